"""The state of one launch, as pure data: what each agent and each rank is, and what happened.

Nothing here touches a socket, a process or the clock: the launch (:mod:`torchrunx.launch`)
applies what it reads (messages, ends of connections and processes, the time) and emits the
public events the methods return. The enums of :mod:`torchrunx.events` are the source of
truth,
and only these moves are allowed (:data:`AGENT_MOVES`, :data:`WORKER_MOVES`)::

    AgentState:   STARTING ──▶ RUNNING ──▶ DONE
                     │            ├──────▶ FAILED   (died, its connection cut)
                     │            └──────▶ LOST     (silent for agent_timeout)
                     └──────────────────▶ FAILED    (could not start; no GPU for "gpu")

    WorkerState:  INIT ──▶ HEALTHY ──▶ SUCCEEDED
                    │         ├──────▶ FAILED
                    │         └──────▶ STOPPED
                    ├──────────────▶ FAILED
                    └──────────────▶ STOPPED

Failures are recorded as :class:`Fault` facts while the launch runs; which one is the cause is
decided once everything has stopped, by :mod:`torchrunx.launcher.failures`.

A rank's end has two halves that travel apart: its agent reports the exit (``WorkerExited``)
and its own connection carries its outcome (a result or an exception) and then closes. A rank
"settles" when both are known, or, if its connection stays open (a forked child may hold it),
:data:`OUTCOME_WAIT` seconds after its exit. An agent's end is judged the same way: its exit can
overtake its last message (``AgentDone``) on its connection.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torchrunx.errors import WorkerFailedError
from torchrunx.events import (
    AgentStarted,
    AgentState,
    Event,
    WorkerFailed,
    WorkerState,
    WorkerStateChanged,
)
from torchrunx.events import WorkersStarted as WorkersStartedEvent
from torchrunx.launcher.health import AgentHealth, HealthReport, WorkerHealth
from torchrunx.launcher.reports import summary
from torchrunx.launcher.results import LaunchTimings

if TYPE_CHECKING:
    from torchrunx.hosts.resolve import HostSlots
    from torchrunx.wire.messages import (
        AgentHello,
        WorkerExited,
        WorkerHello,
        WorkerResult,
        WorkersEnded,
        WorkerSpec,
        WorkersStarted,
    )

OUTCOME_WAIT = 2.0
"""Seconds a rank's (or agent's) reported exit waits for its connection to end."""

StartMethod = Literal["local", "ssh", "srun"]

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


_RUNNING = (WorkerState.HEALTHY, WorkerState.SUCCEEDED)


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
    """The ident of its connection (:class:`torchrunx.launcher.listener.Peer`)."""
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
    pid: int = 0
    result: list[bytearray] | None = None
    timing: WorkerResult | None = None
    received_at: float = 0.0
    error: BaseException | None = None
    """What it raised (rebuilt), or its watchdog error."""
    exited: WorkerExited | None = None
    conn_closed: bool = False
    settle_by: float | None = None
    settled: bool = False

    @property
    def has_outcome(self) -> bool:
        """Whether it sent a result or an exception (or overran a watchdog)."""
        return self.result is not None or self.error is not None


@dataclass
class LaunchState:
    """Every agent and rank of one launch, the faults seen, and the launch's phase."""

    agents: list[AgentRecord]
    started: float
    """Monotonic time the launch started."""
    max_restarts: int = 0
    agent_timeout: float = 30.0
    start_timeout: float = 60.0
    keep_workers: bool = False
    """Workers that stay from run to run (warm agents): a run is over when every rank
    returned, while its workers (and so its agents) go on."""
    kept_workers: bool = False
    """Between warm runs: the last run's workers stay, with their ranks, for the next call."""
    ranks: list[RankRecord] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    """One line per earlier attempt's failure (``attempt N: Type: message``)."""
    stacks: dict[int, str] = field(default_factory=dict)
    """Python stacks of ranks still running when the launch stopped."""
    phase: Phase = Phase.STARTING_AGENTS
    attempt: int = 0
    stopping: bool = False
    between_runs: bool = False
    """Warm agents after a run, until the next run's specs are sent."""
    degraded: bool = False
    """Something failed; healthy again once a restart's workers all run."""
    agents_started_after: float = 0.0
    finished_after: float = 0.0
    # Kept as they change, so that the loop's checks do not walk every rank at every wake-up.
    _results: int = 0
    _running: int = 0
    """Ranks that are HEALTHY or SUCCEEDED."""
    _alarmed: set[int] = field(default_factory=set)
    _waiting_ranks: set[int] = field(default_factory=set)
    _waiting_agents: set[int] = field(default_factory=set)
    _agents_seen: int = 0
    """Agents before this index said hello (the start phase only: replacements come later)."""
    _agents_ended: int = 0
    """Agents before this index are over or ready (within one attempt)."""

    # -- moves --------------------------------------------------------------------------

    def move_agent(self, agent: AgentRecord, new: AgentState) -> bool:
        """Move ``agent`` to ``new``; ``False`` (no change) if it already ended.

        Raises:
            ValueError: The move is not one of :data:`AGENT_MOVES` (a bug).
        """
        if agent.state == new or agent.over:
            return False
        if new not in AGENT_MOVES[agent.state]:
            raise ValueError(f"agent {agent.index}: {agent.state.value} -> {new.value}")
        agent.state = new
        if new in (AgentState.FAILED, AgentState.LOST):
            self.degraded = True
        return True

    def move_rank(self, rank: RankRecord, new: WorkerState) -> list[Event]:
        """Move ``rank`` to ``new``; the event that says so (none if it already ended).

        Raises:
            ValueError: The move is not one of :data:`WORKER_MOVES` (a bug).
        """
        if rank.state == new or rank.state.is_final:
            return []
        if new not in WORKER_MOVES[rank.state]:
            raise ValueError(f"rank {rank.rank}: {rank.state.value} -> {new.value}")
        old, rank.state = rank.state, new
        self._running += (new in _RUNNING) - (old in _RUNNING)
        if new in _RUNNING and self._running == len(self.ranks):
            self.degraded = False  # after a restart: healthy again once every worker runs
            self.phase = Phase.RUNNING
        return [
            WorkerStateChanged(
                rank.rank,
                rank.host_index,
                self.hostname(rank),
                rank.local_rank,
                self.attempt,
                old,
                new,
            )
        ]

    def hostname(self, rank: RankRecord) -> str:
        """The host name of ``rank``'s agent."""
        return self.agents[rank.host_index].slots.hostname

    # -- faults -------------------------------------------------------------------------

    def add_fault(
        self,
        kind: FaultKind,
        error: BaseException,
        at: float,
        *,
        rank: RankRecord | None = None,
        host_index: int | None = None,
    ) -> list[Event]:
        """Record a failure; a rank's is also its move to ``FAILED``."""
        self.faults.append(
            Fault(
                kind,
                error,
                at,
                len(self.faults),
                None if rank is None else rank.rank,
                host_index if rank is None else rank.host_index,
                while_stopping=self.stopping,
            )
        )
        self.degraded = True
        if rank is None:
            return []
        if rank.state.is_final:
            if not self.kept_workers:
                return []
            events: list[Event] = []  # a kept worker, between runs: it ran, and died since
        else:
            events = self.move_rank(rank, WorkerState.FAILED)
        events.append(
            WorkerFailed(
                rank.rank,
                rank.host_index,
                self.hostname(rank),
                rank.local_rank,
                self.attempt,
                summary(error),
            )
        )
        return events

    @property
    def failed(self) -> bool:
        """Whether any failure was recorded in this attempt."""
        return bool(self.faults)

    # -- agents -------------------------------------------------------------------------

    def agent_hello(
        self, agent: AgentRecord, conn: int, hello: AgentHello, now: float
    ) -> list[Event]:
        """An agent connected back and said what its host offers."""
        agent.conn, agent.hello, agent.last_heard = conn, hello, now
        agent.free_port = hello.free_port
        agent.started_after = now - self.started
        self.move_agent(agent, AgentState.RUNNING)
        return [
            AgentStarted(
                agent.index,
                agent.slots.hostname,
                hello.pid,
                hello.slots,
                agent.started_after,
                gpus=hello.gpus,
            )
        ]

    def workers_forked(self, agent: AgentRecord, message: WorkersStarted) -> list[Event]:
        """An agent forked its workers."""
        agent.pids, agent.forked = message.pids, True
        if agent.spec is None:
            return []
        offset = agent.spec.rank_offset
        for local_rank, pid in enumerate(message.pids):
            if self.ranks[offset + local_rank].pid == 0:
                self.ranks[offset + local_rank].pid = pid
        return [
            WorkersStartedEvent(
                agent.index,
                agent.slots.hostname,
                self.attempt,
                tuple(range(offset, offset + len(message.pids))),
                message.pids,
                backend=agent.spec.backend,
            )
        ]

    def workers_ended(self, agent: AgentRecord, message: WorkersEnded) -> bool:
        """The agent's workers of an attempt ended and it waits; ``False`` for a late reply.

        A reply about an earlier attempt (it crossed a restart) changes nothing.
        """
        # Between warm runs, an earlier attempt's reply means the same (an agent that was slow
        # to stop the last run's workers): the agent waits for a spec.
        late = self.between_runs and message.attempt < self.attempt
        if message.attempt != self.attempt and not late:
            return False
        agent.free_port, agent.ready = message.free_port, True
        return True

    def agent_done(self, agent: AgentRecord) -> None:
        """The agent's workers all ended and were reaped; it exits next."""
        self.move_agent(agent, AgentState.DONE)

    def agent_exited(self, agent: AgentRecord, status: int | None, now: float) -> bool:
        """Its process ended; ``True`` if that is judged now (see :meth:`judge_agent_end`)."""
        agent.exited, agent.exit_status = True, status
        if agent.conn is not None and not agent.conn_closed and not agent.over:
            agent.judge_by = now + OUTCOME_WAIT  # its last messages may still be on the way
            self._waiting_agents.add(agent.index)
            return False
        return True

    def agent_conn_closed(self, agent: AgentRecord) -> bool:
        """Its connection ended; ``True`` if the agent must be judged now."""
        agent.conn_closed = True
        return not agent.over

    # -- ranks --------------------------------------------------------------------------

    def assign(self, agent: AgentRecord, spec: WorkerSpec) -> None:
        """Give ``agent`` its workers of this attempt (ranks ``rank_offset`` onwards)."""
        self.between_runs = False
        agent.spec, agent.ready, agent.pids = spec, False, ()
        self.ranks.extend(
            RankRecord(spec.rank_offset + local, agent.index, local)
            for local in range(spec.num_workers)
        )

    def rank_of(self, agent: AgentRecord, local_rank: int) -> RankRecord | None:
        """The rank of this attempt behind ``agent``'s worker ``local_rank``."""
        if agent.spec is None:
            return None
        index = agent.spec.rank_offset + local_rank
        return self.ranks[index] if index < len(self.ranks) else None

    def hello_rank(self, message: WorkerHello) -> RankRecord | None:
        """The rank a worker's hello is for; ``None`` if it is not one of this attempt's.

        A worker of an earlier attempt may connect late (after a restart), and a rank has one
        connection: a second hello for it is refused.
        """
        if message.attempt != self.attempt or not 0 <= message.rank < len(self.ranks):
            return None
        rank = self.ranks[message.rank]
        return rank if rank.conn is None else None

    def worker_hello(self, rank: RankRecord, conn: int, pid: int) -> list[Event]:
        """A worker connected (its own connection)."""
        rank.conn, rank.pid = conn, pid
        return self.move_rank(rank, WorkerState.HEALTHY)

    def worker_result(
        self, rank: RankRecord, timing: WorkerResult, payload: list[bytearray], now: float
    ) -> list[Event]:
        """A worker's function returned; ``payload`` is its pickled value."""
        if rank.result is None:
            self._results += 1
        rank.result, rank.timing, rank.received_at = payload, timing, now
        return self.move_rank(rank, WorkerState.SUCCEEDED)

    def worker_exited(self, rank: RankRecord, message: WorkerExited, now: float) -> bool:
        """Its agent saw it end; ``True`` if it settles now (see :meth:`settle`)."""
        rank.exited, rank.pid = message, message.pid
        if rank.conn_closed or rank.has_outcome or message.stopped:
            return True
        # Its outcome may still be on its own connection (or its hello, if it never got one).
        rank.settle_by = now + OUTCOME_WAIT
        self._waiting_ranks.add(rank.rank)
        if message.signal is not None or message.exitcode not in (0, None):
            self._alarmed.add(rank.rank)
        return False

    @property
    def alarm(self) -> bool:
        """A rank exited abnormally (signal, non-zero status) and is not judged yet.

        The launch stops on it at once; what it failed with is decided once its connection
        ends (an exception may still be on the way) or :data:`OUTCOME_WAIT` has passed.
        """
        return any(
            not self.ranks[i].settled and not self.ranks[i].has_outcome for i in self._alarmed
        )

    def worker_conn_closed(self, rank: RankRecord) -> bool:
        """Its connection ended; ``True`` if it settles now (its exit is known)."""
        rank.conn_closed = True
        return rank.exited is not None

    def settle(self, rank: RankRecord) -> list[Event]:
        """Judge a rank that exited once its outcome had its chance to arrive.

        Fine if it sent a result or an exception (already recorded); stopped if its agent
        had signalled it; else it died: a ``death`` fault with its exit status or signal.
        """
        rank.settle_by = None
        self._waiting_ranks.discard(rank.rank)
        self._alarmed.discard(rank.rank)
        exited = rank.exited
        if exited is None or rank.settled:
            return []
        rank.settled = True
        if rank.has_outcome:
            return []
        if exited.stopped:
            return self.move_rank(rank, WorkerState.STOPPED)
        error = WorkerFailedError(
            self.hostname(rank),
            rank.local_rank,
            rank.rank,
            exited.pid,
            exited.exitcode,
            exited.signal,
        )
        return self.add_fault("death", error, exited.at, rank=rank)

    def worker_timed_out(self, rank: RankRecord) -> bool:
        """Its watchdog fired; ``False`` if it had already ended."""
        return not rank.state.is_final

    def due(self, now: float) -> tuple[list[AgentRecord], list[RankRecord]]:
        """Agents and ranks whose wait for their connection's end is over."""
        self._waiting_agents = {i for i in self._waiting_agents if self.agents[i].judge_by}
        agents = [self.agents[i] for i in sorted(self._waiting_agents)]
        ranks = [self.ranks[i] for i in sorted(self._waiting_ranks) if i < len(self.ranks)]
        return (
            [a for a in agents if a.judge_by is not None and now >= a.judge_by],
            [r for r in ranks if r.settle_by is not None and now >= r.settle_by],
        )

    def next_due(self) -> float | None:
        """When :meth:`due` next has something."""
        times = [self.agents[i].judge_by for i in self._waiting_agents]
        times += [self.ranks[i].settle_by for i in self._waiting_ranks if i < len(self.ranks)]
        return min((t for t in times if t is not None), default=None)

    def silent_agents(self, now: float) -> list[tuple[AgentRecord, float]]:
        """Agents silent for longer than they may be, with how long (none while stopping).

        Until it first forks workers an agent may be busy importing torch (it holds the GIL
        for seconds on a busy host): that phase answers to ``start_timeout``. Warm agents
        between runs answer to ``agent_timeout`` once they have forked workers.
        """
        if self.stopping:
            return []
        silent = []
        for agent in self.agents:
            if agent.hello is None or agent.over:
                continue
            limit = (
                self.agent_timeout
                if agent.pids or agent.forked
                else max(self.agent_timeout, self.start_timeout)
            )
            if now - agent.last_heard > limit:
                silent.append((agent, now - agent.last_heard))
        return silent

    # -- where the launch is ------------------------------------------------------------

    @property
    def all_hellos(self) -> bool:
        """Whether every agent has connected back (in the start phase)."""
        while self._agents_seen < len(self.agents) and self.agents[self._agents_seen].hello:
            self._agents_seen += 1
        return self._agents_seen == len(self.agents)

    @property
    def finished(self) -> bool:
        """Whether every rank returned and every agent is done (or waits, with restarts left)."""
        if not self.ranks or self._results < len(self.ranks):
            return False
        if self.keep_workers:
            return True
        agents = self.agents
        while self._agents_ended < len(agents) and (
            agents[self._agents_ended].over or agents[self._agents_ended].ready
        ):
            self._agents_ended += 1
        return self._agents_ended == len(agents)

    def unready_agents(self) -> list[AgentRecord]:
        """Before a warm run: agents that cannot take a spec (ended, lost, or not waiting)."""
        return [a for a in self.agents if a.over or not a.ready]

    @property
    def stopped(self) -> bool:
        """After a Stop: whether every agent has ended or waits for the next attempt."""
        return all(a.over or a.ready or a.conn is None for a in self.agents)

    @property
    def ranks_known(self) -> bool:
        """After a Stop: whether every rank's end is in (its exit and its connection's end).

        Not waited for: the ranks of an agent that failed or was lost (nothing more comes
        from it, and a cut link keeps their connections open).
        """
        gone = (AgentState.FAILED, AgentState.LOST)
        return all(
            r.settle_by is None and (r.exited is not None or r.conn is None or r.conn_closed)
            for r in self.ranks
            if self.agents[r.host_index].state not in gone
        )

    def keep_workers_for_next_call(self) -> None:
        """After a successful run of workers that stay: they wait for the next call."""
        self.kept_workers = True
        self.between_runs = True

    def kept_workers_well(self) -> bool:
        """Whether every kept worker can take the next call: alive, connected, agent well."""
        return self.kept_workers and all(
            r.conn is not None
            and not r.conn_closed
            and r.exited is None
            and r.state is WorkerState.SUCCEEDED
            and not self.agents[r.host_index].over
            for r in self.ranks
        )

    def next_call(self) -> None:
        """The kept workers take a new run's call: the same ranks, running again.

        Each rank gets a new record (a finished rank never moves back), with its connection
        and pid; the attempt stays the same, since its workers do.
        """
        self.kept_workers = False
        self.between_runs = False
        self.ranks = [
            RankRecord(r.rank, r.host_index, r.local_rank, WorkerState.HEALTHY, r.conn, r.pid)
            for r in self.ranks
        ]
        self.faults = []
        self.stacks = {}
        self.stopping = False
        self._results, self._running = 0, len(self.ranks)
        self._alarmed, self._waiting_ranks = set(), set()

    def next_attempt(self, *, keep_ready: bool = False) -> None:
        """Forget this attempt's ranks and faults (the cause is in ``history`` by now).

        ``keep_ready``: agents that wait for a spec still do (warm agents between runs);
        else every agent waits for this attempt's end again.
        """
        self.kept_workers = False
        self.attempt += 1
        self.ranks = []
        self.faults = []
        self.stacks = {}
        self.stopping = False
        self._results, self._agents_ended, self._running = 0, 0, 0
        self._alarmed, self._waiting_ranks = set(), set()
        for agent in self.agents:
            agent.ready = agent.ready and keep_ready
            agent.pids = ()

    # -- read-outs ----------------------------------------------------------------------

    def health(self, now: float, *, max_restarts: int, cause: str | None) -> HealthReport:
        """The ``GET /health`` snapshot (``cause``: the failure summary of this attempt)."""
        agents = tuple(
            AgentHealth(
                a.index,
                a.slots.hostname,
                a.state,
                None if a.hello is None else round(now - a.last_heard, 3),
            )
            for a in list(self.agents)
        )
        workers = tuple(
            WorkerHealth(
                r.rank, r.host_index, self.hostname(r), r.local_rank, r.pid or None, r.state
            )
            for r in list(self.ranks)
        )
        failures = [*self.history]
        if cause is not None and self.phase is not Phase.RESTARTING:  # else in the history
            failures.append(f"attempt {self.attempt}: {cause}")
        unhealthy = self.degraded or any(
            a.state in (AgentState.FAILED, AgentState.LOST) for a in agents
        )
        return HealthReport(
            healthy=not unhealthy and cause is None,
            launch_state=self.phase.value,
            attempt=self.attempt,
            restarts=self.attempt,
            max_restarts=max_restarts,
            uptime=now - self.started,
            agents=agents,
            workers=workers,
            failures=tuple(failures),
        )

    def timings(self, connect: tuple[float, ...]) -> LaunchTimings:
        """Phase durations of the attempt that succeeded (see :class:`LaunchTimings`)."""
        ranks = [r.timing for r in self.ranks]
        return LaunchTimings(
            total=self.finished_after,
            agents_started=self.agents_started_after,
            connect=connect,
            agent_start=tuple(a.started_after for a in self.agents),
            process_group_init=tuple(t.init_seconds if t else 0.0 for t in ranks),
            function=tuple(t.function_seconds if t else 0.0 for t in ranks),
            result_transfer=tuple(
                (t.pickle_seconds + max(r.received_at - t.sent_at, 0.0)) if t else 0.0
                for r, t in zip(self.ranks, ranks, strict=True)
            ),
        )
