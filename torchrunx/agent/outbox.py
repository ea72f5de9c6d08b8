"""The agent's outbox: its messages to the launcher, written without ever blocking.

The agent's loop must not wait on a slow launcher: it would stop reaping workers and sending
heartbeats. So a message is framed into a buffer and written with non-blocking writes, at
once as far as the socket takes it, the rest when the loop's selector finds the socket
writable again (``len(outbox) > 0`` says that the loop should watch for it).

Backpressure: above a high watermark of unsent bytes, :attr:`Outbox.paused` asks the agent to
stop reading its workers' output until the outbox has shrunk below a low watermark. Chatty
workers then wait on their full pipes, and no line is lost.
"""

from __future__ import annotations

import math
import os
import select
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import socket

    from torchrunx.wire.messages import Message
    from torchrunx.wire.records import Sealer

HIGH_WATERMARK = 16 << 20
"""Unsent bytes above which the agent stops reading its workers' output."""
LOW_WATERMARK = 1 << 20
"""Unsent bytes below which it reads them again."""
_WRITE_CHUNK = 1 << 20
_LONGEST_POLL = 3600.0  # poll's timeout is an int of milliseconds: wait in steps


class Outbox:
    """Messages queued for the launcher on one socket (see the module's description)."""

    def __init__(
        self,
        sock: socket.socket,
        sealer: Sealer,
        *,
        high: int = HIGH_WATERMARK,
        low: int = LOW_WATERMARK,
    ) -> None:
        """Queue for ``sock``, which must have a timeout; ``sealer`` seals each record.

        Records are sealed when queued, in order, with the connection's one
        :class:`~torchrunx.wire.records.Sealer` (:attr:`Connection.sealer`).

        Python keeps the descriptor of a socket with a timeout non-blocking (``socket.send``
        would still wait up to that timeout for room; the outbox writes to the descriptor).

        Raises:
            ValueError: ``sock`` has no timeout, so its descriptor blocks.
        """
        if sock.gettimeout() is None:
            raise ValueError("the outbox needs a socket with a timeout (a non-blocking fd)")
        self._fd = sock.fileno()
        self._sealer = sealer
        self._buffer = bytearray()
        self._high = high
        self._low = low
        self.alive = True
        """False once the connection broke or the launcher was found gone (:meth:`lose`)."""
        self.paused = False
        """True above the high watermark, until below the low one: stop reading output."""

    def __len__(self) -> int:
        """Bytes queued and not yet written."""
        return len(self._buffer)

    def put(self, message: Message) -> None:
        """Queue a message after those already queued, and write what the socket takes now.

        Does nothing once the launcher is gone.
        """
        if not self.alive:
            return
        for record in self._sealer.seal_frame(message):
            self._buffer += record
        self.flush()

    def flush(self) -> None:
        """Write what the socket takes now; a broken connection makes the outbox lost."""
        while self._buffer and self.alive:
            try:
                sent = os.write(self._fd, self._buffer[:_WRITE_CHUNK])
            except BlockingIOError:
                break
            except OSError:
                self.lose()
                return
            del self._buffer[:sent]
        if len(self._buffer) > self._high:
            self.paused = True
        elif len(self._buffer) < self._low:
            self.paused = False

    def lose(self) -> None:
        """The launcher is gone: drop what is queued and accept nothing more."""
        self.alive = False
        self._buffer.clear()
        self.paused = False  # output is read (and dropped): workers never wait on a full pipe

    def drain(self, deadline: float) -> None:
        """Write everything queued, waiting for room until ``deadline`` (monotonic) at most."""
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        while self._buffer and self.alive:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            poller.poll(math.ceil(min(left, _LONGEST_POLL) * 1000))
            self.flush()
