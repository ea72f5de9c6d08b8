"""The agents and ranks of one attempt, as pure data: what each is, and what it reported.

:class:`AttemptState` applies what the launch reads about its agents and ranks (hellos,
forks, exits, outcomes, ends of connections) by the moves of :mod:`torchrunx.launcher.records`,
records failures as :class:`~torchrunx.launcher.records.Fault` facts, and returns the public
events that follow. :class:`~torchrunx.launcher.state.LaunchState` adds the launch around it
(runs, stops, restarts, phases, read-outs). Nothing here touches a socket, a process or the
clock.

A rank's end has two halves: its agent reports the exit (``WorkerExited``), and its channel
(through the agent) carries its outcome (a result or an exception) and then ends; a large
outcome comes on a connection of the worker's own instead, and travels apart (the channel
says so first: ``DirectOutcome``). A rank "settles" when both are known, or, if its channel or
that connection stays open (a forked child may hold it),
:data:`~torchrunx.launcher.records.OUTCOME_WAIT` seconds after its exit. An agent's end is
judged the same way: its exit can overtake its last message (``AgentDone``) on its connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
from torchrunx.launcher.records import (
    AGENT_MOVES,
    OUTCOME_WAIT,
    PHASE_MOVES,
    RUNNING_STATES,
    WORKER_MOVES,
    AgentRecord,
    Fault,
    FaultKind,
    Phase,
    RankRecord,
)
from torchrunx.launcher.reports import summary

if TYPE_CHECKING:
    from torchrunx.wire.messages import (
        AgentHello,
        WorkerExited,
        WorkerHello,
        WorkerResult,
        WorkersEnded,
        WorkerSpec,
        WorkersStarted,
    )


@dataclass
class AttemptState:
    """Every agent and rank of one launch's current attempt, and the faults seen."""

    agents: list[AgentRecord]
    started: float
    """Monotonic time the launch started."""
    kept_workers: bool = False
    """Between warm runs: the last run's workers stay, with their ranks, for the next call."""
    ranks: list[RankRecord] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)
    """Python stacks of ranks still running when the launch stopped."""
    phase: Phase = Phase.STARTING_AGENTS
    attempt: int = 0
    stopping: bool = False
    between_runs: bool = False
    """Warm agents after a run, until the next run's specs are sent."""
    degraded: bool = False
    """Something failed; healthy again once a restart's workers all run."""
    _results: int = 0
    _running: int = 0
    """Ranks that are HEALTHY or SUCCEEDED."""
    _alarmed: set[int] = field(default_factory=set)
    _waiting_ranks: set[int] = field(default_factory=set)
    _waiting_agents: set[int] = field(default_factory=set)

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
        self._running += (new in RUNNING_STATES) - (old in RUNNING_STATES)
        # Workers that start (fresh, or a restart's) all run; never while the launch stops.
        starting = self.phase in (Phase.STARTING_WORKERS, Phase.RESTARTING) and not self.stopping
        if new in RUNNING_STATES and self._running == len(self.ranks) and starting:
            self.degraded = False  # after a restart: healthy again once every worker runs
            self.move_phase(Phase.RUNNING)
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

    def move_phase(self, new: Phase) -> None:
        """Move the launch to phase ``new`` (staying is allowed).

        Raises:
            ValueError: The move is not one of :data:`PHASE_MOVES` (a bug).
        """
        if new is not self.phase and new not in PHASE_MOVES[self.phase]:
            raise ValueError(f"launch: {self.phase.value} -> {new.value}")
        self.phase = new

    def hostname(self, rank: RankRecord) -> str:
        """The host name of ``rank``'s agent."""
        return self.agents[rank.host_index].slots.hostname

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

    def heard_from(self, agent: AgentRecord, now: float) -> None:
        """A message came from ``agent`` (any message counts as a heartbeat)."""
        agent.last_heard = now

    def agent_failed(
        self, agent: AgentRecord, error: BaseException | None, at: float, *, lost: bool = False
    ) -> list[Event]:
        """``agent`` failed (``lost``: fell silent): its move, and its fault.

        No fault if ``error`` is None: a failure while the launch stops is no fault of the run.
        """
        agent.judge_by = None
        self.move_agent(agent, AgentState.LOST if lost else AgentState.FAILED)
        if error is None:
            return []
        kind: FaultKind = "lost" if lost else "agent"
        return self.add_fault(kind, error, at, host_index=agent.index)

    def agent_judged(self, agent: AgentRecord) -> None:
        """``agent``'s end was judged (it had ended well, or its failure is recorded)."""
        agent.judge_by = None

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

    def assign(self, agent: AgentRecord, spec: WorkerSpec) -> None:
        """Give ``agent`` its workers of this attempt (ranks ``rank_offset`` onwards)."""
        if self.phase is not Phase.RESTARTING:  # a restart is one until its workers all run
            self.move_phase(Phase.STARTING_WORKERS)
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
        """A worker said hello on its channel (``conn``: the channel's ident)."""
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

    def worker_failed(
        self, rank: RankRecord, kind: FaultKind, error: BaseException, at: float
    ) -> list[Event]:
        """``rank`` raised or overran a watchdog: its outcome is ``error``.

        ``kind``: ``"exception"``, ``"collective"`` (a peer's echo) or ``"hang"`` (watchdog).
        """
        rank.error = error
        return self.add_fault(kind, error, at, rank=rank)

    def add_stacks(self, agent: AgentRecord, stacks: dict[int, str]) -> None:
        """The Python stacks of ``agent``'s workers (local rank -> text), dumped on a stop."""
        if agent.spec is not None:
            for local_rank, text in stacks.items():
                self.stacks[agent.spec.rank_offset + local_rank] = text

    def take_result(self, rank: RankRecord) -> list[bytearray]:
        """``rank``'s pickled return value, handed over once (the state keeps no copy)."""
        payload = rank.result
        assert payload is not None  # noqa: S101 (called once every rank returned)
        rank.result = None
        return payload

    def worker_exited(self, rank: RankRecord, message: WorkerExited, now: float) -> bool:
        """Its agent saw it end; ``True`` if it settles now (see :meth:`settle`)."""
        rank.exited, rank.pid = message, message.pid
        if (rank.conn_closed and not rank.outcome_elsewhere) or rank.has_outcome or message.stopped:
            return True
        # Its outcome may still be on its way (on a connection of its own, or its hello).
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
        """Its channel ended; ``True`` if it settles now.

        It does once its exit is known, and no outcome is still coming on a connection of its own.
        """
        rank.conn_closed = True
        return rank.exited is not None and not rank.outcome_elsewhere

    def direct_rank(self, message: WorkerHello) -> RankRecord | None:
        """The rank whose worker opened a connection of its own for a large outcome.

        The hello on it must name a rank of this attempt whose worker said hello on its channel
        with the same pid, and that has no outcome and no such connection yet.
        """
        if message.attempt != self.attempt or not 0 <= message.rank < len(self.ranks):
            return None
        rank = self.ranks[message.rank]
        usable = rank.conn is not None and rank.direct is None and not rank.has_outcome
        return rank if usable and rank.pid == message.pid else None

    def direct_closed(self, rank: RankRecord) -> bool:
        """Its connection for a large outcome ended; ``True`` if it settles now."""
        rank.outcome_elsewhere = False
        return rank.exited is not None and (rank.conn_closed or rank.has_outcome)

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
            exited.cause,
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
