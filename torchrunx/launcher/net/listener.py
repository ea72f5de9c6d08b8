"""The launcher's listening socket: accept, authenticate, and turn bytes into frames.

Agents connect here, and workers whose outcome is large (see
:class:`~torchrunx.wire.messages.DirectOutcome`; their other messages travel through their agent).
Each connection is non-blocking and lives in the launch's
:class:`~torchrunx.launcher.net.ioloop.IOLoop`: the handshake (:mod:`torchrunx.wire.handshake`) is
read as its bytes come, under one deadline for the whole of it, and nothing is unpickled before it
succeeds. An authenticated connection becomes a :class:`Peer`, whose frames go, as
:class:`FrameReceived` and :class:`PeerClosed`, to the one queue the launch reads. Sending is
buffered (:meth:`Peer.send`), so a slow peer never blocks the loop.

Failures to accept (out of descriptors, a connection reset before it was accepted) make the
listener pause briefly and go on, with a warning; connections still authenticating are capped,
at :data:`MAX_PENDING` and at a quarter of the process's descriptor limit, so that a flood of
idle connections never takes the descriptors the rest of the launch needs (log files, agents'
pipes, SSH connections). At the cap, each new connection sheds the oldest handshake (once it has had
:data:`SHED_AFTER` to answer), so that a
flood cannot keep the listener full and real peers queued behind it: a real peer answers the
greeting at once, and :func:`torchrunx.wire.handshake.connect` tries again if it was shed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import math
import os
import resource
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchrunx.errors import ProtocolError
from torchrunx.wire import handshake, records
from torchrunx.wire.records import FrameReader, Sealer, frame_pieces

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from torchrunx.launcher.net.channels import WorkerChannel
    from torchrunx.launcher.net.ioloop import IOLoop
    from torchrunx.wire.handshake import Role
    from torchrunx.wire.messages import Message
    from torchrunx.wire.records import SessionKeys

logger = logging.getLogger("torchrunx.listener")

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to complete the whole handshake."""
MAX_PENDING = 1024
"""Connections authenticating at once; at the cap, each new one sheds the oldest (after
:data:`SHED_AFTER`)."""
BACKLOG = 4096
"""Connections the kernel queues before they are accepted (capped by ``net.core.somaxconn``):
every worker of a large launch connects within the same second."""
SHED_AFTER = 1.0
"""Seconds a handshake has had before it may be dropped for a new connection at the cap."""
RELAYED_PENDING = 32
"""Relayed connections of one host authenticating at once (an agent and its workers need a
few); at the cap, the host's oldest is shed for a new one, as at :data:`MAX_PENDING`."""
_ACCEPT_PAUSE = 0.1
"""Seconds the listener rests after a failed ``accept`` (out of descriptors, say)."""
_ACCEPTS_PER_ROUND = 64
_WARN_EVERY = 60.0
"""Seconds between two warnings of one kind (out of descriptors, at the cap); else DEBUG."""


def _host_of(name: object) -> str:
    """The address of a socket name: a TCP ``(host, port, ...)``; "" for a socket pair's."""
    if isinstance(name, tuple) and name:
        return str(name[0]).removeprefix("::ffff:")
    return ""


@dataclass(frozen=True)
class FrameReceived:
    """A peer sent a message (and its payload parts); ``at``: Unix time it was read."""

    peer: Peer
    message: Message
    payload: list[bytearray]
    at: float


@dataclass(frozen=True)
class PeerClosed:
    """A peer's connection ended (closed, broken, or a frame it sent was not valid).

    Also a worker's channel that the launch closed (:meth:`Inbox.drop`).
    """

    peer: Peer | WorkerChannel
    clean: bool = False
    """The peer ended its stream with its authenticated close record: nothing was cut."""


NetEvent = FrameReceived | PeerClosed


