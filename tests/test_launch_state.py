"""The launch state and the failure analysis, as pure code on made-up event sequences.

Every race the end-to-end tests can only force with sleeps is written down here as the order
in which the launcher learns things.
"""

from __future__ import annotations

import dataclasses

import pytest

from torchrunx.errors import AgentFailedError, WorkerFailedError, WorkerTimeoutError
from torchrunx.events import AgentState, WorkerFailed, WorkerState, WorkerStateChanged
from torchrunx.launcher.settings.resolve import HostSlots
from torchrunx.launcher.state.failures import choose_cause, others, restartable
from torchrunx.launcher.state.records import (
    AGENT_MOVES,
    OUTCOME_WAIT,
    WORKER_MOVES,
    AgentRecord,
    Phase,
)
from torchrunx.launcher.state.state import LaunchState
from torchrunx.wire.messages import (
    AgentHello,
    Heartbeat,
    WorkerExited,
    WorkerHello,
    WorkerResult,
    WorkersEnded,
    WorkerSpec,
    WorkersStarted,
)

ECHO = "[gloo/transport/tcp/pair.cc] Connection closed by peer [10.0.0.2]:1234"


def running_launch(
    hosts: int = 2, workers: int = 2, *, connected: bool = True, **fields: float
) -> LaunchState:
    """A launch whose agents said hello and whose workers all connected (``connected=False``:
    the workers' hellos are still on their way)."""
    agents = [AgentRecord(i, HostSlots(f"node{i}", workers), "ssh") for i in range(hosts)]
    state = LaunchState(
        agents, started=100.0, **{"max_restarts": 0, "agent_timeout": 30.0, **fields}
    )
    for agent in agents:
        hello = AgentHello(agent.index, agent.slots.hostname, 1000 + agent.index, workers, 29500)
        state.agent_table.agent_hello(agent, conn=agent.index, hello=hello, now=101.0)
    for agent in agents:
        spec = WorkerSpec(
            agent.index,
            agent.slots.hostname,
            workers,
            agent.index * workers,
            hosts * workers,
            "10.0.0.1",
            29500,
            "gloo",
            600.0,
        )
        state.current.assign(agent, spec)
    for rank in state.ranks if connected else []:
        state.current.worker_hello(rank, conn=100 + rank.rank, pid=2000 + rank.rank)
    return state


def exited(
    local_rank: int,
    *,
    code: int | None = 0,
    sig: int | None = None,
    at: float = 0.0,
    stopped: bool = False,
) -> WorkerExited:
    return WorkerExited(local_rank, 2000 + local_rank, code, sig, stopped=stopped, at=at)


def test_every_state_has_its_moves_written_down_and_final_states_have_none():
    assert set(AGENT_MOVES) == set(AgentState)
    assert set(WORKER_MOVES) == set(WorkerState)
    for state in WorkerState:
        assert (WORKER_MOVES[state] == frozenset()) == state.is_final
    assert AGENT_MOVES[AgentState.DONE] == AGENT_MOVES[AgentState.LOST] == frozenset()


def test_a_move_that_is_not_written_down_is_a_bug_and_a_final_state_never_changes():
    state = running_launch(1, 2, connected=False)
    rank = state.ranks[0]
    with pytest.raises(ValueError, match="INIT -> SUCCEEDED"):
        state.current.move_rank(rank, WorkerState.SUCCEEDED)
    state.current.move_rank(rank, WorkerState.FAILED)
    assert state.current.move_rank(rank, WorkerState.STOPPED) == []
    assert rank.state is WorkerState.FAILED
    agent = AgentRecord(5, HostSlots("x", 1), "local")
    with pytest.raises(ValueError, match="STARTING -> DONE"):
        state.agent_table.move_agent(agent, AgentState.DONE)


def test_moves_are_events_with_the_old_and_new_state():
    state = running_launch(1, 1)
    rank = state.ranks[0]
    events = state.current.worker_result(rank, WorkerResult(0), [bytearray(b"x")], now=5.0)
    assert [(e.old, e.new) for e in events if isinstance(e, WorkerStateChanged)] == [
        (WorkerState.HEALTHY, WorkerState.SUCCEEDED)
    ]
    assert state.phase is Phase.RUNNING


