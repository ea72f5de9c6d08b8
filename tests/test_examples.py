"""Every numbered example runs as its usage docstring says, and prints what it promises."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_frameworks import EXAMPLES as FRAMEWORK_EXAMPLES

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("[0-9][0-9]_*.py"))
# Examples that train with Transformers, Lightning...: tests/test_frameworks.py runs them.
FRAMEWORK_SCRIPTS = sorted(example.script for example in FRAMEWORK_EXAMPLES.values())

# Per example: small arguments, and patterns its output must match (in order, one line each).
RUNS: dict[str, tuple[list[str], list[str]]] = {
    "01_train_ddp.py": (
        ["--steps", "20"],
        [
            r"\[localhost:0\] rank 0/2 \(LOCAL_RANK=0\): final loss \d\.\d+",
            r"rank 0 returned: \{'loss': [\d.e-]+, 'weights': \[.+\], 'bias': .+\}",
            r"all ranks hold the same weights: True",
        ],
    ),
    "02_train_then_test.py": (
        ["--steps", "30"],
        [
            r"trained on 2 workers: weight \[\[1\.9\d*, -2\.9\d*\]\]",
            r"tested on 1 worker: test loss 0\.00\d+",
        ],
    ),
    "03_tyro_cli.py": (
        ["--hostnames", "localhost", "--workers-per-host", "2", "--backend", "gloo"],
        [r"rank 0 of 2 on .+: sum of ranks 1", r"rank 1 of 2 on .+: sum of ranks 1"],
    ),
    "04_argparse.py": (
        ["--steps", "5", "--workers-per-host", "2"],
        [r"final loss per rank: \[[\d.]+, [\d.]+\]"],
    ),
    "05_checkpoint.py": (
        ["--steps", "30", "--out-dir", "{tmp}/ckpt"],
        [
            r"rank 0 saved {tmp}/ckpt/model\.pt",
            r"loaded after 30 steps: weights \[1\.0, 2\.0, 3\.0\]",
        ],
    ),
    "12_debug_a_rank.py": (  # no terminal here: the breakpoint is skipped (test_debugger)
        ["--steps", "5"],
        [r"final loss per rank: \[[\d.]+, [\d.]+\]"],
    ),
    "13_preempt_and_resume.py": (  # SIGTERM to itself once rank 0 has run 0.2 s
        # (its default 3 s raced the 400 steps, which an idle machine runs in under 3 s)
        ["--steps", "400", "--preempt-after", "0.2", "--ckpt", "{tmp}/ckpt.pt"],
        [
            r"preempted \(the launcher received SIGTERM\): saved at step \[\d+\], by rank 0",
            r"resumed from step \d+, finished at step 400",
            r"weights \[1\.0, 2\.0, 3\.0\]",
        ],
    ),
    "11_warm_sweep.py": (
        ["--lrs", "0.05", "1000", "0.2", "--steps", "20"],
        [
            r"lr=0\.05: loss [\d.]+, call to result [\d.]+ s, of which training [\d.]+ s",
            r"lr=1000\.0: failed \(lr=1000\.0 diverged: loss (nan|inf)\); the agents stay .+",
            r"lr=0\.2: loss [\d.]+, call to result [\d.]+ s, of which training [\d.]+ s",
            r"best lr 0\.2 of 3 runs on the same agents",
        ],
    ),
}


# Examples that need a cluster of their own: the module named runs them on it.
ELSEWHERE = {"14_ray.py": "tests/test_ray.py (on its Ray cluster)"}


def run_example(path: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run an example as a reader would, from ``cwd``, with this checkout importable."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(path), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_every_example_is_run_here():
    assert sorted([*RUNS, *FRAMEWORK_SCRIPTS, *ELSEWHERE]) == [path.name for path in EXAMPLES]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_has_a_usage_docstring(path):
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Usage::" in docstring, f"{path.name} says nowhere how to run it"
    assert f"python examples/{path.name}" in docstring


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.name in RUNS], ids=lambda p: p.name)
def test_example_runs(path, tmp_path):
    args, patterns = RUNS[path.name]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = run_example(path, args, tmp_path)
    assert done.returncode == 0, f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    lines = iter(done.stdout.splitlines())
    for pattern in patterns:
        regex = re.compile(pattern.replace("{tmp}", re.escape(str(tmp_path))))
        assert any(regex.fullmatch(line) for line in lines), (
            f"no line matches {regex.pattern!r} (in order) in:\n{done.stdout}"
        )
