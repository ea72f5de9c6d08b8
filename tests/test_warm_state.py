"""Warm agents between runs, as pure event sequences on the launch state.

What the launcher learns while idle (an agent's end, its silence, a kept worker's death) and
what the next run then reads from the state, in the order the launcher learns it.
"""

from __future__ import annotations

from conftest import worker_spec

from torchrunx.errors import AgentFailedError, WorkerFailedError
from torchrunx.events import AgentState, WorkerFailed, WorkerState
from torchrunx.launcher.settings.resolve import HostSlots
from torchrunx.launcher.state.records import AgentRecord
from torchrunx.launcher.state.state import LaunchState
from torchrunx.wire.messages import (
    AgentHello,
    WorkerExited,
    WorkerResult,
    WorkersEnded,
    WorkersStarted,
)

AGENT_TIMEOUT = 5.0
START_TIMEOUT = 60.0


def launch(*, keep_workers: bool = False, hosts: int = 2, workers: int = 2) -> LaunchState:
    """Warm agents that said hello (at t=101), nothing run yet."""
    agents = [AgentRecord(i, HostSlots(f"node{i}", workers), "ssh") for i in range(hosts)]
    state = LaunchState(
        agents,
        started=100.0,
        agent_timeout=AGENT_TIMEOUT,
        start_timeout=START_TIMEOUT,
        keep_workers=keep_workers,
    )
    for agent in agents:
        hello = AgentHello(agent.index, agent.slots.hostname, 1000 + agent.index, workers, 29500)
        state.agent_table.agent_hello(agent, conn=agent.index, hello=hello, now=101.0)
    return state


def run_once(state: LaunchState, *, now: float = 110.0) -> None:
    """One successful run: specs, forks, hellos, results; then the agents wait (fresh workers)
    or the workers stay (keep_workers), as the orchestrator leaves them after a run."""
    hosts, workers = len(state.agents), state.agents[0].slots.workers
    for agent in state.agents:
        spec = worker_spec(agent.index, hosts, workers, state.attempt, keep=state.keep_workers)
        state.current.assign(agent, spec)
        pids = tuple(2000 + agent.index * workers + i for i in range(workers))
        state.current.workers_forked(agent, WorkersStarted(pids))
    for rank in state.ranks:
        state.current.worker_hello(rank, conn=100 + rank.rank, pid=2000 + rank.rank)
        state.current.worker_result(rank, WorkerResult(rank.rank), [bytearray(b"x")], now)
    if state.keep_workers:
        assert state.finished  # every rank returned: the run is over, its workers go on
        state.results_in(now)
        state.succeeded()
        state.after_run(keep_workers=True)  # the workers stay for the next call
        for agent in state.agents:
            state.agent_table.heard_from(agent, now)
        return
    for agent in state.agents:
        for local in range(workers):
            rank = state.current.rank_of(agent, local)
            assert rank is not None
            state.current.worker_exited(rank, WorkerExited(local, rank.pid, 0, None), now)
            state.current.worker_conn_closed(rank)
            state.current.settle(rank)
        assert state.agent_table.workers_ended(agent, WorkersEnded(29600, state.attempt))
        state.agent_table.heard_from(agent, now)
    assert state.finished
    state.results_in(now)
    state.succeeded()
    state.after_run(keep_workers=False)  # the agents wait for the next run's spec


# -- agents between runs ---------------------------------------------------------------------


def test_after_a_run_every_agent_waits_for_the_next_spec():
    state = launch()
    run_once(state)
    assert state.agent_table.unready_agents() == []
    assert all(a.ready and a.state is AgentState.RUNNING for a in state.agents)


def test_an_agent_that_ended_while_idle_is_unready_though_it_was_waiting():
    state = launch()
    run_once(state)
    agent = state.agents[1]
    assert state.agent_table.agent_conn_closed(
        agent
    )  # its connection closed while idle: judged now
    state.agent_table.move_agent(agent, AgentState.FAILED)
    assert agent.ready  # it was waiting for a spec when it died: that alone must not count
    assert state.agent_table.unready_agents() == [agent]


def test_an_idle_agent_that_has_forked_is_silent_after_agent_timeout():
    state = launch()
    run_once(state, now=110.0)
    assert state.agent_table.silent_agents(110.0 + AGENT_TIMEOUT - 0.1) == []
    silent = state.agent_table.silent_agents(110.0 + AGENT_TIMEOUT + 0.1)
    assert [(a.index, round(s, 1)) for a, s in silent] == [(0, 5.1), (1, 5.1)]


def test_an_agent_that_never_forked_answers_to_start_timeout_it_may_be_importing_torch():
    state = launch()
    assert state.agent_table.silent_agents(101.0 + AGENT_TIMEOUT + 1) == []
    assert state.agent_table.silent_agents(101.0 + START_TIMEOUT - 1) == []
    assert len(state.agent_table.silent_agents(101.0 + START_TIMEOUT + 1)) == 2


