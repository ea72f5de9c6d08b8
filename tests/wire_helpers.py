"""The launcher's side of the wire, blocking and whole, for tests and benchmarks.

The launcher itself runs the handshake and reads records without blocking, in its listener
(:mod:`torchrunx.launcher.net.listener`); tests and the many-hosts benchmark want the same steps
one at a time, on a blocking socket or on whole records they hold.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torchrunx.errors import ProtocolError
from torchrunx.wire import handshake
from torchrunx.wire.records import _RECORD, FrameReader

if TYPE_CHECKING:
    import socket

    from torchrunx.wire.handshake import Role
    from torchrunx.wire.records import Frame, SessionKeys


def server_handshake(sock: socket.socket, secret: bytes) -> tuple[Role, SessionKeys]:
    """Authenticate a client that connected to the launcher; return its role and the keys.

    Only fixed-size byte strings are read here: nothing is unpickled.

    Raises:
        ProtocolError: The peer does not speak the protocol or does not know the secret.
        OSError: The connection failed or timed out.
    """
    server_nonce = os.urandom(handshake.NONCE_BYTES)
    sock.sendall(handshake.server_greeting(server_nonce))
    reply = bytes(handshake._recv_exact(sock, handshake.CLIENT_REPLY_BYTES))
    role, proof, keys = handshake.check_client_reply(secret, server_nonce, reply)
    sock.sendall(proof)
    return role, keys


class RecordReader(FrameReader):
    """A :class:`FrameReader` that is also handed whole records (:meth:`open_record`)."""

    def open_record(self, record: bytes | bytearray) -> list[Frame]:
        """Open one whole record (its length header included); the frames it completed."""
        frames: list[Frame] = []
        with memoryview(record) as view:
            if len(view) < _RECORD.size or self._record_size_of(view) != len(view) - 4:
                raise ProtocolError("a record's length does not match its header")
            self._open(view, frames)
        return frames
