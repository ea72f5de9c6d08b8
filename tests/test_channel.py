"""A worker's channel to its agent, and what travels on it (issue #26, item 11).

Workers do not connect to the launcher: each talks to its agent over a socket pair (plain
frames, :mod:`torchrunx.wire.channel`), and the agent forwards what they send on its own sealed
connection. An outcome larger than ``DIRECT_OUTCOME_BYTES`` goes on a sealed connection of the
worker's own, or through the agent when that connection cannot be made. These tests run the
channel's two ends on real socket pairs, the agent's outbox on a real sealed stream, and real
launches on localhost: a large result both ways, a worker killed while its result is on its
channel, a worker whose channel carries something that is not a worker's message.
"""

from __future__ import annotations

import collections
import os
import pickle
import socket
import struct
import threading

import pytest

import torchrunx as trx
from torchrunx.agent.outbox import Outbox
from torchrunx.errors import ProtocolError, WorkerFailedError
from torchrunx.wire import records
from torchrunx.wire.channel import ChannelConnection, ChannelReader
from torchrunx.wire.messages import (
    DIRECT_OUTCOME_BYTES,
    DebugInput,
    Heartbeat,
    LogLines,
    WorkerCall,
    WorkerHello,
    WorkerResult,
)

LOCAL = {"hostnames": ["localhost"], "workers_per_host": 2, "backend": None}


def _read_all(reader: ChannelReader, sock: socket.socket) -> tuple[list, bool]:
    """Read a non-blocking socket until its stream ends (the writer has closed)."""
    frames: list = []
    ended = False
    while not ended:
        more, ended = reader.read(sock, drain=True)
        frames += more
    return frames, ended


# -- the channel's two ends ---------------------------------------------------------------------


def test_a_channel_carries_frames_and_a_large_part_whole_and_ends_cleanly_between_frames():
    worker, agent = socket.socketpair()
    agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
    big = os.urandom(3 * 1024 * 1024 + 17)  # received straight into its part, in pieces
    conn = ChannelConnection(worker)
    sender = threading.Thread(
        target=lambda: (
            conn.send(WorkerHello(3, 1, 42)),
            conn.send(WorkerResult(3), [big, b"", b"tail"]),
            conn.close(),
        )
    )
    sender.start()
    reader = ChannelReader()
    frames, ended = _read_all(reader, agent)
    sender.join()
    assert ended and reader.closed_by_peer and reader.error is None
    assert [message for message, _ in frames] == [WorkerHello(3, 1, 42), WorkerResult(3)]
    assert [bytes(part) for part in frames[1][1]] == [big, b"", b"tail"]
    agent.close()


def test_a_channel_cut_inside_a_frame_is_not_a_clean_end():
    worker, agent = socket.socketpair()
    agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
    start = records.encode_frame_start(WorkerResult(0), [b"x" * 1000])
    worker.sendall(start + b"x" * 10)  # the worker died while sending its result
    worker.close()
    reader = ChannelReader()
    frames, ended = _read_all(reader, agent)
    assert frames == [] and ended and not reader.closed_by_peer
    assert isinstance(reader.error, ProtocolError)
    assert "inside a frame" in str(reader.error)
    agent.close()


def test_a_channel_refuses_a_header_that_is_not_a_torchrunx_message():
    worker, agent = socket.socketpair()
    agent.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
    header = pickle.dumps(collections.OrderedDict(a=1))
    worker.sendall(struct.pack("!QI", len(header), 0) + header)
    worker.close()
    reader = ChannelReader()
    _frames, ended = _read_all(reader, agent)
    assert ended and isinstance(reader.error, ProtocolError)
    agent.close()


def test_the_workers_end_receives_what_the_agent_writes_and_sees_the_agent_end_it():
    worker, agent = socket.socketpair()
    agent.settimeout(0.0)
    outbox = Outbox(agent, None)  # the agent's side: plain frames, never blocking
    call = os.urandom(300_000)
    outbox.put(WorkerCall(run=2), [call])
    outbox.put(DebugInput("c"))
    conn = ChannelConnection(worker)
    received: list = []
    reader = threading.Thread(target=lambda: received.extend([conn.recv(), conn.recv()]))
    reader.start()
    while len(outbox):  # as the agent's loop does when the channel has room
        outbox.flush()
    reader.join(30)
    assert [m for m, _ in received] == [WorkerCall(run=2), DebugInput("c")]
    assert bytes(received[0][1][0]) == call
    agent.close()  # the agent ends the channel: a worker that stays exits
    with pytest.raises(ConnectionError):
        conn.recv()
    conn.close()


