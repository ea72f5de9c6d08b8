"""The rules of the launch state's moves (torchrunx/launcher/state/state.py), for every pair of states.

The expected moves are written out here from the diagram in the module's docstring (and
torchrunx/events.py's), not read from the module, so that a move added or removed there is
caught::

    AgentState:   STARTING ──▶ RUNNING ──▶ DONE
                     │            ├──────▶ FAILED   (died, its connection cut)
                     │            └──────▶ LOST     (silent for agent_timeout)
                     └──────────────────▶ FAILED    (could not start; no GPU for "gpu")

    WorkerState:  INIT ──▶ HEALTHY ──▶ SUCCEEDED
                    │         ├──────▶ FAILED
                    │         └──────▶ STOPPED
                    ├──────────────▶ FAILED
                    └──────────────▶ STOPPED
"""

from __future__ import annotations

import itertools

import pytest

from torchrunx.events import AgentState, WorkerState, WorkerStateChanged
from torchrunx.hosts.hostlists import HostSlots
from torchrunx.launcher.state.records import AgentRecord, RankRecord
from torchrunx.launcher.state.state import LaunchState
from torchrunx.wire.messages import WorkerSpec

A = AgentState
W = WorkerState

AGENT_ALLOWED: set[tuple[AgentState, AgentState]] = {
    (A.STARTING, A.RUNNING),
    (A.STARTING, A.FAILED),
    (A.RUNNING, A.DONE),
    (A.RUNNING, A.FAILED),
    (A.RUNNING, A.LOST),
}
AGENT_FINAL: set[AgentState] = {A.DONE, A.FAILED, A.LOST}

WORKER_ALLOWED: set[tuple[WorkerState, WorkerState]] = {
    (W.INIT, W.HEALTHY),
    (W.INIT, W.FAILED),
    (W.INIT, W.STOPPED),
    (W.HEALTHY, W.SUCCEEDED),
    (W.HEALTHY, W.FAILED),
    (W.HEALTHY, W.STOPPED),
}
WORKER_FINAL: set[WorkerState] = {W.SUCCEEDED, W.FAILED, W.STOPPED}


AGENT_PATHS: dict[AgentState, list[AgentState]] = {
    A.STARTING: [],
    A.RUNNING: [A.RUNNING],
    A.DONE: [A.RUNNING, A.DONE],
    A.FAILED: [A.FAILED],
    A.LOST: [A.RUNNING, A.LOST],
}
"""How an agent gets to each state from STARTING (by the moves above)."""

WORKER_PATHS: dict[WorkerState, list[WorkerState]] = {
    W.INIT: [],
    W.HEALTHY: [W.HEALTHY],
    W.SUCCEEDED: [W.HEALTHY, W.SUCCEEDED],
    W.FAILED: [W.FAILED],
    W.STOPPED: [W.STOPPED],
}
"""How a worker gets to each state from INIT (by the moves above)."""


def _launch() -> tuple[LaunchState, AgentRecord, RankRecord]:
    agent = AgentRecord(0, HostSlots("node0", 1), "local")
    state = LaunchState([agent], agent_timeout=30.0, started=0.0)
    state.current.assign(agent, WorkerSpec(0, "node0", 1, 0, 1, "127.0.0.1", 29500, "gloo", 60.0))
    return state, agent, state.ranks[0]


def _agent_in(state: LaunchState, agent: AgentRecord, target: AgentState) -> None:
    for new in AGENT_PATHS[target]:
        state.agent_table.move_agent(agent, new)


def _rank_in(state: LaunchState, rank: RankRecord, target: WorkerState) -> None:
    for new in WORKER_PATHS[target]:
        state.current.move_rank(rank, new)


def test_the_tables_name_every_state():
    """The expected tables cover both enums (a new state must be added to them)."""
    assert {s for pair in AGENT_ALLOWED for s in pair} | AGENT_FINAL == set(AgentState)
    assert {s for pair in WORKER_ALLOWED for s in pair} | WORKER_FINAL == set(WorkerState)
    assert {s for s in WorkerState if s.is_final} == WORKER_FINAL


