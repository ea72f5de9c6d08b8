"""Warm agents: start the agents once, then run many functions on fresh workers.

:meth:`torchrunx.Launcher.warm` starts one agent per host (over SSH, ``srun`` or locally, as a
launch does) and waits until each has connected back; each agent then imports torch in the
background, which the first run waits for if it is not done yet. Every
:meth:`WarmLauncher.run` then only sends the call: each agent forks fresh workers for it, and
they end with it, so runs are as isolated as separate launches. Between runs, a thread of the
launcher exchanges heartbeats with the agents and notices any that ends; during a run, the
caller's thread owns the launch, as in a one-shot launch.

:meth:`WarmLauncher.submit` queues a run instead and returns a
:class:`concurrent.futures.Future` at once: one background thread of the launcher (started by
the first submit) runs the queued calls one at a time, in submission order, and a direct
:meth:`WarmLauncher.run` waits for them first.

The agents end with the ``with`` block, on :meth:`WarmLauncher.close`, when the object is
garbage-collected, at interpreter exit, and, when the launcher process dies (a notebook kernel
restarted or killed, a SIGKILL), by themselves: their standard input reaches end-of-file, or
the launcher's heartbeats stop for ``agent_timeout`` seconds. The first four also cancel the
submitted runs that are still queued or under way.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
import weakref
from collections import deque
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, final

from torchrunx.errors import AgentFailedError
from torchrunx.launcher.launch.orchestrator import STOP_WAIT
from torchrunx.launcher.launch.preempt import sigterm_preempts
from torchrunx.launcher.launch.replace import Failed
from torchrunx.launcher.launch.session import catch_up, earliest
from torchrunx.launcher.state.records import Phase
from torchrunx.launcher.state.reports import summary
from torchrunx.launcher.state.results import LaunchResult
from torchrunx.launcher.view.where import sigquit_shows_stacks
from torchrunx.serialization import dumps_call

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from torchrunx.launcher.launch.orchestrator import Launch
    from torchrunx.launcher.settings.plan import LaunchPlan
    from torchrunx.launcher.state.results import LaunchTimings

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("torchrunx.launcher")

_CLOSED = "these warm agents were closed; start new ones with Launcher.warm()"

_CANCEL_WAIT = 30.0
"""How long :meth:`_Submitted.cancel` waits for a run under way to end (its workers get their
grace period; a run that was starting new agents stops them first)."""

_our_thread = threading.local()
"""``warm`` is set in the threads this module starts (see :func:`_shut`)."""


def _in_our_thread() -> bool:
    return bool(getattr(_our_thread, "warm", False))


class _Idle:
    """The thread that keeps the launch's loop going between runs (heartbeats, agents' ends)."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self._stopping = False
        self._thread: threading.Thread | None = None

    def resume(self) -> None:
        """Hand the launch to the idle thread."""
        self._stopping = False
        self._thread = threading.Thread(
            target=self._serve, name="torchrunx-warm-agents", daemon=True
        )
        self._thread.start()

    def pause(self) -> None:
        """Take the launch back: the idle thread ends its round and exits."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping = True
        self.launch.session.loop.post(lambda: None)  # wakes the loop at once
        thread.join()

    def _serve(self) -> None:
        _our_thread.warm = True
        try:
            while not self._stopping:  # heartbeats, and agents that end or fall silent
                self.launch.session.step()
        except Exception:
            logger.exception("the warm agents' idle loop failed; the next run will say more")


class _Agents:
    """What every run shares: the launch, its idle thread, the run lock, the count of runs.

    Held by the :class:`WarmLauncher`, its :class:`_Runner` and its finalizer; it refers to
    none of them, so the :class:`WarmLauncher` can be collected while its runner thread lives.
    """

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.hostnames = launch.host_changes.hostnames()
        self.idle = _Idle(launch)
        self.lock = threading.Lock()
        """Held by the run under way (one at a time), and by :meth:`WarmLauncher.close`."""
        self.runs = 0
        self._timings: LaunchTimings | None = None
        """The last successful run's timings (its ranks are forgotten after it)."""
        self._restarts = 0
        """The restarts the last successful run needed."""

    def run(self, call: list[memoryview], token: object = None) -> LaunchResult[Any]:
        """Run a pickled call on fresh workers; the caller holds :attr:`lock`.

        ``token`` names the run for :meth:`LaunchLoop.interrupt` (a submitted run's future).

        Raises:
            BaseException: Whatever the run raises (:meth:`Launch.run_call`).
        """
        self.runs += 1
        self.idle.pause()
        try:
            per_host = self.launch.run_call(call, token, prepare=self._prepare, after=self._after)
        finally:
            self.idle.resume()
        assert self._timings is not None  # noqa: S101 (set by a successful run)
        return LaunchResult(
            self.launch.host_changes.hostnames(),
            per_host,
            self._restarts,
            self._timings,
            fresh_workers=self.launch.state.fresh_workers,
            world_changes=tuple(self.launch.state.agent_table.world_changes),
            stragglers=self.launch.session.stragglers.watch.last_run,
        )

    # -- between two runs ---------------------------------------------------------------------

    def _prepare(self, deadline: float | None) -> bool:
        """Before a run: what the time since the last run changed.

        Returns ``True`` when the last run's workers stay and take this call (nothing failed
        since). Else their workers are gone or stopped now; agents still stopping are waited
        for (bounded), and those that ended are replaced (``restart_on`` with ``"hosts"``)
        or named in the :class:`AgentFailedError` raised.
        """
        launch = self.launch
        st = launch.state
        catch_up(launch.session)
        since_last = st.faults  # workers and agents lost or dead while idle: no run's failure
        if st.progress.kept_workers:
            if not since_last and st.current.kept_workers_well():
                st.next_call()
                return True
            why = "; ".join(dict.fromkeys(summary(f.error) for f in since_last))
            logger.warning(
                "the workers kept since the last run are not all well%s: this run starts new "
                "workers, and what earlier runs loaded in them is gone",
                f" ({why})" if why else "",
            )
            launch.stop_workers(restart=True, dump=False)
            st.next_attempt(keep_ready=True)
        st.forget_idle_faults()
        with st.stopping_meanwhile():  # an agent's end now is this preparation's, not the run's
            launch.session.run_until(
                lambda: all(a.ready or a.over or a.conn is None for a in st.agents),
                earliest(time.monotonic() + STOP_WAIT, deadline),
            )
        gone = st.agent_table.unready_agents()
        if not gone:
            return False
        names = [a.slots.hostname for a in gone]
        if "hosts" not in launch.plan.resilience.restart_on:
            why = "; ".join(
                dict.fromkeys(summary(f.error) for f in since_last if f.kind in ("agent", "lost"))
            )
            raise AgentFailedError(
                names[0],
                f"the warm agents of {names} ended or stopped answering since the last run"
                + (f" ({why})" if why else "")
                + "; add 'hosts' to restart_on to start new ones at the next run, or open "
                "new warm agents",
            )
        if not launch.plan.quarantines:
            logger.warning("starting new agents on %s before this run", names)
        launch.host_changes.replace_agents(deadline)
        unready = [a.slots.hostname for a in st.agent_table.unready_agents()]
        if unready:
            st.add_extra_failure(f"new agents were started, but those of {unready} did not")
            raise Failed
        st.next_attempt()
        return False

    def _after(self) -> None:
        """After a run, failed or not: the agents stay (and the workers, if kept and well).

        What the result reports is read before the state forgets the run.
        """
        st = self.launch.state
        if st.phase is Phase.SUCCEEDED:
            self._timings, self._restarts = self.launch.session.timings(), st.restarts
        st.after_run(keep_workers=self.launch.plan.keep_workers)


