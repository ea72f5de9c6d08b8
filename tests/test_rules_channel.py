"""A worker's channel to its agent, as rules: where a stream may end (socket pairs, no process).

- a stream that ends between two frames is a clean end;
- one that ends anywhere inside a frame (its header's fixed part, its pickled message, a
  part) was cut: the reader reports an error, and the worker's end raises it.
"""

from __future__ import annotations

import socket
import struct

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
    assert "the channel ended inside a frame" in str(reader.error)


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
        with pytest.raises(ProtocolError, match="the channel ended inside a frame"):
            conn.recv()
        conn.close()


def test_rule_the_workers_end_sees_a_clean_end_between_frames_as_the_agents_end():
    worker, agent = socket.socketpair()
    with agent:
        agent.sendall(_WHOLE)
        agent.shutdown(socket.SHUT_WR)
        conn = ChannelConnection(worker)
        assert conn.recv() == (WorkerHello(0, 0, 1), [])
        with pytest.raises(ConnectionError, match="the agent ended the channel"):
            conn.recv()
        conn.close()
