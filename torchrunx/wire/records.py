"""Sealed records and the frames in them, and the framed :class:`Connection`.

Each direction of a connection has a :class:`Sealer` at one end and a :class:`FrameReader` at
the other; a :class:`Connection` holds one of each.

A record is ``!I`` (length of what follows, also authenticated) and the AES-256-GCM ciphertext
of at most :data:`RECORD_BYTES` of plaintext with its tag; its nonce is the direction's sequence
number. The plaintext is a stream of frames: ``!QI`` (header length, number of payload parts),
one ``!Q`` length per part, a pickled message of :mod:`torchrunx.wire.messages`, then the raw
parts. Each part starts a new piece of plaintext (:func:`frame_pieces`), and a large one is
sealed as a record of its own, so a receiver decrypts it straight into its own buffer; small
pieces queued together may share a record (:func:`take_plaintext`, the agent's outbox). A
stream ends with its sender's close record (an empty one).

A worker's channel to its agent carries the same frames without records
(:mod:`torchrunx.wire.channel`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import pickle
import socket
import struct
import threading
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from torchrunx.errors import ProtocolError, exception_text
from torchrunx.wire.frozen import field, frozen
from torchrunx.wire.messages import _load_message

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from torchrunx.wire.messages import Message

TAG_BYTES = 16
RECORD_BYTES = 1 << 20
"""Plaintext bytes in one record at most."""

_RECORD = struct.Struct("!I")
_MAX_RECORD = RECORD_BYTES + TAG_BYTES
IDLE_BUFFER_BYTES = 4096
"""Bytes a reader keeps for an idle connection: it grows to fit the record that comes (up to
a whole one) and gives the rest back once nothing is left to read."""
_NONCE = struct.Struct("!IQ")
_FRAME = struct.Struct("!QI")
_FRAME_BYTES = _FRAME.size
_PART = struct.Struct("!Q")
_PART_BYTES = _PART.size
_MAX_PARTS = 1 << 20
_MAX_HEADER = 64 * 1024 * 1024
MAX_FRAME_BYTES = 1 << 40
"""Payload bytes one frame may declare at most (1 TiB); a frame that declares more is refused
before anything is allocated for it, and its parts' buffers grow only as their bytes come."""


COALESCE_BYTES = 64 * 1024
"""Queued plaintext pieces smaller than this are sealed together, up to this much a record."""


def take_plaintext(
    pieces: collections.deque[bytes | memoryview],
) -> bytes | bytearray | memoryview:
    """The plaintext of the next record to seal, taken from the front of ``pieces``.

    Small pieces queued one after the other (frames' starts, small payload parts, of one frame
    or of several) go in one record, up to :data:`COALESCE_BYTES`: fewer records to seal and
    open for the same frames. A large piece is a record of its own, so a receiver still
    decrypts a large part straight into its buffer.
    """
    first = pieces.popleft()
    if len(first) >= COALESCE_BYTES or not pieces or len(pieces[0]) >= COALESCE_BYTES:
        return first
    merged = bytearray(first)
    while pieces and len(merged) + len(pieces[0]) <= COALESCE_BYTES:
        merged += pieces.popleft()
    return merged


@functools.lru_cache(maxsize=64)
def _part_sizes(count: int) -> struct.Struct:
    """The ``!Q`` sizes of a frame's ``count`` parts, as one struct."""
    return struct.Struct(f"!{count}Q")


def encode_frame_start(
    message: Message, payload: Sequence[bytes | bytearray | memoryview] = ()
) -> bytes:
    """The plaintext of a frame before its payload parts: lengths and the pickled message."""
    header = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = b"".join(_PART.pack(memoryview(part).nbytes) for part in payload)
    return _FRAME.pack(len(header), len(payload)) + sizes + header


def frame_pieces(
    message: Message, payload: Sequence[bytes | bytearray | memoryview]
) -> Iterator[memoryview | bytes]:
    """A frame's plaintext in pieces of at most RECORD_BYTES, each sealed as a record.

    Small pieces queued together may share one (:func:`take_plaintext`).

    The frame start is one piece (or more if it is large) and each payload part starts a new
    piece, so a receiver decrypts a large part straight into its own buffer.
    """
    start = encode_frame_start(message, payload)
    parts = [memoryview(start), *(memoryview(part).cast("B") for part in payload)]
    for part in parts:
        for offset in range(0, part.nbytes, RECORD_BYTES):
            yield part[offset : offset + RECORD_BYTES]