@pytest.mark.parametrize(
    ("old", "new"), list(itertools.product(AgentState, AgentState)), ids=lambda s: s.value
)
def test_rule_an_agent_moves_only_along_the_diagram_and_a_final_state_stays(old, new):
    """Rule: an agent moves only along the documented arrows (any other move is a bug and
    raises ValueError); a final state (DONE, FAILED, LOST) never changes; a move to the state
    it is in changes nothing."""
    state, agent, _ = _launch()
    _agent_in(state, agent, old)
    if old in AGENT_FINAL or old == new:
        assert state.agent_table.move_agent(agent, new) is False
        assert agent.state is old
    elif (old, new) in AGENT_ALLOWED:
        assert state.agent_table.move_agent(agent, new) is True
        assert agent.state is new
        assert state.progress.degraded is (new in (A.FAILED, A.LOST))
    else:
        with pytest.raises(ValueError, match=f"{old.value} -> {new.value}"):
            state.agent_table.move_agent(agent, new)
        assert agent.state is old


@pytest.mark.parametrize(
    ("old", "new"), list(itertools.product(WorkerState, WorkerState)), ids=lambda s: s.value
)
def test_rule_a_worker_moves_only_along_the_diagram_and_a_final_state_stays(old, new):
    """Rule: a rank moves only along the documented arrows (any other move is a bug and raises
    ValueError), and each move is one WorkerStateChanged event; a final state (SUCCEEDED,
    FAILED, STOPPED) never changes; a move to the state it is in changes nothing."""
    state, _, rank = _launch()
    _rank_in(state, rank, old)
    if old in WORKER_FINAL or old == new:
        assert state.current.move_rank(rank, new) == []
        assert rank.state is old
    elif (old, new) in WORKER_ALLOWED:
        events = state.current.move_rank(rank, new)
        assert rank.state is new
        assert [(type(e), e.old, e.new) for e in events if isinstance(e, WorkerStateChanged)] == [
            (WorkerStateChanged, old, new)
        ]
        assert len(events) == 1
    else:
        with pytest.raises(ValueError, match=f"{old.value} -> {new.value}"):
            state.current.move_rank(rank, new)
        assert rank.state is old


@pytest.mark.parametrize("final", [W.SUCCEEDED, W.FAILED, W.STOPPED])
def test_rule_a_failure_of_a_rank_that_ended_is_recorded_but_does_not_move_it(final):
    """Rule: a rank fails once; a fault learnt after its end is a fact, not a move."""
    state, _, rank = _launch()
    _rank_in(state, rank, final)
    assert state.current.add_fault("exception", ValueError("late"), 1.0, rank=rank) == []
    assert rank.state is final
    assert [f.kind for f in state.faults] == ["exception"]


@pytest.mark.parametrize(
    "path",
    [
        [W.HEALTHY, W.SUCCEEDED],
        [W.HEALTHY, W.FAILED],
        [W.HEALTHY, W.STOPPED],
        [W.FAILED],
        [W.STOPPED],
    ],
    ids=lambda path: "-".join(s.value for s in path),
)
def test_rule_every_documented_worker_life_can_be_lived_from_init(path):
    """Rule: each documented life of a worker, from INIT to a final state, is allowed."""
    state, _, rank = _launch()
    for new in path:
        assert state.current.move_rank(rank, new) != []
    assert rank.state is path[-1]
    assert rank.state.is_final


@pytest.mark.parametrize(
    "path",
    [[A.RUNNING, A.DONE], [A.RUNNING, A.FAILED], [A.RUNNING, A.LOST], [A.FAILED]],
    ids=lambda path: "-".join(s.value for s in path),
)
def test_rule_every_documented_agent_life_can_be_lived_from_starting(path):
    """Rule: each documented life of an agent, from STARTING to a final state, is allowed."""
    state, agent, _ = _launch()
    for new in path:
        assert state.agent_table.move_agent(agent, new) is True
    assert agent.over
