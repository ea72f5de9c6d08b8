"""The health endpoint: real HTTP against a real HealthServer on 127.0.0.1, and in launches."""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
from conftest import listening_addresses

import torchrunx as trx
from torchrunx import events as ev
from torchrunx.events import AgentState, WorkerState
from torchrunx.launcher.settings.environ import (
    health_details_from_env,
    health_host_from_env,
    health_port_from_env,
)
from torchrunx.launcher.state.health import AgentHealth, HealthReport, WorkerHealth
from torchrunx.launcher.view.health_server import HealthServer

LOCAL = "127.0.0.1"
# No proxy from the environment may stand between the tests and 127.0.0.1.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

HEALTHY = HealthReport(
    healthy=True,
    launch_state="running",
    attempt=0,
    restarts=0,
    max_restarts=2,
    uptime=12.345678,
    agents=(
        AgentHealth(
            host_index=0, hostname="node1", state=AgentState.RUNNING, last_heartbeat_age=0.25
        ),
        AgentHealth(
            host_index=1, hostname="node2", state=AgentState.STARTING, last_heartbeat_age=None
        ),
    ),
    workers=(
        WorkerHealth(
            rank=0,
            host_index=0,
            hostname="node1",
            local_rank=0,
            pid=4242,
            state=WorkerState.HEALTHY,
        ),
        WorkerHealth(
            rank=None,
            host_index=1,
            hostname="node2",
            local_rank=0,
            pid=None,
            state=WorkerState.INIT,
        ),
    ),
    failures=(),
)
UNHEALTHY = replace(
    HEALTHY,
    healthy=False,
    launch_state="restarting",
    workers=(replace(HEALTHY.workers[0], state=WorkerState.FAILED), HEALTHY.workers[1]),
    failures=("node1 rank 0 (pid 4242) exited with status 1",),
)


class Snapshot:
    """The snapshot function; the test changes ``report`` (or ``error``) between requests."""

    def __init__(self) -> None:
        self.report = HEALTHY
        self.error: Exception | None = None
        self.calls = 0

    def __call__(self) -> HealthReport:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.report


@pytest.fixture
def snapshot():
    return Snapshot()


@pytest.fixture
def server(snapshot):
    health = HealthServer(0, snapshot, host=LOCAL)
    health.start()
    yield health
    health.close()


