"""Relayed launches: hosts that cannot open a connection back to the launcher (``relay=``).

A firewall rule (``iptables``, in the root namespace, where the launcher runs) drops every new
TCP connection from the test hosts to the launcher's address: SSH still works (the launcher
connects out), but an agent or worker that connects back never gets an answer.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest
from conftest import listened_during_launch, wait_gone

import torchrunx as trx

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.cluster


@contextlib.contextmanager
def connections_back_dropped(cluster) -> Iterator[None]:
    """New TCP connections from the test hosts to the launcher's address: dropped."""
    if shutil.which("iptables") is None:
        pytest.fail("iptables is needed (scripts/test.sh installs it)")
    subnet = cluster.hosts[0].address.rsplit(".", 1)[0]
    rule = [
        "INPUT", "-s", f"{subnet}.0/24", "-d", f"{subnet}.1", "-p", "tcp", "--syn", "-j", "DROP",
    ]  # fmt: skip
    subprocess.run(["iptables", "-w", "-I", *rule], check=True)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-w", "-D", *rule], check=True)


def _host_sum(size: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} summed {total.item()}", flush=True)
    return {
        "host": socket.gethostname(),
        "rank": int(os.environ["RANK"]),
        "sum": total.item(),
        "blob": bytes(range(256)) * (size // 256),
    }


def test_relay_on_runs_where_hosts_cannot_connect_back(cluster, capfd):
    with connections_back_dropped(cluster):
        started = time.monotonic()
        result = trx.launch(
            _host_sum,
            func_args=(1 << 20,),
            hostnames=cluster.names(),
            workers_per_host=[1, 2],
            backend="gloo",
            ssh_config_file=cluster.ssh_config,
            relay="on",
        )
        took = time.monotonic() - started
    node1, node2 = cluster.names()
    assert [r["host"] for r in result.ranks] == [node1, node2, node2]
    assert [r["rank"] for r in result.ranks] == [0, 1, 2]
    assert all(r["sum"] == 3.0 for r in result.ranks)
    assert all(r["blob"] == bytes(range(256)) * 4096 for r in result.ranks)
    assert took < 30, took
    assert f"[{node1}:0] rank 0 summed 3.0" in capfd.readouterr().out  # logs come relayed too


def test_without_relay_a_host_that_cannot_connect_back_fails_naming_the_option(cluster):
    with connections_back_dropped(cluster), pytest.raises(trx.AgentFailedError) as info:
        trx.launch(
            _host_sum,
            func_args=(256,),
            hostnames=cluster.names(),
            workers_per_host=1,
            backend="gloo",
            ssh_config_file=cluster.ssh_config,
            agent_timeout=2,
            start_timeout=60,
        )
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "cannot reach the launcher" in text, text
    assert "relay='auto'" in text, text
    assert "start timeout" not in text.lower(), text


def test_something_else_on_a_relaying_agents_stdout_fails_its_host_at_once(cluster, tmp_path):
    from conftest import torchrunx_processes

    env_file = tmp_path / "noisy.sh"
    env_file.write_text("echo 'welcome to the cluster, have a nice day'\n")
    started = time.monotonic()
    with pytest.raises(trx.AgentFailedError) as info:
        trx.launch(
            _host_sum,
            func_args=(256,),
            hostnames=cluster.names()[:1],
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
            env_file=env_file,
            relay="on",
            start_timeout=60,
        )
    took = time.monotonic() - started
    text = str(info.value)
    assert info.value.hostname == cluster.names()[0]
    assert "the relay's stream is broken" in text, text
    assert "welcome to the" in text, text  # what the stream began with
    assert "did something else write to the agent's stdout?" in text, text
    assert "start timeout" not in text.lower(), text
    assert took < 20, took
    deadline = time.monotonic() + 10
    while torchrunx_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not torchrunx_processes()


def test_relay_auto_relays_only_the_hosts_that_cannot_connect_back(cluster, capfd):
    # Without the rule, auto connects back (no relay message); with it, the hosts relay.
    fields = {
        "hostnames": cluster.names(),
        "workers_per_host": 1,
        "backend": "gloo",
        "ssh_config_file": cluster.ssh_config,
        "relay": "auto",
    }
    direct = trx.launch(_host_sum, func_args=(256,), **fields)
    assert [r["sum"] for r in direct.ranks] == [1.0, 1.0]
    assert "relayed" not in capfd.readouterr().out  # the relay says so when it relays
    with connections_back_dropped(cluster):
        relayed = trx.launch(_host_sum, func_args=(256,), **fields)
    assert [r["host"] for r in relayed.ranks] == cluster.names()
    assert [r["sum"] for r in relayed.ranks] == [1.0, 1.0]
    said = capfd.readouterr()
    # The console shows rank 0's host (node2's line is in its log file).
    assert (
        f"[{cluster.names()[0]}] torchrunx relay: this host cannot connect to the launcher"
        in said.out
    ), said
    assert "its connections are relayed over the agent's channel" in said.out, said


def _die_on(rank: int) -> None:
    import signal

    if int(os.environ["RANK"]) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def _raise_on(rank: int) -> None:
    if int(os.environ["RANK"]) == rank:
        raise KeyError("relayed")
    time.sleep(120)


@pytest.mark.parametrize("fault", ["sigkill", "raise"])
def test_relayed_faults_are_reported_like_direct_ones(cluster, fault):
    func, expected = (
        (_die_on, trx.WorkerFailedError) if fault == "sigkill" else (_raise_on, KeyError)
    )
    started = time.monotonic()
    with connections_back_dropped(cluster), pytest.raises(expected) as info:
        trx.launch(
            func,
            func_args=(2,),
            hostnames=cluster.names(),
            workers_per_host=[1, 2],
            backend=None,
            ssh_config_file=cluster.ssh_config,
            relay="on",
        )
    assert time.monotonic() - started < 60
    if fault == "sigkill":
        assert (info.value.hostname, info.value.rank) == (cluster.names()[1], 2)
        assert "SIGKILL" in str(info.value)
    else:
        assert info.value.args == ("relayed",)


def _kill_agent_on_node2() -> None:
    import signal

    if os.environ["GROUP_RANK"] == "1":  # the second host
        os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(120)


def test_a_relayed_agent_killed_mid_run_is_an_agent_failed_error(cluster):
    with connections_back_dropped(cluster), pytest.raises(trx.AgentFailedError) as info:
        trx.launch(
            _kill_agent_on_node2,
            hostnames=cluster.names(),
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
            relay="on",
        )
    assert info.value.hostname == cluster.names()[1]


def _rank_and_pid() -> tuple[int, int]:
    return int(os.environ["RANK"]), os.getpid()


def test_warm_relayed_agents_run_again_and_stop(cluster):
    launcher = trx.Launcher(
        hostnames=cluster.names(),
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
        relay="on",
    )
    with connections_back_dropped(cluster), launcher.warm(keep_workers=True) as warm:
        first = warm.run(_rank_and_pid)
        second = warm.run(_rank_and_pid)
    assert [r for r, _ in first.ranks] == [0, 1]
    assert first.ranks == second.ranks  # the same workers ran both


def test_relay_values_are_checked():
    with pytest.raises(ValueError, match="relay='yes'"):
        trx.Launcher(relay="yes").validate()  # type: ignore[arg-type]


def test_relay_on_listens_on_loopback_only(cluster, listen_sockets):
    # Every remote connection comes over the agents' channels: nothing else need listen.
    bound, result = listened_during_launch(
        listen_sockets,
        _rank,
        hostnames=cluster.names(),
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
        relay="on",
    )
    assert bound == {"127.0.0.1"}
    assert result.ranks == [0, 1]


def _rank() -> int:
    return int(os.environ["RANK"])


SRUN_SCRIPT = """
import os, socket
import torchrunx as trx

def where():
    import torch
    import torch.distributed as dist

    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return socket.gethostname(), int(os.environ["RANK"]), total.item()

result = trx.Launcher(agent_start="srun", relay="on", workers_per_host=1, backend="gloo").run(where)
print("ranks", result.ranks, flush=True)
"""


@pytest.mark.slurm
def test_relay_over_srun_steps(slurm, tmp_path):
    # The launcher runs on snode1 (the batch step), in its own network namespace: there a
    # rule drops new connections to its port, so snode2's agent (an srun step) relays.
    script = tmp_path / "relay.py"
    script.write_text(SRUN_SCRIPT)
    netns = slurm.ssh.hosts[0].netns
    rule = ["INPUT", "!", "-i", "lo", "-p", "tcp", "--dport", "29433", "--syn", "-j", "DROP"]
    subprocess.run(["ip", "netns", "exec", netns, "iptables", "-w", "-I", *rule], check=True)
    try:
        result = slurm.sbatch(
            f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}\n",
            nodes=2,
            env={"TORCHRUNX_LAUNCHER_PORT": "29433"},
            extra_args=["--ntasks-per-node=1"],
        )
    finally:
        subprocess.run(["ip", "netns", "exec", netns, "iptables", "-w", "-D", *rule], check=True)
    assert result.exit_code == 0, result.stderr
    assert "ranks [('snode1', 0, 2.0), ('snode2', 1, 2.0)]" in result.stdout, result


