"""The state of one launch, as pure data: what each agent and each rank is, and what happened.

Nothing here touches a socket, a process or the clock: the launch
(:mod:`torchrunx.launcher.launch.orchestrator`) applies what it reads (messages, ends of connections
and processes, the time) through the methods of :class:`LaunchState` and its parts, and emits
the public events they return. Only those methods change the state, and only by the
written-down moves: agents and ranks by :data:`AGENT_MOVES` and :data:`WORKER_MOVES` (drawn in
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

It is composed of parts, each the owner of its data, which share one
:class:`~torchrunx.launcher.state.records.Progress` (the phase, the attempt, the flags they all
read):

- :class:`~torchrunx.launcher.state.agent_table.AgentTable` (``agent_table``): every agent, the
  world, and its changes;
- :class:`~torchrunx.launcher.state.attempt.AttemptState` (``current``): the current attempt's
  ranks, its faults and stacks.

What arrives about an agent or a worker is applied by the part it concerns; what concerns the
launch as a whole (a run, a stop, a restart, the next attempt) by :class:`LaunchState` itself.
Failures are recorded as :class:`~torchrunx.launcher.state.records.Fault` facts while the launch
runs, and which one is the cause is decided once everything has stopped, by
:mod:`torchrunx.launcher.state.failures`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from torchrunx.events import AgentState, WorkerState
from torchrunx.launcher.state.agent_table import AgentTable
from torchrunx.launcher.state.attempt import AttemptState
from torchrunx.launcher.state.health import AgentHealth, HealthReport, WorkerHealth
from torchrunx.launcher.state.records import Phase, Progress, RankRecord
from torchrunx.launcher.state.results import LaunchTimings

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torchrunx.launcher.state.records import AgentRecord, Fault


class LaunchState:
    """One launch: its agents, its attempt, its runs, stops, restarts and phase."""

    def __init__(  # noqa: PLR0913 (the agents, the start, and one keyword per limit of the plan)
        self,
        agents: list[AgentRecord],
        *,
        started: float,
        agent_timeout: float,
        world: list[AgentRecord] | None = None,
        max_restarts: int = 0,
        start_timeout: float = 60.0,
        keep_workers: bool = False,
    ) -> None:
        """A launch of ``agents`` (``world``: those that run ranks; default: every one).

        ``started``: its monotonic start; the limits are the plan's (see :class:`LaunchPlan`).
        """
        self.progress = Progress(started)
        self.agent_table = AgentTable(
            agents,
            self.progress,
            world=world,
            agent_timeout=agent_timeout,
            start_timeout=start_timeout,
        )
        self.current = AttemptState(self.agent_table, self.progress)
        """The current attempt: its ranks, faults and stacks."""
        self.max_restarts = max_restarts
        self.keep_workers = keep_workers
        """Workers that stay from run to run (warm agents): a run is over when every rank
        returned, while its workers (and so its agents) go on."""
        self.history: list[str] = []
        """One line per earlier attempt's failure (``attempt N: Type: message``)."""
        self.finished_after = 0.0
        self.runs = 0
        """Runs started (warm agents count on; a launch has one)."""
        self.run_started = 0.0
        """Monotonic time the run started: the launch's start, or a warm run's own."""
        self.first_attempt = 0
        """The attempt the run started with (runs of warm agents go on counting attempts)."""
        self.fresh_workers = True
        """Whether the run started its own workers (else the kept ones took its call)."""
        self.extra_failures: list[str] = []
        """Failures of the run that are no fault of an agent or rank (a failed restart)."""

    # -- what the parts hold, read often --------------------------------------------------

    @property
    def agents(self) -> list[AgentRecord]:
        """Every agent of the launch (the agent table's)."""
        return self.agent_table.agents

    @property
    def world(self) -> list[AgentRecord]:
        """The agents that run ranks, in rank order (the agent table's)."""
        return self.agent_table.world

    @property
    def ranks(self) -> list[RankRecord]:
        """The ranks of the current attempt."""
        return self.current.ranks

    @property
    def faults(self) -> list[Fault]:
        """The failures recorded in the current attempt."""
        return self.current.faults

    @property
    def failed(self) -> bool:
        """Whether any failure was recorded in this attempt."""
        return self.current.failed

    @property
    def phase(self) -> Phase:
        """What the launch as a whole is doing."""
        return self.progress.phase

    @property
    def attempt(self) -> int:
        """The attempt under way (counted over the whole launch)."""
        return self.progress.attempt

    # -- the launch as a whole ------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether every rank returned and every agent is done (or waits, with restarts left)."""
        if not self.current.all_returned:
            return False
        return self.keep_workers or self.agent_table.all_waiting

    def due(self, now: float) -> tuple[list[AgentRecord], list[RankRecord]]:
        """Agents and ranks whose wait for their connection's end is over."""
        return self.agent_table.due(now), self.current.due(now)

    def next_due(self) -> float | None:
        """When :meth:`due` next has something."""
        times = [self.agent_table.next_due(), self.current.next_due()]
        return min((t for t in times if t is not None), default=None)

    def start_run(self, now: float, *, warm: bool) -> None:
        """A run begins: a launch's one run counts from the launch's start, a warm run from now."""
        self.runs += 1
        self.run_started = now if warm else self.progress.started
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
        self.progress.move_phase(Phase.SUCCEEDED)

    def begin_failure(self) -> None:
        """The run failed: it stops (the cause is chosen once everything stopped)."""
        self.progress.move_phase(Phase.STOPPING)
        self.progress.degraded = True

    def failed_run(self) -> None:
        """The run's failure was reported."""
        self.progress.move_phase(Phase.FAILED)

    def begin_stop(self, *, restart: bool) -> None:
        """The workers are told to stop (``restart``: the agents stay for another attempt).

        Until the next attempt, what fails is a consequence of the stop, not a cause.
        """
        progress = self.progress
        progress.stopping = True
        if progress.phase is not Phase.STOPPING:  # a failure's stop stays one (warm agents stay)
            progress.move_phase(Phase.RESTARTING if restart else Phase.STOPPING)

    @contextlib.contextmanager
    def stopping_meanwhile(self) -> Iterator[None]:
        """While agents are replaced or stop between runs: their ends are not the run's."""
        progress = self.progress
        stopping, progress.stopping = progress.stopping, True
        try:
            yield
        finally:
            progress.stopping = stopping

    def record_restart(self, reason: str) -> None:
        """The run restarts after a failure (``reason``: its summary, kept in the history)."""
        self.history.append(f"attempt {self.restarts}: {reason}")
        self.progress.move_phase(Phase.RESTARTING)

    def restart_failed(self, why: str) -> None:
        """The restart could not be made: the failure that caused it is the one raised."""
        self.history.pop()
        self.extra_failures.append(why)

    def add_extra_failure(self, why: str) -> None:
        """A failure of the run that is no agent's or rank's (it is named in the error)."""
        self.extra_failures.append(why)

    def forget_idle_faults(self) -> None:
        """Before a warm run: what failed since the last run was dealt with."""
        self.current.forget_faults()

    def after_run(self, *, keep_workers: bool) -> None:
        """After a warm run: its ranks and failures are forgotten; the agents stay, idle.

        ``keep_workers`` (workers that stay): after a success they keep their ranks for the
        next call.
        """
        self.history = []
        self.extra_failures = []
        self.progress.degraded = False
        self.progress.move_phase(Phase.IDLE)
        if keep_workers and self.finished and not self.failed:
            self.keep_workers_for_next_call()
            return
        self.next_attempt(keep_ready=True)  # waiting for a spec (the next run checks)
        self.progress.between_runs = True

    def keep_workers_for_next_call(self) -> None:
        """After a successful run of workers that stay: they wait for the next call."""
        self.progress.kept_workers = True
        self.progress.between_runs = True

    def next_call(self) -> None:
        """The kept workers take a new run's call: the same ranks, running again.

        Each rank gets a new record (a finished rank never moves back), with its connection
        and pid; the attempt stays the same, since its workers do.
        """
        progress = self.progress
        progress.kept_workers = progress.between_runs = progress.stopping = False
        self.current.clear(
            [
                RankRecord(r.rank, r.host_index, r.local_rank, WorkerState.HEALTHY, r.conn, r.pid)
                for r in self.ranks
            ]
        )

    def next_attempt(self, *, keep_ready: bool = False) -> None:
        """Forget this attempt's ranks and faults (the cause is in ``history`` by now).

        ``keep_ready``: agents that wait for a spec still do (warm agents between runs);
        else every agent waits for this attempt's end again.
        """
        progress = self.progress
        progress.kept_workers = progress.stopping = False
        progress.attempt += 1
        self.current.clear([])
        self.agent_table.new_attempt(keep_ready=keep_ready)

    def health(
        self, now: float, *, max_restarts: int, cause: str | None, rows: bool = True
    ) -> HealthReport:
        """The ``GET /health`` snapshot (``cause``: the failure summary of this attempt).

        Without ``rows``, no agent or worker entry (the live view's summary at scale).
        """
        agents = (
            ()
            if not rows
            else tuple(
                AgentHealth(
                    a.index,
                    a.slots.hostname,
                    a.state,
                    None if a.hello is None else round(now - a.last_heard, 3),
                    a.role,
                )
                for a in list(self.agents)
            )
        )
        workers = () if not rows else tuple(self._worker_health(r) for r in list(self.ranks))
        failures = [*self.history]
        # While a restart stops the workers, its cause goes into the history (not twice).
        if cause is not None and not (self.phase is Phase.RESTARTING and self.progress.stopping):
            failures.append(f"attempt {self.attempt}: {cause}")
        # A quarantined host's failure was dealt with (a spare took its place, or the world
        # shrank); a failed spare only leaves fewer spares.
        unhealthy = self.progress.degraded or any(
            a.state in (AgentState.FAILED, AgentState.LOST) for a in list(self.world)
        )
        return HealthReport(
            healthy=not unhealthy and cause is None,
            launch_state=self.phase.value,
            attempt=self.attempt,
            restarts=self.restarts,
            max_restarts=max_restarts,
            uptime=now - self.progress.started,
            agents=agents,
            workers=workers,
            failures=tuple(failures),
            world_changes=tuple(self.agent_table.world_changes),
        )

    def _worker_health(self, r: RankRecord) -> WorkerHealth:
        """One rank's row of the report, with its agent's last figures of its process."""
        usage = self.agents[r.host_index].usage.get(r.pid) if r.pid else None
        _, _, cpu, rss, gpu, gpu_memory = usage or (0, 0, None, None, None, None)
        return WorkerHealth(
            r.rank,
            r.host_index,
            self.agent_table.hostname(r),
            r.local_rank,
            r.pid or None,
            r.state,
            cpu,
            rss,
            gpu,
            gpu_memory,
            r.collectives,
        )

    def timings(self, connect: tuple[float, ...]) -> LaunchTimings:
        """Phase durations of the attempt that succeeded (see :class:`LaunchTimings`)."""
        ranks = [r.timing for r in self.ranks]
        return LaunchTimings(
            total=self.finished_after,
            agents_started=self.agent_table.agents_started_after,
            connect=connect,
            agent_start=tuple(a.started_after for a in self.world),
            process_group_init=tuple(t.init_seconds if t else 0.0 for t in ranks),
            function=tuple(t.function_seconds if t else 0.0 for t in ranks),
            result_transfer=tuple(
                (t.pickle_seconds + max(r.received_at - t.sent_at, 0.0)) if t else 0.0
                for r, t in zip(self.ranks, ranks, strict=True)
            ),
        )