class _Phase(enum.Enum):
    QUEUED = enum.auto()
    CANCELLED = enum.auto()  # while queued: it never starts
    RUNNING = enum.auto()
    ENDING = enum.auto()  # the run is over; its outcome is being set
    ENDED = enum.auto()


class _Submitted(Future[LaunchResult[R]]):
    """The future of a submitted run; the runner thread sets its outcome.

    It stays PENDING while its run is under way (:meth:`running` says so), so that
    :meth:`cancel` can still stop the run.
    """

    def __init__(self, call: list[memoryview], launch: Launch) -> None:
        super().__init__()
        self.call: list[memoryview] | None = call
        self._launch = launch
        self._step = threading.Lock()
        """Guards :attr:`_phase` and :attr:`_cancelling` (never held while callbacks run)."""
        self._phase = _Phase.QUEUED
        self._cancelling = False
        self._error = CancelledError("this submitted run was cancelled (Future.cancel)")

    def start(self) -> bool:
        """For the runner thread: take the run (``False``: it was cancelled while queued)."""
        with self._step:
            if self._phase is not _Phase.QUEUED:
                return False
            self._phase = _Phase.RUNNING
            return True

    def end(self, outcome: LaunchResult[R] | BaseException) -> None:
        """For the runner thread: the run is over; set its outcome (cancelled, raised, value)."""
        with self._step:
            self._phase = _Phase.ENDING
            cancelled = self._cancelling and isinstance(outcome, CancelledError)
        try:
            if cancelled:
                super().cancel()
                self.set_running_or_notify_cancel()  # wait() and as_completed() see it now
            elif isinstance(outcome, BaseException):
                self.set_exception(outcome)
            else:
                self.set_result(outcome)
        finally:
            with self._step:
                self._phase = _Phase.ENDED

    def running(self) -> bool:
        """Whether the run is under way (the future stays PENDING meanwhile)."""
        return self._phase in (_Phase.RUNNING, _Phase.ENDING) and not self.done()

    def cancel(self) -> bool:
        """Cancel the run: a queued run never starts; a run under way stops its workers.

        A run under way is interrupted as Ctrl-C would (its workers are stopped, the agents
        stay); this waits until it has ended (at most 30 s). Thread-safe.

        Returns:
            Whether the future is cancelled: ``False`` when the run ended otherwise first (its
            result or exception stands).
        """
        with self._step:
            phase = self._phase
            if phase is _Phase.QUEUED:
                self._phase = _Phase.CANCELLED
            elif phase is _Phase.RUNNING:
                self._cancelling = True
        if phase is _Phase.QUEUED:
            super().cancel()
            self.set_running_or_notify_cancel()  # wait() and as_completed() see it now
            return True
        if phase in (_Phase.RUNNING, _Phase.ENDING):
            # For this run only (the token): a request that comes after it ended does nothing.
            self._launch.session.interrupt(self._error, self)
            if not self.done():  # done() already in a done-callback of this very future
                wait_futures([self], timeout=_CANCEL_WAIT)
            if not self.done():
                logger.warning("a cancelled run did not end within %.0f s", _CANCEL_WAIT)
        return self.cancelled()


