"""The host side of ``torchrunx check``: what one host can do, printed as one JSON line.

Started exactly as an agent would be (the same command over SSH, ``srun`` or a local
subprocess, the same forwarded variables, working directory, ``env_file`` and interpreter),
with the boot code calling :func:`main` instead of the agent. It reads one JSON line on stdin
(:class:`ProbeRequest`), then:

1. connects back to the launcher's address and port, as an agent would, and says who it is
   (a random token of this check, its host index, and on host 0 the port of step 2);
2. on host 0: listens on a free port, as the agent of host 0 does for the rendezvous store
   (``MASTER_PORT``), and waits for the other hosts to connect to it (every connection read
   at once, each with its own deadline, so idle strangers hold up no one); on the other
   hosts: connects to host 0 there;
3. counts GPUs and CPUs as an agent does, and reads the versions of Python, torchrunx and torch
   (torch's from its installed metadata: nothing is imported);

and prints ``torchrunx-probe <JSON>`` (:class:`ProbeReport`) on stdout. Nothing it receives is
unpickled; what it sends back is a short line of text. Every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import selectors
import socket
import sys
import time
from importlib import metadata
from typing import Any

from torchrunx.agent.guardian import missing_pidfds
from torchrunx.agent.store import listen_address, listening_socket
from torchrunx.devices import count_local_cpus, count_local_gpus

REPORT_PREFIX = "torchrunx-probe "
"""The start of the report's line on the probe's stdout."""

_LINE_LIMIT = 256
"""Bytes a peer may send before its line ends (a token, an index and a port)."""
_PEER_WAIT = 2.0
"""Seconds a connection to host 0's port gets to send its line (a probe sends it at once)."""
_PEERS_AT_ONCE = 256
"""Connections host 0 reads at once at most; past it the oldest is dropped."""
_ACCEPTS_PER_TURN = 64
"""Connections accepted between two reads: a flood cannot push out, unread, a line that came."""


@dataclasses.dataclass(frozen=True)
class ProbeRequest:
    """What the launcher tells the probe of one host (one JSON line on stdin).

    Attributes:
        sys_path: The launcher's ``sys.path`` (as for an agent; read by the boot code).
        host_index: This host's index in the launch.
        address: The launcher's address, as this host is told to reach it.
        port: The launcher's port for this check.
        token: The check's random token: said on every connection of the check.
        timeout: Seconds each network step may take.
        master: Host 0's address and port for the other hosts (``None`` on host 0, or when
            host 0 did not answer).
        peers: On host 0: how many hosts will connect to it.
        local_only: Every host is the launcher's machine: host 0 listens on loopback only.
        keep_path: The host runs its own interpreter or shipped code: its ``sys.path`` is kept
            after ``sys_path`` (as for an agent; read by the boot code).
        package_root: The entry that holds the launcher's torchrunx (as for an agent; read by
            the boot code).
    """

    sys_path: tuple[str, ...]
    host_index: int
    address: str
    port: int
    token: str
    timeout: float
    master: tuple[str, int] | None
    peers: int
    local_only: bool
    keep_path: bool = False
    package_root: str = ""

    def to_json_line(self) -> bytes:
        """The request as one line of JSON."""
        return json.dumps(dataclasses.asdict(self)).encode() + b"\n"

    @classmethod
    def from_json(cls, line: bytes) -> ProbeRequest:
        """Read a request from its JSON line."""
        raw: dict[str, Any] = json.loads(line)
        master = raw["master"]
        return cls(
            sys_path=tuple(raw["sys_path"]),
            host_index=int(raw["host_index"]),
            address=str(raw["address"]),
            port=int(raw["port"]),
            token=str(raw["token"]),
            timeout=float(raw["timeout"]),
            master=None if master is None else (str(master[0]), int(master[1])),
            peers=int(raw["peers"]),
            local_only=bool(raw["local_only"]),
            keep_path=bool(raw.get("keep_path", False)),
            package_root=str(raw.get("package_root", "")),
        )


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """What the probe of one host found (its JSON line); ``None``: not found or not checked.

    Attributes:
        hostname: The host's own name (``socket.gethostname()``).
        python: The interpreter's path.
        python_version: ``platform.python_version()``.
        torchrunx: torchrunx's version, as imported by this interpreter.
        torch: torch's installed version (its metadata), or ``None`` if it is not installed.
        gpus: GPUs an agent would count here.
        cpus: CPU cores an agent would count here.
        cwd: The working directory (the launcher's).
        route_back: ``"ok"``, or why the launcher could not be reached.
        master: On host 0: ``"ok"`` (every other host connected), or what is missing; on the
            others: ``"ok"`` or why host 0 could not be reached; ``None`` with one host, or
            when host 0 did not answer (not tried).
        pidfds: ``None``, or why this kernel cannot run an agent.
        seconds: How long the probe took.
    """

    hostname: str
    python: str
    python_version: str
    torchrunx: str
    torch: str | None
    gpus: int
    cpus: int
    cwd: str
    route_back: str
    master: str | None
    pidfds: str | None
    seconds: float

    def to_line(self) -> str:
        """The report's line on stdout."""
        return REPORT_PREFIX + json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_line(cls, line: str) -> ProbeReport | None:
        """The report of a line of the probe's stdout; ``None`` if it is no (valid) report."""
        if not line.startswith(REPORT_PREFIX):
            return None
        try:
            raw = json.loads(line[len(REPORT_PREFIX) :])
            return cls(**{field.name: raw[field.name] for field in dataclasses.fields(cls)})
        except (ValueError, KeyError, TypeError):
            return None


