"""Rules of a run as the launch state keeps it: its start, its workers, its stops, restarts and
end, the phase moves they make, and the failures that never restart.

Pure: the launch state is driven through its methods in the order the orchestrator and the
warm agents' code call them (torchrunx/launcher/launch/orchestrator.py, warm.py); no process starts.
"""

from __future__ import annotations

import pytest
from conftest import worker_spec

from torchrunx.errors import AgentFailedError
from torchrunx.events import AgentState, WorkerFailed, WorkerState
from torchrunx.hosts import HostSlots
from torchrunx.launcher.launch.inbox import Inbox
from torchrunx.launcher.state.failures import restarts_for
from torchrunx.launcher.state.records import PHASE_MOVES, AgentRecord, Fault, Phase
from torchrunx.launcher.state.state import LaunchState
from torchrunx.wire.messages import AgentHello, WorkerResult

STARTED = 100.0


def agents_up(hosts: int = 2, workers: int = 1) -> LaunchState:
    """Every agent said hello (t=101) and waits for its first spec, as after Launch.open."""
    agents = [AgentRecord(i, HostSlots(f"node{i}", workers), "ssh") for i in range(hosts)]
    state = LaunchState(agents, agent_timeout=30.0, started=STARTED)
    for agent in agents:
        hello = AgentHello(agent.index, agent.slots.hostname, 1000 + agent.index, workers, 29500)
        state.agent_table.agent_hello(agent, conn=agent.index, hello=hello, now=101.0)
    state.agent_table.agents_ready(102.5)
    return state


def assign_all(state: LaunchState) -> None:
    hosts, workers = len(state.agents), state.agents[0].slots.workers
    for agent in state.agents:
        state.current.assign(agent, worker_spec(agent.index, hosts, workers, state.attempt))


def all_run(state: LaunchState) -> None:
    for rank in state.ranks:
        state.current.worker_hello(rank, conn=100 + rank.rank, pid=2000 + rank.rank)


# -- the start of the agents and of a run ------------------------------------------------------


def test_rule_once_every_agent_said_hello_each_waits_for_a_spec_and_the_start_is_timed():
    state = agents_up()
    assert state.agent_table.unready_agents() == []
    assert all(a.ready for a in state.agents)
    assert state.agent_table.agents_started_after == 2.5


def test_rule_a_launchs_run_counts_from_the_launchs_start_a_warm_run_from_its_own():
    state = agents_up()
    state.start_run(110.0, warm=False)
    assert (state.runs, state.run_started) == (1, STARTED)
    state.start_run(120.0, warm=True)
    state.start_run(130.0, warm=True)
    assert (state.runs, state.run_started) == (3, 130.0)


def test_rule_a_run_counts_only_its_own_restarts():
    state = agents_up()
    state.start_run(110.0, warm=True)
    state.run_workers(fresh=True)
    assign_all(state)
    state.begin_stop(restart=True)
    state.record_restart("ValueError: x")
    state.next_attempt()
    assert (state.attempt, state.restarts) == (1, 1)
    state.start_run(120.0, warm=True)  # the next run: attempts go on, its restarts start at 0
    assert (state.attempt, state.first_attempt, state.restarts) == (1, 1, 0)
    state.run_workers(fresh=False)
    assert state.fresh_workers is False
    state.run_workers(fresh=True)
    assert state.fresh_workers is True


# -- stops, failures, restarts -------------------------------------------------------------------


def test_rule_a_failure_stops_the_launch_and_makes_it_unhealthy_at_once():
    state = agents_up()
    state.start_run(110.0, warm=False)
    assign_all(state)
    all_run(state)
    assert state.phase is Phase.RUNNING and state.progress.degraded is False
    state.begin_failure()
    assert state.phase is Phase.STOPPING and state.progress.degraded is True
    assert state.health(111.0, max_restarts=0, cause=None).healthy is False
    state.failed_run()
    assert state.phase is Phase.FAILED


@pytest.mark.parametrize(("restart", "phase"), [(True, Phase.RESTARTING), (False, Phase.STOPPING)])
def test_rule_a_stop_restarts_or_stops_and_what_fails_then_is_its_consequence(restart, phase):
    state = agents_up()
    assign_all(state)
    all_run(state)
    state.begin_stop(restart=restart)
    assert state.phase is phase and state.progress.stopping is True
    state.current.add_fault("agent", AgentFailedError("node1", "gone"), 111.0, host_index=1)
    assert state.faults[0].while_stopping is True


