"""Tree start at scale: real launches on the bench SSH test hosts, tree against flat, and a model.

Usage::

    python benchmarks/tree.py [--hosts 8 16 32] [--radix 0] [--runs 3]

For each host count ``N`` (one cluster of the largest ``N`` is made, ``tests/cluster.py``'s
bench profile, and each launch uses its first ``N`` hosts), each run launches a cheap function
(``backend=None``, 1 worker per host; it returns the time it started and imports no torch)
twice: with ``tree_radix`` (``--radix``; 0: 4 up to 20 hosts, else 8, so that the tree has
depth 2) and with the flat start (``tree_radix=None``). Each launch measures, from the call:

- ``start``: every rank's function start (the latest of the times the ranks return);
- ``result``: the launch's return;
- ``L1 hello`` / ``L2 hello``: the latest agent hello (``AgentStarted`` events) of the hosts
  the launcher starts (level 1) and of those an interior host starts (level 2);
- ``child``: the median over level-2 hosts of their hello less their interior host's hello
  (a child's start over SSH from its interior host, as seen by the launcher);
- the launcher process's CPU time (``getrusage(RUSAGE_SELF)``, user + system, around the call),
  per host.

Then the baseline (:func:`baseline`): the same latencies with the least else running (1 host
flat; 2 hosts, radix 1). Prints one table row per host count and start: the median and the
slowest of the runs; the baseline; a model fitted to the rows' medians (:func:`fit`) and its
prediction for 1,024 hosts with radix 32 (:func:`predict`), with the ``tree_sim.py`` command
line that simulates it. Every host, agent and worker runs on this one machine: see
benchmarks/RESULTS.md for what that means for the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import sys
import time
from typing import Any

import numpy as np
from testhosts import ssh_hosts, unavailable_reason

import torchrunx as trx
from torchrunx.agent.tree.starts import RESOLVE_AT_ONCE, ssh_target
from torchrunx.events import AgentStarted
from torchrunx.launcher.starts.tree import tree_children, tree_parent

PREDICT_HOSTS = 1024
PREDICT_RADIX = 32


def started() -> float:
    """The function every rank runs: when it started (seconds since the epoch)."""
    return time.time()


def default_radix(hosts: int) -> int:
    """The radix that keeps a tree of ``hosts`` at depth 2: 4 up to 20 hosts, else 8."""
    return 4 if hosts <= 4 + 4 * 4 else 8


def shape(hosts: int, radix: int | None) -> dict[str, float]:
    """A start's shape: levels, the most hosts one starter starts, the launcher's own starts."""
    if radix is None or hosts <= radix:
        return {"levels": 1, "max_children": hosts, "direct": hosts}
    most = max(len(tree_children(i, radix, hosts)) for i in range(radix))
    return {"levels": 2, "max_children": max(radix, most), "direct": radix}


def launch_once(hosts: list[str], ssh_config: str, radix: int | None) -> dict[str, float]:
    """One launch on ``hosts``; its figures (seconds from the call; launcher CPU ms per host)."""
    hellos: dict[int, float] = {}

    def record(event: object) -> None:
        if isinstance(event, AgentStarted):
            hellos[event.host_index] = event.time

    before = resource.getrusage(resource.RUSAGE_SELF)
    called = time.time()
    result = trx.launch(
        started,
        hostnames=hosts,
        workers_per_host=1,
        backend=None,
        ssh_config_file=ssh_config,
        tree_radix=radix,
        event_handlers=(record,),
        log_handlers=[],
    )
    returned = time.time()
    after = resource.getrusage(resource.RUSAGE_SELF)
    starts = [float(rank) for rank in result.ranks]
    assert len(starts) == len(hosts), starts  # every rank ran
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    level1 = [i for i in range(len(hosts)) if radix is None or tree_parent(i, radix) is None]
    level2 = [i for i in range(len(hosts)) if i not in level1]
    figures = {
        "start": max(starts) - called,
        "result": returned - called,
        "l1_hello": max(hellos[i] for i in level1) - called,
        "l2_hello": max((hellos[i] for i in level2), default=called) - called,
        "child": 0.0,
        "cpu_ms_per_host": cpu / len(hosts) * 1000,
        "cpu_s": cpu,
    }
    if radix is not None and level2:
        gaps = [hellos[i] - hellos[tree_parent(i, radix) or 0] for i in level2]
        figures["child"] = statistics.median(gaps)
    return figures


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares over the medians of every (hosts, start) row.

    ``time = a + b * levels + c * max_children + d * hosts``: ``d * hosts`` is this machine's
    share (every host's agent, worker, relay, ``sshd`` and ``ssh`` client on its cores, which
    separate machines do not share). On a machine whose cores are saturated ``d`` takes nearly
    all of the time and ``a``, ``b`` and ``c`` are noise: printed, not used to predict.
    ``cpu = cpu_fixed + cpu_per_direct * direct + cpu_per_host * hosts`` (``direct``: the
    hosts the launcher starts itself, over SSH from its process; ``cpu_per_host``: a host's
    connections, frames and result, relayed or not).
    """
    shapes = [shape(int(row["hosts"]), row["radix"]) for row in rows]
    times = np.array([row["start"] for row in rows])
    cpus = np.array([row["cpu_s"] for row in rows])
    x_time = np.array(
        [
            [1, s["levels"], s["max_children"], row["hosts"]]
            for s, row in zip(shapes, rows, strict=True)
        ]
    )
    x_cpu = np.array([[1, s["direct"], row["hosts"]] for s, row in zip(shapes, rows, strict=True)])
    a, b, c, d = np.linalg.lstsq(x_time, times, rcond=None)[0]
    fixed, per_direct, per_host = np.linalg.lstsq(x_cpu, cpus, rcond=None)[0]
    return {
        "a": a,
        "b": b,
        "c": c,
        "d": d,
        "cpu_fixed": fixed,
        "cpu_per_direct": per_direct,
        "cpu_per_host": per_host,
    }


