"""Straggler detection on real launches (gloo on CPU): a rank twice as slow is named, jitter is not.

Each rank sleeps a step's work, then joins an all_reduce; the slow rank's work takes twice as
long. The ranks note when each step's all_reduce ended, so that a ``StragglerFound`` event's
time says after how many steps the straggler was named (the target: within 20). The threshold
is 0.05 s, half the fast ranks' step: the slow rank enters each all_reduce about 0.1 s after
the others.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

import torchrunx as trx
from torchrunx.events import LaunchFinished, StragglerFound

STEP = 0.1
THRESHOLD = 0.05


def steps(count: int, step: float, slow: int | None, jitter: float) -> list[float]:
    """``count`` steps of ``step`` s of work (rank ``slow``'s twice as long; others jittered)."""
    import random

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    rng = random.Random(rank)  # noqa: S311 (made-up work)
    t = torch.ones(4)
    ended = []
    for _ in range(count):
        work = 2 * step if rank == slow else step * (1 + rng.uniform(-jitter, jitter))
        time.sleep(work)
        dist.all_reduce(t)
        ended.append(time.time())
    return ended


def _launch(slow: int | None, count: int, jitter: float = 0.0, step: float = STEP, **fields):
    events: list[object] = []
    on_found = fields.pop("on_found", None)

    def record(event: object) -> None:
        events.append(event)
        if on_found is not None and isinstance(event, StragglerFound):
            on_found.set()

    result = trx.launch(
        steps,
        func_args=(count, step, slow, jitter),
        backend="gloo",
        straggler_threshold=fields.pop("straggler_threshold", THRESHOLD),
        event_handlers=(record,),
        **{"hostnames": ["localhost"], "workers_per_host": 4, **fields},
    )
    found = [e for e in events if isinstance(e, StragglerFound)]
    [finished] = [e for e in events if isinstance(e, LaunchFinished)]
    return result, found, finished


def _view_marks() -> dict[int, bool]:
    """Each rank's ``straggler`` field in a snapshot of this process's launch view."""
    import json
    import socket

    from torchrunx.commands.top import find_views
    from torchrunx.launcher.view.view_server import runtime_dir

    [view] = [v for v in find_views(runtime_dir()) if v.name.startswith(f"{os.getpid()}-")]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(view))
        snapshot = json.loads(sock.makefile("rb").readline())
    return {w["rank"]: w["straggler"] for w in snapshot["report"]["workers"]}


def _steps_before(result: trx.LaunchResult, when: float) -> int:
    """How many steps rank 0 had finished at ``when``."""
    return sum(1 for ended in result.ranks[0] if ended <= when)


def test_a_rank_twice_as_slow_is_named_within_20_steps_once_with_a_warning(caplog, capfd):
    caplog.set_level(logging.WARNING, logger="torchrunx.launcher")
    named = threading.Event()

    marks: list[dict[int, bool]] = []

    def look_once_named() -> None:  # Ctrl-\ once it is named: the collective view names it
        if named.wait(60):
            os.kill(os.getpid(), signal.SIGQUIT)
            marks.append(_view_marks())  # and torchrunx top's mark column

    threading.Thread(target=look_once_named, daemon=True).start()
    result, found, finished = _launch(slow=2, count=30, on_found=named)
    assert [(e.rank, e.hostname) for e in found] == [(2, "localhost")]  # once, while it ran
    event = found[0]
    assert event.text.startswith("rank 2 enters collectives 0.")
    assert event.lateness >= THRESHOLD and event.last_share >= 0.6
    named_after = _steps_before(result, event.time)
    print(f"named after {named_after} steps ({event.text})")
    assert named_after <= 20
    warnings = [r.getMessage() for r in caplog.records if "a straggler" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("torchrunx: rank 2 enters collectives")
    assert "on localhost (straggler_threshold=0.05 s)" in warnings[0]
    assert len(result.stragglers) == 1 and result.stragglers[0].startswith("rank 2 enters")
    assert finished.stragglers == result.stragglers
    assert marks == [{0: False, 1: False, 2: True, 3: False}]
    err = capfd.readouterr().err
    view = err[err.index("torchrunx: the collectives every rank is in") :]
    assert "straggler: rank 2 enters collectives 0." in view


def test_a_jittery_healthy_loop_names_nobody():
    # Step times of 0.15 s +-50%: the last rank is up to 0.07 s late, past the threshold,
    # but a different rank each time.
    result, found, finished = _launch(slow=None, count=30, jitter=0.5, step=0.15)
    assert found == [] and result.stragglers == () and finished.stragglers == ()


def test_a_short_run_names_its_straggler_at_the_end_and_none_turns_it_off():
    # 8 steps (1.6 s), over about when the first request goes out (2 s after the ranks
    # started): named from the timings each rank sends with its result. Stall detection off:
    # the workers' probe runs for the stragglers alone.
    result, found, _ = _launch(slow=1, count=8, stall_timeout=None)
    assert [e.rank for e in found] == [1] and result.stragglers[0].startswith("rank 1 ")
    result, found, finished = _launch(slow=1, count=12, straggler_threshold=None)
    assert found == [] and result.stragglers == () and finished.stragglers == ()


@pytest.mark.cluster
def test_a_rank_twice_as_slow_on_the_ssh_test_hosts_is_named_within_20_steps(cluster):
    node1, node2 = cluster.names()
    result, found, _ = _launch(
        slow=3,
        count=30,
        hostnames=[node1, node2],
        workers_per_host=2,
        ssh_config_file=cluster.ssh_config,
    )
    assert [(e.rank, e.hostname) for e in found] == [(3, node2)]
    named_after = _steps_before(result, found[0].time)
    print(f"named after {named_after} steps on the SSH test hosts ({found[0].text})")
    assert named_after <= 20


@pytest.mark.cluster
def test_a_jittery_healthy_loop_on_the_ssh_test_hosts_names_nobody(cluster):
    result, found, _ = _launch(
        slow=None,
        count=30,
        jitter=0.5,
        step=0.15,
        hostnames=cluster.names(),
        workers_per_host=2,
        ssh_config_file=cluster.ssh_config,
    )
    assert found == [] and result.stragglers == ()


def test_each_warm_run_names_its_own_stragglers():
    launcher = trx.Launcher(
        hostnames=["localhost"],
        workers_per_host=4,
        backend="gloo",
        straggler_threshold=THRESHOLD,
    )
    with launcher.warm(keep_workers=True) as warm:
        slow = warm.run(steps, 12, STEP, 3, 0.0)
        even = warm.run(steps, 12, STEP, None, 0.0)
    assert len(slow.stragglers) == 1 and slow.stragglers[0].startswith("rank 3 enters")
    assert even.stragglers == ()
