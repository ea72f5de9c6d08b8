"""Straggler detection's watch: when it asks, what it compares, whom it names (pure).

:class:`~torchrunx.launcher.launch.stragglers.StragglerWatch` on made-up answers and clocks;
the rule itself is in tests/test_rules_hangs.py, the real launches in tests/test_stragglers.py.
"""

from __future__ import annotations

import pytest

import torchrunx as trx
from torchrunx.events import StragglerFound
from torchrunx.hosts import HostSlots
from torchrunx.launcher.launch.stalls import progress_every
from torchrunx.launcher.launch.stragglers import (
    ANSWER_WAIT,
    DEFAULT_STRAGGLER_THRESHOLD,
    OFFSET_SAMPLES,
    STRAGGLER_EVERY,
    Stragglers,
    StragglerWatch,
    TimingsRound,
    check_straggler_threshold,
    entries_of,
)
from torchrunx.launcher.state.hangs import CollectiveEntry, StragglerRule
from torchrunx.launcher.state.records import AgentRecord, Phase
from torchrunx.launcher.state.state import LaunchState
from torchrunx.wire.messages import (
    AgentHello,
    AskTimings,
    RankState,
    RankTimings,
    WorkerResult,
    WorkerSpec,
)

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


# -- held-out mutants (round 55b): the launch's part (Stragglers.turn) ---------------------------


class _Peer:
    def __init__(self, sent: list[tuple[int, object]], index: int) -> None:
        self.sent, self.index = sent, index

    def send(self, message: object) -> None:
        self.sent.append((self.index, message))


class _Inbox:
    """Stands in for the launch's inbox: what is sent to each agent is recorded."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def peer_of(self, agent: AgentRecord) -> _Peer:
        return _Peer(self.sent, agent.index)


class _Sink:
    def __init__(self) -> None:
        self.events: list[object] = []

    def emit(self, event: object) -> None:
        self.events.append(event)


def _running(hosts: int = 3) -> LaunchState:
    """A launch of one worker on each of ``hosts`` hosts, every worker running (attempt 0)."""
    agents = [AgentRecord(i, HostSlots(f"node{i}", 1), "ssh") for i in range(hosts)]
    state = LaunchState(agents, agent_timeout=30.0, started=100.0)
    for agent in agents:
        hello = AgentHello(agent.index, agent.slots.hostname, 1000 + agent.index, 1, 29500)
        state.agent_table.agent_hello(agent, conn=agent.index, hello=hello, now=101.0)
    state.agent_table.agents_ready(102.0)
    state.start_run(102.0, warm=False)
    for agent in agents:
        spec = WorkerSpec(
            agent.index, agent.slots.hostname, 1, agent.index, hosts, "h", 1, None, 9.0
        )
        state.current.assign(agent, spec)
    for rank in state.ranks:
        state.current.worker_hello(rank, conn=100 + rank.rank, pid=2000 + rank.rank)
    assert state.phase is Phase.RUNNING
    return state


def _stragglers(state: LaunchState) -> tuple[Stragglers, _Inbox, _Sink]:
    plan = trx.Launcher(hostnames=["localhost"], workers_per_host=1, straggler_threshold=0.1)
    inbox, sink = _Inbox(), _Sink()
    part = Stragglers(plan.plan(), state, inbox, sink)  # type: ignore[arg-type]
    return part, inbox, sink


def test_rule_a_request_waits_only_for_the_ranks_still_running_and_names_a_late_one():
    state = _running(3)
    state.current.worker_result(state.ranks[2], WorkerResult(2), [bytearray(b"x")], 103.0)
    part, inbox, sink = _stragglers(state)
    part.turn(0.0)
    assert inbox.sent == []  # the first request comes a few seconds in
    part.turn(STRAGGLER_EVERY)
    assert [(index, type(message)) for index, message in inbox.sent] == [
        (0, AskTimings),
        (1, AskTimings),
        (2, AskTimings),
    ]
    assert part.watch.round is not None and part.watch.round.ranks == {0, 1}  # rank 2 returned
    part.watch.answer(0, _timings(0.0), received_ns=0)
    part.watch.answer(1, _timings(0.5), received_ns=0)
    part.turn(STRAGGLER_EVERY + 0.1)  # both answered: compared before the wait is over
    assert part.watch.round is None
    [found] = sink.events
    assert isinstance(found, StragglerFound)
    assert (found.rank, found.hostname, found.window) == (1, "node1", 10)


def test_rule_no_request_goes_out_while_the_launch_stops():
    state = _running(2)
    part, inbox, _ = _stragglers(state)
    with state.stopping_meanwhile():
        part.turn(0.0)
        part.turn(STRAGGLER_EVERY)
    assert inbox.sent == [] and part.watch.round is None
