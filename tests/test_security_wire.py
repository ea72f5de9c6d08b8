"""What an authenticated peer's malformed frames, and a man in the middle, can do to a stream.

Second round of ``test_security.py``, with its man in the middle (:class:`Mitm`) on real
connections and the launcher's real :class:`~torchrunx.launcher.net.listener.Listener`:

- a malformed frame from a peer that knows the secret drops that connection only (never the
  launcher's loop), and its declared sizes are checked before anything is allocated;
- a frame's header is unpickled with a restricted unpickler: only the protocol's message
  classes, so a header naming any other class never runs it;
- a record that fails authentication leaves none of its plaintext in a payload buffer;
- the good frames read in the same batch as a tampered record are delivered before the drop;
- a stream ends with an authenticated close record, so records dropped at its end, then a FIN,
  are told apart from a clean close.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

import pytest
from test_security import (
    PLANS,
    SECRET,
    TAMPERED,
    TIMEOUT,
    Forged,
    Mitm,
    deliver,
    delivered_before_the_failure,
    flip,
    forward,
    message,
    plan_rewrite,
    text_of,
    through_mitm,
)

from torchrunx.errors import ProtocolError
from torchrunx.launcher.net import listener as listener_module
from torchrunx.launcher.net.ioloop import IOLoop
from torchrunx.launcher.net.listener import FrameReceived, Listener, PeerClosed
from torchrunx.wire import handshake, messages, records
from torchrunx.wire.messages import LogLines, WorkerException, WorkerSpec, WorkerStacks

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path


def header_frame(header: bytes, sizes: tuple[int, ...] = ()) -> bytes:
    """A frame's plaintext start: ``!QI`` (header length, parts), one ``!Q`` per part, header."""
    return (
        struct.pack("!QI", len(header), len(sizes))
        + b"".join(struct.pack("!Q", size) for size in sizes)
        + header
    )


