"""A worker's channel to its agent, as rules: where a stream may end (socket pairs, no process).

- a stream that ends between two frames is a clean end;
- one that ends anywhere inside a frame (its header's fixed part, its pickled message, a
  part) was cut: the reader reports an error, and the worker's end raises it.
"""

from __future__ import annotations

import array
import contextlib
import pickle
import socket
import struct
import threading

import pytest

from torchrunx.errors import ProtocolError
from torchrunx.wire import records
from torchrunx.wire.channel import ChannelConnection, ChannelReader
from torchrunx.wire.messages import WorkerHello, WorkerResult

_WHOLE = records.encode_frame_start(WorkerHello(0, 0, 1))
_START = records.encode_frame_start(WorkerResult(0), [b"x" * 10])
_CUTS = {
    "in the header's lengths": _WHOLE[:5],
    "in the part sizes": _START[: struct.calcsize("!QI") + 3],
    "in the pickled message": _WHOLE[:-1],
    "in a part": _START + b"x" * 4,
}


def _reader_end(sent: bytes) -> tuple[list, ChannelReader]:
    """What the agent's reader makes of ``sent``, then the worker's end of the channel."""
    worker, agent = socket.socketpair()
    with worker, agent:
        agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        worker.sendall(sent)
        worker.shutdown(socket.SHUT_WR)
        reader = ChannelReader()
        frames: list = []
        ended = False
        while not ended:
            more, ended = reader.read(agent, drain=True)
            frames += more
    return frames, reader


@pytest.mark.parametrize("where", list(_CUTS))
def test_rule_a_channel_cut_inside_a_frame_even_its_header_is_a_cut_not_a_clean_end(where):
    frames, reader = _reader_end(_WHOLE + _CUTS[where])
    assert [message for message, _ in frames] == [WorkerHello(0, 0, 1)]  # the whole one came
    assert not reader.closed_by_peer
    assert isinstance(reader.error, ProtocolError)
    assert str(reader.error) == "the channel ended inside a frame"


def test_rule_a_channel_that_ends_between_frames_ends_cleanly():
    frames, reader = _reader_end(_WHOLE + _WHOLE)
    assert len(frames) == 2 and reader.closed_by_peer and reader.error is None
    _frames, empty = _reader_end(b"")
    assert empty.closed_by_peer and empty.error is None


@pytest.mark.parametrize("where", list(_CUTS))
def test_rule_the_workers_end_raises_a_cut_inside_a_frame_even_its_header(where):
    worker, agent = socket.socketpair()
    with agent:
        agent.sendall(_WHOLE + _CUTS[where])
        agent.shutdown(socket.SHUT_WR)
        conn = ChannelConnection(worker)
        assert conn.recv() == (WorkerHello(0, 0, 1), [])
        with pytest.raises(ProtocolError, match=r"^the channel ended inside a frame$"):
            conn.recv()
        conn.close()


def test_rule_the_workers_end_sees_a_clean_end_between_frames_as_the_agents_end():
    worker, agent = socket.socketpair()
    with agent:
        agent.sendall(_WHOLE)
        agent.shutdown(socket.SHUT_WR)
        conn = ChannelConnection(worker)
        assert conn.recv() == (WorkerHello(0, 0, 1), [])
        with pytest.raises(ConnectionError, match=r"^the agent ended the channel$"):
            conn.recv()
        conn.close()


def _sent(parts: list, budget: int = 16 << 20) -> tuple[list, bool, ChannelReader]:
    """What one ``read`` of the agent's end returns once the worker sent a result of ``parts``."""
    worker, agent = socket.socketpair()
    with worker, agent:
        # Non-blocking, as the agent's end is: a read after the sender's last byte cannot hang.
        agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        conn = ChannelConnection(worker)
        sender = threading.Thread(target=conn.send, args=(WorkerResult(1), parts))
        sender.start()
        reader = ChannelReader()
        frames: list = []
        ended = False
        while sender.is_alive() or not frames:
            more, ended = reader.read(agent, budget)
            frames += more
            assert not ended
        sender.join()
    return frames, ended, reader


def test_rule_a_frame_comes_whole_with_its_parts_as_bytes_large_or_small():
    ints = array.array("i", range(70_000))  # not bytes: sent as its bytes, not copied first
    big = bytes(range(256)) * 1024  # 256 KiB: received straight into its part
    frames, ended, reader = _sent([big, b"", ints, b"end"])
    assert not ended and reader.error is None and not reader.closed_by_peer
    ((message, parts),) = frames
    assert message == WorkerResult(1)
    assert [bytes(p) for p in parts] == [big, b"", ints.tobytes(), b"end"]


@pytest.mark.parametrize("budget", [1, 70_000, 1 << 16])
def test_rule_a_read_takes_about_its_budget_and_frames_still_come_whole(budget):
    big = bytes(range(256)) * 2048  # 512 KiB in pieces of at most the budget
    frames, _, _ = _sent([big, b"x" * (1 << 16)], budget)
    ((_, parts),) = frames
    assert [bytes(p) for p in parts] == [big, b"x" * (1 << 16)]


def test_rule_a_read_of_an_empty_socket_returns_nothing_and_the_stream_goes_on():
    worker, agent = socket.socketpair()
    with worker, agent:
        agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        reader = ChannelReader()
        assert reader.read(agent) == ([], False)
        assert reader.read(agent, drain=True) == ([], False)
        assert reader.error is None and reader.closed_by_peer is False