def get(server: HealthServer, path: str = "/health") -> tuple[int, dict[str, str], bytes]:
    """GET with urllib; an error status is returned, not raised."""
    try:
        with OPENER.open(f"http://{LOCAL}:{server.port}{path}", timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, dict(error.headers), error.read()


def request(
    server: HealthServer, method: str, path: str = "/health", body: bytes | None = None
) -> tuple[int, http.client.HTTPResponse, bytes]:
    """Any method with http.client."""
    connection = http.client.HTTPConnection(LOCAL, server.port, timeout=5)
    try:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        return response.status, response, response.read()
    finally:
        connection.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_for_threads(count: int) -> None:
    deadline = time.monotonic() + 2
    while threading.active_count() != count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert threading.active_count() == count


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def test_report_to_json_is_stable_and_plain():
    data = json.loads(HEALTHY.to_json())
    assert list(data) == [
        "healthy",
        "launch_state",
        "attempt",
        "restarts",
        "max_restarts",
        "uptime",
        "agents",
        "workers",
        "failures",
        "world_changes",
    ]
    assert data["uptime"] == 12.346  # rounded to the millisecond
    assert data["agents"] == [
        {
            "host_index": 0,
            "hostname": "node1",
            "state": "RUNNING",
            "last_heartbeat_age": 0.25,
            "role": "host",
        },
        {
            "host_index": 1,
            "hostname": "node2",
            "state": "STARTING",
            "last_heartbeat_age": None,
            "role": "host",
        },
    ]
    assert list(data["workers"][0]) == [
        "rank",
        "host_index",
        "hostname",
        "local_rank",
        "pid",
        "state",
        "cpu_percent",
        "rss_bytes",
        "gpu_percent",
        "gpu_memory_bytes",
        "collectives",
    ]
    assert data["workers"][1] == {
        "rank": None,
        "host_index": 1,
        "hostname": "node2",
        "local_rank": 0,
        "pid": None,
        "state": "INIT",
        "cpu_percent": None,
        "rss_bytes": None,
        "gpu_percent": None,
        "gpu_memory_bytes": None,
        "collectives": None,
    }
    assert data["failures"] == []
    assert HEALTHY.to_json() == HEALTHY.to_json()  # same bytes each time
    assert HEALTHY.to_dict() == data


# --------------------------------------------------------------------------------------------
# Status codes
# --------------------------------------------------------------------------------------------


def test_200_while_healthy_503_after(server, snapshot):
    status, headers, body = get(server)
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert int(headers["Content-Length"]) == len(body)
    assert body == HEALTHY.to_json()

    snapshot.report = UNHEALTHY
    status, headers, body = get(server)
    assert status == 503
    assert headers["Content-Type"] == "application/json"
    data = json.loads(body)
    assert data["healthy"] is False
    assert data["launch_state"] == "restarting"
    assert data["workers"][0]["state"] == "FAILED"
    assert data["failures"] == ["node1 rank 0 (pid 4242) exited with status 1"]

    snapshot.report = replace(HEALTHY, attempt=1, restarts=1)
    status, _, body = get(server)
    assert status == 200
    assert json.loads(body)["attempt"] == 1


def test_query_string_is_ignored(server):
    status, _, body = get(server, "/health?verbose=1")
    assert status == 200
    assert body == HEALTHY.to_json()


def test_404_for_other_paths(server):
    for path in ("/", "/healthz", "/health/x", "/metrics"):
        status, response, body = request(server, "GET", path)
        assert status == 404, path
        assert response.getheader("Content-Type") == "application/json"
        assert "error" in json.loads(body)
    status, _, _ = get(server, "/nope")
    assert status == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "FOO"])
def test_405_for_other_methods(server, snapshot, method):
    body = b'{"x": 1}' if method in ("POST", "PUT", "PATCH") else None
    status, response, data = request(server, method, body=body)
    assert status == 405
    assert response.getheader("Allow") == "GET, HEAD"
    assert response.getheader("Content-Type") == "application/json"
    assert method in json.loads(data)["error"]
    assert snapshot.calls == 0


def test_head_has_the_status_and_no_body(server, snapshot):
    status, response, body = request(server, "HEAD")
    assert (status, body) == (200, b"")
    assert response.getheader("Content-Type") == "application/json"
    assert int(response.getheader("Content-Length")) == len(HEALTHY.to_json())
    snapshot.report = UNHEALTHY
    status, _, body = request(server, "HEAD")
    assert (status, body) == (503, b"")
    status, _, body = request(server, "HEAD", "/other")
    assert (status, body) == (404, b"")


