"""Straggler detection's watch: when it asks, what it compares, whom it names (pure).

:class:`~torchrunx.launcher.launch.stragglers.StragglerWatch` on made-up answers and clocks;
the rule itself is in tests/test_rules_hangs.py, the real launches in tests/test_stragglers.py.
"""

from __future__ import annotations

import pytest

from torchrunx.launcher.launch.stalls import progress_every
from torchrunx.launcher.launch.stragglers import (
    ANSWER_WAIT,
    DEFAULT_STRAGGLER_THRESHOLD,
    OFFSET_SAMPLES,
    STRAGGLER_EVERY,
    StragglerWatch,
    TimingsRound,
    check_straggler_threshold,
    entries_of,
)
from torchrunx.launcher.state.hangs import CollectiveEntry, StragglerRule
from torchrunx.wire.messages import RankState, RankTimings

S = 10**9


def _timings(late: float, steps: int = 10, sent: int = 0, first: int = 1) -> RankTimings:
    """A rank that entered collectives ``first``.. at 1 s, 2 s, ... plus ``late`` seconds."""
    return RankTimings(
        tuple(("default_pg", first + i, int((i + 1 + late) * S)) for i in range(steps)), sent
    )


def _answer_all(watch: StragglerWatch, lates: list[float], **kwargs: int) -> None:
    for rank, late in enumerate(lates):
        watch.answer(rank, _timings(late, **kwargs), received_ns=0)


def test_rule_the_threshold_is_none_or_a_positive_number_of_seconds():
    for good in (None, 0.1, 2, 1e-3):
        check_straggler_threshold(good)
    for bad in (0, -1, float("inf"), float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="straggler_threshold must be a positive number"):
            check_straggler_threshold(bad)


def test_rule_the_probe_runs_for_stragglers_alone_too():
    assert progress_every(None) is None
    assert progress_every(None, stragglers=True) == 5.0
    assert progress_every(10, stragglers=True) == progress_every(10) == 2.0


def test_rule_timings_become_the_rules_entries():
    timings = RankTimings((("g", 3, 7), ("h", 1, 9)), 0)
    assert entries_of(timings) == (
        CollectiveEntry("g", 3, "", done=True, created_ns=7),
        CollectiveEntry("h", 1, "", done=True, created_ns=9),
    )


def test_rule_a_round_is_due_once_every_rank_answered_or_its_wait_is_over():
    round_ = TimingsRound({0, 1}, deadline=10.0)
    assert not round_.due(9.9)
    round_.answered.add(0)
    assert not round_.due(9.9)
    assert round_.due(10.0)
    round_.answered.add(1)
    assert round_.due(0.0)


def test_rule_the_watch_asks_every_few_seconds_while_an_attempt_runs_only():
    watch = StragglerWatch(0.1)
    assert not watch.due(100.0) and watch.next_due() is None  # no attempt runs
    watch.run_state(0, 100.0)
    assert watch.next_due() == 100.0 + STRAGGLER_EVERY
    assert not watch.due(100.0 + STRAGGLER_EVERY - 0.01)
    assert watch.due(100.0 + STRAGGLER_EVERY)
    watch.begin({0, 1}, 102.0)
    assert not watch.due(1000.0)  # a round is under way
    assert watch.next_due() == 102.0 + ANSWER_WAIT
    watch.run_state(None, 102.5)  # the attempt is over: no request, no wake-up
    assert not watch.due(1000.0) and watch.next_due() is None


def test_rule_off_the_watch_never_asks():
    watch = StragglerWatch(None)
    watch.run_state(0, 0.0)
    assert not watch.due(1000.0) and watch.next_due() is None
    _answer_all(watch, [0, 0, 0, 5])
    assert watch.compare([0, 1, 2, 3]) == []