def main(line: bytes) -> None:
    """Entry point, called by the boot code with the request line."""
    started = time.monotonic()
    request = ProbeRequest.from_json(line)
    deadline = time.monotonic() + request.timeout
    listener = None
    if request.host_index == 0 and request.peers > 0:
        listener = listening_socket(listen_address(local_only=request.local_only))
    back: socket.socket | None = None
    try:
        master_port = 0 if listener is None else listener.getsockname()[1]
        back, route_back = _connect(
            (request.address, request.port),
            f"{request.token} {request.host_index} {master_port}",
            request.timeout,
        )
        if listener is not None:
            # Until every other host came, or the launcher says that those still missing
            # will not come (it closes this connection once their checks are over).
            master: str | None = _await_peers(
                listener, request.token, request.peers, deadline, back
            )
        elif request.master is not None:
            master = _say(request.master, request.token, request.timeout)
        else:  # one host, or host 0 did not answer (its own line says why): not tried
            master = None
    finally:
        if listener is not None:
            listener.close()
        if back is not None:
            back.close()
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    # The package is loaded (this module is in it); its __init__ names launcher-side modules,
    # which the host side never imports.
    version = str(sys.modules["torchrunx"].__version__)
    report = ProbeReport(
        hostname=socket.gethostname(),
        python=sys.executable,
        python_version=platform.python_version(),
        torchrunx=version,
        torch=torch_version,
        gpus=count_local_gpus(),
        cpus=count_local_cpus(),
        cwd=os.getcwd(),  # noqa: PTH109
        route_back=route_back,
        master=master,
        pidfds=missing_pidfds(),
        seconds=round(time.monotonic() - started, 3),
    )
    sys.stdout.write(report.to_line() + "\n")
    sys.stdout.flush()


def _connect(
    address: tuple[str, int], words: str, timeout: float
) -> tuple[socket.socket | None, str]:
    """Connect to ``address`` and send ``words`` as one line.

    Returns the open connection and ``"ok"``, or ``None`` and why it failed.
    """
    try:
        conn = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        return None, _why(address, exc)
    try:
        conn.sendall(words.encode() + b"\n")
    except OSError as exc:
        conn.close()
        return None, _why(address, exc)
    return conn, "ok"


def _say(address: tuple[str, int], words: str, timeout: float) -> str:
    """Send ``words`` to ``address`` and wait until it has read them: ``"ok"``, or why not."""
    conn, said = _connect(address, words, timeout)
    if conn is None:
        return said
    with conn, contextlib.suppress(OSError):
        conn.settimeout(timeout)
        conn.recv(1)  # the other side closes once it has read the line
    return said