def test_500_when_the_snapshot_raises_and_serving_goes_on(server, snapshot, caplog):
    snapshot.error = RuntimeError("state lock broken")
    with caplog.at_level(logging.DEBUG, logger="torchrunx.health"):
        status, headers, body = get(server)
        assert status == 500
        assert headers["Content-Type"] == "application/json"
        assert json.loads(body) == {"error": "RuntimeError"}  # the type, not the message
        assert get(server)[0] == 500
    warnings = [
        r for r in caplog.records if r.name == "torchrunx.health" and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1  # once, not once per probe
    snapshot.error = None
    assert get(server)[0] == 200


def test_500_has_the_message_only_when_details_are_asked_for(snapshot):
    snapshot.error = RuntimeError("state lock broken")
    with HealthServer(0, snapshot, host=LOCAL, details=True) as health:
        status, _, body = get(health)
    assert status == 500
    assert json.loads(body) == {"error": "RuntimeError: state lock broken"}


SECRET_FAILURES = replace(
    UNHEALTHY,
    failures=(
        "attempt 0: ValueError: cannot reach postgres://admin:password=hunter2@db",
        "attempt 1: AgentFailedError: agent on host 'node2' failed: password=hunter2",
        "attempt 1: KeyboardInterrupt",
    ),
)


def test_failure_messages_are_served_only_when_asked_for(snapshot):
    snapshot.report = SECRET_FAILURES
    with HealthServer(0, snapshot, host=LOCAL) as health:
        status, _, body = get(health)
    assert status == 503
    assert b"hunter2" not in body
    data = json.loads(body)
    assert data["failures"] == [
        "attempt 0: ValueError",
        "attempt 1: AgentFailedError",
        "attempt 1: KeyboardInterrupt",
    ]
    assert data["workers"] == json.loads(SECRET_FAILURES.to_json())["workers"]  # pids, names
    with HealthServer(0, snapshot, host=LOCAL, details=True) as health:
        _, _, body = get(health)
    assert json.loads(body)["failures"] == list(SECRET_FAILURES.failures)


def test_request_log_goes_to_debug_not_stderr(server, capfd, caplog):
    with caplog.at_level(logging.DEBUG, logger="torchrunx.health"):
        get(server)
        request(server, "POST", body=b"x")
        get(server, "/missing")
        # A client that hangs up without a request, and one that sends garbage.
        with socket.create_connection((LOCAL, server.port), timeout=5):
            pass
        with socket.create_connection((LOCAL, server.port), timeout=5) as raw:
            raw.sendall(b"GET /health HTTP/x.y\r\n\r\n")
            assert b"Bad request version" in raw.recv(200)
    assert capfd.readouterr().err == ""
    messages = [r.getMessage() for r in caplog.records if r.name == "torchrunx.health"]
    assert any('"GET /health HTTP/1.1" 200' in m for m in messages)
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "torchrunx.health")


# --------------------------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------------------------


def test_port_0_picks_a_free_port(snapshot):
    health = HealthServer(0, snapshot, host=LOCAL)
    with pytest.raises(RuntimeError, match="not started"):
        _ = health.port
    with health:
        assert 0 < health.port < 65536
        assert health.url == f"http://{LOCAL}:{health.port}/health"
        assert get(health)[0] == 200


def test_port_in_use_names_the_port_and_the_settings(snapshot):
    fds = open_fds()
    with socket.socket() as taken:
        taken.bind((LOCAL, 0))
        taken.listen()
        port = taken.getsockname()[1]
        health = HealthServer(port, snapshot, host=LOCAL)
        with pytest.raises(OSError, match=f"port {port}") as caught:
            health.start()
        health.close()
    message = str(caught.value)
    assert "TORCHRUNX_HEALTH_CHECK_PORT" in message
    assert "health_check_port" in message
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.EADDRINUSE
    assert open_fds() == fds


def test_reuse_address_lets_the_next_launch_take_the_same_port(snapshot):
    first = HealthServer(0, snapshot, host=LOCAL)
    with first:
        port = first.port
        assert first._server is not None
        assert first._server.socket.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        assert get(first)[0] == 200  # the server closes first: its side is in TIME_WAIT
    with HealthServer(port, snapshot, host=LOCAL) as second:
        assert second.port == port
        assert get(second)[0] == 200


@pytest.mark.parametrize("port", [-1, 65536, True, "8080"])
def test_bad_port_is_refused(snapshot, port):
    with pytest.raises(ValueError, match="0 to 65535"):
        HealthServer(port, snapshot)


@pytest.mark.parametrize(
    ("field", "environ", "expected"),
    [
        (None, {}, None),
        (None, {"TORCHRUNX_HEALTH_CHECK_PORT": ""}, None),
        (None, {"TORCHRUNX_HEALTH_CHECK_PORT": "  "}, None),
        (None, {"TORCHRUNX_HEALTH_CHECK_PORT": "8080"}, 8080),
        (None, {"TORCHRUNX_HEALTH_CHECK_PORT": " 0 "}, 0),
        (None, {"TORCHRUNX_HEALTH_CHECK_PORT": "65535"}, 65535),
        (9000, {"TORCHRUNX_HEALTH_CHECK_PORT": "8080"}, 9000),
        (0, {"TORCHRUNX_HEALTH_CHECK_PORT": "8080"}, 0),
        (9000, {"TORCHRUNX_HEALTH_CHECK_PORT": "junk"}, 9000),  # the field wins, env unread
    ],
)
def test_health_port_from_env(field, environ, expected):
    assert health_port_from_env(field, environ) == expected


