"""One launch, as it happens: start, hellos, specs, monitor, restart or not, collect, stop, close.

The parts it drives each own one thing:

- :mod:`torchrunx.launcher.ioloop`: the one selector loop for every connection of the launch;
- :mod:`torchrunx.launcher.listener`: accepting, authenticating and framing connections;
- :mod:`torchrunx.launcher.agent_pool`: starting, replacing and closing agent processes;
- :mod:`torchrunx.launcher.agent_starts`: how one host's agent is started, and its bootstrap line;
- :mod:`torchrunx.launcher.inbox`: what arrives (frames, closed connections, agents' ends), applied
  to the launch state;
- :mod:`torchrunx.launcher.state`: what every agent and rank is (pure);
- :mod:`torchrunx.launcher.failures`: which failure is the cause, and whether to restart (pure);
- :mod:`torchrunx.launcher.reports`: the error raised, with its notes (pure).

One thread (the caller's) runs it all, agents' output and ends included; the only other
threads start agents (a pool of at most 32) and, for SSH agents, are paramiko's own.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import signal
import threading
import time
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any

from torchrunx import serialization
from torchrunx.devices import resolve_backend
from torchrunx.errors import (
    AgentFailedError,
    LaunchTimeoutError,
    SerializationError,
    add_note,
    exception_text,
)
from torchrunx.events import (
    AgentState,
    EventSink,
    LaunchFinished,
    LaunchStarted,
    Restarting,
    WorkerState,
)
from torchrunx.launcher.agent_pool import (
    AgentPool,
    PoolEvent,
)
from torchrunx.launcher.agent_starts import AgentStarts, listen_socket
from torchrunx.launcher.failures import choose_cause, others, restartable, restarts_for
from torchrunx.launcher.health import (
    HealthReport,
    HealthServer,
    health_details_from_env,
    health_host_from_env,
    health_port_from_env,
)
from torchrunx.launcher.inbox import Inbox
from torchrunx.launcher.ioloop import IOLoop
from torchrunx.launcher.listener import Listener, NetEvent
from torchrunx.launcher.reports import (
    finish_report,
    output_tail_note,
    stacks_note,
    summary,
)
from torchrunx.launcher.state import (
    AgentRecord,
    Fault,
    LaunchState,
    Phase,
    StartMethod,
)
from torchrunx.logs import LogRouter, events_file
from torchrunx.wire import handshake
from torchrunx.wire.messages import HEARTBEAT_INTERVAL, Heartbeat, Stop, WorkerCall, WorkerSpec

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from torchrunx.hosts.resolve import HostSlots
    from torchrunx.launcher.agent_pool import Starter
    from torchrunx.launcher.launcher import Launcher
    from torchrunx.launcher.results import LaunchTimings

logger = logging.getLogger("torchrunx.launcher")

STOP_GRACE = 3.0
"""Seconds workers get between SIGTERM and SIGKILL when the launch stops them."""
_STOP_WAIT = STOP_GRACE + 5.0
"""Seconds a stop waits for every agent to report its workers' ends."""
_TICK = HEARTBEAT_INTERVAL / 2


class _Failed(Exception):  # noqa: N818 (control flow inside this module)
    """A failure was recorded: stop, then raise the cause or restart."""


