"""The diagnosis of a stalled launch and the straggler rule, on made-up snapshots (pure)."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

import torchrunx as trx
from torchrunx.launcher.launch.stalls import (
    DEFAULT_STALL_TIMEOUT,
    StallWatch,
    check_stall_fields,
    progress_every,
)
from torchrunx.launcher.state.hangs import (
    CollectiveEntry,
    RankSnapshot,
    Straggler,
    StragglerRule,
    chance_of_being_last,
    diagnose,
    entry_from_recorder,
    find_stragglers,
    ranks_text,
    render,
)
from torchrunx.wire.messages import RankState
from torchrunx.worker.stallprobe import RECORDER_ENTRIES, recorder_env, user_frame


def _done(seq: int, op: str = "all_reduce", group: str = "default_pg") -> CollectiveEntry:
    return CollectiveEntry(
        group, seq, op, ((4,),), ("Float",), done=True, site="train.py:57 in step"
    )


def _pending(seq: int, op: str = "all_reduce", group: str = "default_pg") -> CollectiveEntry:
    return CollectiveEntry(
        group, seq, op, ((4,),), ("Float",), done=False, site="train.py:57 in step"
    )


def _snap(
    rank: int, *entries: CollectiveEntry, where: str = "", formed: bool = True
) -> RankSnapshot:
    return RankSnapshot(rank, "node1", formed, tuple(entries), where=where)


# -- entries from the recorder -----------------------------------------------------------------


def test_rule_a_recorder_entry_keeps_group_seq_op_sizes_and_the_users_call_site():
    raw = {
        "process_group": ("0", "default_pg"),
        "collective_seq_id": 41,
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[4, 2]],
        "input_dtypes": ["Float"],
        "state": "scheduled",
        "retired": False,
        "time_created_ns": 123,
        "frames": [
            {
                "name": "all_reduce",
                "filename": "/venv/lib/torch/distributed/distributed_c10d.py",
                "line": 3245,
            },
            {
                "name": "wrapper",
                "filename": "/venv/lib/torch/distributed/c10d_logger.py",
                "line": 83,
            },
            {"name": "step", "filename": "/home/me/train.py", "line": 57},
            {"name": "<module>", "filename": "/home/me/train.py", "line": 90},
        ],
    }
    entry = entry_from_recorder(raw)
    assert entry == CollectiveEntry(
        "default_pg",
        41,
        "all_reduce",
        ((4, 2),),
        ("Float",),
        done=False,
        created_ns=123,
        site="/home/me/train.py:57 in step",
    )


def test_rule_a_collective_is_done_when_retired_gloo_or_completed_nccl():
    assert entry_from_recorder({"retired": True, "state": "scheduled"}).done
    assert entry_from_recorder({"retired": False, "state": "completed"}).done
    assert not entry_from_recorder({"retired": False, "state": "started"}).done
    assert not entry_from_recorder({}).done


def test_rule_torchrunxs_own_frames_are_not_the_call_site():
    raw = {"frames": [{"name": "run", "filename": "/x/torchrunx/worker/worker.py", "line": 9}]}
    assert entry_from_recorder(raw).site == ""


# -- the diagnosis ---------------------------------------------------------------------------


def test_rule_a_rank_that_never_entered_is_named_with_where_it_is():
    snaps = [_snap(r, _done(40), _pending(41)) for r in (0, 1, 2)]
    snaps.append(_snap(3, _done(40), where="data.py:12 in __next__"))
    diagnosis = diagnose(snaps, 4)
    assert [(w.entry.seq, w.entry.op, w.ranks) for w in diagnosis.waiting] == [
        (41, "all_reduce", (0, 1, 2))
    ]
    assert diagnosis.absent == {"data.py:12 in __next__": (3,)}
    assert not diagnosis.mismatch
    assert diagnosis.phases == {"in a collective": (0, 1, 2), "in the user's code": (3,)}
    text = render(diagnosis)
    assert (
        text[0]
        == "ranks 0-2 wait in all_reduce #41 of default_pg ([4] Float) at train.py:57 in step"
    )
    assert text[1:3] == [
        "not entered all_reduce #41 of default_pg:",
        "  rank 3: data.py:12 in __next__",
    ]


def test_rule_absent_ranks_are_grouped_by_where_they_are():
    snaps = [_snap(0, _pending(7)), _snap(1, _pending(7))]
    snaps += [_snap(r, _done(6), where="data.py:12 in __next__") for r in (2, 4)]
    snaps.append(_snap(3, _done(6), where="ckpt.py:3 in save"))
    diagnosis = diagnose(snaps, 5)
    assert diagnosis.absent == {"data.py:12 in __next__": (2, 4), "ckpt.py:3 in save": (3,)}


def test_rule_a_rank_past_the_collective_is_not_absent():
    # Rank 1 finished #7 and went on (it is in the user's code at #8): it did enter #7.
    snaps = [_snap(0, _pending(7)), _snap(1, _done(7), _done(8), where="x.py:1 in f")]
    assert diagnose(snaps, 2).absent == {}


def test_rule_different_ops_at_one_sequence_number_are_a_mismatch():
    snaps = [_snap(r, _done(40), _pending(41)) for r in range(4)]
    snaps += [_snap(r, _done(40), _pending(41, "broadcast")) for r in range(4, 8)]
    diagnosis = diagnose(snaps, 8)
    assert diagnosis.mismatch
    assert render(diagnosis)[0] == (
        "mismatched collectives: ranks 0-3 in all_reduce #41 of default_pg ([4] Float) at "
        "train.py:57 in step; ranks 4-7 in broadcast #41 of default_pg ([4] Float) at "
        "train.py:57 in step"
    )


def test_rule_one_op_in_two_groups_at_the_same_number_is_no_mismatch():
    snaps = [_snap(0, _pending(3, group="a")), _snap(1, _pending(3, "broadcast", group="b"))]
    assert not diagnose(snaps, 2).mismatch


def test_rule_the_same_op_at_different_numbers_waits_in_two_places_without_a_mismatch():
    # A rank that skipped a collective: the others wait in #5, it waits in #6.
    snaps = [_snap(0, _pending(5)), _snap(1, _pending(5)), _snap(2, _pending(6))]
    diagnosis = diagnose(snaps, 3)
    assert not diagnosis.mismatch
    assert [(w.entry.seq, w.ranks) for w in diagnosis.waiting] == [(5, (0, 1)), (6, (2,))]


def test_rule_ranks_before_the_group_formed_are_said_so():
    snaps = [
        _snap(0, formed=False, where="train.py:3 in main"),
        _snap(1, formed=True, where="x.py:1 in f"),
    ]
    diagnosis = diagnose(snaps, 3)
    assert diagnosis.phases == {
        "before the process group formed": (0,),
        "in the user's code": (1,),
    }
    assert diagnosis.unanswered == (2,)
    assert render(diagnosis) == [
        "no rank waits in a collective; where they are:",
        "  rank 0: train.py:3 in main",
        "  rank 1: x.py:1 in f",
        "rank 0 before the process group formed",
        "rank 1 in the user's code",
        "rank 2 did not answer in time (their host is silent, or the rank holds Python's GIL)",
    ]


def test_rule_no_collective_at_all_is_a_deadlock_in_user_code():
    snaps = [_snap(0, where="a.py:1 in lock"), _snap(1, where="a.py:1 in lock")]
    diagnosis = diagnose(snaps, 2)
    assert diagnosis.waiting == ()
    assert diagnosis.absent == {"a.py:1 in lock": (0, 1)}
    assert render(diagnosis) == [
        "no rank waits in a collective; where they are:",
        "  ranks 0-1: a.py:1 in lock",
        "ranks 0-1 in the user's code",
    ]


def test_rule_the_diagnosis_as_json_names_the_same_facts():
    snaps = [_snap(0, _pending(2)), _snap(1, _done(1), where="d.py:1 in g")]
    data = diagnose(snaps, 2).to_json()
    assert data["waiting"] == [
        {
            "group": "default_pg",
            "seq": 2,
            "op": "all_reduce",
            "sizes": [[4]],
            "dtypes": ["Float"],
            "site": "train.py:57 in step",
            "ranks": [0],
        }
    ]
    assert data["absent"] == {"d.py:1 in g": [1]}


def test_rule_ranks_text_writes_runs_as_ranges():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([0, 1, 2, 3]) == "ranks 0-3"
    assert ranks_text([7, 0, 2, 1, 5, 8]) == "ranks 0-2, 5, 7-8"
    assert ranks_text([1, 3]) == "ranks 1, 3"


# -- stragglers ------------------------------------------------------------------------------


def _history(steps: int, ranks: int, late_rank: int | None, jitter: float, seed: int):
    rng = random.Random(seed)  # noqa: S311 (made-up step times)
    entries: dict[int, list[CollectiveEntry]] = {r: [] for r in range(ranks)}
    start = 0.0
    for seq in range(1, steps + 1):
        step = 0.5
        for r in range(ranks):
            work = step * (1 + rng.uniform(-jitter, jitter))
            if r == late_rank:
                work = step * 2
            entries[r].append(
                CollectiveEntry(
                    "default_pg", seq, "all_reduce", done=True, created_ns=int((start + work) * 1e9)
                )
            )
        start += step * 2.2
    return {r: tuple(e) for r, e in entries.items()}


def test_rule_a_rank_twice_as_slow_is_named_within_20_steps():
    found = find_stragglers(_history(20, 4, late_rank=2, jitter=0.1, seed=1))
    assert [s.rank for s in found] == [2]
    assert found[0].window == 20
    assert str(found[0]).startswith("rank 2 enters collectives 0.")
    assert str(found[0]).endswith("s after the median, over the last 20")


def test_rule_jitter_of_fifty_percent_names_nobody():
    for seed in range(20):
        assert find_stragglers(_history(50, 4, None, jitter=0.5, seed=seed)) == []


def test_rule_too_few_shared_collectives_name_nobody():
    assert find_stragglers(_history(4, 4, late_rank=1, jitter=0, seed=0)) == []


def test_rule_clock_offsets_are_taken_off_each_ranks_times():
    history = _history(20, 2, late_rank=None, jitter=0.0, seed=0)
    skewed = {
        0: history[0],
        1: tuple(
            CollectiveEntry(e.group, e.seq, e.op, done=True, created_ns=e.created_ns + 5 * 10**9)
            for e in history[1]
        ),
    }
    assert [s.rank for s in find_stragglers(skewed)] == [1]  # a clock 5 s ahead looks late
    assert find_stragglers(skewed, offsets_ns={1: 5 * 10**9}) == []


def test_rule_only_collectives_every_rank_recorded_are_compared():
    history = dict(_history(20, 3, late_rank=0, jitter=0, seed=0))
    history[1] = history[1][:3]  # rank 1's recorder kept only 3
    assert find_stragglers(history) == []  # 3 shared < 5


# -- stall detection: its fields, its clock, its look (torchrunx.launcher.launch.stalls) -------------


def test_rule_stall_fields_are_checked_with_what_to_write_instead():
    check_stall_fields(300, "report", 0)
    check_stall_fields(None, "fail", 0)  # off
    check_stall_fields(0.5, "restart", 1)
    for bad in (0, -1, float("inf"), True, "300"):
        with pytest.raises(ValueError, match="stall_timeout must be a positive number"):
            check_stall_fields(bad, "report", 0)
    with pytest.raises(ValueError, match="on_stall='later' is not one of"):
        check_stall_fields(300, "later", 0)
    with pytest.raises(ValueError, match="needs max_restarts >= 1"):
        check_stall_fields(300, "restart", 0)


def test_rule_launcher_validate_checks_the_stall_fields():
    with pytest.raises(ValueError, match="stall_timeout"):
        trx.Launcher(stall_timeout=0).validate()
    with pytest.raises(ValueError, match="on_stall"):
        trx.Launcher(on_stall="later").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs max_restarts >= 1"):
        trx.Launcher(on_stall="restart").validate()
    trx.Launcher(on_stall="restart", max_restarts=1).validate()
    assert trx.Launcher().stall_timeout == DEFAULT_STALL_TIMEOUT == 300
    assert trx.Launcher().on_stall == "report"


def test_rule_a_worker_says_it_progressed_at_most_every_fifth_of_the_timeout_or_5_s():
    assert progress_every(None) is None
    assert progress_every(2) == 0.4
    assert progress_every(300) == 5.0


def test_rule_the_recorder_is_on_unless_the_user_sized_it():
    assert recorder_env({}) == {"TORCH_FR_BUFFER_SIZE": str(RECORDER_ENTRIES)}
    assert recorder_env({"TORCH_FR_BUFFER_SIZE": "0"}) == {}
    assert recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}) == {}


def test_rule_a_torch_whose_only_recorder_is_nccl_s_gets_its_own_variable():
    old_torch = SimpleNamespace(_dump_nccl_trace=None)  # torch before gloo's recorder
    new_torch = SimpleNamespace(_dump_nccl_trace=None, _dump_fr_trace=None)
    entries = str(RECORDER_ENTRIES)
    assert recorder_env({}, old_torch) == {"TORCH_NCCL_TRACE_BUFFER_SIZE": entries}
    assert recorder_env({}, new_torch) == {"TORCH_FR_BUFFER_SIZE": entries}
    assert recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "9"}, old_torch) == {}
    assert recorder_env({"TORCH_FR_BUFFER_SIZE": "9"}, old_torch) == {}


def test_rule_the_stall_clock_runs_while_an_attempt_runs_and_progress_sets_it_back():
    watch = StallWatch(10, "report", armed=True)
    watch.run_state(None, 0, 0)
    assert not watch.due(100, 0)  # nothing runs
    watch.run_state(0, 100, 0)  # the attempt starts: the clock with it
    assert not watch.due(109.9, 0)
    assert watch.due(110, 0)
    watch.progressed(105, 0)
    assert not watch.due(114.9, 0) and watch.due(115, 0)
    watch.run_state(1, 120, 0)  # a restart: the clock starts again
    assert not watch.due(129, 0) and watch.due(130, 0)
    watch.run_state(None, 131, 0)  # between warm runs: no stall
    assert not watch.due(1000, 0)


def test_rule_time_in_the_debugger_does_not_count():
    watch = StallWatch(10, "report", armed=True)
    watch.run_state(0, 0, paused=0)
    assert not watch.due(15, paused=6)  # 6 s of it in pdb: 9 s without progress
    assert watch.stalled_for(15, 6) == 9
    assert watch.due(16, paused=6)
    assert watch.next_due(paused=6) == 16  # the loop wakes then
    watch.progressed(16, 6)
    assert watch.next_due(paused=7) == 27


def test_rule_without_a_backend_the_clock_starts_at_the_first_progress():
    watch = StallWatch(10, "report", armed=False)
    watch.run_state(0, 0, 0)
    assert not watch.due(1000, 0)
    watch.progressed(1000, 0)
    assert watch.due(1010, 0)


def test_rule_off_is_never_due():
    watch = StallWatch(None, "report", armed=True)
    watch.run_state(0, 0, 0)
    assert not watch.due(10**9, 0)


def _agent(index: int, offset: int) -> object:
    return SimpleNamespace(index=index, spec=SimpleNamespace(rank_offset=offset))


def _rank(rank: int, local_rank: int) -> object:
    return SimpleNamespace(rank=rank, local_rank=local_rank)


def test_rule_a_stall_is_looked_at_once_reported_once_until_progress():
    watch = StallWatch(10, "fail", armed=True)
    watch.run_state(0, 0, 0)
    agents = [_agent(0, 0), _agent(1, 2)]
    watch.begin(agents, {0, 1, 2, 3}, 10, 0)  # type: ignore[arg-type]
    look = watch.look
    assert look is not None and not watch.due(11, 0)  # a look under way
    assert not look.due(10.5)
    entries = (("default_pg", 5, "all_reduce", ((4,),), ("Float",), False, 1, "t.py:9 in f"),)
    for rank in (0, 1, 3):
        watch.answer_state(rank, RankState(group_formed=True, entries=entries, where="t.py:9 in f"))
    watch.answer_state(
        2, RankState(group_formed=True, where="t.py:3 in load", stacks="Current thread:\n  x\n")
    )
    watch.answer_stacks(agents[0], {0: "a", 1: "a"})  # type: ignore[arg-type]
    assert not look.due(10.5)  # host 1's stacks are missing
    watch.answer_stacks(agents[1], {0: "Current thread:\n  load\n", 1: "b"})  # type: ignore[arg-type]
    assert look.due(10.5) and look.stacks[2] == "Current thread:\n  load\n"
    ranks = [_rank(0, 0), _rank(1, 1), _rank(2, 0), _rank(3, 1)]
    report = watch.finish(ranks, dict.fromkeys(range(4), "node"))  # type: ignore[arg-type]
    assert report.number == 1 and report.seconds == 10
    assert report.text.splitlines()[:3] == [
        "ranks 0-1, 3 wait in all_reduce #5 of default_pg ([4] Float) at t.py:9 in f",
        "not entered all_reduce #5 of default_pg:",
        "  rank 2: t.py:3 in load",
    ]
    assert report.values["stacks"] == {"2": "Current thread:\n  load\n"}
    assert report.headline.startswith("torchrunx: no rank made progress for 10 s")
    assert not watch.due(100, 0)  # reported: not again until progress
    watch.progressed(100, 0)
    assert watch.due(110, 0)


def test_rule_a_rank_that_did_not_answer_in_time_is_named_as_such():
    watch = StallWatch(1, "report", armed=True)
    watch.run_state(0, 0, 0)
    watch.begin([_agent(0, 0)], {0, 1}, 1, 0)  # type: ignore[arg-type]
    watch.answer_state(0, RankState(group_formed=True, where="t.py:1 in f"))
    assert watch.look is not None and not watch.look.due(2.9) and watch.look.due(3.0)
    report = watch.finish([_rank(0, 0), _rank(1, 1)], {0: "n", 1: "n"})  # type: ignore[arg-type]
    assert report.values["unanswered"] == [1]
    assert "rank 1 did not answer in time" in report.text


def test_rule_the_users_frame_is_the_innermost_outside_torch_and_torchrunx():
    def code(filename: str, name: str) -> object:
        return SimpleNamespace(co_filename=filename, co_name=name)

    outer = SimpleNamespace(f_code=code("/me/train.py", "main"), f_lineno=9, f_back=None)
    inner = SimpleNamespace(
        f_code=code("/v/torch/distributed/c10d.py", "all_reduce"), f_lineno=1, f_back=outer
    )
    assert user_frame(inner) == "/me/train.py:9 in main"
    assert user_frame(None) == ""


# -- the edges: a recorder entry's defaults, the order of the waits, the lines, the thresholds ---


def test_rule_a_recorder_entry_without_its_fields_is_empty_not_made_up():
    assert entry_from_recorder({}) == CollectiveEntry(
        "", 0, "", (), (), done=False, created_ns=0, site=""
    )
    frameless = entry_from_recorder({"frames": [{}]})  # a frame that names nothing
    assert frameless.site == ":? in ?"
    assert entry_from_recorder({"process_group": ["only_name"]}).group == "only_name"
    # The backend's prefix is left out, once: the rest of the name is the op.
    assert entry_from_recorder({"profiling_name": "nccl:all_reduce:2"}).op == "all_reduce:2"
    assert entry_from_recorder({"profiling_name": "barrier"}).op == "barrier"


def test_rule_a_rank_with_no_collective_of_the_group_has_entered_none():
    assert _snap(0).last_seq("default_pg") == 0
    assert _snap(0, _done(3, group="other")).last_seq("default_pg") == 0
    snaps = [_snap(0, _pending(1)), _snap(1, where="a.py:1 in f"), _snap(2)]
    diagnosis = diagnose(snaps, 3)
    assert diagnosis.absent == {"a.py:1 in f": (1,), "(no frame of the user's code)": (2,)}


def test_rule_a_rank_that_finished_the_collective_the_others_wait_in_is_not_absent():
    snaps = [_snap(0, _pending(41)), _snap(1, _done(41), where="x.py:1 in f")]
    assert diagnose(snaps, 2).absent == {}


def test_rule_the_most_waited_in_collective_comes_first_then_by_group_number_and_op():
    most = [_snap(r, _pending(9, group="z")) for r in (3, 4)]
    assert [w.ranks for w in diagnose([_snap(0, _pending(2, group="a")), *most], 5).waiting] == [
        (3, 4),
        (0,),
    ]
    by_group = diagnose(
        [_snap(0, _pending(1, "y", group="b")), _snap(1, _pending(2, "x", group="a"))], 2
    )
    assert [w.entry.group for w in by_group.waiting] == ["a", "b"]
    by_number = diagnose([_snap(0, _pending(2, "a")), _snap(1, _pending(1, "z"))], 2)
    assert [w.entry.seq for w in by_number.waiting] == [1, 2]


def test_rule_every_line_of_a_diagnosis_with_waits_names_the_other_phases_not_the_waiting():
    snaps = [_snap(r, _done(40), _pending(41)) for r in (0, 1)]
    snaps.append(_snap(2, _done(40), where="data.py:12 in __next__"))
    snaps.append(_snap(3, formed=False, where="t.py:1 in main"))
    assert render(diagnose(snaps, 5)) == [
        "ranks 0-1 wait in all_reduce #41 of default_pg ([4] Float) at train.py:57 in step",
        "not entered all_reduce #41 of default_pg:",
        "  rank 2: data.py:12 in __next__",
        "  rank 3: t.py:1 in main",
        "rank 2 in the user's code",
        "rank 3 before the process group formed",
        "rank 4 did not answer in time (their host is silent, or the rank holds Python's GIL)",
    ]


def test_rule_a_collectives_text_names_only_what_is_known():
    def line(entry: CollectiveEntry) -> str:
        return render(diagnose([_snap(0, entry)], 1))[0]

    full = CollectiveEntry("g", 3, "all_gather", ((4, 2), (3,)), ("Half", "Float"), site="a.py:1")
    assert line(full) == "rank 0 waits in all_gather #3 of g ([4, 2], [3] Half) at a.py:1"
    assert line(CollectiveEntry("g", 3, "op", ((5,),))) == "rank 0 waits in op #3 of g ([5])"
    assert line(CollectiveEntry("g", 3, "op", (), ("Float",))) == "rank 0 waits in op #3 of g"


def test_rule_the_diagnosis_as_json_holds_every_field():
    snaps = [_snap(0, _pending(2)), _snap(1, _pending(2, "broadcast")), _snap(2, formed=False)]
    data = diagnose(snaps, 4).to_json()
    assert {k: v for k, v in data.items() if k != "waiting"} == {
        "absent": {"(no frame of the user's code)": [2]},
        "mismatch": True,
        "phases": {"in a collective": [0, 1], "before the process group formed": [2]},
        "unanswered": [3],
    }


def _entered(times_s: dict[int, list[float]], group: str = "g", first: int = 1):
    """Each rank's collectives of ``group``, numbered from ``first``, entered at these times."""
    return {
        rank: tuple(
            CollectiveEntry(group, first + i, "all_reduce", done=True, created_ns=int(t * 1e9))
            for i, t in enumerate(times)
        )
        for rank, times in times_s.items()
    }