class Peer:
    """One authenticated connection (an agent's or a worker's), as the launcher holds it."""

    def __init__(
        self,
        ident: int,
        role: Role,
        sock: socket.socket,
        keys: SessionKeys,
        listener: Listener,
    ) -> None:
        """Wrap an authenticated non-blocking socket; the listener registers it."""
        self.ident = ident
        self.role: Role = role
        self.sock = sock
        self.closed = False
        self._reader = FrameReader(keys.receive)
        self._sealer = Sealer(keys.send)
        self._pieces: collections.deque[memoryview | bytes] = collections.deque()
        """Plaintext queued, in order; each piece is sealed into a record when its turn comes."""
        self._record: memoryview | None = None
        """The sealed record being sent (``None``: none)."""
        self._unsent = 0
        self._listener = listener
        self.relayed: tuple[str, str] | None = None
        """Set for a relayed connection: the host's address, and the launcher's it was given."""

    def __repr__(self) -> str:
        """``Peer(ident, role)``."""
        return f"Peer({self.ident}, {self.role})"

    @property
    def peer_address(self) -> str:
        """The address the peer connected from (IPv4-mapped IPv6 unmapped).

        A relayed peer's is its host's address on the route to the launcher, as the relay saw it.
        """
        if self.relayed is not None:
            return self.relayed[0]
        with contextlib.suppress(OSError):
            return _host_of(self.sock.getpeername())
        return ""

    @property
    def local_address(self) -> str:
        """This machine's address the peer reached (IPv4-mapped IPv6 unmapped).

        A relayed peer's is the address its host was given for the launcher.
        """
        if self.relayed is not None:
            return self.relayed[1]
        with contextlib.suppress(OSError):
            return _host_of(self.sock.getsockname())
        return ""

    @property
    def closed_by_peer(self) -> bool:
        """The peer's authenticated close record came (a clean end, not a cut stream)."""
        return self._reader.closed_by_peer

    @property
    def unsent(self) -> int:
        """Plaintext bytes queued but not yet accepted by the kernel (about)."""
        return self._unsent

    def send(
        self, message: Message, payload: Sequence[bytes | bytearray | memoryview] = ()
    ) -> None:
        """Queue one message and its payload (not copied) and send what the socket takes now.

        Records are sealed one at a time as the socket takes them, so a large payload sent to
        many peers is never held encrypted all at once. A broken connection is not an error
        here: its end arrives as :class:`PeerClosed`.
        """
        if self.closed:
            return
        was_empty = self._record is None and not self._pieces
        for piece in frame_pieces(message, payload):
            self._pieces.append(piece)
            self._unsent += len(piece)
        if was_empty:
            self._flush()

    def _flush(self) -> None:
        while self._record is not None or self._pieces:
            if self._record is None:
                piece = self._pieces.popleft()
                self._unsent -= len(piece)
                self._record = memoryview(self._sealer.seal(piece))
            try:
                sent = self.sock.send(self._record)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._pieces.clear()
                self._record, self._unsent = None, 0
                self._listener.drop(self)
                return
            self._record = self._record[sent:] if sent < self._record.nbytes else None
        if self._record is not None:
            self._listener.loop.add_writer(self.sock.fileno(), self._flush)
        else:
            self._listener.loop.remove_writer(self.sock.fileno())

    def _on_readable(self) -> None:
        """Deliver the frames that came, in order, then drop the connection if it ended.

        Whatever goes wrong with this peer's bytes (a bad record, a malformed frame, a stream
        cut short, anything the parsing raises) ends this connection only, after the frames
        that came before it.
        """
        before = self._reader.received
        try:
            frames, eof = self._reader.read(self.sock)
            error = self._reader.error
        except Exception as exc:  # noqa: BLE001 (one peer's bytes never stop the launch)
            frames, eof, error = [], True, exc
        if self.role == "worker":
            self._listener.outcome_bytes += self._reader.received - before
        now = time.time()
        for message, payload in frames:
            self._listener.emit(FrameReceived(self, message, payload, now))
        if eof:
            if error is not None:
                logger.debug("connection %s dropped: %s", self, error)
            self._listener.drop(self)

    def close(self) -> None:
        """Close the connection now (unsent data is dropped); no event follows."""
        if self.closed:
            return
        self.closed = True
        if (  # all sent: an authenticated end (unless the peer ended first: it reads no more)
            self._record is None
            and not self._pieces
            and not self.closed_by_peer
            and self.sock.fileno() >= 0
        ):
            records.send_close(self.sock, self._sealer)
        self._pieces.clear()
        self._record, self._unsent = None, 0
        self._listener.forget(self)


class _Pending:
    """A connection in its handshake: the greeting is sent, the reply is being read."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.accepted = time.monotonic()
        self.deadline = deadline
        self.nonce = os.urandom(handshake.NONCE_BYTES)
        self.reply = bytearray()
        self.relayed: tuple[str, str] | None = None
        """A relayed connection's addresses (the host's, the launcher's as the host knows it)."""