def test_rule_the_stop_of_a_failed_run_stays_a_stop_though_the_agents_stay():
    state = agents_up()
    assign_all(state)
    state.begin_failure()
    state.begin_stop(restart=True)  # warm agents: only the run's workers stop
    assert state.phase is Phase.STOPPING


def test_rule_a_late_hello_while_the_launch_stops_neither_runs_it_nor_heals_it():
    state = agents_up(hosts=1, workers=2)
    assign_all(state)
    state.current.worker_hello(state.ranks[0], conn=100, pid=2000)
    state.current.add_fault("exception", ValueError("x"), 105.0, rank=state.ranks[0])
    state.begin_stop(restart=True)
    state.current.worker_hello(state.ranks[1], conn=101, pid=2001)  # comes in during the stop
    assert state.phase is Phase.RESTARTING and state.progress.degraded is True


def test_rule_a_hello_after_a_failure_but_before_the_stop_does_not_run_the_launch():
    state = agents_up(hosts=1, workers=2)
    assign_all(state)
    state.current.worker_hello(state.ranks[0], conn=100, pid=2000)
    state.begin_failure()  # the failure is known; the Stop is not sent yet
    state.current.worker_hello(state.ranks[1], conn=101, pid=2001)
    assert state.phase is Phase.STOPPING and state.progress.degraded is True


def test_rule_a_restart_that_could_not_be_made_raises_its_cause_named_once():
    state = agents_up()
    assign_all(state)
    state.begin_stop(restart=True)
    state.record_restart("ValueError: x")
    assert state.history == ["attempt 0: ValueError: x"]
    state.restart_failed("the agents of ['node1'] did not get ready")
    assert state.history == []  # the cause is the error raised, not an earlier attempt's
    assert state.extra_failures == ["the agents of ['node1'] did not get ready"]
    state.add_extra_failure("one more")
    assert state.extra_failures[-1] == "one more"


def test_rule_a_replaced_agent_starts_anew_on_the_same_host_and_waits_once_it_said_hello():
    state = agents_up()
    state.agent_table.move_agent(state.agents[1], AgentState.LOST)
    old = state.agent_table.replace_agent(1)
    assert old.state is AgentState.LOST
    new = state.agents[1]
    assert (new.index, new.slots, new.method, new.state) == (
        1,
        old.slots,
        "ssh",
        AgentState.STARTING,
    )
    assert new.hello is None
    state.agent_table.replacements_started([1])
    assert new.ready is False  # it never said hello
    hello = AgentHello(1, "node1", 1001, 1, 29500)
    state.agent_table.agent_hello(new, conn=7, hello=hello, now=130.0)
    state.agent_table.replacements_started([1])
    assert new.ready is True and state.agent_table.unready_agents() == []


def test_rule_before_a_warm_run_what_failed_while_idle_is_forgotten():
    state = agents_up()
    state.current.add_fault("lost", AgentFailedError("node1", "silent"), 105.0, host_index=1)
    assert state.failed
    state.forget_idle_faults()
    assert state.faults == [] and not state.failed


@pytest.mark.parametrize("succeeded", [True, False])
def test_rule_after_a_warm_run_its_failures_are_forgotten_and_the_agents_wait(succeeded):
    state = agents_up()
    state.start_run(110.0, warm=True)
    assign_all(state)
    all_run(state)
    if succeeded:
        for rank in state.ranks:
            state.current.worker_result(rank, WorkerResult(rank.rank), [bytearray(b"x")], 111.0)
        state.succeeded()
    else:
        state.current.add_fault("exception", ValueError("x"), 111.0, rank=state.ranks[0])
        state.begin_failure()
        state.add_extra_failure("and something else")
        state.failed_run()
    state.after_run(keep_workers=False)
    assert state.phase is Phase.IDLE and state.progress.degraded is False
    assert state.history == [] and state.extra_failures == [] and state.faults == []
    assert state.progress.between_runs is True and state.ranks == []
    assert state.health(112.0, max_restarts=0, cause=None).healthy is True