def test_rule_a_straggler_is_named_with_its_exact_lateness_window_and_share():
    # Five shared collectives, the fewest compared: rank 1 enters each one 1 s after rank 0.
    # (Of two ranks, one is last five times in five by a chance of 1/32: not named by default.)
    times = _entered({0: [10, 20, 30, 40, 50], 1: [11, 21, 31, 41, 51]})
    assert find_stragglers(times) == []
    found = find_stragglers(times, StragglerRule(max_chance=1 / 32))
    assert found == [Straggler(1, 0.5, 5, 1.0)]  # 0.5 s after the median of the two


def test_rule_a_share_and_a_lateness_exactly_at_the_rule_name_the_rank():
    # Rank 1 is last in 3 of 5 (a share of 0.6), by a median of exactly 0.5 s.
    times = {0: [10, 20, 30, 41, 51], 1: [11, 21, 31, 40, 50]}
    rule = StragglerRule(threshold_s=0.5, min_share=0.6, max_chance=1.0)
    assert find_stragglers(_entered(times), rule) == [Straggler(1, 0.5, 5, 0.6)]


def test_rule_the_window_is_the_newest_collectives_by_time_not_by_name():
    old = _entered({0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5]}, group="b")  # b: long ago, even
    new = _entered({0: [10, 20, 30, 40, 50], 1: [11, 21, 31, 41, 51]}, group="a")  # a: now
    both = {rank: old[rank] + new[rank] for rank in (0, 1)}
    assert [s.rank for s in find_stragglers(both, StragglerRule(window=5, max_chance=1))] == [1]


