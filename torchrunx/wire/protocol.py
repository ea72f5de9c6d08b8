"""The wire protocol between launcher, agents and workers.

Before any connection exists, the launcher hands each agent an :class:`AgentBootstrap` as one
line of JSON on the agent's stdin (where to connect, the secret, its settings); it is never
pickled. Every connection is TCP from an agent or a worker to the launcher's listening socket.
It starts with a mutual challenge-response handshake over a per-launch random secret, and
nothing is unpickled from a peer before it has proved it knows that secret::

    launcher (server)                                agent / worker (client)
      accept  ── MAGIC | server nonce ──────────────▶
              ◀── MAGIC | role | client nonce | HMAC(secret, "client", role, ns, nc) ──
      verify  ── HMAC(secret, "server", nc, ns) ────▶ verify
              ◀════════════ sealed records (both ways) ════════════▶

After the handshake every byte travels in records sealed with AES-256-GCM. Each direction
has its own key, derived with HKDF-SHA256 from the secret and both nonces (so every
connection's keys are new), and its own sequence number, which is the record's nonce: a
record that was altered, injected, replayed, reordered or dropped fails authentication, and
the connection is dropped before anything in it is unpickled. A record is ``!I`` (length of
what follows, also authenticated) and the ciphertext of at most :data:`RECORD_BYTES` of
plaintext with its 16-byte tag.

The plaintext is a stream of frames. A frame is ``!QI`` (header length, number of payload
parts), one ``!Q`` length per part, a pickled message dataclass from this module, then the
raw parts (user data from :mod:`torchrunx.serialization`: the pickle stream and one buffer
per tensor). Each part starts a new record, so a receiver decrypts a large part straight into
its own buffer.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import io
import json
import math
import os
import pickle
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from torchrunx.errors import ProtocolError, exception_text

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

PROTOCOL_VERSION = 3
"""3: a stream ends with an authenticated close record (an empty one), see :class:`FrameReader`."""
MAGIC = b"TORCHRUNX/%03d\n" % PROTOCOL_VERSION
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
SECRET_BYTES = 32
HEARTBEAT_INTERVAL = 1.0
"""Seconds between an agent's heartbeats (the launcher sends its own twice as often)."""
KEY_BYTES = 32
"""AES-256-GCM keys, one per direction of a connection."""
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
_PART = struct.Struct("!Q")
_MAX_PARTS = 1 << 20
_MAX_HEADER = 64 * 1024 * 1024
MAX_FRAME_BYTES = 1 << 40
"""Payload bytes one frame may declare at most (1 TiB); a frame that declares more is refused
before anything is allocated for it, and its parts' buffers grow only as their bytes come."""
_ROLES: dict[bytes, Literal["agent", "worker"]] = {b"A": "agent", b"W": "worker"}

Role = Literal["agent", "worker"]


# --------------------------------------------------------------------------------------------
# The bootstrap: launcher -> agent, one JSON line on the agent's stdin, before any connection.
# --------------------------------------------------------------------------------------------

COUNT_MODES = ("auto", "gpu", "cpu")
"""What an agent counts for its worker count when the launcher gave none."""


