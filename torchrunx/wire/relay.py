"""The relay's frames: many byte streams carried on one agent's stdin and stdout.

When a host cannot connect back to the launcher (``Launcher(relay=...)``), a small relay process
starts before the agent (:mod:`torchrunx.agent.relay`). The agent and its workers connect to the
relay on the host's loopback interface, and the relay carries each connection, as a numbered
channel, over the transport's own channel: SSH's stdin and stdout, an ``srun`` step's, or
``kubectl exec``'s. On the launcher, :mod:`torchrunx.launcher.relay` hands each channel to the
listener as if it had connected. The relay moves bytes only: the handshake and the sealed records
run end to end, between the agent (or worker) and the launcher, so the relay holds no key and can
neither read nor forge a message.

A frame is a 9-byte header, ``kind`` (1 byte), ``channel`` (4 bytes) and ``length`` (4 bytes, big
endian), then ``length`` bytes:

- :data:`OPEN` (host to launcher): a connection came to the relay; it is ``channel`` from now on.
- :data:`DATA` (both ways): bytes of ``channel``.
- :data:`EOF` (both ways): the sender's side of ``channel`` has ended (a half-close: the other
  way goes on until its own EOF).
- :data:`OUT` (host to launcher): bytes the agent wrote to its stdout (channel 0).
"""

from __future__ import annotations

import struct
from typing import Final

from torchrunx.errors import ProtocolError

OPEN: Final = 1
DATA: Final = 2
EOF: Final = 3
OUT: Final = 4
_KINDS = frozenset({OPEN, DATA, EOF, OUT})

HEADER = struct.Struct("!BII")
"""kind, channel, length."""
MAX_DATA = 1 << 20
"""Bytes one frame carries at most (a longer stream is cut into frames of this size)."""

MODES: Final = ("off", "auto", "on")
"""``Launcher.relay`` values: never relay; relay where the host cannot connect back; always."""


def frame(kind: int, channel: int, data: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """One frame's pieces (header, then ``data``, which must fit :data:`MAX_DATA`)."""
    header = HEADER.pack(kind, channel, len(data))
    return [header, data] if data else [header]


class FrameSplitter:
    """Cuts a byte stream into frames, as its chunks come."""

    def __init__(self) -> None:
        """An empty splitter."""
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[tuple[int, int, bytes]]:
        """The whole frames that ``chunk`` completes: ``(kind, channel, data)``.

        Raises:
            ProtocolError: A frame of an unknown kind, or longer than :data:`MAX_DATA` (the
                stream is not the relay's: something else wrote to it).
        """
        self._buffer += chunk
        frames: list[tuple[int, int, bytes]] = []
        start = 0
        buffer = self._buffer
        while len(buffer) - start >= HEADER.size:
            kind, channel, length = HEADER.unpack_from(buffer, start)
            if kind not in _KINDS or length > MAX_DATA:
                shown = bytes(buffer[start : start + 40])
                raise ProtocolError(
                    f"the relay's stream is broken: frame kind {kind}, length {length} "
                    f"(it begins {shown!r}; did something else write to the agent's stdout?)"
                )
            end = start + HEADER.size + length
            if len(buffer) < end:
                break
            frames.append((kind, channel, bytes(buffer[start + HEADER.size : end])))
            start = end
        del buffer[:start]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of a frame not yet whole."""
        return len(self._buffer)
