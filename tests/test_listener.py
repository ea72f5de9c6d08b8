"""The launcher's listener and loop with real sockets: handshakes, frames, slow and bad peers."""

from __future__ import annotations

import collections
import os
import socket
import threading
import time

import pytest

from torchrunx import listener as listener_module
from torchrunx import protocol
from torchrunx.ioloop import IOLoop
from torchrunx.listener import FrameReceived, Listener, PeerClosed
from torchrunx.protocol import FrameReader, Heartbeat, LogLines, WorkerResult

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
        conn = protocol.connect(("127.0.0.1", listener.port), SECRET, "worker", timeout=10)
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
    with pytest.raises((protocol.ProtocolError, ConnectionError, OSError)):
        protocol.connect(("127.0.0.1", listener.port), b"wrong" * 8, "agent", timeout=5)
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
        greeting = sock.recv(protocol.GREETING_BYTES)
        assert greeting.startswith(protocol.MAGIC)
        for _ in range(4):  # one byte every 0.2 s: each read is quick, the whole is not
            sock.sendall(protocol.MAGIC[:1])
            pump(lambda: False, 0.2)
        pump(lambda: listener.rejected == 1, 2)
        assert listener.rejected == 1
        assert time.monotonic() - started < 2
        assert sock.recv(64) == b""  # closed by the launcher
    assert not events


def test_connections_still_authenticating_are_capped_and_the_rest_wait_their_turn(
    served, monkeypatch
):
    listener, _events, pump = served
    monkeypatch.setattr(listener_module, "MAX_PENDING", 3)
    socks = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(5)]
    got: list[protocol.Connection] = []
    try:
        pump(lambda: len(listener._pending) == 3, 5)
        pump(lambda: False, 0.3)
        assert len(listener._pending) == 3  # the cap; the others wait in the kernel's queue
        assert listener.rejected == 0
        thread = threading.Thread(
            target=lambda: got.append(
                protocol.connect(("127.0.0.1", listener.port), SECRET, "agent", timeout=10)
            )
        )
        thread.start()
        for sock in socks:  # the idle ones leave: the real peer gets its turn
            sock.close()
        pump(lambda: bool(listener.peers), 10)
        thread.join()
        assert len(listener.peers) == 1
    finally:
        for sock in socks:
            sock.close()
        for conn in got:
            conn.close()


def test_sends_are_buffered_so_a_peer_that_does_not_read_never_blocks_the_loop(served):
    listener, _events, pump = served
    sock = socket.create_connection(("127.0.0.1", listener.port))
    pump(lambda: listener.next_deadline is not None)  # accepted: the greeting is out
    greeting = sock.recv(protocol.GREETING_BYTES)
    reply, expected, keys = protocol.client_reply(SECRET, greeting, "agent")
    sock.sendall(reply)
    pump(lambda: bool(listener.peers))
    assert sock.recv(protocol.MAC_BYTES) == expected
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
