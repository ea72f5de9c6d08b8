"""What a launch puts on the wire, and what a man in the middle can do to a connection.

The first test captures a real 2-host launch on the test hosts' links (a raw ``AF_PACKET``
socket, no tcpdump needed) and looks for what the launch must keep secret: the function's
code, its arguments, its results, what the workers printed and logged, the forwarded
environment and the launch secret. Only the handshake may travel in the clear.

The others put a man in the middle of one real connection on loopback. It relays the
handshake untouched, then cuts each direction into records (a 4-byte big-endian length of the
ciphertext, tag included, then the ciphertext) and injects, replays, reorders, alters or drops
one of them. The receiver must fail before it delivers anything that was not sent, in order,
and before it unpickles anything the man in the middle wrote.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import pathlib
import pickle
import select
import socket
import struct
import threading
import time
import uuid
from typing import TYPE_CHECKING

import cloudpickle
import pytest
from wire_helpers import server_handshake

import torchrunx as trx
from torchrunx.errors import ProtocolError
from torchrunx.launcher.net import listener as listener_module
from torchrunx.launcher.net.ioloop import IOLoop
from torchrunx.launcher.net.listener import FrameReceived, Listener, PeerClosed
from torchrunx.wire import handshake
from torchrunx.wire.messages import LogLines
from torchrunx.wire.records import Connection

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

SECRET = bytes(range(32))
TIMEOUT = 5.0
"""Seconds any single step of the loopback tests may take (a receive, a connect)."""


# --------------------------------------------------------------------------------------------
# Glue: the only lines that depend on how a framed connection is made from a handshake.
# --------------------------------------------------------------------------------------------


def accepted_connection(sock: socket.socket, secret: bytes) -> Connection:
    """The launcher's side of a connection: the handshake on an accepted socket, then frames."""
    _role, keys = server_handshake(sock, secret)
    return Connection(sock, keys)


def client_connection(address: tuple[str, int], secret: bytes) -> Connection:
    """An agent's side of a connection (``handshake.connect``), receives limited to TIMEOUT."""
    conn = handshake.connect(address, secret, "agent", timeout=TIMEOUT)
    conn.sock.settimeout(TIMEOUT)
    return conn


# --------------------------------------------------------------------------------------------
# Capture of a real launch on the test hosts' links
# --------------------------------------------------------------------------------------------

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
SO_RCVBUFFORCE = 33
SSH_PORT = 22

Flow = tuple[str, int, str, int]
"""A TCP direction: source address and port, destination address and port."""


class LinkCapture:
    """Every frame crossing some links, recorded by a thread from raw ``AF_PACKET`` sockets.

    The sockets are bound when the object is made, so nothing sent after that is missed.
    """

    def __init__(self, links: list[str]) -> None:
        self.frames: list[bytes] = []
        self.drops = 0
        self.sockets = []
        for link in links:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
            sock.bind((link, ETH_P_ALL))
            self.sockets.append(sock)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            ready, _, _ = select.select(self.sockets, [], [], 0.05)
            for sock in ready:
                self.frames.append(sock.recv(1 << 18))  # a GSO frame is at most 64 KiB

    def stop(self) -> None:
        """Stop, read what is still queued, count the frames the kernel dropped, close."""
        self._stopping.set()
        self._thread.join()
        for sock in self.sockets:
            sock.settimeout(0.0)  # non-blocking
            with contextlib.suppress(BlockingIOError):
                while True:
                    self.frames.append(sock.recv(1 << 18))
            _packets, drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
            self.drops += drops
            sock.close()


