"""Warm agents between runs (an agent lost while idle), and the rendezvous store of each attempt."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from conftest import listening_addresses, parent_pid, wait_gone

import torchrunx as trx
from torchrunx.agent.store import StoreSocket, listen_address

# -- functions run by the workers ------------------------------------------------------------


def who() -> tuple[int, int, int]:
    """(rank, worker pid, agent pid): workers are forked by their agent."""
    return int(os.environ["RANK"]), os.getpid(), os.getppid()


def store_port() -> int:
    return int(os.environ["MASTER_PORT"])


def connect_before_rank_0(folder: str) -> tuple[str, str]:
    """Ranks > 0 reach MASTER_PORT while rank 0 waits for them; what each saw.

    Rank 0 returns only once every other rank has tried, so its process (which serves the
    store) has not joined any group when they connect: only a socket that listens before the
    workers start can accept them.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:
        deadline = time.monotonic() + 30
        while len(list(Path(folder).iterdir())) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return "rank 0", os.environ["TORCHELASTIC_USE_AGENT_STORE"]
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    try:
        socket.create_connection(address, timeout=5).close()
        seen = "accepted"
    except OSError as exc:
        seen = f"{type(exc).__name__}: {exc}"
    Path(folder, str(rank)).write_text(seen)
    return seen, os.environ["TORCHELASTIC_USE_AGENT_STORE"]


def all_reduce_after_connect(folder: str) -> float:
    """Join the group (backend=None: the function does it) after the early connects."""
    import torch
    import torch.distributed as dist

    connect_before_rank_0(folder)
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return total.item()


def fail_first_attempt(folder: str) -> int:
    """Attempt 0 writes its MASTER_PORT and fails on rank 1; attempt 1 returns its port."""
    port = int(os.environ["MASTER_PORT"])
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        Path(folder, f"attempt0-{os.environ['RANK']}").write_text(str(port))
        if os.environ["RANK"] == "1":
            raise ValueError("attempt 0 fails")
        time.sleep(30)  # stopped by the restart
    return port


def rank_0_loses_its_agent() -> None:
    """Rank 0's agent (host 0: the store's host) dies while the others wait on the store."""
    import torch.distributed as dist

    if int(os.environ["RANK"]) == 0:
        time.sleep(1.0)
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)
    dist.barrier()


# -- helpers ---------------------------------------------------------------------------------


def command(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def ssh_session_of(pid: int) -> int:
    """The per-connection ``sshd`` process above ``pid`` (an SSH-started agent)."""
    above = parent_pid(pid)
    while above > 1:
        if command(above).startswith("sshd"):
            return above
        above = parent_pid(above)
    raise AssertionError(f"no sshd above {pid}")


def victim(agent: int, what: str) -> int:
    """The process to SIGKILL to lose ``agent``: itself, its guardian, or its SSH session."""
    if what == "agent":
        return agent
    if what == "guardian":
        return parent_pid(agent)
    return ssh_session_of(agent)


RAISE_WITHIN = 3.0
"""Seconds within which a run on a lost agent must raise (it waited forever before)."""


# -- an agent lost between runs --------------------------------------------------------------


@pytest.mark.parametrize("what", ["agent", "guardian"])
def test_an_agent_killed_between_runs_fails_the_next_run_at_once_naming_it(what):
    with trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend=None).warm() as warm:
        (agent,) = {a for _, _, a in warm.run(who).ranks}
        os.kill(victim(agent, what), signal.SIGKILL)
        wait_gone(agent)
        started = time.monotonic()
        with pytest.raises(trx.AgentFailedError, match="localhost") as caught:
            warm.run(who)
        assert time.monotonic() - started < RAISE_WITHIN
        assert "since the last run" in str(caught.value)
        # What happened: its process (the guardian, which the launcher started, and which ends
        # as its agent did) ended with SIGKILL; for a killed agent, its connection may also be
        # seen closed before the guardian has ended.
        text = str(caught.value)
        assert "SIGKILL" in text or (what == "agent" and "closed unexpectedly" in text), text
        with pytest.raises(trx.AgentFailedError, match="localhost"):
            warm.run(who)  # and again: no run waits on it


