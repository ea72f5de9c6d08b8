"""A lost host, a frozen host and a preemption, timed: median and slowest of several runs.

Usage::

    python benchmarks/resilience.py [--runs 5] [--agent-timeout 2]

On this machine and 3 bench test hosts (``bnode1``-``bnode3``, SSH): a launch on ``localhost``,
``bnode1`` and ``bnode2`` with ``bnode3`` as its spare (one gloo worker each, their process
group used in every attempt), ``--runs`` times each:

- **cut link**: once every rank runs, ``bnode1``'s link is cut (``ip link set ... down``):
  from the cut to the function's start on the spare in the next attempt (target:
  ``agent_timeout`` + 2 s);
- **frozen host**: ``bnode2``'s worker SIGSTOPs its agent and itself: from the freeze to the
  ``HostQuarantined`` event (target: ``agent_timeout`` + 1 s);
- **preemption**: SIGTERM to a launcher process (3 ranks over SSH, 30 s of grace), whose ranks
  return as soon as they are told: from the signal to every rank's checkpoint written, and to
  the launcher's exit (``Preempted``, exit status 143).

The floor of the first two is ``agent_timeout`` itself: a host that says nothing cannot be
told apart from a slow one sooner. Where every host is this machine's, SSH hosts included,
the figures are what this machine allows; a real cluster adds its network's round trips.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cluster import TestCluster, cluster_unavailable_reason, start_cluster  # noqa: E402

import torchrunx as trx  # noqa: E402
import torchrunx.events as ev  # noqa: E402


def work(folder: str, attempt_0: str) -> int:
    """Write when each rank starts; in attempt 0, wait (``cut``) or freeze rank 2's host."""
    import torch  # noqa: PLC0415 (in the workers only)
    import torch.distributed as dist  # noqa: PLC0415

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    Path(f"{folder}/start-{attempt}-{rank}").write_text(repr(time.time()))
    if attempt == 0 and attempt_0 == "freeze" and rank == 2:
        Path(f"{folder}/frozen").write_text(repr(time.time()))
        os.kill(os.getppid(), signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)
    if attempt == 0:
        time.sleep(120)
    total = torch.tensor([1])
    dist.all_reduce(total)
    return int(total)


def _launch(
    cluster: TestCluster, folder: Path, attempt_0: str, agent_timeout: float
) -> list[ev.Event]:
    seen: list[ev.Event] = []
    trx.launch(
        work,
        (str(folder), attempt_0),
        hostnames=["localhost", "bnode1", "bnode2"],
        spare_hosts=("bnode3",),
        workers_per_host=1,
        backend="gloo",
        max_restarts=1,
        restart_on=("hosts",),
        agent_timeout=agent_timeout,
        ssh_config_file=cluster.ssh_config,
        event_handlers=(seen.append,),
        log_handlers=None,
    )
    return seen


def cut_link(cluster: TestCluster, agent_timeout: float) -> float:
    """Seconds from the cut of bnode1's link to the function's start on the spare."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cut_at: list[float] = []

        def cut() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if all((folder / f"start-0-{rank}").exists() for rank in range(3)):
                    cut_at.append(time.time())
                    cluster.cut_link("bnode1")
                    return
                time.sleep(0.01)

        cutter = threading.Thread(target=cut)
        cutter.start()
        try:
            _launch(cluster, folder, "cut", agent_timeout)
        finally:
            cutter.join()
            cluster.restore_link("bnode1")
        again = float((folder / "start-1-1").read_text())
    _settle(agent_timeout)
    return again - cut_at[0]


def frozen_host(cluster: TestCluster, agent_timeout: float) -> float:
    """Seconds from the freeze of bnode2's agent and worker to its quarantine."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        seen = _launch(cluster, folder, "freeze", agent_timeout)
        frozen = float((folder / "frozen").read_text())
    (quarantined,) = [e for e in seen if isinstance(e, ev.HostQuarantined)]
    _settle(agent_timeout)
    return quarantined.time - frozen


PREEMPT = r"""
import json, os, sys, time
import torchrunx as trx

def train(folder):
    rank = int(os.environ["RANK"])
    open(f"{folder}/running-{rank}", "w").close()
    while not trx.preemption_requested():
        time.sleep(0.01)
    with open(f"{folder}/ckpt-{rank}.tmp", "w") as f:
        json.dump({"at": time.time()}, f)
    os.replace(f"{folder}/ckpt-{rank}.tmp", f"{folder}/ckpt-{rank}")
    return rank

trx.launch(train, (sys.argv[1],), hostnames=["localhost", "bnode1", "bnode2"],
           workers_per_host=1, backend=None, preemption_grace=30, log_handlers=None,
           ssh_config_file=sys.argv[2])
"""


def preemption(cluster: TestCluster) -> tuple[float, float]:
    """Seconds from SIGTERM to the last checkpoint written, and to the launcher's exit."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        script = folder / "preempt.py"
        script.write_text(PREEMPT)
        process = subprocess.Popen(
            [sys.executable, str(script), str(folder), str(cluster.ssh_config)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not all((folder / f"running-{rank}").exists() for rank in range(3)):
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("the preemption benchmark's ranks did not start")
            time.sleep(0.01)
        told = time.time()
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
        ended = time.time()
        if code != 128 + signal.SIGTERM:
            raise RuntimeError(f"the preempted launcher exited with {code}, not 143")
        saved = max(json.loads((folder / f"ckpt-{r}").read_text())["at"] for r in range(3))
    return saved - told, ended - told


def _settle(agent_timeout: float) -> None:
    """Let a cut-off or frozen agent end (it notices its launcher's silence, or its guardian
    kills it) before the next run."""
    time.sleep(2 * agent_timeout + 4)


def _line(name: str, values: list[float], target: str) -> str:
    return (
        f"{name:<34} median {statistics.median(values):6.2f} s   slowest {max(values):6.2f} s"
        f"   ({len(values)} runs; {target})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--agent-timeout", type=float, default=2.0)
    args = parser.parse_args()
    reason = cluster_unavailable_reason()
    if reason:
        sys.exit(f"no bench test hosts: {reason}")
    with tempfile.TemporaryDirectory() as work_dir:
        cluster = start_cluster(3, Path(work_dir), profile="bench")
        try:
            cuts = [cut_link(cluster, args.agent_timeout) for _ in range(args.runs)]
            freezes = [frozen_host(cluster, args.agent_timeout) for _ in range(args.runs)]
            preempts = [preemption(cluster) for _ in range(args.runs)]
        finally:
            cluster.stop()
    timeout = args.agent_timeout
    print(f"agent_timeout={timeout:g} s (the floor of the first two: silence must last that long)")
    print(_line("cut link -> function on the spare", cuts, f"target <= {timeout + 2:g} s"))
    print(_line("frozen host -> quarantined", freezes, f"target <= {timeout + 1:g} s"))
    print(_line("SIGTERM -> every checkpoint", [p[0] for p in preempts], "30 s of grace"))
    print(_line("SIGTERM -> launcher exited (143)", [p[1] for p in preempts], "30 s of grace"))


if __name__ == "__main__":
    main()
