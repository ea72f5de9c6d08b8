"""A worker's channel as the launcher holds it: through its agent's connection.

Workers never connect to the launcher: each talks to its agent over a socket pair, and the
agent forwards its messages on its own sealed connection inside
:class:`~torchrunx.wire.messages.FromWorker`. The launcher opens a :class:`WorkerChannel` when
a worker's hello comes that way; it stands where a connection of the worker's own would, so the
launch treats it as one (:class:`~torchrunx.launcher.launch.inbox.Inbox`): it sends on it (a warm
run's call, debugger input, wrapped in :class:`~torchrunx.wire.messages.ToWorker`) and closes it
(the agent then ends the worker's channel, which tells a worker that stays to exit). It ends
when the agent reports :class:`~torchrunx.wire.messages.WorkerChannelClosed`, or with the
agent's connection.

One agent connection per host instead of one per worker: a launch of 1,000 hosts x 8 makes
1,000 handshakes, not 9,000 (see ``benchmarks/many_hosts.py``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Literal, Protocol

from torchrunx.wire.messages import ToWorker

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.wire.messages import DebugInput, Message, WorkerCall


class AgentConnection(Protocol):
    """What a channel needs of its agent's connection (a listener's ``Peer``)."""

    ident: int

    def send(
        self, message: Message, payload: Sequence[bytes | bytearray | memoryview] = ()
    ) -> None:
        """Queue a message for the agent."""


_IDENTS = itertools.count(-1, -1)
"""Channels' idents: negative, so never one of the listener's connections (0 and up)."""


class WorkerChannel:
    """One worker's channel, carried by its agent's connection (see the module)."""

    role: Literal["worker"] = "worker"

    def __init__(self, agent: AgentConnection, local_rank: int, pid: int) -> None:
        """The channel of the agent's worker ``local_rank``, process ``pid``."""
        self.ident = next(_IDENTS)
        self.agent = agent
        self.local_rank = local_rank
        self.pid = pid
        self.closed = False
        """The launcher closed it, or its end came: nothing more is sent on it."""

    def __repr__(self) -> str:
        """``WorkerChannel(ident, agent's connection, local rank)``."""
        return f"WorkerChannel({self.ident}, {self.agent!r}, local rank {self.local_rank})"

    def send(
        self,
        message: WorkerCall | DebugInput,
        payload: Sequence[bytes | bytearray | memoryview] = (),
    ) -> None:
        """Queue a message for the worker on its agent's connection (dropped once closed)."""
        if not self.closed:
            self.agent.send(ToWorker(self.pid, message), payload)

    def close(self) -> None:
        """Ask the agent to end the worker's channel; nothing more is sent on it. Safe twice."""
        if not self.closed:
            self.closed = True
            self.agent.send(ToWorker(self.pid, None))

    def ended(self) -> None:
        """Its end came (the agent reported it, or the agent's connection ended)."""
        self.closed = True