@pytest.mark.parametrize(
    "value", ["http", "-1", "65536", "80.0", "8_080", "+80", "0x50", "99999999"]
)
def test_health_port_from_env_rejects_bad_values(value):
    with pytest.raises(ValueError, match="TORCHRUNX_HEALTH_CHECK_PORT") as caught:
        health_port_from_env(None, {"TORCHRUNX_HEALTH_CHECK_PORT": value})
    assert repr(value) in str(caught.value)


def test_health_port_from_env_rejects_a_bad_field():
    with pytest.raises(ValueError, match="health_check_port=70000"):
        health_port_from_env(70000, {})


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, "127.0.0.1"), ("", "127.0.0.1"), (" * ", ""), ("0.0.0.0", "0.0.0.0"), ("::1", "::1")],  # noqa: S104
)
def test_health_host_from_env(value, expected):
    environ = {} if value is None else {"TORCHRUNX_HEALTH_CHECK_HOST": value}
    assert health_host_from_env(environ) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, False), ("", False), ("0", False), ("off", False), ("1", True), (" Yes ", True)],
)
def test_health_details_from_env(value, expected):
    environ = {} if value is None else {"TORCHRUNX_HEALTH_CHECK_DETAILS": value}
    assert health_details_from_env(environ) is expected


def test_health_details_from_env_rejects_other_values():
    with pytest.raises(ValueError, match="TORCHRUNX_HEALTH_CHECK_DETAILS='maybe'"):
        health_details_from_env({"TORCHRUNX_HEALTH_CHECK_DETAILS": "maybe"})


def test_the_plan_reads_the_health_port_from_os_environ(monkeypatch):
    monkeypatch.setenv("TORCHRUNX_HEALTH_CHECK_PORT", "8123")
    assert trx.Launcher(hostnames=["localhost"]).plan().observability.health_port == 8123
    monkeypatch.delenv("TORCHRUNX_HEALTH_CHECK_PORT")
    assert trx.Launcher(hostnames=["localhost"]).plan().observability.health_port is None


# --------------------------------------------------------------------------------------------
# Lifetime
# --------------------------------------------------------------------------------------------


def test_close_leaves_no_fd_and_no_thread(snapshot):
    fds, threads = open_fds(), threading.active_count()
    health = HealthServer(0, snapshot, host=LOCAL)
    health.start()
    assert threading.active_count() == threads + 1
    for _ in range(3):
        assert get(health)[0] == 200
    assert request(health, "HEAD")[0] == 200
    # The client has its answer a moment before the request's thread ends.
    wait_for_threads(threads + 1)
    # A client that connects and sends nothing holds a request thread until close().
    with socket.create_connection((LOCAL, health.port), timeout=5) as idle:
        wait_for_threads(threads + 2)
        started = time.monotonic()
        health.close()
        assert time.monotonic() - started < 1.0
        assert idle.recv(10) == b""  # its connection was ended
    assert threading.active_count() == threads
    assert open_fds() == fds
    health.close()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((LOCAL, health.port), timeout=1).close()


def test_close_without_start_and_no_restart(snapshot):
    fds = open_fds()
    health = HealthServer(0, snapshot, host=LOCAL)
    health.close()
    health.close()
    with pytest.raises(RuntimeError, match="started once"):
        health.start()
    assert open_fds() == fds


def test_start_twice_is_refused(server):
    with pytest.raises(RuntimeError, match="started once"):
        server.start()


def test_default_host_is_loopback_and_every_interface_is_asked_for(snapshot):
    with HealthServer(0, snapshot) as health:
        assert health._server is not None
        assert health._server.server_address[0] == LOCAL
        assert get(health)[0] == 200
    with HealthServer(0, snapshot, host="") as health:
        assert health._server is not None
        assert health._server.server_address[0] in ("::", "0.0.0.0")  # noqa: S104
        assert get(health)[0] == 200  # reached over 127.0.0.1