def _relay_and_agent_pids() -> tuple[int, int]:
    """In a worker: its host's relay and its agent."""
    return _relay_pid(), os.getppid()


def _relay_pid() -> int:
    """In a worker: its host's relay (above its agent and the agent's guardian)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"torchrunx.agent.relay" in f.read():
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise LookupError("no relay above this worker")


def test_a_relay_killed_between_warm_runs_fails_the_next_run_naming_its_host(cluster):
    import signal

    launcher = trx.Launcher(
        hostnames=cluster.names(),
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
        relay="on",
    )
    with launcher.warm() as warm:
        relays = warm.run(_relay_and_agent_pids).ranks
        os.kill(relays[1][0], signal.SIGKILL)
        wait_gone(relays[1][1], 30)  # its agent sees the end of its stdin, and stops: between runs
        with pytest.raises(trx.AgentFailedError) as info:
            warm.run(_rank)
    assert info.value.hostname == cluster.names()[1]


def _flood_my_relay_then_sum(connections: int) -> float:
    """On host 1: open ``connections`` idle connections and a few of garbage to the relay."""
    import torch
    import torch.distributed as dist

    if int(os.environ["RANK"]) == 1:
        relay = _relay_pid()
        inodes = set()
        for fd in os.listdir(f"/proc/{relay}/fd"):
            target = os.readlink(f"/proc/{relay}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        with open("/proc/net/tcp") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        port = next(int(r[1].split(":")[1], 16) for r in rows if r[3] == "0A" and r[9] in inodes)
        held = []
        for index in range(connections):
            sock = socket.create_connection(("127.0.0.1", port))
            if index % 10 == 0:
                sock.sendall(os.urandom(4096))
            held.append(sock)
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return total.item()


def test_a_flood_at_a_hosts_relay_does_not_stall_the_launch(cluster):
    started = time.monotonic()
    result = trx.launch(
        _flood_my_relay_then_sum,
        func_args=(300,),
        hostnames=cluster.names(),
        workers_per_host=1,
        backend="gloo",
        ssh_config_file=cluster.ssh_config,
        relay="on",
    )
    assert result.ranks == [2.0, 2.0]
    assert time.monotonic() - started < 30


def test_breakpoint_on_a_relaying_host_opens_pdb_in_the_launchers_terminal(cluster, tmp_path):
    from test_debugger import SCRIPT, _closing, _finish, _prompt, _spawn

    hosts = cluster.names()
    text = SCRIPT.replace("backend=None,", "backend=None, relay='on',")
    with (
        connections_back_dropped(cluster),
        _closing(
            _spawn(tmp_path, ",".join(hosts), "3", str(cluster.ssh_config), text=text)
        ) as child,
    ):
        child.expect(_prompt(3, hosts[1]))
        child.sendline("p value, os.environ['LOCAL_RANK']")
        child.expect(_prompt(3, hosts[1]))
        assert "(44, '1')" in str(child.before)
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 43, 44, 45]"))
        _finish(child)
        assert child.exitstatus == 0