def test_a_peers_collective_error_arriving_before_the_real_death_is_not_the_cause():
    state = running_launch()
    echo = RuntimeError(ECHO)
    state.current.add_fault("collective", echo, at=10.2, rank=state.ranks[0])  # learnt first
    state.begin_stop(restart=False)  # the launch stops on it; the death report comes meanwhile
    agent = state.agents[0]
    rank1 = state.current.rank_of(agent, 1)
    assert rank1 is not None
    assert not state.current.worker_exited(rank1, exited(1, code=None, sig=9, at=10.0), now=11.0)
    assert state.current.alarm  # an abnormal exit stops the launch before it is judged
    assert state.current.worker_conn_closed(rank1)
    state.current.settle(rank1)
    assert not state.current.alarm
    cause = choose_cause(state.faults)
    assert isinstance(cause.error, WorkerFailedError)
    assert (cause.error.rank, cause.error.signal) == (1, 9)
    assert others(state.faults, cause) == [f"RuntimeError: {ECHO}"]


def test_the_real_exception_wins_over_an_echo_whichever_arrives_first():
    for echo_first in (True, False):
        state = running_launch()
        faults = [
            ("collective", RuntimeError(ECHO), 10.3, state.ranks[0]),
            ("exception", ValueError("bad batch"), 10.1, state.ranks[3]),
        ]
        for kind, error, at, rank in faults if echo_first else reversed(faults):
            state.current.add_fault(kind, error, at=at, rank=rank)
        cause = choose_cause(state.faults)
        assert isinstance(cause.error, ValueError)
        assert cause.rank == 3


def test_an_echo_alone_is_the_cause():
    state = running_launch()
    state.current.add_fault("collective", RuntimeError(ECHO), at=10.0, rank=state.ranks[2])
    assert choose_cause(state.faults).rank == 2


def test_a_rank_that_raised_then_exited_non_zero_failed_once_by_its_exception():
    state = running_launch(1, 2)
    rank = state.ranks[1]
    # Its exit (status 1) overtakes its exception, which travels on its own connection.
    assert state.current.worker_exited(rank, exited(1, code=1, at=10.1), now=11.0) is False
    assert rank.settle_by == 11.0 + OUTCOME_WAIT  # it waits for the connection
    assert state.current.alarm and not state.faults
    error = ValueError("x")
    state.current.worker_failed(rank, "exception", error, at=10.0)
    assert state.current.worker_conn_closed(rank)
    state.current.settle(rank)
    cause = choose_cause(state.faults)
    assert cause.error is error
    assert others(state.faults, cause) == []
    failed = state.current.add_fault("exception", ValueError("y"), 1.0, rank=rank)
    assert failed == []  # a rank fails once: no second WorkerFailed event


def test_a_clean_exit_that_overtakes_the_result_is_not_a_failure():
    state = running_launch(1, 1)
    rank = state.ranks[0]
    assert state.current.worker_exited(rank, exited(0, at=10.0), now=11.0) is False
    assert state.next_due() == 11.0 + OUTCOME_WAIT
    state.current.worker_result(rank, WorkerResult(0), [bytearray(b"v")], now=11.1)
    assert state.current.worker_conn_closed(rank)
    assert state.current.settle(rank) == []
    assert state.faults == []
    assert rank.state is WorkerState.SUCCEEDED


def test_a_clean_exit_without_any_outcome_is_a_death_once_its_wait_is_over():
    state = running_launch(1, 1)
    rank = state.ranks[0]
    state.current.worker_exited(rank, exited(0, at=10.0), now=11.0)
    assert state.due(11.0 + OUTCOME_WAIT - 0.01) == ([], [])
    assert state.due(11.0 + OUTCOME_WAIT) == ([], [rank])
    events = state.current.settle(rank)
    assert [type(e) for e in events] == [WorkerStateChanged, WorkerFailed]
    assert isinstance(state.faults[0].error, WorkerFailedError)
    assert rank.state is WorkerState.FAILED


def test_a_worker_the_agent_stopped_is_stopped_not_failed():
    state = running_launch(1, 2)
    state.begin_stop(restart=False)
    rank = state.ranks[0]
    assert state.current.worker_exited(rank, exited(0, code=None, sig=15, stopped=True), now=11.0)
    state.current.settle(rank)
    assert rank.state is WorkerState.STOPPED
    assert state.faults == []


def test_an_agents_exit_overtaking_its_last_message_is_judged_after_it():
    state = running_launch(1, 1)
    agent = state.agents[0]
    assert (
        state.agent_table.agent_exited(agent, 0, now=20.0) is False
    )  # AgentDone may still be queued
    assert agent.judge_by == 20.0 + OUTCOME_WAIT
    state.agent_table.agent_done(agent)  # ... and it was
    assert agent.state is AgentState.DONE
    assert state.agent_table.agent_conn_closed(agent) is False  # nothing left to judge
    assert not state.progress.degraded


