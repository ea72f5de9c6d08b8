"""The launcher's listener and loop with real sockets: handshakes, frames, slow and bad peers,
floods of idle connections, where it listens."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from typing import TYPE_CHECKING

import pytest
from conftest import listening_addresses
from wire_helpers import server_handshake

import torchrunx as trx
from torchrunx.errors import ProtocolError
from torchrunx.launcher.net import listener as listener_module
from torchrunx.launcher.net.ioloop import IOLoop
from torchrunx.launcher.net.listener import FrameReceived, Listener, PeerClosed
from torchrunx.wire import handshake, records
from torchrunx.wire.messages import Heartbeat, LogLines, WorkerResult
from torchrunx.wire.records import FrameReader

if TYPE_CHECKING:
    from pathlib import Path

SECRET = b"k" * 32


@pytest.fixture
def served():
    """A listener on loopback in a loop run by this thread (call ``pump`` to turn it)."""
    loop = IOLoop()
    events: collections.deque[object] = collections.deque()
    listener = Listener(loop, SECRET, listener_module.listen_socket("127.0.0.1"), events.append)

    def pump(until, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            loop.run_once(0.05)
            listener.tick(time.monotonic())

    yield listener, events, pump
    listener.close()
    loop.close()


def test_an_authenticated_peer_delivers_frames_in_order_and_its_end(served):
    listener, events, pump = served
    big = os.urandom(3 << 20)  # read straight into its buffer

    def client() -> None:
        conn = handshake.connect(("127.0.0.1", listener.port), SECRET, "worker", timeout=10)
        for i in range(100):
            conn.send(LogLines(((0, 20, "x", f"line {i}", 0.0),)))
        conn.send(WorkerResult(7), [big, b"tail"])
        conn.close()

    thread = threading.Thread(target=client)
    thread.start()
    pump(lambda: any(isinstance(e, PeerClosed) for e in events))
    thread.join()
    frames = [e for e in events if isinstance(e, FrameReceived)]
    assert [f.message.records[0][3] for f in frames[:100]] == [f"line {i}" for i in range(100)]
    assert frames[100].message == WorkerResult(7)
    assert [bytes(p) for p in frames[100].payload] == [big, b"tail"]
    assert frames[0].peer.role == "worker"
    assert isinstance(events[-1], PeerClosed)


def test_a_peer_without_the_secret_is_dropped_and_nothing_is_read(served):
    listener, events, pump = served
    with pytest.raises((ProtocolError, ConnectionError, OSError)):
        handshake.connect(("127.0.0.1", listener.port), b"wrong" * 8, "agent", timeout=5)
    pump(lambda: listener.rejected == 1)
    assert listener.rejected == 1
    assert not events
    assert not listener.peers


def test_a_slow_handshake_is_dropped_at_its_one_deadline(served, monkeypatch):
    listener, events, pump = served
    monkeypatch.setattr(listener_module, "HANDSHAKE_TIMEOUT", 0.5)
    with socket.create_connection(("127.0.0.1", listener.port)) as sock:
        sock.settimeout(5)
        started = time.monotonic()
        pump(lambda: listener.next_deadline is not None, 2)
        greeting = sock.recv(handshake.GREETING_BYTES)
        assert greeting.startswith(handshake.MAGIC)
        for _ in range(4):  # one byte every 0.2 s: each read is quick, the whole is not
            sock.sendall(handshake.MAGIC[:1])
            pump(lambda: False, 0.2)
        pump(lambda: listener.rejected == 1, 2)
        assert listener.rejected == 1
        assert time.monotonic() - started < 2
        assert sock.recv(64) == b""  # closed by the launcher
    assert not events


def test_connections_still_authenticating_are_capped_and_the_oldest_are_shed(served, monkeypatch):
    listener, _events, pump = served
    monkeypatch.setattr(listener_module, "MAX_PENDING", 3)
    socks = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(5)]
    got: list[records.Connection] = []
    try:
        pump(lambda: listener.rejected == 2, 5)
        pump(lambda: False, 0.3)
        assert len(listener._pending) == 3  # the cap
        assert listener.rejected == 2  # the two oldest, shed for the two newest
        thread = threading.Thread(
            target=lambda: got.append(
                handshake.connect(("127.0.0.1", listener.port), SECRET, "agent", timeout=10)
            )
        )
        thread.start()  # the idle ones stay: the real peer gets in all the same
        pump(lambda: bool(listener.peers), 10)
        thread.join()
        assert len(listener.peers) == 1
        assert len(listener._pending) == 2  # one more was shed for it
    finally:
        for sock in socks:
            sock.close()
        for conn in got:
            conn.close()


def test_sends_are_buffered_so_a_peer_that_does_not_read_never_blocks_the_loop(served):
    listener, _events, pump = served
    sock = socket.create_connection(("127.0.0.1", listener.port))
    pump(lambda: listener.next_deadline is not None)  # accepted: the greeting is out
    greeting = sock.recv(handshake.GREETING_BYTES)
    reply, expected, keys = handshake.client_reply(SECRET, greeting, "agent")
    sock.sendall(reply)
    pump(lambda: bool(listener.peers))
    assert sock.recv(handshake.MAC_BYTES) == expected
    (peer,) = listener.peers.values()
    payload = b"x" * (64 << 20)  # far more than the socket buffers hold
    started = time.monotonic()
    peer.send(Heartbeat(), [payload])
    assert time.monotonic() - started < 1
    assert peer.unsent > 0
    # The peer reads now: everything arrives, in one frame.
    reader, frames = FrameReader(keys.receive), []
    sock.settimeout(0.0)  # non-blocking
    deadline = time.monotonic() + 30
    while not frames and time.monotonic() < deadline:
        pump(lambda: True, 0)
        listener.loop.run_once(0.01)
        try:
            got, _eof = reader.read(sock)
        except BlockingIOError:
            continue
        frames += got
    sock.close()
    assert len(frames) == 1
    assert len(frames[0][1][0]) == len(payload)
    assert peer.unsent == 0


# --------------------------------------------------------------------------------------------
# Where it listens
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", {"127.0.0.1"}),
        ("::1", {"::1"}),
        ("0.0.0.0", {"0.0.0.0"}),  # noqa: S104
        (None, {"::", "0.0.0.0"}),  # noqa: S104 (dual-stack where the machine has IPv6)
        ("*", {"::", "0.0.0.0"}),  # noqa: S104
    ],
)
def test_listen_socket_on_one_address_or_every_interface(host, expected):
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    with listener_module.listen_socket(host) as sock:
        bound = listening_addresses(sock.getsockname()[1], os.getpid())
    assert len(bound) == 1
    assert bound <= expected


# --------------------------------------------------------------------------------------------
# Floods
# --------------------------------------------------------------------------------------------


def test_a_relayed_connection_handed_over_as_the_launch_ends_is_closed_not_leaked():
    """A relay hands the loop a connection (``post(..., on_drop=sock.close)``, as the launch
    does); the loop closes before its next round: the socket is closed, and so is one handed
    over after. A post that runs is not dropped."""
    loop = IOLoop()
    ran: list[str] = []
    kept, _peer = socket.socketpair()
    loop.post(lambda: ran.append("kept"), on_drop=kept.close)
    loop.run_once(0)
    assert ran == ["kept"]
    assert kept.fileno() >= 0  # it ran: nothing dropped
    late, _late_peer = socket.socketpair()
    loop.post(lambda: ran.append("late"), on_drop=late.close)
    loop.close()  # before the loop's next round
    assert late.fileno() == -1
    after, _after_peer = socket.socketpair()
    loop.post(lambda: ran.append("after"), on_drop=after.close)
    assert after.fileno() == -1
    assert ran == ["kept"]
    loop.post(lambda: ran.append("no drop"))  # nothing to release: no error
    for sock in (kept, _peer, _late_peer, _after_peer):
        sock.close()


def test_handshakes_at_once_take_at_most_a_quarter_of_the_descriptor_limit(caplog):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        loop = IOLoop()
        listener = Listener(loop, SECRET, listener_module.listen_socket("127.0.0.1"), print)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    flood = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(100)]
    try:
        with caplog.at_level(logging.WARNING, logger="torchrunx.listener"):
            deadline = time.monotonic() + 5
            while len(listener._pending) < 64 and time.monotonic() < deadline:
                loop.run_once(0.05)
            for _ in range(5):
                loop.run_once(0.05)
        assert len(listener._pending) == 64  # 192 descriptors are left to the launch
        assert listener.max_pending == 64
        (warning,) = caplog.records  # once, not once per try
        assert "64 connections are authenticating at once" in warning.getMessage()
    finally:
        for sock in flood:
            sock.close()
        listener.close()
        loop.close()


_FLOODED_LISTENER = r"""
import collections, logging, os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
logging.basicConfig(level=logging.DEBUG, format="%(name)s %(levelname)s %(message)s")
from torchrunx.launcher.net import listener as listener_module
from torchrunx.launcher.net.ioloop import IOLoop
from torchrunx.launcher.net.listener import FrameReceived, Listener
listener_module.HANDSHAKE_TIMEOUT = 0.5
loop, events = IOLoop(), collections.deque()
sock = listener_module.listen_socket("127.0.0.1")
listener = Listener(loop, bytes.fromhex(sys.argv[1]), sock, events.append)
ballast = []  # the rest of a busy launcher: every descriptor but 40 is taken
while True:
    try:
        ballast.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