def malformed_frames(path: Path) -> dict[str, bytes]:
    """Plaintexts an authenticated peer could seal that are not well-formed frames."""
    hello = pickle.dumps(message(0), protocol=pickle.HIGHEST_PROTOCOL)
    return {
        "part-of-2**63-bytes": header_frame(hello, (1 << 63,)),
        "parts-over-the-total-cap": header_frame(hello, (1 << 39, 1 << 39, 1 << 39)),
        "not-a-pickle": header_frame(b"\x80\x05this is not a pickle"),
        "truncated-pickle": header_frame(hello[:-5]),
        "unknown-class": header_frame(pickle.dumps(Forged(path), protocol=pickle.HIGHEST_PROTOCOL)),
        "foreign-class-inside-a-message": header_frame(
            pickle.dumps(
                LogLines(((0, 20, "x", Forged(path), 0.0),)),  # type: ignore[arg-type]
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        ),
    }


MALFORMED = sorted(malformed_frames(__import__("pathlib").Path("unused")))


def send_raw(conn: records.Connection, plaintext: bytes) -> None:
    """Seal ``plaintext`` as one record with the connection's own keys (an authenticated peer)."""
    conn.sock.sendall(conn.sealer.seal(plaintext))


# --------------------------------------------------------------------------------------------
# The launcher's real listener, with several peers
# --------------------------------------------------------------------------------------------


class LiveListener:
    """A real :class:`Listener` in a real :class:`IOLoop`, pumped by the test's thread."""

    def __init__(self) -> None:
        self.loop = IOLoop()
        self.events: list[object] = []
        self.listener = Listener(
            self.loop, SECRET, listener_module.listen_socket("127.0.0.1"), self.events.append
        )
        self.address = ("127.0.0.1", self.listener.port)

    def pump(self, until: Callable[[], bool], timeout: float = TIMEOUT) -> None:
        """Run the loop (any exception out of a callback fails the test) until ``until()``."""
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            self.loop.run_once(0.02)
            self.listener.tick(time.monotonic())

    def connect(self, address: tuple[str, int] | None = None) -> records.Connection:
        """A worker's connection to the listener (or to ``address``, a man in the middle)."""
        got: list[object] = []

        def run() -> None:
            try:
                got.append(handshake.connect(address or self.address, SECRET, "worker", TIMEOUT))
            except BaseException as exc:
                got.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        self.pump(lambda: bool(got))
        thread.join(TIMEOUT)
        (conn,) = got
        assert isinstance(conn, records.Connection), conn
        return conn

    def received(self) -> list[str]:
        return [text_of(e.message) for e in self.events if isinstance(e, FrameReceived)]

    def closed(self) -> list[PeerClosed]:
        return [e for e in self.events if isinstance(e, PeerClosed)]

    def close(self) -> None:
        self.listener.close()
        self.loop.close()


@contextlib.contextmanager
def live_listener() -> Iterator[LiveListener]:
    live = LiveListener()
    try:
        yield live
    finally:
        live.close()


@pytest.mark.parametrize("malformed", MALFORMED)
def test_a_malformed_frame_from_an_authenticated_peer_drops_that_connection_only(
    malformed, tmp_path
):
    path = tmp_path / "pwned"
    with live_listener() as live:
        bad, good = live.connect(), live.connect()
        try:
            good.send(message(1, "good "))
            send_raw(bad, malformed_frames(path)[malformed])
            live.pump(lambda: bool(live.closed()) and bool(live.received()))
            good.send(message(2, "good "))  # the launcher still reads the other peer
            live.pump(lambda: len(live.received()) == 2)
        finally:
            bad.close()
            good.close()
        assert live.received() == ["good message 1", "good message 2"]
        (closed,) = live.closed()
        assert closed.peer.ident == 0  # the bad peer's, and only it
    assert not path.exists(), "a header naming a foreign class was unpickled"


@pytest.mark.parametrize("malformed", MALFORMED)
def test_a_malformed_frame_fails_the_receiving_connection_with_a_protocol_error(
    malformed, tmp_path
):
    """The agent's and the worker's receive path (``Connection.recv``)."""
    path = tmp_path / "pwned"
    with through_mitm() as (client, server, _mitm):
        server.send(message(0, "down "))
        send_raw(server, malformed_frames(path)[malformed])
        assert text_of(client.recv()[0]) == "down message 0"
        with pytest.raises(ProtocolError):
            client.recv()
    assert not path.exists(), "a header naming a foreign class was unpickled"


def test_a_huge_declared_part_allocates_only_what_arrives():
    with through_mitm() as (client, server, _mitm):
        hello = pickle.dumps(message(0), protocol=pickle.HIGHEST_PROTOCOL)
        send_raw(server, header_frame(hello, (1 << 38,)))  # 256 GiB declared, within the cap
        send_raw(server, b"x" * 100)
        send_raw(server, b"y" * 100)
        client.sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            client.recv()  # still waiting for the rest of the part
        parts = client._reader._parser._parts
        assert sum(len(part) for part in parts) < 1 << 20


def test_every_message_type_goes_through_the_restricted_unpickler():
    samples = [
        LogLines(((None, 20, "a", "text", 1.5), (0, 30, "b", "more", 2.0))),
        WorkerStacks({0: "stack", 3: "other"}),
        WorkerSpec(0, "h", 2, 0, 2, "127.0.0.1", 1234, None, 600.0, keep=True),
        WorkerException(0, "ValueError", "boom", "Traceback ...", collective=True),
        *(cls() for cls in (messages.AgentDone, messages.Heartbeat)),
        messages.Stop("reason"),
        messages.WorkersStarted((1, 2, 3)),
    ]
    with through_mitm() as (client, server, _mitm):
        for sample in samples:
            client.send(sample, [b"part"])
            got, parts = server.recv()
            assert got == sample
            assert parts == [bytearray(b"part")]


# --------------------------------------------------------------------------------------------
# A record that fails: nothing of its plaintext stays
# --------------------------------------------------------------------------------------------


def test_a_record_that_fails_leaves_none_of_its_plaintext_in_the_payload_buffer():
    def flip_second_half(direction: str, index: int, record: bytes, _e: list[bytes]) -> list[bytes]:
        # Records "up": 0 the frame start, 1 and 2 the two halves of the part.
        if (direction, index) == ("up", 2):
            return [flip(record, 4 + 1000)]
        return [record]

    with through_mitm(flip_second_half) as (client, server, _mitm):
        client.send(message(0), [b"\xaa" * (2 * records.RECORD_BYTES)])
        with pytest.raises(ProtocolError):
            server.recv()
        parts = server._reader._parser._parts
        (part,) = parts
        assert b"\xaa" not in bytes(part)[records.RECORD_BYTES :]
        assert b"\xab" not in bytes(part)  # the attacker's changed byte, unverified


# --------------------------------------------------------------------------------------------
# Good frames read with a tampered record are delivered first
# --------------------------------------------------------------------------------------------


def batched(
    rewrite: Callable[[str, int, bytes, list[bytes]], list[bytes]],
) -> Callable[[str, int, bytes, list[bytes]], list[bytes]]:
    """``rewrite``, but every record "up" to ``TAMPERED + 1`` goes in one write: one read."""
    held: list[bytes] = []

    def rewrite_batched(
        direction: str, index: int, record: bytes, earlier: list[bytes]
    ) -> list[bytes]:
        out = rewrite(direction, index, record, earlier)
        if direction != "up":
            return out
        held.extend(out)
        if index < TAMPERED + 1:
            return []
        out, held[:] = list(held), []
        return out

    return rewrite_batched


@pytest.mark.parametrize("plan", PLANS)
def test_the_launcher_delivers_the_frames_read_with_a_tampered_record_before_dropping_it(
    plan, tmp_path
):
    path = tmp_path / f"pwned-{plan}"
    with live_listener() as live:
        mitm = Mitm(live.address, batched(plan_rewrite(plan, "up", path)))
        conn = live.connect(mitm.address)
        try:
            sent = [message(i) for i in range(6)]
            for each in sent:
                conn.send(each)
            live.pump(lambda: bool(live.closed()))
        finally:
            conn.close()
            mitm.close()
        assert not path.exists()
        assert live.received() == delivered_before_the_failure(plan, [text_of(m) for m in sent])
        assert isinstance(live.events[-1], PeerClosed)


# --------------------------------------------------------------------------------------------
# The end of a stream is authenticated
# --------------------------------------------------------------------------------------------


def drop_from(
    direction_dropped: str, first: int
) -> Callable[[str, int, bytes, list[bytes]], list[bytes]]:
    """Drop every record of one direction from ``first`` on (the close record included)."""

    def rewrite(direction: str, index: int, record: bytes, _earlier: list[bytes]) -> list[bytes]:
        return [] if direction == direction_dropped and index >= first else [record]

    return rewrite


@pytest.mark.parametrize("direction", ["up", "down"])
def test_records_dropped_at_the_end_of_a_stream_are_not_a_clean_close(direction):
    with through_mitm(drop_from(direction, 2)) as (client, server, _mitm):
        sender, receiver = (client, server) if direction == "up" else (server, client)
        for i in range(4):
            sender.send(message(i))
        sender.close()  # its close record is dropped too; then the FIN goes through
        received = [text_of(receiver.recv()[0]) for _ in range(2)]
        assert received == ["message 0", "message 1"]
        with pytest.raises(ProtocolError, match="without its authenticated close"):
            receiver.recv()


@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_clean_close_is_told_apart(direction):
    with through_mitm() as (client, server, _mitm):
        sender, receiver = (client, server) if direction == "up" else (server, client)
        sent, received, error = deliver(sender, receiver, 3)
        assert error is None
        assert received == sent
        sender.close()
        with pytest.raises(ConnectionError) as info:
            receiver.recv()
        assert not isinstance(info.value, ProtocolError)


def test_a_record_after_the_close_record_fails():
    def replay_after_close(
        direction: str, index: int, record: bytes, earlier: list[bytes]
    ) -> list[bytes]:
        if direction == "up" and index == 1:  # the close record: then an earlier record again
            return [record, earlier[0]]
        return [record]

    with through_mitm(replay_after_close) as (client, server, _mitm):
        client.send(message(0))
        client.send_close()
        assert text_of(server.recv()[0]) == "message 0"
        with pytest.raises(ProtocolError):
            server.recv()


@pytest.mark.parametrize("clean", [True, False])
def test_the_launcher_tells_a_clean_close_from_a_cut_stream(clean):
    with live_listener() as live:
        mitm = Mitm(live.address, forward if clean else drop_from("up", 1))
        conn = live.connect(mitm.address)
        try:
            conn.send(message(0))
            conn.send(message(1))
            conn.close()
            live.pump(lambda: bool(live.closed()))
        finally:
            mitm.close()
        assert live.received() == (["message 0", "message 1"] if clean else ["message 0"])
        (closed,) = live.closed()
        assert closed.clean is clean


def test_a_peer_that_dies_without_closing_is_a_cut_stream():
    with live_listener() as live:
        conn = live.connect()
        conn.send(message(0))
        conn.sock.shutdown(socket.SHUT_RDWR)  # as when the process dies: no close record
        conn.sock.close()
        live.pump(lambda: bool(live.closed()))
        (closed,) = live.closed()
        assert not closed.clean
        assert live.received() == ["message 0"]
