"""The agent's connection to the launcher: its socket and stdin, and nothing they mean.

:class:`LauncherLink` owns the authenticated connection the agent made in
:func:`torchrunx.agent.agent.main`: it registers the socket and stdin on the agent's selector, sends
through the :class:`~torchrunx.agent.outbox.Outbox` (never blocking; the socket is watched for room
while data waits, and the workers' output is paused while too much does), keeps the
:class:`~torchrunx.agent.watchdog.Heartbeats` both ways, decides when the launcher is lost (a cut or
bad stream, EOF on stdin, silence past the bootstrap's ``timings.launcher_silence``), and ends the
stream cleanly (:meth:`LauncherLink.finish`). :class:`_ToLauncher` sends the agent's own ``logging``
records on it, so "worker N exited" never overtakes that worker's output.

What a message means is the agent's business: the link hands over what arrives
(:meth:`LauncherLink.on_ready`) and calls the agent back when the launcher is lost (the agent
stops its workers) and when the outbox pauses or resumes the workers' output.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import selectors
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

from torchrunx.agent.outbox import Outbox
from torchrunx.agent.watchdog import Heartbeats
from torchrunx.errors import ProtocolError
from torchrunx.wire.messages import AgentDone, Heartbeat, LogLines

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from torchrunx.wire.bootstrap import AgentTimings
    from torchrunx.wire.messages import Message, WorkerUsage
    from torchrunx.wire.records import Connection

logger = logging.getLogger("torchrunx.agent")


class _ToLauncher(logging.Handler):
    """Sends the agent's own records on its connection, in order with its workers' output.

    On stderr they would travel apart from the workers' lines (a pipe or SSH channel read
    by another thread of the launcher), so "worker 0 exited" could overtake the worker's last
    lines. Records of other threads, of forked children, or after the launcher is gone go
    to ``fallback`` (stderr) instead.
    """

    def __init__(self, link: LauncherLink, fallback: logging.Handler) -> None:
        super().__init__()
        self.link = link
        self.fallback = fallback
        self.pid = os.getpid()
        self.setFormatter(logging.Formatter())

    def emit(self, record: logging.LogRecord) -> None:
        """Queue the record as a :class:`LogLines` entry with no local rank (the agent's)."""
        link = self.link
        if (
            os.getpid() != self.pid
            or threading.current_thread() is not threading.main_thread()
            or not link.alive
            or link.closed
        ):
            self.fallback.handle(record)
            return
        try:
            link.send_record(record.levelno, record.name, self.format(record), record.created)
        except Exception:  # noqa: BLE001 (logging's contract: a handler reports, never raises)
            self.handleError(record)


class LauncherLink:
    """The agent's side of its connection to the launcher (created by the agent)."""

    def __init__(
        self,
        connection: Connection,
        selector: selectors.BaseSelector,
        *,
        timings: AgentTimings,
        on_lost: Callable[[], None],
        on_backpressure: Callable[[bool], None],
    ) -> None:
        """Register the socket (data ``"launcher"``) and stdin (``"stdin"``) on ``selector``.

        ``on_lost``: called each time the launcher is found gone. ``on_backpressure``: called
        with whether the workers' output should pause, after each change of the outbox.
        ``timings``: the bootstrap's (heartbeats, the launcher's silence).
        """
        self.conn = connection
        self.usage: Callable[[float], tuple[WorkerUsage, ...]] = lambda _: ()
        """What the workers use now, sent in each heartbeat (the agent's
        :mod:`~torchrunx.agent.usage`)."""
        self.selector = selector
        self.on_lost = on_lost
        self.on_backpressure = on_backpressure
        # A timeout also makes the socket's descriptor non-blocking, which the outbox needs.
        self.conn.sock.settimeout(timings.launcher_silence)
        self.outbox = Outbox(self.conn.sock, self.conn.sealer)
        self.heartbeats = Heartbeats(timings.heartbeat_interval, timings.launcher_silence)
        self.events = selectors.EVENT_READ
        """What the selector watches the socket for (0 once the launcher is lost)."""
        self.selector.register(self.conn.sock, self.events, "launcher")
        self.selector.register(0, selectors.EVENT_READ, "stdin")
        self.closed = False
        """Set when the agent closes: records logged from then on go to stderr."""

    @property
    def alive(self) -> bool:
        """Whether the launcher still listens (no EOF, no broken connection, not silent)."""
        return self.outbox.alive

    def forward_logging(self) -> None:
        """From now on, send this process's ``logging`` records on the launcher connection."""
        root = logging.getLogger()
        fallback = root.handlers[0] if root.handlers else logging.StreamHandler(sys.stderr)
        root.handlers[:] = [_ToLauncher(self, fallback)]

    def send_record(self, levelno: int, name: str, text: str, created: float) -> None:
        """Send one of the agent's own records (no local rank) after what is already queued."""
        self.send(LogLines(((None, levelno, name, text, created),)))

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Queue what is sent meanwhile, and write it at the end, at once (one loop turn).

        Messages sent together share records (see :mod:`torchrunx.agent.outbox`); nothing
        waits longer than the turn. Nested holds write at the end of the outermost.
        """
        if self.outbox.held:
            yield
            return
        self.outbox.held = True
        try:
            yield
        finally:
            self.outbox.held = False
            if len(self.outbox):
                self.outbox.flush()
                self._after_send()

    def send(
        self, message: Message, payload: Sequence[bytes | bytearray | memoryview] = ()
    ) -> None:
        """Queue a message and its payload parts for the launcher; sent as the socket takes it."""
        self.outbox.put(message, payload)
        self._after_send()

    def _after_send(self) -> None:
        """Follow the outbox: watch the socket for room while it holds data; backpressure."""
        if not self.outbox.alive:
            if self.events:
                self.lose()
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if len(self.outbox) else 0)
        if events != self.events:
            self.selector.modify(self.conn.sock, events, "launcher")
            self.events = events
        self.on_backpressure(self.outbox.paused)

    def lose(self) -> None:
        """The launcher is gone, or unreachable: send nothing more, and stop the workers."""
        self.outbox.lose()
        if self.events:
            self.events = 0
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.conn.sock)
        self.on_lost()

    def on_ready(self, events: int) -> tuple[Message, list[bytearray]] | None:
        """The socket is ready: send what it takes; return the message that came, if any."""
        if events & selectors.EVENT_WRITE:
            self.outbox.flush()
            self._after_send()
        if events & selectors.EVENT_READ and self.alive:
            return self._receive()
        return None

    def _receive(self) -> tuple[Message, list[bytearray]] | None:
        try:
            message, payload = self.conn.recv()
        except Exception as exc:  # noqa: BLE001 (a bad record or frame, a cut stream: all lost)
            if not isinstance(exc, OSError | ProtocolError):
                logger.warning("dropping the launcher's connection: %r", exc)
            self.lose()
            return None
        self.heartbeats.heard()
        return message, payload

    def on_stdin(self) -> None:
        """Stdin is readable: at EOF the launcher (or its SSH connection) is gone."""
        if not os.read(0, 4096):
            self.selector.unregister(0)
            self.lose()

    def on_timers(self, now: float) -> None:
        """Send a heartbeat when one is due; take a silent launcher for lost."""
        if self.heartbeats.due(now):
            self.send(Heartbeat(self.usage(now)))
        if self.alive:
            silent = self.heartbeats.silent_for(now, self.conn.sock)
            if silent is not None:
                logger.warning("no heartbeat from the launcher for %.1f s: stopping", silent)
                self.lose()

    def next_deadline(self) -> float:
        """When :meth:`on_timers` has something to do next (monotonic)."""
        return self.heartbeats.next_deadline(launcher_alive=self.alive)

    def finish(self, timeout: float) -> None:
        """Send :class:`AgentDone`, deliver what is queued, and end the stream cleanly.

        Bounded by ``timeout`` (the bootstrap's ``timings.finish_timeout``). The agent half-closes
        its side and reads (heartbeats) until the launcher, having read everything, closes its own:
        a socket closed with unread data is reset, and a reset can drop what was still on its way,
        ``AgentDone`` included.
        """
        self.send(AgentDone())
        deadline = time.monotonic() + timeout
        self.outbox.drain(deadline)
        if self.outbox.alive and not len(self.outbox):
            self.conn.send_close()  # everything went: end the stream with its close record
            _half_close_and_drain(self.conn.sock, deadline)


def _half_close_and_drain(sock: socket.socket, deadline: float) -> None:
    """Shut our side of ``sock`` for writing, then read until the peer closes or ``deadline``."""
    try:
        sock.shutdown(socket.SHUT_WR)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            if not poller.poll(math.ceil(min(left, 1.0) * 1000)):
                continue
            with contextlib.suppress(BlockingIOError, InterruptedError):
                if not sock.recv(65536, socket.MSG_DONTWAIT):
                    return
    except OSError:  # reset or gone: nothing more to wait for
        return
