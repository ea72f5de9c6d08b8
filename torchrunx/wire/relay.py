"""The relay's frames: many byte streams carried on one agent's stdin and stdout.

When a host cannot connect back to the launcher (``Launcher(relay=...)``), a small relay process
starts before the agent (:mod:`torchrunx.agent.relay`). The agent and its workers connect to the
relay on the host's loopback interface, and the relay carries each connection, as a numbered
channel, over the transport's own channel: SSH's stdin and stdout, an ``srun`` step's, or
``kubectl exec``'s. On the launcher, :mod:`torchrunx.engines.relay` hands each channel to the
listener as if it had connected. The relay moves bytes only: the handshake and the sealed records
run end to end, between the agent (or worker) and the launcher, so the relay holds no key and can
neither read nor forge a message.

A frame is a 9-byte header, ``kind`` (1 byte), ``channel`` (4 bytes) and ``length`` (4 bytes, big
endian), then ``length`` bytes:

- :data:`OPEN` (host to launcher): a connection came to the relay; it is ``channel`` from now on.
- :data:`DATA` (both ways): bytes of ``channel``.
- :data:`EOF` (both ways): the sender's side of ``channel`` has ended. From the host, a
  half-close: the launcher's way goes on until its own EOF. From the launcher, the channel is
  over (the launcher never half-closes a connection: its end closed, or it refused the
  channel): the host writes what came before it, then closes the connection, whether or not the
  connection's own side has ended.
- :data:`OUT` (host to launcher): bytes the agent wrote to its stdout (channel 0).
- :data:`TREE` (host to launcher, tree start only): one JSON object about a host this relay
  started (``Launcher(tree_radix=...)``): ``{"host": INDEX, "err": BOOL, "line": TEXT}``, a
  line of its ``ssh`` client's output, or ``{"host": INDEX, "exit": STATUS}``, its end.
"""

from __future__ import annotations

import collections
import itertools
import struct
from typing import TYPE_CHECKING, Final

from torchrunx.errors import ProtocolError

if TYPE_CHECKING:
    from collections.abc import Callable

OPEN: Final = 1
DATA: Final = 2
EOF: Final = 3
OUT: Final = 4
TREE: Final = 5
_KINDS = frozenset({OPEN, DATA, EOF, OUT, TREE})

HEADER = struct.Struct("!BII")
"""kind, channel, length."""
MAX_DATA = 1 << 20
"""Bytes one frame carries at most (a longer stream is cut into frames of this size)."""
PIPE_SIZE = 1 << 20
"""Capacity asked for the pipes that carry frames (Linux's default, 64 KiB, means many small
reads and writes; an unprivileged process may get up to ``/proc/sys/fs/pipe-max-size``)."""

_IOV_PIECES = 64
"""Pieces one write takes at most (below any system's ``IOV_MAX``)."""

MODES: Final = ("off", "auto", "on")
"""``Launcher.relay`` values: never relay; relay where the host cannot connect back; always."""


def frame(kind: int, channel: int, data: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """One frame's pieces (header, then ``data``, which must fit :data:`MAX_DATA`)."""
    header = HEADER.pack(kind, channel, len(data))
    return [header, data] if data else [header]


class FrameSplitter:
    """Cuts a byte stream into frames, as its chunks come; each byte is copied once."""

    def __init__(self) -> None:
        """An empty splitter."""
        self._chunks: collections.deque[memoryview] = collections.deque()
        self._size = 0
        self._header: tuple[int, int, int] | None = None

    def feed(self, chunk: bytes) -> list[tuple[int, int, bytes]]:
        """The whole frames that ``chunk`` completes: ``(kind, channel, data)``.

        Raises:
            ProtocolError: A frame of an unknown kind, or longer than :data:`MAX_DATA` (the
                stream is not the relay's: something else wrote to it).
        """
        if chunk:
            self._chunks.append(memoryview(chunk))
            self._size += len(chunk)
        frames: list[tuple[int, int, bytes]] = []
        while True:
            if self._header is None:
                if self._size < HEADER.size:
                    return frames
                head = self._take(HEADER.size)
                kind, channel, length = HEADER.unpack(head)
                if kind not in _KINDS or length > MAX_DATA:
                    shown = head + self._take(min(self._size, 31))
                    raise ProtocolError(
                        f"the relay's stream is broken: frame kind {kind}, length {length} "
                        f"(it begins {shown!r}; did something else write to the agent's stdout?)"
                    )
                self._header = (kind, channel, length)
            kind, channel, length = self._header
            if self._size < length:
                return frames
            frames.append((kind, channel, self._take(length)))
            self._header = None

    def _take(self, size: int) -> bytes:
        parts: list[memoryview] = []
        left = size
        while left:
            head = self._chunks[0]
            if len(head) <= left:
                parts.append(self._chunks.popleft())
                left -= len(head)
            else:
                parts.append(head[:left])
                self._chunks[0] = head[left:]
                left = 0
        self._size -= size
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet whole."""
        return self._size


class ByteQueue:
    """Bytes waiting to be written, as the pieces they came in (no copy until written)."""

    def __init__(self) -> None:
        """An empty queue."""
        self._pieces: collections.deque[memoryview] = collections.deque()
        self.size = 0

    def __len__(self) -> int:
        """Bytes waiting."""
        return self.size

    def append(self, data: bytes | memoryview) -> None:
        """Queue ``data`` (kept, not copied: do not change it)."""
        if data:
            self._pieces.append(memoryview(data))
            self.size += len(data)

    def clear(self) -> None:
        """Drop everything."""
        self._pieces.clear()
        self.size = 0

    def write_to(self, write: Callable[[list[memoryview]], int]) -> int:
        """Write what ``write`` takes (``os.writev`` or ``socket.sendmsg``); drop it from here.

        Raises:
            OSError: As ``write`` does (``BlockingIOError`` when nothing fits now).
        """
        count = written = write(list(itertools.islice(self._pieces, _IOV_PIECES)))
        self.size -= written
        while written:
            head = self._pieces[0]
            if len(head) <= written:
                self._pieces.popleft()
                written -= len(head)
            else:
                self._pieces[0] = head[written:]
                written = 0
        return count