def tcp_segment(frame: bytes) -> tuple[Flow, int, int, bytes] | None:
    """``(flow, sequence number, TCP flags, payload)`` of an Ethernet frame, if it is TCP."""
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    packet = frame[14:]
    if ethertype == 0x0800 and len(packet) >= 20 and packet[9] == socket.IPPROTO_TCP:
        header = (packet[0] & 0x0F) * 4
        total = struct.unpack_from("!H", packet, 2)[0]
        source, destination = socket.inet_ntoa(packet[12:16]), socket.inet_ntoa(packet[16:20])
        segment = packet[header : total or len(packet)]  # drop the Ethernet padding
    elif ethertype == 0x86DD and len(packet) >= 40 and packet[6] == socket.IPPROTO_TCP:
        total = 40 + struct.unpack_from("!H", packet, 4)[0]
        source = socket.inet_ntop(socket.AF_INET6, packet[8:24])
        destination = socket.inet_ntop(socket.AF_INET6, packet[24:40])
        segment = packet[40:total]
    else:
        return None
    source_port, destination_port, sequence = struct.unpack_from("!HHI", segment)
    offset = (segment[12] >> 4) * 4
    flow = (source, source_port, destination, destination_port)
    return flow, sequence, segment[13], segment[offset:]


def reassemble(frames: list[bytes]) -> tuple[dict[Flow, bytes], dict[Flow, int]]:
    """Every TCP direction's bytes in order (duplicates and retransmissions merged), and the
    number of holes in each (bytes never seen)."""
    segments: dict[Flow, dict[int, bytes]] = collections.defaultdict(dict)
    first: dict[Flow, int] = {}
    for frame in frames:
        parsed = tcp_segment(frame)
        if parsed is None:
            continue
        flow, sequence, flags, payload = parsed
        if flags & 0x02:  # SYN: the data starts after it
            first[flow] = sequence + 1
        first.setdefault(flow, sequence)
        if payload and len(payload) > len(segments[flow].get(sequence, b"")):
            segments[flow][sequence] = payload  # a retransmission may carry more
    streams, holes = {}, {}
    for flow, by_sequence in segments.items():
        data, position, gaps = bytearray(), 0, 0
        for offset, payload in sorted(
            ((sequence - first[flow]) % (1 << 32), payload)
            for sequence, payload in by_sequence.items()
        ):
            if offset > position:
                gaps += 1
                data += b"\0"  # never joins two pieces into a marker
            elif offset + len(payload) <= position:
                continue
            data += payload[max(0, position - offset) :]
            position = offset + len(payload)
        streams[flow], holes[flow] = bytes(data), gaps
    return streams, holes


def is_ssh(flow: Flow) -> bool:
    return SSH_PORT in (flow[1], flow[3])


def not_ssh_frames(frames: list[bytes]) -> Iterator[bytes]:
    """Every captured frame except those of SSH connections (encrypted by SSH anyway)."""
    for frame in frames:
        parsed = tcp_segment(frame)
        if parsed is None or not is_ssh(parsed[0]):
            yield frame


def launcher_connections(streams: dict[Flow, bytes], launcher: str) -> dict[Flow, bytes]:
    """Both directions of every connection to the launcher's port (the one whose first bytes
    from the launcher are the protocol's greeting), each checked to start with the handshake."""
    ports = {
        flow[1]
        for flow, data in streams.items()
        if flow[0] == launcher and data.startswith(b"TORCHRUNX/")  # the greeting, in the clear
    }
    assert len(ports) == 1, ports
    (port,) = ports
    ours = {flow: data for flow, data in streams.items() if port in {flow[1], flow[3]}}
    assert all(data.startswith(b"TORCHRUNX/") for data in ours.values())  # reply too
    return ours


def in_the_clear(
    markers: dict[str, bytes], streams: dict[Flow, bytes], frames: list[bytes]
) -> list[str]:
    """For each marker in a TCP stream but SSH's, or in a captured frame but SSH's: where."""
    places = [(f"TCP {flow}", data) for flow, data in streams.items() if not is_ssh(flow)]
    places += [(f"frame {i}", frame) for i, frame in enumerate(not_ssh_frames(frames))]
    found = []
    for name, marker in markers.items():
        where = [place for place, data in places if marker in data]
        if where:
            found.append(f"{name}: in {len(where)} place(s), e.g. {where[0]}")
    return found