def test_rule_collectives_without_a_sequence_number_are_not_compared():
    late = {0: [10, 20, 30, 40, 50], 1: [11, 21, 31, 41, 51]}
    unnumbered = {
        rank: tuple(
            CollectiveEntry(f"g{i}", 0, "x", done=True, created_ns=int(t * 1e9))
            for i, t in enumerate(times)
        )
        for rank, times in late.items()
    }
    everything = StragglerRule(max_chance=1.0)  # numbered, they would name rank 1
    assert find_stragglers(unnumbered, everything) == []
    numbered = {r: tuple(replace(e, seq=1) for e in es) for r, es in unnumbered.items()}
    assert [s.rank for s in find_stragglers(numbered, everything)] == [1]


def test_rule_a_rank_without_a_clock_offset_has_nothing_taken_off():
    # Rank 0's clock runs 5 s ahead; after its offset both enter together, and on a tie the
    # higher rank counts as the last one in.
    times = _entered({0: [15, 25, 35, 45, 55], 1: [10, 20, 30, 40, 50]})
    rule = StragglerRule(threshold_s=0.0, max_chance=1.0)
    found = find_stragglers(times, rule, offsets_ns={0: 5 * 10**9})
    assert [(s.rank, s.lateness_s, s.last_share) for s in found] == [(1, 0.0, 1.0)]