@dataclass(frozen=True)
class AgentBootstrap:
    """What an agent needs to find and join its launch; sent as one JSON line on its stdin.

    It travels before the agent has connected (the handshake needs :attr:`secret`), so it is
    plain JSON, never pickled: :meth:`to_json_line` writes it and :meth:`from_json_line`, run
    first thing in the agent, checks every field.
    """

    host_index: int
    """Index of the agent's host in the launcher's host list."""
    hostname: str
    """The host's name as the launcher knows it."""
    launcher_address: str
    """Address on which this host reaches the launcher's listening socket."""
    launcher_port: int
    secret: bytes = field(repr=False)
    """The per-launch secret of the handshake (hex in the JSON line)."""
    workers: int | None
    """Workers to start, or ``None`` to let the agent count them (see :attr:`count`)."""
    preload_torch: bool
    """Import ``torch.distributed`` once in the agent, before forking (not for ``backend=None``)."""
    heartbeat_interval: float
    """Seconds between the agent's heartbeats."""
    agent_timeout: float
    """Seconds without a message from the launcher after which the agent stops by itself."""
    log_level: int
    """Level of the agent's root logger (``TORCHRUNX_LOG_LEVEL``)."""
    sys_path: tuple[str, ...]
    """The launcher's ``sys.path``, set by the boot code before it imports torchrunx."""
    count: str = "auto"
    """What the agent counts when ``workers`` is None: "auto" (GPUs, else CPU cores), "gpu"
    or "cpu" (``workers_per_host`` of that name)."""
    warm: bool = False
    """Stay after each run's workers end, for the next run, until a final Stop (warm agents)."""
    local_only: bool = False
    """Every host of the launch is the launcher's machine: host 0's rendezvous store listens on
    loopback only (:mod:`torchrunx.agent.store`); else on every interface."""

    def to_json_line(self) -> bytes:
        """Encode as one line of JSON (the secret as hex), ending with a newline."""
        data: dict[str, Any] = {
            "host_index": self.host_index,
            "hostname": self.hostname,
            "launcher": [self.launcher_address, self.launcher_port],
            "secret": self.secret.hex(),
            "workers": self.workers,
            "count": self.count,
            "preload_torch": self.preload_torch,
            "heartbeat_interval": self.heartbeat_interval,
            "agent_timeout": self.agent_timeout,
            "log_level": self.log_level,
            "sys_path": list(self.sys_path),
            "warm": self.warm,
            "local_only": self.local_only,
        }
        return json.dumps(data).encode() + b"\n"

    @classmethod
    def from_json_line(cls, line: bytes | str) -> AgentBootstrap:
        """Decode and check a line written by :meth:`to_json_line`.

        Raises:
            ProtocolError: The line is not JSON, lacks a field, has an unknown one, or a field
                has the wrong type or an impossible value; the message names the field.
        """
        try:
            data = json.loads(line)
        except ValueError as exc:  # also a UnicodeDecodeError
            raise ProtocolError(f"malformed agent bootstrap: not a line of JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ProtocolError(
                f"malformed agent bootstrap: a JSON object expected, got {type(data).__name__}"
            )
        fields = _BootstrapFields(data)
        address, port = fields.launcher()
        bootstrap = cls(
            host_index=fields.integer("host_index", minimum=0),
            hostname=fields.text("hostname"),
            launcher_address=address,
            launcher_port=port,
            secret=fields.secret("secret"),
            workers=fields.workers("workers"),
            preload_torch=fields.boolean("preload_torch"),
            heartbeat_interval=fields.seconds("heartbeat_interval"),
            agent_timeout=fields.seconds("agent_timeout"),
            log_level=fields.integer("log_level", minimum=0),
            sys_path=fields.paths("sys_path"),
            count=fields.choice("count", COUNT_MODES, default="auto"),
            warm=fields.boolean("warm"),
            local_only=fields.boolean("local_only"),
        )
        fields.no_others()
        return bootstrap


