"""The agent's imports against a bare Python: what every agent pays before its hello.

    python benchmarks/agent_import.py [--runs 15] [--no-compile] [--against DIR]

Each run starts two fresh interpreters, one after the other: ``python -c pass`` (the floor:
the interpreter and its ``site``) and ``python -c "import torchrunx.agent.agent"`` (what the
boot code of every agent imports, ``torchrunx.wire.bootstrap.BOOT_CODE``). It prints, as min
and median over the runs: their wall times and CPU times, the difference (the agent's imports),
and the import's own time as ``python -X importtime`` reports it (the cumulative time of
``torchrunx.agent.agent``, in a third interpreter). The package is compiled to bytecode first,
as ``pip install`` compiles it (``--no-compile``: as it is, which where
``PYTHONDONTWRITEBYTECODE`` is set means compiled from source at every start). ``--against
DIR``: the same figures for another checkout's ``torchrunx`` (an earlier commit's, for
example ``git archive COMMIT torchrunx | tar -x -C DIR``), measured in turn with this one's in
every run, so that both see the same load.

What follows the hello (the preload thread's ``import torchrunx.worker.worker``, and torch's
when the backend needs it, ``torchrunx.agent.preload``) is not counted here: it overlaps the
wait for the other hosts' hellos and for the spec.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import compile_ours

REPO = Path(__file__).resolve().parent.parent
AGENT = "import torchrunx.agent.agent"


def children_cpu() -> float:
    """CPU seconds (user and system) of this process's ended children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(env: dict[str, str], figures: dict[str, list[float]]) -> None:
    """One run: a bare Python, the agent's import, and ``-X importtime``'s figure."""
    for name, code in (("bare", "pass"), ("agent", AGENT)):
        wall, cpu = timed(code, env)
        figures[f"{name} wall"].append(wall)
        figures[f"{name} cpu"].append(cpu)
    figures["importtime"].append(import_time(env))


def report(title: str, figures: dict[str, list[float]]) -> None:
    """Min and median of each figure, and of the differences agent - bare."""
    for kind in ("wall", "cpu"):
        figures[f"imports {kind}"] = [
            a - b for a, b in zip(figures[f"agent {kind}"], figures[f"bare {kind}"], strict=True)
        ]
    print(f"{title:<14} {'min ms':>8} {'median ms':>10}")
    for name, values in figures.items():
        ms = [value * 1000 for value in values]
        print(f"{name:<14} {min(ms):>8.1f} {statistics.median(ms):>10.1f}")


def timed(code: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one ``python -c code`` (in the checkout: ``-c`` puts the working
    folder first on ``sys.path``)."""
    cpu = children_cpu()
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, cwd=env["PYTHONPATH"], check=True)
    return time.perf_counter() - began, children_cpu() - cpu


def import_time(env: dict[str, str]) -> float:
    """Seconds of ``import torchrunx.agent.agent`` as ``-X importtime`` reports them."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", AGENT],
        env=env,
        cwd=env["PYTHONPATH"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[2].strip() == "torchrunx.agent.agent":
            return int(parts[1]) / 1e6
    raise RuntimeError(f"no import time for torchrunx.agent.agent in:\n{done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs (min and median)")
    parser.add_argument("--no-compile", action="store_true", help="use the package as it is")
    parser.add_argument("--against", type=Path, help="another checkout, measured in turn")
    args = parser.parse_args()
    trees = {"this checkout": REPO}
    if args.against is not None:
        trees[str(args.against)] = args.against.resolve()
    if not args.no_compile:
        compile_ours()
        for tree in trees.values():
            compileall.compile_dir(tree / "torchrunx", quiet=1)
    names = ("bare wall", "bare cpu", "agent wall", "agent cpu", "importtime")
    figures = {title: {name: [] for name in names} for title in trees}
    load = os.getloadavg()[0]
    for _ in range(args.runs):
        for title, tree in trees.items():
            measure({**os.environ, "PYTHONPATH": str(tree)}, figures[title])
    print(
        f"{args.runs} runs, load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at "
        f"the end; {'as it is' if args.no_compile else 'compiled to bytecode'}"
    )
    for title in trees:
        report(title, figures[title])


if __name__ == "__main__":
    main()