def test_an_agent_that_never_connected_is_judged_at_its_exit():
    agents = [AgentRecord(0, HostSlots("node0", 1), "ssh")]
    state = LaunchState(agents, agent_timeout=30.0, started=0.0)
    assert state.agent_table.agent_exited(agents[0], 127, now=1.0) is True


def test_the_launchers_own_reason_comes_first_even_after_a_worker_failed():
    state = running_launch()
    state.current.add_fault("exception", ValueError("x"), at=10.0, rank=state.ranks[1])
    state.begin_stop(restart=False)
    state.current.add_fault("launch", KeyboardInterrupt(), at=10.5)
    assert isinstance(choose_cause(state.faults).error, KeyboardInterrupt)


def test_among_root_failures_the_earliest_is_the_cause_not_the_first_learnt():
    state = running_launch()
    host = AgentFailedError("node1", "the connection to the agent closed unexpectedly")
    state.current.add_fault("agent", host, at=10.5, host_index=1)
    timeout = WorkerTimeoutError("node0", 0, 0, "step", 1.0)
    state.current.add_fault("hang", timeout, at=10.0, rank=state.ranks[0])
    assert choose_cause(state.faults).error is timeout


def test_silent_agents_answer_to_start_timeout_until_their_workers_run():
    state = running_launch(2, 1, agent_timeout=5.0, start_timeout=60.0)
    for agent in state.agents:
        state.agent_table.heard_from(agent, 0.0)
    state.current.workers_forked(state.agents[1], WorkersStarted((123,)))
    assert [(a.index, round(s)) for a, s in state.agent_table.silent_agents(10.0)] == [(1, 10)]
    state.begin_stop(restart=False)
    assert state.agent_table.silent_agents(100.0) == []


def test_restart_policy_follows_restart_on_and_the_restarts_left():
    state = running_launch()
    state.current.add_fault("exception", ValueError("x"), at=1.0, rank=state.ranks[0])
    cause = choose_cause(state.faults)
    assert restartable(cause, ("exceptions",), attempt=0, max_restarts=1)
    assert not restartable(cause, ("exceptions",), attempt=1, max_restarts=1)
    assert not restartable(cause, ("deaths",), attempt=0, max_restarts=3)
    assert restartable(cause, ("ValueError",), attempt=0, max_restarts=3)
    lost = running_launch()
    lost.current.add_fault("lost", AgentFailedError("node1", "silent"), at=1.0, host_index=1)
    assert restartable(choose_cause(lost.faults), ("hosts",), attempt=0, max_restarts=1)
    assert not restartable(choose_cause(lost.faults), ("exceptions",), attempt=0, max_restarts=1)


def test_health_is_read_from_the_state():
    state = running_launch(2, 1)
    state.agent_table.heard_from(state.agents[0], 109.5)
    report = state.health(110.0, max_restarts=2, cause=None)
    assert report.healthy and report.launch_state == "running"  # every worker connected
    assert [w.state for w in report.workers] == [WorkerState.HEALTHY, WorkerState.HEALTHY]
    assert report.agents[0].last_heartbeat_age == 0.5
    state.begin_stop(restart=True)  # a restart begins ...
    state.record_restart("ValueError: x")
    state.agent_table.move_agent(state.agents[1], AgentState.LOST)
    state.begin_failure()  # ... and fails on a lost agent
    report = state.health(110.0, max_restarts=2, cause="AgentFailedError: silent")
    assert not report.healthy
    assert report.failures == ("attempt 0: ValueError: x", "attempt 0: AgentFailedError: silent")
    # Without rows (the live view at scale): the launch's own fields, no agent or worker.
    bare = state.health(110.0, max_restarts=2, cause="AgentFailedError: silent", rows=False)
    assert (bare.agents, bare.workers) == ((), ())
    assert bare == dataclasses.replace(report, agents=(), workers=())


