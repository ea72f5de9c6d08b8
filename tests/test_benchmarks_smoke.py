"""The benchmarks still run: a smoke run of two cheap cases, ours only (no upstream venv needed),
and of the smaller benchmarks.

The whole smoke (every case, every tool) is ``python benchmarks/run.py --smoke``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import cluster_unavailable_reason

REPO = Path(__file__).resolve().parent.parent


def test_benchmark_smoke_run_of_launch_overhead_and_results():
    command = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--smoke", "--tools", "ours"]
    result = subprocess.run(
        [*command, "--only", "launch-overhead", "results"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in result.stdout.splitlines()}
    for label in (
        "launch overhead, 1 host x 2 workers, gloo: wall, call to result",
        "launch overhead, 1 host x 2 workers, backend=None: call to function start on every rank",
        "results: 40 MB tensor from each of 2 ranks (1 host x 2, backend=None): throughput",
    ):
        ours = rows[label].split(" | ")[1]
        assert re.fullmatch(r"[\d,.]+ (s|MB/s)", ours), rows[label]
    assert "Error" not in result.stdout, result.stdout


def test_warm_benchmark_smoke_run():
    """``benchmarks/warm.py --smoke``: ours cold, warm (fresh and kept workers) and the floors,
    1 host, two runs each."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "warm.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = {}  # figures by launcher (the first table), idle CPU by row label (the second)
    for line in result.stdout.splitlines():
        if line.startswith("| "):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            local = cells[0] == "1 host x 2 workers, gloo"
            rows[cells[1] if local else cells[0]] = cells[2:] if local else cells[1:]
    for launcher in (
        "floor: running processes fork the ranks, gloo group on a listening store",
        "floor, rank 0 makes the store (`init_method=tcp://`)",
        "ours: `Launcher.run` (every launch cold)",
        "ours: warm agents, `warm.run` (fresh workers each run)",
        "ours: warm agents, workers that stay (`warm(keep_workers=True)`)",
    ):
        first_run, second_run = rows[launcher][:2]
        assert re.fullmatch(r"\d+\.\d+ s", first_run), rows[launcher]
        assert re.fullmatch(r"\d+\.\d+ s", second_run), rows[launcher]
    # Whether a target is met depends on the machine's load; that it is judged does not.
    for launcher, target in (
        ("ours: warm agents, `warm.run` (fresh workers each run)", "median ≤ 0.1 s, max ≤ 0.25 s"),
        ("ours: warm agents, workers that stay (`warm(keep_workers=True)`)", "median ≤ 0.02 s"),
        ("ours: `Launcher.run` (every launch cold)", "max ≤ median + 0.2 s"),
    ):
        assert rows[launcher][-2:] in ([target, "yes"], [target, "**no**"]), rows[launcher]
    for label in (
        "the agents, with their guardian processes",
        "launcher process, all threads (its main thread sleeps)",
    ):
        assert re.fullmatch(r"\d+\.\d+ CPU-s \(.*\)", rows[label][0]), rows[label]
    assert "torchrunx 0.4" not in result.stdout
    assert "Error" not in result.stdout, result.stdout


def test_many_hosts_benchmark_smoke_run_with_its_floor():
    """``benchmarks/many_hosts.py --floor`` at a small size: every rank's result comes back
    (it asserts so itself), the launcher's figures and the bare server's floor are printed."""
    sizes = ["--hosts", "20", "--workers", "2", "--simulators", "2"]
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "many_hosts.py"), *sizes, "--floor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "simulated agent failed" not in result.stderr, result.stderr[-4000:]
    figures = {}
    for line in result.stdout.splitlines():
        match = re.fullmatch(r"(floor )?(\w+) +([\d.]+)(?: +([\d.]+))?", line)
        if match:
            figures[(match[1] or "") + match[2]] = float(match[4] or match[3])
    assert figures["ranks"] == 40, result.stdout  # 20 hosts x 2, the large launch
    assert figures["cpu_ms_per_host"] > 0, result.stdout
    assert figures["floor seconds"] > 0, result.stdout
    assert figures["floor cpu_ms_per_host"] > 0, result.stdout
    assert re.search(r"launcher CPU per host over the floor's: [\d.]+x", result.stdout)