for fd in ballast[-40:]:
    os.close(fd)
print(listener.port, flush=True)
deadline = time.monotonic() + 60
while not any(isinstance(e, FrameReceived) for e in events) and time.monotonic() < deadline:
    loop.run_once(0.05)
    listener.tick(time.monotonic())
print("peer in" if events else "peer never got in", listener.rejected, flush=True)
"""


def test_out_of_descriptors_it_backs_off_and_lets_the_real_peer_in_after_the_flood():
    # A listener with 40 descriptors left; 150 idle connections are queued before the real
    # peer: accepting fails (EMFILE) again and again until the flood is dropped, 0.5 s after
    # each was accepted; then the peer, last in the kernel's queue, gets in.
    child = subprocess.Popen(
        [sys.executable, "-c", _FLOODED_LISTENER, SECRET.hex()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    flood: list[socket.socket] = []
    try:
        port = int(child.stdout.readline())
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(150)]
        started = time.monotonic()
        conn = handshake.connect(("127.0.0.1", port), SECRET, "worker", timeout=30)
        waited = time.monotonic() - started
        try:
            conn.send(Heartbeat())
            out, err = child.communicate(timeout=30)
        finally:
            conn.close()
    finally:
        for sock in flood:
            sock.close()
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert out.split()[:2] == ["peer", "in"], err
    assert int(out.split()[2]) >= 100  # the flood, dropped at its deadline
    assert "cannot accept a connection ([Errno 24] Too many open files)" in err
    assert waited < 20


_FLOODED_LAUNCH = r"""
import logging, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
import torchrunx as trx
from torchrunx.launcher.net import listener as listener_module
listener_module.HANDSHAKE_TIMEOUT = 0.5
real_listen = listener_module.listen_socket

