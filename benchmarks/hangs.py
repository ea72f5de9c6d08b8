"""Hangs: seconds from a stall's start to the ``Stalled`` event that names its cause.

Usage::

    python benchmarks/hangs.py [--runs 3] [--stall-timeout 5]
    python benchmarks/hangs.py --smoke   # 1 run of each case, 1 host only, stall_timeout 3 s

Each rank runs three all_reduces of 4 floats (gloo, CPU), then, just before its next
collective, writes ``time.time()`` and that collective's sequence number (read from its own
flight recorder) to a file. Then:

- **a sleeping rank**: one rank sleeps (a minute) before the all_reduce that the others wait in;
- **a mismatch**: ranks 0-1 enter an all_reduce, ranks 2-3 a broadcast, at the same sequence
  number.

With ``stall_timeout`` (``--stall-timeout``, 5 s) and ``on_stall="fail"``, the time from the
stall's start (the latest rank's ``time.time()`` before that collective: the last progress
any rank made) to the ``Stalled`` event's time (target: ``stall_timeout`` + 2 s), on 1 host x 4
workers (``localhost``) and, as root, on 2 bench test hosts x 2 (SSH; the sleeping rank on
the second host). Each diagnosis is checked: the sleeping rank named as not entered, at its
file:line, the others waiting in the all_reduce with the right sequence number; or the two
collectives named as a mismatch at that number. Median and slowest of ``--runs``. The exit
status is 1 if any diagnosis was wrong (the timing target is printed, not asserted).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testhosts import ssh_hosts, unavailable_reason

import torchrunx as trx
from torchrunx.errors import StallError
from torchrunx.events import Stalled

SLEEP = 60.0
"""The sleeping rank's sleep: far past any stall_timeout here (on_stall="fail" ends it)."""


def hang(folder: str, case: str, sleeper: int) -> int:
    """Three all_reduces, then the hang of ``case``: ``"sleep"`` or ``"mismatch"``."""
    import torch  # noqa: PLC0415 (in the workers only)
    import torch.distributed as dist  # noqa: PLC0415

    from torchrunx.worker import stallprobe  # noqa: PLC0415

    rank = dist.get_rank()
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    seq = 1 + max(s for group, s, _ in stallprobe.timings().entries if group == "default_pg")
    Path(folder, f"began-{rank}").write_text(json.dumps({"time": time.time(), "seq": seq}))
    if case == "sleep" and rank == sleeper:
        time.sleep(SLEEP)
    if case == "mismatch" and rank >= 2:
        dist.broadcast(t, src=2)
    else:
        dist.all_reduce(t)
    return rank


def check(case: str, event: Stalled, began: dict[str, Any], sleeper: int, world: int) -> str:
    """What the diagnosis got wrong ("" if it named the cause right)."""
    values, text, seq = event.diagnosis, event.text, began["seq"]
    if case == "mismatch":
        found = {(w["op"], w["seq"], tuple(w["ranks"])) for w in values["waiting"]}
        want = {("all_reduce", seq, (0, 1)), ("broadcast", seq, (2, 3))}
        if values.get("mismatch") is not True or found != want:
            return f"not the mismatch at #{seq}: {found}"
        return "" if "mismatched collectives: " in text else "no 'mismatched collectives' line"
    others = tuple(r for r in range(world) if r != sleeper)
    found = {(w["op"], w["seq"], tuple(w["ranks"])) for w in values["waiting"]}
    if found != {("all_reduce", seq, others)}:
        return f"not ranks {others} waiting in all_reduce #{seq}: {found}"
    lines, first = inspect.getsourcelines(hang)
    line = first + next(i for i, text in enumerate(lines) if "time.sleep(SLEEP)" in text)
    site = f"hangs.py:{line} in hang"
    absent = {where: ranks for where, ranks in values["absent"].items() if sleeper in ranks}
    if len(absent) != 1 or not next(iter(absent)).endswith(site):
        return f"rank {sleeper} not named at {site}: {values['absent']}"
    wanted = (f"all_reduce #{seq} of default_pg", f"rank {sleeper}: ", site, f"--- rank {sleeper} ")
    missing = [part for part in wanted if part not in text]
    return f"the text lacks {missing}" if missing else ""


