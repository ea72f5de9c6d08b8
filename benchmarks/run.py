"""Benchmarks: torchrunx against the original torchrunx 0.4 (PyPI) and torchrun.

    python benchmarks/run.py [--runs N] [--smoke] [--only CASE ...] [--tools TOOL ...]
                             [--backend gloo|nccl] [--scale-hosts N ...]
                             [--results-file benchmarks/RESULTS.md]

Sets up what it needs (the bench-profile namespace test hosts, a virtual environment with
torchrunx 0.4.0 in ``benchmarks/.venv-upstream``), runs every measured launch in a fresh process,
and prints a Markdown table of medians with the ratio ours/0.4 and the targets. Needs root for the
test hosts; without them the setups that need them are skipped. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from cases import (
    CASE_NAMES,
    FULL,
    SMOKE,
    TOOLS,
    Case,
    Metric,
    Outcome,
    Ratio,
    Setup,
    Target,
    Tool,
    build_cases,
    median,
    throughput,
    with_backend,
)
from harness import Context, compile_ours, ensure_upstream_venv, log, measure

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cluster import TestCluster, cluster_unavailable_reason, start_cluster  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterable

COLUMNS: dict[Tool, str] = {
    "ours": "ours",
    "upstream": "torchrunx 0.4",
    "torchrun": "torchrun",
    "floor": "floor",
}
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


@dataclass
class Cell:
    """One tool's numbers for one row, over the runs."""

    values: list[float] = field(default_factory=list)
    capped_at: float | None = None
    errors: list[str] = field(default_factory=list)

    def median(self) -> float | None:
        return median(self.values)


