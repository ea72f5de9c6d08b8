"""The rules of the handshake (torchrunx/wire/handshake.py), each against a peer that breaks it.

On socketpairs (one test on loopback, for ``connect``), with a thread for the other end. The
rules (torchrunx/wire's package docstring, docs/security.md):

- the handshake is mutual: a client refuses a launcher that cannot prove it knows the secret,
  whatever the launcher sent;
- the role is bound into the client's proof and into the session keys: two ends that believe
  different roles cannot talk;
- both nonces are fresh for each connection: keys are never reused, and neither side of a
  recorded handshake can be replayed to a new peer.

Then the records of torchrunx/wire/records.py (a record holds at most a whole piece; only the
authenticated close record, between frames, is a clean end, and nothing comes after it; frames
before a bad one are delivered first) and a frame's header (torchrunx/wire/messages.py: the
protocol's message classes, and nothing else).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest
from wire_helpers import RecordReader, server_handshake

from torchrunx.errors import ProtocolError
from torchrunx.launcher.net.listener import _Pending
from torchrunx.wire import handshake, messages, records

SECRET = b"s" * 32
WRONG = b"w" * 32

Serve = Callable[[socket.socket], object]


def run_server(server: socket.socket, serve: Serve) -> tuple[threading.Thread, list[object]]:
    """Run ``serve`` on the server end in a thread; what it returns or raises is kept."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(serve(server))
        except (ProtocolError, OSError) as exc:
            outcome.append(exc)
        finally:
            server.close()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def impostor(proof: Callable[[bytes, bytes], bytes]) -> Callable[[socket.socket], bytes]:
    """A server that greets with a fresh nonce, never checks the reply (it cannot: it knows no
    secret) and answers ``proof(nonce, reply)``."""

    def serve(sock: socket.socket) -> bytes:
        nonce = os.urandom(handshake.NONCE_BYTES)
        sock.sendall(handshake.server_greeting(nonce))
        reply = bytes(handshake._recv_exact(sock, handshake.CLIENT_REPLY_BYTES))
        sock.sendall(proof(nonce, reply))
        return reply

    return serve


def _client_nonce(reply: bytes) -> bytes:
    start = len(handshake.MAGIC) + 1
    return reply[start : start + handshake.NONCE_BYTES]


IMPOSTOR_PROOFS = [
    pytest.param(lambda _nonce, _reply: os.urandom(handshake.MAC_BYTES), id="random-bytes"),
    pytest.param(lambda _nonce, _reply: bytes(handshake.MAC_BYTES), id="zeros"),
    pytest.param(
        lambda _nonce, reply: reply[-handshake.MAC_BYTES :], id="the-clients-own-proof-reflected"
    ),
    pytest.param(
        lambda nonce, reply: handshake._mac(WRONG, b"server", _client_nonce(reply), nonce),
        id="proof-with-another-secret",
    ),
    pytest.param(
        lambda nonce, reply: handshake._mac(SECRET, b"server", nonce, _client_nonce(reply)),
        id="proof-with-the-nonces-swapped",  # knows the secret but proves the wrong thing
    ),
]


@pytest.mark.parametrize("proof", IMPOSTOR_PROOFS)
@pytest.mark.parametrize("role", ["agent", "worker"])
def test_rule_a_client_refuses_a_launcher_that_cannot_prove_the_secret(proof, role):
    """Rule: the handshake is mutual. A server that does not know the secret accepts the
    client's reply (it does not check it) and answers a wrong proof: the client refuses."""
    server, client = socket.socketpair()
    with client:
        thread, outcome = run_server(server, impostor(proof))
        with pytest.raises(ProtocolError, match="launcher failed to authenticate"):
            handshake.client_handshake(client, SECRET, role)
    thread.join(10)
    assert isinstance(outcome[0], bytes)  # the impostor got to the end of its script


