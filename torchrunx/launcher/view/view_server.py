"""The view socket: a running launch's snapshot, for ``torchrunx top`` of the same user only.

Every launch (unless ``TORCHRUNX_VIEW=0``) listens on a Unix socket in the user's private
runtime folder (:func:`runtime_dir`: ``$XDG_RUNTIME_DIR/torchrunx``, else
``/tmp/torchrunx-<uid>``; mode 0700, owned by the user, or no socket at all). There is no
network port. A connection is served only if the peer's uid (``SO_PEERCRED``) is the launcher's
own; anything else is closed unread. A served connection gets one JSON line per
:data:`INTERVAL_S`: the launch's health snapshot (:meth:`HealthReport.to_dict`), what it is
(its pid, start time, log folder, hosts), each source's last log line, and the latest answer
to each kind of request (``looks``: its number, and its text the first time it is sent on that
connection). A viewer may write a word on its connection to ask for something (the stacks, the
diagnosis: handed to the ``request`` callback); nothing else it writes is read as a command.
Reading never changes the launch; the socket file is removed when the launch ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5
"""Seconds between two snapshots sent on a connection."""
MAX_VIEWERS = 8
"""Connections served at once; one more is closed at once."""
LAST_LINE_CHARS = 200
"""A source's last log line is cut to this many characters."""


UNIX_PATH_BYTES = 107
"""The longest path a Unix socket's address holds (108 bytes with its closing NUL)."""


GROUP_ABOVE = 64
"""Above this many ranks a snapshot has counts per host and state, not a row per rank."""
COST_SHARE = 0.05
"""The most of one core a viewer may cost the launcher: the next snapshot waits at least this
many times longer than the last one took to make (20 times, for 5%)."""


def grouped(
    report: dict[str, Any],
    ranks: Iterable[tuple[str, str]],
    agents: Iterable[tuple[str, str, float | None, str]],
) -> dict[str, Any]:
    """A launch's summary at scale: the report's own fields, ranks counted per host and state.

    Args:
        report: The health report without its rows (``HealthReport.to_dict``).
        ranks: ``(hostname, state)`` of each rank.
        agents: ``(hostname, state, heartbeat age, role)`` of each agent: those not running
            are listed, the others counted.
    """
    counts = Counter(ranks)
    listed, running = [], 0
    for hostname, state, age, role in agents:
        if state == "RUNNING" and role == "host":
            running += 1
        else:
            listed.append(
                {"hostname": hostname, "state": state, "last_heartbeat_age": age, "role": role}
            )
    return {
        **report,
        "agents": listed,
        "agents_running": running,
        "groups": [[host, state, n] for (host, state), n in sorted(counts.items())],
    }


def unsent(snapshot: dict[str, Any], sent: dict[str, int]) -> dict[str, Any]:
    """The snapshot for one connection: the text of an answer (``looks``) sent once only.

    ``sent``: the number of each kind's answer this connection got (updated here).
    """
    looks = snapshot.get("looks")
    if not looks:
        return snapshot
    trimmed = {}
    for kind, look in looks.items():
        number = look["number"]
        trimmed[kind] = look if sent.get(kind) != number else {"number": number}
        sent[kind] = number
    return {**snapshot, "looks": trimmed}