# -- the agent's outbox: what one turn sends shares records -------------------------------------


def test_small_frames_queued_in_one_turn_share_a_record_and_a_large_part_has_its_own():
    keys = records.SessionKeys(os.urandom(32), os.urandom(32))
    ours, theirs = socket.socketpair()
    ours.settimeout(0.0)
    sealer = records.Sealer(keys.send)
    outbox = Outbox(ours, sealer)
    big = os.urandom(200_000)
    outbox.held = True  # one turn of the agent's loop
    outbox.put(Heartbeat())
    outbox.put(LogLines(((0, 20, "x", "a line", 1.0),)))
    outbox.put(WorkerResult(1), [b"small"])
    outbox.put(WorkerResult(2), [big])
    assert len(outbox) > 200_000  # nothing written while held
    outbox.held = False
    while len(outbox):
        outbox.flush()
    outbox.put(Heartbeat())  # not held: sent at once, in a record of its own
    assert not len(outbox)
    ours.sendall(sealer.seal_close())
    ours.close()
    sizes = []
    stream = b"".join(iter(lambda: theirs.recv(1 << 20), b""))
    opener = records.FrameReader(keys.send)
    position = 0
    while position < len(stream):
        (size,) = struct.unpack_from("!I", stream, position)
        sizes.append(size)
        position += 4 + size
    # The held turn: one record for its small frames and the big one's start, one for the big
    # part; then the heartbeat sent on its own, and the close record.
    assert len(sizes) == 4, sizes
    assert sizes[1] == len(big) + records.TAG_BYTES and sizes[3] == records.TAG_BYTES
    a, b = socket.socketpair()
    a.sendall(stream)
    a.close()
    frames = []
    while len(frames) < 5:
        frames += opener.read_record(b)
    assert opener.read_record(b) == []  # the close record
    with pytest.raises(ConnectionError):  # then the stream's clean end
        opener.read_record(b)
    assert [m for m, _ in frames] == [
        Heartbeat(),
        LogLines(((0, 20, "x", "a line", 1.0),)),
        WorkerResult(1),
        WorkerResult(2),
        Heartbeat(),
    ]
    assert bytes(frames[3][1][0]) == big
    b.close()
    theirs.close()


# -- real launches ------------------------------------------------------------------------------


def _large(size: int) -> bytes:
    import torch.distributed  # noqa: F401 (as a real function would)

    return bytes([int(os.environ["RANK"])]) * size


def _large_through_the_agent(size: int) -> bytes:
    """As :func:`_large`, but this worker cannot open a connection of its own."""
    from torchrunx.wire import handshake

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConnectionRefusedError("no direct route from this worker")

    handshake.connect = refuse  # type: ignore[assignment]
    return _large(size)


@pytest.mark.parametrize("function", [_large, _large_through_the_agent])
def test_a_large_result_comes_back_whole_on_its_own_connection_or_through_the_agent(function):
    size = 3 * DIRECT_OUTCOME_BYTES + 5
    result = trx.launch(function, func_args=(size,), **LOCAL)
    assert [len(value) for value in result.results["localhost"]] == [size, size]
    assert result.rank(0) == b"\x00" * size and result.rank(1) == b"\x01" * size


def _killed_while_sending(size: int) -> bytes:
    """Rank 1 is SIGKILLed in the middle of sending its large result through the agent."""
    import signal

    from torchrunx.wire import handshake

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConnectionRefusedError("no direct route from this worker")

    handshake.connect = refuse  # type: ignore[assignment]
    if os.environ["RANK"] == "1":
        sendall = socket.socket.sendall

        def dies_while_sending(self: socket.socket, data: bytes) -> None:
            view = memoryview(data).cast("B")
            if len(view) < size:  # its hello, the start of its result's frame
                sendall(self, view)
                return
            sendall(self, view[: len(view) // 4])  # a quarter of the result is on its way
            os.kill(os.getpid(), signal.SIGKILL)

        socket.socket.sendall = dies_while_sending  # type: ignore[method-assign,assignment]
    return b"r" * size


def test_a_worker_killed_while_its_result_is_on_its_channel_is_a_worker_failure():
    with pytest.raises(WorkerFailedError) as info:
        trx.launch(_killed_while_sending, func_args=(8 * DIRECT_OUTCOME_BYTES,), **LOCAL)
    assert info.value.rank == 1
    assert info.value.signal == 9, str(info.value)
