"""Log forwarding throughput: one worker printing N lines, ours against torchrun and a bare floor.

Usage::

    python benchmarks/log_overhead.py [--lines 100000] [--runs 5] [--no-torchrun]

Each run measures, in fresh processes and temporary folders:

- **floor**: a bare Python writing the lines to a file (no launcher at all);
- **torchrun**: ``python -m torch.distributed.run`` with one worker that prints the lines to
  the stdout it inherits from torchrun, a pipe this script reads (what ``run.py`` measures);
  torchrun writes no files;
- **ours, "auto"**: ``torchrunx.launch`` with the default handlers: rank 0 on the console
  (this process's stdout, sent to a file here) and one log file per agent and worker;
- **ours, one file**: the same with ``log_handlers=[file_handler(...)]``: the log file only.

Columns, as medians over the runs: the print loop's time inside the worker (how much the way
out slows the worker down), the time from the function's start to the moment every line is
written (torchrun: the command's exit; ours: ``launch`` returning, its files flushed), the lines
per second over that time (``run.py``'s "lines/s, function start to result"), the launch's
wall time from the call (torchrun: the command's start) to that moment, and lines lost
(counted in the output and the log files; for "auto" in the console output and the file both).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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

TORCHRUN_WORKER = """
import sys, time
start = time.time()
t = time.perf_counter()
for i in range(int(sys.argv[1])):
    print(f"line {i}")
sys.stdout.flush()
print(f"measured {time.perf_counter() - t} {start}", file=sys.stderr)
"""


@dataclass
class Run:
    """One measured run of one tool."""

    loop: float
    """Seconds of the print loop inside the worker."""
    to_written: float
    """Seconds from the function's start until every line was written."""
    wall: float
    """Seconds from the launch call (or command start) until every line was written."""
    lost: int


def print_lines(count: int) -> tuple[float, float]:
    start = time.time()
    started = time.perf_counter()
    for i in range(count):
        print(f"line {i}")
    return time.perf_counter() - started, start


def count_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.rsplit(" ", 2)[-2:-1] == ["line"])


def floor(count: int, folder: Path) -> Run:
    out = subprocess.run(
        [sys.executable, "-c", DIRECT, str(folder / "direct.txt"), str(count)],
        capture_output=True,
        text=True,
        check=True,
    )
    loop = float(out.stdout)
    lost = count - count_lines((folder / "direct.txt").read_text())
    return Run(loop, loop, loop, lost)


def torchrun(count: int, folder: Path) -> Run:
    script = folder / "worker.py"
    script.write_text(TORCHRUN_WORKER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    argv += ["--nproc-per-node", "1", str(script), str(count)]
    started = time.time()
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=folder)
    ended = time.time()
    measured = next(line for line in out.stderr.splitlines() if line.startswith("measured "))
    loop, start = (float(word) for word in measured.split()[1:])
    return Run(loop, ended - start, ended - started, count - count_lines(out.stdout))


def ours(count: int, folder: Path, *, auto: bool) -> Run:
    console = folder / "console.txt"
    handler = None if auto else trx.file_handler("localhost", 0, folder / "worker.log")
    os.environ["TORCHRUNX_LOG_DIR"] = str(folder / "logs")
    with console.open("w") as out, contextlib.redirect_stdout(out):
        started = time.time()
        try:
            result = trx.launch(
                print_lines,
                (count,),
                hostnames=["localhost"],
                workers_per_host=1,
                backend=None,
                log_handlers="auto" if auto else [handler],
            )
        finally:
            if handler is not None:
                handler.close()
        ended = time.time()
    loop, start = result.rank(0)
    if auto:
        # "latest" is a link to the newest launch's folder: count the real folder only.
        (launch,) = (
            path for path in (folder / "logs").iterdir() if path.is_dir() and not path.is_symlink()
        )
        in_file = count_lines((launch / "localhost[0].log").read_text())
        lost = 2 * count - in_file - count_lines(console.read_text())
    else:
        lost = count - count_lines((folder / "worker.log").read_text())
    return Run(loop, ended - start, ended - started, lost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-torchrun", action="store_true", help="measure ours and the floor")
    args = parser.parse_args()
    n = args.lines
    tools = {
        "floor: bare Python writing to a file": lambda folder: floor(n, folder),
        "torchrun: the worker prints to torchrun's stdout (a pipe)": lambda folder: torchrun(
            n, folder
        ),
        'ours, "auto": rank 0 on the console, a file per agent and worker': lambda folder: ours(
            n, folder, auto=True
        ),
        "ours, one file_handler: the log file only": lambda folder: ours(n, folder, auto=False),
    }
    if args.no_torchrun:
        del tools["torchrun: the worker prints to torchrun's stdout (a pipe)"]
    runs: dict[str, list[Run]] = {name: [] for name in tools}
    for _ in range(args.runs):  # the tools take turns: load changes hit them alike
        for name, measure in tools.items():
            with tempfile.TemporaryDirectory() as tmp:
                runs[name].append(measure(Path(tmp)))
    print(
        f"| {n:,} lines, medians of {args.runs} | loop in the worker | function start to"
        " every line written | lines/s | call to every line written | lines lost |\n"
        "|---|---|---|---|---|---|"
    )
    for name, measured in runs.items():
        loop = statistics.median(r.loop for r in measured)
        to_written = statistics.median(r.to_written for r in measured)
        wall = statistics.median(r.wall for r in measured)
        lost = statistics.median(r.lost for r in measured)
        print(
            f"| {name} | {loop:.3f} s | {to_written:.3f} s | {n / to_written:,.0f} |"
            f" {wall:.3f} s | {lost:.0f} |"
        )


if __name__ == "__main__":
    main()