def flooded(host=None, ports=(0,)):  # the flood is queued before the launch accepts anything
    sock = real_listen(host, ports)
    print(sock.getsockname()[1], flush=True)
    sys.stdin.readline()
    return sock

listener_module.listen_socket = flooded
result = trx.launch(os.getpid, hostnames=["localhost"], workers_per_host=2, backend=None)
print("ranks", len(result.ranks), flush=True)
"""


def test_a_launch_under_a_flood_with_few_descriptors_succeeds(tmp_path: Path):
    # 300 idle connections, each made again as soon as the launcher drops it, against a
    # launcher allowed 256 descriptors: the flood may not take those the launch needs (log
    # files, the agent's pipes), and the agent and workers get in between its rounds.
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with out_path.open("w") as out, err_path.open("w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", _FLOODED_LAUNCH],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            text=True,
        )
    assert child.stdin is not None
    selector = selectors.DefaultSelector()
    reconnects = 0

    def connect(port: int) -> None:
        with contextlib.suppress(OSError):  # refused: the launch closed its port
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.settimeout(0.0)  # non-blocking
            selector.register(sock, selectors.EVENT_READ)

    try:
        deadline = time.monotonic() + 30
        while not out_path.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.02)
        port = int(out_path.read_text())
        for _ in range(300):
            connect(port)
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + 90
        while child.poll() is None and time.monotonic() < deadline:
            for key, _ in selector.select(0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)  # the greeting, then EOF when it is dropped
                except OSError:
                    data = b""
                if not data:
                    selector.unregister(sock)
                    sock.close()
                    connect(port)
                    reconnects += 1
        child.wait(10)
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()
        child.stdin.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    err_text = err_path.read_text()
    assert child.returncode == 0, err_text[-3000:]
    assert out_path.read_text().split()[1:] == ["ranks", "2"]
    assert reconnects >= 300  # the flood went on for the whole launch
    assert "connections are authenticating at once, the most allowed" in err_text


# --------------------------------------------------------------------------------------------
# The end of a launch
# --------------------------------------------------------------------------------------------


class Drippers:
    """Connections to ``port`` that send their handshake a byte every 0.1 s, from a thread."""

    def __init__(self, port: int, count: int) -> None:
        self.socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
        for sock in self.socks:
            sock.settimeout(0.0)  # non-blocking
        self.ended: dict[int, float] = {}
        """Which were closed by the other end, and when."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for index, sock in enumerate(self.socks):
                if index not in self.ended and self._closed_after_step(sock):
                    self.ended[index] = time.monotonic()

    @staticmethod
    def _closed_after_step(sock: socket.socket) -> bool:
        """Read what came (the greeting), send one byte; True once the other end closed."""
        try:
            while sock.recv(4096):
                pass
        except BlockingIOError:
            with contextlib.suppress(OSError):
                sock.send(handshake.MAGIC[:1])
            return False
        except OSError:  # reset
            return True
        return True  # EOF

    def wait_all_ended(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ended) < len(self.socks) and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.socks:
            sock.close()