def test_silence_is_not_judged_while_stopping_and_a_lost_agent_is_over():
    state = launch()
    run_once(state)
    with state.stopping_meanwhile():
        assert state.agent_table.silent_agents(1000.0) == []
    (agent, _), *_ = state.agent_table.silent_agents(1000.0)
    assert state.agent_table.move_agent(agent, AgentState.LOST)
    assert agent in state.agent_table.unready_agents()
    assert agent not in [a for a, _ in state.agent_table.silent_agents(2000.0)]


def test_a_fault_while_idle_is_kept_for_the_next_run_to_read():
    state = launch()
    run_once(state)
    state.current.add_fault(
        "agent", AgentFailedError("node1", "connection closed"), 120.0, host_index=1
    )
    assert state.failed
    assert [f.host_index for f in state.faults] == [1]
    assert not state.faults[0].while_stopping


def test_next_attempt_keeps_waiting_agents_waiting_only_when_asked():
    state = launch()
    run_once(state)
    state.next_attempt(keep_ready=True)
    assert all(a.ready for a in state.agents)
    state.next_attempt()
    assert not any(a.ready for a in state.agents)


# -- workers that stay -----------------------------------------------------------------------


def test_with_kept_workers_a_run_is_over_when_every_rank_returned():
    state = launch(keep_workers=True)
    run_once(state)
    assert state.progress.kept_workers
    assert state.current.kept_workers_well()
    assert not any(a.ready for a in state.agents)  # busy with their workers, which stay


def test_the_next_call_reuses_ranks_connections_and_pids_running_again():
    state = launch(keep_workers=True)
    run_once(state)
    before = [(r.rank, r.conn, r.pid) for r in state.ranks]
    state.next_call()
    assert [(r.rank, r.conn, r.pid) for r in state.ranks] == before
    assert all(r.state is WorkerState.HEALTHY and r.result is None for r in state.ranks)
    assert not state.finished
    assert not state.progress.kept_workers
    for rank in state.ranks:
        state.current.worker_result(rank, WorkerResult(rank.rank), [bytearray(b"y")], 130.0)
    assert state.finished


def test_a_kept_worker_that_exits_while_idle_is_a_death_and_ends_the_kept_workers():
    state = launch(keep_workers=True)
    run_once(state)
    rank = state.ranks[1]
    state.current.take_result(rank)  # collected
    assert state.current.worker_exited(rank, WorkerExited(1, rank.pid, None, 9), 120.0) is False
    state.current.worker_conn_closed(rank)
    events = state.current.settle(rank)
    assert not state.current.kept_workers_well()
    assert [type(f.error) for f in state.faults] == [WorkerFailedError]
    assert [type(e) for e in events] == [WorkerFailed]  # told, though its run had ended
    assert rank.state is WorkerState.SUCCEEDED  # its run's outcome stands


def test_kept_workers_are_not_well_once_a_connection_closed_or_an_agent_ended():
    state = launch(keep_workers=True)
    run_once(state)
    state.current.worker_conn_closed(state.ranks[0])
    assert not state.current.kept_workers_well()
    state = launch(keep_workers=True)
    run_once(state)
    state.agent_table.move_agent(state.agents[1], AgentState.FAILED)
    assert not state.current.kept_workers_well()


def test_a_new_attempt_forgets_kept_workers():
    state = launch(keep_workers=True)
    run_once(state)
    state.next_attempt(keep_ready=True)
    assert not state.progress.kept_workers
    assert not state.current.kept_workers_well()
    assert state.ranks == []


# -- one answer: the restarts of the run under way -------------------------------------------


def test_health_counts_the_restarts_of_the_run_under_way_as_its_result_does():
    state = launch()
    for run, now in ((1, 110.0), (2, 130.0)):
        state.start_run(now, warm=True)
        state.run_workers(fresh=True)
        for agent in state.agents:
            state.current.assign(agent, worker_spec(agent.index, 2, 2, state.attempt))
        state.current.add_fault("exception", ValueError("x"), now, rank=state.ranks[0])
        state.begin_stop(restart=True)  # the run restarts once
        state.record_restart("ValueError: x")
        state.next_attempt()
        report = state.health(now + 1.0, max_restarts=1, cause=None)
        assert (report.restarts, state.restarts) == (1, 1)  # not the attempts of earlier runs
        assert report.attempt == state.attempt == 2 * run - 1
        assert report.failures == ("attempt 0: ValueError: x",)
        run_once(state, now=now + 2.0)
        assert state.finished_after == 2.0  # counted from the run's start, not the agents'