def test_rule_a_read_without_drain_stops_after_a_short_read_drain_goes_on_to_the_end():
    worker, agent = socket.socketpair()
    with worker, agent:
        agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        worker.sendall(_WHOLE)
        worker.shutdown(socket.SHUT_WR)
        reader = ChannelReader()
        frames, ended = reader.read(agent)  # one short read: the socket is taken as empty
        assert (len(frames), ended, reader.closed_by_peer) == (1, False, False)
        assert reader.read(agent) == ([], True) and reader.closed_by_peer is True
        worker2, agent2 = socket.socketpair()
        with worker2, agent2:
            agent2.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
            worker2.sendall(_WHOLE + _WHOLE)
            worker2.shutdown(socket.SHUT_WR)
            drained = ChannelReader()
            frames, ended = drained.read(agent2, drain=True)
            assert (len(frames), ended, drained.closed_by_peer) == (2, True, True)


def test_rule_a_broken_socket_ends_the_stream_with_its_error():
    worker, agent = socket.socketpair()
    worker.close()
    agent.close()
    reader = ChannelReader()
    assert reader.read(agent) == ([], True)
    assert isinstance(reader.error, OSError) and reader.closed_by_peer is False


def _exactly_one_scratch_read() -> tuple[bytes, int]:
    """A whole frame exactly as long as one read of the scratch buffer (64 KiB)."""
    part = 1 << 16
    while True:
        start = records.encode_frame_start(WorkerResult(2), [bytes(part)])
        extra = len(start) + part - (1 << 16)
        if extra == 0:
            return start + bytes(part), part
        part -= extra


def test_rule_the_workers_end_returns_a_frame_that_came_with_the_end():
    worker, agent = socket.socketpair()
    with agent:
        data, size = _exactly_one_scratch_read()
        agent.sendall(data)
        agent.shutdown(socket.SHUT_WR)  # one read fills the scratch buffer, the next sees the end
        conn = ChannelConnection(worker)
        message, parts = conn.recv()
        assert message == WorkerResult(2) and parts == [bytearray(size)]
        with pytest.raises(ConnectionError, match=r"^the agent ended the channel$"):
            conn.recv()
        conn.close()


def test_rule_the_workers_end_blocks_and_may_be_closed_twice():
    worker, agent = socket.socketpair()
    with agent:
        worker.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        conn = ChannelConnection(worker)
        assert conn.sock.getblocking()
        conn.send(WorkerHello(0, 0, 1))
        conn.close()
        conn.close()  # safe twice
        assert agent.recv(1 << 16) == _WHOLE
        assert agent.recv(1) == b""  # the agent sees the end


def test_rule_a_frame_whose_last_part_is_large_comes_whole():
    big = bytes(range(256)) * 1024
    frames, _, _ = _sent([b"head", big])
    ((_, parts),) = frames
    assert [bytes(p) for p in parts] == [b"head", big]


def _consumed(budget: int, *, drain: bool) -> int:
    """Bytes one ``read`` takes from a socket that holds far more than ``budget``."""
    worker, agent = socket.socketpair()
    with worker, agent:
        for sock in (worker, agent):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        worker.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        start = records.encode_frame_start(WorkerResult(0), [bytes(1 << 20)])
        stream = memoryview(start + bytes(1 << 20))
        sent = 0
        with contextlib.suppress(BlockingIOError):  # the socket is full
            while sent < len(stream):
                sent += worker.send(stream[sent:])
        assert sent > 4 * budget  # the socket holds far more than one read takes
        ChannelReader().read(agent, budget, drain=drain)
        left = 0
        with contextlib.suppress(BlockingIOError):  # the socket is empty
            while True:
                left += len(agent.recv(1 << 20))
    return sent - left


@pytest.mark.parametrize("drain", [False, True])
def test_rule_a_read_stops_at_its_budget_when_the_socket_holds_more(drain):
    # 64 KiB into the scratch buffer, then the rest of the budget straight into the part.
    assert _consumed(100_000, drain=drain) == 100_000


def test_rule_a_frame_completed_by_a_read_straight_into_its_part_is_returned():
    worker, agent = socket.socketpair()
    with worker, agent:
        for sock in (worker, agent):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        part = bytes(range(256)) * 1024  # 256 KiB: its last bytes come straight into it
        worker.sendall(records.encode_frame_start(WorkerResult(0), [part]) + part)
        agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        frames, ended = ChannelReader().read(agent, drain=True)
        assert not ended
        assert [(message, [bytes(p) for p in parts]) for message, parts in frames] == [
            (WorkerResult(0), [part])
        ]


def _declaring(sizes: list[int]) -> bytes:
    """A frame's start (no part's bytes) that declares parts of ``sizes``."""
    header = pickle.dumps(WorkerResult(0), protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack(f"!QI{len(sizes)}Q", len(header), len(sizes), *sizes) + header


def test_rule_a_frame_declaring_more_than_a_mebi_parts_is_refused_at_its_start():
    frames, reader = _reader_end(_WHOLE + struct.pack("!QI", 10, (1 << 20) + 1))
    assert [message for message, _ in frames] == [WorkerHello(0, 0, 1)]
    assert isinstance(reader.error, ProtocolError)
    assert str(reader.error) == f"frame of 10 header bytes, {(1 << 20) + 1} parts is too large"


def test_rule_a_frame_declaring_more_than_a_tebibyte_is_refused_before_its_parts_come():
    most = records.MAX_FRAME_BYTES
    _, over = _reader_end(_declaring([most // 2, most // 2 + 1]))
    assert isinstance(over.error, ProtocolError)
    assert str(over.error) == f"frame of {most + 1} payload bytes: more than {most}"
    # Exactly the most: taken (its parts grow as bytes come), then the stream ends inside it.
    _, at_most = _reader_end(_declaring([most // 2, most // 2]))
    assert str(at_most.error) == "the channel ended inside a frame"
