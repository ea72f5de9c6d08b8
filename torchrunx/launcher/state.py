"""The state of one launch, as pure data: what each agent and each rank is, and what happened.

Nothing here touches a socket, a process or the clock: the launch
(:mod:`torchrunx.launcher.orchestrator`) applies what it reads (messages, ends of connections
and processes, the time) through the methods of :class:`LaunchState`, and emits the public
events they return. Only the methods change the state, and only by the written-down moves:
agents and ranks by :data:`AGENT_MOVES` and :data:`WORKER_MOVES` (drawn in
:mod:`torchrunx.events`, whose enums are the source of truth), the launch as a whole by
:data:`PHASE_MOVES`::

    STARTING_AGENTS ─▶ STARTING_WORKERS ─▶ RUNNING ─▶ SUCCEEDED ─▶ IDLE   (warm agents)
    STARTING_WORKERS, RUNNING, IDLE ─▶ RESTARTING ─▶ RUNNING   (a restart lasts until the
                                                               new workers all run)
    IDLE ─▶ STARTING_WORKERS (the next run's specs), RUNNING (the kept workers' call)
    STARTING_*, RUNNING, RESTARTING, IDLE ─▶ STOPPING ─▶ FAILED ─▶ IDLE   (warm agents)

A run's bookkeeping is kept here too (its start, the attempt it started with, its restarts,
its extra failures), so that ``GET /health``, :class:`~torchrunx.LaunchResult` and the events
give one answer.

The agents and ranks of the current attempt are
:class:`~torchrunx.launcher.attempt.AttemptState`'s; failures are recorded as
:class:`~torchrunx.launcher.records.Fault` facts while the launch runs, and which one is the
cause is decided once everything has stopped, by :mod:`torchrunx.launcher.failures`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchrunx.events import (
    AgentState,
    WorkerState,
)
from torchrunx.launcher.attempt import AttemptState
from torchrunx.launcher.health import AgentHealth, HealthReport, WorkerHealth
from torchrunx.launcher.records import (
    AgentRecord,
    Phase,
    RankRecord,
)
from torchrunx.launcher.results import LaunchTimings

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torchrunx.events import Event
    from torchrunx.launcher.spares import Reshape
    from torchrunx.wire.messages import AgentHello


@dataclass
class LaunchState(AttemptState):
    """One launch: its attempt's agents and ranks, its runs, stops, restarts and phase."""

    max_restarts: int = 0
    agent_timeout: float = 30.0
    start_timeout: float = 60.0
    keep_workers: bool = False
    """Workers that stay from run to run (warm agents): a run is over when every rank
    returned, while its workers (and so its agents) go on."""
    history: list[str] = field(default_factory=list)
    """One line per earlier attempt's failure (``attempt N: Type: message``)."""
    agents_started_after: float = 0.0
    finished_after: float = 0.0
    runs: int = 0
    """Runs started (warm agents count on; a launch has one)."""
    run_started: float = 0.0
    """Monotonic time the run started: the launch's start, or a warm run's own."""
    first_attempt: int = 0
    """The attempt the run started with (runs of warm agents go on counting attempts)."""
    fresh_workers: bool = True
    """Whether the run started its own workers (else the kept ones took its call)."""
    extra_failures: list[str] = field(default_factory=list)
    """Failures of the run that are no fault of an agent or rank (a failed restart)."""
    world: list[AgentRecord] = field(default_factory=list)
    """The agents that run ranks, in rank order (the others are spares, or quarantined)."""
    world_changes: list[str] = field(default_factory=list)
    """One line per host quarantined, replaced by a spare, or dropped (the whole launch)."""
    _agents_seen: int = 0
    """Agents before this index said hello (the start phase only: replacements come later)."""
    _agents_ended: int = 0
    """Agents before this index are over or ready (within one attempt)."""

    def __post_init__(self) -> None:
        """Without a world given, every agent runs ranks (no spare)."""
        if not self.world:
            self.world = list(self.agents)

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

    @property
    def all_hellos(self) -> bool:
        """Whether every agent has connected back (in the start phase)."""
        world = self.world
        while self._agents_seen < len(world) and world[self._agents_seen].hello:
            self._agents_seen += 1
        return self._agents_seen == len(world)

    @property
    def finished(self) -> bool:
        """Whether every rank returned and every agent is done (or waits, with restarts left)."""
        if not self.ranks or self._results < len(self.ranks):
            return False
        if self.keep_workers:
            return True
        agents = self.world
        while self._agents_ended < len(agents) and (
            agents[self._agents_ended].over or agents[self._agents_ended].ready
        ):
            self._agents_ended += 1
        return self._agents_ended == len(agents)

    def unready_agents(self) -> list[AgentRecord]:
        """Before a warm run: agents that cannot take a spec (ended, lost, or not waiting)."""
        return [a for a in self.world if a.over or not a.ready]

    @property
    def stopped(self) -> bool:
        """After a Stop: whether every agent has ended or waits for the next attempt."""
        return all(a.over or a.ready or a.conn is None for a in self.world)

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

    def agents_ready(self, now: float) -> None:
        """Every agent said hello: each waits for its first spec."""
        self.agents_started_after = now - self.started
        for agent in self.agents:  # spares that said hello wait too
            agent.ready = agent.hello is not None

    def start_run(self, now: float, *, warm: bool) -> None:
        """A run begins: a launch's one run counts from the launch's start, a warm run from now."""
        self.runs += 1
        self.run_started = now if warm else self.started
        self.first_attempt = self.attempt

    def run_workers(self, *, fresh: bool) -> None:
        """The run's first attempt: on fresh workers, or on the kept ones (``fresh=False``)."""
        self.first_attempt = self.attempt
        self.fresh_workers = fresh

    @property
    def restarts(self) -> int:
        """Restarts of the run under way (or of the last one)."""
        return self.attempt - self.first_attempt

    def results_in(self, now: float) -> None:
        """Every rank of the run returned (:attr:`finished`)."""
        self.finished_after = now - self.run_started

    def succeeded(self) -> None:
        """The run's results were collected."""
        self.move_phase(Phase.SUCCEEDED)

    def begin_failure(self) -> None:
        """The run failed: it stops (the cause is chosen once everything stopped)."""
        self.move_phase(Phase.STOPPING)
        self.degraded = True

    def failed_run(self) -> None:
        """The run's failure was reported."""
        self.move_phase(Phase.FAILED)

    def begin_stop(self, *, restart: bool) -> None:
        """The workers are told to stop (``restart``: the agents stay for another attempt).

        Until the next attempt, what fails is a consequence of the stop, not a cause.
        """
        self.stopping = True
        if self.phase is not Phase.STOPPING:  # a failure's stop stays one (warm agents stay)
            self.move_phase(Phase.RESTARTING if restart else Phase.STOPPING)

    @contextlib.contextmanager
    def stopping_meanwhile(self) -> Iterator[None]:
        """While agents are replaced or stop between runs: their ends are not the run's."""
        stopping, self.stopping = self.stopping, True
        try:
            yield
        finally:
            self.stopping = stopping

    def record_restart(self, reason: str) -> None:
        """The run restarts after a failure (``reason``: its summary, kept in the history)."""
        self.history.append(f"attempt {self.restarts}: {reason}")
        self.move_phase(Phase.RESTARTING)

    def restart_failed(self, why: str) -> None:
        """The restart could not be made: the failure that caused it is the one raised."""
        self.history.pop()
        self.extra_failures.append(why)

    def add_extra_failure(self, why: str) -> None:
        """A failure of the run that is no agent's or rank's (it is named in the error)."""
        self.extra_failures.append(why)

    def replace_agent(self, index: int) -> AgentRecord:
        """A new record for host ``index``'s agent, about to be started again; the old one."""
        old = self.agents[index]
        new = AgentRecord(index, old.slots, old.method)
        self.agents[index] = new
        self.world[self.world.index(old)] = new
        return old

    def agent_hello(
        self, agent: AgentRecord, conn: int, hello: AgentHello, now: float
    ) -> list[Event]:
        """An agent connected back; a spare that does so after the start waits at once."""
        events = super().agent_hello(agent, conn, hello, now)
        if agent.role == "spare" and self.phase is not Phase.STARTING_AGENTS:
            agent.ready = True
        return events

    def agent_failed(
        self, agent: AgentRecord, error: BaseException | None, at: float, *, lost: bool = False
    ) -> list[Event]:
        """``agent`` failed; a spare's or a quarantined host's failure is no fault of the run."""
        return super().agent_failed(agent, error if agent.role == "host" else None, at, lost=lost)

    def quarantine(self, agent: AgentRecord) -> str:
        """A host of the world failed: it takes no further part; the line that says so."""
        agent.role = "quarantined"
        line = (
            f"attempt {self.attempt}: {agent.slots.hostname} (host {self.world.index(agent)}, "
            f"{agent.state.value}) quarantined"
        )
        self.world_changes.append(line)
        return line

    def reshape_world(self, reshape: Reshape) -> list[str]:
        """The next attempt runs on ``reshape.world``; the lines that say what changed."""
        by_id = {a.index: a for a in self.agents}
        lines = []
        for failed, spare in reshape.replaced:
            by_id[spare].role = "host"
            lines.append(
                f"attempt {self.attempt + 1}: spare {by_id[spare].slots.hostname} replaces "
                f"{by_id[failed].slots.hostname} (host {self.world.index(by_id[failed])})"
            )
        if reshape.dropped:
            names = [by_id[i].slots.hostname for i in reshape.dropped]
            lines.append(
                f"attempt {self.attempt + 1}: no spare for {', '.join(names)}: "
                f"{len(reshape.world)} hosts go on"
            )
        self.world = [by_id[i] for i in reshape.world]
        self._agents_seen = len(self.world)
        self.world_changes.extend(lines)
        return lines

    def replacements_started(self, indices: list[int]) -> None:
        """The new agents of ``indices`` that said hello wait for a spec."""
        for index in indices:
            self.agents[index].ready = self.agents[index].hello is not None

    def forget_idle_faults(self) -> None:
        """Before a warm run: what failed since the last run was dealt with."""
        self.faults = []

    def after_run(self, *, keep_workers: bool) -> None:
        """After a warm run: its ranks and failures are forgotten; the agents stay, idle.

        ``keep_workers`` (workers that stay): after a success they keep their ranks for the
        next call.
        """
        self.history = []
        self.extra_failures = []
        self.degraded = False
        self.move_phase(Phase.IDLE)
        if keep_workers and self.finished and not self.failed:
            self.keep_workers_for_next_call()
            return
        self.next_attempt(keep_ready=True)  # waiting for a spec (the next run checks)
        self.between_runs = True

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
        for agent in self.world:  # spares keep waiting
            agent.ready = agent.ready and keep_ready
            agent.pids = ()

    def health(self, now: float, *, max_restarts: int, cause: str | None) -> HealthReport:
        """The ``GET /health`` snapshot (``cause``: the failure summary of this attempt)."""
        agents = tuple(
            AgentHealth(
                a.index,
                a.slots.hostname,
                a.state,
                None if a.hello is None else round(now - a.last_heard, 3),
                a.role,
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
        # While a restart stops the workers, its cause goes into the history (not twice).
        if cause is not None and not (self.phase is Phase.RESTARTING and self.stopping):
            failures.append(f"attempt {self.attempt}: {cause}")
        # A quarantined host's failure was dealt with (a spare took its place, or the world
        # shrank); a failed spare only leaves fewer spares.
        unhealthy = self.degraded or any(
            a.state in (AgentState.FAILED, AgentState.LOST) for a in list(self.world)
        )
        return HealthReport(
            healthy=not unhealthy and cause is None,
            launch_state=self.phase.value,
            attempt=self.attempt,
            restarts=self.restarts,
            max_restarts=max_restarts,
            uptime=now - self.started,
            agents=agents,
            workers=workers,
            failures=tuple(failures),
            world_changes=tuple(self.world_changes),
        )

    def timings(self, connect: tuple[float, ...]) -> LaunchTimings:
        """Phase durations of the attempt that succeeded (see :class:`LaunchTimings`)."""
        ranks = [r.timing for r in self.ranks]
        return LaunchTimings(
            total=self.finished_after,
            agents_started=self.agents_started_after,
            connect=connect,
            agent_start=tuple(a.started_after for a in self.world),
            process_group_init=tuple(t.init_seconds if t else 0.0 for t in ranks),
            function=tuple(t.function_seconds if t else 0.0 for t in ranks),
            result_transfer=tuple(
                (t.pickle_seconds + max(r.received_at - t.sent_at, 0.0)) if t else 0.0
                for r, t in zip(self.ranks, ranks, strict=True)
            ),
        )
