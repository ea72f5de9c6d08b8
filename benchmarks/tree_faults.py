"""An interior host of a tree start lost mid-run, on 32 or more bench test hosts.

Usage::

    python benchmarks/tree_faults.py [--hosts 32] [--radix 8] [--victim 1]
        [--faults kill cut kill+policy cut+policy] [--agent-timeout 5]

One cluster of ``--hosts`` bench test hosts (``tests/cluster.py``'s ``bench`` profile); for
each fault, one launch of a function that says it runs and then sleeps (``backend=None``, 1
worker per host, ``tree_radix=--radix``). Once every rank runs, interior host ``--victim``
(a host the launcher starts, which starts its own children) is lost:

- ``kill``: every process of that host but its ``sshd`` is SIGKILLed (its relay, agent and
  workers: its SSH session to the launcher ends);
- ``cut``: its link is cut (its root-side veth down): its SSH session does not end, its
  subtree falls silent, and ``agent_timeout`` tells;
- ``+policy``: the last 2 hosts are ``spare_hosts`` and ``min_hosts`` is 20 with one restart
  for ``"hosts"``: the lost subtree is quarantined, the spares take the first places, and the
  hosts left go on; the second attempt returns at once.

Prints, for each: the seconds from the fault to the launch's error or result, the error's host,
the hosts it names as lost through the victim (every one of its children must be), the world
after the restart (``+policy``), and what was left running on any host 40 s later at most
(``nothing`` is the only right answer).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import testhosts  # noqa: F401 (first: it puts tests/ on the path, for cluster and conftest)
from cluster import TestCluster, TestHost, start_cluster
from conftest import escaped_processes, torchrunx_processes

import torchrunx as trx
from torchrunx.launcher.starts.tree import tree_children

SPARES = 2
MIN_HOSTS = 20


def runs_then_sleeps(folder: str) -> int:
    """Attempt 0: say this rank runs, then sleep; a later attempt returns the world's size."""
    if os.environ.get("TORCHRUNX_RESTART_COUNT", "0") != "0":
        return int(os.environ["WORLD_SIZE"])
    Path(folder, os.environ["RANK"]).touch()
    time.sleep(120)
    return 0


def _lose(cluster: TestCluster, host: TestHost, how: str) -> None:
    if how == "cut":
        cluster.cut_link(host)
        return
    sshd = cluster._daemons[host.name].pid  # noqa: SLF001 (its sshd stays: the host is up)
    pids = subprocess.run(
        ["ip", "netns", "pids", host.netns],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    for pid in map(int, pids):
        if pid != sshd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def one_fault(
    cluster: TestCluster, fault: str, radix: int, victim: int, agent_timeout: float
) -> None:
    """One launch, the victim lost once every rank runs; prints what the launch said."""
    how, _, policy = fault.partition("+")
    names = cluster.names()
    extra: dict[str, Any] = {}
    if policy:
        names, spares = names[:-SPARES], names[-SPARES:]
        extra = {
            "spare_hosts": tuple(spares),
            "min_hosts": MIN_HOSTS,
            "max_restarts": 1,
            "restart_on": ("hosts",),
        }
    host = cluster.hosts[victim]
    children = tree_children(victim, radix, len(names))
    lost_at: list[float] = []
    with tempfile.TemporaryDirectory() as folder:

        def lose_when_all_run() -> None:
            deadline = time.monotonic() + 120
            while len(list(Path(folder).iterdir())) < len(names) and time.monotonic() < deadline:
                time.sleep(0.05)
            lost_at.append(time.monotonic())
            _lose(cluster, host, how)

        thread = threading.Thread(target=lose_when_all_run, daemon=True)
        thread.start()
        outcome = ""
        try:
            result = trx.launch(
                runs_then_sleeps,
                func_args=(folder,),
                hostnames=names,
                workers_per_host=1,
                backend=None,
                ssh_config_file=cluster.ssh_config,
                tree_radix=radix,
                agent_timeout=agent_timeout,
                log_handlers=[],
                **extra,
            )
            took = time.monotonic() - lost_at[0]
            outcome = (
                f"returned {took:.1f} s after the fault, restarts {result.restarts}, "
                f"world {sorted(set(result.ranks))} hosts, "
                f"{sum('quarantined' in c for c in result.world_changes)} quarantined"
            )
        except trx.AgentFailedError as error:
            took = time.monotonic() - lost_at[0]
            text = str(error) + "\n".join(getattr(error, "__notes__", []))
            named = [i for i in children if f"{names[i]} (host index {i})" in text]
            outcome = (
                f"raised {took:.1f} s after the fault, on host {error.hostname} "
                f"(victim {host.name}); children named: {len(named)} of "
                f"{len(children)}"
            )
        finally:
            if how == "cut":
                cluster.restore_link(host)
            thread.join(130)
    deadline = time.monotonic() + 40
    while (torchrunx_processes() or escaped_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = torchrunx_processes() + escaped_processes()
    print(f"{fault:>11}: {outcome}; left running: {left or 'nothing'}", flush=True)


def main() -> None:
    """Parse the arguments, make the hosts, lose the victim once per fault."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=32)
    parser.add_argument("--radix", type=int, default=8)
    parser.add_argument("--victim", type=int, default=1, help="an interior host's index")
    parser.add_argument("--faults", nargs="+", default=["kill", "cut", "kill+policy", "cut+policy"])
    parser.add_argument("--agent-timeout", type=float, default=5.0)
    args = parser.parse_args()
    if not 0 <= args.victim < args.radix:
        parser.error(f"--victim must be an interior host: 0 to {args.radix - 1}")
    with tempfile.TemporaryDirectory() as work_dir:
        cluster = start_cluster(args.hosts, Path(work_dir), profile="bench")
        try:
            for fault in args.faults:
                one_fault(cluster, fault, args.radix, args.victim, args.agent_timeout)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
