"""A real multi-node Ray cluster on namespace test hosts, for the Ray engine's tests.

Each node is a test host of :mod:`cluster` (its own network namespace, address and hostname):
``ray start --head`` on the first, ``ray start --address=HEAD:6379`` on the others, each with its
own temporary folder. Ray's daemons run without the test session's marker (they are the
cluster's, not a launch's), and stop with the hosts: stopping the cluster kills every process
in the hosts' namespaces. The benchmarks start one on their own ``"bench"`` hosts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from cluster import ProfileName, TestCluster, TestHost, run_command, start_cluster

if TYPE_CHECKING:
    from collections.abc import Sequence

RAY_PORT = 6379
NODE_CPUS = 2


def ray_unavailable_reason() -> str | None:
    """Why no Ray cluster can be made here (Ray not installed), or ``None``."""
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None:
        return f"Ray is not installed next to {sys.executable} (pip install 'torchrunx[ray]')"
    return None


class RayCluster:
    """Ray running on test hosts: ``hosts.hosts[0]`` is the head node."""

    def __init__(self, hosts: TestCluster, marker: str | None = None) -> None:
        """Describe a cluster on ``hosts``; ``marker``: the variable left out of Ray's environment."""
        self.hosts = hosts
        self.address = f"{hosts.hosts[0].address}:{RAY_PORT}"
        self._marker = marker
        self._ray = str(Path(sys.executable).parent / "ray")

    def _temp_dir(self, host: TestHost) -> str:
        return f"/tmp/trxray-{host.name}"

    def _environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "TORCHRUNX_"))}
        if self._marker:
            env.pop(self._marker.split("=", 1)[0], None)
        return {**env, "RAY_USAGE_STATS_ENABLED": "0"}

    def start_node(self, host: TestHost, *, head: bool = False) -> None:
        """``ray start`` on ``host`` (the head, or a node joining the head)."""
        shutil.rmtree(self._temp_dir(host), ignore_errors=True)
        argv = [
            *self.hosts.enter_argv(host),
            self._ray,
            "start",
            f"--node-ip-address={host.address}",
            f"--num-cpus={NODE_CPUS}",
            "--num-gpus=0",
            "--object-store-memory=100000000",
            "--disable-usage-stats",
            f"--temp-dir={self._temp_dir(host)}",
        ]
        argv += (
            [f"--port={RAY_PORT}", "--head", "--include-dashboard=false"]
            if head
            else [f"--address={self.address}"]
        )
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, env=self._environ(), check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"ray start on {host.name} failed: {done.stdout[-2000:]} {done.stderr[-2000:]}"
            )

    def start(self) -> None:
        """Start the head, then the other nodes at once; wait until every node is alive."""
        self.start_node(self.hosts.hosts[0], head=True)
        with ThreadPoolExecutor(max(1, len(self.hosts.hosts) - 1)) as pool:
            list(pool.map(self.start_node, self.hosts.hosts[1:]))
        self.wait_nodes(len(self.hosts.hosts))

    def alive_nodes(self) -> list[str]:
        """The addresses of the alive nodes, as a fresh driver sees them (in a subprocess)."""
        code = (
            f"import ray,json;ray.init(address={self.address!r},logging_level='ERROR',log_to_driver=False);"
            "print(json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
        )
        return _json(self.driver(code))

    def wait_nodes(self, count: int, timeout: float = 60.0) -> None:
        """Wait until ``count`` nodes are alive."""
        deadline = time.monotonic() + timeout
        while len(self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Ray cluster does not have {count} alive nodes in {timeout} s"
                )
            time.sleep(0.5)

    def leftovers(self) -> dict[str, list[str]]:
        """Alive actors and placement groups not removed, as a fresh driver sees them."""
        code = (
            f"import ray,json;ray.init(address={self.address!r},logging_level='ERROR',log_to_driver=False)\n"
            "import ray._private.state as s\n"
            "actors=[v.get('Name') or k for k,v in s.actors().items() if v['State']!='DEAD']\n"
            "groups=[k for k,v in ray.util.placement_group_table().items() if v['state']!='REMOVED']\n"
            "print(json.dumps({'actors':actors,'placement_groups':groups}))"
        )
        return _json(self.driver(code))

    def driver(self, code: str) -> str:
        """Run ``code`` in a new Python process (a Ray driver of its own) and return its stdout."""
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the Ray driver failed: {done.stderr[-3000:]}")
        return done.stdout

    def node_processes(self, host: TestHost) -> list[int]:
        """Pids in ``host``'s namespace other than its ``sshd``: Ray's and what Ray started."""
        sshd = self.hosts.enter_argv(host)[2]
        pids = run_command(["ip", "netns", "pids", host.netns], check=False).stdout.split()
        return [int(p) for p in pids if p != sshd]

    def kill_node(self, host: TestHost) -> None:
        """SIGKILL every process of ``host`` but its sshd: the node dies, as a crashed machine's."""
        for pid in self.node_processes(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Stop every process in the hosts and remove them, and Ray's temporary folders."""
        self.hosts.stop()
        for host in self.hosts.hosts:
            shutil.rmtree(self._temp_dir(host), ignore_errors=True)


def _json(text: str) -> object:
    import json

    return json.loads(text.strip().splitlines()[-1])


def start_ray_cluster(
    n: int, workdir: Path, profile: ProfileName = "ray", marker: str | None = None
) -> RayCluster:
    """Start ``n`` test hosts of ``profile`` and a Ray cluster on them (the first is the head)."""
    hosts = start_cluster(n, workdir, profile)
    cluster = RayCluster(hosts, marker)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def nodes_of(cluster: RayCluster) -> Sequence[TestHost]:
    """The test hosts under the Ray nodes, head first."""
    return cluster.hosts.hosts
