"""The parts of one launch and its one loop, which the orchestrator's ``Launch`` decides with.

:class:`LaunchLoop` opens, owns and closes every resource of a launch, and turns the loop: each
step sends heartbeats when due, waits for the next socket event, agent end or deadline, and
applies what arrived to the state (through :mod:`~torchrunx.launcher.launch.inbox`). It decides
nothing: starting, stopping, restarting and collecting are the orchestrator's, which holds one
``LaunchLoop`` (``Launch.session``) and calls it; so do warm agents between runs.

The parts, each the owner of one thing:

- :mod:`~torchrunx.launcher.net.ioloop`: the one selector loop for every connection of the launch;
- :mod:`~torchrunx.launcher.net.listener`: accepting, authenticating and framing connections;
- :mod:`~torchrunx.launcher.starts.agent_pool`: starting, replacing and closing agent processes;
- :mod:`~torchrunx.launcher.starts.agent_starts`: how one host's agent is started, and its
  bootstrap;
- :mod:`~torchrunx.launcher.launch.inbox`: what arrives, applied to the launch state;
- :mod:`~torchrunx.launcher.state.state`: what every agent and rank is (pure);
- the log router, the event sink and the health endpoint.

One thread runs the loop at a time: the caller's during a launch or a warm run, the idle thread
of :mod:`~torchrunx.launcher.warm` between warm runs. The only other threads start agents (a
pool of at most 32), serve ``GET /health`` (reading, never changing, the state), and, for SSH
agents, are paramiko's own.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from torchrunx.errors import StallError
from torchrunx.events import AgentState, EventSink, Preempting, Stalled
from torchrunx.launcher.launch.inbox import Inbox
from torchrunx.launcher.launch.outward import DebugpyForwards, LiveView
from torchrunx.launcher.launch.stalls import ON_DEMAND, StallWatch, stall_note
from torchrunx.launcher.launch.stragglers import Stragglers
from torchrunx.launcher.net.ioloop import IOLoop
from torchrunx.launcher.net.listener import Listener, NetEvent
from torchrunx.launcher.starts.agent_pool import AgentPool, PoolEvent
from torchrunx.launcher.starts.agent_starts import AgentStarts, listen_socket
from torchrunx.launcher.state.failures import choose_cause
from torchrunx.launcher.state.records import AgentRecord, Phase
from torchrunx.launcher.state.reports import summary
from torchrunx.launcher.state.state import LaunchState
from torchrunx.launcher.view.debugger import Debugger
from torchrunx.launcher.view.health_server import HealthServer
from torchrunx.launcher.view.logdirs import events_file
from torchrunx.launcher.view.logrouter import LogRouter
from torchrunx.launcher.view.where import StacksLook, print_look
from torchrunx.wire import handshake
from torchrunx.wire.messages import (
    HEARTBEAT_INTERVAL,
    DebugInput,
    Heartbeat,
    Preempt,
    RankProgress,
    RankTimings,
    ShowStacks,
)

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Collection

    from torchrunx.launcher.launch.stalls import LookReason, StallLook
    from torchrunx.launcher.settings.plan import LaunchPlan
    from torchrunx.launcher.starts.agent_pool import Starter
    from torchrunx.launcher.starts.tree import Tree
    from torchrunx.launcher.state.agent_table import AgentTable
    from torchrunx.launcher.state.hangs import Straggler
    from torchrunx.launcher.state.health import HealthReport
    from torchrunx.launcher.state.results import LaunchTimings
    from torchrunx.wire.messages import RankState

logger = logging.getLogger("torchrunx.launcher")

TICK = HEARTBEAT_INTERVAL / 2
"""Seconds between two rounds of silence checks, agent polls and judgements due."""
VIEW_HEADLINE = "the collectives every rank is in now (the launch goes on):"
NO_VIEW = (
    "no collective view: stall detection is off (Launcher.stall_timeout=None), and with it "
    "the ranks' flight-recorder probe; press s for the Python stacks"
)
BEAT_EVERY = HEARTBEAT_INTERVAL
SILENT_TOGETHER = 2 * HEARTBEAT_INTERVAL
"""Agents whose silence began within this many seconds of each other's fell silent together
(a heartbeat a second each): how a tree's interior host is found the cause of its children's."""
"""Seconds between two heartbeats to each agent: as often as agents send theirs (every tick
would double the launcher's sends, a thousand a round at a thousand hosts, for nothing: an
agent only needs to hear from the launcher within ``agent_timeout``)."""


class LaunchLoop:
    """The parts of one launch and its loop; owned by the thread that runs the loop."""

    def __init__(self, plan: LaunchPlan, *, starter: Starter | None = None) -> None:
        """Open the logs, the events file, the listening socket and the loop; start nothing.

        ``starter`` replaces how agents start (the many-hosts benchmark simulates them). What
        was opened is closed again if a later part fails (an unwritable log folder, no fd left).
        """
        self.plan, watch = plan, plan.observability
        with contextlib.ExitStack() as undo:
            self.logs = LogRouter(
                watch.log_handlers,
                list(plan.hosts.hostnames),
                console_ranks=watch.console_ranks,
                workers_per_host=[host.workers for host in plan.hosts.slots],
                settings=plan.from_env,
            )
            undo.callback(self.logs.close)
            log_dir = self.logs.log_dir
            self.sink = EventSink(watch.event_handlers, log_dir and events_file(log_dir))
            undo.callback(self.sink.close)
            self.secret = handshake.new_secret()  # through the module: tests replace it
            self.queue: collections.deque[NetEvent | PoolEvent] = collections.deque()
            """The one queue: what the listener read and what the pool saw, in order."""
            self.loop = IOLoop()
            undo.callback(self.loop.close)
            sock = listen_socket(plan)
            undo.callback(sock.close)
            self.listener = Listener(self.loop, self.secret, sock, self.queue.append)
            undo.pop_all()  # all open: close() releases them
        self.port = self.listener.port
        agents = [
            AgentRecord(i, h, m, role="host" if i < plan.hosts.world_hosts else "spare")
            for i, (h, m) in enumerate(zip(plan.hosts.slots, plan.hosts.methods, strict=True))
        ]
        self.state = LaunchState(
            agents,
            world=agents[: plan.hosts.world_hosts],
            started=time.monotonic(),
            max_restarts=plan.resilience.max_restarts,
            agent_timeout=plan.timeouts.agent,
            start_timeout=plan.timeouts.start,
            keep_workers=plan.keep_workers,
        )
        self.starts = AgentStarts(
            plan,
            self.state.agents,
            self.port,
            self.secret,
            self.logs.level,
            lambda index, record: self.logs.emit_batch(index, 0, (record,)),
            adopt=self._adopt,
        )
        self.pool = AgentPool(
            self.loop, self.queue.append, starter or self.starts, list(plan.hosts.hostnames)
        )
        self.inbox = Inbox(
            plan, self.state, listener=self.listener, pool=self.pool, logs=self.logs, sink=self.sink
        )
        self.health: HealthServer | None = None
        self.view = LiveView(self)
        self._next_tick = self._next_beat = 0.0
        self._interrupt: tuple[object, BaseException] | None = None
        """A run's token and the error raised in it at its next wake-up (:meth:`interrupt`)."""
        self.run_token: object = None
        """The token of the run under way (set by ``Launch.run_call``; see :meth:`interrupt`)."""
        self._want_stacks = False
        """Set by SIGQUIT (:meth:`ask_stacks`): look at every rank's stacks at the next wake."""
        self._preempt_request: str | None = None
        """Set by SIGTERM or an agent's notice (:meth:`preempt`): the reason."""
        self.preemption: tuple[str, float] | None = None
        """The preemption under way: its reason and its deadline (monotonic)."""
        self.look: StacksLook | None = None
        """The look at every rank's stacks under way, if any."""
        self.inbox.on_shown = self._on_shown
        self.stalls = StallWatch(
            watch.stall_timeout, watch.on_stall, armed=plan.backend is not None
        )
        """Stall detection (``stall_timeout``): its clock, and its look at every rank."""
        self.stragglers = Stragglers(plan, self.state, self.inbox, self.sink)
        """Straggler detection (``straggler_threshold``): its requests, whom it named."""
        self.inbox.on_preempt = self.preempt
        self.debugger = Debugger(
            self.loop,
            self._send_debug,
            lambda rank: self.state.agent_table.hostname(self.state.ranks[rank]),
            stdin_fd=0,  # the process's standard input, whatever sys.stdin is now
            settings=plan.from_env,
        )
        """``breakpoint()`` in the workers: pdb sessions in this terminal."""
        self.inbox.debugger = self.debugger
        self.forwards = DebugpyForwards(self)
        self.inbox.on_debugpy = self.forwards.announce
        """Per rank and host, the port made reachable here (``TORCHRUNX_DEBUGPY``), closed last."""

    def _send_debug(self, rank: int, message: DebugInput) -> None:
        record = self.state.ranks[rank] if rank < len(self.state.ranks) else None
        peer = None if record is None or record.conn is None else self.inbox.peers.get(record.conn)
        if peer is not None:
            peer.send(message)

    # -- the loop -------------------------------------------------------------------------

    def interrupt(self, error: BaseException, token: object) -> None:
        """From any thread: make run ``token`` stop as a Ctrl-C would, raising ``error``.

        If that run is under way (or about to start: ``token`` given to ``Launch.run_call``),
        the launch's thread raises ``error`` at its next wake-up (at once: the loop is woken),
        whether it waits for its workers, for agents still stopping or for new agents; then
        it stops the run's workers and raises ``error`` with its notes. A request for
        another run, or one that came after its run ended, does nothing.
        """
        self._interrupt = (token, error)
        self.loop.post(lambda: None)

    def preempt(self, reason: str) -> None:
        """From SIGTERM's handler or an agent's notice: preempt the launch at the next wake.

        Every agent is told (its workers see :func:`torchrunx.preemption_requested`), and the
        run goes on until every rank returned or ``preemption_grace`` passed (see
        :mod:`torchrunx.launcher.launch.preempt`). Only the first request counts.
        """
        if self._preempt_request is None:
            self._preempt_request = reason
        self.loop.wake()

    def _begin_preemption(self, reason: str) -> None:
        grace = self.plan.resilience.preemption_grace
        self.preemption = (reason, time.monotonic() + grace)
        message = Preempt(time.time() + grace, reason)
        for agent in self.state.world:
            if agent.conn is not None and not agent.over:
                self.inbox.peer_of(agent).send(message)
        logger.warning("%s: every rank has %g s to save and return (preemption)", reason, grace)
        self.sink.emit(Preempting(reason, grace))

    def ask_stacks(self) -> None:
        """From SIGQUIT's handler: print every rank's stacks soon; the launch goes on."""
        self._want_stacks = True
        self.loop.wake()

    def _look(self, now: float, *, for_view: bool = False) -> None:
        """Ask the agents for their workers' stacks, or print (show) the answers once in."""
        if (self._want_stacks or for_view) and self.look is None:
            agents = [a for a in self.state.agents if a.conn is not None and not a.over]
            # The collective view too, if stall detection is on.
            states = self._ask_states(now, "on demand" if self._want_stacks else "view")
            for agent in agents if not states else ():
                self.inbox.peer_of(agent).send(ShowStacks())
            self.look = StacksLook(agents, now, to_terminal=self._want_stacks, to_view=for_view)
        self._want_stacks = False
        if self.look is not None and self.look.due(now):
            look, self.look = self.look, None
            text = look.text(self.state.ranks, self.state.agent_table.hostname)
            if look.to_view:
                self.view.show("stacks", text)
            if look.to_terminal:
                print_look(text)

    def _view_requests(self, now: float) -> None:
        """Serve what ``torchrunx top`` asked for: the stacks, the collective view."""
        stalls = self.stalls

        def can(what: str) -> bool:
            return self.look is None if what == "stacks" else stalls.look is None

        while (what := self.view.take_request(can)) is not None:
            if what == "stacks":
                self._look(now, for_view=True)
            elif not self._ask_states(now, "view"):
                self.view.show_diagnosis(NO_VIEW)

    def _on_shown(self, agent: AgentRecord, stacks: dict[int, str]) -> None:
        if self.look is not None:
            self.look.answer(agent, stacks)
        self.stalls.answer_stacks(agent, stacks)

    def _on_rank(self, rank: int, message: RankProgress | RankState | RankTimings) -> None:
        now = time.monotonic()
        if isinstance(message, RankTimings):
            self.stragglers.watch.answer(rank, message, time.time_ns())
            return
        if isinstance(message, RankProgress):
            self.state.current.collectives_done(rank, message.collectives)
        self.stalls.note(rank, message, now, self.debugger.paused(now))

    def _ask_states(
        self, now: float, why: LookReason, without: Collection[int] = (), wait: float | None = None
    ) -> StallLook | None:
        """Ask the agents (not ``without``'s) for stacks and states; None: off, or one runs."""
        stalls, st = self.stalls, self.state
        if stalls.timeout is None or stalls.look is not None:
            return None
        agents = [a for a in st.agents if a.conn is not None and not a.over]
        agents = [a for a in agents if a.index not in without]
        for agent in agents:
            self.inbox.peer_of(agent).send(ShowStacks(states=True))
        ranks = [r for r in st.ranks if r.host_index not in without and r.conn is not None]
        live = {r.rank for r in ranks if not r.state.is_final}
        return stalls.begin(agents, live, now, self.debugger.paused(now), why, wait)

    def diagnose_now(self, without: Collection[int] = (), wait: float | None = None) -> str | None:
        """For ``launch_timeout``'s error, a lost host's: the collective view of every rank, now.

        None where stall detection is off; waits for the answers (``wait``, else 2 s at most),
        but not for the hosts ``without`` (lost: they cannot answer).
        """
        if not (look := self._ask_states(time.monotonic(), "launch_timeout", without, wait)):
            return None
        while not look.due(time.monotonic()) and self.stalls.look is look:  # not run_until:
            self.step(look.deadline)  # this runs after a failure too
        if self.stalls.look is not look:  # the attempt ended meanwhile
            return None
        st = self.state
        hosts = {r.rank: st.agent_table.hostname(r) for r in st.ranks}
        return "\n".join(self.stalls.finish(st.ranks, hosts).view)

    def _watch_stalls(self, now: float) -> None:
        """Stall detection's turn: look at every rank when stalled, act on what came."""
        st, stalls, paused = self.state, self.stalls, self.debugger.paused(now)
        running = st.phase is Phase.RUNNING and not st.progress.stopping
        stalls.run_state(st.attempt if running else None, now, paused)
        if stalls.due(now, paused):
            self._ask_states(now, "stall")
        look = stalls.look
        if look is not None and look.why != "launch_timeout" and look.due(now):
            hosts = {r.rank: st.agent_table.hostname(r) for r in st.ranks}
            report = stalls.finish(st.ranks, hosts)
            if look.why == "view":
                self.view.show_diagnosis("\n".join([VIEW_HEADLINE, *report.view]))
                return
            if look.why == "on demand":
                found = self.stragglers.watch.view_lines(look.states)
                print_look("\n".join([ON_DEMAND, *report.view, *found]) + "\n")
                return
            report.write(self.logs.log_dir)
            self.view.stall = f"{report.headline}\n{report.text}"
            self.sink.emit(Stalled(report.seconds, report.text, report.values, stalls.action))
            error = StallError(report.seconds, report.text, report.values)
            if stalls.action == "fail":
                self.interrupt(error, self.run_token)
            elif stalls.action == "restart":
                self.inbox.emit(st.current.add_fault("hang", error, time.time()))

    def current_stragglers(self) -> tuple[Straggler, ...]:
        """The stragglers of the newest comparison (any thread may call it; it reads only)."""
        return self.stragglers.watch.current

    def run_until(
        self, done: Callable[[], bool], deadline: float | None, *, interruptible: bool = True
    ) -> None:
        """Run the loop until ``done()``, a failure (unless stopping), or ``deadline``.

        Raises:
            BaseException: The error of an :meth:`interrupt` of this run (if
                ``interruptible``: not while stopping workers).
        """
        st = self.state
        while not done():
            if self._preempt_request is not None and self.preemption is None:
                self._begin_preemption(self._preempt_request)
            if interruptible and self.preemption is not None:
                if time.monotonic() >= self.preemption[1]:
                    return  # the grace is over
                deadline = earliest(deadline, self.preemption[1])
            if interruptible and self._interrupt is not None:
                token, error = self._interrupt
                if token is self.run_token:
                    self._interrupt = None
                    raise error
            if not st.progress.stopping and (st.failed or st.current.alarm):
                return
            now = time.monotonic()
            # Time with a rank in the debugger does not count: the deadline moves by it.
            limit = None if deadline is None else deadline + self.debugger.paused(now)
            if limit is not None and now >= limit:
                return
            self.step(limit)

    def step(self, deadline: float | None = None) -> None:
        """One turn of the loop: the periodic round if due, else wait and apply what comes.

        The wait ends at the next heartbeat round, the next judgement due, the listener's
        next deadline, or ``deadline``, whichever comes first.
        """
        now = time.monotonic()
        self._view_requests(now)
        if self._want_stacks or self.look is not None:
            self._look(now)
        self._watch_stalls(now)
        self.stragglers.turn(now)
        if now >= self._next_tick:
            self._tick(now)
            self._next_tick = now + TICK
            return
        wake = earliest(
            self._next_tick,
            deadline,
            self.state.next_due(),
            self.listener.next_deadline,
            None if self.look is None else self.look.deadline,
            None if self.stalls.look is None else self.stalls.look.deadline,
            self.stalls.next_due(self.debugger.paused(now)),
            self.stragglers.watch.next_due(),
        )
        self.loop.run_once(max(0.0, (wake or now) - now))
        self.apply_queue()

    def _tick(self, now: float) -> None:
        """Heartbeats out; silent agents lost; agents' ends polled; overdue ends judged."""
        st = self.state
        if now >= self._next_beat:
            self._next_beat = now + BEAT_EVERY
            for agent in st.agents:
                if agent.conn is not None and not agent.over:
                    self.inbox.peer_of(agent).send(Heartbeat())
        for agent, seconds, why in silent_causes(st.agent_table, now, self.starts.tree):
            self.inbox.agent_silent(agent, seconds, **why)
        self.listener.tick(now)
        self.pool.poll()
        agents, ranks = st.due(now)
        for agent in agents:
            self.inbox.judge_agent(agent)
        for rank in ranks:
            self.inbox.settle(rank)

    def apply_queue(self) -> None:
        """Apply what the listener and the pool queued, in order."""
        while self.queue:
            event = self.queue.popleft()
            note = stall_note(event, self.inbox)  # a rank's progress or state on a stall
            if note is None:
                self.inbox.apply(event)
            else:
                self._on_rank(*note)

    # -- health and timings -----------------------------------------------------------------

    def open_health(self) -> None:
        """Serve ``GET /health`` if the plan asks for it (an OSError ends the launch).

        And the view socket for ``torchrunx top`` (this user's only), unless ``TORCHRUNX_VIEW=0``.
        """
        self.view.start()
        if (port := self.plan.observability.health_port) is not None:  # close() cleans up
            self.health = HealthServer(
                port,
                self.health_report,
                host=self.plan.from_env.health_host,
                details=self.plan.from_env.health_details,
                token=self.plan.from_env.health_token,
            )
            self.health.start()
            logger.info("health endpoint: %s", self.health.url)

    def health_report(self, *, rows: bool = True) -> HealthReport:
        """Called from the health server's and the view's threads: reads, changes nothing.

        Without ``rows``: no agent or worker entry (the live view's summary at scale).
        """
        faults = list(self.state.faults)
        cause = summary(choose_cause(faults).error) if faults else None
        restarts = self.plan.resilience.max_restarts
        return self.state.health(time.monotonic(), max_restarts=restarts, cause=cause, rows=rows)

    def timings(self) -> LaunchTimings:
        """Phase durations of the attempt that succeeded."""
        processes = self.pool.processes
        connect = tuple(
            float(getattr(processes.get(a.index), "connect_seconds", 0.0)) for a in self.state.world
        )
        return self.state.timings(connect)

    # -- the end ----------------------------------------------------------------------------

    def _adopt(self, sock: socket.socket, addresses: tuple[str, str]) -> None:
        """A relayed connection (from a relay's thread): the listener takes it in the loop."""
        # Closed, not leaked, if the launch ends before its loop takes it.
        self.loop.post(lambda: self.listener.adopt(sock, addresses), on_drop=sock.close)

    def close(self) -> None:
        """Release everything: agents, connections, the port, the loop, and helper threads."""
        self.debugger.close()
        self.forwards.close()
        self.listener.stop_accepting()
        for agent in self.state.agents:
            if agent.state is AgentState.DONE:  # it reads until this end closes, then exits
                self.inbox.drop(agent.conn)
        lost = {a.index for a in self.state.agents if a.state is AgentState.LOST}
        self.pool.close(lost)
        self.starts.close()  # the transports: Ray's actors and placement group, say
        self.listener.close()
        self.loop.close()
        if self.health is not None:
            self.health.close()
        self.view.close()
        self.sink.close()
        self.logs.close()