def test_rule_connect_refuses_a_launcher_that_cannot_prove_the_secret():
    """Rule: the same through ``connect`` (what agents and workers call), on loopback."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept_and_fake(sock: socket.socket) -> bytes:
        conn, _ = sock.accept()
        with conn:
            return impostor(lambda _nonce, _reply: os.urandom(handshake.MAC_BYTES))(conn)

    thread, outcome = run_server(listener, accept_and_fake)
    with pytest.raises(ProtocolError, match="launcher failed to authenticate"):
        handshake.connect(("127.0.0.1", port), SECRET, "worker", timeout=10).close()
    thread.join(10)
    assert isinstance(outcome[0], bytes)


def test_rule_a_client_refuses_a_launcher_that_sends_no_proof():
    server, client = socket.socketpair()
    with client:
        thread, _ = run_server(server, impostor(lambda _nonce, _reply: b""))  # then it closes
        with pytest.raises((ProtocolError, ConnectionError)):
            handshake.client_handshake(client, SECRET, "agent")
    thread.join(10)


# -- the role ---------------------------------------------------------------------------------


def test_rule_the_role_is_bound_into_the_session_keys():
    """Rule: for the same secret and nonces, an agent's keys are not a worker's."""
    ns, nc = os.urandom(handshake.NONCE_BYTES), os.urandom(handshake.NONCE_BYTES)
    for server in (True, False):
        agent = handshake.session_keys(SECRET, ns, nc, b"A", server=server)
        worker = handshake.session_keys(SECRET, ns, nc, b"W", server=server)
        assert agent.send != worker.send
        assert agent.receive != worker.receive
        assert len({agent.send, agent.receive, worker.send, worker.receive}) == 4


@pytest.mark.parametrize(("client_role", "server_role"), [(b"A", b"W"), (b"W", b"A")])
def test_rule_two_ends_that_believe_different_roles_cannot_talk(client_role, server_role):
    """Rule: a client that believes it is one role and a server that believes it the other
    hold different keys: the first record fails authentication and nothing is unpickled."""
    ns, nc = os.urandom(handshake.NONCE_BYTES), os.urandom(handshake.NONCE_BYTES)
    server_keys = handshake.session_keys(SECRET, ns, nc, server_role, server=True)
    client_keys = handshake.session_keys(SECRET, ns, nc, client_role, server=False)
    a, b = socket.socketpair()
    client, server = records.Connection(a, client_keys), records.Connection(b, server_keys)
    try:
        client.send(messages.Heartbeat())
        with pytest.raises(ProtocolError, match="failed authentication"):
            server.recv()
        server.send(messages.Heartbeat())
        with pytest.raises(ProtocolError, match="failed authentication"):
            client.recv()
    finally:
        client.close()
        server.close()


def test_the_same_role_on_both_ends_talks():
    """The control of the test above: with the same role, the same records go through."""
    ns, nc = os.urandom(handshake.NONCE_BYTES), os.urandom(handshake.NONCE_BYTES)
    server_keys = handshake.session_keys(SECRET, ns, nc, b"W", server=True)
    client_keys = handshake.session_keys(SECRET, ns, nc, b"W", server=False)
    a, b = socket.socketpair()
    client, server = records.Connection(a, client_keys), records.Connection(b, server_keys)
    try:
        client.send(messages.Heartbeat())
        assert server.recv() == (messages.Heartbeat(), [])
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize(("claimed", "changed_to"), [(b"W", b"A"), (b"A", b"W")])
def test_rule_a_role_changed_on_the_way_is_refused_by_the_server(claimed, changed_to):
    """Rule: the role is bound into the client's proof: a worker's reply made to say
    "agent" (or the reverse) fails to authenticate."""
    nonce = os.urandom(handshake.NONCE_BYTES)
    role: handshake.Role = "agent" if claimed == b"A" else "worker"
    reply, _, _ = handshake.client_reply(SECRET, handshake.server_greeting(nonce), role)
    at = len(handshake.MAGIC)
    assert reply[at : at + 1] == claimed
    changed = reply[:at] + changed_to + reply[at + 1 :]
    with pytest.raises(ProtocolError, match="failed to authenticate"):
        handshake.check_client_reply(SECRET, nonce, changed)
    assert handshake.check_client_reply(SECRET, nonce, reply)[0] == role


@pytest.mark.parametrize("role", ["agent", "worker"])
def test_the_server_learns_the_role_the_client_has(role):
    server, client = socket.socketpair()
    with client:
        thread, outcome = run_server(server, lambda sock: server_handshake(sock, SECRET))
        client_keys = handshake.client_handshake(client, SECRET, role)
        thread.join(10)
    result = outcome[0]
    assert isinstance(result, tuple)
    server_role, server_keys = result
    assert isinstance(server_keys, handshake.SessionKeys)
    assert server_role == role
    assert (server_keys.send, server_keys.receive) == (client_keys.receive, client_keys.send)


# -- fresh nonces -----------------------------------------------------------------------------


def _record_handshake() -> tuple[bytes, bytes, bytes, handshake.SessionKeys]:
    """One real handshake; what each side sent (greeting, client reply, proof) and the keys."""
    server, client = socket.socketpair()
    with client:
        thread, outcome = run_server(server, lambda sock: server_handshake(sock, SECRET))
        greeting = bytes(handshake._recv_exact(client, handshake.GREETING_BYTES))
        reply, expected, keys = handshake.client_reply(SECRET, greeting, "worker")
        client.sendall(reply)
        proof = bytes(handshake._recv_exact(client, handshake.MAC_BYTES))
        thread.join(10)
    assert proof == expected
    assert isinstance(outcome[0], tuple)
    return greeting, reply, proof, keys


def test_rule_every_handshake_has_a_fresh_server_nonce_and_fresh_keys():
    """Rule: the server's nonce is new for each connection, and so are the session keys."""
    first, second = _record_handshake(), _record_handshake()
    assert first[0] != second[0]  # the greetings: MAGIC and the server's nonce
    assert first[0][: len(handshake.MAGIC)] == second[0][: len(handshake.MAGIC)]
    assert first[3].send != second[3].send
    assert first[3].receive != second[3].receive