class _BootstrapFields:
    """Reads the fields of a decoded bootstrap object, each checked, naming any bad one."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.read: set[str] = set()

    def _get(self, name: str) -> object:
        self.read.add(name)
        if name not in self.data:
            raise ProtocolError(f"malformed agent bootstrap: field {name!r} is missing")
        return self.data[name]

    @staticmethod
    def _bad(name: str, expected: str, value: object) -> ProtocolError:
        return ProtocolError(
            f"malformed agent bootstrap: field {name!r} must be {expected}, got {value!r}"
        )

    def integer(self, name: str, *, minimum: int) -> int:
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._bad(name, f"an integer of at least {minimum}", value)
        return value

    def text(self, name: str) -> str:
        value = self._get(name)
        if not isinstance(value, str) or not value:
            raise self._bad(name, "a non-empty string", value)
        return value

    def boolean(self, name: str) -> bool:
        value = self._get(name)
        if not isinstance(value, bool):
            raise self._bad(name, "true or false", value)
        return value

    def seconds(self, name: str) -> float:
        value = self._get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise self._bad(name, "a finite number of seconds above 0", value)
        return float(value)

    def workers(self, name: str) -> int | None:
        value = self._get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self._bad(name, "a positive integer or null", value)
        return value

    def secret(self, name: str) -> bytes:
        value = self._get(name)
        try:
            secret = bytes.fromhex(value) if isinstance(value, str) else b""
        except ValueError:
            secret = b""
        if not secret:
            raise self._bad(name, "a non-empty hex string", value)
        return secret

    def paths(self, name: str) -> tuple[str, ...]:
        value = self._get(name)
        if not isinstance(value, list) or not all(isinstance(entry, str) for entry in value):
            raise self._bad(name, "a list of strings", value)
        return tuple(value)

    def choice(self, name: str, choices: tuple[str, ...], *, default: str) -> str:
        if name not in self.data:
            self.read.add(name)
            return default
        value = self._get(name)
        if value not in choices:
            raise self._bad(name, " or ".join(repr(choice) for choice in choices), value)
        return str(value)

    def launcher(self) -> tuple[str, int]:
        value = self._get("launcher")
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not isinstance(value[0], str)
            or not value[0]
            or isinstance(value[1], bool)
            or not isinstance(value[1], int)
            or not 0 < value[1] < 65536
        ):
            raise self._bad("launcher", "[address, port]", value)
        return value[0], value[1]

    def no_others(self) -> None:
        unknown = sorted(set(self.data) - self.read)
        if unknown:
            raise ProtocolError(f"malformed agent bootstrap: unknown field(s) {unknown}")


# --------------------------------------------------------------------------------------------
# Messages. Agent -> launcher, launcher -> agent, worker -> launcher.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentHello:
    """First message of an agent: who it is and what its host offers."""

    host_index: int
    hostname: str
    pid: int
    slots: int
    """Workers this host would run for ``workers_per_host="auto"`` (GPUs, else CPU cores)."""
    free_port: int
    """A port that was free on this host, used as ``MASTER_PORT`` if it runs rank 0."""
    gpus: int = 0
    """GPUs the agent counted on its host (``devices.count_local_gpus``), for ``backend="auto"``."""


@dataclass(frozen=True)
class WorkerSpec:
    """Blueprint of the worker group an agent starts; its payload is the cloudpickled call."""

    host_index: int
    hostname: str
    num_workers: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str | None
    """The process-group backend, never ``"auto"``: the launcher resolved it for every host."""
    timeout: float
    """The process-group timeout in seconds."""
    isolate_gpus: bool = False
    """Set each worker's CUDA_VISIBLE_DEVICES to its own GPU (unless already set)."""
    log_level: int = 20
    """Level of the workers' root logger (``TORCHRUNX_LOG_LEVEL``)."""
    attempt: int = 0
    """Numbers every worker group of the agents' life: 0 first, then one more for each
    restart and (warm agents) each run. Replies name it, so a late one is told apart."""
    max_restarts: int = 0
    restarts: int = 0
    """Restarts so far in this run (``TORCHELASTIC_RESTART_COUNT``); ``attempt`` in a launch."""
    keep: bool = False
    """Workers that stay (``Launcher.warm(keep_workers=True)``): after its outcome a worker
    waits on its connection for the next run's :class:`WorkerCall`, in the same process and
    process group."""


@dataclass(frozen=True)
class WorkersStarted:
    """Agent: the workers were forked; their pids in local-rank order."""

    pids: tuple[int, ...]


@dataclass(frozen=True)
class WorkerExited:
    """Agent: a worker process ended (seen at once through its pidfd)."""

    local_rank: int
    pid: int
    exitcode: int | None
    signal: int | None
    stopped: bool = False
    """The agent had signalled it (a Stop, a restart, the end of the launch): its end is not a
    failure of its own."""
    at: float = 0.0
    """Unix time the agent saw it end."""


