"""Warm agents: start the agents once, then run many functions on fresh workers.

:meth:`torchrunx.Launcher.warm` starts one agent per host (over SSH, ``srun`` or locally, as a
launch does) and waits until each has connected back; each agent then imports torch in the
background, which the first run waits for if it is not done yet. Every
:meth:`WarmLauncher.run` then only sends the call: each agent forks fresh workers for it, and
they end with it, so runs are as isolated as separate launches. Between runs, a thread of the
launcher exchanges heartbeats with the agents and notices any that ends; during a run, the
caller's thread owns the launch, as in a one-shot launch.

The agents end with the ``with`` block, on :meth:`WarmLauncher.close`, when the object is
garbage-collected, at interpreter exit, and, when the launcher process dies (a notebook kernel
restarted or killed, a SIGKILL), by themselves: their standard input reaches end-of-file, or
the launcher's heartbeats stop for ``agent_timeout`` seconds.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, ParamSpec, TypeVar, final

from torchrunx.orchestrator import sigterm_raises_system_exit
from torchrunx.results import LaunchResult
from torchrunx.serialization import dumps_call

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from torchrunx.launcher import Launcher
    from torchrunx.orchestrator import Launch

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("torchrunx.launcher")


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
        self.launch.loop.post(lambda: None)  # wakes the loop at once
        thread.join()

    def _serve(self) -> None:
        try:
            self.launch.idle(lambda: self._stopping)
        except Exception:
            logger.exception("the warm agents' idle loop failed; the next run will say more")


def _shut(launch: Launch, idle: _Idle) -> None:
    """End the agents and release everything (the finalizer: no reference to the object)."""
    idle.pause()
    try:
        launch.shutdown()
    finally:
        launch.close()


@final
class WarmLauncher:
    """Agents started once and kept for many runs; made by :meth:`torchrunx.Launcher.warm`.

    Use it as a context manager, or call :meth:`close`::

        with trx.Launcher(hostnames=["node1", "node2"], workers_per_host=2).warm() as warm:
            model_path = warm.run(train, "config.yaml").rank(0)
            scores = warm.run(evaluate, model_path)

    Attributes:
        launcher: The settings the agents were started with.
        hostnames: The hosts, in launch order.
        runs: Runs made so far (failed ones included).
    """

    def __init__(self, launcher: Launcher, launch: Launch) -> None:
        """Take over a launch whose agents have all said hello (see :meth:`Launcher.warm`)."""
        self.launcher = launcher
        self.hostnames = tuple(a.slots.hostname for a in launch.state.agents)
        self.runs = 0
        self._launch = launch
        self._lock = threading.Lock()
        self._idle = _Idle(launch)
        self._idle.resume()
        self._finalizer = weakref.finalize(self, _shut, launch, self._idle)

    @property
    def closed(self) -> bool:
        """Whether the agents were ended (:meth:`close`, the ``with`` block, collection)."""
        return not self._finalizer.alive

    def run(self, func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> LaunchResult[R]:
        """Run ``func(*args, **kwargs)`` on fresh workers of every agent; every rank's value.

        Raises as :meth:`torchrunx.Launcher.run` does, and only for this run: the agents stay,
        and the next run starts fresh workers. An agent that ended since the last run is
        replaced first if ``restart_on`` holds ``"hosts"``; otherwise that run raises
        :class:`~torchrunx.AgentFailedError` at once.

        Raises:
            RuntimeError: The agents were closed, or another thread's run is under way.
        """
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")
        call = dumps_call(func, args, kwargs)
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("these warm agents are running another call (one run at a time)")
        try:
            if self.closed:
                raise RuntimeError(
                    "these warm agents were closed; start new ones with Launcher.warm()"
                )
            self.runs += 1
            self._idle.pause()
            try:
                with sigterm_raises_system_exit():
                    per_host = self._launch.run_call(call)
            finally:
                self._idle.resume()
        finally:
            self._lock.release()
        launch = self._launch
        assert launch.timings_of_run is not None  # noqa: S101 (set by a successful run)
        return LaunchResult(self.hostnames, per_host, launch.restarts, launch.timings_of_run)

    def close(self) -> None:
        """End the agents (their workers are gone already) and release everything; idempotent."""
        with self._lock:
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
