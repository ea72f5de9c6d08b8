"""The live view's cost and speed: attach time, refresh interval, the launcher's CPU for it.

Usage::

    python benchmarks/view.py [--hosts 1000] [--workers 8] [--seconds 10] [--real]

Simulated (default): a process serves a launch's view (:class:`ViewServer`) whose snapshot is
the health report of ``--hosts`` x ``--workers`` ranks, built each time from agent and worker
records as the launcher builds it; ``torchrunx top``'s reader attaches to it. Prints the time
from connecting to the first snapshot (attach), the interval between snapshots (refresh; median
and slowest), a snapshot's size, and the serving process's CPU over ``--seconds`` with one
viewer attached, against the same process with none (its floor), as a share of one core;
and what one agent's sample of its ``--workers`` workers' CPU and memory costs (``/proc``,
once a second per agent; GPU figures come from ``nvidia-smi`` in the background).

``--real``: a real launch of 8 hosts (each ``localhost``, an agent each) x 8 workers with
``backend=None``, whose function sleeps; the same figures from its view, and the launcher's
CPU while it sleeps with a viewer attached and without (two launches).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from torchrunx.events import AgentState, WorkerState  # noqa: E402
from torchrunx.launcher.state.health import AgentHealth, HealthReport, WorkerHealth  # noqa: E402


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process (``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


FIGURES = (97.5, 3 << 30, 88, 40 << 30, 1532)
"""A rank's use and collective count, as its agent's heartbeat and its progress bring them."""


def _sample_cost(workers: int, rounds: int = 200) -> float:
    """Seconds one agent's sample of ``workers`` processes takes (``/proc``; no GPU)."""
    from torchrunx.agent.usage import UsageSampler  # noqa: PLC0415

    sampler = UsageSampler(gpus=0)
    pids = [(i, os.getpid()) for i in range(workers)]
    started = time.perf_counter()
    for i in range(rounds):
        sampler.sample(pids, float(i))
    return (time.perf_counter() - started) / rounds


def _serve(hosts: int, workers: int) -> None:
    """The simulated launcher: serves the view until stdin closes."""
    from dataclasses import dataclass  # noqa: PLC0415

    from torchrunx.launcher.view.view_server import (  # noqa: PLC0415
        GROUP_ABOVE,
        ViewServer,
        grouped,
    )

    @dataclass
    class Rank:  # what the launcher's records hold of a rank, for the view
        hostname: str
        state: WorkerState

    @dataclass
    class Agent:
        hostname: str
        state: AgentState
        last_heard: float
        role: str = "host"

    ranks = [Rank(f"node{h}", WorkerState.HEALTHY) for h in range(hosts) for _ in range(workers)]
    agents = [Agent(f"node{h}", AgentState.RUNNING, time.monotonic()) for h in range(hosts)]

    def snapshot() -> dict[str, object]:
        # As the launcher's view_snapshot does: above GROUP_ABOVE ranks, a summary.
        now = time.monotonic()
        rows = len(ranks) <= GROUP_ABOVE
        report = HealthReport(
            healthy=True,
            launch_state="running",
            attempt=0,
            restarts=0,
            max_restarts=0,
            uptime=now,
            agents=tuple(
                AgentHealth(i, a.hostname, a.state, now - a.last_heard)
                for i, a in enumerate(agents)
            )
            if rows
            else (),
            workers=tuple(
                WorkerHealth(i, i // workers, r.hostname, i % workers, 10_000, r.state, *FIGURES)
                for i, r in enumerate(ranks)
            )
            if rows
            else (),
            failures=(),
        )
        if rows:
            return {"report": report.to_dict(), "last_lines": {}, "looks": {}}
        summary = grouped(
            report.to_dict(),
            ((r.hostname, r.state.value) for r in list(ranks)),
            [(a.hostname, a.state.value, now - a.last_heard, a.role) for a in list(agents)],
        )
        return {"report": summary, "last_lines": {}, "looks": {}}

    server = ViewServer(snapshot, {"pid": os.getpid(), "log_dir": None, "hostnames": []})
    server.start()
    print(server.path, flush=True)
    sys.stdin.read()
    server.close()


def _watch(path: str, seconds: float) -> dict[str, float]:
    """Attach to a view: attach time, refresh intervals and a snapshot's size."""
    started = time.monotonic()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    buffer, arrivals, size = b"", [], 0
    with sock:
        while time.monotonic() - started < seconds:
            data = sock.recv(1 << 20)
            if not data:
                break
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                json.loads(line)
                arrivals.append(time.monotonic())
                size = len(line)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "attach_s": arrivals[0] - started,
        "refresh_median_s": statistics.median(gaps),
        "refresh_slowest_s": max(gaps),
        "snapshot_bytes": size,
    }


def simulated(hosts: int, workers: int, seconds: float) -> None:
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(hosts), str(workers)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    path = server.stdout.readline().strip()
    try:
        idle_from = _cpu_seconds(server.pid)
        time.sleep(seconds)
        idle = _cpu_seconds(server.pid) - idle_from
        watched_from = _cpu_seconds(server.pid)
        figures = _watch(path, seconds)
        watched = _cpu_seconds(server.pid) - watched_from
    finally:
        server.communicate("")
    figures["launcher_cpu_share_watched"] = watched / seconds
    figures["launcher_cpu_share_floor"] = idle / seconds
    figures["view_cost_share_of_a_core"] = (watched - idle) / seconds
    figures["agent_sample_ms"] = _sample_cost(workers) * 1000
    print(json.dumps({"simulated": f"{hosts} x {workers}", **_rounded(figures)}, indent=1))


SLEEPER = """
import sys, time
import torchrunx as trx
trx.launch(time.sleep, (float(sys.argv[1]),), hostnames=["localhost"] * 8, workers_per_host=8,
           backend=None)
"""


def real(seconds: float) -> None:
    from torchrunx.commands.top import find_views  # noqa: PLC0415
    from torchrunx.launcher.view.view_server import runtime_dir  # noqa: PLC0415

    results = {}
    for watched in (False, True):
        launch = subprocess.Popen([sys.executable, "-c", SLEEPER, str(seconds + 30)])
        try:
            deadline = time.monotonic() + 120
            view = None
            while view is None and time.monotonic() < deadline:
                view = next(
                    (v for v in find_views(runtime_dir()) if v.name.startswith(f"{launch.pid}-")),
                    None,
                )
                time.sleep(0.05)
            assert view is not None, "the launch has no view"
            time.sleep(10)  # every rank started
            before = _cpu_seconds(launch.pid)
            if watched:
                results.update(_watch(str(view), seconds))
            else:
                time.sleep(seconds)
            results[f"launcher_cpu_share_{'watched' if watched else 'floor'}"] = (
                _cpu_seconds(launch.pid) - before
            ) / seconds
        finally:
            launch.kill()
            launch.wait()
    results["view_cost_share_of_a_core"] = (
        results["launcher_cpu_share_watched"] - results["launcher_cpu_share_floor"]
    )
    print(json.dumps({"real": "8 x 8", **_rounded(results)}, indent=1))


def _rounded(figures: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in figures.items()}


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        _serve(int(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--real", action="store_true")
    args = parser.parse_args()
    if args.real:
        real(args.seconds)
    else:
        simulated(args.hosts, args.workers, args.seconds)


if __name__ == "__main__":
    main()
