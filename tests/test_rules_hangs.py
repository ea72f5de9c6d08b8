"""The diagnosis of a stalled launch and the straggler rule, on made-up snapshots (pure)."""

from __future__ import annotations

import random

from torchrunx.launcher.hangs import (
    CollectiveEntry,
    RankSnapshot,
    diagnose,
    entry_from_recorder,
    find_stragglers,
    ranks_text,
    render,
)


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
    raw = {"frames": [{"name": "run", "filename": "/x/torchrunx/agent/worker.py", "line": 9}]}
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
