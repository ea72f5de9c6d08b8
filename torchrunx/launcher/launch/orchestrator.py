"""One launch, as it happens: start, hellos, specs, monitor, restart or not, collect, stop.

:class:`Launch` decides. It holds its parts: the launch's resources and its loop, a
:class:`~torchrunx.launcher.launch.session.LaunchLoop` (``session``); the changes of the world's
hosts between attempts, a :class:`~torchrunx.launcher.launch.replace.HostChanges`
(``host_changes``); what its workers are sent and return, a
:class:`~torchrunx.launcher.launch.dispatch.Dispatch` (``dispatch``). Every change of the launch
state goes through the methods of :class:`~torchrunx.launcher.state.state.LaunchState` (the
session's). Which failure is the cause and whether to restart is
:mod:`~torchrunx.launcher.state.failures` (pure); the error raised and its notes are
:mod:`~torchrunx.launcher.state.reports` (pure). What happens between two runs of warm agents is
:mod:`~torchrunx.launcher.warm`'s (it hands :meth:`Launch.run_call` its two steps)::

    open: start agents ─▶ every AgentHello (start_timeout)
    run_call: [warm: prepare] ─▶ specs (or the call to kept workers) ─▶ monitor
        ─▶ every result ─▶ collect ─▶ [warm: after the run]
        └▶ a failure ─▶ stop the workers ─▶ cause ─▶ restart (specs again) or raise
"""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any

from torchrunx.errors import (
    Preempted,
    add_note,
    exception_text,
)
from torchrunx.events import (
    LaunchFinished,
    LaunchStarted,
    Restarting,
    WorkerState,
)
from torchrunx.launcher.launch.dispatch import Dispatch
from torchrunx.launcher.launch.limits import GUESSED_WORKERS, DescriptorLimit, descriptors_needed
from torchrunx.launcher.launch.preempt import end_preemption
from torchrunx.launcher.launch.replace import Failed, HostChanges
from torchrunx.launcher.launch.session import LaunchLoop, earliest
from torchrunx.launcher.launch.stalls import LOST_ANSWER_WAIT
from torchrunx.launcher.state.failures import choose_cause, others, restartable, restarts_for
from torchrunx.launcher.state.hangs import ranks_text
from torchrunx.launcher.state.records import STOP_GRACE
from torchrunx.launcher.state.reports import (
    finish_report,
    launch_timeout_error,
    output_tail_note,
    stacks_note,
    start_timeout_error,
    summary,
    world_changes_note,
)
from torchrunx.launcher.view.progress import BytesProgress, ProgressLine, mib
from torchrunx.wire.messages import Stop

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.launcher.settings.plan import LaunchPlan
    from torchrunx.launcher.starts.agent_pool import Starter
    from torchrunx.launcher.state.records import Fault

logger = logging.getLogger("torchrunx.launcher")

STOP_WAIT = STOP_GRACE + 5.0
"""Seconds a stop waits for every agent to report its workers' ends."""


def wants_stacks(error: BaseException | None) -> bool:
    """Whether a stop for ``error`` asks the survivors for their stacks.

    They tell where the survivors were stuck: after a failure, and after Ctrl-C or SIGTERM too
    (a launch stopped because it seemed stuck). Not for a cancelled warm run, or the
    launcher's own exit.
    """
    if isinstance(error, KeyboardInterrupt):
        return True
    if isinstance(error, SystemExit):
        return error.code == 128 + signal.SIGTERM
    return not isinstance(error, CancelledError)


