"""A port of a remote host made reachable on this machine, through an agent's SSH connection.

Used for an IDE's debugger (``TORCHRUNX_DEBUGPY``): the chosen rank's debugpy listens on its
own host's ``127.0.0.1:PORT``; :class:`PortForward` listens on this machine's
``127.0.0.1:PORT`` and carries each connection to it over a ``direct-tcpip`` channel of the
SSH connection that started that host's agent, as ``ssh -L PORT:127.0.0.1:PORT host`` would.
One thread serves every connection of a forward (a selector over the sockets and channels);
:meth:`PortForward.close` ends them all. Only this user's processes are carried: a connection
whose other end another user made (:func:`torchrunx.peercred.same_user`) is closed unread,
before any channel opens.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
from typing import TYPE_CHECKING, Union

from torchrunx.peercred import same_user

if TYPE_CHECKING:
    from collections.abc import Callable

    import paramiko

logger = logging.getLogger("torchrunx.launcher.forward")  # its name from before it moved here

_CHUNK = 65536
_End = Union["socket.socket", "paramiko.Channel"]
"""One end of a forwarded connection: the local socket or its SSH channel."""


class PortForward:
    """``127.0.0.1:port`` here, carried to ``127.0.0.1:remote_port`` on the remote host."""

    def __init__(
        self,
        open_channel: Callable[[tuple[str, int], tuple[str, int]], paramiko.Channel],
        port: int,
        remote_port: int,
    ) -> None:
        """Listen on this machine's ``127.0.0.1:port`` and start serving.

        ``open_channel(destination, origin)`` opens a ``direct-tcpip`` channel (paramiko's
        ``Transport.open_channel`` with that kind).

        Raises:
            OSError: The port cannot be listened on here (in use, or not allowed).
        """
        self._open_channel = open_channel
        self._remote = ("127.0.0.1", remote_port)
        self._server = socket.create_server(("127.0.0.1", port))
        self._server.settimeout(0.0)
        self.port: int = self._server.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._pairs: dict[_End, _End] = {}
        """Each end's other end: a local socket and its channel, both ways."""
        self._closed = False
        self.refused = 0
        """Connections closed unread: another user's."""
        self._thread = threading.Thread(target=self._serve, name="torchrunx-forward", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select(1.0):
                if key.fileobj is self._wake_read:
                    return
                if key.fileobj is self._server:
                    self._accept()
                else:
                    self._pump(key.fileobj)  # a socket or a channel

    def _accept(self) -> None:
        try:
            conn, origin = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        if not same_user(conn):
            self.refused += 1
            logger.warning(
                "refused a connection to the forwarded port %d from another user's process",
                self.port,
            )
            conn.close()
            return
        try:
            channel = self._open_channel(self._remote, origin[:2])
        except Exception as exc:  # noqa: BLE001 (any failure of this one connection)
            logger.warning("cannot forward a connection to %s: %s", self._remote, exc)
            conn.close()
            return
        self._pairs[conn] = channel
        self._pairs[channel] = conn
        self._selector.register(conn, selectors.EVENT_READ, None)
        self._selector.register(channel, selectors.EVENT_READ, None)

    def _pump(self, source: _End) -> None:
        target = self._pairs.get(source)
        if target is None:
            return
        try:
            data = source.recv(_CHUNK)
            if data:
                target.sendall(data)
                return
        except OSError:
            pass
        self._drop(source)

    def _drop(self, end: _End) -> None:
        other = self._pairs.pop(end, None)
        for one in (end, other):
            if one is None:
                continue
            self._pairs.pop(one, None)
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(one)
            with contextlib.suppress(Exception):
                one.close()

    def close(self) -> None:
        """Stop listening, end every forwarded connection, and wait for the thread (1 s)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_write.send(b"\0")
        self._thread.join(1.0)
        for end in list(self._pairs):
            self._drop(end)
        self._selector.close()
        for sock in (self._server, self._wake_read, self._wake_write):
            sock.close()