@frozen
class SessionKeys:
    """One connection's keys, as one end holds them (see ``handshake.session_keys``)."""

    send: bytes = field(repr=False)
    receive: bytes = field(repr=False)


class Sealer:
    """Seals one direction of a connection: each record encrypted and authenticated."""

    def __init__(self, key: bytes) -> None:
        """Seal with ``key`` (this direction's key of :class:`SessionKeys`)."""
        self._aead = AESGCM(key)
        self._sequence = 0

    def seal(self, piece: bytes | bytearray | memoryview) -> bytearray:
        """One record: its length (also authenticated), then the piece encrypted, then the tag.

        The nonce is this direction's sequence number, so no record can be replayed, reordered
        or dropped without the next one failing. An empty piece is the close record
        (:meth:`seal_close`): frames never make one.
        """
        size = len(piece) + TAG_BYTES
        record = bytearray(_RECORD.size + size)
        header = _RECORD.pack(size)
        record[: _RECORD.size] = header
        with memoryview(record) as view:
            self._aead.encrypt_into(self._next_nonce(), piece, header, view[_RECORD.size :])
        return record

    def seal_close(self) -> bytearray:
        """The authenticated close record: the last record of this direction, before FIN.

        A receiver that sees the stream end without it knows the stream was cut (records
        dropped on the way, then a FIN or a reset), not closed by its sender.
        """
        return self.seal(b"")

    def seal_frame(
        self, message: Message, payload: Sequence[bytes | bytearray | memoryview] = ()
    ) -> Iterator[bytearray]:
        """The records of one frame, sealed one by one as they are taken (lazily)."""
        return (self.seal(piece) for piece in frame_pieces(message, payload))

    def _next_nonce(self) -> bytes:
        nonce = _NONCE.pack(0, self._sequence)  # struct.error at 2**64 records: never reused
        self._sequence += 1
        return nonce


def send_close(sock: socket.socket, sealer: Sealer) -> bool:
    """Send ``sealer``'s close record on ``sock`` without blocking; whether it all went.

    Best effort: a record that does not fit whole in the socket's buffer is cut, which the
    receiver sees as a truncated stream (so it is never taken for a clean close).
    """
    record = sealer.seal_close()
    with contextlib.suppress(OSError):
        return sock.send(record, socket.MSG_DONTWAIT) == len(record)
    return False


class Connection:
    """An authenticated socket that sends and receives framed, sealed messages.

    Sending is safe from several threads; receiving belongs to one reader.
    """

    def __init__(self, sock: socket.socket, keys: SessionKeys) -> None:
        """Wrap a socket that has completed the handshake that gave ``keys``."""
        self.sock = sock
        self.sealer = Sealer(keys.send)
        """Seals what this end sends; an :class:`~torchrunx.agent.outbox.Outbox` may share it."""
        self._reader = FrameReader(keys.receive)
        self._frames: collections.deque[Frame] = collections.deque()
        self._send_lock = threading.Lock()
        self._close_sent = False

    def fileno(self) -> int:
        """The socket's file descriptor (for selectors)."""
        return self.sock.fileno()

    def send(
        self, message: Message, payload: Sequence[bytes | bytearray | memoryview] = ()
    ) -> None:
        """Send one message and its optional raw payload parts.

        Raises:
            OSError: The connection is broken.
        """
        with self._send_lock:
            for record in self.sealer.seal_frame(message, payload):
                self.sock.sendall(record)

    def send_close(self) -> None:
        """Send the authenticated close record (once; nothing may be sent after it)."""
        with self._send_lock:
            if not self._close_sent:
                self._close_sent = True
                send_close(self.sock, self.sealer)

    def recv(self) -> tuple[Message, list[bytearray]]:
        """Receive one message and its payload parts (blocking, honouring the socket timeout).

        Frames that came before a bad record are delivered first; the error comes after them.

        Raises:
            ConnectionError: The peer closed the connection cleanly (its close record came).
            ProtocolError: A record failed authentication, the frame is not a torchrunx
                message or is malformed (nothing of it was unpickled beyond the protocol's
                own message classes), or the stream ended without its close record.
            OSError: The connection is broken or timed out.
        """
        while not self._frames:
            self._frames.extend(self._reader.read_record(self.sock))
        return self._frames.popleft()

    def close(self) -> None:
        """Send the close record (best effort, see :meth:`send_close`), close; safe twice."""
        if self.sock.fileno() >= 0:
            self.send_close()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


