"""A worker's channel to its agent: plain frames on a socket pair.

The agent makes the socket pair before it forks the worker; no other process holds either
end (both are closed on ``exec``, and the worker's children that only ``fork`` are ended with
it), so the channel carries the frames of :mod:`torchrunx.wire.records` without records or
encryption: ``!QI`` (header length, number of parts), one ``!Q`` per part, the pickled
message, the raw parts. What leaves the host goes sealed on the agent's own connection
(:class:`~torchrunx.wire.messages.FromWorker`).

No copy is made that the socket does not make: the worker sends a result's parts (a tensor's
storage) as they are, and the agent receives a large part straight into its buffer.

A stream that ends between two frames is a clean end; one that ends inside a frame was cut
(its worker died while sending).
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
from typing import TYPE_CHECKING

from torchrunx.errors import ProtocolError
from torchrunx.wire.records import FrameParser, encode_frame_start

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.wire.messages import Message
    from torchrunx.wire.records import Frame

_SCRATCH_BYTES = 64 * 1024
"""Bytes read at once between large parts (frames' starts, small parts)."""
_DIRECT_BYTES = 64 * 1024
"""A part missing at least this much is received straight into its buffer."""


class ChannelReader:
    """Reads a channel's frames as they come (see the module); one per channel end."""

    def __init__(self) -> None:
        """A reader at the start of a stream."""
        self._parser = FrameParser()
        self._scratch = bytearray(_SCRATCH_BYTES)
        self.closed_by_peer = False
        """The stream ended between two frames: a clean end."""
        self.error: Exception | None = None
        """Why the stream ended badly, once :meth:`read` returned its end."""

    def read(
        self, sock: socket.socket, budget: int = 16 << 20, *, drain: bool = False
    ) -> tuple[list[Frame], bool]:
        """Read what ``sock`` holds now (about ``budget`` bytes at most); return whole frames.

        A read that did not fill what it asked for is taken to have emptied the socket (on a
        non-blocking socket, the caller's loop says when more comes; a blocking one waits for
        it); with ``drain``, reading goes on until the socket says it has nothing, or ends.
        Never raises: a failure returns the frames completed before it, the end, and
        :attr:`error`.

        Returns:
            The frames completed, and whether the stream is over (ended or failed).
        """
        frames: list[Frame] = []
        received = 0
        parser = self._parser
        try:
            while received < budget:
                wanted = parser.wanted()
                try:
                    if wanted >= _DIRECT_BYTES:  # straight into the part
                        room = min(wanted, budget - received)
                        target = parser.target(room)
                        assert target is not None  # noqa: S101 (a part wants that much)
                        with target:
                            count = sock.recv_into(target)
                        parser.filled(count, frames)
                    else:
                        room = _SCRATCH_BYTES
                        with memoryview(self._scratch) as view:
                            count = sock.recv_into(view)
                        parser.feed(self._scratch[:count], frames)
                except (BlockingIOError, InterruptedError):
                    return frames, False
                if count == 0:
                    if parser.idle:
                        self.closed_by_peer = True
                    else:
                        self.error = ProtocolError("the channel ended inside a frame")
                    return frames, True
                received += count
                if count < room and not drain:
                    return frames, False
        except Exception as exc:  # noqa: BLE001 (any failure ends this channel, and only it)
            self.error = exc
            return frames, True
        return frames, False


class ChannelConnection:
    """The worker's end of its channel: send and receive whole frames, blocking.

    Sending is safe from several threads (the debugger's and the function's); receiving
    belongs to one reader.
    """

    def __init__(self, sock: socket.socket) -> None:
        """Wrap the worker's end of the socket pair (made blocking)."""
        sock.setblocking(True)  # noqa: FBT003 (socket.setblocking takes a flag)
        self.sock = sock
        self._reader = ChannelReader()
        self._frames: collections.deque[Frame] = collections.deque()
        self._send_lock = threading.Lock()

    def send(
        self, message: Message, payload: Sequence[bytes | bytearray | memoryview] = ()
    ) -> None:
        """Send one message and its payload parts (not copied).

        Raises:
            OSError: The channel is broken (the agent is gone).
        """
        with self._send_lock:
            self.sock.sendall(encode_frame_start(message, payload))
            for part in payload:
                with memoryview(part) as view, view.cast("B") as flat:
                    self.sock.sendall(flat)

    def recv(self) -> tuple[Message, list[bytearray]]:
        """Receive one message and its payload parts (blocking).

        Raises:
            ConnectionError: The agent ended the channel (between two frames).
            ProtocolError: The channel ended inside a frame, or a frame is malformed.
            OSError: The channel is broken.
        """
        while not self._frames:
            frames, ended = self._reader.read(self.sock)
            self._frames.extend(frames)
            if ended and not self._frames:
                if self._reader.error is not None:
                    raise self._reader.error
                raise ConnectionError("the agent ended the channel")
        return self._frames.popleft()

    def close(self) -> None:
        """End the channel (the agent sees a clean end after the last whole frame); safe twice."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
