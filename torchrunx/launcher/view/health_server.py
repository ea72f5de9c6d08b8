"""The health endpoint: an HTTP ``GET /health`` that reports a running launch's state.

While a launch runs, the launcher can serve a snapshot of it
(:class:`~torchrunx.launcher.state.health.HealthReport`) over HTTP, for probes from outside the
process (a Kubernetes liveness probe, Nagios, ``curl``)::

    GET  /health   200 + JSON while the launch is healthy, 503 + the same JSON once not
    HEAD /health   the same status and headers, no body
    GET  /other    404 {"error": ...}
    POST /health   405 {"error": ...} (any method but GET and HEAD)
                   500 {"error": ...} when the snapshot itself fails

The server is the standard library's :class:`http.server.ThreadingHTTPServer`: one daemon
thread runs its ``serve_forever()`` loop and each request gets a short-lived daemon thread of
its own (a client has 10 s to send its request), at most :data:`MAX_CONNECTIONS` at once: a
connection beyond them gets a ``503`` and is closed at once, without a thread.
:meth:`HealthServer.close` stops the loop with ``shutdown()``, ends the connections still open
and waits at most 2 s for their threads.

Security: plain HTTP, without authentication unless ``TORCHRUNX_HEALTH_CHECK_TOKEN`` sets a
token (then a request needs ``Authorization: Bearer <token>``, else ``401``). Without one, on
``127.0.0.1`` every user of this machine (not only you) can read it. A request whose
``Host`` header names something else than ``localhost``, an IP address, or the address or name
the server listens on gets ``403``: a web page that DNS rebinding points at this machine (its
name resolving to ``127.0.0.1``) sends its own name, so a browser on this machine cannot be
made to read the report.

The launcher serves it on ``127.0.0.1`` unless ``TORCHRUNX_HEALTH_CHECK_HOST`` names another
address (``*``: every interface;
:func:`~torchrunx.launcher.settings.environ.health_host_from_env`), for probes from other
machines (a kubelet probes the pod's address, a monitoring server the node's). The report
holds host names, ranks, pids, states and, per failure, its attempt and exception type:
never the launch's secret, nor any environment value, nor what the function returned, nor an
exception's message, which may hold anything, unless ``TORCHRUNX_HEALTH_CHECK_DETAILS=1``
asks for the first line of each
(:func:`~torchrunx.launcher.settings.environ.health_details_from_env`,
:meth:`~torchrunx.launcher.state.health.HealthReport.redacted`).

The port comes from ``Launcher.health_check_port`` or, when that is not set,
``TORCHRUNX_HEALTH_CHECK_PORT``
(:func:`~torchrunx.launcher.settings.environ.health_port_from_env`).
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import ipaddress
import json
import logging
import socket
import socketserver
import threading
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from torchrunx.launcher.settings.environ import (
    DEFAULT_HEALTH_HOST,
    HEALTH_HOST_ENV_VAR,
    HEALTH_PORT_ENV_VAR,
)
from torchrunx.launcher.settings.environ import HEALTH_TOKEN_ENV_VAR as TOKEN_VAR

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from torchrunx.launcher.state.health import HealthReport

logger = logging.getLogger("torchrunx.health")

_EVERY_INTERFACE = ("", "0.0.0.0", "::")  # noqa: S104 (names, not a bind)

PATH = "/health"
"""The one path served."""

_POLL_INTERVAL = 0.1
"""Seconds between the serving thread's checks for :meth:`HealthServer.close`."""

_REQUEST_TIMEOUT = 10.0
"""Seconds a connection may take to send its request; a stalled client then loses its thread."""

_CLOSE_JOIN_TIMEOUT = 2.0
"""Seconds :meth:`HealthServer.close` waits, in all, for requests still being answered."""

MAX_CONNECTIONS = 16
"""Connections answered at once, each in a thread of its own; one more is closed at once, after
a short ``503`` if its socket takes it (a flood of idle connections cannot start more threads)."""

_LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
"""``Host`` header names always accepted: this machine, as a client on it names it."""

_BUSY_BODY = b'{"error": "too many connections at once; try again"}'
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\nCache-Control: no-store\r\nRetry-After: 1\r\n"
    b"Connection: close\r\n\r\n%s"
) % (len(_BUSY_BODY), _BUSY_BODY)

_MAX_DISCARDED_BODY = 1 << 16
"""A rejected request's body is read (and dropped) up to this size, so that closing the
connection does not reset it before the client has read the answer."""


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


class HealthServer:
    """Serves ``GET /health`` from a snapshot function, in a daemon thread.

    Example::

        server = HealthServer(8080, launch_state.health_report)
        server.start()  # OSError if the port cannot be bound
        try:
            ...  # run the launch
        finally:
            server.close()

    It is also a context manager (``with HealthServer(0, snapshot) as server: ...``), which
    starts it on entry and closes it on exit.
    """

    def __init__(
        self,
        port: int,
        snapshot: Callable[[], HealthReport],
        *,
        host: str = DEFAULT_HEALTH_HOST,
        details: bool = False,
        token: str | None = None,
    ) -> None:
        """Prepare the server; nothing is bound before :meth:`start`.

        Args:
            port: TCP port to listen on; 0 for any free port (see :attr:`port`).
            snapshot: Makes the report for one request. It is called from the server's request
                threads, possibly several at once, so it must be thread-safe, and quick.
            host: Address to listen on. The default ``"127.0.0.1"`` is this machine only
                (every local user included: see the security notes of
                :mod:`torchrunx.launcher.view.health_server`),
                as the launcher's default
                (:func:`~torchrunx.launcher.settings.environ.health_host_from_env`). ``""``: every
                interface (IPv6 and IPv4 where the machine has both), for probes from other
                machines; the report holds no secret and no environment value.
            details: Serve each failure's message (the first line of its exception), and, when
                the snapshot itself fails, the exception's message in the 500 answer. The
                default serves exception types only
                (:meth:`~torchrunx.launcher.state.health.HealthReport.redacted`): a message may hold
                anything the failing code put in it.
            token: Answer only requests with ``Authorization: Bearer <token>`` (others get
                ``401``). ``None`` or ``""``: no token (the launch gives the plan's, from
                :data:`~torchrunx.launcher.settings.environ.HEALTH_TOKEN_ENV_VAR`).

        Raises:
            ValueError: ``port`` is not from 0 to 65535.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"health check port {port!r} is not an integer from 0 to 65535")
        self._requested_port = port
        self._snapshot = snapshot
        self._host = host
        self._details = details
        self._token = token or None
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def port(self) -> int:
        """The port the server listens on (the one chosen by the system for port 0).

        Raises:
            RuntimeError: The server is not started.
        """
        if self._server is None:
            raise RuntimeError("the health server is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://HOST:PORT/health``, with this machine's name for the default host."""
        host = socket.gethostname() if self._host in _EVERY_INTERFACE else self._host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}{PATH}"

    def start(self) -> None:
        """Bind the port and start serving in a daemon thread.

        Raises:
            OSError: The port cannot be bound (in use, or a privileged port); the message names
                the port and how to choose another one.
            RuntimeError: The server was already started, or closed.
        """
        with self._lock:
            if self._closed or self._server is not None:
                raise RuntimeError("a HealthServer can be started once")
            try:
                server = _Server(
                    self._host, self._requested_port, self._snapshot, self._details, self._token
                )
            except OSError as error:
                reason = error.strerror or str(error)
                raise OSError(
                    f"cannot serve the health check on port {self._requested_port} of "
                    f"{self._host or 'all interfaces'}: {reason}. Choose another port with "
                    f"Launcher(health_check_port=...) or {HEALTH_PORT_ENV_VAR} (0: any free "
                    f"port), or another address with {HEALTH_HOST_ENV_VAR}"
                ) from error
            thread = threading.Thread(
                target=server.serve_forever,
                args=(_POLL_INTERVAL,),
                name="torchrunx-health",
                daemon=True,
            )
            thread.start()
            self._server, self._thread = server, thread
        logger.debug("health endpoint listening on port %d", self.port)

    def close(self) -> None:
        """Stop serving, end the requests in flight (waiting at most 2 s), close the socket.

        Calling it again, or on a server never started, does nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.shutdown()  # serve_forever() returns within one poll interval
        thread.join()
        server.end_requests(_CLOSE_JOIN_TIMEOUT)
        server.server_close()

    def __enter__(self) -> HealthServer:  # noqa: PYI034 (Self needs Python 3.11)
        """Start the server."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close the server."""
        self.close()