Frame = tuple["Message", list[bytearray]]
"""One received message and its payload parts."""


class FrameParser:
    """Cuts authenticated plaintext into frames; a large part is filled in place.

    A frame's declared sizes are checked (:data:`MAX_FRAME_BYTES`) before anything is
    allocated, and each part's buffer grows as its bytes come, never past its declared size.
    Also the parser of a worker's channel (:mod:`torchrunx.wire.channel`), fed plain bytes.
    """

    def __init__(self) -> None:
        """A parser between frames, with nothing buffered."""
        self._buffer = bytearray()
        self._message: Message | None = None
        """The frame whose parts are being filled (``None``: between frames)."""
        self._sizes: list[int] = []
        self._parts: list[bytearray] = []
        self._part = 0
        self._filled = 0

    def release_if_idle(self) -> None:
        """Between frames with nothing buffered: give back the buffer's memory."""
        if self.idle:
            self._buffer = bytearray()

    @property
    def idle(self) -> bool:
        """No frame is begun: the plaintext so far ended on a frame boundary."""
        return self._message is None and not self._buffer

    def _room(self, size: int) -> bytearray:
        """The current part, grown (at least doubling) so that ``size`` more bytes fit."""
        part = self._parts[self._part]
        need = self._filled + size
        if len(part) < need:
            grown = min(self._sizes[self._part], max(need, 2 * len(part)))
            part += bytes(grown - len(part))
        return part

    def wanted(self) -> int:
        """Bytes the current part still misses (0 between frames)."""
        if self._message is None:
            return 0
        return self._sizes[self._part] - self._filled

    def target(self, size: int) -> memoryview | None:
        """Where ``size`` bytes of the current part go, if they all fit in it."""
        if self._message is None or self._sizes[self._part] - self._filled < size:
            return None
        part = self._room(size)
        return memoryview(part)[self._filled : self._filled + size]

    def filled(self, size: int, frames: list[Frame]) -> None:
        """``size`` bytes were written to :meth:`target`."""
        self._filled += size
        self._finish(frames)

    def feed(self, data: bytes | bytearray, frames: list[Frame]) -> None:
        """Take plaintext; append every frame it completes to ``frames``."""
        with memoryview(data) as view:
            position = self._fill(view, 0, frames)
            if position == len(view):
                return
            if self._buffer:  # the start of a frame came before: cut from the whole
                self._buffer += view[position:]
            else:  # cut straight from ``data``; keep only what no whole frame took
                position = self._cut(view, position, frames)
                if position < len(view):
                    self._buffer += view[position:]
                return
        with memoryview(self._buffer) as whole:
            position = self._cut(whole, 0, frames)
        del self._buffer[:position]

    def _fill(self, view: memoryview, position: int, frames: list[Frame]) -> int:
        """Copy from ``view[position:]`` into the current frame's parts; the new position."""
        while self._message is not None and position < len(view):
            take = min(self._sizes[self._part] - self._filled, len(view) - position)
            part = self._room(take)
            part[self._filled : self._filled + take] = view[position : position + take]
            self._filled += take
            position += take
            self._finish(frames)
        return position

    def _finish(self, frames: list[Frame]) -> None:
        while self._part < len(self._parts) and self._filled == self._sizes[self._part]:
            self._part, self._filled = self._part + 1, 0
        if self._message is not None and self._part == len(self._parts):
            frames.append((self._message, self._parts))
            self._message, self._sizes, self._parts, self._part, self._filled = (
                None,
                [],
                [],
                0,
                0,
            )

    def _cut(self, view: memoryview, start: int, frames: list[Frame]) -> int:
        """Cut whole frames from ``view[start:]``; the position of what is left.

        A frame whose parts are not all there is begun (its parts fill as their bytes come);
        what is left is a frame's start that is not whole yet.
        """
        length = len(view)
        while self._message is None and length - start >= _FRAME_BYTES:
            header_size, count = _FRAME.unpack_from(view, start)
            if header_size > _MAX_HEADER or count > _MAX_PARTS:
                raise ProtocolError(
                    f"frame of {header_size} header bytes, {count} parts is too large"
                )
            body = start + _FRAME_BYTES + _PART_BYTES * count
            end = body + header_size
            if length < end:
                break
            sizes = list(_part_sizes(count).unpack_from(view, start + _FRAME_BYTES))
            total = sum(sizes)
            if total > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {total} payload bytes: more than {MAX_FRAME_BYTES}")
            message = _load_message(view[body:end])
            if length - end >= total:  # the whole frame is here: its parts are cut at once
                parts = []
                for size in sizes:
                    parts.append(bytearray(view[end : end + size]))
                    end += size
                frames.append((message, parts))
                start = end
                continue
            self._message, self._sizes = message, sizes
            self._parts = [bytearray() for _ in sizes]
            self._finish(frames)  # its empty parts, if it starts with some
            start = self._fill(view, end, frames)
        return start