@dataclass(frozen=True)
class LogLines:
    """Agent: whole lines its workers wrote, in order per worker and stream, and its own records.

    Each record is ``(local_rank, levelno, logger name, text, unix time read)``; ``local_rank``
    is ``None`` for a ``logging`` record of the agent itself (sent on the same connection, so
    "worker N exited" never overtakes that worker's last lines).
    """

    records: tuple[tuple[int | None, int, str, str, float], ...]


@dataclass(frozen=True)
class AgentDone:
    """Agent: every worker ended and was reaped; the agent exits after this."""


@dataclass(frozen=True)
class Stop:
    """Launcher: stop the workers (SIGTERM, then SIGKILL after the grace period) and exit."""

    reason: str
    grace_period: float = 3.0
    dump_stacks: bool = True
    """Send each live worker's Python stacks (:class:`WorkerStacks`) before stopping."""
    restart: bool = False
    """Stop only the workers: then send :class:`WorkersEnded` and wait for a new spec."""
    attempt: int = 0
    """The launcher's attempt being stopped (echoed in :class:`WorkersEnded`)."""


@dataclass(frozen=True)
class WorkersEnded:
    """Agent: every worker of ``attempt`` ended, and the agent waits for the launcher.

    Sent after a ``Stop(restart=True)``, and also unasked when restarts are possible
    (``attempt < max_restarts``): then the agent stays until the launcher sends a new
    :class:`WorkerSpec` (a restart) or a :class:`Stop` (the launch is over).
    """

    free_port: int
    """A port free on this host now, for the next group's ``MASTER_PORT``."""
    attempt: int = -1
    """The attempt whose workers ended (-1: none had started)."""


@dataclass(frozen=True)
class WorkerTimedOut:
    """Agent: a worker stayed in a watchdog scope (``torchrunx.timer``) past its limit."""

    local_rank: int
    scope: str
    limit: float
    stack: str


@dataclass(frozen=True)
class WorkerStacks:
    """Agent: the Python stacks of its workers that were still running, by local rank."""

    stacks: dict[int, str]


@dataclass(frozen=True)
class Heartbeat:
    """Either direction: I am alive."""


@dataclass(frozen=True)
class WorkerHello:
    """Worker: first message on its own connection."""

    rank: int
    local_rank: int
    pid: int
    attempt: int = 0


@dataclass(frozen=True)
class WorkerCall:
    """Launcher, to a worker that stays: run this call next; the payload is the pickled call.

    The worker answers with :class:`WorkerResult` or :class:`WorkerException`, as for the call
    of its spec. Its connection's end tells it to exit.
    """

    run: int
    """The warm run this call belongs to (1 for the first run)."""


@dataclass(frozen=True)
class WorkerResult:
    """Worker: the function returned; the payload is the cloudpickled return value."""

    rank: int
    init_seconds: float = 0.0
    """Time in ``init_process_group`` (and its barrier)."""
    function_seconds: float = 0.0
    """Time in the function."""
    pickle_seconds: float = 0.0
    """Time to pickle the return value."""
    sent_at: float = 0.0
    """Wall-clock time the worker began sending the value."""


@dataclass(frozen=True)
class WorkerException:
    """Worker: the function raised.

    The payload is the cloudpickled exception, or empty when it could not be pickled and
    restored; the type name, message and formatted traceback always travel as text.
    """

    rank: int
    type_name: str
    message: str
    traceback: str
    unpicklable_result: bool = False
    """True when the function returned but its value could not be pickled."""
    collective: bool = False
    """True when the exception looks like the echo of another rank's failure in a collective
    (:func:`torchrunx.errors.is_collective_error`)."""
    at: float = 0.0
    """Unix time the worker caught it."""


Message = (
    AgentHello
    | WorkerSpec
    | WorkersStarted
    | WorkerExited
    | LogLines
    | AgentDone
    | Stop
    | WorkerStacks
    | WorkersEnded
    | WorkerTimedOut
    | Heartbeat
    | WorkerHello
    | WorkerCall
    | WorkerResult
    | WorkerException
)
_MESSAGE_TYPES = (
    AgentHello,
    WorkerSpec,
    WorkersStarted,
    WorkerExited,
    LogLines,
    AgentDone,
    Stop,
    WorkerStacks,
    WorkersEnded,
    WorkerTimedOut,
    Heartbeat,
    WorkerHello,
    WorkerCall,
    WorkerResult,
    WorkerException,
)