def test_the_end_of_a_launch_closes_every_handshake_in_progress(monkeypatch):
    # 500 connections send their handshake a byte at a time, each far from done (and from its
    # 10 s deadline) when the launch ends: the launch returns on time and closes every one.
    trx.launch(os.getpid, hostnames=["localhost"], workers_per_host=1, backend=None)  # warm-up
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    real_listen = listener_module.listen_socket
    drippers: list[Drippers] = []

    def flooded(host: str | None = None, ports: tuple[int, ...] = (0,)) -> socket.socket:
        sock = real_listen(host, ports)  # queued before the launch accepts
        drippers.append(Drippers(sock.getsockname()[1], 500))
        return sock

    monkeypatch.setattr(listener_module, "listen_socket", flooded)
    started = time.monotonic()
    try:
        trx.launch(time.sleep, (2,), hostnames=["localhost"], workers_per_host=1, backend=None)
        returned = time.monotonic()
        (flood,) = drippers
        flood.wait_all_ended(5)
        assert returned - started < 2 + 5  # not held up by them
        assert len(flood.ended) == 500  # every one closed by the launcher...
        assert max(flood.ended.values()) - returned < 1.0  # ...by the time the launch returned
    finally:
        for flood in drippers:
            flood.close()
    assert (len(os.listdir("/proc/self/fd")), threading.active_count()) == (fds, threads)


_REFRESHED_FLOOD_LAUNCH = r"""
import logging, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
import torchrunx as trx
from torchrunx.launcher.net import listener as listener_module
real_listen = listener_module.listen_socket

def flooded(host=None, ports=(0,)):  # the flood is queued before the launch accepts anything
    sock = real_listen(host, ports)
    print(sock.getsockname()[1], flush=True)
    sys.stdin.readline()
    return sock

listener_module.listen_socket = flooded
result = trx.launch(
    os.getpid, hostnames=["localhost"], workers_per_host=2, backend=None, agent_timeout=3.0
)
print("ranks", len(result.ranks), flush=True)
"""