def test_close_does_not_wait_for_a_stuck_snapshot_past_its_deadline(snapshot, monkeypatch):
    monkeypatch.setattr("torchrunx.launcher.view.health_server._CLOSE_JOIN_TIMEOUT", 0.2)
    release = threading.Event()
    entered = threading.Event()

    def stuck() -> HealthReport:
        entered.set()
        release.wait(10)
        return HEALTHY

    health = HealthServer(0, stuck, host=LOCAL)
    health.start()
    outcome: list[object] = []

    def probe() -> None:
        try:
            outcome.append(request(health, "GET")[0])
        except OSError as error:  # http.client.RemoteDisconnected: the connection was ended
            outcome.append(error)

    client = threading.Thread(target=probe, daemon=True)
    client.start()
    assert entered.wait(5)
    started = time.monotonic()
    health.close()
    assert time.monotonic() - started < 1.0  # the poll interval and the 0.2 s deadline
    release.set()
    client.join(5)
    assert not client.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], OSError)  # close() ended the connection, not the snapshot


# --------------------------------------------------------------------------------------------
# In a launch
# --------------------------------------------------------------------------------------------


def leak_a_password() -> None:
    raise ValueError("cannot reach postgres://admin:password=hunter2@db")


def probe_during_launch(monkeypatch, func, **env: str) -> tuple[set[str], str, int, bytes]:
    """Run ``func`` on one local worker with the endpoint on; probe it as the launch ends.

    Returns where the endpoint listened, its URL, and the status and body it served while
    the launch was finishing (a failed launch: after its failure, before it raised).
    """
    monkeypatch.setenv("TORCHRUNX_HEALTH_CHECK_PORT", "0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen: dict[str, object] = {}

    def on_event(event: ev.Event) -> None:  # in the launcher's thread: the launch waits
        if isinstance(event, ev.LaunchStarted):
            assert event.health_url is not None
            seen["url"] = event.health_url
            port = int(event.health_url.rsplit(":", 1)[1].split("/")[0])
            seen["bound"] = listening_addresses(port, os.getpid())
        elif isinstance(event, ev.LaunchFinished):
            port = int(str(seen["url"]).rsplit(":", 1)[1].split("/")[0])
            try:
                with OPENER.open(f"http://{LOCAL}:{port}/health", timeout=5) as response:
                    seen["answer"] = (response.status, response.read())
            except urllib.error.HTTPError as error:
                with error:
                    seen["answer"] = (error.code, error.read())

    with contextlib.suppress(ValueError):
        trx.launch(
            func,
            hostnames=["localhost"],
            workers_per_host=1,
            backend=None,
            event_handlers=(on_event,),
        )
    status, body = seen["answer"]
    return seen["bound"], str(seen["url"]), status, body


def test_a_launch_serves_health_on_loopback_only_by_default(monkeypatch):
    bound, url, status, _ = probe_during_launch(monkeypatch, os.getpid)
    assert bound == {"127.0.0.1"}
    assert url.startswith("http://127.0.0.1:")
    assert status == 200
    bound, url, _, _ = probe_during_launch(monkeypatch, os.getpid, TORCHRUNX_HEALTH_CHECK_HOST="*")
    assert bound <= {"::", "0.0.0.0"} and len(bound) == 1  # noqa: S104 (every interface)
    assert not url.startswith("http://127.0.0.1:")


def test_a_failed_launch_serves_no_exception_text_unless_asked(monkeypatch):
    _, _, status, body = probe_during_launch(monkeypatch, leak_a_password)
    assert status == 503
    assert b"hunter2" not in body
    assert json.loads(body)["failures"] == ["attempt 0: ValueError"]
    _, _, status, body = probe_during_launch(
        monkeypatch, leak_a_password, TORCHRUNX_HEALTH_CHECK_DETAILS="1"
    )
    assert status == 503
    assert json.loads(body)["failures"] == [
        "attempt 0: ValueError: cannot reach postgres://admin:password=hunter2@db"
    ]
