"""The floor under the results case: how fast this machine moves two big tensors between processes.

Usage::

    python benchmarks/results_floor.py [--mb 400] [--runs 3]

Two forked processes (as workers are forked from an agent that imported torch) each make a
float32 tensor of ``--mb`` MB, mark the time, and send it to the parent over a loopback TCP
socket; the parent reads both connections in one thread (as the launcher's I/O loop does) and
rebuilds both tensors. From the first tensor ready to both rebuilt is the same span as the
results case's "tensor ready to result" in ``benchmarks/run.py``. Two ways:

- ``plain``: the tensor's bytes (``torchrunx.serialization``, no copy) with a length in front,
  received straight into their buffers: the bare floor, no framing, no encryption.
- ``sealed``: the same bytes through the real records (:class:`torchrunx.wire.records.Sealer`
  on the sending side, :class:`~torchrunx.wire.records.FrameReader` on non-blocking sockets in
  the parent): what sealing costs on top, without the launcher around it.

Prints each way's median and slowest throughput (MB/s, both tensors' bytes over the span).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import selectors
import socket
import statistics
import struct
import time

import torch

from torchrunx import serialization
from torchrunx.wire import messages
from torchrunx.wire.records import FrameReader, Sealer, SessionKeys

_SIZE = struct.Struct("!Q")
_RANKS = 2


def _send(address: tuple[str, int], nbytes: int, way: str, keys: SessionKeys, rank: int) -> None:
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    ready = time.time()
    with socket.create_connection(address) as sock:
        sock.sendall(struct.pack("!d", ready))
        parts = serialization.dumps(tensor)
        if way == "plain":
            sock.sendall(_SIZE.pack(len(parts)))
            sock.sendall(b"".join(_SIZE.pack(part.nbytes) for part in parts))
            for part in parts:
                sock.sendall(part)
        else:
            sealer = Sealer(keys.send)
            for record in sealer.seal_frame(messages.WorkerResult(rank, sent_at=ready), parts):
                sock.sendall(record)
            sock.sendall(sealer.seal_close())
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # until the parent closes


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if count == 0:
            raise ConnectionError("closed early")
        got += count
    return buffer


class _SealedReader:
    """The launcher's record reader, on a non-blocking socket."""

    def __init__(self, key: bytes) -> None:
        self.reader = FrameReader(key)

    def take(self, sock: socket.socket) -> tuple[list[torch.Tensor], bool]:
        """The tensors rebuilt from what came, and whether this connection is done."""
        frames, ended = self.reader.read(sock)
        if self.reader.error is not None:
            raise self.reader.error
        return [serialization.loads(payload) for _message, payload in frames], ended


class _PlainReader:
    """Non-blocking: the part count, the sizes, then each part into its own buffer."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.parts: list[bytearray] = []
        self.sizes: list[int] = []
        self.index = self.filled = 0

    def take(self, sock: socket.socket) -> tuple[list[torch.Tensor], bool]:
        """The tensors rebuilt from what came, and whether this connection is done."""
        if self._read(sock):
            return [serialization.loads(self.parts)], True
        return [], False

    def _read(self, sock: socket.socket) -> bool:
        while True:
            try:
                if not self.sizes:  # the head, read exactly (never into a part's bytes)
                    need = 8 if len(self.head) < 8 else 8 + 8 * _SIZE.unpack_from(self.head)[0]
                    chunk = sock.recv(need - len(self.head))
                    if not chunk:
                        raise ConnectionError("closed early")
                    self.head += chunk
                    if len(self.head) > 8 and len(self.head) == need:
                        self.sizes = [
                            _SIZE.unpack_from(self.head, 8 * i)[0] for i in range(1, need // 8)
                        ]
                        self.parts = [bytearray(size) for size in self.sizes]
                    continue
                while self.index < len(self.parts) and self.filled == self.sizes[self.index]:
                    self.index, self.filled = self.index + 1, 0
                if self.index == len(self.parts):
                    return True
                with memoryview(self.parts[self.index]) as view:
                    count = sock.recv_into(view[self.filled :])
                if count == 0:
                    raise ConnectionError("closed early")
                self.filled += count
            except BlockingIOError:
                return False


def measure(nbytes: int, way: str) -> float:
    """One transfer of two tensors; MB/s over first-ready to both rebuilt."""
    keys = SessionKeys(send=os.urandom(32), receive=b"")
    with socket.create_server(("127.0.0.1", 0)) as server:
        context = multiprocessing.get_context("fork")
        senders = [
            context.Process(
                target=_send, args=(server.getsockname(), nbytes, way, keys, rank), daemon=True
            )
            for rank in range(_RANKS)
        ]
        for sender in senders:
            sender.start()
        conns = [server.accept()[0] for _ in range(_RANKS)]
        readies = [struct.unpack("!d", _recv_exact(conn, 8))[0] for conn in conns]
        selector = selectors.DefaultSelector()
        readers: dict[int, tuple[socket.socket, _PlainReader | _SealedReader]] = {}
        for conn in conns:
            conn.settimeout(0.0)
            reader = _PlainReader() if way == "plain" else _SealedReader(keys.send)
            readers[conn.fileno()] = (conn, reader)
            selector.register(conn, selectors.EVENT_READ)
        results: list[torch.Tensor] = []
        while readers:
            for key, _ in selector.select(60):
                conn, reader = readers[key.fd]
                tensors, ended = reader.take(conn)
                results += tensors
                if ended:
                    selector.unregister(conn)
                    del readers[key.fd]
        done = time.time()
        selector.close()
        for conn in conns:
            conn.close()
        for sender in senders:
            sender.join(30)
    assert len(results) == _RANKS
    assert all(int(tensor.numel()) * 4 == nbytes for tensor in results)
    return float(_RANKS * nbytes / 1e6 / (done - min(readies)))


def main() -> None:
    """Measure both ways ``--runs`` times, taking turns, and print median and slowest."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"plain": [], "sealed": []}
    for _ in range(args.runs):
        for way, runs in figures.items():
            runs.append(measure(args.mb * 1_000_000, way))
    for way, runs in figures.items():
        print(
            f"{way:8} {statistics.median(runs):8.0f} MB/s median, {min(runs):8.0f} MB/s slowest "
            f"({args.runs} runs of 2 x {args.mb} MB)"
        )


if __name__ == "__main__":
    main()