def test_rule_the_chance_of_being_last_is_a_binomial_tail():
    assert chance_of_being_last(5, 5, 2) == 1 / 32
    assert chance_of_being_last(0, 7, 4) == pytest.approx(1.0)
    assert chance_of_being_last(1, 1, 4) == 0.25
    assert chance_of_being_last(2, 3, 2) == 0.5  # 3 ways of two, 1 of three, in 8
    assert chance_of_being_last(8, 10, 4) == pytest.approx(
        45 * 0.25**8 * 0.75**2 + 10 * 0.25**9 * 0.75 + 0.25**10
    )


def test_rule_a_rank_jitter_made_last_three_times_in_five_is_not_named():
    # 4 ranks; rank 3 is last in 3 of 5 by 0.5 s: a share of 0.6, but by luck 1 time in 10.
    times = {0: [10, 20, 30, 40, 50], 1: [10, 20, 30, 40, 50], 2: [10, 20, 30, 41, 51]}
    times[3] = [11, 21, 31, 40, 50]
    assert find_stragglers(_entered(times), StragglerRule(threshold_s=0.0)) == []
    assert chance_of_being_last(3, 5, 4) > StragglerRule().max_chance
    # The same rank last in all 5: by luck 1 time in 1,024 (below 1/1,000): named.
    times[3] = [11, 21, 31, 41, 51]
    found = find_stragglers(_entered(times), StragglerRule(threshold_s=0.0))
    assert [(s.rank, s.window, s.last_share) for s in found] == [(3, 5, 1.0)]


