"""The benchmarks still run: a smoke run of two cheap cases, ours only (no upstream venv needed).

The whole smoke (every case, every tool) is ``python benchmarks/run.py --smoke``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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
