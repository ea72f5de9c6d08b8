"""Another user of a relaying host floods its relay: the launch still succeeds (issue #42).

The launcher runs with 1,024 descriptors (a login's default) and ``relay="on"``. On the second
SSH test host, the other user (tests/attacker.py) opens 900 idle connections to the relay's
loopback port while the ranks run, and holds them until the launch has ended. Before the fix,
every such connection cost the launcher a socket pair until the attacker closed it; at the limit
``socketpair()`` failed, and that failure ended every channel of the host: the launch failed.
While the flood is held, neither end keeps what it refused: the host's relay holds only the
connections the launcher still authenticates, and the launcher their socket pairs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from attacker import as_attacker, shared_folder
from conftest import torchrunx_processes

from torchrunx.launcher.net.listener import RELAYED_PENDING

ROOT = Path(__file__).resolve().parent.parent

LAUNCH = r"""
import os, resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
import torchrunx as trx

def relay_port_then_sum(folder):
    import torch
    import torch.distributed as dist

    if int(os.environ["RANK"]) == 1:  # on the second host: find its relay's port, as root can
        pid = os.getppid()
        while b"torchrunx.agent.relay" not in open(f"/proc/{pid}/cmdline", "rb").read():
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")}
        rows = [line.split() for line in open("/proc/net/tcp").readlines()[1:]]
        port = next(int(r[1].split(":")[1], 16) for r in rows if r[3] == "0A" and r[9] in inodes)
        with open(f"{folder}/port.tmp", "w") as f:
            f.write(f"{port} {pid}")
        os.replace(f"{folder}/port.tmp", f"{folder}/port")
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{folder}/go") and time.monotonic() < deadline:
            time.sleep(0.05)  # held while the other user floods the relay
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return total.item()

folder, hosts, config = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
result = trx.launch(relay_port_then_sum, (folder,), hostnames=hosts, workers_per_host=1,
                    backend="gloo", ssh_config_file=config, relay="on")
print("RESULTS", result.ranks, flush=True)
"""

FLOOD = r"""
import os, socket, sys
port, count, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
held, failed = [], 0
for _ in range(count):
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        held.append(sock)
    except OSError:
        failed += 1
with open(ready + ".tmp", "w") as f:  # whole when the test sees it
    f.write(f"{len(held)} {failed}")
os.replace(ready + ".tmp", ready)
sys.stdin.read()  # held until the test says so
"""


def _backlog(cluster, host: str, port: int) -> int:
    """Connections waiting to be accepted on ``host``'s listening ``port`` (its ``rx_queue``)."""
    table = cluster.run_on(host, ["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]
    for row in (line.split() for line in table):
        if row[3] == "0A" and int(row[1].split(":")[1], 16) == port:
            return int(row[4].split(":")[1], 16)
    return 0


def _sockets(pid: int) -> int:
    """Sockets process ``pid`` holds."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def _wait_for(path: Path, process: subprocess.Popen[str], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path.name} did not come"
        time.sleep(0.05)
    return path.read_text()


@pytest.mark.cluster
def test_another_users_flood_at_a_relaying_host_leaves_a_launch_with_1024_descriptors_whole(
    cluster, tmp_path
):
    hosts = cluster.names()
    with shared_folder() as folder:
        launcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, str(folder), ",".join(hosts), str(cluster.ssh_config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=tmp_path,
        )
        flood = None
        try:
            port, relay = _wait_for(folder / "port", launcher).split()
            flood = subprocess.Popen(
                [
                    *cluster.enter_argv(hosts[1]),
                    *as_attacker(["python3", "-c", FLOOD, port, "900", str(folder / "ready")]),
                ],
                stdin=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            held = _wait_for(folder / "ready", launcher)
            assert int(held.split()[0]) > 0, held  # the relay took connections from them
            # Every one accepted by the relay (its OPEN frames then come before the result).
            deadline = time.monotonic() + 60
            while _backlog(cluster, hosts[1], int(port)) > 0:
                assert launcher.poll() is None, launcher.communicate()
                assert time.monotonic() < deadline, "the relay did not accept the flood"
                time.sleep(0.05)
            # Neither side keeps what it refused: the relay holds the connections the launcher
            # still authenticates (RELAYED_PENDING at most) and the launcher their pairs.
            while not (
                _sockets(int(relay)) <= RELAYED_PENDING + 8
                and len(os.listdir(f"/proc/{launcher.pid}/fd")) < 512
            ):
                assert launcher.poll() is None, launcher.communicate()
                assert time.monotonic() < deadline, (_sockets(int(relay)), launcher.pid)
                time.sleep(0.05)
            (folder / "go").touch()
            out, err = launcher.communicate(timeout=120)
            assert launcher.returncode == 0, err
            assert out.splitlines()[-1] == "RESULTS [2.0, 2.0]"
        finally:
            if flood is not None:
                _, said = flood.communicate(timeout=30)  # its stdin closes: it lets go
                assert flood.returncode == 0, said
            launcher.kill()
            launcher.communicate()
            deadline = time.monotonic() + 30  # the agents end, too (also when the test failed)
            while torchrunx_processes() and time.monotonic() < deadline:
                time.sleep(0.1)
    assert torchrunx_processes() == []