class _Server(http.server.ThreadingHTTPServer):
    allow_reuse_address = True  # SO_REUSEADDR: a port left in TIME_WAIT is usable at once

    def __init__(
        self,
        host: str,
        port: int,
        snapshot: Callable[[], HealthReport],
        details: bool,
        token: str | None = None,
    ) -> None:
        self.snapshot = snapshot
        self.details = details
        self.token = None if token is None else f"Bearer {token}".encode()
        self.snapshot_failed = False
        self._requests: dict[threading.Thread, socket.socket] = {}
        self._requests_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.host_names = _accepted_host_names(host)
        if host == "" and socket.has_dualstack_ipv6():
            self.address_family = socket.AF_INET6
            address = "::"
        else:
            self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            address = host
        super().__init__((address, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the host's FQDN (a DNS query); the name is not needed.
        if self.address_family == socket.AF_INET6:
            with contextlib.suppress(OSError, AttributeError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])

    def process_request(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: object
    ) -> None:
        # ThreadingMixIn's: one daemon thread per connection, which end_requests() can find.
        assert isinstance(request, socket.socket)  # noqa: S101 (a TCP server's request)
        if not self._slots.acquire(blocking=False):
            self._refuse_busy(request, client_address)
            return
        thread = threading.Thread(
            target=self._answer,
            args=(request, client_address),
            name="torchrunx-health-request",
            daemon=True,
        )
        with self._requests_lock:
            self._requests[thread] = request
        thread.start()

    def _answer(self, request: socket.socket, client_address: object) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._requests_lock:
                del self._requests[threading.current_thread()]
            self._slots.release()

    def _refuse_busy(self, request: socket.socket, client_address: object) -> None:
        """At the cap: a ``503`` if the socket takes it without waiting, then close, no thread."""
        logger.debug("health connection from %s refused: %d open", client_address, MAX_CONNECTIONS)
        with contextlib.suppress(OSError):
            request.settimeout(0.0)  # non-blocking: a full buffer drops the 503, not the loop
            request.send(_BUSY)
        self.shutdown_request(request)

    def authorized(self, header: str | None) -> bool:
        """Whether a request's ``Authorization`` header carries the token (if one is set)."""
        if self.token is None:
            return True
        given = (header or "").strip().encode("utf-8", "replace")
        return hmac.compare_digest(given, self.token)

    def host_accepted(self, header: str | None) -> bool:
        """Whether a request's ``Host`` header names this server (no header: yes).

        Accepted: ``localhost``, ``127.0.0.1``, ``[::1]``, the address or name it was told to
        listen on, this machine's name when it listens on every interface, and any IP address
        literal, with any port. A page that DNS rebinding turned against this machine's
        loopback sends its own domain name, which is none of these.
        """
        if header is None:
            return True
        name = _host_name(header)
        if name is None:
            return False
        if name in self.host_names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def end_requests(self, timeout: float) -> None:
        """End the connections still open and wait up to ``timeout`` s for their threads."""
        with self._requests_lock:
            requests = list(self._requests.items())
        for _, request in requests:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)  # a client still sending gets EOF at once
        deadline = time.monotonic() + timeout
        for thread, _ in requests:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.debug("a health request is still being answered after close()")

    def handle_error(
        self, request: socket.socket | tuple[bytes, socket.socket], client_address: object
    ) -> None:
        # The default prints a traceback on stderr (for example when a client hangs up early).
        # Called from socketserver's `except` clause, so exc_info is the request's error.
        del request
        logger.debug("health request from %s failed", client_address, exc_info=True)  # noqa: LOG014


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    server_version = "torchrunx-health"
    timeout = _REQUEST_TIMEOUT

    def version_string(self) -> str:
        return self.server_version  # no Python version in the Server header

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        host = self.headers.get("Host")
        if not self.server.host_accepted(host):
            self._discard_body()
            self._send_json(
                403,
                {"error": f"Host {host!r} is not this server's; ask for localhost or its address"},
            )
            return False
        if not self.server.authorized(self.headers.get("Authorization")):
            self._discard_body()
            self._send_json(
                401,
                {"error": f"send the token of {TOKEN_VAR}: Authorization: Bearer <token>"},
                www_authenticate='Bearer realm="torchrunx-health"',
            )
            return False
        if self.command not in ("GET", "HEAD"):
            self._discard_body()
            self._send_json(
                405,
                {"error": f"method {self.command} is not allowed; use GET or HEAD"},
                allow="GET, HEAD",
            )
            return False
        return True

    def do_GET(self) -> None:  # the name http.server looks up
        if urlsplit(self.path).path != PATH:
            self._send_json(404, {"error": f"not found: {PATH} is the only path served"})
            return
        try:
            report = self.server.snapshot()
            if not self.server.details:
                report = report.redacted()
            body = report.to_json()
        except Exception as error:  # any failure of the snapshot is a 500
            if not self.server.snapshot_failed:
                self.server.snapshot_failed = True
                logger.warning("the health report could not be made", exc_info=True)
            else:
                logger.debug("the health report could not be made", exc_info=True)
            text = (
                f"{type(error).__name__}: {error}" if self.server.details else type(error).__name__
            )
            self._send_json(500, {"error": text})
            return
        self._send(200 if report.healthy else 503, body)

    def do_HEAD(self) -> None:  # the name http.server looks up
        self.do_GET()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Malformed requests (400, 414, 431, 501, ...) get a JSON answer too.
        del explain
        default = self.responses.get(code, ("error",))[0]
        self._send_json(code, {"error": message or default})

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
        logger.debug("%s %s", self.address_string(), format % args)

    def _discard_body(self) -> None:
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) <= _MAX_DISCARDED_BODY:
            with contextlib.suppress(OSError):
                self.rfile.read(int(length))

    def _send_json(self, code: int, payload: dict[str, str], **headers: str) -> None:
        self._send(code, json.dumps(payload).encode(), **headers)

    def _send(self, code: int, body: bytes, **headers: str) -> None:
        self.close_connection = True
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        for name, value in headers.items():
            self.send_header(name.replace("_", "-").title(), value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _accepted_host_names(host: str) -> frozenset[str]:
    """The ``Host`` names a server listening on ``host`` accepts, besides IP literals."""
    names = set(_LOCAL_NAMES)
    if host in _EVERY_INTERFACE:
        names.add(socket.gethostname().lower())
    else:
        names.add(host.strip("[]").lower().rstrip("."))
    return frozenset(names)


def _host_name(header: str) -> str | None:
    """The name of a ``Host`` header without its port, in lower case (``None``: malformed)."""
    text = header.strip().lower()
    if text.startswith("["):  # [v6]:port
        end = text.find("]")
        if end < 0 or (end + 1 < len(text) and text[end + 1] != ":"):
            return None
        return text[1:end]
    name, _, port = text.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None