def _why(address: tuple[str, int], exc: OSError) -> str:
    what = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
    return f"cannot connect to {address[0]}:{address[1]}: {what}"


def _await_peers(
    listener: socket.socket,
    token: str,
    peers: int,
    deadline: float,
    launcher: socket.socket | None,
) -> str:
    """On host 0: wait until ``peers`` hosts said ``token``; ``"ok"``, or how many did.

    Every connection is read as its bytes come, at once (a selector), each until its own
    deadline (:data:`_PEER_WAIT`), and past :data:`_PEERS_AT_ONCE` unread connections the
    oldest is dropped: strangers that connect and say nothing never hold up a host's line.
    Stops early when ``launcher`` (the connection back) becomes readable: the launcher closes
    it once the other hosts' checks are over.
    """
    heard = 0
    pending: dict[socket.socket, _Peer] = {}
    with selectors.DefaultSelector() as selector:
        listener.setblocking(False)  # noqa: FBT003 (socket API)
        selector.register(listener, selectors.EVENT_READ)
        if launcher is not None:
            selector.register(launcher, selectors.EVENT_READ)
        try:
            released = False
            while heard < peers and not released:
                now = time.monotonic()
                for conn in [c for c, peer in pending.items() if peer.until <= now]:
                    _forget(selector, pending, conn)
                if now >= deadline:
                    break
                wait = min([deadline, *(peer.until for peer in pending.values())]) - now
                for key, _ in selector.select(max(0.0, wait)):
                    if key.fileobj is launcher:
                        released = True  # after this turn's lines: they were sent before it
                    elif key.fileobj is listener:
                        _accept_peers(listener, selector, pending)
                    else:
                        heard += _read_peer(selector, pending, key.fileobj, token)  # type: ignore[arg-type]
        finally:
            for conn in list(pending):
                _forget(selector, pending, conn)
    if heard >= peers:
        return "ok"
    return (
        f"{heard} of the {peers} other hosts connected to this host's port "
        f"{listener.getsockname()[1]}"
    )


@dataclasses.dataclass
class _Peer:
    """A connection to host 0's port whose line is being read."""

    until: float
    data: bytes = b""


def _accept_peers(
    listener: socket.socket, selector: selectors.BaseSelector, pending: dict[socket.socket, _Peer]
) -> None:
    """Accept the connections waiting on ``listener`` (some of them); each is read from now on."""
    for _ in range(_ACCEPTS_PER_TURN):
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # out of descriptors: the next turn tries again
            return
        if len(pending) >= _PEERS_AT_ONCE:
            _forget(selector, pending, next(iter(pending)))  # the oldest
        conn.setblocking(False)  # noqa: FBT003 (socket API)
        pending[conn] = _Peer(until=time.monotonic() + _PEER_WAIT)
        selector.register(conn, selectors.EVENT_READ)


def _read_peer(
    selector: selectors.BaseSelector,
    pending: dict[socket.socket, _Peer],
    conn: socket.socket,
    token: str,
) -> int:
    """Read what ``conn`` sent; 1 when its whole line is this check's token, else 0.

    A connection whose line is whole (or too long, or that ended) is closed: the host that sent
    it waits for that close, so it knows its line was read. One forgotten earlier in the same
    turn (dropped for a newer one: the listener's event came first) is skipped.
    """
    peer = pending.get(conn)
    if peer is None:  # forgotten for a newer connection earlier in this turn: closed
        return 0
    try:
        chunk = conn.recv(_LINE_LIMIT - len(peer.data))
    except (BlockingIOError, InterruptedError):
        return 0
    except OSError:
        chunk = b""
    peer.data += chunk
    if chunk and b"\n" not in peer.data and len(peer.data) < _LINE_LIMIT:
        return 0  # more to come
    _forget(selector, pending, conn)
    return int(peer.data.partition(b"\n")[0].decode(errors="replace") == token)


def _forget(
    selector: selectors.BaseSelector, pending: dict[socket.socket, _Peer], conn: socket.socket
) -> None:
    """Stop reading ``conn`` and close it."""
    selector.unregister(conn)
    del pending[conn]
    conn.close()