def catch_up(loop: LaunchLoop) -> None:
    """Apply, without waiting, what has already happened to ``loop``'s launch.

    Agents' processes that ended, what their connections and the listener have ready: a warm
    run's look at its agents, so that one lost just before the call is named as lost since the
    last run.
    """
    loop.pool.poll()
    loop.loop.run_once(0.0)
    loop.apply_queue()


def silent_causes(
    table: AgentTable, now: float, tree: Tree | None
) -> list[tuple[AgentRecord, float, dict[str, str | None]]]:
    """The agents silent too long (:meth:`AgentTable.silent_agents`), each with how long.

    And, in a tree, what the silence means (the ``through`` and ``subtree`` of
    :func:`torchrunx.launcher.launch.inbox.silence_error`). A cut link or a frozen interior
    host silences its subtree at once, but each agent's last heartbeat came at its own time
    (one a second): a child may be due before its interior host. An interior host silent
    within :data:`SILENT_TOGETHER` of its limit, whose child is due, is the cause: it is
    judged first, naming the children lost with it (:meth:`Tree.silent_subtree`), and each
    child due is named through it (:meth:`Tree.silent_through`).
    """
    silent = table.silent_agents(now)
    if tree is None or not silent:
        return [(agent, seconds, {}) for agent, seconds in silent]
    quiet = {
        agent.index: (agent, seconds)
        for agent, seconds in table.silent_agents(now, slack=SILENT_TOGETHER)
    }
    due = {agent.index for agent, _ in silent}
    causes = {
        parent for index in due if (parent := tree.parent_of(index)) is not None and parent in quiet
    }
    ordered = [quiet[i] for i in sorted(causes - due)] + silent
    live = {agent.index for agent in table.agents if not agent.over}
    together = due | causes  # those judged now: the due, and the interior hosts behind them
    return [
        (
            agent,
            seconds,
            {
                "through": tree.silent_through(agent.index, together),
                "subtree": tree.silent_subtree(agent.index, live),
            },
        )
        for agent, seconds in ordered
    ]


def earliest(*times: float | None) -> float | None:
    """The earliest of the times that are known (None if none is)."""
    known = [t for t in times if t is not None]
    return min(known) if known else None
