"""The same benchmarks on two commits, interleaved, to show what a change did to the figures.

    python benchmarks/before_after.py [--base 5da8ed5] [--rounds 3]
                                      [--sets run warm many_hosts resilience]

A refactor should change no figure beyond noise (issue #44). This script checks out ``--base``
in a temporary git worktree (removed at the end, however the script ends), and then, round
after round, runs each set's benchmark commands in the base checkout and in this one: in the
order base, this, then this, base in the next round (ABBA), so that a machine that gets
busier or quieter over the run favours neither. Each checkout runs its own copy of the
benchmark scripts against its own ``torchrunx`` (``PYTHONPATH`` is the checkout: an editable
install would otherwise give both the package it points to).

The sets (each a command of a script described in ``README.md``):

- ``run``: ``run.py --tools ours floor --runs 1`` for launch overhead (1 host and 2 SSH test
  hosts, gloo and ``backend=None``), back-to-back launches and failure latencies;
- ``warm``: ``warm.py --tools cold warm warm-keep --runs 5`` (1 host and 2 SSH test hosts);
- ``many_hosts``: ``many_hosts.py --hosts 1000`` (simulated agents; the real launcher);
- ``resilience``: ``resilience.py --runs 2`` (a cut link, a frozen host, a preemption).

Every figure the commands print (a Markdown table's cells, ``many_hosts.py``'s rows,
``resilience.py``'s medians) is collected per round. The table printed at the end has one row
per figure: the base's median and range over the rounds, this checkout's, their ratio, and
``same`` when the two ranges overlap or the medians are within 10% of each other; ``CHANGED``
otherwise. Progress goes to stderr; the exit status is 1 only if a command failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS: dict[str, list[str]] = {
    "run": [
        "benchmarks/run.py",
        "--tools",
        "ours",
        "floor",
        "--runs",
        "1",
        "--only",
        "launch-overhead",
        "back-to-back",
        "failure-latency",
    ],
    "warm": ["benchmarks/warm.py", "--tools", "cold", "warm", "warm-keep", "--runs", "5"],
    "many_hosts": ["benchmarks/many_hosts.py", "--hosts", "1000"],
    "resilience": ["benchmarks/resilience.py", "--runs", "2"],
}
"""Each set's command, run with this interpreter in a checkout's root."""
NOISE = 0.10
"""Medians within this fraction of each other are the same figure (also: overlapping ranges)."""
_NUMBER = re.compile(r"^[<>~]?\s*(-?\d+(?:\.\d+)?)")
_ROW = re.compile(r"^(\w+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)$")
_FLOOR = re.compile(r"^floor (\w+)\s+(-?\d+\.\d+)$")
_MEDIAN = re.compile(r"^(\S.*?\S)\s+median\s+(-?\d+\.\d+) s\s+slowest\s+(-?\d+\.\d+) s")


def figures(output: str) -> dict[str, float]:
    """Every figure of one command's output, by a name that is the same in both checkouts.

    Markdown tables: ``row | column`` for each numeric cell (the first cell names the row);
    ``many_hosts.py``: ``key | small``, ``key | large`` and ``floor | key``;
    ``resilience.py``: ``name | median`` and ``name | slowest``.
    """
    found: dict[str, float] = {}
    header: list[str] = []
    for raw in output.splitlines():
        line = raw.strip()
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= set("-: ") for c in cells):
                continue
            if not header or cells[0] in ("case", "setup", ""):
                header = cells
                continue
            for column, cell in zip(header[1:], cells[1:], strict=False):
                number = _NUMBER.match(cell.replace(",", ""))
                if number and column:
                    found[f"{cells[0]} | {column}"] = float(number[1])
            continue
        header = []
        if match := _MEDIAN.match(line):
            found[f"{match[1]} | median"] = float(match[2])
            found[f"{match[1]} | slowest"] = float(match[3])
        elif match := _ROW.match(line):
            found[f"{match[1]} | small"] = float(match[2])
            found[f"{match[1]} | large"] = float(match[3])
        elif match := _FLOOR.match(line):
            found[f"floor | {match[1]}"] = float(match[2])
    return found


def verdict(base: list[float], head: list[float]) -> str:
    """``same`` if the ranges overlap or the medians are within :data:`NOISE`; else CHANGED."""
    low, high = min(base), max(base)
    if min(head) <= high and max(head) >= low:
        return "same"
    b, h = statistics.median(base), statistics.median(head)
    if b == h or (b and abs(h / b - 1) <= NOISE):
        return "same"
    return "CHANGED"


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def table(base: dict[str, list[float]], head: dict[str, list[float]]) -> str:
    """The Markdown table of every figure measured in both checkouts."""
    lines = [
        "| figure | base median [range] | this median [range] | this/base | verdict |",
        "|---|---|---|---|---|",
    ]
    for name in [n for n in base if n in head]:
        b, h = base[name], head[name]
        mb = statistics.median(b)
        ratio = f"{statistics.median(h) / mb:.2f}" if mb else "-"
        lines.append(f"| {name} | {_cell(b)} | {_cell(h)} | {ratio} | {verdict(b, h)} |")
    missing = sorted(set(base) ^ set(head))
    if missing:
        lines.append("")
        lines.append(f"Measured in one checkout only: {', '.join(missing)}")
    return "\n".join(lines)


def _run(checkout: Path, command: list[str], timeout: float) -> str | None:
    """One command in ``checkout``; its stdout, or None (said on stderr) if it failed."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, *command],
            cwd=checkout,
            env={**os.environ, "PYTHONPATH": str(checkout)},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        print(f"  {command[0]} in {checkout}: over {timeout:.0f} s", file=sys.stderr)
        return None
    took = time.monotonic() - started
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        print(f"  {command[0]} in {checkout}: exit {done.returncode}\n{tail}", file=sys.stderr)
        return None
    print(f"  {command[0]} in {checkout.name}: {took:.0f} s", file=sys.stderr)
    return done.stdout


def main() -> int:
    """Run the sets in both checkouts and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="5da8ed5", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sets", nargs="+", choices=list(SETS), default=list(SETS))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    parser.add_argument("--keep-output", type=Path, help="write every command's stdout here")
    args = parser.parse_args()
    if shutil.which("git") is None:
        parser.error("git is needed (the base is checked out with git worktree)")
    folder = Path(tempfile.mkdtemp(prefix="trx-before-after-"))
    base_dir = folder / "base"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_dir), args.base],
        check=True,
        capture_output=True,
    )
    found: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
    failed = False
    try:
        for round_ in range(args.rounds):
            order = [("base", base_dir), ("this", ROOT)]
            if round_ % 2:
                order.reverse()
            for name in args.sets:
                for side, checkout in order:
                    print(f"round {round_ + 1}, {name}, {side}", file=sys.stderr)
                    out = _run(checkout, SETS[name], args.timeout)
                    if out is None:
                        failed = True
                        continue
                    if args.keep_output:
                        args.keep_output.mkdir(parents=True, exist_ok=True)
                        (args.keep_output / f"{name}-{side}-{round_ + 1}.txt").write_text(out)
                    for figure, value in figures(out).items():
                        found[side].setdefault(f"{name}: {figure}", []).append(value)
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_dir)],
            check=False,
            capture_output=True,
        )
        shutil.rmtree(folder, ignore_errors=True)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    print(f"base {args.base}, this {head}, {args.rounds} rounds (ABBA), sets {' '.join(args.sets)}")
    print()
    print(table(found["base"], found["this"]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