class RefreshedFlood:
    """Idle connections to ``port``, each made again as soon as the other end drops it."""

    def __init__(self, port: int, count: int) -> None:
        self.port = port
        self.reconnects = 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        for _ in range(count):
            self._connect()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _connect(self) -> None:
        with contextlib.suppress(OSError):  # refused: the launch closed its port
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            sock.settimeout(0.0)  # non-blocking
            self._selector.register(sock, selectors.EVENT_READ)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)  # the greeting, then EOF when it is dropped
                except OSError:
                    data = b""
                if not data:
                    self._selector.unregister(sock)
                    sock.close()
                    if not self._stop.is_set():
                        self._connect()
                        self.reconnects += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()


def test_a_launch_survives_a_flood_that_keeps_the_handshake_cap_full(tmp_path: Path):
    # The launcher may have 64 handshakes at once (a quarter of 256 descriptors), each for 10 s
    # (HANDSHAKE_TIMEOUT, not lowered); 200 idle connections are queued before the agent's and
    # each one the launcher drops is made again at once, for the whole launch. The agent and
    # workers wait 6 s (2 x agent_timeout) at most: they get in only if the launcher sheds old
    # handshakes (1 s old) for new ones, and they try again when shed.
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with out_path.open("w") as out, err_path.open("w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", _REFRESHED_FLOOD_LAUNCH],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            text=True,
        )
    assert child.stdin is not None
    flood = None
    try:
        deadline = time.monotonic() + 30
        while not out_path.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.02)
        flood = RefreshedFlood(int(out_path.read_text()), 200)
        child.stdin.write("go\n")
        child.stdin.flush()
        child.wait(90)
    finally:
        if flood is not None:
            flood.close()
        child.stdin.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    err_text = err_path.read_text()
    assert child.returncode == 0, err_text[-3000:]
    assert out_path.read_text().split()[1:] == ["ranks", "2"]
    assert flood.reconnects >= 200  # the flood went on: every connection dropped, and back
    assert "the oldest is dropped for each new one" in err_text


def test_a_peer_that_is_shed_during_its_handshake_tries_again():
    # The first try is closed at once (as a listener at its cap sheds it), the second is served.
    with socket.create_server(("127.0.0.1", 0)) as server:
        roles: list[str] = []

        def serve() -> None:
            server.settimeout(5)
            first, _ = server.accept()
            first.close()
            second, _ = server.accept()
            with second:
                second.settimeout(5)
                roles.append(server_handshake(second, SECRET)[0])

        thread = threading.Thread(target=serve)
        thread.start()
        conn = handshake.connect(server.getsockname()[:2], SECRET, "worker", timeout=5)
        conn.close()
        thread.join(5)
    assert roles == ["worker"]


def test_an_idle_connection_costs_the_launcher_little_memory(served):
    # 100 authenticated connections, each having sent a frame, then idle: the readers' buffers
    # are back to small (a record reader used to keep a whole record's 1 MiB per connection).
    listener, events, pump = served
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        conns: list[records.Connection] = []

        def connect_all() -> None:
            for _ in range(100):
                address = ("127.0.0.1", listener.port)
                conns.append(handshake.connect(address, SECRET, "worker", timeout=10))

        thread = threading.Thread(target=connect_all)
        thread.start()
        pump(lambda: not thread.is_alive(), 20)
        thread.join()
        try:
            for conn in conns:
                conn.send(Heartbeat())
            pump(lambda: len(events) == 100, 10)
            assert len(listener.peers) == 100
            per_connection = (tracemalloc.get_traced_memory()[0] - before) / len(conns)
            assert per_connection < 32 * 1024, per_connection  # both ends of it, here
            big = bytes(range(256)) * (3 << 12)  # 3 MiB: the buffer grows, then shrinks
            conns[0].send(Heartbeat(), [big])
            pump(lambda: len(events) == 101, 10)
            assert [bytes(part) for part in events[-1].payload] == [big]
            assert all(len(peer._reader._raw) <= 4096 for peer in listener.peers.values())
        finally:
            for conn in conns:
                conn.close()
    finally:
        tracemalloc.stop()