@pytest.mark.parametrize("what", ["agent", "guardian"])
def test_an_agent_killed_between_runs_is_replaced_with_restart_on_hosts(what):
    launcher = trx.Launcher(
        hostnames=["localhost"], workers_per_host=2, backend=None, restart_on=("hosts",)
    )
    with launcher.warm() as warm:
        (agent,) = {a for _, _, a in warm.run(who).ranks}
        os.kill(victim(agent, what), signal.SIGKILL)
        wait_gone(agent)
        result = warm.run(who)
        (new_agent,) = {a for _, _, a in result.ranks}
        assert new_agent != agent
        assert [r for r, _, _ in result.ranks] == [0, 1]
        assert {a for _, _, a in warm.run(who).ranks} == {new_agent}


@pytest.mark.cluster
@pytest.mark.parametrize("what", ["agent", "guardian", "ssh"])
def test_an_ssh_agent_lost_between_runs_fails_the_next_run_naming_its_host(cluster, what):
    launcher = trx.Launcher(
        hostnames=cluster.names()[:2],
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
    )
    with launcher.warm() as warm:
        agents = [a for _, _, a in warm.run(who).ranks]
        os.kill(victim(agents[1], what), signal.SIGKILL)
        wait_gone(agents[1])
        started = time.monotonic()
        with pytest.raises(trx.AgentFailedError, match=cluster.names()[1]):
            warm.run(who)
        assert time.monotonic() - started < RAISE_WITHIN


@pytest.mark.cluster
def test_an_ssh_agent_killed_between_runs_is_replaced_with_restart_on_hosts(cluster):
    launcher = trx.Launcher(
        hostnames=cluster.names()[:2],
        workers_per_host=1,
        backend="gloo",
        restart_on=("hosts",),
        ssh_config_file=cluster.ssh_config,
    )
    with launcher.warm() as warm:
        agents = [a for _, _, a in warm.run(who).ranks]
        os.kill(agents[1], signal.SIGKILL)
        wait_gone(agents[1])
        after = [a for _, _, a in warm.run(who).ranks]
        assert after[0] == agents[0]
        assert after[1] != agents[1]


@pytest.mark.cluster
def test_a_link_cut_between_runs_is_noticed_while_idle(cluster):
    host = cluster.names()[1]
    launcher = trx.Launcher(
        hostnames=cluster.names()[:2],
        workers_per_host=1,
        backend=None,
        agent_timeout=2,
        ssh_config_file=cluster.ssh_config,
    )
    with launcher.warm() as warm:
        agents = [a for _, _, a in warm.run(who).ranks]
        cluster.cut_link(host)
        try:
            # The agent stops by itself once the launcher is silent for agent_timeout.
            wait_gone(agents[1], 15)
            started = time.monotonic()
            with pytest.raises(trx.AgentFailedError, match=host) as caught:
                warm.run(who)
            assert time.monotonic() - started < RAISE_WITHIN
            assert "no heartbeat" in str(caught.value) or "closed" in str(caught.value)
        finally:
            cluster.restore_link(host)


# -- the rendezvous store --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["gloo", None])
def test_the_store_accepts_ranks_before_rank_0_runs(tmp_path, backend):
    """With or without torch imported in the agent (backend=None: it is not)."""
    result = trx.launch(
        connect_before_rank_0,
        (str(tmp_path),),
        hostnames=["localhost"],
        workers_per_host=3,
        backend=backend,
    )
    assert result.ranks == [("rank 0", "True"), ("accepted", "True"), ("accepted", "True")]


def test_ranks_that_came_early_join_the_group_rank_0_serves_later(tmp_path):
    """backend=None: rank 0 serves the store once the function imports torch."""
    result = trx.launch(
        all_reduce_after_connect,
        (str(tmp_path),),
        hostnames=["localhost"],
        workers_per_host=2,
        backend=None,
    )
    assert result.ranks == [2.0, 2.0]