def test_health_has_each_ranks_use_from_its_agents_heartbeat_and_its_collective_count():
    state = running_launch(1, 2)
    rank0 = state.ranks[0]
    usage = ((0, rank0.pid, 97.5, 3 << 30, 88, 40 << 30), (1, 4242, 5.0, 1 << 20, None, None))
    state.agent_table.heard_from(state.agents[0], 109.0, Heartbeat(usage))
    state.current.collectives_done(1, 17)
    state.current.collectives_done(0, -1)  # no recorder: nothing known
    first, second = state.health(110.0, max_restarts=0, cause=None).workers
    assert (first.cpu_percent, first.rss_bytes, first.gpu_percent, first.gpu_memory_bytes) == (
        97.5,
        3 << 30,
        88,
        40 << 30,
    )
    assert first.collectives is None and second.collectives == 17
    # Rank 1's figures are of another pid (a worker of an earlier attempt): not its own.
    assert (second.cpu_percent, second.rss_bytes) == (None, None)
    state.agent_table.heard_from(state.agents[0], 109.5, Heartbeat())  # its workers ended
    assert state.health(110.0, max_restarts=0, cause=None).workers[0].rss_bytes is None


def test_a_new_attempt_forgets_ranks_and_faults_but_keeps_the_history():
    state = running_launch(1, 2)
    state.current.add_fault("exception", ValueError("x"), at=1.0, rank=state.ranks[0])
    state.begin_stop(restart=True)
    state.agent_table.workers_ended(state.agents[0], WorkersEnded(29501, attempt=0))
    state.record_restart("ValueError: x")
    state.next_attempt()
    assert (state.attempt, state.ranks, state.faults) == (1, [], [])
    assert state.history == ["attempt 0: ValueError: x"]
    assert not state.agents[0].ready


def test_an_exit_reported_before_the_worker_connected_waits_for_its_hello():
    state = running_launch(1, 1, connected=False)  # its hello is still on its way
    rank = state.ranks[0]
    assert not state.current.worker_exited(rank, exited(0, at=10.0), now=11.0)
    assert state.current.hello_rank(WorkerHello(0, 0, 2000)) is rank  # ... and here it is
    state.current.worker_hello(rank, conn=7, pid=2000)
    state.current.worker_result(rank, WorkerResult(0), [bytearray(b"v")], now=11.2)
    assert state.current.worker_conn_closed(rank)
    assert state.current.settle(rank) == []
    assert rank.state is WorkerState.SUCCEEDED


def test_replies_that_cross_a_restart_change_nothing():
    state = running_launch(1, 2)
    agent = state.agents[0]
    state.begin_stop(restart=True)
    state.next_attempt()  # attempt 1: the old workers' last words may still come
    assert not state.agent_table.workers_ended(agent, WorkersEnded(29501, attempt=0))
    assert not agent.ready
    assert state.current.hello_rank(WorkerHello(0, 0, 3000, attempt=0)) is None
    assert state.agent_table.workers_ended(agent, WorkersEnded(29502, attempt=1))
    assert (agent.ready, agent.free_port) == (True, 29502)


def test_a_rank_has_one_connection():
    state = running_launch(1, 1)
    assert state.ranks[0].conn is not None
    assert state.current.hello_rank(WorkerHello(0, 0, 4000)) is None
    assert state.current.hello_rank(WorkerHello(5, 0, 4000)) is None  # no such rank


def test_a_stop_does_not_wait_for_the_ranks_of_a_lost_agent():
    state = running_launch(2, 1)
    state.begin_stop(restart=False)
    assert not state.current.ranks_known  # both ranks still run
    state.current.worker_exited(state.ranks[0], exited(0, sig=15, stopped=True), now=5.0)
    assert not state.current.ranks_known  # the lost host's rank: its link is cut, it never says
    state.agent_table.move_agent(state.agents[1], AgentState.LOST)
    assert state.current.ranks_known


def test_between_warm_runs_a_late_reply_of_the_last_run_means_the_agent_waits():
    state = running_launch(1, 1)
    agent = state.agents[0]
    state.begin_failure()  # the run failed; the agent was slow to stop its workers
    state.begin_stop(restart=True)
    state.failed_run()
    state.after_run(keep_workers=False)  # between warm runs
    assert not state.agent_table.workers_ended(
        agent, WorkersEnded(29501, attempt=2)
    )  # not from the future
    assert state.agent_table.workers_ended(
        agent, WorkersEnded(29501, attempt=0)
    )  # late, but it waits now
    assert agent.ready
    spec = state.agents[0].spec
    assert spec is not None
    state.current.assign(agent, spec)  # the next run's spec is out: late replies are stale again
    assert not state.progress.between_runs
    assert not state.agent_table.workers_ended(agent, WorkersEnded(29502, attempt=0))
    assert not agent.ready
