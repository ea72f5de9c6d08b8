"""One launch, as it happens: start, hellos, specs, monitor, restart or not, collect, stop, close.

The parts it drives each own one thing:

- :mod:`torchrunx.ioloop`: the one selector loop for every connection of the launch;
- :mod:`torchrunx.listener`: accepting, authenticating and framing connections;
- :mod:`torchrunx.agent_pool`: starting, replacing and closing agent processes;
- :mod:`torchrunx.agent_starts`: how one host's agent is started, and its bootstrap line;
- :mod:`torchrunx.launch_state`: what every agent and rank is (pure);
- :mod:`torchrunx.failures`: which failure is the cause, and whether to restart (pure);
- :mod:`torchrunx.reports`: the error raised, with its notes (pure).

One thread (the caller's) runs it all, agents' output and ends included; the only other
threads start agents (a pool of at most 32) and, for SSH agents, are paramiko's own.
"""

from __future__ import annotations

import collections
import logging
import signal
import time
from typing import TYPE_CHECKING, Any

from torchrunx import listener as listener_module
from torchrunx import protocol, serialization
from torchrunx.agent_pool import (
    AgentPool,
    AgentStarted,
    AgentStartFailed,
    PoolEvent,
)
from torchrunx.agent_starts import AgentStarts
from torchrunx.devices import resolve_backend
from torchrunx.errors import (
    AgentFailedError,
    LaunchTimeoutError,
    SerializationError,
    add_note,
    exception_text,
    is_collective_error,
)
from torchrunx.events import (
    AgentState,
    Event,
    EventSink,
    LaunchFinished,
    LaunchStarted,
    Restarting,
    WorkerState,
)
from torchrunx.failures import choose_cause, others, restartable, restarts_for
from torchrunx.health import HealthReport, HealthServer, health_port_from_env
from torchrunx.ioloop import IOLoop
from torchrunx.launch_state import (
    AgentRecord,
    Fault,
    FaultKind,
    LaunchState,
    Phase,
    RankRecord,
    StartMethod,
)
from torchrunx.listener import FrameReceived, Listener, NetEvent, Peer, PeerClosed
from torchrunx.logs import LogRouter, events_file
from torchrunx.protocol import (
    HEARTBEAT_INTERVAL,
    AgentDone,
    AgentHello,
    Heartbeat,
    LogLines,
    Stop,
    WorkerException,
    WorkerExited,
    WorkerHello,
    WorkerResult,
    WorkersEnded,
    WorkerSpec,
    WorkersStarted,
    WorkerStacks,
    WorkerTimedOut,
)
from torchrunx.reports import (
    agent_exit_error,
    finish_report,
    output_tail_note,
    rebuild_exception,
    stacks_note,
    summary,
    watchdog_error,
    worker_where,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.agent_pool import Starter
    from torchrunx.hosts import HostSlots
    from torchrunx.launcher import Launcher
    from torchrunx.results import LaunchTimings

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

    def __init__(
        self,
        launcher: Launcher,
        hosts: list[HostSlots],
        methods: list[StartMethod],
        call: list[memoryview],
        *,
        starter: Starter | None = None,
    ) -> None:
        """Open the logs, the listening socket and the loop; nothing is started yet.

        ``starter`` replaces how agents start (the many-hosts benchmark simulates them).
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
        self.secret = protocol.new_secret()
        self.queue: collections.deque[NetEvent | PoolEvent] = collections.deque()
        """The one queue: what the listener read and what the pool saw, in order."""
        loop = None
        try:  # out of descriptors, say: nothing made so far is left open
            self.loop = loop = IOLoop()
            self.listener = Listener(
                self.loop, self.secret, listener_module.listen_socket(), self.queue.append
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
        )
        self.starts = AgentStarts(
            launcher,
            self.state.agents,
            self.port,
            self.secret,
            self.logs.level,
            lambda index, record: self.logs.emit_batch(index, 0, (record,)),
        )
        self.pool = AgentPool(
            self.loop,
            self.queue.append,
            starter or self.starts,
            [h.hostname for h in hosts],
        )
        self.owners: dict[int, tuple[str, int]] = {}
        """Connection ident -> ("agent", host index) or ("rank", rank)."""
        self.peers: dict[int, Peer] = {}
        self.extra_failures: list[str] = []
        self.health: HealthServer | None = None
        self._next_tick = 0.0
        self._final_stop: Stop | None = None

    # -- the launch, in order ------------------------------------------------------------

    def execute(self) -> tuple[tuple[Any, ...], ...]:
        """Run every phase; return the unpickled results per host."""
        st = self.state
        limit = self.launcher.launch_timeout
        deadline = None if limit is None else st.started + limit
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
            st.agents_started_after = time.monotonic() - st.started
            while True:
                self._send_specs()
                self._run_until(lambda: st.finished, deadline)
                if not st.finished and not st.failed and not st.alarm:
                    self._launch_timed_out()
                if st.finished and not st.failed:
                    break
                self._restart_or_raise(deadline)
            st.finished_after = time.monotonic() - st.started
            results = self._collect()
        except BaseException as exc:  # noqa: BLE001 (Ctrl-C included: stop everything first)
            error = self._end_with_failure(exc)
            raise error from error.__cause__
        st.phase = Phase.SUCCEEDED
        self._emit_finished(None)
        return results

    def _end_with_failure(self, exc: BaseException) -> BaseException:
        """Record what ended the launch, stop everything (bounded), and build the error."""
        st = self.state
        if not isinstance(exc, _Failed):
            # Ctrl-C, SIGTERM, or a failure of the launcher itself: it comes first, even in the
            # middle of a restart (see torchrunx.failures).
            self._fault("launch", exc, time.time())
        st.phase = Phase.STOPPING
        st.degraded = True
        try:
            if not self._all_over():
                self._stop(restart=False)
        except (KeyboardInterrupt, SystemExit) as again:  # a second Ctrl-C: stop waiting
            self._fault("launch", again, time.time())
        cause = choose_cause(st.faults)
        error = self._report(cause)
        st.phase = Phase.FAILED
        self._emit_finished(error)
        return error

    def _restart_or_raise(self, deadline: float | None) -> None:
        """After a failure: stop the workers, find the cause, then restart or raise it."""
        st = self.state
        may_restart = st.attempt < self.launcher.max_restarts and self._provisionally_restartable()
        self._stop(restart=may_restart)
        cause = choose_cause(st.faults)
        if not (
            may_restart
            and restartable(
                cause,
                self.launcher.restart_on,
                attempt=st.attempt,
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
            )
            st.assign(agent, spec)
            if st.attempt == 0:
                self.logs.add_workers(agent.index, spec.num_workers)
            offset += spec.num_workers
            self._peer_of(agent).send(spec, self.call)

    def _master_address(self) -> tuple[str, int]:
        """Rank 0 runs on host 0: its address as the other hosts can reach it, and its port."""
        agents = self.state.agents
        first = agents[0]
        if first.remote:
            address = self._peer_of(first).peer_address
        elif any(a.remote for a in agents):
            # Host 0 is this machine: use the address the remote agents reached us on.
            address = self._peer_of(next(a for a in agents if a.remote)).local_address
        else:
            address = "127.0.0.1"
        return address, first.free_port

    def _peer_of(self, agent: AgentRecord) -> Peer:
        assert agent.conn is not None  # noqa: S101 (it said hello)
        return self.peers[agent.conn]

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

    def _run_until(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Run the loop until ``done()``, a failure (unless stopping), or ``deadline``."""
        st = self.state
        while not done():
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
                self.peers[agent.conn].send(Heartbeat())
        for agent, silent in st.silent_agents(now):
            st.move_agent(agent, AgentState.LOST)
            self._fault(
                "lost",
                AgentFailedError(
                    agent.slots.hostname,
                    f"no heartbeat for {silent:.1f} s (agent_timeout="
                    f"{self.launcher.agent_timeout:g}, start_timeout="
                    f"{self.launcher.start_timeout:g} until workers start); the host is "
                    "unreachable, its link is cut, or the agent is frozen",
                ),
                time.time(),
                host_index=agent.index,
            )
        self.listener.tick(now)
        self.pool.poll()
        agents, ranks = st.due(now)
        for agent in agents:
            self._judge_agent(agent)
        for rank in ranks:
            self._settle(rank)

    def _apply_queue(self) -> None:
        while self.queue:
            event = self.queue.popleft()
            if isinstance(event, FrameReceived):
                self._on_frame(event)
            elif isinstance(event, PeerClosed):
                self._on_closed(event.peer)
            elif isinstance(event, AgentStarted):
                pass  # the pool keeps the process; the agent announces itself on its connection
            elif isinstance(event, AgentStartFailed):
                agent = self.state.agents[event.host_index]
                self.state.move_agent(agent, AgentState.FAILED)
                self._fault("agent", event.error, time.time(), host_index=agent.index)
            elif self.pool.processes.get(event.host_index) is event.process:  # not replaced
                self._on_agent_exited(self.state.agents[event.host_index], event.status)

    def _emit(self, events: list[Event]) -> None:
        for event in events:
            self.sink.emit(event)

    def _fault(
        self,
        kind: FaultKind,
        error: BaseException,
        at: float,
        *,
        rank: RankRecord | None = None,
        host_index: int | None = None,
    ) -> None:
        self._emit(self.state.add_fault(kind, error, at, rank=rank, host_index=host_index))

    # -- what arrives ---------------------------------------------------------------------

    def _on_frame(self, event: FrameReceived) -> None:
        peer, message = event.peer, event.message
        owner = self.owners.get(peer.ident)
        if owner is None:
            self._on_first_frame(peer, message)
        elif owner[0] == "agent":
            self._on_agent_message(self.state.agents[owner[1]], message, event.payload)
        else:
            self._on_worker_message(owner[1], message, event.payload, event.at)

    def _on_first_frame(self, peer: Peer, message: protocol.Message) -> None:
        st = self.state
        if peer.role == "agent" and isinstance(message, AgentHello):
            index = message.host_index
            if not 0 <= index < len(st.agents) or st.agents[index].conn is not None:
                peer.close()
                return
            agent = st.agents[index]
            self.owners[peer.ident], self.peers[peer.ident] = ("agent", index), peer
            self._emit(st.agent_hello(agent, peer.ident, message, time.monotonic()))
            if self._final_stop is not None:  # it started while the launch was stopping
                peer.send(self._final_stop)
            if message.slots == 0:  # only workers_per_host="gpu" counts 0
                st.move_agent(agent, AgentState.FAILED)
                self._fault(
                    "agent",
                    AgentFailedError(
                        agent.slots.hostname,
                        "workers_per_host='gpu' but this host has no GPU (its agent looked at "
                        "CUDA_VISIBLE_DEVICES, the NVIDIA driver and nvidia-smi); give a number "
                        "of workers, or 'auto' (GPUs, else CPU cores)",
                    ),
                    time.time(),
                    host_index=index,
                )
            return
        if peer.role == "worker" and isinstance(message, WorkerHello):
            rank = st.hello_rank(message)
            if rank is None:
                peer.close()  # of an earlier attempt (late), or a second one for that rank
                return
            self.owners[peer.ident], self.peers[peer.ident] = ("rank", rank.rank), peer
            self._emit(st.worker_hello(rank, peer.ident, message.pid))
            return
        peer.close()  # a peer that does not say who it is first, or claims another role

    def _on_agent_message(
        self, agent: AgentRecord, message: protocol.Message, payload: list[bytearray]
    ) -> None:
        st = self.state
        agent.last_heard = time.monotonic()
        del payload
        if isinstance(message, LogLines):
            self._on_log_lines(agent, message)
        elif isinstance(message, WorkerExited | WorkerTimedOut | WorkerStacks):
            self._on_worker_report(agent, message)
        elif isinstance(message, WorkersStarted):
            self._emit(st.workers_forked(agent, message))
        elif isinstance(message, WorkersEnded):
            st.workers_ended(agent, message)
        elif isinstance(message, AgentDone):
            st.agent_done(agent)
        elif not isinstance(message, Heartbeat):  # a worker's message on an agent's connection
            self._drop(agent.conn)

    def _on_worker_report(
        self, agent: AgentRecord, message: WorkerExited | WorkerTimedOut | WorkerStacks
    ) -> None:
        """What an agent says about its workers: an exit, a watchdog, the stacks."""
        st = self.state
        if isinstance(message, WorkerStacks):
            if agent.spec is not None:
                for local_rank, text in message.stacks.items():
                    st.stacks[agent.spec.rank_offset + local_rank] = text
            return
        rank = st.rank_of(agent, message.local_rank)
        if rank is None:
            return
        if isinstance(message, WorkerExited):
            if st.worker_exited(rank, message, time.monotonic()):
                self._settle(rank)
        elif st.worker_timed_out(rank, message):
            error = watchdog_error(agent.slots.hostname, rank.rank, message)
            rank.error = error
            self._fault("hang", error, time.time(), rank=rank)

    def _on_log_lines(self, agent: AgentRecord, message: LogLines) -> None:
        offset = 0 if agent.spec is None else agent.spec.rank_offset  # agent records: no spec
        self.logs.emit_batch(agent.index, offset, message.records)

    def _on_worker_message(
        self, index: int, message: protocol.Message, payload: list[bytearray], at: float
    ) -> None:
        st = self.state
        rank = st.ranks[index]
        if isinstance(message, WorkerResult) and not rank.has_outcome:
            self._emit(st.worker_result(rank, message, payload, at))
        elif isinstance(message, WorkerException) and not rank.has_outcome:
            where = worker_where(rank.rank, rank.local_rank, st.hostname(rank), rank.pid)
            error = rebuild_exception(message, payload, where)
            rank.error = error
            collective = message.collective or is_collective_error(error)
            self._fault(
                "collective" if collective else "exception", error, message.at or at, rank=rank
            )
        else:
            self._drop(rank.conn)  # agents' messages, or a second outcome: not a worker's

    def _drop(self, conn: int | None) -> None:
        peer = None if conn is None else self.peers.get(conn)
        if peer is not None:
            self.listener.drop(peer)

    def _on_closed(self, peer: Peer) -> None:
        owner = self.owners.get(peer.ident)
        if owner is None:
            return
        st = self.state
        if owner[0] == "rank":
            if owner[1] < len(st.ranks) and st.ranks[owner[1]].conn == peer.ident:
                rank = st.ranks[owner[1]]
                if st.worker_conn_closed(rank):
                    self._settle(rank)
            return
        agent = st.agents[owner[1]]
        if agent.conn != peer.ident or not st.agent_conn_closed(agent):
            return
        if agent.exited:
            self._judge_agent(agent)
            return
        st.move_agent(agent, AgentState.FAILED)
        if not st.stopping:
            self._fault(
                "agent",
                AgentFailedError(
                    agent.slots.hostname,
                    "the connection to the agent closed unexpectedly (the agent process died "
                    "or was killed)",
                    self._stderr_tail(agent.index),
                ),
                time.time(),
                host_index=agent.index,
            )

    def _on_agent_exited(self, agent: AgentRecord, status: int | None) -> None:
        if self.state.agent_exited(agent, status, time.monotonic()):
            self._judge_agent(agent)

    def _judge_agent(self, agent: AgentRecord) -> None:
        """An agent's process ended: fine after AgentDone, else it failed."""
        st = self.state
        agent.judge_by = None
        if agent.over:
            return
        st.move_agent(agent, AgentState.FAILED)
        if st.stopping:
            return
        env_file = self.launcher.env_file
        error = agent_exit_error(
            agent.slots.hostname,
            agent.exit_status,
            remote=agent.remote,
            connected=agent.hello is not None,
            env_file=None if env_file is None else str(env_file),
            stderr_tail=self._stderr_tail(agent.index),
        )
        self._fault("agent", error, time.time(), host_index=agent.index)

    def _stderr_tail(self, index: int) -> str:
        process = self.pool.processes.get(index)
        return process.stderr_tail() if process is not None else ""

    def _settle(self, rank: RankRecord) -> None:
        """A rank exited and its outcome had its chance to arrive: judge it."""
        self._emit(self.state.settle(rank))

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

    def _stop(self, *, restart: bool) -> None:
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
        dump = not isinstance(error, KeyboardInterrupt | SystemExit) and not restart
        stop = Stop(reason, STOP_GRACE, dump_stacks=dump, restart=restart, attempt=st.attempt)
        if not restart:
            self._final_stop = stop  # also for an agent whose start completes meanwhile
        for agent in st.agents:
            if agent.conn is not None and not agent.over and not (restart and agent.ready):
                self.peers[agent.conn].send(stop)
        done = (lambda: st.stopped and st.ranks_known) if restart else self._ends_known
        self._run_until(done, time.monotonic() + _STOP_WAIT)
        self._apply_queue()
        for rank in st.ranks:  # what is still unsettled is judged on what arrived
            if rank.exited is not None:
                self._settle(rank)
            self._emit(st.move_rank(rank, WorkerState.STOPPED))

    def _ends_known(self) -> bool:
        return self._all_over() and self.state.ranks_known

    def _restart(self, cause: Fault, deadline: float | None) -> None:
        """Restart the worker group on the agents, replacing lost ones if asked to."""
        st = self.state
        reason = summary(cause.error)
        st.history.append(f"attempt {st.attempt}: {reason}")
        st.phase = Phase.RESTARTING
        self.sink.emit(Restarting(st.attempt + 1, self.launcher.max_restarts, reason))
        logger.warning(
            "restarting the workers (restart %d of %d) after: %s",
            st.attempt + 1,
            self.launcher.max_restarts,
            reason,
        )
        for rank in st.ranks:
            self._drop(rank.conn)  # an old worker's connection: nothing more is read
            self.owners.pop(rank.conn if rank.conn is not None else -1, None)
        if "hosts" in self.launcher.restart_on:
            self._replace_agents(deadline)
        unready = [a.slots.hostname for a in st.agents if not a.ready]
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
        replaced = [a.index for a in st.agents if not a.ready]
        for index in replaced:
            old = st.agents[index]
            logger.warning("starting a new agent on %s", old.slots.hostname)
            if old.conn is not None:
                self._drop(old.conn)
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
        self._fault(
            "agent",
            AgentFailedError(
                missing.slots.hostname,
                "the agent did not connect back within "
                f"start_timeout={self.launcher.start_timeout:g} s; "
                f"can that host reach this machine on port {self.port}"
                + (f" at {address}" if address else "")
                + "? Set launcher_address / TORCHRUNX_LAUNCHER_ADDR to an address it can reach",
                self._stderr_tail(missing.index),
            ),
            time.time(),
            host_index=missing.index,
        )

    def _launch_timed_out(self) -> None:
        st = self.state
        now = time.monotonic()
        limit = self.launcher.launch_timeout
        running = [r.rank for r in st.ranks if r.result is None]
        self._fault(
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
                attempts=self.state.attempt + 1,
                duration=time.monotonic() - self.state.started,
                error=None if error is None else summary(error),
            )
        )

    # -- health and timings -----------------------------------------------------------------

    def _open_health(self) -> None:
        port = health_port_from_env(self.launcher.health_check_port)
        if port is not None:  # an OSError (port in use) ends the launch; close() cleans up
            self.health = HealthServer(port, self.health_report)
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

    def close(self) -> None:
        """Release everything: agents, connections, the port, the loop, and helper threads."""
        self.listener.stop_accepting()
        for agent in self.state.agents:
            if agent.state is AgentState.DONE:  # it reads until this end closes, then exits
                self._drop(agent.conn)
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