# --------------------------------------------------------------------------------------------
# Handshake
# --------------------------------------------------------------------------------------------


def new_secret() -> bytes:
    """A fresh random per-launch secret."""
    return os.urandom(SECRET_BYTES)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    with memoryview(buffer) as view:
        _recv_exact_into(sock, view)
    return buffer


CLIENT_REPLY_BYTES = len(MAGIC) + 1 + NONCE_BYTES + MAC_BYTES
"""Size of a client's handshake reply (fixed, so a server can read it without parsing)."""


def server_greeting(server_nonce: bytes) -> bytes:
    """The first bytes a server sends: the protocol magic and its fresh nonce."""
    return MAGIC + server_nonce


@dataclass(frozen=True)
class SessionKeys:
    """One connection's keys, as one end holds them."""

    send: bytes = field(repr=False)
    receive: bytes = field(repr=False)


def session_keys(
    secret: bytes, server_nonce: bytes, client_nonce: bytes, role_byte: bytes, *, server: bool
) -> SessionKeys:
    """Derive a connection's two keys (HKDF-SHA256) from the secret and both nonces.

    Both nonces are fresh, so every connection has keys of its own; the role is bound in too.
    """

    def derive(direction: bytes) -> bytes:
        return HKDF(
            algorithm=SHA256(),
            length=KEY_BYTES,
            salt=server_nonce + client_nonce,
            info=b"torchrunx %d %s %s" % (PROTOCOL_VERSION, role_byte, direction),
        ).derive(secret)

    to_server, to_client = derive(b"client->server"), derive(b"server->client")
    if server:
        return SessionKeys(send=to_client, receive=to_server)
    return SessionKeys(send=to_server, receive=to_client)


def check_client_reply(
    secret: bytes, server_nonce: bytes, reply: bytes
) -> tuple[Role, bytes, SessionKeys]:
    """Verify a client's handshake reply.

    Returns:
        The client's role, the server's proof to send back, and the server's keys.

    Raises:
        ProtocolError: The peer does not speak the protocol or does not know the secret.
    """
    magic, rest = reply[: len(MAGIC)], reply[len(MAGIC) :]
    if magic != MAGIC or len(reply) != CLIENT_REPLY_BYTES:
        raise ProtocolError(f"peer does not speak torchrunx protocol version {PROTOCOL_VERSION}")
    role_byte, client_nonce, client_mac = (
        rest[:1],
        rest[1 : 1 + NONCE_BYTES],
        rest[1 + NONCE_BYTES :],
    )
    expected = _mac(secret, b"client", role_byte, server_nonce, client_nonce)
    if role_byte not in _ROLES or not hmac.compare_digest(expected, client_mac):
        raise ProtocolError("peer failed to authenticate (wrong or missing launch secret)")
    keys = session_keys(secret, server_nonce, client_nonce, role_byte, server=True)
    return _ROLES[role_byte], _mac(secret, b"server", client_nonce, server_nonce), keys


def server_handshake(sock: socket.socket, secret: bytes) -> tuple[Role, SessionKeys]:
    """Authenticate a client that connected to the launcher; return its role and the keys.

    Only fixed-size byte strings are read here: nothing is unpickled.

    Raises:
        ProtocolError: The peer does not speak the protocol or does not know the secret.
        OSError: The connection failed or timed out.
    """
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(server_greeting(server_nonce))
    reply = bytes(_recv_exact(sock, CLIENT_REPLY_BYTES))
    role, proof, keys = check_client_reply(secret, server_nonce, reply)
    sock.sendall(proof)
    return role, keys


GREETING_BYTES = len(MAGIC) + NONCE_BYTES
"""Size of a server's greeting."""


