"""The ranks of one attempt, as pure data: what each is and reported, and the faults seen.

:class:`AttemptState` is the attempt's part of :class:`~torchrunx.launcher.state.state.LaunchState`:
it holds the ranks of the current attempt, its faults and the stacks dumped on a stop. It
applies what the launch reads about the workers (specs assigned, forks, hellos, exits,
outcomes, ends of connections) by :data:`~torchrunx.launcher.state.records.WORKER_MOVES`, records
failures (a rank's, an agent's, the launcher's) as :class:`~torchrunx.launcher.state.records.Fault`
facts, and returns the public events that follow. The agents are the
:class:`~torchrunx.launcher.state.agent_table.AgentTable`'s (it reads them, and moves one that
failed there); the launch around the attempt (runs, stops, restarts, read-outs) is the launch
state's. Nothing here touches a socket, a process or the clock.

A rank's end has two halves: its agent reports the exit (``WorkerExited``), and its channel
(through the agent) carries its outcome (a result or an exception) and then ends; a large
outcome comes on a connection of the worker's own instead, and travels apart (the channel
says so first: ``DirectOutcome``). A rank "settles" when both are known, or, if its channel or
that connection stays open (a forked child may hold it),
:data:`~torchrunx.launcher.state.records.OUTCOME_WAIT` seconds after its exit (an agent's end is
judged the same way, by the agent table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrunx.errors import RemoteTraceback, WorkerFailedError
from torchrunx.events import (
    AgentState,
    Event,
    WorkerFailed,
    WorkerState,
    WorkerStateChanged,
)
from torchrunx.events import WorkersStarted as WorkersStartedEvent
from torchrunx.launcher.state.records import (
    OUTCOME_WAIT,
    RUNNING_STATES,
    WORKER_MOVES,
    Fault,
    FaultKind,
    Phase,
    RankRecord,
)
from torchrunx.launcher.state.reports import summary

if TYPE_CHECKING:
    from torchrunx.launcher.state.agent_table import AgentTable
    from torchrunx.launcher.state.records import AgentRecord, Progress
    from torchrunx.wire.messages import (
        WorkerExited,
        WorkerHello,
        WorkerResult,
        WorkerSpec,
        WorkersStarted,
    )


class AttemptState:
    """The ranks of one launch's current attempt, its faults, and the stacks of a stop."""

    def __init__(self, table: AgentTable, progress: Progress) -> None:
        """An attempt with no rank yet, on the agents of ``table``."""
        self.table = table
        self.progress = progress
        self.ranks: list[RankRecord] = []
        self.faults: list[Fault] = []
        self.stacks: dict[int, str] = {}
        """Python stacks of ranks still running when the launch stopped."""
        self._results = 0
        self._running = 0
        """Ranks that are HEALTHY or SUCCEEDED."""
        self._alarmed: set[int] = set()
        self._waiting: set[int] = set()
        """Ranks whose exit waits for their outcome (:meth:`settle`)."""

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
        starting = (
            self.progress.phase in (Phase.STARTING_WORKERS, Phase.RESTARTING)
            and not self.progress.stopping
        )
        if new in RUNNING_STATES and self._running == len(self.ranks) and starting:
            self.progress.degraded = False  # after a restart: healthy again once every worker runs
            self.progress.move_phase(Phase.RUNNING)
        return [
            WorkerStateChanged(
                rank.rank,
                rank.host_index,
                self.table.hostname(rank),
                rank.local_rank,
                self.progress.attempt,
                old,
                new,
            )
        ]

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
                while_stopping=self.progress.stopping,
            )
        )
        self.progress.degraded = True
        if rank is None:
            return []
        if rank.state.is_final:
            if not self.progress.kept_workers:
                return []
            events: list[Event] = []  # a kept worker, between runs: it ran, and died since
        else:
            events = self.move_rank(rank, WorkerState.FAILED)
        events.append(
            WorkerFailed(
                rank.rank,
                rank.host_index,
                self.table.hostname(rank),
                rank.local_rank,
                self.progress.attempt,
                summary(error),
                traceback=remote.text
                if isinstance(remote := error.__cause__, RemoteTraceback)
                else None,
            )
        )
        return events

    @property
    def failed(self) -> bool:
        """Whether any failure was recorded in this attempt."""
        return bool(self.faults)

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
                self.progress.attempt,
                tuple(range(offset, offset + len(message.pids))),
                message.pids,
                backend=agent.spec.backend,
            )
        ]

    def agent_failed(
        self, agent: AgentRecord, error: BaseException | None, at: float, *, lost: bool = False
    ) -> list[Event]:
        """``agent`` failed (``lost``: fell silent): its move, and its fault.

        No fault if ``error`` is None (a failure while the launch stops is no fault of the run),
        nor for a spare's or a quarantined host's failure.
        """
        self.table.agent_judged(agent)
        self.table.move_agent(agent, AgentState.LOST if lost else AgentState.FAILED)
        if error is None or agent.role != "host":
            return []
        kind: FaultKind = "lost" if lost else "agent"
        return self.add_fault(kind, error, at, host_index=agent.index)

    def assign(self, agent: AgentRecord, spec: WorkerSpec) -> None:
        """Give ``agent`` its workers of this attempt (ranks ``rank_offset`` onwards)."""
        if (
            self.progress.phase is not Phase.RESTARTING
        ):  # a restart is one until its workers all run
            self.progress.move_phase(Phase.STARTING_WORKERS)
        self.progress.between_runs = False
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
        if message.attempt != self.progress.attempt or not 0 <= message.rank < len(self.ranks):
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

    def collectives_done(self, rank: int, count: int) -> None:
        """Rank ``rank`` said it completed ``count`` collectives (-1: it has no recorder)."""
        if 0 <= rank < len(self.ranks) and count >= 0:
            self.ranks[rank].collectives = count

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
        self._waiting.add(rank.rank)
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
        if message.attempt != self.progress.attempt or not 0 <= message.rank < len(self.ranks):
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
        self._waiting.discard(rank.rank)
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
            self.table.hostname(rank),
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

    def due(self, now: float) -> list[RankRecord]:
        """Ranks whose wait for their outcome is over."""
        ranks = [self.ranks[i] for i in sorted(self._waiting) if i < len(self.ranks)]
        return [r for r in ranks if r.settle_by is not None and now >= r.settle_by]

    def next_due(self) -> float | None:
        """When :meth:`due` next has something."""
        times = [self.ranks[i].settle_by for i in self._waiting if i < len(self.ranks)]
        return min((t for t in times if t is not None), default=None)

    # -- the attempt as a whole -----------------------------------------------------------

    @property
    def all_returned(self) -> bool:
        """Whether the attempt has ranks and every one returned."""
        return bool(self.ranks) and self._results >= len(self.ranks)

    @property
    def ranks_known(self) -> bool:
        """After a Stop: whether every rank's end is in (its exit and its connection's end).

        Not waited for: the ranks of an agent that failed or was lost (nothing more comes
        from it, and a cut link keeps their connections open).
        """
        gone = (AgentState.FAILED, AgentState.LOST)
        agents = self.table.agents
        return all(
            r.settle_by is None and (r.exited is not None or r.conn is None or r.conn_closed)
            for r in self.ranks
            if agents[r.host_index].state not in gone
        )

    def kept_workers_well(self) -> bool:
        """Whether every kept worker can take the next call: alive, connected, agent well."""
        agents = self.table.agents
        return self.progress.kept_workers and all(
            r.conn is not None
            and not r.conn_closed
            and r.exited is None
            and r.state is WorkerState.SUCCEEDED
            and not agents[r.host_index].over
            for r in self.ranks
        )

    def forget_faults(self) -> None:
        """What failed so far was dealt with (warm agents, before a run)."""
        self.faults = []

    def clear(self, ranks: list[RankRecord]) -> None:
        """A new attempt (``ranks``: none), or the kept workers' next call (their new records).

        No fault, no stacks; every rank given is running, none waits for its outcome.
        """
        self.ranks = ranks
        self.faults = []
        self.stacks = {}
        self._results, self._running = 0, len(ranks)
        self._alarmed, self._waiting = set(), set()