def test_rule_a_late_rank_is_named_once_per_run_and_the_run_end_lists_it():
    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    watch.begin({0, 1, 2, 3}, 2.0)
    _answer_all(watch, [0, 0, 0, 0.5])
    assert watch.round is not None and watch.round.due(2.0)
    [first] = watch.compare(watch.round.ranks)
    assert (first.rank, first.window, first.last_share) == (3, 10, 1.0)
    assert first.lateness_s == pytest.approx(0.5)
    assert watch.round is None and watch.current == (first,)
    _answer_all(watch, [0, 0, 0, 0.7])
    assert watch.compare([0, 1, 2, 3]) == []  # named already: no second warning
    assert watch.current[0].lateness_s == pytest.approx(0.7)  # but the newest figures
    named = ("rank 3 enters collectives 0.7 s after the median, over the last 10",)
    assert watch.end_run(0) == named
    assert watch.last_run == named and watch.named == {}
    assert watch.end_run(0) == ()  # the next run starts afresh


def test_rule_nothing_is_compared_until_every_rank_sent_timings():
    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    _answer_all(watch, [0, 0, 0.5])
    assert watch.compare([0, 1, 2, 3]) == []  # rank 3 sent nothing
    assert watch.compare([]) == []
    assert watch.compare([0, 1, 2]) != []


def test_rule_a_new_attempt_forgets_the_last_ones_timings_but_not_whom_it_named():
    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    _answer_all(watch, [0, 0, 0.5])
    assert [s.rank for s in watch.compare([0, 1, 2])] == [2]
    watch.run_state(None, 5.0)
    watch.run_state(0, 6.0)  # the same attempt again: nothing forgotten
    assert set(watch.latest) == {0, 1, 2}
    watch.run_state(1, 7.0)
    assert watch.latest == {} and watch.current == () and watch.offsets() == {}
    assert watch.next_due() == 7.0 + STRAGGLER_EVERY
    assert list(watch.named) == [2]


def test_rule_a_ranks_clock_offset_is_its_least_delayed_answer():
    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    # Rank 1's clock is 5 s ahead; its answers took 3, 1 and 2 ms.
    for delay_ms in (3, 1, 2):
        watch.answer(1, _timings(5.0, sent=5 * S), received_ns=delay_ms * 10**6)
    assert watch.offsets() == {1: 5 * S - 10**6}
    watch.answer(0, _timings(0.0), received_ns=0)
    assert watch.compare([0, 1]) == []  # 5 s ahead, not 5 s late
    for _ in range(OFFSET_SAMPLES):  # the oldest samples go
        watch.answer(1, _timings(5.0, sent=5 * S), received_ns=4 * 10**6)
    assert watch.offsets() == {0: 0, 1: 5 * S - 4 * 10**6}


def test_rule_the_collective_view_names_stragglers_or_says_none_is():
    def state(late: float) -> RankState:
        entries = tuple(
            ("default_pg", i + 1, "all_reduce", (), (), True, int((i + 1 + late) * S), "")
            for i in range(10)
        )
        return RankState(group_formed=True, entries=entries)

    watch = StragglerWatch(None)  # off: the view still uses the default threshold
    lines = watch.view_lines({0: state(0), 1: state(0), 2: state(0), 3: state(1.0)})
    assert lines == ["straggler: rank 3 enters collectives 1 s after the median, over the last 10"]
    lines = watch.view_lines({0: state(0), 1: state(0), 2: state(0.05)})
    threshold = f"{DEFAULT_STRAGGLER_THRESHOLD:g} s"
    assert lines == [
        f"no straggler: no rank of ranks 0-2 entered most recent collectives last by {threshold}"
    ]
    assert watch.view_lines({0: state(0)}) == []
    assert StragglerWatch(0.02).view_lines({0: state(0), 1: state(0), 2: state(0.05)}) == [
        "straggler: rank 2 enters collectives 0.05 s after the median, over the last 10"
    ]
    assert StragglerRule().threshold_s == DEFAULT_STRAGGLER_THRESHOLD


def test_rule_a_fresh_watch_has_named_nobody():
    watch = StragglerWatch(0.1)
    assert watch.current == () and watch.last_run == () and watch.named == {}


