"""The records a launch keeps: its phases and the moves allowed, each agent and rank, and faults.

Plain data, changed only by the methods of :class:`~torchrunx.launcher.state.state.LaunchState` and
its parts (see :mod:`torchrunx.launcher.state.state` for the drawing of :data:`PHASE_MOVES`; the
agent and worker moves are drawn in :mod:`torchrunx.events`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torchrunx.events import (
    AgentState,
    WorkerState,
)

if TYPE_CHECKING:
    from torchrunx.launcher.settings.plan import StartMethod
    from torchrunx.launcher.settings.resolve import HostSlots
    from torchrunx.wire.messages import (
        AgentHello,
        WorkerExited,
        WorkerResult,
        WorkerSpec,
        WorkerUsage,
    )


OUTCOME_WAIT = 2.0
"""Seconds a rank's (or agent's) reported exit waits for its connection to end."""

AGENT_MOVES: dict[AgentState, frozenset[AgentState]] = {
    AgentState.STARTING: frozenset({AgentState.RUNNING, AgentState.FAILED}),
    AgentState.RUNNING: frozenset({AgentState.DONE, AgentState.FAILED, AgentState.LOST}),
    AgentState.DONE: frozenset(),
    AgentState.FAILED: frozenset(),
    AgentState.LOST: frozenset(),
}
"""The agent states each state may move to."""

WORKER_MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.INIT: frozenset({WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.STOPPED}),
    WorkerState.HEALTHY: frozenset(
        {WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED}
    ),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
    WorkerState.STOPPED: frozenset(),
}
"""The worker states each state may move to."""


RUNNING_STATES = (WorkerState.HEALTHY, WorkerState.SUCCEEDED)


class Phase(str, enum.Enum):
    """What the launch as a whole is doing (``launch_state`` in ``GET /health``)."""

    STARTING_AGENTS = "starting agents"
    STARTING_WORKERS = "starting workers"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping after a failure"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    IDLE = "idle"
    """Warm agents between runs."""


PHASE_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING_AGENTS: frozenset({Phase.STARTING_WORKERS, Phase.STOPPING}),
    Phase.STARTING_WORKERS: frozenset({Phase.RUNNING, Phase.RESTARTING, Phase.STOPPING}),
    Phase.RUNNING: frozenset({Phase.SUCCEEDED, Phase.RESTARTING, Phase.STOPPING}),
    Phase.RESTARTING: frozenset({Phase.RUNNING, Phase.STOPPING}),
    Phase.STOPPING: frozenset({Phase.FAILED}),
    Phase.SUCCEEDED: frozenset({Phase.IDLE}),
    Phase.FAILED: frozenset({Phase.IDLE}),
    Phase.IDLE: frozenset(
        {Phase.STARTING_WORKERS, Phase.RUNNING, Phase.RESTARTING, Phase.STOPPING}
    ),
}
"""The phases each phase may move to (staying is always allowed). SUCCEEDED and FAILED to
IDLE: warm agents wait for the next run."""


@dataclass
class Progress:
    """Where the launch is: its phase, its attempt, and the flags every part of its state reads.

    Held by :class:`~torchrunx.launcher.state.state.LaunchState` and shared with its parts (the
    agent table, the attempt), which read it and move the phase only by :data:`PHASE_MOVES`.
    """

    started: float
    """Monotonic time the launch started."""
    phase: Phase = Phase.STARTING_AGENTS
    attempt: int = 0
    """The attempt under way, counted over the whole launch (warm runs go on counting)."""
    stopping: bool = False
    """The workers were told to stop: until the next attempt, what fails is no cause."""
    between_runs: bool = False
    """Warm agents after a run, until the next run's specs are sent."""
    kept_workers: bool = False
    """Between warm runs: the last run's workers stay, with their ranks, for the next call."""
    degraded: bool = False
    """Something failed; healthy again once a restart's workers all run."""

    def move_phase(self, new: Phase) -> None:
        """Move the launch to phase ``new`` (staying is allowed).

        Raises:
            ValueError: The move is not one of :data:`PHASE_MOVES` (a bug).
        """
        if new is not self.phase and new not in PHASE_MOVES[self.phase]:
            raise ValueError(f"launch: {self.phase.value} -> {new.value}")
        self.phase = new