def test_rule_after_a_successful_run_kept_workers_stay_with_their_ranks():
    state = LaunchState(
        [AgentRecord(0, HostSlots("node0", 1), "ssh")],
        agent_timeout=30.0,
        started=STARTED,
        keep_workers=True,
    )
    state.agent_table.agent_hello(
        state.agents[0], conn=0, hello=AgentHello(0, "node0", 1000, 1, 1), now=101.0
    )
    state.agent_table.agents_ready(101.0)
    state.start_run(110.0, warm=True)
    assign_all(state)
    all_run(state)
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray(b"x")], 111.0)
    state.succeeded()
    state.after_run(keep_workers=True)
    assert state.progress.kept_workers is True and len(state.ranks) == 1
    assert state.current.kept_workers_well()


# -- the phase table -------------------------------------------------------------------------


def test_rule_a_phase_move_outside_the_table_is_refused_and_names_both_phases():
    state = agents_up()
    assert Phase.SUCCEEDED not in PHASE_MOVES[Phase.STARTING_AGENTS]
    with pytest.raises(ValueError, match=r"^launch: starting agents -> succeeded$"):
        state.progress.move_phase(Phase.SUCCEEDED)
    state.progress.move_phase(Phase.STARTING_AGENTS)  # staying is allowed
    assert state.phase is Phase.STARTING_AGENTS


def test_rule_every_phase_can_end_and_only_failures_reach_failed():
    for phase, moves in PHASE_MOVES.items():
        assert phase in (Phase.FAILED, Phase.SUCCEEDED, Phase.STOPPING) or Phase.STOPPING in moves
        assert (Phase.FAILED in moves) == (phase is Phase.STOPPING)


# -- agents' failures and what never restarts ----------------------------------------------


def test_rule_an_agent_failure_is_a_failed_agent_and_an_agent_fault_by_default():
    state = agents_up()
    error = AgentFailedError("node1", "died")
    assert state.current.agent_failed(state.agents[1], error, 105.0) == []
    assert state.agents[1].state is AgentState.FAILED
    assert state.faults == [Fault("agent", error, 105.0, 0, None, 1)]
    state.current.agent_failed(
        state.agents[0], None, 106.0, lost=True
    )  # no fault: while stopping, say
    assert state.agents[0].state is AgentState.LOST and len(state.faults) == 1


def test_rule_the_launchers_own_errors_and_a_workers_interrupt_never_restart():
    every = {"exceptions", "deaths", "timeouts", "hosts", "OSError", "KeyboardInterrupt"}
    assert restarts_for(OSError("the launcher's"), every, from_worker=False) is False
    assert restarts_for(KeyboardInterrupt(), every, from_worker=True) is False
    assert restarts_for(SystemExit(1), every, from_worker=True) is False
    assert restarts_for(OSError("a worker's"), {"exceptions"}, from_worker=True) is True


def test_rule_the_inbox_records_a_fault_with_its_rank_and_host_and_emits_what_follows():
    events: list[object] = []

    class Sink:
        def emit(self, event: object) -> None:
            events.append(event)

    state = agents_up(hosts=2, workers=1)
    assign_all(state)
    all_run(state)
    inbox = Inbox(
        None,  # type: ignore[arg-type]  # the plan: not read by fault()
        state,
        listener=None,  # type: ignore[arg-type]
        pool=None,  # type: ignore[arg-type]
        logs=None,  # type: ignore[arg-type]
        sink=Sink(),  # type: ignore[arg-type]
    )
    error = ValueError("x")
    inbox.fault("exception", error, 105.0, rank=state.ranks[1])
    inbox.fault("agent", AgentFailedError("node0", "gone"), 106.0, host_index=0)
    assert [(f.kind, f.at, f.rank, f.host_index) for f in state.faults] == [
        ("exception", 105.0, 1, 1),
        ("agent", 106.0, None, 0),
    ]
    assert state.ranks[1].state is WorkerState.FAILED
    failed = [e for e in events if isinstance(e, WorkerFailed)]
    assert [(e.rank, e.host_index, e.reason) for e in failed] == [(1, 1, "ValueError: x")]