def runtime_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The user's private folder for view sockets, made if missing; None if none is safe.

    ``$XDG_RUNTIME_DIR/torchrunx`` when that variable names a folder of the user's, else
    ``/tmp/torchrunx-<uid>``. The folder must be the user's, mode 0700, and not a link: a folder
    of that name made by someone else is refused (no view), never used.
    """
    # os.environ only outside a launch (torchrunx top, a view made alone): a launch's view
    # server gives its plan's environment.
    env = os.environ if environ is None else environ
    base = env.get("XDG_RUNTIME_DIR")
    me = os.geteuid()
    if base and os.path.isdir(base) and os.stat(base).st_uid == me:  # noqa: PTH112, PTH116
        folder = Path(base) / "torchrunx"
    else:
        folder = Path("/tmp") / f"torchrunx-{me}"  # noqa: S108 (checked below: ours, 0700)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    try:
        info = folder.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != me or stat.S_IMODE(info.st_mode) & 0o077:
        logger.debug("%s is not a private folder of this user: no view socket", folder)
        return None
    return folder


@contextlib.contextmanager
def unix_address(path: Path) -> Iterator[str]:
    """An address for the socket file ``path`` that a Unix socket can bind or connect to.

    ``path`` itself when it fits (:data:`UNIX_PATH_BYTES`); else the same file reached through
    an open handle on its folder (``/proc/self/fd/N/NAME``), valid until the block ends. A
    runtime folder deep in a long path (``XDG_RUNTIME_DIR`` set by a job, a test's temporary
    folder) still gets its view, and ``torchrunx top`` still reaches it.
    """
    if len(os.fsencode(path)) <= UNIX_PATH_BYTES:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


def prune_dead(folder: Path) -> list[Path]:
    """Remove the sockets of launchers that are gone (killed before they could); those removed.

    A socket is named by its launcher's pid (``PID-TOKEN.sock``, or ``PID-TOKEN.new``
    before it listens); one whose pid no longer runs is a leftover. The folder is the user's own
    (:func:`runtime_dir`).
    """
    removed = []
    for path in (*folder.glob("*.sock"), *folder.glob("*.new")):
        pid = path.name.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class ViewServer:
    """Serves a launch's snapshot on a private Unix socket (owned by the launcher's process).

    Args:
        snapshot: Called from the server's threads: the launch's state as plain data.
        info: What the launch is (pid, start, log folder, hosts): sent with every snapshot.
        request: Called from the server's threads with each word a viewer writes.
    """

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        info: dict[str, Any],
        request: Callable[[str], None] | None = None,
        *,
        runtime: Mapping[str, str] | None = None,
    ) -> None:
        """Keep what to serve; nothing is opened before :meth:`start`.

        ``runtime``: the environment that names the user's runtime folder (a launch gives its
        plan's, :func:`runtime_dir`); None: this process's.
        """
        self._runtime = runtime
        self._snapshot = snapshot
        self._info = info
        self._request = request
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.path: Path | None = None

    def start(self) -> None:
        """Listen, if the user has a private runtime folder; a failure only means no view."""
        folder = runtime_dir(self._runtime)
        if folder is None:
            return
        prune_dead(folder)
        path = folder / f"{os.getpid()}-{secrets.token_hex(4)}.sock"
        # Bound under another name, and given its own once it listens: a socket named
        # ``*.sock`` that refuses a connection is a dead launch's, which any ``torchrunx top``
        # (find_views) removes, and one bound but not yet listening refuses too. The name is
        # no longer than the socket's; a path too long for an address is bound through its
        # folder (unix_address), and viewers reach it the same way.
        bound = path.with_suffix(".new")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with unix_address(bound) as address:
                sock.bind(address)
            bound.chmod(0o600)
            sock.listen(MAX_VIEWERS)
            bound.rename(path)
        except OSError as exc:
            sock.close()
            bound.unlink(missing_ok=True)  # the rename comes last: nothing has the final name
            logger.debug("no view socket: %s", exc)
            return
        self._sock, self.path = sock, path
        thread = threading.Thread(target=self._accept, name="torchrunx-view", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        sock = self._sock
        assert sock is not None  # noqa: S101 (started only with one)
        while not self._stop.is_set():
            try:  # blocks until a viewer comes; close() wakes it (shutdown): no polling
                conn, _ = sock.accept()
            except OSError:
                return
            if peer_uid(conn) != os.geteuid() or self._viewers() >= MAX_VIEWERS:
                conn.close()  # another user's, or one too many: unread
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._lock:
                self._threads.append(thread)
            thread.start()

    def _viewers(self) -> int:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            return len(self._threads) - 1

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)  # a viewer that does not read is dropped, never waited on
        sent: dict[str, int] = {}
        with self._lock:
            self._conns.add(conn)
        with conn:
            while True:  # the last snapshot is sent after close(): how the launch ended
                started = time.monotonic()
                try:
                    snapshot = unsent(self._snapshot(), sent)
                    line = json.dumps({**self._info, **snapshot}, default=str) + "\n"
                    conn.sendall(line.encode())
                except (OSError, ValueError, RuntimeError):
                    break
                if self._stop.is_set():
                    break
                took = time.monotonic() - started
                if not self._wait(conn, max(INTERVAL_S - took, took / COST_SHARE - took)):
                    break
        with self._lock:
            self._conns.discard(conn)

    def _wait(self, conn: socket.socket, seconds: float) -> bool:
        """Wait for the next snapshot, taking the viewer's requests; False: the viewer left."""
        deadline = time.monotonic() + seconds
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if not select.select([conn], [], [], left)[0]:
                break
            try:
                data = conn.recv(256)
            except OSError:
                return False
            if not data:  # the viewer left, or close() woke this wait
                return self._stop.is_set()
            for word in data.decode(errors="replace").split():
                if self._request is not None:
                    self._request(word)
        return True

    def close(self) -> None:
        """Stop serving, remove the socket file, and wait (bounded) for the threads."""
        self._stop.set()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # wakes their waits; the last snapshot still goes out
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        if self._sock is not None:
            with contextlib.suppress(OSError):  # wakes the accept at once (a close alone does not)
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        deadline = time.monotonic() + 2.0
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
