"""Every agent of a launch, as pure data: what each is, which of them run ranks, and their ends.

:class:`AgentTable` is the agents' part of :class:`~torchrunx.launcher.state.state.LaunchState`: it
holds every :class:`~torchrunx.launcher.state.records.AgentRecord` (the world's hosts, then the
spares), the world (the agents that run ranks, in rank order), and how the world changed. It
applies what the launch reads about an agent (its hello, a message heard, the reply that its
workers ended, its exit, the end of its connection) by
:data:`~torchrunx.launcher.state.records.AGENT_MOVES`, finds the agents silent for too long, and
makes the world's changes between attempts: a new agent on a host, a host quarantined, a spare
in its place, a smaller world. An agent's failure is recorded by the attempt
(:mod:`~torchrunx.launcher.state.attempt`), which moves the agent here.
Nothing here touches a socket, a process or the clock.

An agent's end is judged as a rank's is: its exit can overtake its last message (``AgentDone``)
on its connection, so an exit with the connection still open waits
:data:`~torchrunx.launcher.state.records.OUTCOME_WAIT` seconds for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrunx.events import AgentStarted, AgentState, Event
from torchrunx.launcher.state.records import AGENT_MOVES, OUTCOME_WAIT, AgentRecord, Phase
from torchrunx.wire.messages import Heartbeat

if TYPE_CHECKING:
    from torchrunx.launcher.state.records import Progress, RankRecord
    from torchrunx.launcher.state.spares import Reshape
    from torchrunx.wire.messages import AgentHello, Message, WorkersEnded


class AgentTable:
    """Every agent of one launch, and the world: the agents that run ranks, in rank order."""

    def __init__(
        self,
        agents: list[AgentRecord],
        progress: Progress,
        *,
        world: list[AgentRecord] | None = None,
        agent_timeout: float,
        start_timeout: float,
    ) -> None:
        """Hold ``agents`` (without ``world``, every one runs ranks: no spare)."""
        self.agents = agents
        self.world = list(agents) if world is None else world
        """The agents that run ranks, in rank order (the others are spares, or quarantined)."""
        self.progress = progress
        self.agent_timeout = agent_timeout
        self.start_timeout = start_timeout
        self.world_changes: list[str] = []
        """One line per host quarantined, replaced by a spare, or dropped (the whole launch)."""
        self.agents_started_after = 0.0
        """Seconds from the launch's start until every agent had said hello."""
        self._seen = 0
        """Agents of the world before this index said hello (the start phase only)."""
        self._ended = 0
        """Agents of the world before this index are over or ready (within one attempt)."""
        self._waiting: set[int] = set()
        """Agents whose exit waits for the end of their connection."""

    def move_agent(self, agent: AgentRecord, new: AgentState) -> bool:
        """Move ``agent`` to ``new``; ``False`` (no change) if it already ended.

        Raises:
            ValueError: The move is not one of :data:`AGENT_MOVES` (a bug).
        """
        if agent.state == new or agent.over:
            return False
        if new not in AGENT_MOVES[agent.state]:
            raise ValueError(f"agent {agent.index}: {agent.state.value} -> {new.value}")
        agent.state = new
        if new in (AgentState.FAILED, AgentState.LOST):
            self.progress.degraded = True
        return True

    def hostname(self, rank: RankRecord) -> str:
        """The host name of ``rank``'s agent."""
        return self.agents[rank.host_index].slots.hostname

    # -- what the launch reads about an agent -------------------------------------------------

    def agent_hello(
        self, agent: AgentRecord, conn: int, hello: AgentHello, now: float
    ) -> list[Event]:
        """An agent connected back and said what its host offers.

        A spare that does so after the start waits for a spec at once.
        """
        agent.conn, agent.hello, agent.last_heard = conn, hello, now
        agent.free_port = hello.free_port
        agent.started_after = now - self.progress.started
        self.move_agent(agent, AgentState.RUNNING)
        if agent.role == "spare" and self.progress.phase is not Phase.STARTING_AGENTS:
            agent.ready = True
        return [
            AgentStarted(
                agent.index,
                agent.slots.hostname,
                hello.pid,
                hello.slots,
                agent.started_after,
                gpus=hello.gpus,
            )
        ]

    def heard_from(self, agent: AgentRecord, now: float, message: Message | None = None) -> None:
        """A message came from ``agent`` (any message counts as a heartbeat).

        A heartbeat says what its running workers use: kept by pid (``torchrunx top`` matches).
        """
        agent.last_heard = now
        if isinstance(message, Heartbeat):
            agent.usage = {sample[1]: sample for sample in message.usage}

    def workers_ended(self, agent: AgentRecord, message: WorkersEnded) -> bool:
        """The agent's workers of an attempt ended and it waits; ``False`` for a late reply.

        A reply about an earlier attempt (it crossed a restart) changes nothing.
        """
        # Between warm runs, an earlier attempt's reply means the same (an agent that was slow
        # to stop the last run's workers): the agent waits for a spec.
        attempt = self.progress.attempt
        late = self.progress.between_runs and message.attempt < attempt
        if message.attempt != attempt and not late:
            return False
        agent.free_port, agent.ready = message.free_port, True
        return True

    def agent_judged(self, agent: AgentRecord) -> None:
        """``agent``'s end was judged (it had ended well, or its failure is recorded)."""
        agent.judge_by = None

    def agent_done(self, agent: AgentRecord) -> None:
        """The agent's workers all ended and were reaped; it exits next."""
        self.move_agent(agent, AgentState.DONE)

    def agent_exited(self, agent: AgentRecord, status: int | None, now: float) -> bool:
        """Its process ended; ``True`` if that is judged now (else once :meth:`due`)."""
        agent.exited, agent.exit_status = True, status
        if agent.conn is not None and not agent.conn_closed and not agent.over:
            agent.judge_by = now + OUTCOME_WAIT  # its last messages may still be on the way
            self._waiting.add(agent.index)
            return False
        return True

    def agent_conn_closed(self, agent: AgentRecord) -> bool:
        """Its connection ended; ``True`` if the agent must be judged now."""
        agent.conn_closed = True
        return not agent.over

    def silent_agents(self, now: float, slack: float = 0.0) -> list[tuple[AgentRecord, float]]:
        """Agents silent for longer than they may be, with how long (none while stopping).

        Until it first forks workers an agent may be busy importing torch (it holds the GIL
        for seconds on a busy host): that phase answers to ``start_timeout``. Warm agents
        between runs answer to ``agent_timeout`` once they have forked workers. ``slack``:
        those within that many seconds of it too (fallen silent at about the same time).
        """
        if self.progress.stopping:
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
            if now - agent.last_heard > limit - slack:
                silent.append((agent, now - agent.last_heard))
        return silent

    def due(self, now: float) -> list[AgentRecord]:
        """Agents whose wait for their connection's end is over."""
        self._waiting = {i for i in self._waiting if self.agents[i].judge_by}
        agents = [self.agents[i] for i in sorted(self._waiting)]
        return [a for a in agents if a.judge_by is not None and now >= a.judge_by]

    def next_due(self) -> float | None:
        """When :meth:`due` next has something."""
        times = [self.agents[i].judge_by for i in self._waiting]
        return min((t for t in times if t is not None), default=None)

    # -- the world, as a whole ------------------------------------------------------------

    @property
    def all_hellos(self) -> bool:
        """Whether every agent of the world has connected back (in the start phase)."""
        world = self.world
        while self._seen < len(world) and world[self._seen].hello:
            self._seen += 1
        return self._seen == len(world)

    @property
    def all_waiting(self) -> bool:
        """Whether every agent of the world is over or waits (its workers of the attempt ended)."""
        world = self.world
        while self._ended < len(world) and (world[self._ended].over or world[self._ended].ready):
            self._ended += 1
        return self._ended == len(world)

    @property
    def stopped(self) -> bool:
        """After a Stop: whether every agent has ended or waits for the next attempt."""
        return all(a.over or a.ready or a.conn is None for a in self.world)

    def unready_agents(self) -> list[AgentRecord]:
        """Before a warm run: agents that cannot take a spec (ended, lost, or not waiting)."""
        return [a for a in self.world if a.over or not a.ready]

    def agents_ready(self, now: float) -> None:
        """Every agent said hello: each waits for its first spec."""
        self.agents_started_after = now - self.progress.started
        for agent in self.agents:  # spares that said hello wait too
            agent.ready = agent.hello is not None

    def new_attempt(self, *, keep_ready: bool) -> None:
        """A new attempt: every agent of the world waits for its end again.

        ``keep_ready``: agents that wait for a spec still do (warm agents between runs).
        """
        self._ended = 0
        for agent in self.world:  # spares keep waiting
            agent.ready = agent.ready and keep_ready
            agent.pids = ()

    # -- changes of the world between attempts ------------------------------------------------

    def replace_agent(self, index: int) -> AgentRecord:
        """A new record for host ``index``'s agent, about to be started again; the old one."""
        old = self.agents[index]
        new = AgentRecord(index, old.slots, old.method)
        self.agents[index] = new
        self.world[self.world.index(old)] = new
        return old

    def replacements_started(self, indices: list[int]) -> None:
        """The new agents of ``indices`` that said hello wait for a spec."""
        for index in indices:
            self.agents[index].ready = self.agents[index].hello is not None

    def quarantine(self, agent: AgentRecord) -> str:
        """A host of the world failed: it takes no further part; the line that says so."""
        agent.role = "quarantined"
        line = (
            f"attempt {self.progress.attempt}: {agent.slots.hostname} (host "
            f"{self.world.index(agent)}, {agent.state.value}) quarantined"
        )
        self.world_changes.append(line)
        return line

    def reshape_world(self, reshape: Reshape) -> list[str]:
        """The next attempt runs on ``reshape.world``; the lines that say what changed."""
        by_id = {a.index: a for a in self.agents}
        attempt = self.progress.attempt + 1
        lines = []
        for failed, spare in reshape.replaced:
            by_id[spare].role = "host"
            lines.append(
                f"attempt {attempt}: spare {by_id[spare].slots.hostname} replaces "
                f"{by_id[failed].slots.hostname} (host {self.world.index(by_id[failed])})"
            )
        if reshape.dropped:
            names = [by_id[i].slots.hostname for i in reshape.dropped]
            lines.append(
                f"attempt {attempt}: no spare for {', '.join(names)}: "
                f"{len(reshape.world)} hosts go on"
            )
        self.world = [by_id[i] for i in reshape.world]
        self._seen = len(self.world)
        self.world_changes.extend(lines)
        return lines