STOP_GRACE = 3.0
"""Seconds workers get between SIGTERM and SIGKILL when the launch stops them."""

AgentRole = Literal["host", "spare", "quarantined"]
"""An agent's part in the launch (:attr:`AgentRecord.role`)."""

FaultKind = Literal[
    "exception",  # a worker raised (or its value could not be pickled)
    "collective",  # a worker raised a peer's echo (torchrunx.errors.is_collective_error)
    "death",  # a worker ended without an outcome (exit status, signal)
    "hang",  # a worker overran a watchdog scope (torchrunx.timer)
    "agent",  # an agent could not start, died, or its connection was cut
    "lost",  # an agent was silent for agent_timeout
    "launch",  # the launcher's own: start_timeout, launch_timeout, Ctrl-C, SIGTERM
]


@dataclass(frozen=True)
class Fault:
    """One failure, as it happened."""

    kind: FaultKind
    error: BaseException
    at: float
    """Unix time it happened (where it happened, if known; else when the launcher learnt it)."""
    seq: int
    """Order in which the launcher learnt of it."""
    rank: int | None = None
    host_index: int | None = None
    while_stopping: bool = False
    """It came after the launch began to stop (a consequence, never the cause if another
    fault came before)."""


@dataclass
class AgentRecord:
    """One host's agent."""

    index: int
    slots: HostSlots
    method: StartMethod
    state: AgentState = AgentState.STARTING
    conn: int | None = None
    """The ident of its connection (:class:`torchrunx.launcher.net.listener.Peer`)."""
    hello: AgentHello | None = None
    spec: WorkerSpec | None = None
    pids: tuple[int, ...] = ()
    last_heard: float = 0.0
    started_after: float = 0.0
    """Seconds from the launch's start to its hello."""
    free_port: int = 0
    ready: bool = False
    """Its workers of this attempt ended and it waits for a new spec or a Stop."""
    forked: bool = False
    """It has forked workers once: its torch import is over, its loop answers at once."""
    exit_status: int | None = None
    exited: bool = False
    conn_closed: bool = False
    judge_by: float | None = None
    """Its process ended before its connection: judged when the connection ends, or then."""
    role: AgentRole = "host"
    """``"host"``: one of the world's (it runs ranks); ``"spare"``: waits to replace one;
    ``"quarantined"``: it failed, and takes no further part
    (:mod:`torchrunx.launcher.state.spares`)."""
    usage: dict[int, WorkerUsage] = field(default_factory=dict)
    """What its running workers use, by pid, from its last heartbeat (``torchrunx top``)."""

    @property
    def remote(self) -> bool:
        """Whether it runs on another host (over SSH or srun)."""
        return self.method != "local"

    @property
    def over(self) -> bool:
        """Whether it has ended (or is given up on)."""
        return self.state in (AgentState.DONE, AgentState.FAILED, AgentState.LOST)


@dataclass
class RankRecord:
    """One worker of the current attempt."""

    rank: int
    host_index: int
    local_rank: int
    state: WorkerState = WorkerState.INIT
    conn: int | None = None
    """Its channel (through its agent)."""
    pid: int = 0
    direct: int | None = None
    """The connection of its own that brings a large outcome (:class:`DirectOutcome`)."""
    outcome_elsewhere: bool = False
    """Its outcome comes on a connection of its own, which has not ended yet: the end of its
    channel and its exit wait for it."""
    result: list[bytearray] | None = None
    timing: WorkerResult | None = None
    received_at: float = 0.0
    error: BaseException | None = None
    """What it raised (rebuilt), or its watchdog error."""
    exited: WorkerExited | None = None
    conn_closed: bool = False
    settle_by: float | None = None
    settled: bool = False
    collectives: int | None = None
    """Collectives it completed, from its last :class:`RankProgress` (None: none came)."""

    @property
    def has_outcome(self) -> bool:
        """Whether it sent a result or an exception (or overran a watchdog)."""
        return self.result is not None or self.error is not None
