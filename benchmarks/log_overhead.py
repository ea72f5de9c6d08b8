"""Log forwarding overhead: a worker printing N lines, against writing them to a file directly.

Usage::

    python benchmarks/log_overhead.py [--lines 100000] [--runs 5]

Prints, as medians over the runs: the time a bare Python takes to write the lines to a file
(the floor), the time the same loop takes inside a torchrunx worker whose output is forwarded
(how much the worker is slowed), the end-to-end time until every line is in the launcher's
log file, lines per second, and lines lost (read back from the log file).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torchrunx as trx

DIRECT = """
import sys, time
t = time.perf_counter()
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        print(f"line {i}", file=f)
print(time.perf_counter() - t)
"""


def print_lines(count: int) -> float:
    started = time.perf_counter()
    for i in range(count):
        print(f"line {i}")
    return time.perf_counter() - started


def direct(count: int, folder: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-c", DIRECT, str(folder / "direct.txt"), str(count)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout)


def forwarded(count: int, folder: Path) -> tuple[float, float, int]:
    path = folder / "worker.log"
    handler = trx.file_handler("localhost", 0, path)  # files only: no console in the way
    started = time.perf_counter()
    try:
        result = trx.launch(
            print_lines,
            (count,),
            hostnames=["localhost"],
            workers_per_host=1,
            backend=None,
            log_handlers=[handler],
        )
    finally:
        handler.close()
    end_to_end = time.perf_counter() - started
    received = sum(1 for line in path.read_text().splitlines() if " line " in line)
    return result.rank(0), end_to_end, count - received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {"direct": [], "in_worker": [], "end_to_end": [], "lost": []}
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            rows["direct"].append(direct(args.lines, Path(tmp)))
        with tempfile.TemporaryDirectory() as tmp:
            in_worker, end_to_end, lost = forwarded(args.lines, Path(tmp))
        rows["in_worker"].append(in_worker)
        rows["end_to_end"].append(end_to_end)
        rows["lost"].append(lost)
    median = {key: statistics.median(values) for key, values in rows.items()}
    n = args.lines
    slowdown = median["in_worker"] / median["direct"]
    print(
        f"| {n:,} lines, medians of {args.runs} | seconds | lines/s |\n|---|---|---|\n"
        f"| floor: bare Python writing to a file | {median['direct']:.3f} |"
        f" {n / median['direct']:,.0f} |\n"
        f"| same loop in a torchrunx worker (forwarded) | {median['in_worker']:.3f} |"
        f" {n / median['in_worker']:,.0f} |\n"
        f"| launch call to result, every line in the log file | {median['end_to_end']:.3f} |"
        f" {n / median['end_to_end']:,.0f} |\n"
        f"| worker slowed by forwarding (in worker / floor) | {slowdown:.1f}x | |\n"
        f"| lines lost | {median['lost']:.0f} | |",
    )


if __name__ == "__main__":
    main()