def client_reply(secret: bytes, greeting: bytes, role: Role) -> tuple[bytes, bytes, SessionKeys]:
    """A client's answer to the server's greeting, the proof it expects back, and its keys.

    Raises:
        ProtocolError: The greeting is not a torchrunx launcher's.
    """
    if greeting[: len(MAGIC)] != MAGIC or len(greeting) != GREETING_BYTES:
        raise ProtocolError(
            f"launcher does not speak torchrunx protocol version {PROTOCOL_VERSION}"
        )
    server_nonce = greeting[len(MAGIC) :]
    client_nonce = os.urandom(NONCE_BYTES)
    role_byte = b"A" if role == "agent" else b"W"
    mac = _mac(secret, b"client", role_byte, server_nonce, client_nonce)
    expected = _mac(secret, b"server", client_nonce, server_nonce)
    keys = session_keys(secret, server_nonce, client_nonce, role_byte, server=False)
    return MAGIC + role_byte + client_nonce + mac, expected, keys


def client_handshake(sock: socket.socket, secret: bytes, role: Role) -> SessionKeys:
    """Authenticate to the launcher, check that it knows the secret too; return the keys.

    Raises:
        ProtocolError: The server is not a torchrunx launcher of this launch.
        OSError: The connection failed or timed out.
    """
    reply, expected, keys = client_reply(secret, bytes(_recv_exact(sock, GREETING_BYTES)), role)
    sock.sendall(reply)
    if not hmac.compare_digest(bytes(_recv_exact(sock, MAC_BYTES)), expected):
        raise ProtocolError("launcher failed to authenticate (wrong launch secret)")
    return keys


# --------------------------------------------------------------------------------------------
# Framed connection
# --------------------------------------------------------------------------------------------


def encode_frame_start(message: Message, payload: Sequence[bytes | memoryview] = ()) -> bytes:
    """The plaintext of a frame before its payload parts: lengths and the pickled message."""
    header = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sizes = b"".join(_PART.pack(memoryview(part).nbytes) for part in payload)
    return _FRAME.pack(len(header), len(payload)) + sizes + header


def frame_pieces(
    message: Message, payload: Sequence[bytes | memoryview]
) -> Iterator[memoryview | bytes]:
    """A frame's plaintext in pieces of at most RECORD_BYTES, each to be sealed as one record.

    The frame start is one piece (or more if it is large) and each payload part starts a new
    piece, so a receiver decrypts a large part straight into its own buffer.
    """
    start = encode_frame_start(message, payload)
    parts = [memoryview(start), *(memoryview(part).cast("B") for part in payload)]
    for part in parts:
        for offset in range(0, part.nbytes, RECORD_BYTES):
            yield part[offset : offset + RECORD_BYTES]


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
        self, message: Message, payload: Sequence[bytes | memoryview] = ()
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

    def send(self, message: Message, payload: Sequence[bytes | memoryview] = ()) -> None:
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

_MESSAGE_CLASSES: dict[str, type] = {cls.__name__: cls for cls in _MESSAGE_TYPES}


class _HeaderUnpickler(pickle.Unpickler):
    """Unpickles a frame's header: the protocol's message classes, and nothing else by name.

    Every field of every message is a built-in (int, float, str, bool, None, bytes, tuple,
    dict), which pickle writes with opcodes of its own; the only globals a header may name are
    the message classes of this module.
    """

    def find_class(self, module: str, name: str) -> Any:  # noqa: ANN401 (pickle's signature)
        """The message class ``module.name``; ``UnpicklingError`` for anything else."""
        cls = _MESSAGE_CLASSES.get(name) if module == __name__ else None
        if cls is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a torchrunx message class")
        return cls


def _load_message(header: memoryview | bytes | bytearray) -> Message:
    """Unpickle a header with :class:`_HeaderUnpickler` and check that it is a message.

    Raises:
        ProtocolError: Anything else (a malformed pickle, a foreign class, another type).
    """
    try:
        message = _HeaderUnpickler(io.BytesIO(header)).load()
    except Exception as exc:  # noqa: BLE001 (whatever a malformed header raises)
        raise ProtocolError(
            f"malformed message header ({type(exc).__name__}: {exception_text(exc)})"
        ) from None
    if not isinstance(message, _MESSAGE_TYPES):
        raise ProtocolError(f"unexpected message type {type(message).__name__}")
    return message


