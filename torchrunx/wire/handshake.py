"""The handshake: a mutual challenge-response over the per-launch secret, and the session keys.

The launcher (server) greets with the protocol's magic and a fresh nonce; the client (agent or
worker) answers with its role, its own nonce and an HMAC proving it knows the secret; the
server answers with its own proof. Only fixed-size byte strings are read until then: nothing
is unpickled. Each end then derives the connection's two keys (:func:`session_keys`). The
server side runs in the launcher's listener (:mod:`torchrunx.launcher.net.listener`), without
blocking; :func:`connect` is the client side, with its retries.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time
from typing import Literal

from torchrunx.errors import ProtocolError
from torchrunx.wire.records import Connection, SessionKeys, _recv_exact_into

PROTOCOL_VERSION = 6
"""5: a worker's debugger speaks on its connection (``DebugOutput``, ``DebugInput``) and
``WorkerSpec`` says whether the launcher has a terminal. 4: the message classes live in
:mod:`torchrunx.wire.messages` (a frame's header names its class's module, so a peer of
version 3 could not read them). 3: a stream ends with an authenticated close record (an empty
one), see :class:`~torchrunx.wire.records.FrameReader`."""
MAGIC = b"TORCHRUNX/%03d\n" % PROTOCOL_VERSION
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
SECRET_BYTES = 32
KEY_BYTES = 32
"""AES-256-GCM keys, one per direction of a connection."""
_ROLES: dict[bytes, Literal["agent", "worker"]] = {b"A": "agent", b"W": "worker"}

Role = Literal["agent", "worker"]


def new_secret() -> bytes:
    """A fresh random per-launch secret."""
    return os.urandom(SECRET_BYTES)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.digest(secret, b"|".join(parts), "sha256")


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    with memoryview(buffer) as view:
        _recv_exact_into(sock, view)
    return buffer


CLIENT_REPLY_BYTES = len(MAGIC) + 1 + NONCE_BYTES + MAC_BYTES
"""Size of a client's handshake reply (fixed, so a server can read it without parsing)."""


def server_greeting(server_nonce: bytes) -> bytes:
    """The first bytes a server sends: the protocol magic and its fresh nonce."""
    return MAGIC + server_nonce


def session_keys(
    secret: bytes, server_nonce: bytes, client_nonce: bytes, role_byte: bytes, *, server: bool
) -> SessionKeys:
    """Derive a connection's two keys (HKDF-SHA256) from the secret and both nonces.

    Both nonces are fresh, so every connection has keys of its own; the role is bound in too.
    """
    # HKDF-SHA256 (RFC 5869) with one-shot HMACs: one extract for both keys, then one expand
    # block each (a 32-byte key is the first block, T(1) = HMAC(PRK, info | 0x01)).
    prk = hmac.digest(server_nonce + client_nonce, secret, "sha256")

    def derive(direction: bytes) -> bytes:
        info = b"torchrunx %d %s %s" % (PROTOCOL_VERSION, role_byte, direction)
        return hmac.digest(prk, info + b"\x01", "sha256")[:KEY_BYTES]

    to_server, to_client = derive(b"client->server"), derive(b"server->client")
    if server:
        return SessionKeys(send=to_client, receive=to_server)
    return SessionKeys(send=to_server, receive=to_client)


def check_client_reply(
    secret: bytes, server_nonce: bytes, reply: bytes
) -> tuple[Role, bytes, SessionKeys]:
    """Verify a client's handshake reply.

    Returns:
        The client's role, the server's proof to send back, and the server's keys.

    Raises:
        ProtocolError: The peer does not speak the protocol or does not know the secret.
    """
    magic, rest = reply[: len(MAGIC)], reply[len(MAGIC) :]
    if magic != MAGIC or len(reply) != CLIENT_REPLY_BYTES:
        raise ProtocolError(f"peer does not speak torchrunx protocol version {PROTOCOL_VERSION}")
    role_byte, client_nonce, client_mac = (
        rest[:1],
        rest[1 : 1 + NONCE_BYTES],
        rest[1 + NONCE_BYTES :],
    )
    expected = _mac(secret, b"client", role_byte, server_nonce, client_nonce)
    if role_byte not in _ROLES or not hmac.compare_digest(expected, client_mac):
        raise ProtocolError("peer failed to authenticate (wrong or missing launch secret)")
    keys = session_keys(secret, server_nonce, client_nonce, role_byte, server=True)
    return _ROLES[role_byte], _mac(secret, b"server", client_nonce, server_nonce), keys


