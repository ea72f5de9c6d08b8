"""The health endpoint against a browser turned on it, and against a flood of connections."""

from __future__ import annotations

import contextlib
import http.client
import select
import socket
import threading
import time
from typing import TYPE_CHECKING

import pytest

import torchrunx as trx
from torchrunx.launcher.state.health import HealthReport
from torchrunx.launcher.view import health_server as health_module
from torchrunx.launcher.view.health_server import MAX_CONNECTIONS, HealthServer

if TYPE_CHECKING:
    from collections.abc import Iterator

LOCAL = "127.0.0.1"
REPORT = HealthReport(
    healthy=True,
    launch_state="running",
    attempt=0,
    restarts=0,
    max_restarts=0,
    uptime=1.0,
    agents=(),
    workers=(),
    failures=(),
)


def snapshot() -> HealthReport:
    return REPORT


@pytest.fixture
def server() -> Iterator[HealthServer]:
    with HealthServer(0, snapshot) as health:
        yield health


def ask(port: int, host: str | None, *, address: str = LOCAL) -> tuple[int, bytes]:
    """``GET /health`` with the given ``Host`` header (``None``: none, as HTTP/1.0 allows)."""
    with socket.create_connection((address, port), timeout=5) as conn:
        head = "GET /health HTTP/1.0\r\n" + ("" if host is None else f"Host: {host}\r\n")
        conn.sendall(f"{head}\r\n".encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:{port}", "localhost.evil.example:{port}", "127.0.0.1.nip.io"],
)
def test_a_request_for_another_host_name_is_refused(server, host):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1."""
    status, body = ask(server.port, host.format(port=server.port))
    assert status == 403
    assert b"is not this server's" in body
    assert b"launch_state" not in body


@pytest.mark.parametrize(
    "host",
    [
        None,
        "localhost",
        "localhost:{port}",
        "LocalHost.:{port}",
        "127.0.0.1:{port}",
        "[::1]:{port}",
        "10.1.2.3:{port}",
        "localhost:9000",  # a forwarded port (ssh -L, kubectl port-forward)
    ],
)
def test_this_machines_names_and_addresses_are_served(server, host):
    status, body = ask(server.port, None if host is None else host.format(port=server.port))
    assert status == 200
    assert b"launch_state" in body


def test_http_client_requests_name_the_host_and_are_served(server):
    connection = http.client.HTTPConnection("localhost", server.port, timeout=5)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
    finally:
        connection.close()


def test_a_server_on_every_interface_accepts_this_machines_name():
    with HealthServer(0, snapshot, host="") as health:
        assert ask(health.port, f"{socket.gethostname()}:{health.port}")[0] == 200
        assert ask(health.port, "evil.example")[0] == 403


def test_the_default_address_is_loopback():
    with HealthServer(0, snapshot) as health:
        assert health._server is not None
        assert health._server.server_address[0] == LOCAL
        assert health.url == f"http://{LOCAL}:{health.port}/health"


def wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def answered(conns: list[socket.socket]) -> list[socket.socket]:
    """The connections with something to read: a reply, or the server's close."""
    return select.select(conns, [], [], 0)[0]


def test_a_flood_of_idle_connections_starts_no_more_threads_than_the_cap(monkeypatch):
    monkeypatch.setattr(health_module, "_REQUEST_TIMEOUT", 30.0)  # idle ones are not let go
    base = threading.active_count()
    with HealthServer(0, snapshot) as health:
        flood = [socket.create_connection((LOCAL, health.port)) for _ in range(3 * MAX_CONNECTIONS)]
        try:
            assert wait_for(lambda: threading.active_count() == base + 1 + MAX_CONNECTIONS)
            # Every connection handled by now: those over the cap got their 503 (or were closed:
            # readable either way), the rest are held by a thread each, and no thread more.
            assert wait_for(lambda: len(answered(flood)) == 2 * MAX_CONNECTIONS)
            assert threading.active_count() == base + 1 + MAX_CONNECTIONS
            # One more, while the cap is full: a 503 (or a closed connection), not a thread.
            status_or_eof = b""
            with socket.create_connection((LOCAL, health.port), timeout=5) as extra:
                extra.sendall(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
                with contextlib.suppress(ConnectionResetError):
                    status_or_eof = extra.recv(100)
            assert status_or_eof == b"" or status_or_eof.startswith(b"HTTP/1.1 503")
            assert threading.active_count() == base + 1 + MAX_CONNECTIONS
        finally:
            for conn in flood:
                conn.close()
        # The idle clients gone, their threads end and a probe is answered again.
        assert wait_for(lambda: threading.active_count() == base + 1)
        assert ask(health.port, "localhost")[0] == 200
    assert wait_for(lambda: threading.active_count() == base)


def test_a_token_from_the_environment_is_required_when_set(monkeypatch):
    monkeypatch.setenv("TORCHRUNX_HEALTH_CHECK_TOKEN", "s3cret")
    token = trx.Launcher(hostnames=["localhost"]).plan().from_env.health_token  # as a launch
    with HealthServer(0, snapshot, token=token) as health:
        for authorization, expected in [
            (None, 401),
            ("Bearer wrong", 401),
            ("s3cret", 401),
            ("Bearer s3cret", 200),
        ]:
            headers = {} if authorization is None else {"Authorization": authorization}
            connection = http.client.HTTPConnection(LOCAL, health.port, timeout=5)
            try:
                connection.request("GET", "/health", headers=headers)
                response = connection.getresponse()
                body = response.read()
            finally:
                connection.close()
            assert response.status == expected, authorization
            if expected == 401:
                assert b"launch_state" not in body
                assert response.getheader("WWW-Authenticate") == 'Bearer realm="torchrunx-health"'
    with HealthServer(0, snapshot, token="") as health:  # none: the plan's token only counts
        assert ask(health.port, "localhost")[0] == 200