def test_rule_the_listeners_handshakes_each_have_a_fresh_server_nonce():
    """Rule: the same for the launcher's own handshakes (read in its loop)."""
    a, b = socket.socketpair()
    with a, b:
        nonces = {_Pending(a, 0.0).nonce for _ in range(3)}
    assert len(nonces) == 3
    assert all(len(nonce) == handshake.NONCE_BYTES for nonce in nonces)


def test_rule_a_recorded_client_side_replayed_to_a_new_server_is_refused():
    """Rule: a client's reply answers one server nonce only. Replaying a recorded reply (with
    its valid proof) to a new connection fails, in ``server_handshake`` and in the listener."""
    _, reply, _, _ = _record_handshake()
    server, client = socket.socketpair()
    with client:
        thread, outcome = run_server(server, lambda sock: server_handshake(sock, SECRET))
        handshake._recv_exact(client, handshake.GREETING_BYTES)  # a new greeting, ignored
        client.sendall(reply)
        thread.join(10)
    assert isinstance(outcome[0], ProtocolError)
    assert "failed to authenticate" in str(outcome[0])
    a, b = socket.socketpair()
    with a, b:
        pending = _Pending(a, 0.0)
        with pytest.raises(ProtocolError, match="failed to authenticate"):
            handshake.check_client_reply(SECRET, pending.nonce, reply)


def test_rule_a_recorded_server_side_replayed_to_a_new_client_is_refused():
    """Rule: the launcher's proof answers one client nonce only. Replaying a recorded greeting
    and proof (a real launcher's, made with the secret) to a new client fails."""
    greeting, _, proof, _ = _record_handshake()

    def replay(sock: socket.socket) -> bytes:
        sock.sendall(greeting)
        reply = bytes(handshake._recv_exact(sock, handshake.CLIENT_REPLY_BYTES))
        sock.sendall(proof)
        return reply

    server, client = socket.socketpair()
    with client:
        thread, outcome = run_server(server, replay)
        with pytest.raises(ProtocolError, match="launcher failed to authenticate"):
            handshake.client_handshake(client, SECRET, "worker")
    thread.join(10)
    assert isinstance(outcome[0], bytes)


# -- the replies' shape, the keys' inputs, what connect leaves --------------------------------


def test_rule_a_client_reply_of_another_size_does_not_speak_the_protocol():
    nonce = os.urandom(handshake.NONCE_BYTES)
    reply, _, _ = handshake.client_reply(SECRET, handshake.server_greeting(nonce), "agent")
    for wrong in (reply + b"\0", reply[:-1]):
        with pytest.raises(ProtocolError, match="peer does not speak torchrunx protocol"):
            handshake.check_client_reply(SECRET, nonce, wrong)


