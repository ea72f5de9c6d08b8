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

Prints one table row per host count, start and run kind: the median and the slowest of the
runs. Then a model fitted to the medians (:func:`fit`) and its prediction for 1,024 hosts
(radix 32). Every host, agent and worker runs on this one machine: see benchmarks/RESULTS.md
for what that means for the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np
from testhosts import ssh_hosts, unavailable_reason

import torchrunx as trx
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

    ``time = a + b * levels + c * max_children + d * hosts``, where ``d * hosts`` is this
    machine's share (every agent and worker of every host on its 2 cores: a host's own start
    costs every other host time here, not on separate machines), left out of the prediction;
    ``cpu = fixed + per_direct * direct + per_host * hosts`` (the launcher's own starts are
    its direct children; ``per_host``: a host's connection, frames and result, relayed or not).
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


def predict(model: dict[str, float], hosts: int, radix: int) -> dict[str, float]:
    """The model's call-to-start seconds (without this machine's share) and launcher CPU."""
    s = shape(hosts, radix)
    seconds = model["a"] + model["b"] * s["levels"] + model["c"] * s["max_children"]
    cpu = model["cpu_fixed"] + model["cpu_per_direct"] * s["direct"]
    return {"seconds": seconds, "cpu_s": cpu + model["cpu_per_host"] * hosts}


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
) -> list[dict[str, Any]]:
    """Every launch, on one cluster of ``max(counts)`` bench hosts; a row per count and start.

    A first launch of each kind per count is not counted; a failed launch is added to
    ``failures`` and left out of its row.
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
    return rows


def main() -> None:
    """Measure, print the table, fit the model and print its prediction."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--radix", type=int, default=0, help="0: 4 up to 20 hosts, else 8")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-flat", action="store_true", help="tree starts only")
    parser.add_argument("--json", help="also write every row to this file")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"no bench test hosts: {reason}")
    os.environ.setdefault("TORCHRUNX_LOG_LEVEL", "WARNING")
    failures: list[str] = []
    rows = measure(sorted(args.hosts), args.radix, args.runs, failures, flat=not args.no_flat)
    print_table(rows)
    for failure in failures:
        print(f"failed launch: {failure}")
    if args.json:
        with open(args.json, "w") as f:  # noqa: PTH123
            json.dump(rows, f, indent=1)
    if len(rows) < 4:
        print("model: too few rows to fit (needs 4 or more)")
        return
    model = fit(rows)
    print("model: " + ", ".join(f"{key} {value:.4f}" for key, value in model.items()))
    guess = predict(model, PREDICT_HOSTS, PREDICT_RADIX)
    print(
        f"prediction, {PREDICT_HOSTS} hosts radix {PREDICT_RADIX}: call to every function start "
        f"{guess['seconds']:.2f} s (without this machine's share), launcher CPU "
        f"{guess['cpu_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