def test_rule_the_next_request_is_due_every_few_seconds_after_the_last():
    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    watch.begin({0}, 2.0)
    watch.compare([0])
    assert not watch.due(2.0 + STRAGGLER_EVERY - 0.01)
    assert watch.due(2.0 + STRAGGLER_EVERY)


def test_rule_the_watch_compares_with_its_own_threshold():
    watch = StragglerWatch(0.5)
    watch.run_state(0, 0.0)
    _answer_all(watch, [0, 0, 0, 0.3])
    assert watch.compare([0, 1, 2, 3]) == []  # 0.3 s late: below 0.5 s (past the default)
    _answer_all(watch, [0, 0, 0, 0.6])
    assert [s.rank for s in watch.compare([0, 1, 2, 3])] == [3]


def test_rule_the_collective_view_takes_the_clocks_offsets_off_and_says_so_of_two_ranks():
    def state(late: float) -> RankState:
        entries = tuple(
            ("default_pg", i + 1, "all_reduce", (), (), True, int((i + 1 + late) * S), "")
            for i in range(12)
        )
        return RankState(group_formed=True, entries=entries)

    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    watch.answer(3, _timings(0.0, sent=5 * S), received_ns=0)  # rank 3's clock: 5 s ahead
    states = {0: state(0), 1: state(0), 2: state(0), 3: state(5.0)}
    assert watch.view_lines(states) == [
        "no straggler: no rank of ranks 0-3 entered most recent collectives last by 0.1 s"
    ]
    assert watch.view_lines({0: state(0), 1: state(0.01)}) == [
        "no straggler: no rank of ranks 0-1 entered most recent collectives last by 0.1 s"
    ]


def test_rule_a_warm_run_compares_only_the_collectives_after_the_last_run_ended():
    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    _answer_all(watch, [0, 0, 0, 0.5])  # collectives at 1-10 s, rank 3 late
    assert [s.rank for s in watch.compare([0, 1, 2, 3])] == [3]
    watch.end_run(10 * S + S // 2)  # the run ended at 10.5 s; the workers stay, same attempt
    assert watch.latest == {} and watch.since_ns == 10 * S + S // 2
    _answer_all(watch, [0, 0, 0, 0.5])  # their recorders still hold those collectives
    assert watch.compare([0, 1, 2, 3]) == []
    late = [_timings(0.0, steps=20), _timings(0.0, steps=20), _timings(0.0, steps=20)]
    for rank, timings in enumerate([*late, _timings(0.5, steps=20)]):
        watch.answer(rank, timings, received_ns=0)  # 10 more, at 11-20 s (10.5 s for rank 3)
    [found] = watch.compare([0, 1, 2, 3])
    assert (found.rank, found.window) == (3, 10)  # of the new run's 10 only
    assert watch.offsets() == {0: 0, 1: 0, 2: 0, 3: 0}


def test_rule_the_last_runs_end_is_compared_on_each_ranks_own_clock():
    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    watch.end_run(10 * S + S // 2)
    # Rank 3's clock is 5 s behind: its collectives at 11-20 s read 6-15 s there.
    for rank in range(3):
        watch.answer(rank, _timings(0.0, steps=20), received_ns=0)
    behind = RankTimings(
        tuple(
            (group, seq, created - 5 * S + S // 2)
            for group, seq, created in _timings(0.0, steps=20).entries
        ),
        -5 * S,
    )
    watch.answer(3, behind, received_ns=0)
    [found] = watch.compare([0, 1, 2, 3])
    assert (found.rank, found.window) == (3, 10)
    assert found.lateness_s == pytest.approx(0.5)


def test_rule_a_collective_entered_as_the_last_run_ended_belongs_to_it():
    watch = StragglerWatch(0.1)
    watch.run_state(0, 0.0)
    watch.end_run(10 * S)  # ranks 0-2 entered collective 10 at exactly 10 s, rank 3 at 10.5 s
    _answer_all(watch, [0, 0, 0, 0.5], steps=20)
    [found] = watch.compare([0, 1, 2, 3])
    assert (found.rank, found.window) == (3, 10)  # 11-20; 10 was the last run's