def derived(seed: str, label: str) -> str:
    """A marker the worker computes from the seed it gets: it travels only if the worker's
    output does."""
    return f"{label}-{hashlib.sha256(f'{seed}/{label}'.encode()).hexdigest()[:32]}"


BODY_MARKER = "FUNC-MARKER-7f3a-c0de-5e1f"
"""The string literal in the launched function's code (it travels in the pickled function)."""


@pytest.mark.cluster
def test_a_two_host_launch_sends_nothing_of_the_function_its_data_or_its_logs_in_the_clear(
    cluster, log_dir, monkeypatch
):
    import torch

    seed = f"ARG-{uuid.uuid4().hex}"
    tensor_marker = f"TENSOR-ARG-{uuid.uuid4().hex}"
    env_marker = f"ENV-{uuid.uuid4().hex}"
    monkeypatch.setenv("TORCH_TRAFFIC_MARKER", env_marker)  # forwarded (TORCH*), over SSH
    secrets: list[bytes] = []
    new_secret = handshake.new_secret
    monkeypatch.setattr(
        handshake, "new_secret", lambda: secrets.append(new_secret()) or secrets[-1]
    )

    def probe(seed: str, *, tensor: torch.Tensor) -> dict[str, object]:
        import hashlib
        import logging
        import os

        import torch

        def derived(label: str) -> str:  # as the module's, which is not pickled by value
            return f"{label}-{hashlib.sha256(f'{seed}/{label}'.encode()).hexdigest()[:32]}"

        rank = os.environ["RANK"]
        print(derived(f"PRINTED-{rank}"), flush=True)
        logging.getLogger("probe").warning(derived(f"LOGGED-{rank}"))
        return {
            "result": derived(f"RESULT-{rank}"),
            "tensor": torch.frombuffer(
                bytearray(derived("TENSOR").encode() * 2048), dtype=torch.uint8
            ),
            "argument_bytes": bytes(tensor.tolist()[:80]),
            "body": hashlib.sha256(b"FUNC-MARKER-7f3a-c0de-5e1f").hexdigest(),  # BODY_MARKER
        }

    # Defined in a test, the function is pickled by value: its code, with the literal, travels.
    assert BODY_MARKER.encode() in probe.__code__.co_consts
    assert BODY_MARKER.encode() in cloudpickle.dumps(probe)
    tensor = torch.frombuffer(bytearray(tensor_marker.encode() * 2048), dtype=torch.uint8)

    capture = LinkCapture([host.veth for host in cluster.hosts])
    try:
        result = trx.launch(
            probe,
            func_args=(seed,),
            func_kwargs={"tensor": tensor},
            hostnames=cluster.names(),
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
        )
        time.sleep(0.3)  # the last FINs and ACKs
    finally:
        capture.stop()

    # The launch did carry every marker from the hosts to the launcher.
    assert [r["result"] for r in result.ranks] == [derived(seed, f"RESULT-{i}") for i in (0, 1)]
    assert all(
        bytes(r["tensor"].tolist()[:80]) == (derived(seed, "TENSOR").encode() * 3)[:80]
        for r in result.ranks
    )
    assert all(r["argument_bytes"] == (tensor_marker.encode() * 3)[:80] for r in result.ranks)
    assert {r["body"] for r in result.ranks} == {hashlib.sha256(BODY_MARKER.encode()).hexdigest()}
    logs = "".join(p.read_text(errors="replace") for p in log_dir.rglob("*") if p.is_file())
    for rank in (0, 1):
        assert derived(seed, f"PRINTED-{rank}") in logs
        assert derived(seed, f"LOGGED-{rank}") in logs
    (secret,) = secrets

    # The capture holds the launch's own connections, whole; none of the markers is in it.
    assert capture.drops == 0
    streams, holes = reassemble(capture.frames)
    ours = launcher_connections(streams, cluster.launcher_address)
    from_launcher = [flow for flow in ours if flow[0] == cluster.launcher_address]
    assert len(from_launcher) == 2  # 2 agents: their workers' outcomes travel inside them
    assert all(holes[flow] == 0 for flow in ours)
    tensors = 2 * (len(tensor_marker) + len(derived(seed, "TENSOR"))) * 2048  # to and from 2 hosts
    assert sum(map(len, ours.values())) > tensors
    markers = {
        "function body": BODY_MARKER.encode(),
        "argument": seed.encode(),
        "tensor argument": tensor_marker.encode(),
        "forwarded environment value": env_marker.encode(),
        "launch secret": secret,
        "launch secret (hex)": secret.hex().encode(),
        "tensor result": derived(seed, "TENSOR").encode(),
        **{f"rank {i} result": derived(seed, f"RESULT-{i}").encode() for i in (0, 1)},
        **{f"rank {i} print": derived(seed, f"PRINTED-{i}").encode() for i in (0, 1)},
        **{f"rank {i} logging": derived(seed, f"LOGGED-{i}").encode() for i in (0, 1)},
    }
    leaks = in_the_clear(markers, streams, capture.frames)
    assert not leaks, "in the clear on the wire:\n" + "\n".join(leaks)