def test_rule_a_role_that_is_neither_agent_nor_worker_is_refused_even_with_a_valid_proof():
    """Rule: only ``A`` and ``W`` are roles; a peer that knows the secret and proves some other
    role byte is refused as a protocol error (never a lookup error in the listener)."""
    nonce, client_nonce = os.urandom(handshake.NONCE_BYTES), os.urandom(handshake.NONCE_BYTES)
    proof = handshake._mac(SECRET, b"client", b"X", nonce, client_nonce)
    reply = handshake.MAGIC + b"X" + client_nonce + proof
    assert len(reply) == handshake.CLIENT_REPLY_BYTES
    with pytest.raises(ProtocolError, match="failed to authenticate"):
        handshake.check_client_reply(SECRET, nonce, reply)


@pytest.mark.parametrize(
    "greeting",
    [
        pytest.param(b"TORCHRUNX/005\n" + bytes(handshake.NONCE_BYTES), id="another-version"),
        pytest.param(handshake.MAGIC + bytes(handshake.NONCE_BYTES + 1), id="too-long"),
        pytest.param(handshake.MAGIC + bytes(handshake.NONCE_BYTES - 1), id="too-short"),
    ],
)
def test_rule_a_client_answers_only_a_greeting_of_this_protocol_and_size(greeting):
    with pytest.raises(ProtocolError, match="launcher does not speak torchrunx protocol"):
        handshake.client_reply(SECRET, greeting, "worker")


def test_rule_the_keys_depend_on_the_clients_nonce_too():
    """Rule: a replayed greeting (the same server nonce) still gives keys of their own."""
    ns = os.urandom(handshake.NONCE_BYTES)
    first = handshake.session_keys(SECRET, ns, os.urandom(handshake.NONCE_BYTES), b"W", server=True)
    again = handshake.session_keys(SECRET, ns, os.urandom(handshake.NONCE_BYTES), b"W", server=True)
    assert first.send != again.send
    assert first.receive != again.receive


def test_rule_connect_gives_up_at_once_where_nothing_listens():
    """Rule: a refused connection is not tried again until the timeout (nothing listens)."""
    with socket.socket() as bound:  # bound, never listening: its port refuses
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            handshake.connect(("127.0.0.1", port), SECRET, "worker", timeout=10)
        assert time.monotonic() - started < 5