class _FrameParser:
    """Cuts authenticated plaintext into frames; a large part is filled in place.

    A frame's declared sizes are checked (:data:`MAX_FRAME_BYTES`) before anything is
    allocated, and each part's buffer grows as its bytes come, never past its declared size.
    """

    def __init__(self) -> None:
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
            if position < len(view):
                self._buffer += view[position:]
                self._cut(frames)

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

    def _cut(self, frames: list[Frame]) -> None:
        buffer, start = self._buffer, 0
        with memoryview(buffer) as view:
            while self._message is None and len(buffer) - start >= _FRAME.size:
                header_size, count = _FRAME.unpack_from(buffer, start)
                if header_size > _MAX_HEADER or count > _MAX_PARTS:
                    raise ProtocolError(
                        f"frame of {header_size} header bytes, {count} parts is too large"
                    )
                body = start + _FRAME.size + _PART.size * count
                end = body + header_size
                if len(buffer) < end:
                    break
                sizes = [
                    _PART.unpack_from(buffer, start + _FRAME.size + _PART.size * index)[0]
                    for index in range(count)
                ]
                if sum(sizes) > MAX_FRAME_BYTES:
                    raise ProtocolError(
                        f"frame of {sum(sizes)} payload bytes: more than {MAX_FRAME_BYTES}"
                    )
                self._message = _load_message(view[body:end])
                self._sizes = sizes
                self._parts = [bytearray() for _ in sizes]
                self._finish(frames)  # a frame without parts (or empty ones) is complete
                start = self._fill(view, end, frames)
        del buffer[:start]


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
        self._parser = _FrameParser()
        self.closed_by_peer = False
        """The peer's close record came: its stream is whole, and over."""
        self.error: Exception | None = None
        """Why the stream ended badly, once :meth:`read` returned its end (``None``: it did
        not, or the end was the peer's clean close)."""
        self._pending_error: Exception | None = None

    def read(self, sock: socket.socket, budget: int = 16 << 20) -> tuple[list[Frame], bool]:
        """Read what ``sock`` holds now (about ``budget`` bytes at most); return whole frames.

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
                self._have += count
                self._open_all(frames)
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

    def open_record(self, record: bytes | bytearray) -> list[Frame]:
        """Open one whole record (its length header included); the frames it completed."""
        frames: list[Frame] = []
        with memoryview(record) as view:
            if len(view) < _RECORD.size or self._record_size_of(view) != len(view) - 4:
                raise ProtocolError("a record's length does not match its header")
            self._open(view, frames)
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


_RETRY_FIRST = 0.05
_RETRY_MOST = 1.0
"""Seconds between two tries of :func:`connect` (doubling from the first, up to this)."""


def connect(address: tuple[str, int], secret: bytes, role: Role, timeout: float) -> Connection:
    """Connect to the launcher, authenticate, and return the framed connection.

    A try that the launcher resets or closes before the handshake is done (it sheds handshakes
    when a flood fills its cap) is tried again, with a short growing pause, until ``timeout``
    seconds have passed since the first. A refused connection is not: nothing listens there
    (the launcher is gone, or the address is wrong), and waiting would only hide that.

    Raises:
        ProtocolError: Authentication failed (the launcher does not know the secret).
        OSError: The launcher cannot be reached within ``timeout`` seconds, or refuses.
    """
    deadline = time.monotonic() + timeout
    pause = _RETRY_FIRST
    while True:
        left = deadline - time.monotonic()
        try:
            return _connect_once(address, secret, role, max(left, 0.001))
        except (ProtocolError, ConnectionRefusedError):
            raise
        except ConnectionError:  # reset, aborted, or closed by the launcher: shed
            left = deadline - time.monotonic()
            if left <= pause:
                raise
        time.sleep(pause)
        pause = min(pause * 2, _RETRY_MOST)


def _connect_once(
    address: tuple[str, int], secret: bytes, role: Role, timeout: float
) -> Connection:
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keys = client_handshake(sock, secret, role)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Connection(sock, keys)