class Launch:
    """One launch in progress; owned by the thread that calls :meth:`execute`."""

    def __init__(
        self, plan: LaunchPlan, call: list[memoryview], *, starter: Starter | None = None
    ) -> None:
        """Open the launch's parts (see :class:`LaunchLoop`); start nothing.

        ``call`` is the pickled function and arguments (warm agents: each run's, given to
        :meth:`run_call`); ``starter`` replaces how agents start (the many-hosts benchmark).
        """
        self.plan = plan
        self.call = call
        slots = plan.hosts.slots
        self.descriptors = DescriptorLimit(  # before any part opens one
            descriptors_needed(len(slots), sum(s.workers or GUESSED_WORKERS for s in slots))
        )
        """The launch's hold on the process's open-file limit, released by :meth:`close`."""
        try:
            self.session = LaunchLoop(plan, starter=starter)
            """The parts and the loop: opened here, closed by :meth:`close`."""
        except BaseException:
            self.descriptors.release()
            raise
        self.host_changes = HostChanges(self.session)
        """The world's hosts between attempts: new agents, spares, a smaller world."""
        self.state = self.session.state
        """The launch state (the session's: the same object)."""
        self.dispatch = Dispatch(self.session)
        """What the workers are sent (specs, calls), and their results."""

    def close(self) -> None:
        """Release every part of the launch (see :meth:`LaunchLoop.close`), then its limit."""
        try:
            self.session.close()
        finally:
            self.descriptors.release()

    def execute(self) -> tuple[tuple[Any, ...], ...]:
        """Run every phase of a one-shot launch; return the unpickled results per host."""
        self.open()
        return self.run_call(self.call)

    def open(self) -> None:
        """Start the agents and wait until every one has said hello.

        Raises:
            AgentFailedError: An agent could not start or connect (the others are stopped).
        """
        st = self.state
        deadline = self._deadline(st.progress.started)
        self.session.open_health()
        self.session.sink.emit(
            LaunchStarted(
                tuple(a.slots.hostname for a in st.world),
                tuple(a.slots.workers for a in st.world),
                self.plan.resilience.max_restarts,
                None if self.session.health is None else self.session.health.url,
                spare_hosts=tuple(a.slots.hostname for a in st.agents if a.role == "spare"),
            )
        )
        try:
            self.session.starts.prepare()
            for agent in st.agents:
                self.session.pool.start(agent.index)
            start_by = st.progress.started + self.plan.timeouts.start
            forced = self.plan.from_env.progress
            line = ProgressLine("agents starting", len(st.agents), "hosts up", forced=forced)
            bundle = self.session.starts.bundle

            def started() -> bool:
                if line.due():  # counted only then: this runs at every turn of the loop
                    shipped = f"; code shipped: {mib(bundle.written)}" if bundle else ""
                    line.update(sum(a.hello is not None for a in st.agents), shipped)
                return st.agent_table.all_hellos

            try:
                self.session.run_until(started, earliest(start_by, deadline))
            finally:
                line.close()
            if self.session.preemption is not None:
                raise self._preempted()  # noqa: TRY301 (it stopped everything and reported)
            if not st.agent_table.all_hellos and not st.failed:
                if deadline is not None and time.monotonic() >= deadline:
                    self._launch_timed_out()
                else:
                    self._start_timed_out()
            if st.failed:
                raise Failed  # noqa: TRY301 (stopped and reported below, like every failure)
        except Preempted:
            raise
        except BaseException as exc:  # noqa: BLE001 (Ctrl-C included: stop everything first)
            error = self._end_with_failure(exc, final=True)
            raise error from error.__cause__
        st.agent_table.agents_ready(time.monotonic())

    def run_call(
        self,
        call: list[memoryview],
        token: object = None,
        *,
        prepare: Callable[[float | None], bool] | None = None,
        after: Callable[[], None] | None = None,
    ) -> tuple[tuple[Any, ...], ...]:
        """Run one call on the started agents; the results per host.

        A one-shot launch runs one call and its failure stops the agents. Warm agents stay
        after a failure (this run's workers stopped), ready for the next call: for them,
        ``prepare(deadline)`` runs first (``True``: the kept workers take the call) and
        ``after()`` last, whether the run succeeded or not. ``token`` names this run for
        :meth:`LaunchLoop.interrupt` (``None``: a fresh one).
        """
        st = self.state
        self.call = call
        self.session.run_token = object() if token is None else token
        st.start_run(time.monotonic(), warm=self.plan.warm)
        deadline = self._deadline(st.run_started)
        try:
            kept = prepare is not None and prepare(deadline)
            st.run_workers(fresh=not kept)
            self._run_attempts(kept=kept, deadline=deadline)
            st.results_in(time.monotonic())
            results = self.dispatch.collect()
        except Preempted:
            if after is not None:
                after()
            raise
        except BaseException as exc:  # noqa: BLE001 (Ctrl-C included: stop everything first)
            error = self._end_with_failure(exc, final=not self.plan.warm)
            if after is not None:
                after()
            raise error from error.__cause__
        st.succeeded()
        self._emit_finished(None)
        if after is not None:
            after()
        return results

    def _run_attempts(self, *, kept: bool, deadline: float | None) -> None:
        """Attempts until every rank of one returned; else raise (a failure, a preemption)."""
        st = self.state
        while True:
            if self.session.preemption is not None:  # SIGTERM during a restart: no new attempt
                raise self._preempted()
            if kept:
                self.dispatch.send_calls(self.call)
                kept = False
            else:
                self.dispatch.send_specs(self.call)
            results = BytesProgress(
                "results",
                lambda: self.session.listener.outcome_bytes,
                forced=self.plan.from_env.progress,
            )

            def finished(results: BytesProgress = results) -> bool:
                results.update()  # large results' bytes, as they come
                return st.finished

            try:
                self.session.run_until(finished, deadline)
            finally:
                results.close()
            if self.session.preemption is not None:
                raise self._preempted()
            if not st.finished and not st.failed and not st.current.alarm:
                self._launch_timed_out()
            if st.finished and not st.failed:
                return
            self._restart_or_raise(deadline)

    def _deadline(self, start: float) -> float | None:
        limit = self.plan.timeouts.launch
        return None if limit is None else start + limit

    def _end_with_failure(self, exc: BaseException, *, final: bool) -> BaseException:
        """Record what ended the run, stop the workers (bounded), and build the error.

        ``final``: stop the agents too (warm agents stay for the next run otherwise).
        """
        st = self.state
        if not isinstance(exc, Failed):
            # Ctrl-C, SIGTERM, or a failure of the launcher itself: it comes first, even in the
            # middle of a restart (see torchrunx.launcher.state.failures).
            self.session.inbox.fault("launch", exc, time.time())
        st.begin_failure()
        try:
            if not final:
                self.stop_workers(restart=True, dump=True)
            elif not self.all_over():
                self.stop_workers(restart=False)
        except (KeyboardInterrupt, SystemExit) as again:  # a second Ctrl-C: stop waiting
            self.session.inbox.fault("launch", again, time.time())
        error = self._report(choose_cause(st.faults))
        st.failed_run()
        self._emit_finished(error)
        return error

    def _restart_or_raise(self, deadline: float | None) -> None:
        """After a failure: stop the workers, find the cause, then restart or raise it."""
        st, plan = self.state, self.plan
        may_restart = (
            st.restarts < plan.resilience.max_restarts and self._provisionally_restartable()
        )
        lost = [f for f in st.faults if f.kind == "lost"]
        gone = {f.host_index for f in lost if f.host_index is not None}
        if lost and (view := self.session.diagnose_now(gone, LOST_ANSWER_WAIT)):  # before stops
            hosts, were = ("host", "was") if len(gone) == 1 else (f"{len(gone)} hosts", "were")
            if away := [r.rank for r in st.ranks if r.host_index in gone]:
                view += f"\n{ranks_text(away)} on the lost {hosts}: not asked"
            add_note(
                lost[0].error, f"what the ranks were doing when the {hosts} {were} lost:\n{view}"
            )
        # Warm agents stay either way: only this run's workers are stopped.
        self.stop_workers(restart=may_restart or plan.warm, dump=not may_restart)
        cause = choose_cause(st.faults)
        if not may_restart or not restartable(
            cause,
            plan.resilience.restart_on,
            attempt=st.restarts,
            max_restarts=plan.resilience.max_restarts,
        ):
            raise Failed
        self._restart(cause, deadline)

    # -- stopping, restarting, failing ------------------------------------------------------

    def _provisionally_restartable(self) -> bool:
        st = self.state
        if not st.faults:  # only an abnormal exit so far: a death, if nothing else shows up
            return "deaths" in self.plan.resilience.restart_on
        cause = choose_cause(st.faults)
        return restarts_for(
            cause.error, set(self.plan.resilience.restart_on), from_worker=cause.rank is not None
        )

    def all_over(self) -> bool:
        """Whether every agent has ended (or never connected)."""
        return all(a.over or a.conn is None for a in self.state.agents)

    def stop_workers(self, *, restart: bool, dump: bool | None = None) -> None:
        """Tell the agents to stop their workers; wait (bounded) until every end is known.

        ``restart``: the agents stay (for another attempt, or the next warm run); else they
        end too. ``dump``: ask for the survivors' stacks (default: when not restarting).
        """
        st = self.state
        st.begin_stop(restart=restart)
        first = choose_cause(st.faults) if st.faults else None
        error = None if first is None else first.error
        if isinstance(error, SystemExit) and error.code == 128 + signal.SIGTERM:
            reason = "the launcher received SIGTERM"
        elif error is None:
            reason = "a worker exited abnormally"
        else:
            reason = (exception_text(error).splitlines() or [type(error).__name__])[0]
        dump = (not restart if dump is None else dump) and wants_stacks(error)
        stop = Stop(reason, STOP_GRACE, dump_stacks=dump, restart=restart, attempt=st.attempt)
        if not restart:
            self.session.inbox.final_stop = (
                stop  # also for an agent whose start completes meanwhile
            )
        for agent in st.agents:
            if agent.conn is not None and not agent.over and not (restart and agent.ready):
                self.session.inbox.peer_of(agent).send(stop)
        done = (
            (lambda: st.agent_table.stopped and st.current.ranks_known)
            if restart
            else self._ends_known
        )
        self.session.run_until(done, time.monotonic() + STOP_WAIT, interruptible=False)
        self.session.apply_queue()
        for rank in st.ranks:  # what is still unsettled is judged on what arrived
            if rank.exited is not None:
                self.session.inbox.settle(rank)
            self.session.inbox.emit(st.current.move_rank(rank, WorkerState.STOPPED))

    def _ends_known(self) -> bool:
        return self.all_over() and self.state.current.ranks_known

    def _restart(self, cause: Fault, deadline: float | None) -> None:
        """Restart the worker group on the agents, replacing lost ones if asked to."""
        st = self.state
        reason = summary(cause.error)
        st.record_restart(reason)
        self.session.sink.emit(
            Restarting(st.restarts + 1, self.plan.resilience.max_restarts, reason)
        )
        logger.warning(
            "restarting the workers (restart %d of %d) after: %s",
            st.restarts + 1,
            self.plan.resilience.max_restarts,
            reason,
        )
        for rank in st.ranks:
            self.session.inbox.forget_rank(rank)  # an old worker's channel: nothing more is read
        if "hosts" in self.plan.resilience.restart_on:
            self.host_changes.replace_agents(deadline)
        unready = [a.slots.hostname for a in st.agent_table.unready_agents()]
        if unready:
            st.restart_failed(
                f"a restart was attempted, but the agents of {unready} did not get ready"
            )
            raise Failed
        st.next_attempt()

    def _start_timed_out(self) -> None:
        missing = next(a for a in self.state.world if a.hello is None)
        error = start_timeout_error(
            missing.slots.hostname,
            self.plan.timeouts.start,
            self.session.port,
            self.session.starts.configured_address(),
            self.session.inbox.stderr_tail(missing.index),
            started=missing.index in self.session.pool.processes,
        )
        self.session.inbox.fault("agent", error, time.time(), host_index=missing.index)

    def _launch_timed_out(self) -> None:
        st = self.state
        running = [r.rank for r in st.ranks if r.result is None]
        elapsed = time.monotonic() - st.progress.started
        error = launch_timeout_error(self.plan.timeouts.launch or 0.0, elapsed, running)
        diagnosis = self.session.diagnose_now()  # what the ranks wait for, from stall detection
        if diagnosis:
            add_note(error, f"what the ranks were doing at the limit:\n{diagnosis.rstrip()}")
        self.session.inbox.fault("launch", error, time.time())

    def _report(self, cause: Fault) -> BaseException:
        st = self.state
        error = cause.error
        if cause.rank is not None and cause.rank < len(st.ranks):
            rank = st.ranks[cause.rank]
            note = output_tail_note(
                self.session.logs.tail(rank.host_index, rank.local_rank),
                self.session.logs.log_file(rank.host_index, rank.local_rank),
            )
            if note is not None:
                add_note(error, note)
        finish_report(
            error,
            others=[*others(st.faults, cause), *st.extra_failures],
            history=st.history,
            max_restarts=self.plan.resilience.max_restarts,
        )
        changes = world_changes_note(st.agent_table.world_changes)
        if changes is not None:
            add_note(error, changes)
        if st.current.stacks:
            where = {r.rank: (r.local_rank, st.agent_table.hostname(r)) for r in st.ranks}
            note = stacks_note(st.current.stacks, where)
            add_note(error, note)
            if isinstance(error, SystemExit):  # Python prints no note of a SystemExit
                logger.warning("%s", note)
        return error

    def _preempted(self) -> Preempted:
        """The preemption's end: keep what returned, stop everything, requeue if asked."""
        assert self.session.preemption is not None  # noqa: S101 (called once it began)
        return end_preemption(
            self.state,
            self.plan,
            self.session.preemption[0],
            self._stop_for_good,
            self._emit_finished,
        )

    def _stop_for_good(self) -> None:
        if not self.all_over():
            self.stop_workers(restart=False, dump=False)

    def _emit_finished(self, error: BaseException | None) -> None:
        st = self.state
        self.session.sink.emit(
            LaunchFinished(
                succeeded=error is None,
                attempts=st.restarts + 1,
                duration=time.monotonic() - st.run_started,
                error=None if error is None else summary(error),
                stragglers=self.session.stragglers.end_run(),
            )
        )

    # -- the end ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """End warm agents that wait between runs: a final Stop, then their AgentDone (bounded)."""
        st = self.state
        stop = Stop("the warm agents were closed", STOP_GRACE, restart=False, attempt=st.attempt)
        self.session.inbox.final_stop = stop
        with st.stopping_meanwhile():
            for agent in st.agents:
                if agent.conn is not None and not agent.over:
                    self.session.inbox.peer_of(agent).send(stop)
            self.session.run_until(self.all_over, time.monotonic() + STOP_WAIT, interruptible=False)
            self.session.apply_queue()
