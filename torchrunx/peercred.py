"""Who is at the other end of a loopback TCP connection: its owner's uid and its socket.

A TCP port on ``127.0.0.1`` can be reached by every user of the machine. Where torchrunx
accepts on such a port a connection that must be the user's own (an IDE attaching to a rank's
debugger, see :mod:`torchrunx.worker.debugger` and :mod:`torchrunx.engines.forward`), it asks
the kernel who made the other end: ``/proc/net/tcp`` (and ``tcp6``) lists every socket of this
network namespace with the uid of its owner and its inode. The other end of an accepted
connection is the row whose local address is our peer's and whose remote address is ours.
An inode also tells whether a socket is held by a given process (its ``/proc/PID/fd`` links).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PeerSocket:
    """The socket at the other end of a connection, as the kernel lists it."""

    uid: int
    """The uid of the user whose process made it."""
    inode: int
    """Its inode: ``socket:[INODE]`` in the ``/proc/PID/fd`` of each process that holds it."""


def proc_address(host: str, port: int) -> str:
    """``host:port`` as ``/proc/net/tcp{,6}`` writes it (words in this machine's byte order)."""
    import ipaddress  # noqa: PLC0415 (every worker imports this module; few read a table)

    raw = ipaddress.ip_address(host).packed
    words = "".join(
        f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4)
    )
    return f"{words}:{port:04X}"


def find_peer(table: str, local: tuple[str, int], peer: tuple[str, int]) -> PeerSocket | None:
    """In ``table`` (``/proc/net/tcp``'s text), the socket at ``peer`` connected to ``local``.

    None if no row has ``peer`` as its local end and ``local`` as its remote end (the peer
    closed already, or it is not on this machine).
    """
    mine, theirs = proc_address(*local), proc_address(*peer)
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        if fields[1].upper() == theirs and fields[2].upper() == mine:
            return PeerSocket(uid=int(fields[7]), inode=int(fields[9]))
    return None


def loopback_peer(sock: socket.socket) -> PeerSocket | None:
    """The other end of ``sock``, a connected TCP socket, if it is on this machine."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    table = Path("/proc/net/tcp6" if sock.family == socket.AF_INET6 else "/proc/net/tcp")
    try:
        text = table.read_text()
    except OSError:
        return None
    return find_peer(text, (local[0], local[1]), (peer[0], peer[1]))


def held_by(inode: int, pid: int | str = "self") -> bool:
    """Whether process ``pid`` (this one by default) holds the socket ``inode``."""
    wanted = f"socket:[{inode}]"
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if str(fd.readlink()) == wanted:
                return True
    return False


def same_user(sock: socket.socket) -> bool:
    """Whether the other end of ``sock`` was made by this process's user (False if unknown)."""
    peer = loopback_peer(sock)
    return peer is not None and peer.uid == os.geteuid()