GREETING_BYTES = len(MAGIC) + NONCE_BYTES
"""Size of a server's greeting."""


def client_reply(secret: bytes, greeting: bytes, role: Role) -> tuple[bytes, bytes, SessionKeys]:
    """A client's answer to the server's greeting, the proof it expects back, and its keys.

    Raises:
        ProtocolError: The greeting is not a torchrunx launcher's.
    """
    if greeting[: len(MAGIC)] != MAGIC or len(greeting) != GREETING_BYTES:
        raise ProtocolError(
            f"launcher does not speak torchrunx protocol version {PROTOCOL_VERSION}"
        )
    server_nonce = greeting[len(MAGIC) :]
    client_nonce = os.urandom(NONCE_BYTES)
    role_byte = b"A" if role == "agent" else b"W"
    mac = _mac(secret, b"client", role_byte, server_nonce, client_nonce)
    expected = _mac(secret, b"server", client_nonce, server_nonce)
    keys = session_keys(secret, server_nonce, client_nonce, role_byte, server=False)
    return MAGIC + role_byte + client_nonce + mac, expected, keys


def client_handshake(sock: socket.socket, secret: bytes, role: Role) -> SessionKeys:
    """Authenticate to the launcher, check that it knows the secret too; return the keys.

    Raises:
        ProtocolError: The server is not a torchrunx launcher of this launch.
        OSError: The connection failed or timed out.
    """
    reply, expected, keys = client_reply(secret, bytes(_recv_exact(sock, GREETING_BYTES)), role)
    sock.sendall(reply)
    if not hmac.compare_digest(bytes(_recv_exact(sock, MAC_BYTES)), expected):
        raise ProtocolError("launcher failed to authenticate (wrong launch secret)")
    return keys


_RETRY_FIRST = 0.05
_RETRY_MOST = 1.0
"""Seconds between two tries of :func:`connect` (doubling from the first, up to this)."""


def connect(address: tuple[str, int], secret: bytes, role: Role, timeout: float) -> Connection:
    """Connect to the launcher, authenticate, and return the framed connection.

    A try that the launcher resets or closes before the handshake is done (it sheds handshakes
    when a flood fills its cap) is tried again, with a short growing pause, until ``timeout``
    seconds have passed since the first. A refused connection is not: nothing listens there
    (the launcher is gone, or the address is wrong), and waiting would only hide that.

    Raises:
        ProtocolError: Authentication failed (the launcher does not know the secret).
        OSError: The launcher cannot be reached within ``timeout`` seconds, or refuses.
    """
    deadline = time.monotonic() + timeout
    pause = _RETRY_FIRST
    while True:
        left = deadline - time.monotonic()
        try:
            return _connect_once(address, secret, role, max(left, 0.001))
        except (ProtocolError, ConnectionRefusedError):
            raise
        except ConnectionError:  # reset, aborted, or closed by the launcher: shed
            left = deadline - time.monotonic()
            if left <= pause:
                raise
        time.sleep(pause)
        pause = min(pause * 2, _RETRY_MOST)


def _connect_once(
    address: tuple[str, int], secret: bytes, role: Role, timeout: float
) -> Connection:
    host, port = address
    # getaddrinfo encodes a str host with the idna codec, whose import (encodings.idna,
    # stringprep, unicodedata) was 3 ms of every agent's start; it takes bytes as they are.
    name = host.encode() if host.isascii() else host
    sock = socket.create_connection((name, port), timeout=timeout)  # type: ignore[arg-type]
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keys = client_handshake(sock, secret, role)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Connection(sock, keys)