# --------------------------------------------------------------------------------------------
# A man in the middle of one connection on loopback
# --------------------------------------------------------------------------------------------

RECORD_LENGTH = struct.Struct("!I")
TAG_BYTES = 16
TAMPERED = 2
"""Index of the record the man in the middle acts on; records 0 and 1 go through untouched."""


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def forward(_direction: str, _index: int, record: bytes, _earlier: list[bytes]) -> list[bytes]:
    return [record]


class Mitm:
    """A man in the middle of one connection on loopback.

    The handshake is relayed untouched; after it, each direction (``"up"``: client to server,
    ``"down"``: server to client) is cut into records, and ``rewrite(direction, index, record,
    earlier records)`` says what goes on in place of each record. Every record received is kept
    in :attr:`records`. ``inject`` maps a direction to bytes sent that way right after the
    handshake, before any record (a record boundary whatever the record format).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        rewrite: Callable[[str, int, bytes, list[bytes]], list[bytes]] = forward,
        inject: dict[str, bytes] | None = None,
    ) -> None:
        self.upstream = upstream
        self.rewrite = rewrite
        self.inject = inject or {}
        self.listening = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listening.getsockname()[:2]
        self.records: dict[str, list[bytes]] = {"up": [], "down": []}
        self.sockets: list[socket.socket] = []
        self.errors: list[BaseException] = []
        """What broke the relay before :meth:`close`."""
        self.closing = False
        self._threads = [threading.Thread(target=self._run, daemon=True)]
        self._threads[0].start()

    def _run(self) -> None:
        try:
            self.listening.settimeout(TIMEOUT)
            client, _ = self.listening.accept()
            self.sockets.append(client)
            server = socket.create_connection(self.upstream, timeout=TIMEOUT)
            self.sockets.append(server)
            for sock in (client, server):
                sock.settimeout(None)
            client.sendall(_recv_exact(server, handshake.GREETING_BYTES))
            server.sendall(_recv_exact(client, handshake.CLIENT_REPLY_BYTES))
            client.sendall(_recv_exact(server, handshake.MAC_BYTES))
            server.sendall(self.inject.get("up", b""))
            client.sendall(self.inject.get("down", b""))
        except OSError as exc:
            self.errors.append(exc)
            return
        for direction, source, destination in (("up", client, server), ("down", server, client)):
            thread = threading.Thread(
                target=self._relay, args=(direction, source, destination), daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _relay(self, direction: str, source: socket.socket, destination: socket.socket) -> None:
        records = self.records[direction]
        try:
            while True:
                try:
                    head = _recv_exact(source, RECORD_LENGTH.size)
                except ConnectionError:
                    with contextlib.suppress(OSError):
                        destination.shutdown(socket.SHUT_WR)  # pass the end on
                    return
                (length,) = RECORD_LENGTH.unpack(head)
                record = head + _recv_exact(source, length)
                out = self.rewrite(direction, len(records), record, list(records))
                records.append(record)
                destination.sendall(b"".join(out))
        except OSError as exc:
            if not self.closing:
                self.errors.append(exc)

    def close(self) -> None:
        self.closing = True
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the relays' reads
        for thread in self._threads:
            thread.join(TIMEOUT)
        for sock in [*self.sockets, self.listening]:
            sock.close()


@contextlib.contextmanager
def through_mitm(
    rewrite: Callable[[str, int, bytes, list[bytes]], list[bytes]] = forward,
    inject: dict[str, bytes] | None = None,
) -> Iterator[tuple[Connection, Connection, Mitm]]:
    """A client (agent) and a server (launcher) connection, a man in the middle between them."""
    with socket.create_server(("127.0.0.1", 0)) as listening:
        mitm = Mitm(listening.getsockname()[:2], rewrite, inject)
        got: dict[str, object] = {}

        def connect() -> None:
            try:
                got["client"] = client_connection(mitm.address, SECRET)
            except BaseException as exc:
                got["error"] = exc

        thread = threading.Thread(target=connect)
        thread.start()
        server = None
        try:
            listening.settimeout(TIMEOUT)
            sock, _ = listening.accept()
            sock.settimeout(TIMEOUT)
            try:
                server = accepted_connection(sock, SECRET)
            except BaseException:
                sock.close()
                raise
            thread.join(TIMEOUT)
            client = got.get("client")
            assert isinstance(client, Connection), got.get("error")
            yield client, server, mitm
        finally:
            thread.join(TIMEOUT)
            for conn in (got.get("client"), server):
                if isinstance(conn, Connection):
                    conn.close()
            mitm.close()


def message(i: int, who: str = "") -> LogLines:
    return LogLines(((0, 20, "mitm", f"{who}message {i}", 0.0),))


def text_of(received: object) -> str:
    if isinstance(received, LogLines):
        return received.records[0][3]
    return repr(received)  # anything else is not what was sent


def deliver(
    sender: Connection, receiver: Connection, count: int, who: str = ""
) -> tuple[list[str], list[str], BaseException | None]:
    """Send ``count`` small messages; receive until they all came or the receiver fails.

    Returns what was sent, what was received, and the receiver's error (``None``: none).
    """
    sent = [message(i, who) for i in range(count)]
    for each in sent:
        sender.send(each)
    received: list[str] = []
    error = None
    try:
        while len(received) < count:
            received.append(text_of(receiver.recv()[0]))
    except BaseException as exc:
        error = exc
    return [text_of(m) for m in sent], received, error


class Forged:
    """What a man in the middle would like a receiver to unpickle: it creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def forged_frame(path: Path) -> bytes:
    """A frame as the plaintext protocol wrote it (``!QI`` header, no parts), forged."""
    header = pickle.dumps(Forged(path), protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!QI", len(header), 0) + header


def forged_record(path: Path) -> bytes:
    """The forged frame as the body of a record of the right length, with a made-up tag."""
    frame = forged_frame(path)
    return RECORD_LENGTH.pack(len(frame) + TAG_BYTES) + frame + bytes(TAG_BYTES)


FORGERIES = {"plaintext-frame": forged_frame, "forged-record": forged_record}


def flip(record: bytes, at: int) -> bytes:
    changed = bytearray(record)
    changed[at] ^= 0x01
    return bytes(changed)


PLANS = (
    "inject-plaintext-frame",
    "inject-forged-record",
    "duplicate",
    "replay-earlier",
    "reorder",
    "drop",
    "flip-ciphertext-bit",
    "flip-tag-bit",
)


def plan_rewrite(
    plan: str, attacked: str, path: Path
) -> Callable[[str, int, bytes, list[bytes]], list[bytes]]:
    """What the man in the middle does to record ``TAMPERED`` of direction ``attacked``."""
    held: list[bytes] = []

    def rewrite(direction: str, index: int, record: bytes, earlier: list[bytes]) -> list[bytes]:
        if direction != attacked:
            return [record]
        if plan == "reorder" and index == TAMPERED + 1:
            return [record, *held]
        if index != TAMPERED:
            return [record]
        return {
            "inject-plaintext-frame": [forged_frame(path), record],
            "inject-forged-record": [forged_record(path), record],
            "duplicate": [record, record],
            "replay-earlier": [earlier[0], record],
            "reorder": held.append(record) or [],
            "drop": [],
            "flip-ciphertext-bit": [flip(record, RECORD_LENGTH.size)],
            "flip-tag-bit": [flip(record, len(record) - 1)],
        }[plan]

    return rewrite


def delivered_before_the_failure(plan: str, sent: list[str]) -> list[str]:
    """What the receiver may deliver: the records before the tampered one (and, for a
    duplicate, the tampered one itself, which was genuine the first time)."""
    return sent[: TAMPERED + 1] if plan == "duplicate" else sent[:TAMPERED]


def test_the_forged_frame_would_run_code_if_it_were_unpickled(tmp_path):
    path = tmp_path / "control"
    header = forged_frame(path)[struct.calcsize("!QI") :]
    pickle.loads(header)  # noqa: S301 (the point: what the receivers must never do)
    assert path.exists()


@pytest.mark.parametrize("direction", ["up", "down"])
def test_an_untouched_relay_delivers_everything_and_shows_none_of_it(direction):
    payload_marker = f"PAYLOAD-{uuid.uuid4().hex}".encode()
    with through_mitm() as (client, server, mitm):
        sender, receiver = (client, server) if direction == "up" else (server, client)
        sent, received, error = deliver(sender, receiver, 6)
        assert error is None
        assert received == sent
        assert len(mitm.records[direction]) == 6  # one record per small frame
        big = payload_marker * ((3 << 20) // len(payload_marker))  # large: read into place
        sender.send(message(6), [big, b"tail"])
        got, parts = receiver.recv()
        assert text_of(got) == "message 6"
        assert [bytes(part) for part in parts] == [big, b"tail"]
        wire = b"".join(mitm.records[direction])
        assert b"message " not in wire
        assert payload_marker not in wire
        assert all(len(r) >= RECORD_LENGTH.size + TAG_BYTES for r in mitm.records[direction])
    assert not mitm.errors


@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("plan", PLANS)
def test_a_tampered_record_fails_the_connection_before_anything_is_unpickled(
    plan, direction, tmp_path
):
    path = tmp_path / f"pwned-{plan}-{direction}"
    with through_mitm(plan_rewrite(plan, direction, path)) as (client, server, _mitm):
        sender, receiver = (client, server) if direction == "up" else (server, client)
        sent, received, error = deliver(sender, receiver, 6)
    assert not path.exists(), "the receiver unpickled the forged frame"
    assert isinstance(error, ProtocolError | ConnectionError), repr(error)
    assert received == delivered_before_the_failure(plan, sent)


def test_a_record_from_another_connection_of_the_same_launch_fails():
    with through_mitm() as (client, server, mitm):
        _sent, received, error = deliver(client, server, 1, who="other ")
        assert error is None
        (stolen,) = mitm.records["up"]

    def replace_first(
        direction: str, index: int, record: bytes, _earlier: list[bytes]
    ) -> list[bytes]:
        return [stolen] if (direction, index) == ("up", 0) else [record]

    with through_mitm(replace_first) as (client, server, _mitm):
        _sent, received, error = deliver(client, server, 3)
    assert isinstance(error, ProtocolError | ConnectionError), repr(error)
    assert received == []


def test_a_record_reflected_back_to_its_sender_fails():
    seen: dict[str, list[bytes]] = {}

    def reflect(direction: str, index: int, record: bytes, _earlier: list[bytes]) -> list[bytes]:
        if (direction, index) == ("up", 0):
            return [seen["down"][0]]  # the launcher's first record, back to the launcher
        return [record]

    with through_mitm(reflect) as (client, server, mitm):
        seen.update(mitm.records)
        _sent, received, error = deliver(server, client, 1, who="down ")
        assert error is None  # the client got it: the man in the middle has it too
        _sent, received, error = deliver(client, server, 3)
    assert isinstance(error, ProtocolError | ConnectionError), repr(error)
    assert received == []


def through_listener(
    rewrite: Callable[[str, int, bytes, list[bytes]], list[bytes]] = forward,
    inject: dict[str, bytes] | None = None,
    count: int = 6,
) -> tuple[list[str], list[object]]:
    """A worker sends ``count`` messages to the launcher's real listener through a man in the
    middle; returns what was sent and every event of the listener."""
    loop = IOLoop()
    events: list[object] = []
    listener = Listener(loop, SECRET, listener_module.listen_socket("127.0.0.1"), events.append)
    mitm = Mitm(("127.0.0.1", listener.port), rewrite, inject)
    got: list[Connection] = []

    def pump(until: Callable[[], bool]) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not until() and time.monotonic() < deadline:
            loop.run_once(0.02)
            listener.tick(time.monotonic())

    thread = threading.Thread(
        target=lambda: got.append(
            handshake.connect(mitm.address, SECRET, "worker", timeout=TIMEOUT)
        )
    )
    sent = [message(i) for i in range(count)]
    try:
        thread.start()
        pump(lambda: bool(got) or any(isinstance(e, PeerClosed) for e in events))
        thread.join(TIMEOUT)
        for conn in got:
            with contextlib.suppress(OSError):  # the launcher may have dropped it already
                for each in sent:
                    conn.send(each)
        pump(lambda: any(isinstance(e, PeerClosed) for e in events))
    finally:
        thread.join(TIMEOUT)
        for conn in got:
            conn.close()
        mitm.close()
        listener.close()
        loop.close()
    return [text_of(m) for m in sent], events


@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_frame_injected_right_after_the_handshake_is_never_unpickled(
    forgery, direction, tmp_path
):
    path = tmp_path / f"pwned-{forgery}-{direction}"
    inject = {direction: FORGERIES[forgery](path)}
    with through_mitm(inject=inject) as (client, server, _mitm):
        sender, receiver = (client, server) if direction == "up" else (server, client)
        _sent, received, error = deliver(sender, receiver, 3)
    assert not path.exists(), "the receiver unpickled the forged frame"
    assert isinstance(error, ProtocolError | ConnectionError), repr(error)
    assert received == []


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_the_launcher_never_unpickles_a_frame_injected_right_after_the_handshake(forgery, tmp_path):
    path = tmp_path / f"pwned-{forgery}"
    _sent, events = through_listener(inject={"up": FORGERIES[forgery](path)})
    assert not path.exists(), "the launcher unpickled the forged frame"
    assert not [e for e in events if isinstance(e, FrameReceived)]
    assert events, "the connection was neither dropped nor delivered anything"
    assert isinstance(events[-1], PeerClosed)


@pytest.mark.parametrize("plan", PLANS)
def test_the_launchers_listener_drops_a_tampered_connection_and_unpickles_nothing(plan, tmp_path):
    path = tmp_path / f"pwned-{plan}"
    sent, events = through_listener(plan_rewrite(plan, "up", path))
    assert not path.exists(), "the launcher unpickled the forged frame"
    # Frames read together with the bad record are delivered before the drop: all of them.
    received = [text_of(e.message) for e in events if isinstance(e, FrameReceived)]
    assert received == delivered_before_the_failure(plan, sent)
    assert events, "the connection was neither dropped nor delivered anything"
    assert isinstance(events[-1], PeerClosed)