@dataclass
class Results:
    """Everything measured in one invocation."""

    runs: int
    load: float
    cells: dict[tuple[str, Tool], Cell] = field(default_factory=dict)
    leftovers: dict[Tool, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    harness_errors: int = 0
    minutes: float = 0.0

    def cell(self, row: str, tool: Tool) -> Cell:
        return self.cells.setdefault((row, tool), Cell())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement (median)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one run of each case, smaller sizes and caps: checks that the benchmarks work (CI)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=CASE_NAMES, metavar="CASE", help=", ".join(CASE_NAMES)
    )
    parser.add_argument(
        "--tools", nargs="+", choices=TOOLS, default=list(TOOLS), help="columns to measure"
    )
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default="gloo",
        help="backend of the cases that start a process group (nccl: one GPU per worker)",
    )
    parser.add_argument(
        "--scale-hosts",
        nargs="+",
        type=int,
        metavar="N",
        help="host counts of the scale case (default 1 4 8 16; its ratio row is last / first)",
    )
    parser.add_argument(
        "--results-file", type=Path, help=f"also write the table between {BEGIN} and {END} here"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs = 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    if args.scale_hosts:
        sizes = replace(sizes, scale_hosts=tuple(args.scale_hosts))
    every_case = with_backend(build_cases(sizes), args.backend)
    cases = [case for case in every_case if not args.only or case.name in args.only]
    tools: list[Tool] = [tool for tool in TOOLS if tool in args.tools]
    began = time.monotonic()
    results = Results(args.runs, os.getloadavg()[0])
    if args.backend != "gloo":
        results.notes.append(
            f"--backend {args.backend}: the cases labelled {args.backend} ran on it; the floor "
            "stays a bare gloo group."
        )
    # A kill (SIGTERM) unwinds like Ctrl-C, so that the test hosts are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if "ours" in tools:
        compile_ours()
        results.notes.append(
            "ours: this checkout's package was compiled to bytecode first, as pip compiles "
            "0.4's at install (an editable install under PYTHONDONTWRITEBYTECODE has none)."
        )
    with tempfile.TemporaryDirectory(prefix="trxbench-") as tmp:
        cluster = start_bench_cluster(cases, Path(tmp) / "cluster", results)
        try:
            ctx = Context(
                cluster,
                Path(tmp) / "runs",
                cap=60.0 if args.smoke else 180.0,
                failure_cap=20.0 if args.smoke else 60.0,
                upstream_python=ensure_upstream_venv() if "upstream" in tools else None,
            )
            collect(cases, tools, ctx, results)
        finally:
            if cluster is not None:
                cluster.stop()
    results.minutes = (time.monotonic() - began) / 60
    report = render(cases, tools, results)
    print(report)
    if args.results_file is not None:
        write_results(args.results_file, report)
    return 1 if results.harness_errors else 0


def start_bench_cluster(cases: list[Case], workdir: Path, results: Results) -> TestCluster | None:
    """Start as many bench-profile test hosts as the cases need (none if none)."""
    needed = max((setup.hosts for case in cases for setup in case.setups), default=0)
    if needed == 0:
        return None
    reason = cluster_unavailable_reason()
    if reason is not None:
        results.notes.append(f"setups on test hosts skipped: {reason}")
        return None
    workdir.mkdir()
    log(f"starting {needed} bench test hosts")
    return start_cluster(needed, workdir, profile="bench")


def collect(cases: list[Case], tools: list[Tool], ctx: Context, results: Results) -> None:
    """Measure every setup with every tool, ``runs`` times, interleaving tools within a run."""
    for run in range(results.runs):
        for case in cases:
            for setup in case.setups:
                if setup.hosts and ctx.cluster is None:
                    continue
                for tool in tools:
                    if due(setup, tool, run, results):
                        outcome = measure(tool, setup.measures[tool], ctx)
                        log(
                            f"[{run + 1}/{results.runs}] {setup.label} | {tool}: {summary(outcome)}"
                        )
                        record(setup, tool, outcome, ctx, results)


def due(setup: Setup, tool: Tool, run: int, results: Results) -> bool:
    """Whether ``tool`` measures ``setup`` in run number ``run`` (from 0).

    Not if the tool cannot, if its runs are limited, or if it hit the cap once already (it would
    again).
    """
    spec = setup.measures.get(tool)
    if spec is None or (spec.max_runs is not None and run >= spec.max_runs):
        return False
    cells = (results.cells.get((row_label(setup, m), tool)) for m in setup.metrics)
    return not any(cell is not None and cell.capped_at for cell in cells)


def record(setup: Setup, tool: Tool, outcome: Outcome, ctx: Context, results: Results) -> None:
    spec = setup.measures[tool]
    results.leftovers[tool] = results.leftovers.get(tool, 0) + outcome.leftovers
    results.harness_errors += outcome.harness_error
    for metric in setup.metrics:
        cell = results.cell(row_label(setup, metric), tool)
        if outcome.capped:
            cell.capped_at = ctx.cap_for(spec)
        if outcome.error is not None and not spec.expect_error:
            cell.errors.append(outcome.error)
            continue
        value = metric.extract(outcome)
        if value is not None:
            cell.values.append(value)


def summary(outcome: Outcome) -> str:
    parts = []
    if outcome.walls:
        parts.append("walls " + ", ".join(f"{w:.2f}" for w in outcome.walls))
    if outcome.latency is not None:
        parts.append(f"latency {outcome.latency:.2f}")
    rate = throughput(outcome)
    if rate is not None:
        parts.append(f"tensor ready to result {outcome.transfer:.2f} s, {rate:,.0f} MB/s")
    if outcome.error:
        parts.append(f"error {outcome.error[:160]}")
    if outcome.capped:
        parts.append("capped")
    if outcome.leftovers:
        parts.append(f"{outcome.leftovers} leftover processes killed")
    return "; ".join(parts) or "no numbers"


def row_label(setup: Setup, metric: Metric) -> str:
    return f"{setup.label}: {metric.label}"


# -- the table -------------------------------------------------------------------------------


def render(cases: list[Case], tools: list[Tool], results: Results) -> str:
    header = ["case", *(COLUMNS[t] for t in TOOLS), "ours/0.4", "target", "met?"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case in cases:
        lines.extend(
            measured_row(setup, metric, tools, results)
            for setup in case.setups
            for metric in setup.metrics
        )
        lines.extend(ratio_row(ratio, tools, results) for ratio in case.ratios)
    leftovers = ", ".join(
        f"{COLUMNS[t]} {results.leftovers.get(t, 0)}" for t in tools if t != "floor"
    )
    notes = [
        (
            f"Medians of {results.runs} run(s) (fewer for 0.4 where it is slow, see README); "
            f"{results.minutes:.1f} min in all; load average {results.load:.2f} at the start."
        ),
        (
            "n/a: the tool cannot do this (torchrun: one host only here, no return values, "
            "launcher and agent are one process). -: not measured in this invocation."
        ),
        f"Leftover processes killed after the runs: {leftovers}.",
        *results.notes,
        *error_notes(results),
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {note}" for note in notes)


def measured_row(setup: Setup, metric: Metric, tools: list[Tool], results: Results) -> str:
    label = row_label(setup, metric)
    cells = []
    for tool in TOOLS:
        if tool not in setup.measures:
            cells.append("n/a")
        elif tool not in tools or (label, tool) not in results.cells:
            cells.append("-")
        else:
            cells.append(show_cell(results.cells[label, tool], metric.unit))
    ours, theirs = (cell_median(results, label, t) for t in ("ours", "upstream"))
    comparison = compare(ours, theirs, results.cells.get((label, "upstream")))
    return table_line(label, cells, comparison, metric.target)


def ratio_row(ratio: Ratio, tools: list[Tool], results: Results) -> str:
    cells = []
    values: dict[Tool, float | None] = {}
    for tool in TOOLS:
        top = cell_median(results, ratio.numerator, tool)
        bottom = cell_median(results, ratio.denominator, tool)
        if tool not in tools or top is None or bottom is None:
            cells.append("-" if tool in ("ours", "upstream") else "n/a")
            values[tool] = None
        else:
            values[tool] = top / bottom
            cells.append(f"{top / bottom:.2f}x")
    comparison = compare(values["ours"], values["upstream"], None)
    return table_line(ratio.label, cells, comparison, ratio.target)


@dataclass(frozen=True)
class Comparison:
    """Ours' median, ours/0.4, and how to show the latter."""

    ours: float | None
    ratio: float | None
    text: str


def table_line(label: str, cells: list[str], comparison: Comparison, target: Target | None) -> str:
    met = target.met(comparison.ours, comparison.ratio) if target is not None else None
    met_text = "" if target is None else {True: "yes", False: "**no**", None: "?"}[met]
    target_text = target.text if target is not None else ""
    return "| " + " | ".join([label, *cells, comparison.text, target_text, met_text]) + " |"


def cell_median(results: Results, label: str, tool: Tool) -> float | None:
    cell = results.cells.get((label, tool))
    return cell.median() if cell is not None else None


def compare(ours: float | None, theirs: float | None, their_cell: Cell | None) -> Comparison:
    """ours/0.4; against a capped 0.4 only an upper bound is known."""
    if ours is None or theirs is None or theirs == 0:
        return Comparison(ours, None, "-")
    if math.isinf(theirs) and their_cell is not None and their_cell.capped_at:
        bound = ours / their_cell.capped_at
        return Comparison(ours, bound, f"< {show_ratio(bound)}")
    return Comparison(ours, ours / theirs, show_ratio(ours / theirs))


def show_ratio(ratio: float) -> str:
    return f"{ratio:.3f}" if ratio < 0.1 else f"{ratio:.2f}"


def show_cell(cell: Cell, unit: str) -> str:
    value = cell.median()
    if value is None:
        return "error" if cell.errors else "-"
    if math.isinf(value):
        return f"> {cell.capped_at:g} s (cap)"
    return show(value, unit)


def show(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.1f} s" if value >= 10 else f"{value:.2f} s"
    if unit == "CPU-s":
        return f"{value:.1f} CPU-s"
    return f"{value:,.0f} {unit}"


def error_notes(results: Results) -> Iterable[str]:
    """One note per setup and tool that had errors: how often, and the first error."""
    seen: set[tuple[str, Tool]] = set()
    for (label, tool), cell in results.cells.items():
        setup = label.rsplit(": ", 1)[0]
        if cell.errors and (setup, tool) not in seen:
            seen.add((setup, tool))
            runs = len(cell.errors) + len(cell.values)
            yield (
                f"Error, {COLUMNS[tool]}, {setup} ({len(cell.errors)} of {runs} runs): "
                f"{cell.errors[0][:200]}"
            )


# -- RESULTS.md --------------------------------------------------------------------------------


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    commit = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return (
        f"{os.cpu_count()} x {cpu}, {mem_kb / 2**20:.0f} GiB, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, "
        f"torch {importlib.metadata.version('torch')}, torchrunx at {commit or 'unknown'}"
    )


def write_results(path: Path, report: str) -> None:
    """Replace the part of ``path`` between the markers with the table (create it if missing)."""
    command = "python benchmarks/run.py " + " ".join(sys.argv[1:])
    block = (
        f"{BEGIN}\n"
        f"Run on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: {machine()}.\n\n"
        f"Command: `{command.strip()}`\n\n{report}\n\n{END}"
    )
    text = path.read_text() if path.exists() else f"# Benchmark results\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(head + block + tail)


if __name__ == "__main__":
    sys.exit(main())