class _Runner:
    """The thread that runs submitted calls one at a time, in order; started on demand.

    It refers to the agents, never to the :class:`WarmLauncher`.
    """

    def __init__(self, agents: _Agents) -> None:
        self._agents = agents
        self._changed = threading.Condition()
        """Guards what follows; notified when a run is queued, taken, or over."""
        self._queue: deque[_Submitted[Any]] = deque()
        self._current: _Submitted[Any] | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def submit(self, call: list[memoryview]) -> _Submitted[Any]:
        """Queue a pickled call; its future.

        Raises:
            RuntimeError: The runner was stopped (the agents are closed).
        """
        future: _Submitted[Any] = _Submitted(call, self._agents.launch)
        with self._changed:
            if self._stopping:
                raise RuntimeError(_CLOSED)
            self._queue.append(future)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="torchrunx-warm-submitted", daemon=True
                )
                self._thread.start()
            self._changed.notify_all()
        return future

    def lock_when_drained(self) -> bool:
        """For a direct run: wait for the submitted runs, then take the run lock if free.

        ``False``: the lock is held by another thread's direct run.

        Raises:
            RuntimeError: Called in the runner thread (a done-callback), which would wait for
                itself.
        """
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError(
                "run() from a submitted run's done-callback would wait for itself; "
                "use submit() there"
            )
        with self._changed:
            while self._queue or self._current is not None:
                self._changed.wait()
            return self._agents.lock.acquire(blocking=False)

    def stop(self) -> None:
        """Cancel the queued runs and the run under way, then end the thread; idempotent."""
        with self._changed:
            self._stopping = True
            queued = list(self._queue)
            self._queue.clear()
            current, thread = self._current, self._thread
            self._changed.notify_all()
        for future in queued:
            future.cancel()
        if current is not None:
            current.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _serve(self) -> None:
        _our_thread.warm = True
        while True:
            with self._changed:
                while not self._queue and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
                future = self._current = self._queue.popleft()
            try:
                self._run(future)
            except Exception as exc:  # a bug of ours: the future must not stay pending forever
                logger.exception("the runner of submitted runs failed")
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(exc)
            finally:
                with self._changed:
                    self._current = None
                    self._changed.notify_all()
            del future

    def _run(self, future: _Submitted[Any]) -> None:
        with self._agents.lock:  # a direct run of another thread may be under way
            if not future.start():
                return
            call, future.call = future.call, None
            assert call is not None  # noqa: S101 (set until started)
            outcome: LaunchResult[Any] | BaseException
            try:
                outcome = self._agents.run(call, token=future)
            except BaseException as exc:  # noqa: BLE001 (the future carries it, whatever it is)
                outcome = exc
        future.end(outcome)


def _shut(agents: _Agents, runner: _Runner) -> None:
    """Cancel the submitted runs, end the agents, release everything.

    The finalizer: it refers to no :class:`WarmLauncher`.
    """
    if _in_our_thread():
        # Collected in the runner or idle thread (a pass of the garbage collector, or close()
        # in a done-callback): neither can wait for itself, so another thread ends everything.
        threading.Thread(target=_shut, args=(agents, runner), name="torchrunx-warm-close").start()
        return
    runner.stop()
    agents.idle.pause()
    try:
        agents.launch.shutdown()
    finally:
        agents.launch.close()


