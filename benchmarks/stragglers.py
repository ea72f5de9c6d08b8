"""Stragglers: steps until a rank twice as slow is named, and false reports of a jittery loop.

Usage::

    python benchmarks/stragglers.py [--runs 3] [--step 0.15] [--jitter-steps 120]
    python benchmarks/stragglers.py --smoke   # 1 run, 1 host only, 10 jittery steps (CI)
    python benchmarks/stragglers.py --jitter-only --jitter-steps 1500   # ten minutes

Each rank sleeps a step's work, then joins an all_reduce of 4 floats (gloo, CPU); the default
``straggler_threshold`` (0.1 s) throughout.

- **slow rank**: one rank's work takes twice the others' (``--step`` s against 2 x ``--step``):
  the steps rank 0 had finished when the ``StragglerFound`` event came (target: within 20), on
  1 host x 4 workers (``localhost``) and, as root, on 2 bench test hosts x 2 (``bnode1``,
  ``bnode2``, SSH; set up and stopped here, as by the other benchmarks);
- **jittery loop**: every rank's work is 0.4 s +-50% (uniform), ``--jitter-steps`` steps on
  1 host x 4 (120 steps: about a minute; 1,500: ten minutes), with ``stall_timeout=2``:
  the ``StragglerFound`` and ``Stalled`` events (target: none of either). The
  last rank into each all_reduce is then 0.12 s after the median rank on average (past the
  threshold): only being last again and again names a rank.

It also prints the cost of a rank's answer: reading its recorder (256 entries, the default)
into the timings it sends, and the size of that answer.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time

from testhosts import ssh_hosts, unavailable_reason

import torchrunx as trx
from torchrunx.events import Stalled, StragglerFound

JITTER_STEP = 0.4
JITTER_STALL_TIMEOUT = 2.0
"""The jittery loop's ``stall_timeout``: five mean steps (its slowest step is 0.6 s)."""
STEPS = 40
"""Steps of a slow-rank run (the target is 20)."""


def steps(count: int, step: float, slow: int | None, jitter: float) -> dict[str, object]:
    """``count`` steps; each step's end time, and what one answer of timings costs here."""
    import random  # noqa: PLC0415 (in the workers only)

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from torchrunx.worker import stallprobe  # noqa: PLC0415

    rank = dist.get_rank()
    rng = random.Random(rank)
    t = torch.ones(4)
    ended = []
    for _ in range(count):
        work = 2 * step if rank == slow else step * (1 + rng.uniform(-jitter, jitter))
        time.sleep(work)
        dist.all_reduce(t)
        ended.append(time.time())
    for _ in range(300):  # fill the recorder (256 entries) for the cost below
        dist.all_reduce(t)
    started = time.perf_counter()
    for _ in range(10):
        answer = stallprobe.timings()
    cost = (time.perf_counter() - started) / 10
    return {"ended": ended, "cost": cost, "bytes": len(pickle.dumps(answer))}


STALLED: list[Stalled] = []
"""Every launch's ``Stalled`` events (the jittery loop's are the ones counted)."""


def run(count: int, step: float, slow: int | None, jitter: float, **fields: object) -> tuple:
    """One launch: its StragglerFound events and rank 0's values."""
    found: list[StragglerFound] = []

    def record(event: object) -> None:
        if isinstance(event, StragglerFound):
            found.append(event)
        elif isinstance(event, Stalled):
            STALLED.append(event)

    result = trx.launch(
        steps, (count, step, slow, jitter), backend="gloo", event_handlers=(record,), **fields
    )
    return found, result.ranks[0]


def steps_to_name(runs: int, step: float, slow: int, **fields: object) -> list[float]:
    """Steps rank 0 had finished when the slow rank was named, each run (inf: never)."""
    counts = []
    for _ in range(runs):
        found, values = run(STEPS, step, slow, 0.0, **fields)
        named = [e for e in found if e.rank == slow]
        others = [e.rank for e in found if e.rank != slow]
        if others:
            print(f"  ranks wrongly named: {others}", file=sys.stderr)
        when = named[0].time if named else float("inf")
        counts.append(float(sum(1 for ended in values["ended"] if ended <= when)))
        print(f"  named after {counts[-1]:g} steps", file=sys.stderr)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--step", type=float, default=0.15)
    parser.add_argument("--jitter-steps", type=int, default=120)
    parser.add_argument("--smoke", action="store_true", help="1 run, 1 host, 10 jittery steps")
    parser.add_argument("--jitter-only", action="store_true", help="only the jittery loop")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.jitter_steps = 1, 10
    local = {"hostnames": ["localhost"], "workers_per_host": 4}
    print(
        f"slow rank: work {args.step:g} s a step, {2 * args.step:g} s on the slow rank",
        file=sys.stderr,
    )
    rows = (
        []
        if args.jitter_only
        else [("1 host x 4", steps_to_name(args.runs, args.step, 2, **local))]
    )
    reason = "--smoke" if args.smoke else unavailable_reason()
    if reason and not args.jitter_only:
        print(f"no bench test hosts: {reason}", file=sys.stderr)
    elif not args.jitter_only:
        with ssh_hosts(2) as ssh:
            counts = steps_to_name(args.runs, args.step, 3, workers_per_host=2, **ssh)
            rows.append(("2 SSH hosts x 2", counts))
    started = time.monotonic()
    STALLED.clear()
    found, values = run(
        args.jitter_steps, JITTER_STEP, None, 0.5, stall_timeout=JITTER_STALL_TIMEOUT, **local
    )
    seconds = time.monotonic() - started
    print("| case | runs | steps to name: median | slowest | target |")
    print("| --- | --- | --- | --- | --- |")
    for name, counts in rows:
        slowest = max(counts)
        met = "met" if slowest <= 20 else "missed"
        print(
            f"| slow rank ({args.step:g} s / {2 * args.step:g} s a step), {name} | {len(counts)} "
            f"| {statistics.median(counts):g} | {slowest:g} | <= 20: {met} |"
        )
    print()
    print(
        "| case | steps | launch | StragglerFound events | Stalled events "
        f"(stall_timeout {JITTER_STALL_TIMEOUT:g} s) | target |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    wrong = [e.text for e in found] + [e.text.splitlines()[0] for e in STALLED]
    verdict = "met" if not wrong else "missed: " + "; ".join(wrong)
    print(
        f"| jittery loop ({JITTER_STEP:g} s +-50% a step), 1 host x 4 | {args.jitter_steps} "
        f"| {seconds:.0f} s | {len(found)} | {len(STALLED)} | none: {verdict} |"
    )
    print()
    print(
        f"a rank's answer: {values['cost'] * 1e3:.1f} ms to read 256 recorder entries into "
        f"{values['bytes']:,} bytes (once every 2 s)"
    )


if __name__ == "__main__":
    main()
