"""What arrives during a launch, applied to the launch state.

Frames from agents and, forwarded by them, from workers (each worker's as if on a connection
of its own: a :class:`~torchrunx.launcher.net.channels.WorkerChannel`), closed connections, agents'
starts and ends, silences: each is applied to :class:`~torchrunx.launcher.state.state.LaunchState`,
by the part it concerns (an agent: its ``agent_table``; a worker or a fault: its ``current``
attempt), and what follows from it is done here (an event to the sinks, a fault recorded, a
connection dropped, log lines routed). Nothing here decides what the launch does next;
:mod:`torchrunx.launcher.launch.orchestrator` reads the state for that.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from torchrunx.engines.command import agent_exit_error
from torchrunx.errors import AgentFailedError, is_collective_error
from torchrunx.events import HostQuarantined
from torchrunx.launcher.net.channels import WorkerChannel
from torchrunx.launcher.net.listener import FrameReceived, Peer, PeerClosed
from torchrunx.launcher.settings.reach import python_for
from torchrunx.launcher.starts.agent_pool import AgentStarted, AgentStartFailed
from torchrunx.launcher.state.records import STOP_GRACE, Phase
from torchrunx.launcher.state.reports import (
    rebuild_exception,
    summary,
    watchdog_error,
    worker_where,
)
from torchrunx.wire.messages import (
    AgentDone,
    AgentHello,
    DebugOutput,
    DebugpyListening,
    DirectOutcome,
    FromWorker,
    Heartbeat,
    LogLines,
    PreemptionNotice,
    Stop,
    ToWorker,
    WorkerChannelClosed,
    WorkerException,
    WorkerExited,
    WorkerHello,
    WorkerResult,
    WorkersEnded,
    WorkersStarted,
    WorkerStacks,
    WorkerTimedOut,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.events import Event, EventSink
    from torchrunx.launcher.net.listener import Listener, NetEvent
    from torchrunx.launcher.settings.plan import LaunchPlan, Timeouts
    from torchrunx.launcher.starts.agent_pool import AgentPool, PoolEvent
    from torchrunx.launcher.state.agent_table import AgentTable
    from torchrunx.launcher.state.records import AgentRecord, FaultKind, RankRecord
    from torchrunx.launcher.state.state import LaunchState
    from torchrunx.launcher.view.debugger import Debugger
    from torchrunx.launcher.view.logrouter import LogRouter
    from torchrunx.wire.messages import Message

logger = logging.getLogger("torchrunx.launcher")


class Inbox:
    """Applies every event of the launch's queue to its state; owned by the launch's thread."""

    def __init__(  # noqa: PLR0913 (every part a message may touch)
        self,
        plan: LaunchPlan,
        state: LaunchState,
        *,
        listener: Listener,
        pool: AgentPool,
        logs: LogRouter,
        sink: EventSink,
    ) -> None:
        """Bind the parts a message may touch; no connection is known yet."""
        self.plan = plan
        self.state = state
        self.listener = listener
        self.pool = pool
        self.logs = logs
        self.sink = sink
        self.owners: dict[int, tuple[str, int]] = {}
        """Connection ident -> ("agent", host index) or ("rank", rank)."""
        self.peers: dict[int, Peer | WorkerChannel] = {}
        """Connection ident -> an agent's connection, or a worker's channel."""
        self.channels: dict[tuple[int, int], WorkerChannel] = {}
        """(Agent connection's ident, local rank) -> that worker's open channel."""
        self.final_stop: Stop | None = None
        """The launch's last Stop, also sent to an agent that says hello after it."""
        self.on_shown: Callable[[AgentRecord, dict[int, str]], None] | None = None
        """Where an agent's answer to ShowStacks goes (the launch's look, see ``where``)."""
        self.debugger: Debugger | None = None
        """Where a worker's debugger output goes (``breakpoint()``), once the launch has one."""
        self.on_preempt: Callable[[str], None] | None = None
        """An agent received SIGTERM: preempt the launch (:meth:`LaunchLoop.preempt`)."""
        self.on_debugpy: Callable[[int, int], None] | None = None
        """A rank's debugpy listens on its host's port: make it reachable (TORCHRUNX_DEBUGPY)."""

    # -- what the orchestrator asks for -------------------------------------------------------

    def apply(self, event: NetEvent | PoolEvent) -> None:
        """One event from the listener or the agent pool."""
        if isinstance(event, FrameReceived):
            self._on_frame(event)
        elif isinstance(event, PeerClosed):
            self._on_closed(event.peer)
        elif isinstance(event, AgentStarted):
            pass  # the pool keeps the process; the agent announces itself on its connection
        elif isinstance(event, AgentStartFailed):
            self.agent_failed(self.state.agents[event.host_index], event.error)
        elif self.pool.processes.get(event.host_index) is event.process:  # not replaced
            agent = self.state.agents[event.host_index]
            if self.state.agent_table.agent_exited(agent, event.status, time.monotonic()):
                self.judge_agent(agent)

    def emit(self, events: list[Event]) -> None:
        """Hand events to the sinks, in order."""
        for event in events:
            self.sink.emit(event)

    def fault(
        self,
        kind: FaultKind,
        error: BaseException,
        at: float,
        *,
        rank: RankRecord | None = None,
        host_index: int | None = None,
    ) -> None:
        """Record a failure (``at`` is wall-clock time where it happened)."""
        self.emit(self.state.current.add_fault(kind, error, at, rank=rank, host_index=host_index))

    def peer_of(self, agent: AgentRecord) -> Peer:
        """The connection of an agent that said hello."""
        assert agent.conn is not None  # noqa: S101 (it said hello)
        peer = self.peers[agent.conn]
        assert not isinstance(peer, WorkerChannel)  # noqa: S101 (an agent's: its connection)
        return peer

    def drop(self, conn: int | None) -> None:
        """Close a connection or a worker's channel; nothing more is read from it."""
        peer = None if conn is None else self.peers.get(conn)
        if isinstance(peer, WorkerChannel):
            if not peer.closed:
                peer.close()  # the agent ends the worker's channel
                self.channels.pop((peer.agent.ident, peer.local_rank), None)
                self.listener.emit(PeerClosed(peer))  # its end, in turn, as for a connection
        elif peer is not None:
            self.listener.drop(peer)

    def forget_rank(self, rank: RankRecord) -> None:
        """Drop a rank's channel (and connection) before a restart: its late frames are old."""
        for conn in (rank.conn, rank.direct):
            self.drop(conn)
            self.owners.pop(conn if conn is not None else -1, None)

    def agent_failed(
        self, agent: AgentRecord, error: BaseException | None, *, lost: bool = False
    ) -> None:
        """An agent failed (``lost``: fell silent); ``error`` is its fault (None: no fault).

        A spare's failure leaves one spare fewer. With spares or ``min_hosts``, a host of the
        world that fails while the launch runs is quarantined at once.
        """
        role = agent.role
        self.emit(self.state.current.agent_failed(agent, error, time.time(), lost=lost))
        if role == "spare":
            logger.warning(
                "spare host %s is not available: %s",
                agent.slots.hostname,
                "its agent failed" if error is None else summary(error),
            )
        elif (
            error is not None
            and self.plan.quarantines
            and self.state.phase is not Phase.STARTING_AGENTS
        ):
            self.quarantine(agent)

    def quarantine(self, agent: AgentRecord) -> None:
        """A host of the world failed: it takes no further part in the launch.

        An agent still alive (it did not get ready in time) is told to stop for good.
        """
        if agent.role != "host":
            return
        if not agent.over:
            if agent.conn is not None:
                stop = Stop(
                    "its host was quarantined",
                    STOP_GRACE,
                    dump_stacks=False,  # nobody waits for them
                    restart=False,
                    attempt=self.state.attempt,
                )
                self.peer_of(agent).send(stop)
            self.emit(self.state.current.agent_failed(agent, None, time.time()))
        line = self.state.agent_table.quarantine(agent)
        logger.warning("%s", line)
        self.sink.emit(HostQuarantined(agent.index, agent.slots.hostname, agent.state.value))

    def agent_silent(self, agent: AgentRecord, silent: float, **why: str | None) -> None:
        """No heartbeat from an agent for too long: it is lost (``why``: :func:`silence_error`)."""
        error = silence_error(agent.slots.hostname, silent, self.plan.timeouts, **why)
        self.agent_failed(agent, error, lost=True)

    def judge_agent(self, agent: AgentRecord) -> None:
        """An agent's process ended: fine after AgentDone, else it failed."""
        if agent.over:
            self.state.agent_table.agent_judged(agent)
            return
        lost = _lost_in_tree(self.pool.processes.get(agent.index), agent.slots.hostname)
        if lost is not None or self.state.progress.stopping:
            self.agent_failed(agent, lost)
            return
        error = agent_exit_error(
            agent.slots.hostname,
            agent.exit_status,
            remote=agent.remote,
            connected=agent.hello is not None,
            env_file=None if self.plan.reach.env_file is None else str(self.plan.reach.env_file),
            stderr_tail=self.stderr_tail(agent.index),
            python=python_for(self.plan.reach.python, agent.slots.hostname, agent.method),
        )
        self.agent_failed(agent, error)

    def settle(self, rank: RankRecord) -> None:
        """A rank exited and its outcome had its chance to arrive: judge it."""
        self.emit(self.state.current.settle(rank))

    def stderr_tail(self, index: int) -> str:
        """The last lines an agent process wrote to its stderr."""
        process = self.pool.processes.get(index)
        return process.stderr_tail() if process is not None else ""

    # -- frames ----------------------------------------------------------------------------

    def _on_frame(self, event: FrameReceived) -> None:
        peer, message = event.peer, event.message
        owner = self.owners.get(peer.ident)
        if owner is None:
            self._on_first_frame(peer, message)
        elif owner[0] == "agent":
            agent = self.state.agents[owner[1]]
            if isinstance(message, FromWorker | WorkerChannelClosed):
                self.state.agent_table.heard_from(agent, time.monotonic())
                self._on_channel(peer, agent, message, event.payload, event.at)
            else:
                self._on_agent_message(agent, message)
        else:
            self._on_direct(peer, owner[1], message, event.payload, event.at)

    def _on_first_frame(self, peer: Peer, message: Message) -> None:
        st = self.state
        if peer.role == "agent" and isinstance(message, AgentHello):
            index = message.host_index
            if not 0 <= index < len(st.agents) or st.agents[index].conn is not None:
                peer.close()
                return
            agent = st.agents[index]
            self.owners[peer.ident], self.peers[peer.ident] = ("agent", index), peer
            self.emit(st.agent_table.agent_hello(agent, peer.ident, message, time.monotonic()))
            if self.final_stop is not None:  # it started while the launch was stopping
                peer.send(self.final_stop)
            if message.slots == 0:  # only workers_per_host="gpu" counts 0
                error = AgentFailedError(
                    agent.slots.hostname,
                    "workers_per_host='gpu' but this host has no GPU (its agent looked at "
                    "CUDA_VISIBLE_DEVICES, the NVIDIA driver and nvidia-smi); give a number "
                    "of workers, or 'auto' (GPUs, else CPU cores)",
                )
                self.agent_failed(agent, error)
            return
        if peer.role == "worker" and isinstance(message, WorkerHello):  # a large outcome comes
            rank = st.current.direct_rank(message)
            if rank is None:
                peer.close()  # of an earlier attempt (late), a second one, or no such worker
                return
            rank.direct, rank.outcome_elsewhere = peer.ident, True
            self.owners[peer.ident], self.peers[peer.ident] = ("direct", rank.rank), peer
            return
        peer.close()  # a peer that does not say who it is first, or claims another role

    def _on_direct(
        self, peer: Peer, index: int, message: Message, payload: list[bytearray], at: float
    ) -> None:
        """A frame on a worker's connection of its own: its outcome, once, and nothing else."""
        ranks = self.state.ranks
        rank = ranks[index] if index < len(ranks) else None
        if rank is None or rank.direct != peer.ident:
            self.drop(peer.ident)  # a connection of an earlier attempt's worker
        elif isinstance(message, WorkerResult | WorkerException) and not rank.has_outcome:
            self._on_worker_message(index, message, payload, at)
        else:
            self.drop(peer.ident)  # anything else, or a second outcome: that connection ends

    def _on_channel(
        self,
        peer: Peer,
        agent: AgentRecord,
        message: FromWorker | WorkerChannelClosed,
        payload: list[bytearray],
        at: float,
    ) -> None:
        """What an agent forwards from one of its workers, or the end of that worker's channel.

        A worker's first message is its hello, which opens its channel here; until its
        channel ends, what it sends is taken as a worker's own (:meth:`_on_worker_message`).
        """
        key = (peer.ident, message.local_rank)
        channel = self.channels.get(key)
        if isinstance(message, WorkerChannelClosed):
            if channel is not None:
                del self.channels[key]
                channel.ended()
                self._on_closed(channel)
            return
        inner = message.message
        if channel is not None:
            index = self.owners[channel.ident][1]
            ranks = self.state.ranks
            if index < len(ranks) and ranks[index].conn == channel.ident:  # not an old one's
                self._on_worker_message(index, inner, payload, at)
        elif isinstance(inner, WorkerHello):
            self._on_worker_hello(peer, agent, message.local_rank, inner)
        # else: what a worker sent after the launch closed its channel: nothing to act on

    def _on_worker_hello(
        self, peer: Peer, agent: AgentRecord, local_rank: int, hello: WorkerHello
    ) -> None:
        st = self.state
        rank = st.current.hello_rank(hello)
        if (
            rank is None  # of an earlier attempt (late), or a second one for that rank
            or st.current.rank_of(agent, local_rank) is not rank  # a rank of another host
            or hello.local_rank != local_rank
        ):
            peer.send(ToWorker(hello.pid, None))  # that worker's channel ends: it exits
            return
        channel = WorkerChannel(peer, local_rank, hello.pid)
        self.channels[(peer.ident, local_rank)] = channel
        self.owners[channel.ident], self.peers[channel.ident] = ("rank", rank.rank), channel
        self.emit(st.current.worker_hello(rank, channel.ident, hello.pid))

    def _on_agent_message(self, agent: AgentRecord, message: Message) -> None:
        st = self.state
        st.agent_table.heard_from(agent, time.monotonic(), message)  # a heartbeat: its usage too
        if isinstance(message, LogLines):
            offset = 0 if agent.spec is None else agent.spec.rank_offset  # agent records: none
            self.logs.emit_batch(agent.index, offset, message.records)
        elif isinstance(message, WorkerExited | WorkerTimedOut | WorkerStacks):
            self._on_worker_report(agent, message)
        elif isinstance(message, WorkersStarted):
            self.emit(st.current.workers_forked(agent, message))
        elif isinstance(message, WorkersEnded):
            st.agent_table.workers_ended(agent, message)
        elif isinstance(message, AgentDone):
            st.agent_table.agent_done(agent)
        elif isinstance(message, PreemptionNotice):
            if self.on_preempt is not None and self.plan.resilience.preemption_grace > 0:
                self.on_preempt(message.reason)
        elif not isinstance(message, Heartbeat):  # a worker's message on an agent's connection
            self.drop(agent.conn)

    def _on_worker_report(
        self, agent: AgentRecord, message: WorkerExited | WorkerTimedOut | WorkerStacks
    ) -> None:
        """What an agent says about its workers: an exit, a watchdog, the stacks."""
        st = self.state
        if isinstance(message, WorkerStacks):
            if not message.shown:
                st.current.add_stacks(agent, message.stacks)
            elif self.on_shown is not None:
                self.on_shown(agent, message.stacks)
            return
        rank = st.current.rank_of(agent, message.local_rank)
        if rank is None:
            return
        if isinstance(message, WorkerExited):
            if st.current.worker_exited(rank, message, time.monotonic()):
                self.settle(rank)
        elif st.current.worker_timed_out(rank):
            error = watchdog_error(agent.slots.hostname, rank.rank, message)
            self.emit(st.current.worker_failed(rank, "hang", error, time.time()))

    def _on_worker_message(
        self, index: int, message: Message, payload: list[bytearray], at: float
    ) -> None:
        st = self.state
        rank = st.ranks[index]
        if isinstance(message, WorkerResult) and not rank.has_outcome:
            self.emit(st.current.worker_result(rank, message, payload, at))
        elif isinstance(message, WorkerException) and not rank.has_outcome:
            where = worker_where(
                rank.rank, rank.local_rank, st.agent_table.hostname(rank), rank.pid
            )
            error = rebuild_exception(message, payload, where)
            collective = message.collective or is_collective_error(error)
            kind: FaultKind = "collective" if collective else "exception"
            self.emit(st.current.worker_failed(rank, kind, error, message.at or at))
        elif isinstance(message, DebugOutput) and self.debugger is not None:
            self.debugger.on_output(rank.rank, message)
        elif isinstance(message, DebugpyListening) and self.on_debugpy is not None:
            self.on_debugpy(rank.rank, message.port)
        elif isinstance(message, DirectOutcome):  # its outcome may have come already
            if not rank.has_outcome:
                rank.outcome_elsewhere = rank.direct is None or rank.outcome_elsewhere
        else:
            self.drop(rank.conn)  # agents' messages, or a second outcome: not a worker's

    # -- ends ------------------------------------------------------------------------------

    def _on_rank_closed(self, index: int, ident: int) -> None:
        """A worker's channel ``ident`` ended: its rank settles once its exit is known too."""
        st = self.state
        if self.debugger is not None:
            self.debugger.forget(index)
        if index < len(st.ranks) and st.ranks[index].conn == ident:
            rank = st.ranks[index]
            if st.current.worker_conn_closed(rank):
                self.settle(rank)

    def _on_closed(self, peer: Peer | WorkerChannel) -> None:
        owner = self.owners.get(peer.ident)
        if owner is None:
            return
        st = self.state
        if not isinstance(peer, WorkerChannel):  # an agent's: its workers' channels end with it
            for key in [key for key in self.channels if key[0] == peer.ident]:
                channel = self.channels.pop(key)
                channel.ended()
                self._on_closed(channel)
        if owner[0] == "rank":
            self._on_rank_closed(owner[1], peer.ident)
            return
        if owner[0] == "direct":
            rank = st.ranks[owner[1]] if owner[1] < len(st.ranks) else None
            if rank is not None and rank.direct == peer.ident and st.current.direct_closed(rank):
                self.settle(rank)
            return
        agent = st.agents[owner[1]]
        if agent.conn != peer.ident or not st.agent_table.agent_conn_closed(agent):
            return
        if _exited(self.pool, st.agent_table, agent):  # before its connection ended, maybe
            self.judge_agent(agent)
            return
        if st.progress.stopping:  # a consequence of the stop, not a fault
            self.agent_failed(agent, None)
            return
        error = AgentFailedError(
            agent.slots.hostname,
            "the connection to the agent closed unexpectedly (the agent process died or was "
            "killed)",
            self.stderr_tail(agent.index),
        )
        self.agent_failed(agent, error)


def _exited(pool: AgentPool, table: AgentTable, agent: AgentRecord) -> bool:
    """Whether ``agent``'s process ended, seen now if not yet (its status says more)."""
    if not agent.exited:
        status = pool.exit_status_now(agent.index)
        if status is not None:
            table.agent_exited(agent, status, time.monotonic())
    return agent.exited


def silence_error(
    hostname: str,
    silent: float,
    timeouts: Timeouts,
    *,
    through: str | None = None,
    subtree: str | None = None,
) -> AgentFailedError:
    """An agent silent for ``silent`` seconds, with the limits it answered to.

    ``through``: a tree start's child silenced with its interior host, which carries its
    connection (:meth:`torchrunx.launcher.starts.tree.Tree.silent_through`): said instead of
    the guesses at the cause. ``subtree``: an interior host's children, lost with it
    (:meth:`~torchrunx.launcher.starts.tree.Tree.silent_subtree`): said after them.
    """
    limits = f"agent_timeout={timeouts.agent:g}, start_timeout={timeouts.start:g}"
    cause = through or "the host is unreachable, its link is cut, or the agent is frozen"
    also = f"; {subtree}" if subtree else ""
    return AgentFailedError(
        hostname, f"no heartbeat for {silent:.1f} s ({limits} until workers start); {cause}{also}"
    )


def _lost_in_tree(process: object, hostname: str) -> AgentFailedError | None:
    """The error of a tree start's child whose interior host was lost first, else None.

    Its stand-in (:class:`torchrunx.launcher.starts.tree.TreeChildProcess`) says why in
    ``lost``, naming both hosts; any other agent process has no such attribute.
    """
    lost = getattr(process, "lost", "")
    return AgentFailedError(hostname, lost) if lost else None