def test_rule_a_connection_from_connect_blocks_without_the_connect_timeout():
    """Rule: the timeout is the handshake's; the connection then waits as long as it must."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept(sock: socket.socket) -> object:
        conn, _ = sock.accept()
        with conn:
            return server_handshake(conn, SECRET)

    thread, outcome = run_server(listener, accept)
    conn = handshake.connect(("127.0.0.1", listener.getsockname()[1]), SECRET, "agent", 10)
    try:
        thread.join(10)
        assert isinstance(outcome[0], tuple)
        assert conn.sock.gettimeout() is None
    finally:
        conn.close()


# -- records: their sizes, the close record, what comes after a bad one -----------------------

KEY = b"k" * 32


def test_rule_a_record_of_a_whole_piece_is_taken_one_byte_more_is_not():
    sealer, reader = records.Sealer(KEY), RecordReader(KEY)
    part = os.urandom(records.RECORD_BYTES)
    sealed = list(sealer.seal_frame(messages.WorkerResult(0), [part]))
    assert len(sealed[-1]) == 4 + records.RECORD_BYTES + records.TAG_BYTES  # the largest
    frames = [frame for record in sealed for frame in reader.open_record(record)]
    assert [(m, [bytes(p) for p in parts]) for m, parts in frames] == [
        (messages.WorkerResult(0), [part])
    ]
    for size in (records.RECORD_BYTES + records.TAG_BYTES + 1, records.TAG_BYTES - 1):
        with pytest.raises(ProtocolError, match=f"record of {size} bytes: not a torchrunx"):
            records.FrameReader._record_size_of(memoryview(struct.pack("!I", size)))


def test_rule_a_close_record_inside_a_frame_is_a_cut_not_a_clean_close():
    sealer, reader = records.Sealer(KEY), RecordReader(KEY)
    start, _part = records.frame_pieces(messages.WorkerResult(0), [b"part"])
    assert reader.open_record(sealer.seal(start)) == []
    with pytest.raises(ProtocolError, match="closed its stream in the middle of a frame"):
        reader.open_record(sealer.seal_close())
    assert not reader.closed_by_peer


def test_rule_no_record_is_taken_after_the_close_record():
    sealer, reader = records.Sealer(KEY), RecordReader(KEY)
    assert reader.open_record(sealer.seal_close()) == []
    assert reader.closed_by_peer
    (record,) = sealer.seal_frame(messages.Heartbeat())
    with pytest.raises(ProtocolError, match="a record after the peer's close record"):
        reader.open_record(record)


def _pair() -> tuple[records.Connection, records.Connection]:
    a, b = socket.socketpair()
    keys = records.SessionKeys(send=KEY, receive=WRONG)
    return records.Connection(a, keys), records.Connection(b, records.SessionKeys(WRONG, KEY))


def test_rule_a_stream_that_ends_without_its_close_record_was_cut():
    """Rule: only the authenticated close record is a clean end; a FIN alone is a cut stream,
    for a blocking reader (``recv``) and a non-blocking one (``read``) alike."""
    sender, receiver = _pair()
    try:
        sender.send(messages.Heartbeat())
        sender.sock.shutdown(socket.SHUT_WR)  # no close record
        assert receiver.recv() == (messages.Heartbeat(), [])
        with pytest.raises(ProtocolError, match="ended without its authenticated close"):
            receiver.recv()
    finally:
        sender.close()
        receiver.close()
    a, b = socket.socketpair()
    with a, b:
        (record,) = records.Sealer(KEY).seal_frame(messages.Heartbeat())
        a.sendall(record)
        a.shutdown(socket.SHUT_WR)
        b.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        reader = records.FrameReader(KEY)
        frames, ended = reader.read(b, drain=True)
        assert (frames, ended) == ([(messages.Heartbeat(), [])], True)
        assert isinstance(reader.error, ProtocolError)
        assert not reader.closed_by_peer


def test_rule_a_clean_close_ends_the_stream_as_a_connection_error_only():
    sender, receiver = _pair()
    try:
        sender.send(messages.Heartbeat())
        sender.close()
        assert receiver.recv() == (messages.Heartbeat(), [])
        with pytest.raises(ConnectionError) as info:
            receiver.recv()
        assert not isinstance(info.value, ProtocolError)
    finally:
        receiver.close()


def test_rule_frames_before_a_malformed_one_in_the_same_record_come_first():
    too_many_parts = struct.pack("!QI", 10, (1 << 20) + 1)
    record = records.Sealer(KEY).seal(
        records.encode_frame_start(messages.Heartbeat()) + too_many_parts
    )
    a, b = socket.socketpair()
    receiver = records.Connection(b, records.SessionKeys(send=WRONG, receive=KEY))
    with a:
        a.sendall(record)
        a.shutdown(socket.SHUT_WR)
        try:
            assert receiver.recv() == (messages.Heartbeat(), [])
            with pytest.raises(ProtocolError, match="parts is too large"):
                receiver.recv()
        finally:
            receiver.close()


def test_rule_a_reader_reads_a_connection_one_way_only():
    a, b = socket.socketpair()
    with a, b:
        (record,) = records.Sealer(KEY).seal_frame(messages.Heartbeat())
        a.sendall(record[:10])  # half a record: kept by ``read``
        b.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        reader = records.FrameReader(KEY)
        assert reader.read(b) == ([], False)
        with pytest.raises(ProtocolError, match="one reading style per connection"):
            reader.read_record(b)


# -- a frame's header: the protocol's message classes, and nothing else ----------------------


def test_rule_a_header_naming_a_message_class_of_another_module_is_refused():
    header = pickle.dumps(messages.Heartbeat(), protocol=2)
    assert messages._load_message(header) == messages.Heartbeat()
    forged = header.replace(b"ctorchrunx.wire.messages\n", b"cevil\n")
    with pytest.raises(ProtocolError, match=r"evil\.Heartbeat is not a torchrunx message class"):
        messages._load_message(forged)


@pytest.mark.parametrize("value", [{"type": "Heartbeat"}, ("Heartbeat",), 5, None])
def test_rule_a_header_of_built_ins_only_is_not_a_message(value):
    with pytest.raises(ProtocolError, match=f"unexpected message type {type(value).__name__}"):
        messages._load_message(pickle.dumps(value))