class Launch:
    """One launch in progress; owned by the thread that calls :meth:`execute`."""

    def __init__(  # noqa: PLR0913 (a launch's inputs, and how agents start)
        self,
        launcher: Launcher,
        hosts: list[HostSlots],
        methods: list[StartMethod],
        call: list[memoryview],
        *,
        starter: Starter | None = None,
        warm: bool = False,
        keep_workers: bool = False,
    ) -> None:
        """Open the logs, the listening socket and the loop; nothing is started yet.

        ``starter`` replaces how agents start (the many-hosts benchmark simulates them).
        ``keep_workers`` (warm agents only): the workers stay from run to run.
        """
        self.launcher = launcher
        self.call = call
        # First: it may raise (a bad TORCHRUNX_LOG_LEVEL, a failing handler factory).
        self.logs = LogRouter(launcher.log_handlers, [h.hostname for h in hosts])
        try:  # an unwritable log folder fails here, before any socket or thread exists
            self.sink = EventSink(
                launcher.event_handlers,
                None if self.logs.log_dir is None else events_file(self.logs.log_dir),
            )
        except BaseException:
            self.logs.close()
            raise
        self.secret = handshake.new_secret()
        self.queue: collections.deque[NetEvent | PoolEvent] = collections.deque()
        """The one queue: what the listener read and what the pool saw, in order."""
        loop = None
        try:  # out of descriptors, say: nothing made so far is left open
            self.loop = loop = IOLoop()
            self.listener = Listener(
                self.loop, self.secret, listen_socket(launcher, methods), self.queue.append
            )
        except BaseException:
            if loop is not None:
                loop.close()
            self.sink.close()
            self.logs.close()
            raise
        self.port = self.listener.port
        self.state = LaunchState(
            [AgentRecord(i, h, m) for i, (h, m) in enumerate(zip(hosts, methods, strict=True))],
            started=time.monotonic(),
            max_restarts=launcher.max_restarts,
            agent_timeout=float(launcher.agent_timeout),
            start_timeout=float(launcher.start_timeout),
            keep_workers=warm and keep_workers,
        )
        self.starts = AgentStarts(
            launcher,
            self.state.agents,
            self.port,
            self.secret,
            self.logs.level,
            lambda index, record: self.logs.emit_batch(index, 0, (record,)),
            warm=warm,
        )
        self.pool = AgentPool(
            self.loop,
            self.queue.append,
            starter or self.starts,
            [h.hostname for h in hosts],
        )
        self.inbox = Inbox(
            launcher,
            self.state,
            listener=self.listener,
            pool=self.pool,
            logs=self.logs,
            sink=self.sink,
        )
        self.extra_failures: list[str] = []
        self.health: HealthServer | None = None
        self._next_tick = 0.0
        self.warm = warm
        self.keep_workers = warm and keep_workers
        """Workers that stay: a run's call goes to the last run's workers when they are well."""
        self.runs = 0
        """Runs started (warm agents)."""
        self.fresh_workers = True
        """Whether the last run started its own workers (else the kept ones took its call)."""
        """Warm agents: they stay after each run for the next, until :meth:`close`."""
        self.run_started = 0.0
        self.first_attempt = 0
        """The attempt the current run started with (runs of warm agents go on counting)."""
        self.restarts = 0
        """Restarts the last successful run needed."""
        self.timings_of_run: LaunchTimings | None = None
        """The last successful warm run's timings (its ranks are forgotten after it)."""
        self._interrupt: tuple[object, BaseException] | None = None
        """A run's token and the error raised in it at its next wake-up (:meth:`interrupt`)."""
        self._run_token: object = None
        """The token of the run under way (:meth:`run_call`)."""

    # -- the launch, in order ------------------------------------------------------------

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
        deadline = self._deadline(st.started)
        self._open_health()
        self.sink.emit(
            LaunchStarted(
                tuple(a.slots.hostname for a in st.agents),
                tuple(a.slots.workers for a in st.agents),
                self.launcher.max_restarts,
                None if self.health is None else self.health.url,
            )
        )
        try:
            self._start_agents()
            start_by = st.started + self.launcher.start_timeout
            self._run_until(lambda: st.all_hellos, _earliest(start_by, deadline))
            if not st.all_hellos and not st.failed:
                if deadline is not None and time.monotonic() >= deadline:
                    self._launch_timed_out()
                else:
                    self._start_timed_out()
            if st.failed:
                raise _Failed  # noqa: TRY301 (stopped and reported below, like every failure)
        except BaseException as exc:  # noqa: BLE001 (Ctrl-C included: stop everything first)
            error = self._end_with_failure(exc, final=True)
            raise error from error.__cause__
        st.agents_started_after = time.monotonic() - st.started
        for agent in st.agents:  # each waits for its first spec
            agent.ready = True

    def run_call(self, call: list[memoryview], token: object = None) -> tuple[tuple[Any, ...], ...]:
        """Run one call on fresh workers of the started agents; the results per host.

        A one-shot launch runs one call and its failure stops the agents. Warm agents stay
        after a failure (this run's workers stopped), ready for the next call. ``token``
        names this run for :meth:`interrupt` (``None``: a fresh one).
        """
        st = self.state
        self.call = call
        self._run_token = object() if token is None else token
        self.runs += 1
        self.run_started = time.monotonic()
        self.first_attempt = st.attempt
        deadline = self._deadline(self.run_started if self.warm else st.started)
        kept = False
        try:
            if self.warm:
                kept = self._prepare_run(deadline)
                self.first_attempt = st.attempt
            self.fresh_workers = not kept
            while True:
                if kept:
                    self._send_calls()
                    kept = False
                else:
                    self._send_specs()
                self._run_until(lambda: st.finished, deadline)
                if not st.finished and not st.failed and not st.alarm:
                    self._launch_timed_out()
                if st.finished and not st.failed:
                    break
                self._restart_or_raise(deadline)
            st.finished_after = time.monotonic() - (self.run_started if self.warm else st.started)
            results = self._collect()
        except BaseException as exc:  # noqa: BLE001 (Ctrl-C included: stop everything first)
            error = self._end_with_failure(exc, final=not self.warm)
            if self.warm:
                self._next_run()
            raise error from error.__cause__
        st.phase = Phase.SUCCEEDED
        self._emit_finished(None)
        self.restarts = st.attempt - self.first_attempt
        if self.warm:
            self.timings_of_run = self.timings()
            self._next_run()
        return results

    def _deadline(self, start: float) -> float | None:
        limit = self.launcher.launch_timeout
        return None if limit is None else start + limit

    def _end_with_failure(self, exc: BaseException, *, final: bool) -> BaseException:
        """Record what ended the run, stop the workers (bounded), and build the error.

        ``final``: stop the agents too (warm agents stay for the next run otherwise).
        """
        st = self.state
        if not isinstance(exc, _Failed):
            # Ctrl-C, SIGTERM, or a failure of the launcher itself: it comes first, even in the
            # middle of a restart (see torchrunx.launcher.failures).
            self.inbox.fault("launch", exc, time.time())
        st.phase = Phase.STOPPING
        st.degraded = True
        try:
            if not final:
                self._stop(restart=True, dump=True)
            elif not self._all_over():
                self._stop(restart=False)
        except (KeyboardInterrupt, SystemExit) as again:  # a second Ctrl-C: stop waiting
            self.inbox.fault("launch", again, time.time())
        cause = choose_cause(st.faults)
        error = self._report(cause)
        st.phase = Phase.FAILED
        self._emit_finished(error)
        return error

    # -- warm agents: between runs ------------------------------------------------------------

    def _prepare_run(self, deadline: float | None) -> bool:
        """Before a warm run: what the time since the last run changed.

        Returns ``True`` when the last run's workers stay and take this call (nothing failed
        since). Else their workers are gone or stopped now; agents still stopping are waited
        for (bounded), and those that ended are replaced (``restart_on`` with ``"hosts"``)
        or named in the :class:`AgentFailedError` raised.
        """
        st = self.state
        since_last = st.faults  # workers and agents lost or dead while idle: no run's failure
        if st.kept_workers:
            if not since_last and st.kept_workers_well():
                st.next_call()
                return True
            why = "; ".join(dict.fromkeys(summary(f.error) for f in since_last))
            logger.warning(
                "the workers kept since the last run are not all well%s: this run starts new "
                "workers, and what earlier runs loaded in them is gone",
                f" ({why})" if why else "",
            )
            self._stop(restart=True, dump=False)
            st.next_attempt(keep_ready=True)
        st.faults = []
        st.stopping = True  # an agent's end now is this preparation's, not the run's
        try:
            self._run_until(
                lambda: all(a.ready or a.over or a.conn is None for a in st.agents),
                _earliest(time.monotonic() + _STOP_WAIT, deadline),
            )
        finally:
            st.stopping = False
        gone = st.unready_agents()
        if not gone:
            return False
        names = [a.slots.hostname for a in gone]
        if "hosts" not in self.launcher.restart_on:
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
        logger.warning("starting new agents on %s before this run", names)
        self._replace_agents(deadline)
        unready = [a.slots.hostname for a in st.unready_agents()]
        if unready:
            self.extra_failures.append(f"new agents were started, but those of {unready} did not")
            raise _Failed
        st.next_attempt()
        return False

    def _next_run(self) -> None:
        """After a warm run: forget its ranks and failures; the agents stay.

        Workers that stay after a successful run keep their ranks for the next call.
        """
        st = self.state
        st.history = []
        self.extra_failures = []
        st.degraded = False
        st.phase = Phase.IDLE
        if self.keep_workers and st.finished and not st.failed:
            st.keep_workers_for_next_call()
            return
        st.next_attempt(keep_ready=True)  # waiting for a spec (the next run checks)
        st.between_runs = True

    def idle(self, stop: Callable[[], bool]) -> None:
        """Between warm runs: heartbeats, and noting agents that end or fall silent.

        Until ``stop()``. What happens to an agent meanwhile (its end, a cut connection, its
        silence for ``agent_timeout``) is recorded as a fault of no run: the next run reads
        it (:meth:`_prepare_run`), and raises or replaces the agent at once.
        """
        st = self.state
        while not stop():
            now = time.monotonic()
            if now >= self._next_tick:
                self._tick(now)
                self._next_tick = now + _TICK
            wake = _earliest(self._next_tick, st.next_due(), self.listener.next_deadline)
            self.loop.run_once(max(0.0, (wake or now) - now))
            self._apply_queue()

    def _restart_or_raise(self, deadline: float | None) -> None:
        """After a failure: stop the workers, find the cause, then restart or raise it."""
        st = self.state
        restarts = st.attempt - self.first_attempt
        may_restart = restarts < self.launcher.max_restarts and self._provisionally_restartable()
        # Warm agents stay either way: only this run's workers are stopped.
        self._stop(restart=may_restart or self.warm, dump=not may_restart)
        cause = choose_cause(st.faults)
        if not (
            may_restart
            and restartable(
                cause,
                self.launcher.restart_on,
                attempt=restarts,
                max_restarts=self.launcher.max_restarts,
            )
        ):
            raise _Failed
        self._restart(cause, deadline)

    # -- agents ---------------------------------------------------------------------------

    def _start_agents(self) -> None:
        self.starts.prepare()
        for agent in self.state.agents:
            self.pool.start(agent.index)

    # -- workers --------------------------------------------------------------------------

    def _send_specs(self) -> None:
        st = self.state
        for agent in st.agents:  # a spec to an agent that ended would wait for nothing
            if agent.over or agent.conn is None:
                if not st.failed:
                    self.inbox.fault(
                        "agent",
                        AgentFailedError(
                            agent.slots.hostname,
                            f"its agent ended ({agent.state.value}) before the workers started",
                        ),
                        time.time(),
                        host_index=agent.index,
                    )
                raise _Failed
        hellos = [a.hello for a in st.agents]
        world_size = sum(h.slots for h in hellos if h is not None)
        # Decided once for every worker of every host: a group that mixes backends hangs.
        backend = resolve_backend(
            self.launcher.backend, [(h.slots, h.gpus) for h in hellos if h is not None]
        )
        master_addr, master_port = self._master_address()
        st.phase = Phase.STARTING_WORKERS
        offset = 0
        for agent in st.agents:
            assert agent.hello is not None  # noqa: S101 (all hellos are in)
            spec = WorkerSpec(
                host_index=agent.index,
                hostname=agent.slots.hostname,
                num_workers=agent.hello.slots,
                rank_offset=offset,
                world_size=world_size,
                master_addr=master_addr,
                master_port=master_port,
                backend=backend,
                timeout=self.launcher.timeout,
                isolate_gpus=self.launcher.isolate_gpus,
                log_level=self.logs.level,
                attempt=st.attempt,
                max_restarts=self.launcher.max_restarts,
                restarts=st.attempt - self.first_attempt,
                keep=self.keep_workers,
            )
            st.assign(agent, spec)
            if st.attempt == 0:
                self.logs.add_workers(agent.index, spec.num_workers)
            offset += spec.num_workers
            self.inbox.peer_of(agent).send(spec, self.call)

    def _send_calls(self) -> None:
        """Workers that stay: send this run's call to each of them, on its own connection."""
        st = self.state
        st.phase = Phase.RUNNING
        message = WorkerCall(run=self.runs)
        for rank in st.ranks:
            assert rank.conn is not None  # noqa: S101 (checked by kept_workers_well)
            self.inbox.peers[rank.conn].send(message, self.call)

    def _master_address(self) -> tuple[str, int]:
        """Rank 0 runs on host 0: its address as the other hosts can reach it, and its port."""
        agents = self.state.agents
        first = agents[0]
        if first.remote:
            address = self.inbox.peer_of(first).peer_address
        elif any(a.remote for a in agents):
            # Host 0 is this machine: use the address the remote agents reached us on.
            address = self.inbox.peer_of(next(a for a in agents if a.remote)).local_address
        else:
            address = "127.0.0.1"
        return address, first.free_port

    def _collect(self) -> tuple[tuple[Any, ...], ...]:
        per_host: list[list[Any]] = [[] for _ in self.state.agents]
        for rank in self.state.ranks:
            assert rank.result is not None  # noqa: S101 (checked by finished)
            try:
                value = serialization.loads(rank.result)
            except Exception as exc:
                raise SerializationError(
                    f"cannot unpickle the return value of rank {rank.rank} in the launcher: "
                    f"{exc}; is every module it needs importable here?"
                ) from exc
            rank.result = None
            per_host[rank.host_index].append(value)
        return tuple(tuple(values) for values in per_host)

    # -- the loop -------------------------------------------------------------------------

    def interrupt(self, error: BaseException, token: object) -> None:
        """From any thread: make run ``token`` stop as a Ctrl-C would, raising ``error``.

        If that run is under way (or about to start: ``token`` given to :meth:`run_call`),
        the launch's thread raises ``error`` at its next wake-up (at once: the loop is woken),
        whether it waits for its workers, for agents still stopping or for new agents; then
        it stops the run's workers and raises ``error`` with its notes. A request for
        another run, or one that came after its run ended, does nothing.
        """
        self._interrupt = (token, error)
        self.loop.post(lambda: None)

    def _run_until(
        self, done: Callable[[], bool], deadline: float | None, *, interruptible: bool = True
    ) -> None:
        """Run the loop until ``done()``, a failure (unless stopping), or ``deadline``.

        Raises:
            BaseException: The error of an :meth:`interrupt` of this run (if
                ``interruptible``: not while stopping workers).
        """
        st = self.state
        while not done():
            if interruptible and self._interrupt is not None:
                token, error = self._interrupt
                if token is self._run_token:
                    self._interrupt = None
                    raise error
            if not st.stopping and (st.failed or st.alarm):
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            if now >= self._next_tick:
                self._tick(now)
                self._next_tick = now + _TICK
                continue
            wake = _earliest(self._next_tick, deadline, st.next_due(), self.listener.next_deadline)
            self.loop.run_once(max(0.0, (wake or now) - now))
            self._apply_queue()

    def _tick(self, now: float) -> None:
        st = self.state
        for agent in st.agents:
            if agent.conn is not None and not agent.over:
                self.inbox.peer_of(agent).send(Heartbeat())
        for agent, silent in st.silent_agents(now):
            self.inbox.agent_silent(agent, silent)
        self.listener.tick(now)
        self.pool.poll()
        agents, ranks = st.due(now)
        for agent in agents:
            self.inbox.judge_agent(agent)
        for rank in ranks:
            self.inbox.settle(rank)

    def _apply_queue(self) -> None:
        while self.queue:
            self.inbox.apply(self.queue.popleft())

    # -- stopping, restarting, failing ------------------------------------------------------

    def _provisionally_restartable(self) -> bool:
        st = self.state
        if not st.faults:  # only an abnormal exit so far: a death, if nothing else shows up
            return "deaths" in self.launcher.restart_on
        cause = choose_cause(st.faults)
        return restarts_for(
            cause.error, set(self.launcher.restart_on), from_worker=cause.rank is not None
        )

    def _all_over(self) -> bool:
        return all(a.over or a.conn is None for a in self.state.agents)

    def _stop(self, *, restart: bool, dump: bool | None = None) -> None:
        """Tell the agents to stop their workers; wait (bounded) until every end is known."""
        st = self.state
        st.stopping = True
        st.phase = Phase.RESTARTING if restart else Phase.STOPPING
        first = choose_cause(st.faults) if st.faults else None
        error = None if first is None else first.error
        if isinstance(error, SystemExit) and error.code == 128 + signal.SIGTERM:
            reason = "the launcher received SIGTERM"
        elif error is None:
            reason = "a worker exited abnormally"
        else:
            reason = (exception_text(error).splitlines() or [type(error).__name__])[0]
        # Stacks tell where the survivors were stuck; after a Ctrl-C the user knows why.
        if dump is None:
            dump = not restart
        dump = dump and not isinstance(error, KeyboardInterrupt | SystemExit | CancelledError)
        stop = Stop(reason, STOP_GRACE, dump_stacks=dump, restart=restart, attempt=st.attempt)
        if not restart:
            self.inbox.final_stop = stop  # also for an agent whose start completes meanwhile
        for agent in st.agents:
            if agent.conn is not None and not agent.over and not (restart and agent.ready):
                self.inbox.peer_of(agent).send(stop)
        done = (lambda: st.stopped and st.ranks_known) if restart else self._ends_known
        self._run_until(done, time.monotonic() + _STOP_WAIT, interruptible=False)
        self._apply_queue()
        for rank in st.ranks:  # what is still unsettled is judged on what arrived
            if rank.exited is not None:
                self.inbox.settle(rank)
            self.inbox.emit(st.move_rank(rank, WorkerState.STOPPED))

    def _ends_known(self) -> bool:
        return self._all_over() and self.state.ranks_known

    def _restart(self, cause: Fault, deadline: float | None) -> None:
        """Restart the worker group on the agents, replacing lost ones if asked to."""
        st = self.state
        reason = summary(cause.error)
        restarts = st.attempt - self.first_attempt
        st.history.append(f"attempt {restarts}: {reason}")
        st.phase = Phase.RESTARTING
        self.sink.emit(Restarting(restarts + 1, self.launcher.max_restarts, reason))
        logger.warning(
            "restarting the workers (restart %d of %d) after: %s",
            restarts + 1,
            self.launcher.max_restarts,
            reason,
        )
        for rank in st.ranks:
            self.inbox.forget_rank(rank)  # an old worker's connection: nothing more is read
        if "hosts" in self.launcher.restart_on:
            self._replace_agents(deadline)
        unready = [a.slots.hostname for a in st.unready_agents()]
        if unready:
            st.history.pop()  # this failure is the one raised, not an earlier one
            self.extra_failures.append(
                f"a restart was attempted, but the agents of {unready} did not get ready"
            )
            raise _Failed
        st.next_attempt()

    def _replace_agents(self, deadline: float | None) -> None:
        """Start a new agent for every host whose agent died or was lost (new SSH or srun)."""
        st = self.state
        replaced = [a.index for a in st.unready_agents()]
        for index in replaced:
            old = st.agents[index]
            logger.warning("starting a new agent on %s", old.slots.hostname)
            if old.conn is not None:
                self.inbox.drop(old.conn)
            st.agents[index] = AgentRecord(index, old.slots, old.method)
            self.pool.replace(index, lost=old.state is AgentState.LOST)
        stopping, st.stopping = st.stopping, True  # their failures now are the restart's
        self._run_until(
            lambda: all(st.agents[i].hello is not None or st.agents[i].over for i in replaced),
            _earliest(time.monotonic() + self.launcher.start_timeout, deadline),
        )
        st.stopping = stopping
        for index in replaced:
            st.agents[index].ready = st.agents[index].hello is not None

    def _start_timed_out(self) -> None:
        missing = next(a for a in self.state.agents if a.hello is None)
        address = self.starts.configured_address()
        self.inbox.fault(
            "agent",
            AgentFailedError(
                missing.slots.hostname,
                "the agent did not connect back within "
                f"start_timeout={self.launcher.start_timeout:g} s; "
                f"can that host reach this machine on port {self.port}"
                + (f" at {address}" if address else "")
                + "? Set launcher_address / TORCHRUNX_LAUNCHER_ADDR to an address it can reach",
                self.inbox.stderr_tail(missing.index),
            ),
            time.time(),
            host_index=missing.index,
        )

    def _launch_timed_out(self) -> None:
        st = self.state
        now = time.monotonic()
        limit = self.launcher.launch_timeout
        running = [r.rank for r in st.ranks if r.result is None]
        self.inbox.fault(
            "launch",
            LaunchTimeoutError(
                f"launch_timeout={limit:g} s was hit: the launch was stopped after "
                f"{now - st.started:.1f} s with ranks {running or 'not yet started'} still "
                "running (their stacks are below, if they could be read)"
            ),
            time.time(),
        )

    def _report(self, cause: Fault) -> BaseException:
        st = self.state
        error = cause.error
        if cause.rank is not None and cause.rank < len(st.ranks):
            rank = st.ranks[cause.rank]
            note = output_tail_note(
                self.logs.tail(rank.host_index, rank.local_rank),
                self.logs.log_file(rank.host_index, rank.local_rank),
            )
            if note is not None:
                add_note(error, note)
        finish_report(
            error,
            others=[*others(st.faults, cause), *self.extra_failures],
            history=st.history,
            max_restarts=self.launcher.max_restarts,
        )
        if st.stacks:
            where = {r.rank: (r.local_rank, st.hostname(r)) for r in st.ranks}
            add_note(error, stacks_note(st.stacks, where))
        return error

    def _emit_finished(self, error: BaseException | None) -> None:
        self.sink.emit(
            LaunchFinished(
                succeeded=error is None,
                attempts=self.state.attempt - self.first_attempt + 1,
                duration=time.monotonic() - self.state.started,
                error=None if error is None else summary(error),
            )
        )

    # -- health and timings -----------------------------------------------------------------

    def _open_health(self) -> None:
        port = health_port_from_env(self.launcher.health_check_port)
        if port is not None:  # an OSError (port in use) ends the launch; close() cleans up
            self.health = HealthServer(
                port,
                self.health_report,
                host=health_host_from_env(),
                details=health_details_from_env(),
            )
            self.health.start()
            logger.info("health endpoint: %s", self.health.url)

    def health_report(self) -> HealthReport:
        """Called from the health server's threads: reads the state, changes nothing."""
        st = self.state
        faults = list(st.faults)
        cause = summary(choose_cause(faults).error) if faults else None
        return st.health(time.monotonic(), max_restarts=self.launcher.max_restarts, cause=cause)

    def timings(self) -> LaunchTimings:
        """Phase durations of the attempt that succeeded."""
        processes = self.pool.processes
        connect = tuple(
            float(getattr(processes.get(a.index), "connect_seconds", 0.0))
            for a in self.state.agents
        )
        return self.state.timings(connect)

    # -- the end ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """End warm agents that wait between runs: a final Stop, then their AgentDone (bounded)."""
        st = self.state
        stop = Stop("the warm agents were closed", STOP_GRACE, restart=False, attempt=st.attempt)
        self.inbox.final_stop = stop
        st.stopping = True
        for agent in st.agents:
            if agent.conn is not None and not agent.over:
                self.inbox.peer_of(agent).send(stop)
        self._run_until(self._all_over, time.monotonic() + _STOP_WAIT, interruptible=False)
        self._apply_queue()

    def close(self) -> None:
        """Release everything: agents, connections, the port, the loop, and helper threads."""
        self.listener.stop_accepting()
        for agent in self.state.agents:
            if agent.state is AgentState.DONE:  # it reads until this end closes, then exits
                self.inbox.drop(agent.conn)
        lost = {a.index for a in self.state.agents if a.state is AgentState.LOST}
        self.pool.close(lost)
        self.listener.close()
        self.loop.close()
        if self.health is not None:
            self.health.close()
        self.sink.close()
        self.logs.close()


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


@contextlib.contextmanager
def sigterm_raises_system_exit() -> Iterator[None]:
    """During a launch, SIGTERM stops everything cleanly, then exits with status 143.

    Only where SIGTERM still has its default action (which would kill the launcher before it
    could stop its agents) and only in the main thread; the handler is restored afterwards.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def on_sigterm(signum: int, frame: object) -> None:
        del signum, frame
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
