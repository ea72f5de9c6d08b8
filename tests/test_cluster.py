"""Launches over real SSH on the namespace test hosts (``cluster.names()``: node1, node2)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import time

import pytest
from conftest import (
    listened_during_launch,
    torchrunx_processes,
    touch_then_sleep,
    when_file_appears,
)

import torchrunx as trx
from torchrunx.events import WorkerState, WorkerStateChanged

pytestmark = pytest.mark.cluster


def where_am_i() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {
        "host": socket.gethostname(),
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "groups": int(os.environ["GROUP_WORLD_SIZE"]),
        "role": (os.environ["ROLE_NAME"], os.environ["ROLE_RANK"], os.environ["ROLE_WORLD_SIZE"]),
        "sum": total.item(),
    }


def test_two_hosts_over_ssh_with_uneven_workers(cluster):
    result = trx.launch(
        where_am_i,
        hostnames=cluster.names(),
        workers_per_host=[1, 2],
        backend="gloo",
        ssh_config_file=cluster.ssh_config,
    )
    node1, node2 = cluster.names()
    assert [r["host"] for r in result.ranks] == [node1, node2, node2]
    assert [(r["rank"], r["local_rank"], r["group_rank"]) for r in result.ranks] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 1),
    ]
    assert all(r["world"] == 3 and r["sum"] == 3.0 for r in result.ranks)
    assert [r["local_world"] for r in result.ranks] == [1, 2, 2]
    assert all(r["groups"] == 2 for r in result.ranks)  # torchrun's GROUP_WORLD_SIZE: hosts
    assert [r["role"] for r in result.ranks] == [("default", str(i), "3") for i in range(3)]
    assert result.index(node2, 1)["rank"] == 2
    assert list(result.results) == [node1, node2]


def test_localhost_and_remote_hosts_in_one_group(cluster):
    result = trx.launch(
        where_am_i,
        hostnames=["localhost", *cluster.names()],
        workers_per_host=1,
        backend="gloo",
        ssh_config_file=cluster.ssh_config,
    )
    assert [r["host"] for r in result.ranks] == [socket.gethostname(), *cluster.names()]
    assert all(r["sum"] == 3.0 for r in result.ranks)


class RemoteError(Exception):
    pass


def fail_on_node2() -> None:
    import torch.distributed as dist

    if os.environ["GROUP_RANK"] == "1":  # the second host
        raise RemoteError(f"failed on {socket.gethostname()}")
    dist.barrier()


def test_remote_exception_keeps_type_and_names_the_host(cluster):
    started = time.monotonic()
    node2 = cluster.names()[1]
    with pytest.raises(RemoteError, match=f"failed on {node2}") as info:
        trx.launch(
            fail_on_node2,
            hostnames=cluster.names(),
            workers_per_host=1,
            backend="gloo",
            ssh_config_file=cluster.ssh_config,
            timeout=120,
        )
    assert any(f"host '{node2}'" in note and "rank 1" in note for note in info.value.__notes__)
    assert time.monotonic() - started < 60  # node1 waited in barrier(); it was stopped


def kill_my_agent_on_node2() -> None:
    if os.environ["GROUP_RANK"] == "1":  # the second host
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(120)


def test_agent_killed_mid_run_is_an_agent_failed_error(cluster):
    started = time.monotonic()
    node2 = cluster.names()[1]
    with pytest.raises(trx.AgentFailedError, match=f"agent on host '{node2}' failed") as info:
        trx.launch(
            kill_my_agent_on_node2,
            hostnames=cluster.names(),
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
        )
    assert info.value.hostname == node2
    assert time.monotonic() - started < 60


def test_worker_sigkill_on_a_remote_host(cluster):
    def die() -> None:
        if os.environ["RANK"] == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)

    with pytest.raises(trx.WorkerFailedError, match="SIGKILL") as info:
        trx.launch(
            die,
            hostnames=cluster.names(),
            workers_per_host=[1, 2],
            backend=None,
            ssh_config_file=cluster.ssh_config,
        )
    assert (info.value.hostname, info.value.rank, info.value.local_rank) == (
        cluster.names()[1],
        2,
        1,
    )


def die_on_node2(how: str) -> None:
    import ctypes
    import sys

    if os.environ["GROUP_RANK"] == "1":  # the second host
        if how == "segfault":
            ctypes.string_at(0)
        sys.exit(3)
    time.sleep(120)


@pytest.mark.parametrize(
    ("how", "described"), [("segfault", "signal 11 (SIGSEGV)"), ("exit", "exit code 3")]
)
def test_remote_worker_death(cluster, how, described):
    started = time.monotonic()
    with pytest.raises(trx.WorkerFailedError, match=re.escape(described)) as info:
        trx.launch(
            die_on_node2,
            (how,),
            hostnames=cluster.names(),
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
        )
    assert (info.value.hostname, info.value.rank) == (cluster.names()[1], 1)
    assert time.monotonic() - started < 60  # node1 sleeps 120 s: it was stopped


def test_unreachable_host_fails_quickly_with_the_reason(cluster):
    unreachable = cluster.profile.unreachable_name
    address = re.escape(cluster.profile.unreachable_address)
    started = time.monotonic()
    with pytest.raises(
        trx.AgentFailedError,
        match=rf"cannot connect to root@{address}:22: no answer in \d+ s \(ConnectTimeout\); "
        r"is the host up and reachable\?",
    ) as info:
        trx.launch(
            print,
            hostnames=[cluster.names()[0], unreachable],
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
        )
    assert info.value.hostname == unreachable
    assert time.monotonic() - started < 30  # ConnectTimeout 2 s in the test ssh config


def test_wrong_key_is_refused_with_the_reason(cluster):
    address = re.escape(cluster.hosts[0].address)
    with pytest.raises(
        trx.AgentFailedError, match=rf"SSH authentication failed for root@{address}:22"
    ):
        trx.launch(
            print,
            hostnames=cluster.names()[:1],
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.bad_key_ssh_config,
        )


def test_missing_interpreter_is_a_clear_error(cluster, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python3")
    with pytest.raises(trx.AgentFailedError, match=r"Launcher\(python=\.\.\.\)") as info:
        trx.launch(
            print,
            hostnames=cluster.names()[:1],
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
        )
    assert "exit status 127" in str(info.value)
    assert "no Python interpreter /nonexistent/bin/python3 on this host" in info.value.stderr


def test_no_secret_or_environment_value_on_any_command_line(cluster, monkeypatch):
    monkeypatch.setenv("TORCH_SECRET_TOKEN", "hunter2-value-that-must-not-leak")

    def scan_command_lines(session: int) -> list[str]:
        # Every process of this test session: below its pytest process (the launcher, ssh, the
        # hosts' sshd and what they start). Other processes of the machine (another pytest-xdist
        # worker's launches and containers) may show other 64-hex-digit strings.
        parents = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])

        def below_session(pid: int) -> bool:
            while pid > 1 and pid != session:
                pid = parents.get(pid, 0)
            return pid == session

        leaks = []
        for pid in filter(below_session, parents):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            # The value itself, or anything shaped like the launch secret (64 hex digits).
            if b"hunter2" in cmdline or re.search(rb"[0-9a-f]{64}", cmdline):
                leaks.append(cmdline.decode(errors="replace"))
        assert os.environ["TORCH_SECRET_TOKEN"].startswith("hunter2")
        return leaks

    result = trx.launch(
        scan_command_lines,
        (os.getpid(),),
        hostnames=cluster.names(),
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
    )
    assert result.ranks == [[], []]


@pytest.mark.parametrize("relay", ["off", "on"])
def test_cut_link_is_noticed_within_agent_timeout(cluster, tmp_path, relay):
    # The link is cut once the launcher has heard that rank 1 runs (not after a guessed
    # delay, nor when rank 1 runs: its agent's word of it may still be on the way, and until it
    # comes the launcher waits start_timeout for that agent's workers, not agent_timeout).
    host = cluster.hosts[1]
    heard = tmp_path / "heard"

    def on_event(event: object) -> None:
        if isinstance(event, WorkerStateChanged) and (event.rank, event.new) == (
            1,
            WorkerState.HEALTHY,
        ):
            heard.touch()

    started = time.monotonic()
    try:
        with (
            when_file_appears(heard, lambda: cluster.cut_link(host)),
            pytest.raises(trx.AgentFailedError, match="no heartbeat for") as info,
        ):
            trx.launch(
                _touch_rank_then_sleep,
                func_args=(str(tmp_path),),
                hostnames=cluster.names(),
                workers_per_host=1,
                backend=None,
                ssh_config_file=cluster.ssh_config,
                agent_timeout=2,
                relay=relay,
                event_handlers=[on_event],
            )
        assert info.value.hostname == host.name
        assert time.monotonic() - started < 25
    finally:
        cluster.restore_link(host)
    # Cut off, the agent notices the silence too and stops its workers by itself (and its relay
    # ends with it): nothing is left on the host (the autouse check after the test).
    deadline = time.monotonic() + 30
    while torchrunx_processes() and time.monotonic() < deadline:
        time.sleep(0.2)


def _touch_rank_then_sleep(folder: str) -> None:
    touch_then_sleep(os.path.join(folder, os.environ["RANK"]), 30)


@pytest.mark.parametrize("configured", [True, False])
def test_the_launcher_listens_where_the_hosts_reach_it(
    cluster, monkeypatch, configured, listen_sockets
):
    # launcher_address set to an address of this machine: that address only; else every
    # interface (each SSH connection tells its agent which address to use).
    monkeypatch.delenv("TORCHRUNX_LAUNCHER_ADDR", raising=False)
    found, result = listened_during_launch(
        listen_sockets,
        socket.gethostname,
        hostnames=cluster.names(),
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
        launcher_address=cluster.launcher_address if configured else None,
    )
    bound = [found]
    assert result.ranks == cluster.names()
    if configured:
        assert bound == [{cluster.launcher_address}]
    else:
        assert len(bound[0]) == 1
        assert bound[0] <= {"::", "0.0.0.0"}  # noqa: S104 (every interface)