def test_stragglers_benchmark_smoke_run():
    """``benchmarks/stragglers.py --smoke``: one slow-rank run and a short jittery loop, 1 host."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "stragglers.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| slow rank")]
    assert len(rows) == 1 and "1 host x 4 | 1 |" in rows[0], result.stdout
    assert re.search(r"\| (\d+|inf) \| (\d+|inf) \| <= 20: (met|missed) \|$", rows[0]), rows[0]
    assert re.search(r"jittery loop .* \| 10 \| \d+ s \| \d+ \|", result.stdout), result.stdout
    assert re.search(r"a rank's answer: [\d.]+ ms to read 256", result.stdout), result.stdout


def test_agent_import_benchmark_smoke_run():
    """``benchmarks/agent_import.py``: the agent's import against a bare Python, every figure
    printed as min and median, and the import slower than no import at all."""
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "agent_import.py"), "--runs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    figures = {}
    for line in result.stdout.splitlines():
        # A difference of two runs may be below 0 on a loaded machine (CI's load was once 6
        # on 2 cores): still printed, and read.
        match = re.fullmatch(r"(\w+(?: \w+)?) +(-?[\d.]+) +(-?[\d.]+)", line)
        if match:
            figures[match[1]] = (float(match[2]), float(match[3]))
    assert set(figures) == {
        "bare wall",
        "bare cpu",
        "agent wall",
        "agent cpu",
        "importtime",
        "imports wall",
        "imports cpu",
    }, result.stdout
    assert figures["agent cpu"][0] > figures["bare cpu"][0] > 0, result.stdout
    assert figures["importtime"][0] > 0, result.stdout


def test_before_after_reads_every_benchmarks_figures_and_judges_noise():
    spec = importlib.util.spec_from_file_location(
        "before_after", REPO / "benchmarks/before_after.py"
    )
    assert spec is not None and spec.loader is not None
    before_after = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before_after)
    run_table = (
        "| case | ours | floor | ours/0.4 |\n|---|---|---|---|\n"
        "| launch overhead, 1 host: wall | 2.09 s | 2.15 s | 0.36 |\n"
        "| logs: lines/s | 364,525 lines/s | n/a | - |\n"
    )
    many = (
        f"{'':24}{'small':>12}{'large':>12}\n{'seconds':24}{0.8:12.3f}{2.9:12.3f}\n"
        f"launcher threads: 8 at 30 hosts, 27 at 300 hosts\n"
        f"floor {'seconds':18}{0.5:12.3f}\n"
    )
    resilience = "cut link -> function on the spare   median   2.40 s   slowest   2.61 s   (3 runs)"
    found = before_after.figures(run_table + "\n" + many + resilience)
    assert found == {
        "launch overhead, 1 host: wall | ours": 2.09,
        "launch overhead, 1 host: wall | floor": 2.15,
        "launch overhead, 1 host: wall | ours/0.4": 0.36,
        "logs: lines/s | ours": 364525.0,
        "seconds | small": 0.8,
        "seconds | large": 2.9,
        "floor | seconds": 0.5,
        "cut link -> function on the spare | median": 2.40,
        "cut link -> function on the spare | slowest": 2.61,
    }
    assert before_after.verdict([1.0, 1.2], [1.1, 1.3]) == "same"  # ranges overlap
    assert before_after.verdict([1.0, 1.01], [1.05, 1.06]) == "same"  # within 10%
    assert before_after.verdict([1.0, 1.01], [1.2, 1.3]) == "CHANGED"
    assert before_after.verdict([0.0], [0.0]) == "same"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


@pytest.mark.cluster
def test_tree_benchmark_smoke_run_on_bench_hosts():
    """``benchmarks/tree.py`` at its smallest: 3 and 4 bench hosts, radix 2, one run each, tree
    and flat; a row per count and start, every figure as median / slowest, and the model."""
    reason = cluster_unavailable_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"bench test hosts required on CI: {reason}")
        pytest.skip(reason)
    sizes = ["--hosts", "3", "4", "--radix", "2", "--runs", "1"]
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tree.py"), *sizes],
        capture_output=True,
        text=True,
        timeout=240,  # the bench hosts' lock may be held by a benchmark run: start_cluster waits
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [_cells(line) for line in result.stdout.splitlines() if re.match(r"\| \d", line)]
    assert [row[:3] for row in rows] == [
        ["3", "tree radix 2", "1"],
        ["3", "flat", "1"],
        ["4", "tree radix 2", "1"],
        ["4", "flat", "1"],
    ], result.stdout
    figure = r"\d+\.\d\d / \d+\.\d\d (s|ms)"
    for row in rows:
        flat = row[1] == "flat"
        for index, cell in enumerate(row[3:], start=3):
            expected = "-" if flat and index in (6, 7) else figure  # L2 hello, child: tree only
            assert re.fullmatch(expected, cell), (row, cell)
    assert "failed launch" not in result.stdout, result.stdout
    assert re.search(
        r"^model: a -?[\d.]+, b -?[\d.]+, .*cpu_per_host -?[\d.]+$", result.stdout, re.MULTILINE
    )
    assert re.search(
        r"^prediction, 1024 hosts radix 32: call to every function start -?[\d.]+ s .*"
        r"launcher CPU -?[\d.]+ s$",
        result.stdout,
        re.MULTILINE,
    ), result.stdout


def test_tree_simulation_benchmark_smoke_run():
    """``benchmarks/tree_sim.py`` at 64 simulated hosts x 2, radix 8: every rank's result comes
    back (it asserts so itself) and the simulated figures are printed beside the model's."""
    sizes = ["--hosts", "64", "--workers", "2", "--radix", "8", "--simulators", "2"]
    schedule = [
        "--first",
        "0.2",
        "--per-start",
        "0.04",
        "--child",
        "0.1",
        "--workers-after",
        "0.05",
    ]
    result = subprocess.run(
        [
            *(sys.executable, str(REPO / "benchmarks" / "tree_sim.py"), *sizes, *schedule),
            *("--predicted", "1.5", "0.25"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "simulated agent failed" not in result.stderr, result.stderr[-4000:]
    figures = {}
    for line in result.stdout.splitlines():
        match = re.fullmatch(r"([a-z][a-z ]+?) +([\d.]+|nan) +([\d.]+|nan)", line)
        if match:
            figures[match[1]] = (float(match[2]), float(match[3]))
    assert figures["ranks"][0] == 128, result.stdout
    start, predicted = figures["call to every function start s"]
    assert start >= 0.87 and predicted == 1.5, result.stdout  # never before the schedule's floor
    assert figures["launcher cpu s"][0] > 0 and figures["launcher cpu s"][1] == 0.25
    assert "schedule's floor: 0.87 s" in result.stdout, result.stdout
