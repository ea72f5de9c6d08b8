"""The world's hosts between attempts: new agents in place, or spares and a smaller world.

After a failure that ``"hosts"`` in ``restart_on`` covers, :class:`HostChanges` gets every host
of the world ready for the next attempt (the launch, :mod:`~torchrunx.launcher.launch.orchestrator`,
holds one, and warm agents call it between runs). It works through the launch's parts and loop
(:class:`~torchrunx.launcher.launch.session.LaunchLoop`, given) and keeps nothing of its own: what
the world is, is the launch state's.

- without spares or ``min_hosts``: a new agent on each failed host (a new SSH connection or
  ``srun`` step), the host keeping its place;
- with them: each failed host is quarantined, and a spare takes its place, or the world
  shrinks (which one is :func:`torchrunx.launcher.state.spares.reshape`'s decision).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

from torchrunx.events import AgentState, HostsChanged
from torchrunx.launcher.launch.session import earliest
from torchrunx.launcher.state.spares import reshape

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.launcher.launch.session import LaunchLoop
    from torchrunx.launcher.starts.tree import Tree
    from torchrunx.launcher.state.records import AgentRecord

logger = logging.getLogger("torchrunx.launcher")


class Failed(Exception):  # noqa: N818 (control flow of a launch, never raised to the user)
    """A failure was recorded: stop, then raise the cause or restart."""


class HostChanges:
    """The world's hosts, and replacing failed ones between attempts (the launch's thread)."""

    def __init__(self, session: LaunchLoop) -> None:
        """Change the hosts of ``session``'s launch, through its parts and its loop."""
        self.session = session

    def hostnames(self) -> tuple[str, ...]:
        """The hosts of the current (or last) attempt, in rank order."""
        return tuple(a.slots.hostname for a in self.session.state.world)

    def replace_agents(self, deadline: float | None) -> None:
        """Start a new agent for every host whose agent died or was lost (new SSH or srun).

        With spare hosts or ``min_hosts``, the failed hosts are quarantined instead: spares
        take their places, or the world shrinks (:meth:`_reshape`).
        """
        if self.session.plan.quarantines:
            self._reshape(deadline)
            return
        st = self.session.state
        replaced = [a.index for a in st.agent_table.unready_agents()]
        for index in replaced:
            old = st.agent_table.replace_agent(index)
            logger.warning("starting a new agent on %s", old.slots.hostname)
            self.session.inbox.drop(old.conn)
            self.session.pool.replace(index, lost=old.state is AgentState.LOST)
        with st.stopping_meanwhile():  # their failures now are the restart's
            self.session.run_until(
                lambda: all(st.agents[i].hello is not None or st.agents[i].over for i in replaced),
                earliest(time.monotonic() + self.session.plan.timeouts.start, deadline),
            )
        st.agent_table.replacements_started(replaced)

    def _reshape(self, deadline: float | None) -> None:
        """Quarantine the world's failed hosts; spares take their places, or the world shrinks.

        A spare that has not said hello yet is waited for (``start_timeout``); one that fails
        meanwhile is replaced in turn. Raises :class:`Failed` (the cause is raised) when fewer
        than ``min_hosts`` hosts would be left.
        """
        st = self.session.state
        while True:
            failed = st.agent_table.unready_agents()
            if not failed:
                return
            failed += subtree_of(self.session.starts.tree, st.world, failed)
            for agent in failed:
                if agent.role == "host":  # alive but not ready in time, or not yet noted
                    self.session.inbox.quarantine(agent)
                self.session.inbox.drop(agent.conn)
            spares = sorted(
                (a for a in st.agents if a.role == "spare" and not a.over),
                key=lambda a: (not a.ready, a.index),
            )
            decision = reshape(
                [a.index for a in st.world],
                [a.index for a in failed],
                [a.index for a in spares],
                self.session.plan.resilience.min_hosts,
            )
            if decision.short is not None:
                st.restart_failed(decision.short)
                raise Failed
            lines = st.agent_table.reshape_world(decision)
            for line in lines:
                logger.warning("%s", line)
            self.session.sink.emit(
                HostsChanged(
                    st.attempt + 1,
                    tuple(a.slots.hostname for a in st.world),
                    tuple(lines),
                )
            )
            waiting = [st.agents[spare] for _, spare in decision.replaced]
            with st.stopping_meanwhile():  # a spare's failure now is this restart's
                self.session.run_until(
                    functools.partial(_all_ready, waiting),
                    earliest(time.monotonic() + self.session.plan.timeouts.start, deadline),
                )


def subtree_of(
    tree: Tree | None, world: Sequence[AgentRecord], failed: Sequence[AgentRecord]
) -> list[AgentRecord]:
    """The hosts of ``world`` (not in ``failed``) that a failed host of a tree start started.

    They go with it: their connections run through its relay, which stops them when its
    agent stops (a quarantined host is told to stop for good), so none of them is left in the
    next attempt's world to be lost in it.
    """
    if tree is None:
        return []
    gone = {agent.index for agent in failed}
    started = {child for index in gone for child in tree.children(index)} - gone
    return [agent for agent in world if agent.index in started]


def _all_ready(agents: list[AgentRecord]) -> bool:
    return all(a.ready or a.over for a in agents)
