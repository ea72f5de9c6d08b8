"""Stall detection on real launches (gloo on CPU, localhost): each hang names itself.

Each launch has a stall_timeout of 2 s; the diagnosis comes as a ``Stalled`` event (and on
stderr, and in the log folder). Timings are measured from the moment the stall began (the
last collective that completed) to the diagnosis.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time

import pytest
from conftest import touch_then_sleep, when_file_appears

import torchrunx as trx
from torchrunx.errors import StallError
from torchrunx.events import Stalled
from torchrunx.launcher.launch.stalls import ON_DEMAND
from torchrunx.worker.stallprobe import RECORDER_ENTRIES, loaded_c10d, recorder_env

STALL = 2.0
STALL_SSH = 5.0
"""On the SSH test hosts: their ranks may take over 2 s to form the group on a loaded machine,
and the clock runs from the attempt's start (the ranks' checks do not depend on it)."""


def _launch(func, workers=3, backend="gloo", on_stall="report", **fields):
    del func
    events: list[Stalled] = []
    fields.setdefault("stall_timeout", STALL)

    def record(event: object) -> None:
        if isinstance(event, Stalled):
            events.append(event)

    launcher = trx.Launcher(
        hostnames=["localhost"],
        workers_per_host=workers,
        backend=backend,
        on_stall=on_stall,
        event_handlers=(record,),
        **fields,
    )
    return launcher, events


def _run(func, *args, **kwargs):
    launcher, events = _launch(func, **kwargs)
    result = launcher.run(func, *args)
    return result, events


# -- the functions the ranks run --------------------------------------------------------------


def sleep_before_all_reduce(folder: str) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    with open(f"{folder}/stall-began-{dist.get_rank()}", "w") as f:
        f.write(str(time.time()))
    if dist.get_rank() == 1:
        while not os.path.exists(f"{folder}/go"):
            time.sleep(0.05)  # the sleeping rank
    dist.all_reduce(t)
    return dist.get_rank()


def skip_an_all_reduce(folder: str) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(2, 3)
    dist.all_reduce(t)
    if dist.get_rank() != 2:
        dist.all_reduce(t)  # rank 2 skips it
    else:
        threading.Event().wait(60)  # and waits in its own code
    return 0


def mismatched_ops() -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() < 2:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=2)
    return 0


def deadlock_in_user_code() -> int:
    first, second = threading.Lock(), threading.Lock()
    first.acquire()
    helper = threading.Thread(target=lambda: (second.acquire(), first.acquire()), daemon=True)
    helper.start()
    time.sleep(0.2)
    second.acquire()  # the helper holds it and waits for ours: a deadlock, no collective
    return 0


def progress_then_sleep() -> int:
    trx.progress()  # backend=None: the stall clock starts here
    assert "torch.distributed" not in sys.modules
    time.sleep(60)
    return 0


def hang_in_init_process_group() -> int:
    import datetime as dt

    import torch.distributed as dist

    trx.progress()  # backend=None: the stall clock starts here
    dist.init_process_group(  # one rank more than there are: every rank waits for it
        "gloo",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]) + 1,
        timeout=dt.timedelta(seconds=60),
    )
    return 0


def healthy_loop(steps: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    for step in range(steps):
        time.sleep(0.6 if step % 2 else 0.2)
        dist.all_reduce(t)
    return 0


def progress_without_collectives(steps: int) -> int:
    for _ in range(steps):
        time.sleep(0.5)
        trx.progress()
    return 0


# -- the tests --------------------------------------------------------------------------------


def test_a_rank_that_sleeps_before_an_all_reduce_is_named_with_its_stack_and_seq(tmp_path):
    folder = str(tmp_path)
    launcher, events = _launch(sleep_before_all_reduce)
    found = threading.Event()

    def release() -> None:  # once the diagnosis came, the sleeper goes on: the launch ends
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:
            time.sleep(0.05)
        found.set()
        (tmp_path / "go").touch()

    threading.Thread(target=release, daemon=True).start()
    seen = time.time()
    result = launcher.run(sleep_before_all_reduce, folder)
    assert found.is_set() and result.ranks == [0, 1, 2]
    [event] = events
    began = max(float((tmp_path / f"stall-began-{r}").read_text()) for r in range(3))
    took = event.time - began
    assert STALL <= took < STALL + 2, took
    del seen
    values = event.diagnosis
    [waiting] = values["waiting"]
    assert (waiting["op"], waiting["seq"], waiting["ranks"]) == ("all_reduce", 5, [0, 2])
    assert waiting["sizes"] == [[4]] and waiting["group"] == "default_pg"
    assert "test_hangs.py" in waiting["site"] and "sleep_before_all_reduce" in waiting["site"]
    [(where, ranks)] = values["absent"].items()
    assert ranks == [1] and "test_hangs.py" in where and "in sleep_before_all_reduce" in where
    assert values["unanswered"] == []
    assert "sleep_before_all_reduce" in values["stacks"]["1"]
    assert "ranks 0, 2 wait in all_reduce #5 of default_pg ([4] Float)" in event.text
    assert "not entered all_reduce #5 of default_pg:" in event.text
    assert "--- rank 1 (local rank 1 on host 'localhost') ---" in event.text
    assert "stallprobe" not in event.text  # the probe's own thread is left out
    assert event.action == "report"


def test_the_diagnosis_is_written_to_the_log_folder_and_stderr(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", str(tmp_path / "logs"))
    with pytest.raises(StallError):
        _run(skip_an_all_reduce, str(tmp_path), on_stall="fail")
    [text_file] = list((tmp_path / "logs").rglob("stall-1.txt"))
    [json_file] = list((tmp_path / "logs").rglob("stall-1.json"))
    text = text_file.read_text()
    assert text.startswith("torchrunx: no rank made progress for ")
    values = json.loads(json_file.read_text())
    assert values["waiting"][0]["ranks"] == [0, 1] and values["waiting"][0]["seq"] == 3
    assert "torchrunx: no rank made progress for " in capfd.readouterr().err


def test_a_rank_that_skips_a_collective_is_named_where_it_waits(tmp_path):
    with pytest.raises(StallError) as caught:
        _run(skip_an_all_reduce, str(tmp_path), on_stall="fail")
    error = caught.value
    [waiting] = error.diagnosis["waiting"]
    assert (waiting["op"], waiting["seq"], waiting["ranks"]) == ("all_reduce", 3, [0, 1])
    assert waiting["sizes"] == [[2, 3]]
    [(where, ranks)] = error.diagnosis["absent"].items()
    assert ranks == [2] and "in skip_an_all_reduce" in where
    assert "rank 2: " in str(error) and "in skip_an_all_reduce" in str(error)
    assert isinstance(error, TimeoutError) and error.seconds >= STALL


def test_mismatched_collectives_are_named_as_a_mismatch():
    with pytest.raises(StallError) as caught:
        _run(mismatched_ops, workers=4, on_stall="fail")
    values = caught.value.diagnosis
    assert values["mismatch"] is True
    found = {(w["op"], w["seq"], tuple(w["ranks"])) for w in values["waiting"]}
    assert found == {("all_reduce", 3, (0, 1)), ("broadcast", 3, (2, 3))}
    assert "mismatched collectives: " in caught.value.text


def test_a_deadlock_in_user_code_with_no_collective_names_where_every_rank_is():
    with pytest.raises(StallError) as caught:
        _run(deadlock_in_user_code, workers=2, on_stall="fail")
    values = caught.value.diagnosis
    assert values["waiting"] == [] and values["mismatch"] is False
    assert values["phases"] == {"in the user's code": [0, 1]}
    [(where, ranks)] = values["absent"].items()
    assert ranks == [0, 1] and "in deadlock_in_user_code" in where
    assert "no rank waits in a collective; where they are:" in caught.value.text
    assert "ranks 0-1 in the user's code" in caught.value.text


def test_without_a_process_group_every_rank_still_answers_the_look():
    # backend=None and no torch.distributed in the workers: their probe used to fail on the
    # missing recorder and end, and every rank was named as not answering.
    with pytest.raises(StallError) as caught:
        _run(progress_then_sleep, workers=2, backend=None, on_stall="fail")
    values = caught.value.diagnosis
    assert values["waiting"] == [] and values["unanswered"] == []
    [(where, ranks)] = values["absent"].items()
    assert ranks == [0, 1] and "in progress_then_sleep" in where
    assert "no rank waits in a collective; where they are:" in caught.value.text


def test_a_hang_inside_init_process_group_is_before_the_group_formed():
    with pytest.raises(StallError) as caught:
        _run(hang_in_init_process_group, workers=2, backend=None, on_stall="fail")
    values = caught.value.diagnosis
    assert values["phases"] == {"before the process group formed": [0, 1]}
    [(where, ranks)] = values["absent"].items()
    assert ranks == [0, 1] and "in hang_in_init_process_group" in where
    assert "ranks 0-1 before the process group formed" in caught.value.text


def test_restart_on_a_stall_restarts_then_raises_the_stall():
    launcher, events = _launch(
        skip_an_all_reduce, on_stall="restart", max_restarts=1, restart_on=("timeouts",)
    )
    with pytest.raises(StallError) as caught:
        launcher.run(skip_an_all_reduce, "")
    assert [e.action for e in events] == ["restart", "restart"]  # one per attempt
    assert caught.value.diagnosis["waiting"][0]["ranks"] == [0, 1]


def test_a_healthy_loop_with_jittery_steps_and_progress_calls_is_never_reported():
    result, events = _run(healthy_loop, 12, workers=2)
    assert result.ranks == [0, 0] and events == []
    result, events = _run(progress_without_collectives, 10, workers=2, backend=None)
    assert result.ranks == [0, 0] and events == []


def test_the_users_recorder_size_is_kept_and_the_recorder_is_on_otherwise(monkeypatch):
    def size() -> str | None:
        return os.environ.get("TORCH_FR_BUFFER_SIZE")

    launcher, _ = _launch(size, workers=1, backend=None)
    assert launcher.run(size).ranks == [str(RECORDER_ENTRIES)]
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "10")
    launcher, _ = _launch(size, workers=1, backend=None)
    assert launcher.run(size).ranks == [None]
    launcher, _ = _launch(size, workers=1, backend=None, stall_timeout=None)
    assert launcher.run(size).ranks == [None]


def sleep_on_the_last_rank(folder: str) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(8)
    for _ in range(3):
        dist.all_reduce(t)
    with open(f"{folder}/stall-began-{dist.get_rank()}", "w") as f:
        f.write(str(time.time()))
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(120)  # the sleeping rank, on the second host
    dist.all_reduce(t)
    return 0


def test_the_installed_torch_reads_the_backend_neutral_recorder_size():
    import torch.distributed  # noqa: F401 (loads torch._C._distributed_c10d)

    c10d = loaded_c10d()
    assert c10d is not None and hasattr(c10d, "_dump_fr_trace")
    assert recorder_env({}, c10d) == {"TORCH_FR_BUFFER_SIZE": str(RECORDER_ENTRIES)}


@pytest.mark.cluster
def test_a_sleeping_rank_on_a_remote_host_is_named_within_seconds(cluster, tmp_path):
    node1, node2 = cluster.names()
    events: list[Stalled] = []
    started = time.monotonic()
    with pytest.raises(StallError) as caught:
        trx.launch(
            sleep_on_the_last_rank,
            func_args=(str(tmp_path),),
            hostnames=[node1, node2],
            workers_per_host=2,
            backend="gloo",
            ssh_config_file=cluster.ssh_config,
            stall_timeout=STALL,
            on_stall="fail",
            event_handlers=(lambda e: events.append(e) if isinstance(e, Stalled) else None,),
        )
    values = caught.value.diagnosis
    [waiting] = values["waiting"]
    assert (waiting["op"], waiting["seq"], waiting["ranks"]) == ("all_reduce", 5, [0, 1, 2])
    [(where, ranks)] = values["absent"].items()
    assert ranks == [3] and "in sleep_on_the_last_rank" in where
    assert f"--- rank 3 (local rank 1 on host {node2!r}) ---" in caught.value.text
    assert values["unanswered"] == []
    assert len(events) == 1
    assert time.monotonic() - started < 60  # not the 120 s sleep
    began = max(float((tmp_path / f"stall-began-{r}").read_text()) for r in range(4))
    assert STALL <= events[0].time - began < STALL + 2  # the target: within stall_timeout + 2 s
    print(f"stall to diagnosis on the SSH test hosts: {events[0].time - began:.2f} s")


def test_ctrl_backslash_adds_the_collective_view_and_the_launch_goes_on(tmp_path, capfd):
    launcher, events = _launch(sleep_before_all_reduce, stall_timeout=300)

    waiting = "ranks 0, 2 wait in all_reduce #5 of default_pg ([4] Float)"
    seen: list[str] = []  # stderr so far, read by the thread below

    def look_then_release() -> None:
        # Ctrl-\ until a view shows ranks 0 and 2 inside the all_reduce (on a loaded machine
        # they may not have entered it when rank 1 wrote its file), then release rank 1.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            (tmp_path / f"stall-began-{r}").exists() for r in range(3)
        ):
            time.sleep(0.05)
        while time.monotonic() < deadline:
            os.kill(os.getpid(), signal.SIGQUIT)
            shown = len("".join(seen).split(ON_DEMAND))
            answered = time.monotonic() + 10
            while time.monotonic() < min(deadline, answered):
                seen.append(capfd.readouterr().err)
                views = "".join(seen).split(ON_DEMAND)
                if len(views) > shown and "straggler" in views[-1]:  # its last line is in
                    break
                time.sleep(0.05)
            if waiting in "".join(seen).split(ON_DEMAND)[-1]:
                break
            time.sleep(0.2)
        (tmp_path / "go").touch()

    looker = threading.Thread(target=look_then_release, daemon=True)
    looker.start()
    assert launcher.run(sleep_before_all_reduce, str(tmp_path)).ranks == [0, 1, 2]
    looker.join(timeout=5)
    err = "".join(seen) + capfd.readouterr().err
    assert "torchrunx: where every rank is" in err  # the stacks, as before
    view = err[err.rindex(ON_DEMAND) :]
    assert waiting in view
    assert "  rank 1: " in view and "in sleep_before_all_reduce" in view
    assert "no straggler: no rank of ranks 0-2 entered most recent collectives last" in view
    assert events == []  # no stall was reported


def sleep_long_before_all_reduce() -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        time.sleep(120)
    dist.all_reduce(t)
    return 0


def test_launch_timeout_names_the_collective_the_ranks_wait_in():
    launcher, _ = _launch(sleep_long_before_all_reduce, stall_timeout=300, launch_timeout=15)
    with pytest.raises(trx.LaunchTimeoutError) as caught:
        launcher.run(sleep_long_before_all_reduce)
    notes = "\n".join(caught.value.__notes__)
    view = notes[notes.index("what the ranks were doing at the limit:") :]
    assert "ranks 0, 2 wait in all_reduce #3 of default_pg ([4] Float)" in view
    assert "  rank 1: " in view and "in sleep_long_before_all_reduce" in view


def test_a_lost_host_s_error_says_what_the_other_ranks_were_doing(tmp_path):
    from torchrunx.events import AgentStarted

    agents: list[int] = []
    frozen: list[int] = []

    def record(event: object) -> None:
        if isinstance(event, AgentStarted) and event.host_index == 1:
            agents.append(event.pid)

    def freeze() -> None:  # the second host's agent stops answering: lost after agent_timeout
        os.kill(agents[0], signal.SIGSTOP)
        frozen.append(agents[0])

    launcher = trx.Launcher(
        hostnames=["localhost", "localhost"],
        workers_per_host=2,
        backend="gloo",
        agent_timeout=2,
        event_handlers=(record,),
    )
    # Once rank 3 is past the first all_reduce (so every rank is), ranks 0-2 go on into the next.
    try:
        with (
            when_file_appears(tmp_path / "past-first", freeze),
            pytest.raises(trx.AgentFailedError) as caught,
        ):
            launcher.run(sleep_long_before_all_reduce_on_rank, 3, str(tmp_path))
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    view = notes[notes.index("what the ranks were doing when the host was lost:") :]
    assert "ranks 0-1 wait in all_reduce #3 of default_pg" in view
    # The lost host's ranks are not waited for (the error comes within agent_timeout + 1 s).
    assert "ranks 2-3 on the lost host: not asked" in view
    assert "did not answer" not in view


def sleep_long_before_all_reduce_on_rank(sleeper: int, folder: str) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == sleeper:
        touch_then_sleep(f"{folder}/past-first", 120)
    dist.all_reduce(t)
    return 0


def _skipped(values: dict) -> None:
    [waiting] = values["waiting"]
    assert (waiting["op"], waiting["seq"], waiting["ranks"]) == ("all_reduce", 3, [0, 1, 3])
    [(where, ranks)] = values["absent"].items()
    assert ranks == [2] and "in skip_an_all_reduce" in where


def _mismatched(values: dict) -> None:
    assert values["mismatch"] is True
    found = {(w["op"], w["seq"], tuple(w["ranks"])) for w in values["waiting"]}
    assert found == {("all_reduce", 3, (0, 1)), ("broadcast", 3, (2, 3))}


def _deadlocked(values: dict) -> None:
    assert values["waiting"] == [] and values["phases"] == {"in the user's code": [0, 1, 2, 3]}
    [(where, _)] = values["absent"].items()
    assert "in deadlock_in_user_code" in where


def _before_the_group(values: dict) -> None:
    assert values["phases"] == {"before the process group formed": [0, 1, 2, 3]}


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("func", "args", "backend", "check"),
    [
        (skip_an_all_reduce, ("",), "gloo", _skipped),
        (mismatched_ops, (), "gloo", _mismatched),
        (deadlock_in_user_code, (), "gloo", _deadlocked),
        (hang_in_init_process_group, (), None, _before_the_group),
    ],
    ids=["skip", "mismatch", "deadlock", "init"],
)
def test_each_hang_is_named_on_the_ssh_test_hosts(cluster, func, args, backend, check):
    with pytest.raises(StallError) as caught:
        trx.launch(
            func,
            func_args=args,
            hostnames=cluster.names(),
            workers_per_host=2,
            backend=backend,
            ssh_config_file=cluster.ssh_config,
            stall_timeout=STALL_SSH,
            on_stall="fail",
        )
    assert caught.value.diagnosis["unanswered"] == []
    check(caught.value.diagnosis)