def extra_resolves(s: dict[str, float], base: dict[str, float]) -> float:
    """The ``ssh -G`` time an interior relay spends beyond a lone child's (in rounds)."""
    rounds = -(-int(s["max_children"]) // RESOLVE_AT_ONCE)
    return base["resolve"] * (rounds - 1)


def predict(
    model: dict[str, float], base: dict[str, float], hosts: int, radix: int
) -> dict[str, float]:
    """The launcher's CPU (the fit) and the call to every function start on separate machines.

    The start is the later of two bounds. The path: a level-1 host's hello with nothing else
    running (``base["first"]``), plus one SSH start's launcher CPU (``cpu_per_direct``, which
    the launcher's threads take one at a time) for each other host it starts; a child's start
    from its interior host with nothing else running (``base["child"]``), plus the same for each
    other child of that host (an upper bound: its OpenSSH clients are separate processes, on
    that host's own cores), and one ``ssh -G`` (``base["resolve"]``) for each further round of
    :data:`RESOLVE_AT_ONCE` children: the relay resolves its children's addresses, that many
    at once, before it starts any; then a hello to the
    function's start (``base["workers"]``). The launcher's own CPU: it handles every host's
    connection, frames and result on its core.
    """
    s = shape(hosts, radix)
    per = model["cpu_per_direct"]
    path = base["first"] + per * (s["direct"] - 1) + base["workers"]
    if s["levels"] > 1:
        path += base["child"] + per * (s["max_children"] - 1) + extra_resolves(s, base)
    cpu = model["cpu_fixed"] + per * s["direct"] + model["cpu_per_host"] * hosts
    return {"path_s": path, "cpu_s": cpu, "seconds": max(path, cpu)}


def baseline(names: list[str], config: str, runs: int) -> dict[str, float]:
    """The latencies with the least else running (medians of ``runs``, after one not counted).

    ``first``: 1 host, flat: the call to its hello. ``child``: 2 hosts, radix 1: host 1's hello
    less host 0's (host 0 starts it). ``workers``: those launches' hello to function start.
    ``resolve``: one ``ssh -G`` of a host, as an interior relay runs it for each child.
    """
    figures: dict[str, list[float]] = {"first": [], "child": [], "workers": [], "resolve": []}
    launch_once(names[:1], config, None)
    launch_once(names[:2], config, 1)
    for _ in range(runs):
        alone = launch_once(names[:1], config, None)
        pair = launch_once(names[:2], config, 1)
        figures["first"].append(alone["l1_hello"])
        figures["child"].append(pair["child"])
        figures["workers"] += [alone["start"] - alone["l1_hello"], pair["start"] - pair["l2_hello"]]
        resolving = time.perf_counter()
        ssh_target(names[0], config)
        figures["resolve"].append(time.perf_counter() - resolving)
    return {key: statistics.median(values) for key, values in figures.items()}


FIGURES = ("start", "result", "l1_hello", "l2_hello", "child", "cpu_ms_per_host")


def print_table(rows: list[dict[str, Any]]) -> None:
    """One row per host count and start: median / slowest of each figure."""
    print(
        "| hosts | start | runs | call to every function start | call to result | L1 hello "
        "| L2 hello | child start | launcher CPU per host |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        kind = "flat" if row["radix"] is None else f"tree radix {row['radix']}"
        cells = []
        for key in FIGURES:
            if row["radix"] is None and key in ("l2_hello", "child"):
                cells.append("-")
                continue
            values = row["runs_" + key]
            unit = "ms" if key == "cpu_ms_per_host" else "s"
            cells.append(f"{statistics.median(values):.2f} / {max(values):.2f} {unit}")
        print(f"| {row['hosts']} | {kind} | {len(row['runs_start'])} | " + " | ".join(cells) + " |")
    print("(each cell: median / slowest of the runs)")


def measure(
    counts: list[int], radix: int, runs: int, failures: list[str], *, flat: bool
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every launch, on one cluster of ``max(counts)`` bench hosts; a row per count and start.

    A first launch of each kind per count is not counted; a failed launch is added to
    ``failures`` and left out of its row. Then :func:`baseline`'s latencies.
    """
    rows: list[dict[str, Any]] = []
    made = time.monotonic()
    with ssh_hosts(max(counts)) as ssh:
        print(f"  {max(counts)} hosts made in {time.monotonic() - made:.1f} s", file=sys.stderr)
        names: list[str] = ssh["hostnames"]  # type: ignore[assignment]
        config = str(ssh["ssh_config_file"])
        for count in counts:
            chosen = radix or default_radix(count)
            kinds: list[int | None] = [chosen, None] if flat else [chosen]
            runs_by_kind: dict[int | None, list[dict[str, float]]] = {k: [] for k in kinds}
            for kind in kinds:  # not counted: the first launch's imports, the hosts' caches
                launch_once(names[:count], config, kind)
            for run in range(runs):
                for kind in kinds:  # alternated, so that load drifts hit both alike
                    try:
                        figures = launch_once(names[:count], config, kind)
                    except Exception as exc:  # noqa: BLE001 (said, and the run left out)
                        failures.append(f"{count} hosts, radix {kind}, run {run + 1}: {exc!r}")
                        print(f"  FAILED {failures[-1]}", file=sys.stderr)
                        continue
                    runs_by_kind[kind].append(figures)
                    shown = {key: round(value, 3) for key, value in figures.items()}
                    print(f"  {count} hosts, radix {kind}, run {run + 1}: {shown}", file=sys.stderr)
            for kind, done in runs_by_kind.items():
                if not done:
                    continue
                row: dict[str, Any] = {"hosts": count, "radix": kind}
                for key in (*FIGURES, "cpu_s"):
                    row["runs_" + key] = [f[key] for f in done]
                    row[key] = statistics.median(row["runs_" + key])
                rows.append(row)
        base = baseline(names, config, runs)
    return rows, base


def main() -> None:
    """Measure, print the table, fit the model and print its prediction."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--radix", type=int, default=0, help="0: 4 up to 20 hosts, else 8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-flat", action="store_true", help="tree starts only")
    parser.add_argument("--json", help="also write every row and the baseline to this file")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"no bench test hosts: {reason}")
    os.environ.setdefault("TORCHRUNX_LOG_LEVEL", "WARNING")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the hosts are stopped then too
    failures: list[str] = []
    rows, base = measure(sorted(args.hosts), args.radix, args.runs, failures, flat=not args.no_flat)
    print_table(rows)
    for failure in failures:
        print(f"failed launch: {failure}")
    if args.json:
        with open(args.json, "w") as f:  # noqa: PTH123
            json.dump({"rows": rows, "baseline": base}, f, indent=1)
    print(
        "baseline (medians, the least else running): "
        + ", ".join(f"{key} {value:.3f} s" for key, value in base.items())
    )
    if len(rows) < 4:
        print("model: too few rows to fit (needs 4 or more)")
        return
    model = fit(rows)
    print("model: " + ", ".join(f"{key} {value:.4f}" for key, value in model.items()))
    guess = predict(model, base, PREDICT_HOSTS, PREDICT_RADIX)
    per, k = model["cpu_per_direct"], PREDICT_RADIX
    print(
        f"simulate it: python benchmarks/tree_sim.py --hosts {PREDICT_HOSTS} --radix {k} "
        f"--first {base['first']:.3f} --per-start {per:.3f} "
        f"--child {base['child'] + extra_resolves(shape(PREDICT_HOSTS, k), base):.3f} "
        f"--workers-after {base['workers']:.3f} --predicted {guess['seconds']:.2f} "
        f"{guess['cpu_s']:.2f}"
    )
    print(
        f"prediction, {PREDICT_HOSTS} hosts radix {PREDICT_RADIX}: call to every function start "
        f"{guess['seconds']:.2f} s (the path {guess['path_s']:.2f} s, the launcher's CPU "
        f"{guess['cpu_s']:.2f} s), launcher CPU {guess['cpu_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