def test_rule_the_chance_at_the_rule_names_the_rank_and_above_it_does_not():
    times = _entered({0: [10, 20, 30, 40, 50], 1: [11, 21, 31, 41, 51]})
    assert [s.rank for s in find_stragglers(times, StragglerRule(max_chance=1 / 32))] == [1]
    assert find_stragglers(times, StragglerRule(max_chance=1 / 33)) == []


def test_rule_a_probe_that_cannot_read_its_state_still_answers_and_says_why():
    from torchrunx.worker.stallprobe import _answer

    answer = _answer(object())  # type: ignore[arg-type]  (no thread: reading the state fails)
    assert answer.group_formed is False and answer.entries == ()
    assert answer.where.startswith("(torchrunx's probe failed: AttributeError")


# -- held-out mutants (round 55b): the rules they broke ------------------------------------------


def test_rule_a_rank_waits_in_its_newest_unfinished_collective():
    # NCCL runs collectives asynchronously: rank 0 has #3 and #4 both unfinished.
    snaps = [_snap(0, _pending(3), _pending(4)), _snap(1, _done(3), _pending(4))]
    diagnosis = diagnose(snaps, 2)
    assert [(w.entry.seq, w.ranks) for w in diagnosis.waiting] == [(4, (0, 1))]


def test_rule_a_rank_waiting_in_an_earlier_collective_waits_there_and_is_not_absent():
    # Ranks 0-1 wait in #5; rank 2 waits in #3 of the same group; rank 3 is in its own code.
    snaps = [_snap(r, _done(3), _pending(5)) for r in (0, 1)]
    snaps += [_snap(2, _pending(3)), _snap(3, _done(3), where="data.py:12 in __next__")]
    diagnosis = diagnose(snaps, 4)
    assert [(w.entry.seq, w.ranks) for w in diagnosis.waiting] == [(5, (0, 1)), (3, (2,))]
    assert diagnosis.absent == {"data.py:12 in __next__": (3,)}
    lines = render(diagnosis)
    assert lines[2:4] == [
        "not entered all_reduce #5 of default_pg:",
        "  rank 3: data.py:12 in __next__",
    ]


def test_rule_different_ops_at_different_numbers_of_one_group_are_no_mismatch():
    # A rank that went on to the next collective (a broadcast) while the others wait in #5.
    snaps = [
        _snap(0, _pending(5)),
        _snap(1, _pending(5)),
        _snap(2, _done(5), _pending(6, "broadcast")),
    ]
    diagnosis = diagnose(snaps, 3)
    assert not diagnosis.mismatch
    assert render(diagnosis)[:2] == [
        "ranks 0-1 wait in all_reduce #5 of default_pg ([4] Float) at train.py:57 in step",
        "rank 2 waits in broadcast #6 of default_pg ([4] Float) at train.py:57 in step",
    ]