@final
class WarmLauncher:
    """Agents started once and kept for many runs; made by :meth:`torchrunx.Launcher.warm`.

    Use it as a context manager, or call :meth:`close`::

        with trx.Launcher(hostnames=["node1", "node2"], workers_per_host=2).warm() as warm:
            model_path = warm.run(train, "config.yaml").rank(0)
            scores = warm.run(evaluate, model_path)

    Attributes:
        plan: What the agents were started with: the resolved hosts and the settings.
        hostnames: The hosts, in launch order.
        keep_workers: Whether the workers stay from run to run (``warm(keep_workers=True)``).
    """

    def __init__(self, plan: LaunchPlan, launch: Launch) -> None:
        """Take over a launch whose agents have all said hello (see :meth:`Launcher.warm`)."""
        self.plan = plan
        self._agents = _Agents(launch)
        self.hostnames = self._agents.hostnames
        self.keep_workers = launch.plan.keep_workers
        self._runner = _Runner(self._agents)
        self._agents.idle.resume()
        self._finalizer = weakref.finalize(self, _shut, self._agents, self._runner)

    @property
    def runs(self) -> int:
        """Runs started so far, failed, cancelled and submitted ones included."""
        return self._agents.runs

    @property
    def closed(self) -> bool:
        """Whether the agents were ended (:meth:`close`, the ``with`` block, collection)."""
        return not self._finalizer.alive

    def run(self, func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> LaunchResult[R]:
        """Run ``func(*args, **kwargs)`` on fresh workers of every agent; every rank's value.

        Runs submitted earlier (:meth:`submit`) that are queued or under way go first: this
        waits for them, then runs in the calling thread.

        Raises as :meth:`torchrunx.Launcher.run` does, and only for this run: the agents stay,
        and the next run starts fresh workers. An agent that ended since the last run is
        replaced first if ``restart_on`` holds ``"hosts"``; otherwise that run raises
        :class:`~torchrunx.AgentFailedError` at once.

        Raises:
            RuntimeError: The agents were closed, another thread's run is under way, or this
                is called from a done-callback of a submitted run.
        """
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")
        call = dumps_call(func, args, kwargs)
        if not self._runner.lock_when_drained():
            raise RuntimeError("these warm agents are running another call (one run at a time)")
        try:
            if self.closed:
                raise RuntimeError(_CLOSED)
            launch = self._agents.launch
            with (
                sigterm_preempts(launch.session.preempt, launch.plan.resilience.preemption_grace),
                sigquit_shows_stacks(launch.session.ask_stacks),
            ):
                result: LaunchResult[R] = self._agents.run(call)
        finally:
            self._agents.lock.release()
        return result

    def submit(
        self, func: Callable[P, R], *args: P.args, **kwargs: P.kwargs
    ) -> Future[LaunchResult[R]]:
        """Queue ``func(*args, **kwargs)`` to run as :meth:`run` would, without waiting for it.

        One background thread runs the submitted calls one at a time, in submission order
        (a later :meth:`run` waits for them). The future's result is the
        :class:`~torchrunx.LaunchResult` that :meth:`run` would return, or its exception is
        what :meth:`run` would raise; a failed run leaves the agents ready for the next.

        ``future.cancel()`` of a queued run: it never starts. Of a run under way: its workers
        are stopped as Ctrl-C would stop them (the agents stay), and ``cancel`` returns
        ``True`` once the run has ended, ``False`` if the run ended otherwise first (its
        outcome stands). :meth:`close` cancels every submitted run not yet ended.

        Returns:
            A :class:`concurrent.futures.Future`; :meth:`~concurrent.futures.Future.running`
            tells whether its run is under way.

        Raises:
            TypeError: ``func`` is not callable.
            SerializationError: ``func`` or an argument cannot be pickled.
            RuntimeError: The agents were closed.
        """
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")
        call = dumps_call(func, args, kwargs)
        if self.closed:
            raise RuntimeError(_CLOSED)
        future: Future[LaunchResult[R]] = self._runner.submit(call)
        return future

    def close(self) -> None:
        """End the agents and release everything; idempotent.

        Submitted runs not yet ended are cancelled first; the workers of direct runs are gone
        already (a direct run of another thread is waited for).
        """
        self._runner.stop()
        with self._agents.lock:
            self._finalizer()

    def __enter__(self) -> WarmLauncher:
        """The warm agents themselves."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """End the agents (:meth:`close`)."""
        self.close()

    def __repr__(self) -> str:
        """``WarmLauncher(hostnames=..., runs=..., closed=...)``."""
        return f"WarmLauncher(hostnames={self.hostnames}, runs={self.runs}, closed={self.closed})"
