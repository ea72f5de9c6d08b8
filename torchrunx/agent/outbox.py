"""The agent's outbox: its messages to the launcher, written without ever blocking.

The agent's loop must not wait on a slow launcher: it would stop reaping workers and sending
heartbeats. So a message is queued as plaintext pieces and written with non-blocking writes,
each piece sealed into its record when its turn comes (small ones queued together share a
record, :func:`~torchrunx.wire.records.take_plaintext`), at once as far as the socket takes it
(:meth:`Outbox.flush`), the rest when the loop's selector finds the socket writable again
(``len(outbox) > 0`` says that the loop should watch for it). A worker's large result is never
held sealed whole.

The agent also writes to each worker's channel through an outbox of its own (plain frames, no
records: :mod:`torchrunx.wire.channel`): a worker that does not read never blocks it.

Backpressure: above a high watermark of unsent bytes, :attr:`Outbox.paused` asks the agent to
stop reading its workers' output until the outbox has shrunk below a low watermark. Chatty
workers then wait on their full pipes, and no line is lost.
"""

from __future__ import annotations

import collections
import math
import os
import select
import time
from typing import TYPE_CHECKING

from torchrunx.wire.records import frame_pieces, take_plaintext

if TYPE_CHECKING:
    import socket
    from collections.abc import Sequence

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
        sealer: Sealer | None,
        *,
        high: int = HIGH_WATERMARK,
        low: int = LOW_WATERMARK,
    ) -> None:
        """Queue for ``sock``, which must have a timeout; ``sealer`` seals each record.

        Records are sealed in order, each when the socket has room for it, with the
        connection's one :class:`~torchrunx.wire.records.Sealer` (:attr:`Connection.sealer`);
        ``None``: the plaintext goes as it is (a worker's channel).

        Python keeps the descriptor of a socket with a timeout non-blocking (``socket.send``
        would still wait up to that timeout for room; the outbox writes to the descriptor).

        Raises:
            ValueError: ``sock`` has no timeout, so its descriptor blocks.
        """
        if sock.gettimeout() is None:
            raise ValueError("the outbox needs a socket with a timeout (a non-blocking fd)")
        self._fd = sock.fileno()
        self._sealer = sealer
        self._pieces: collections.deque[bytes | memoryview] = collections.deque()
        """Plaintext queued, in order; each is sealed into a record when its turn comes."""
        self._record = memoryview(b"")
        """What is left to write of the record being sent."""
        self._unsent = 0
        self._high = high
        self._low = low
        self.alive = True
        """False once the connection broke or the launcher was found gone (:meth:`lose`)."""
        self.paused = False
        """True above the high watermark, until below the low one: stop reading output."""
        self.held = False
        """While set, :meth:`put` only queues: the owner flushes once when it is done (the
        agent, after each turn of its loop), so what one turn sends shares records."""

    def __len__(self) -> int:
        """Bytes queued and not yet written (about: plaintext, and the record under way)."""
        return self._unsent + self._record.nbytes

    def put(self, message: Message, payload: Sequence[bytes | bytearray | memoryview] = ()) -> None:
        """Queue a message and its payload parts (not copied); write what the socket takes now.

        It goes after those already queued. Does nothing once the launcher is gone.
        """
        if not self.alive:
            return
        for piece in frame_pieces(message, payload):
            self._pieces.append(piece)
            self._unsent += len(piece)
        if not self.held:
            self.flush()

    def flush(self) -> None:
        """Write what the socket takes now; a broken connection makes the outbox lost."""
        while self.alive and (self._record.nbytes or self._pieces):
            if not self._record.nbytes:
                piece = take_plaintext(self._pieces)
                self._unsent -= len(piece)
                sealed = piece if self._sealer is None else self._sealer.seal(piece)
                self._record = memoryview(sealed).cast("B")
            try:
                sent = os.write(self._fd, self._record[:_WRITE_CHUNK])
            except BlockingIOError:
                break
            except OSError:
                self.lose()
                return
            self._record = self._record[sent:]
        if len(self) > self._high:
            self.paused = True
        elif len(self) < self._low:
            self.paused = False

    def lose(self) -> None:
        """The launcher is gone: drop what is queued and accept nothing more."""
        self.alive = False
        self._pieces.clear()
        self._record, self._unsent = memoryview(b""), 0
        self.paused = False  # output is read (and dropped): workers never wait on a full pipe

    def drain(self, deadline: float) -> None:
        """Write everything queued, waiting for room until ``deadline`` (monotonic) at most."""
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        while len(self) and self.alive:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            poller.poll(math.ceil(min(left, _LONGEST_POLL) * 1000))
            self.flush()