def test_ioloop_past_deadline_returns_at_once_and_hangup_reaches_the_reader() -> None:
    """A negative timeout (a deadline already past) polls; it never waits forever.

    epoll takes any negative timeout as "forever": the loop must clamp it. A peer that hangs up
    makes its descriptor readable, so the reader sees the end; a removed descriptor is not
    called again.
    """
    loop = IOLoop()
    mine, theirs = socket.socketpair()
    try:
        started = time.monotonic()
        loop.run_once(-5.0)
        assert time.monotonic() - started < 1.0
        seen: list[bytes] = []
        loop.add_reader(mine.fileno(), lambda: seen.append(mine.recv(16)))
        theirs.close()  # a hang-up, no data
        loop.run_once(2.0)
        assert seen == [b""]
        loop.remove(mine.fileno())
        started = time.monotonic()
        loop.run_once(0.2)
        assert seen == [b""]
        assert time.monotonic() - started >= 0.15  # nothing else was ready: it waited
    finally:
        mine.close()
        theirs.close()
        loop.close()


# -- relayed connections: their own host's cap, shed as accepted ones are (issue #42) -----------


def _adopt_pairs(listener, host: str, count: int) -> list[socket.socket]:
    """``count`` relayed connections of ``host`` handed to ``listener``: the host's ends."""
    ends = []
    for _ in range(count):
        ours, theirs = socket.socketpair()
        listener.adopt(theirs, (host, "10.0.0.1"))
        ends.append(ours)
    return ends


def test_a_hosts_relayed_handshakes_are_capped_young_ones_are_not_shed(served, monkeypatch):
    listener, _events, _pump = served
    monkeypatch.setattr(listener_module, "RELAYED_PENDING", 3)
    ends = _adopt_pairs(listener, "10.0.0.7", 5)
    try:
        assert len(listener._pending) == 3  # the host's cap
        assert listener.rejected == 2  # the two newest, closed at once: the others are young
        assert [e.recv(64)[:4] for e in ends[3:]] == [b"", b""]  # closed, no greeting
        other = _adopt_pairs(listener, "10.0.0.8", 1)  # another host is not held back
        assert len(listener._pending) == 4
        other[0].close()
    finally:
        for end in ends:
            end.close()


def test_a_hosts_oldest_relayed_handshake_is_shed_once_it_has_had_its_second(served, monkeypatch):
    listener, _events, pump = served
    monkeypatch.setattr(listener_module, "RELAYED_PENDING", 3)
    monkeypatch.setattr(listener_module, "SHED_AFTER", 0.2)
    ends = _adopt_pairs(listener, "10.0.0.7", 3)
    pump(lambda: False, 0.3)  # they have had their time
    newest = _adopt_pairs(listener, "10.0.0.7", 1)
    try:
        assert len(listener._pending) == 3
        assert listener.rejected == 1
        ends[0].settimeout(5)
        assert ends[0].recv(64).startswith(handshake.MAGIC)  # its greeting, then its end
        assert ends[0].recv(64) == b""
        assert newest[0].recv(64).startswith(handshake.MAGIC)  # the new one was greeted
    finally:
        for end in [*ends, *newest]:
            end.close()


def test_a_relayed_real_peer_gets_in_while_idle_ones_of_its_host_hold_the_cap(served, monkeypatch):
    listener, _events, pump = served
    monkeypatch.setattr(listener_module, "RELAYED_PENDING", 4)
    monkeypatch.setattr(listener_module, "SHED_AFTER", 0.2)
    idle = _adopt_pairs(listener, "10.0.0.7", 4)
    pump(lambda: False, 0.3)
    ours, theirs = socket.socketpair()
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(server_handshake_client(ours)))
    listener.adopt(theirs, ("10.0.0.7", "10.0.0.1"))
    thread.start()
    try:
        pump(lambda: bool(listener.peers), 10)
        thread.join(10)
        assert len(listener.peers) == 1  # authenticated through the full cap
    finally:
        for end in [*idle, ours]:
            end.close()


def server_handshake_client(sock: socket.socket) -> object:
    """The client's side of the handshake on an already connected socket (as a relayed peer)."""
    sock.settimeout(10)
    return handshake.client_handshake(sock, SECRET, "worker")
