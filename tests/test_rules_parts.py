"""Rules of the launch's parts, each on its own: made-up facts, no process, socket or clock.

The launch state is composed of an :class:`AgentTable` (every agent, the world) and an
:class:`AttemptState` (the attempt's ranks and faults) that share one :class:`Progress`; the
launch (``Launch``) of a :class:`LaunchLoop`, a :class:`HostChanges` and a :class:`Dispatch`.
Here each part is driven without the whole around it.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import types

import pytest

from torchrunx.errors import AgentFailedError, SerializationError
from torchrunx.events import AgentState
from torchrunx.launcher.launch.dispatch import Dispatch
from torchrunx.launcher.launch.orchestrator import Launch
from torchrunx.launcher.launcher import Launcher
from torchrunx.launcher.settings.plan import (
    LaunchPlan,
    Observability,
    PlanHosts,
    Reach,
    Resilience,
    Timeouts,
)
from torchrunx.launcher.settings.resolve import HostSlots
from torchrunx.launcher.state.agent_table import AgentTable
from torchrunx.launcher.state.attempt import AttemptState
from torchrunx.launcher.state.records import AgentRecord, Phase, Progress
from torchrunx.launcher.state.spares import Reshape
from torchrunx.launcher.state.state import LaunchState
from torchrunx.serialization import dumps
from torchrunx.wire.messages import AgentHello, WorkersEnded, WorkerSpec, WorkersStarted


def agents(hosts: int = 2, workers: int = 2) -> list[AgentRecord]:
    return [AgentRecord(i, HostSlots(f"node{i}", workers), "ssh") for i in range(hosts)]


def table(records: list[AgentRecord], *, world: int | None = None) -> AgentTable:
    for record in records[world:] if world is not None else []:
        record.role = "spare"
    return AgentTable(
        records,
        Progress(started=100.0),
        world=None if world is None else records[:world],
        agent_timeout=5.0,
        start_timeout=60.0,
    )


def hello(agent: AgentRecord, slots: int = 2) -> AgentHello:
    return AgentHello(agent.index, agent.slots.hostname, 1000 + agent.index, slots, 29500)


def spec(agent: AgentRecord, position: int, workers: int = 2, hosts: int = 2) -> WorkerSpec:
    return WorkerSpec(
        position,
        agent.slots.hostname,
        workers,
        position * workers,
        hosts * workers,
        "10.0.0.1",
        29500,
        "gloo",
        600.0,
    )


# -- the agent table ------------------------------------------------------------------------


def test_rule_the_agent_table_alone_takes_hellos_and_says_when_every_agent_of_the_world_did():
    records = agents(3)
    hosts = table(records, world=2)
    assert not hosts.all_hellos
    for agent in records[:2]:
        hosts.agent_hello(agent, agent.index, hello(agent), 101.0)
    assert hosts.all_hellos  # the spare is not waited for
    assert [a.state for a in records] == [AgentState.RUNNING] * 2 + [AgentState.STARTING]
    assert records[0].started_after == 1.0
    hosts.agents_ready(102.0)
    assert hosts.agents_started_after == 2.0
    assert not records[2].ready  # a spare that has not said hello does not wait for a spec


def test_rule_a_spare_that_says_hello_after_the_start_waits_for_a_spec_at_once():
    records = agents(2)
    hosts = table(records, world=1)
    hosts.progress.phase = Phase.RUNNING
    hosts.agent_hello(records[1], 1, hello(records[1]), 150.0)
    assert records[1].ready


def test_rule_the_agent_table_answers_silence_with_start_timeout_until_workers_fork():
    records = agents(1)
    hosts = table(records)
    hosts.agent_hello(records[0], 0, hello(records[0]), 100.0)
    assert hosts.silent_agents(130.0) == []  # importing torch: start_timeout (60 s)
    records[0].forked = True
    assert hosts.silent_agents(130.0) == [(records[0], 30.0)]  # agent_timeout (5 s)
    hosts.progress.stopping = True
    assert hosts.silent_agents(130.0) == []  # while stopping, silence is no fault


def test_rule_each_attempt_waits_anew_for_every_agent_of_the_world_to_end():
    records = agents(2)
    hosts = table(records)
    for agent in records:
        hosts.agent_hello(agent, agent.index, hello(agent), 101.0)
        assert hosts.workers_ended(agent, WorkersEnded(29500 + agent.index, attempt=0))
    assert hosts.all_waiting
    hosts.new_attempt(keep_ready=False)
    assert not hosts.all_waiting  # attempt 1's workers have not ended: no agent waits yet
    hosts.progress.attempt = 1
    assert hosts.workers_ended(records[0], WorkersEnded(29600, attempt=1))
    assert not hosts.all_waiting
    assert hosts.workers_ended(records[1], WorkersEnded(29601, attempt=1))
    assert hosts.all_waiting


def test_rule_after_a_stop_an_agent_that_never_connected_does_not_hold_up_the_end():
    records = agents(2)
    hosts = table(records)
    hosts.agent_hello(records[0], 0, hello(records[0]), 101.0)
    assert not hosts.stopped  # host 0 runs its workers
    assert hosts.workers_ended(records[0], WorkersEnded(29500, attempt=0))
    assert hosts.stopped  # host 1 never connected: nothing to wait for
    hosts.agent_hello(records[1], 1, hello(records[1]), 102.0)
    assert not hosts.stopped  # once connected, it is waited for


def test_rule_an_agent_failed_in_the_table_marks_the_launch_degraded():
    records = agents(1)
    hosts = table(records)
    hosts.agent_hello(records[0], 0, hello(records[0]), 100.0)
    assert hosts.move_agent(records[0], AgentState.LOST)
    assert hosts.progress.degraded
    assert not hosts.move_agent(records[0], AgentState.FAILED)  # a final state stays


def test_rule_the_world_reshaped_in_the_table_names_each_change_and_counts_as_all_hellos():
    records = agents(3)
    hosts = table(records, world=2)
    line = hosts.quarantine(records[1])
    assert line == "attempt 0: node1 (host 1, STARTING) quarantined"
    lines = hosts.reshape_world(Reshape(world=(0, 2), replaced=((1, 2),), dropped=()))
    assert lines == ["attempt 1: spare node2 replaces node1 (host 1)"]
    assert hosts.world == [records[0], records[2]]
    assert hosts.world_changes == [line, *lines]
    assert hosts.all_hellos  # the reshaped world is not a start phase


# -- the attempt ----------------------------------------------------------------------------


def running_attempt() -> AttemptState:
    records = agents(2)
    hosts = table(records)
    attempt = AttemptState(hosts, hosts.progress)
    for position, agent in enumerate(records):
        hosts.agent_hello(agent, agent.index, hello(agent), 101.0)
        attempt.assign(agent, spec(agent, position))
    return attempt


def test_rule_the_attempt_alone_moves_the_launch_to_running_once_every_rank_runs():
    attempt = running_attempt()
    assert attempt.progress.phase is Phase.STARTING_WORKERS
    for rank in attempt.ranks[:-1]:
        attempt.worker_hello(rank, 100 + rank.rank, 2000 + rank.rank)
    assert attempt.progress.phase is Phase.STARTING_WORKERS
    attempt.worker_hello(attempt.ranks[-1], 103, 2003)
    assert attempt.progress.phase is Phase.RUNNING


def test_rule_workers_that_start_while_the_launch_stops_do_not_make_it_run():
    attempt = running_attempt()
    attempt.progress.stopping = True
    attempt.progress.degraded = True
    for rank in attempt.ranks:
        attempt.worker_hello(rank, 100 + rank.rank, 2000 + rank.rank)
    assert attempt.progress.phase is Phase.STARTING_WORKERS
    assert attempt.progress.degraded


def test_rule_the_attempt_takes_the_forked_pids_of_its_agents_ranks():
    attempt = running_attempt()
    agent = attempt.table.agents[1]
    (event,) = attempt.workers_forked(agent, WorkersStarted((31, 32)))
    assert [r.pid for r in attempt.ranks] == [0, 0, 31, 32]
    assert event.ranks == (2, 3)
    assert agent.forked


def test_rule_an_agent_failure_is_the_attempts_fault_only_for_a_host_of_the_world():
    attempt = running_attempt()
    first, second = attempt.table.agents
    error = AgentFailedError("node1", "it died")
    second.role = "spare"
    assert attempt.agent_failed(second, error, 1.0) == []
    assert second.state is AgentState.FAILED
    assert attempt.faults == []
    attempt.agent_failed(first, error, 2.0, lost=True)
    assert first.state is AgentState.LOST
    assert [(f.kind, f.host_index) for f in attempt.faults] == [("lost", 0)]


def test_rule_a_cleared_attempt_keeps_the_ranks_given_and_forgets_every_fault():
    attempt = running_attempt()
    attempt.add_fault("launch", KeyboardInterrupt(), 1.0)
    attempt.stacks[0] = "stack"
    attempt.clear([])
    assert (attempt.ranks, attempt.faults, attempt.stacks) == ([], [], {})
    assert not attempt.all_returned


# -- the dispatch ---------------------------------------------------------------------------


def test_rule_results_are_collected_per_host_of_the_world_in_rank_order():
    records = agents(2, workers=1)
    state = LaunchState(records, started=0.0, agent_timeout=5.0, world=records[::-1])
    for position, agent in enumerate(state.world):
        state.agent_table.agent_hello(agent, agent.index, hello(agent, 1), 1.0)
        state.current.assign(agent, spec(agent, position, workers=1))
    for rank in state.ranks:
        state.current.worker_hello(rank, 10 + rank.rank, 20 + rank.rank)
        value = [bytearray(part) for part in dumps(f"rank {rank.rank}")]
        state.current.worker_result(rank, None, value, 2.0)  # type: ignore[arg-type]
    dispatch = Dispatch(types.SimpleNamespace(state=state))  # type: ignore[arg-type]
    assert dispatch.collect() == (("rank 0",), ("rank 1",))


def test_rule_a_result_that_cannot_be_unpickled_here_names_its_rank():
    records = agents(1, workers=1)
    state = LaunchState(records, started=0.0, agent_timeout=5.0)
    state.agent_table.agent_hello(records[0], 0, hello(records[0], 1), 1.0)
    state.current.assign(records[0], spec(records[0], 0, workers=1, hosts=1))
    rank = state.ranks[0]
    state.current.worker_hello(rank, 10, 20)
    state.current.worker_result(rank, None, [bytearray(b"not a pickle")], 2.0)  # type: ignore[arg-type]
    with pytest.raises(SerializationError, match="return value of rank 0"):
        Dispatch(types.SimpleNamespace(state=state)).collect()  # type: ignore[arg-type]


# -- composition, and one default per setting ---------------------------------------------


def test_rule_the_launch_and_its_state_hold_their_parts_and_inherit_none():
    assert Launch.__bases__ == (object,)
    assert LaunchState.__bases__ == (object,)
    assert AttemptState.__bases__ == (object,)
    assert AgentTable.__bases__ == (object,)


def test_rule_agent_timeout_has_one_default_the_launchers():
    assert Launcher().agent_timeout == 5.0
    plan_field = {f.name: f for f in dataclasses.fields(Timeouts)}["agent"]
    assert plan_field.default is dataclasses.MISSING
    parameter = inspect.signature(LaunchState).parameters["agent_timeout"]
    assert parameter.default is inspect.Parameter.empty
    assert Launcher(hostnames=["localhost"], workers_per_host=1).plan().timeouts.agent == 5.0


def test_rule_every_setting_has_one_default_the_launchers_the_plan_none():
    groups = (LaunchPlan, PlanHosts, Reach, Timeouts, Resilience, Observability)
    for group in groups:
        for field in dataclasses.fields(group):
            assert field.default is dataclasses.MISSING, (group.__name__, field.name)
            assert field.default_factory is dataclasses.MISSING, (group.__name__, field.name)
    grouped = {f.name for f in dataclasses.fields(LaunchPlan)}
    assert grouped >= {"hosts", "reach", "timeouts", "resilience", "observability", "from_env"}


def test_rule_the_event_sink_calls_each_handler_its_way_and_drops_one_that_fails(caplog):
    from torchrunx.events import EventSink, LaunchFinished

    class Recorder:  # an EventRecorder: its record method gets the events
        def __init__(self) -> None:
            self.seen: list[object] = []

        def record(self, event: object) -> None:
            self.seen.append(event)

        def __call__(self, event: object) -> None:  # not used: record wins
            raise AssertionError(f"called instead of record: {event}")

    recorder, plain, calls = Recorder(), [], []

    def failing(event: object) -> None:
        calls.append(event)
        raise RuntimeError("handler bug")

    sink = EventSink([recorder, failing, plain.append, "not a handler"], None)
    first = LaunchFinished(succeeded=True, attempts=1, duration=1.0, error=None)
    second = dataclasses.replace(first, succeeded=False, error="x")
    with caplog.at_level(logging.ERROR, logger="torchrunx"):
        sink.emit(first)
        sink.emit(second)
    assert recorder.seen == [first, second]
    assert plain == [first, second]
    assert calls == [first]  # reported once, then no more events
    assert caplog.text.count("gets no more events") == 1
    assert "handler bug" in caplog.text