def once(case: str, stall_timeout: float, sleeper: int, **fields: object) -> tuple[float, str]:
    """One launch: seconds from the stall's start to the Stalled event, and what was wrong."""
    events: list[Stalled] = []
    with tempfile.TemporaryDirectory() as folder:
        try:
            trx.launch(
                hang,
                (folder, case, sleeper),
                backend="gloo",
                stall_timeout=stall_timeout,
                on_stall="fail",
                event_handlers=(lambda e: events.append(e) if isinstance(e, Stalled) else None,),
                **fields,  # type: ignore[arg-type]
            )
        except StallError:
            pass
        except Exception as error:  # noqa: BLE001 (a result: printed, counted as wrong)
            return float("inf"), f"the launch raised {error!r}"[:500]
        else:
            return float("inf"), "the launch ended without a stall"
        files = sorted(Path(folder).glob("began-*"))
        world = len(files)
        began = [json.loads(path.read_text()) for path in files]
    if not events:
        return float("inf"), "no Stalled event"
    start = max(b["time"] for b in began)
    if len({b["seq"] for b in began}) != 1:  # the ranks disagree on the collective's number
        return events[0].time - start, f"the ranks' next sequence numbers differ: {began}"
    return events[0].time - start, check(case, events[0], began[0], sleeper, world)


def measure(runs: int, stall_timeout: float, sleeper: int, **fields: object) -> dict[str, list]:
    """``runs`` of each case, the cases taking turns: {case: [(seconds, wrong), ...]}."""
    got: dict[str, list] = {"sleep": [], "mismatch": []}
    for _ in range(runs):
        for case, values in got.items():
            seconds, wrong = once(case, stall_timeout, sleeper, **fields)
            values.append((seconds, wrong))
            print(f"  {case}: {seconds:.2f} s {wrong or 'named right'}", file=sys.stderr)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stall-timeout", type=float, default=5.0)
    parser.add_argument("--smoke", action="store_true", help="1 run of each case, 1 host only")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.stall_timeout = 1, 3.0
    setups = [("1 host x 4", measure(args.runs, args.stall_timeout, 2, **LOCAL))]
    reason = "--smoke" if args.smoke else unavailable_reason()
    if reason:
        print(f"no bench test hosts: {reason}", file=sys.stderr)
    else:
        with ssh_hosts(2) as ssh:
            got = measure(args.runs, args.stall_timeout, 3, workers_per_host=2, **ssh)
            setups.append(("2 SSH hosts x 2", got))
    target = args.stall_timeout + 2
    names = {"sleep": "a rank sleeps before an all_reduce", "mismatch": "mismatched collectives"}
    print(
        f"| case | setup | runs | stall to Stalled event: median | slowest "
        f"| target (stall_timeout {args.stall_timeout:g} s + 2 s) | diagnosis |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    wrong_any = False
    for setup, got in setups:
        for case, values in got.items():
            seconds = [s for s, _ in values]
            slowest = max(seconds)
            wrong = [w for _, w in values if w]
            met = "met" if slowest <= target else "missed"
            right = "named right" if not wrong else "wrong: " + "; ".join(wrong)
            print(
                f"| {names[case]} | {setup} | {len(values)} | {statistics.median(seconds):.2f} s "
                f"| {slowest:.2f} s | <= {target:g} s: {met} | {right} |"
            )
            wrong_any = wrong_any or bool(wrong)
    if wrong_any:  # a wrong diagnosis is a bug, not a figure: the exit status says so
        sys.exit(1)


LOCAL = {"hostnames": ["localhost"], "workers_per_host": 4}

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as logs:  # the stall-N.txt files, gone at the end
        os.environ.setdefault("TORCHRUNX_LOG_DIR", logs)
        main()