_INVALID_RECORD = (
    "a record failed authentication (altered, injected, replayed, reordered or dropped on the "
    "way, or sealed with another key): the connection is dropped"
)


class FrameReader:
    """Opens the records of one direction of a connection and decodes the frames in them.

    A record is opened (decrypted and its tag checked) before any byte of it is looked at:
    one that fails raises :class:`ProtocolError`, and nothing of it, or after it, is ever
    unpickled; frames completed before it are still delivered, then the error. Records are
    read as they come on a non-blocking socket (:meth:`read`, for an I/O loop) or one at a
    time on a blocking one (:meth:`read_record`). A large payload part is decrypted straight
    into its own buffer.

    A stream ends with its sender's close record (an empty record, :meth:`Sealer.seal_close`):
    an end without it (FIN or reset) is a truncated stream, reported as a
    :class:`ProtocolError`, and so is any record after it.
    """

    def __init__(self, key: bytes) -> None:
        """Open with ``key`` (the peer's sending key)."""
        self._aead = AESGCM(key)
        self._sequence = 0
        self._raw = bytearray(IDLE_BUFFER_BYTES)
        """Records as they come: sized to the record being read, back to small when idle."""
        self._have = 0
        self._parser = FrameParser()
        self.closed_by_peer = False
        """The peer's close record came: its stream is whole, and over."""
        self.received = 0
        """Bytes :meth:`read` took from the socket so far (progress of a large frame)."""
        self.error: Exception | None = None
        """Why the stream ended badly, once :meth:`read` returned its end (``None``: it did
        not, or the end was the peer's clean close)."""
        self._pending_error: Exception | None = None

    def read(
        self, sock: socket.socket, budget: int = 16 << 20, *, drain: bool = False
    ) -> tuple[list[Frame], bool]:
        """Read what ``sock`` holds now (about ``budget`` bytes at most); return whole frames.

        A read that did not fill the buffer is taken to have emptied the socket (the caller's
        loop says when more comes); with ``drain``, reading goes on until the socket says it
        has nothing, or ends.

        Never raises: a failure (a bad record, a malformed frame, a truncated stream, a broken
        connection) returns the frames completed before it and the end, with :attr:`error`.

        Returns:
            The frames completed, and whether the stream is over (closed or failed).
        """
        frames: list[Frame] = []
        received = 0
        try:
            while received < budget:
                self._make_room()
                room = len(self._raw) - self._have
                try:
                    with memoryview(self._raw) as view:
                        count = sock.recv_into(view[self._have :])
                except (BlockingIOError, InterruptedError):
                    self._release_if_idle()
                    return frames, False
                if count == 0:
                    self._check_end()
                    return frames, True
                received += count
                self.received += count
                self._have += count
                self._open_all(frames)
                if count < room and not drain:  # it had no more: the loop says when more comes
                    self._release_if_idle()
                    return frames, False
        except Exception as exc:  # noqa: BLE001 (any failure ends this stream, and only it)
            self.error = exc
            return frames, True
        return frames, False

    def read_record(self, sock: socket.socket) -> list[Frame]:
        """Read and open exactly one record from a blocking ``sock``; the frames it completed.

        Raises:
            ConnectionError: The peer closed the connection after its close record.
            ProtocolError: As for :meth:`read`, or the stream ended without a close record.
            OSError: The connection is broken or timed out.
        """
        if self._pending_error is not None:
            raise self._pending_error
        if self._have:
            raise ProtocolError("read_record after read: one reading style per connection")
        frames: list[Frame] = []
        with memoryview(self._raw) as view:
            try:
                _recv_exact_into(sock, view[: _RECORD.size])
            except ConnectionError:
                self._check_end()
                raise
            size = self._record_size(0)
        if len(self._raw) < _RECORD.size + size:  # grown to what came (kept for the next)
            self._raw += bytes(_RECORD.size + size - len(self._raw))
        with memoryview(self._raw) as view:
            try:
                _recv_exact_into(sock, view[_RECORD.size : _RECORD.size + size])
            except ConnectionError:
                raise ProtocolError("the stream ended in the middle of a record") from None
            try:
                self._open(view[: _RECORD.size + size], frames)
            except ProtocolError as exc:
                if not frames:
                    raise
                self._pending_error = exc  # the frames before it first; the error next time
        return frames

    def _make_room(self) -> None:
        """Grow the buffer, if it is full, to hold the whole record that is coming."""
        if self._have < len(self._raw):
            return
        need = _RECORD.size + self._record_size(0)  # full: a record's header is in it
        grown = max(need, min(2 * len(self._raw), _RECORD.size + _MAX_RECORD))
        self._raw += bytes(grown - len(self._raw))

    def _release_if_idle(self) -> None:
        """Nothing more to read now: give back a grown buffer, keeping what is unread."""
        if len(self._raw) > IDLE_BUFFER_BYTES and self._have <= IDLE_BUFFER_BYTES:
            small = bytearray(IDLE_BUFFER_BYTES)
            small[: self._have] = self._raw[: self._have]
            self._raw = small
        self._parser.release_if_idle()

    def _check_end(self) -> None:
        """The stream ended here: fine after the peer's close record, else truncated."""
        if not self.closed_by_peer:
            raise ProtocolError(
                "the connection ended without its authenticated close: the stream was cut "
                "(its last records dropped on the way, or its sender died)"
            )

    def _record_size(self, start: int) -> int:
        with memoryview(self._raw) as view:
            return self._record_size_of(view[start:])

    @staticmethod
    def _record_size_of(view: memoryview) -> int:
        (size,) = _RECORD.unpack_from(view)
        if not TAG_BYTES <= size <= _MAX_RECORD:
            raise ProtocolError(f"record of {size} bytes: not a torchrunx record")
        return int(size)

    def _open_all(self, frames: list[Frame]) -> None:
        start = 0
        with memoryview(self._raw) as view:
            while self._have - start >= _RECORD.size:
                end = start + _RECORD.size + self._record_size(start)
                if end > self._have:
                    break
                self._open(view[start:end], frames)
                start = end
            if start:
                view[: self._have - start] = view[start : self._have]
                self._have -= start

    def _open(self, record: memoryview, frames: list[Frame]) -> None:
        if self.closed_by_peer:
            raise ProtocolError("a record after the peer's close record")
        header, sealed = record[: _RECORD.size], record[_RECORD.size :]
        nonce = _NONCE.pack(0, self._sequence)
        self._sequence += 1
        size = len(sealed) - TAG_BYTES
        if size == 0:  # the close record: authenticated like any other
            try:
                self._aead.decrypt(nonce, sealed, header)
            except InvalidTag:
                raise ProtocolError(_INVALID_RECORD) from None
            if not self._parser.idle:
                raise ProtocolError("the peer closed its stream in the middle of a frame")
            self.closed_by_peer = True
            return
        target = self._parser.target(size)
        if target is not None:
            with target:
                try:
                    self._aead.decrypt_into(nonce, sealed, header, target)
                except InvalidTag:
                    target[:] = bytes(size)  # nothing unverified stays in the part
                    raise ProtocolError(_INVALID_RECORD) from None
            self._parser.filled(size, frames)
            return
        try:
            plaintext = self._aead.decrypt(nonce, sealed, header)
        except InvalidTag:
            raise ProtocolError(_INVALID_RECORD) from None
        try:
            self._parser.feed(plaintext, frames)
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 (a malformed frame from an authenticated peer)
            raise ProtocolError(
                f"malformed frame ({type(exc).__name__}: {exception_text(exc)})"
            ) from None


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    received = 0
    size = len(view)
    # On blocking sockets, MSG_WAITALL reads large records in few syscalls (and GIL hand-offs).
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    while received < size:
        count = sock.recv_into(view[received:], size - received, flags)
        if count == 0:
            raise ConnectionError("connection closed by peer")
        received += count