def _descriptor_share() -> int:
    """Handshakes at once that leave three quarters of the descriptor limit to the launch."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_PENDING if soft == resource.RLIM_INFINITY else max(8, soft // 4)


def listen_socket(host: str | None = None, ports: Sequence[int] = (0,)) -> socket.socket:
    """A listening TCP socket on the first free port of ``ports``: ``host`` only, or everywhere.

    ``host``: an address (IPv4 or IPv6) or a name of this machine, ``OSError`` if it is not
    one; ``"0.0.0.0"``: every IPv4 interface; ``None``, ``""`` or ``"*"``: every interface,
    IPv6 and IPv4 where the machine has both. ``ports``: tried in order, a port in use
    (``EADDRINUSE``) passed over; ``(0,)``: an ephemeral port. The last port's error is raised
    when none is free.
    """
    error: OSError | None = None
    for port in ports:
        try:
            return _listen_on(host, port)
        except OSError as exc:  # noqa: PERF203 (a few binds, once per launch)
            if exc.errno != errno.EADDRINUSE:
                raise
            error = exc
    assert error is not None  # noqa: S101 (ports is never empty)
    raise error


def _listen_on(host: str | None, port: int) -> socket.socket:
    if host not in (None, "", "*"):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host == "::" and socket.has_dualstack_ipv6()
        sock = socket.create_server(
            (host, port), family=family, backlog=BACKLOG, dualstack_ipv6=dualstack
        )
    elif socket.has_dualstack_ipv6():
        sock = socket.create_server(
            ("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=BACKLOG
        )
    else:
        sock = socket.create_server(("0.0.0.0", port), backlog=BACKLOG)  # noqa: S104 (remote agents)
    sock.settimeout(0.0)  # non-blocking
    return sock


class Listener:
    """Accepts and authenticates connections in ``loop``; their frames go to ``events``."""

    def __init__(
        self,
        loop: IOLoop,
        secret: bytes,
        sock: socket.socket,
        emit: Callable[[NetEvent], None],
    ) -> None:
        """Start accepting on ``sock`` (see :func:`listen_socket`); hand events to ``emit``.

        ``emit`` puts them on the launch's one queue, in the order they were read.
        """
        self.loop = loop
        self.secret = secret
        self.sock = sock
        self.port = int(sock.getsockname()[1])
        self.emit = emit
        self.peers: dict[int, Peer] = {}
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._paused_until = 0.0
        self._accepting = False
        self._cap_paused = False
        self._warned: dict[str, float] = {}
        self.max_pending = _descriptor_share()
        """At most this many handshakes at once (and :data:`MAX_PENDING`)."""
        self.rejected = 0
        """Connections closed without authenticating (wrong secret, too slow, over the cap)."""
        self.outcome_bytes = 0
        """Bytes read so far from workers' own connections (their large outcomes)."""
        self._resume()

    def _resume(self) -> None:
        if not self._accepting and self.sock.fileno() >= 0 and self._paused_until != math.inf:
            self.loop.add_reader(self.sock.fileno(), self._accept)
            self._accepting = True
            self._cap_paused = False

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_ROUND):
            full = len(self._pending) >= min(MAX_PENDING, self.max_pending)
            if full and not self._may_shed():
                return
            try:
                sock, _address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: rest, then go on (connections wait queued).
                self._warn(
                    "accept",
                    "cannot accept a connection (%s); retrying every %g s",
                    exc,
                    _ACCEPT_PAUSE,
                )
                self._pause(_ACCEPT_PAUSE)
                return
            if full:
                self._reject(next(iter(self._pending)))  # the oldest makes room for it
            self._begin_handshake(sock)

    def _may_shed(self) -> bool:
        """At the cap: may a new connection replace the oldest handshake? Else pause.

        It may once the oldest has waited :data:`SHED_AFTER`; until then accepting pauses (or
        until a handshake ends). A real peer answers the greeting at once (and tries
        again if it was dropped), so a flood of idle connections cannot hold the listener full
        and keep real peers queued behind it; a burst of real peers is never shed.
        """
        self._warn(
            "cap",
            "%d connections are authenticating at once, the most allowed: the oldest is dropped "
            "for each new one once it has waited %g s (a real peer answers at once)",
            len(self._pending),
            SHED_AFTER,
        )
        oldest = next(iter(self._pending.values()))
        waited = time.monotonic() - oldest.accepted
        if waited < SHED_AFTER:
            self._pause(SHED_AFTER - waited)  # or until a handshake ends (_handshake_ended)
            self._cap_paused = True
            return False
        return True

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """Log at WARNING, or at DEBUG when a warning of this kind came less than a minute ago."""
        now = time.monotonic()
        if now - self._warned.get(kind, -math.inf) >= _WARN_EVERY:
            self._warned[kind] = now
            logger.warning(message, *args)
        else:
            logger.debug(message, *args)

    def _pause(self, seconds: float | None = None) -> None:
        """Stop accepting: for ``seconds``, or (``None``) until a handshake ends."""
        if self._accepting:
            self.loop.remove_reader(self.sock.fileno())
            self._accepting = False
        self._paused_until = math.inf if seconds is None else time.monotonic() + seconds

    def adopt(self, sock: socket.socket, addresses: tuple[str, str]) -> None:
        """Take a connection that came another way (a relayed channel) as if it was accepted.

        It authenticates like any other, under the same cap, and under a cap of its own host's
        (:data:`RELAYED_PENDING`): at either, the oldest handshake there is shed for it if it
        has had :data:`SHED_AFTER`, else this one is closed at once (a real peer tries again),
        as :meth:`_accept` would have left it in the backlog. After :meth:`stop_accepting` it
        is closed at once. ``addresses``: the host's, and the launcher's as the host was given
        it (:attr:`Peer.relayed`).
        """
        if self.sock.fileno() < 0 or not self._room_for(addresses[0]):
            sock.close()
            self.rejected += 1
            return
        self._begin_handshake(sock)
        pending = self._pending.get(sock.fileno())
        if pending is not None:
            pending.relayed = addresses

    def _room_for(self, host: str) -> bool:
        """Shed a handshake, if need be, for a relayed connection of ``host``; whether it fits."""
        now = time.monotonic()
        same = [fd for fd, p in self._pending.items() if p.relayed and p.relayed[0] == host]
        if len(same) >= RELAYED_PENDING:
            if now - self._pending[same[0]].accepted < SHED_AFTER:
                return False
            self._reject(same[0])
        if len(self._pending) >= min(MAX_PENDING, self.max_pending):
            oldest = next(iter(self._pending))
            if now - self._pending[oldest].accepted < SHED_AFTER:
                return False
            self._reject(oldest)
        return True

    def _begin_handshake(self, sock: socket.socket) -> None:
        pending = _Pending(sock, time.monotonic() + HANDSHAKE_TIMEOUT)
        try:
            sock.settimeout(0.0)  # non-blocking
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.send(handshake.server_greeting(pending.nonce))  # small: fits any fresh buffer
        except OSError:
            sock.close()
            return
        fd = sock.fileno()
        self._pending[fd] = pending
        self.loop.add_reader(fd, lambda: self._on_handshake(fd))

    def _on_handshake(self, fd: int) -> None:
        pending = self._pending[fd]
        try:
            chunk = pending.sock.recv(handshake.CLIENT_REPLY_BYTES - len(pending.reply))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._reject(fd)
            return
        pending.reply += chunk
        if len(pending.reply) < handshake.CLIENT_REPLY_BYTES:
            return
        try:
            role, proof, keys = handshake.check_client_reply(
                self.secret, pending.nonce, bytes(pending.reply)
            )
            pending.sock.send(proof)  # 32 bytes: fits the buffer the greeting left
        except (OSError, ProtocolError):
            self._reject(fd)
            return
        del self._pending[fd]
        self._handshake_ended()
        peer = Peer(next(self._ids), role, pending.sock, keys, self)
        peer.relayed = pending.relayed
        self.peers[fd] = peer
        self.loop.add_reader(fd, peer._on_readable)  # noqa: SLF001 (the peer's own reader)
        peer._on_readable()  # noqa: SLF001 (frames may have come with the reply)

    def _reject(self, fd: int) -> None:
        pending = self._pending.pop(fd)
        self.loop.remove(fd)
        pending.sock.close()  # dropped without reading anything more
        self.rejected += 1
        self._handshake_ended()

    def _handshake_ended(self) -> None:
        if self._cap_paused:  # paused at the cap: there is room again
            self._cap_paused = False
            self._paused_until = 0.0
            self._resume()

    def tick(self, now: float) -> None:
        """Drop handshakes past their deadline; resume accepting after a pause."""
        # Deadlines are in the order connections came (one timeout for all): oldest first.
        expired = []
        for fd, pending in self._pending.items():
            if now < pending.deadline:
                break
            expired.append(fd)
        for fd in expired:
            self._reject(fd)
        if not self._accepting and now >= self._paused_until:
            self._resume()

    @property
    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (``None``: nothing pending)."""
        oldest = next(iter(self._pending.values()), None)
        times = [] if oldest is None else [oldest.deadline]
        if not self._accepting and self._paused_until != math.inf:
            times.append(self._paused_until)
        return min(times, default=None)

    def drop(self, peer: Peer) -> None:
        """End ``peer``'s connection and queue its :class:`PeerClosed`."""
        if peer.closed:
            return
        peer.close()
        self.emit(PeerClosed(peer, clean=peer.closed_by_peer))

    def forget(self, peer: Peer) -> None:
        """Unregister and close a peer's socket (from :meth:`Peer.close`)."""
        fd = peer.sock.fileno()
        if fd >= 0:
            self.loop.remove(fd)
            self.peers.pop(fd, None)
        if not peer.closed_by_peer:  # else its end is over already: close alone ends ours
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
        peer.sock.close()

    def stop_accepting(self) -> None:
        """Close the listening socket and every connection still authenticating."""
        if self.sock.fileno() >= 0:
            self.loop.remove(self.sock.fileno())
            self.sock.close()
        self._accepting = False
        for fd in list(self._pending):
            self._reject(fd)

    def close(self) -> None:
        """Close everything: the listening socket, handshakes in progress, and every peer."""
        self.stop_accepting()
        for peer in list(self.peers.values()):
            peer.close()