@pytest.mark.cluster
def test_the_store_accepts_ranks_of_other_hosts_before_rank_0_runs(cluster, tmp_path):
    result = trx.launch(
        connect_before_rank_0,
        (str(tmp_path),),
        hostnames=cluster.names()[:2],
        workers_per_host=1,
        backend="gloo",
        ssh_config_file=cluster.ssh_config,
    )
    assert result.ranks == [("rank 0", "True"), ("accepted", "True")]


@pytest.mark.cluster
def test_losing_the_stores_host_is_an_agent_failure_naming_it(cluster):
    host = cluster.names()[0]
    started = time.monotonic()
    with pytest.raises(trx.AgentFailedError, match=host):
        trx.launch(
            rank_0_loses_its_agent,
            hostnames=cluster.names()[:2],
            workers_per_host=1,
            backend="gloo",
            ssh_config_file=cluster.ssh_config,
        )
    assert time.monotonic() - started < 50  # not the 60 s sleep, nor the group's timeout


def test_every_run_gets_a_fresh_store_that_ends_with_it():
    with trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo").warm() as warm:
        ports = [warm.run(store_port).ranks for _ in range(3)]
    assert all(len(set(p)) == 1 for p in ports)  # one store per run
    assert len({p[0] for p in ports}) == 3
    for port, _ in ports:
        assert listening_addresses(port) == set()


def test_a_restart_gets_a_fresh_store(tmp_path):
    result = trx.launch(
        fail_first_attempt,
        (str(tmp_path),),
        hostnames=["localhost"],
        workers_per_host=2,
        backend="gloo",
        max_restarts=1,
    )
    first = {p.read_text() for p in tmp_path.glob("attempt0-*")}
    assert len(first) == 1
    assert result.restarts == 1
    assert len(set(result.ranks)) == 1
    assert str(result.ranks[0]) not in first


# -- pure parts ------------------------------------------------------------------------------


def test_the_store_listens_on_loopback_only_when_every_host_is_this_machine():
    assert listen_address(local_only=True) == "127.0.0.1"
    assert listen_address(local_only=False) == ""


def test_a_store_socket_listens_from_the_start_and_each_renewal_is_new():
    store = StoreSocket("127.0.0.1")
    try:
        first = store.port
        assert listening_addresses(first) == {"127.0.0.1"}
        second = store.renew()
        assert second != first
        assert listening_addresses(first) == set()
        assert listening_addresses(second) == {"127.0.0.1"}
        store.handed_over()
        assert listening_addresses(second) == set()
    finally:
        store.close()


SERVE_LATER = """
import socket, sys, datetime
from torchrunx.agent.store import serve_when_torch_imported
sock = socket.create_server(("127.0.0.1", 0))
port = sock.getsockname()[1]
serve_when_torch_imported(sock.detach(), port, 30.0)
assert "torch" not in sys.modules
early = socket.create_connection(("127.0.0.1", port))  # waits in the backlog meanwhile
import torch.distributed as dist
loader = sys.modules["torch"].__spec__.loader
assert type(loader).__name__ != "_ThenLoader", loader
assert sys.modules["torch"].__loader__ is loader
client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
client.set("key", "value")
print(client.get("key").decode())
"""


def test_rank_0_serves_the_store_once_torch_is_imported_and_torch_keeps_its_loader():
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", SERVE_LATER], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "value"


def test_serving_does_not_import_torch_by_itself():
    """A function that never imports torch costs rank 0 nothing."""
    import subprocess

    code = (
        "import socket, sys\n"
        "from torchrunx.agent.store import serve_when_torch_imported\n"
        "sock = socket.create_server(('127.0.0.1', 0))\n"
        "serve_when_torch_imported(sock.detach(), 1, 30.0)\n"
        "import json, email.parser\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
