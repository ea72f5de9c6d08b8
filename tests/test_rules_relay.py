"""The relay's pure parts: frames, queues, command lines, options (no hosts; see test_relay.py)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

import torchrunx as trx
from torchrunx.engines.builtin import openssh_command, srun_command
from torchrunx.engines.command import AGENT_COMMAND
from torchrunx.errors import ProtocolError
from torchrunx.launcher.settings.plan import check_relay
from torchrunx.launcher.starts.agent_starts import listen_hosts
from torchrunx.wire.relay import (
    DATA,
    EOF,
    HEADER,
    MAX_DATA,
    OPEN,
    OUT,
    TREE,
    ByteQueue,
    FrameSplitter,
    frame,
)


def test_frames_survive_any_cutting_of_the_stream():
    rng = random.Random(7)  # noqa: S311 (a reproducible cutting, not a secret)
    sent = [
        (OPEN, 1, b"10.0.0.2\n10.0.0.1"),
        (DATA, 1, rng.randbytes(MAX_DATA)),
        (DATA, 2, b""),
        (OUT, 0, b"a line\n"),
        (EOF, 1, b""),
        (DATA, 7, rng.randbytes(12345)),
    ]
    stream = b"".join(b"".join(frame(*f)) for f in sent)
    for _ in range(20):
        splitter = FrameSplitter()
        got = []
        at = 0
        while at < len(stream):
            size = rng.choice([1, 2, 8, 9, 100, 65536, 1 << 21])
            got += splitter.feed(stream[at : at + size])
            at += size
        assert got == sent
        assert splitter.pending == 0


def test_a_stream_that_is_not_the_relays_is_refused_with_what_it_began_with():
    splitter = FrameSplitter()
    with pytest.raises(ProtocolError, match=r"frame kind 72.*it begins b'Hello") as info:
        splitter.feed(b"Hello, I am a banner that a login script printed\n")
    assert "did something else write to the agent's stdout?" in str(info.value)
    too_long = HEADER.pack(DATA, 1, MAX_DATA + 1)
    with pytest.raises(ProtocolError, match=f"length {MAX_DATA + 1}"):
        FrameSplitter().feed(too_long)


def test_a_byte_queue_writes_in_order_across_partial_writes():
    queue = ByteQueue()
    pieces = [b"abc", b"", b"defgh", b"i" * 1000, b"jk"]
    for piece in pieces:
        queue.append(piece)
    assert len(queue) == sum(map(len, pieces))
    out = bytearray()

    def write_some(views: list[memoryview]) -> int:
        data = b"".join(views)[:7]  # a pipe that takes 7 bytes at a time
        out.extend(data)
        return len(data)

    while queue:
        assert queue.write_to(write_some) > 0
    assert bytes(out) == b"".join(pieces)
    queue.append(b"x")
    queue.clear()
    assert len(queue) == 0


def test_openssh_runs_the_constant_agent_command_without_prompting():
    argv = openssh_command("/usr/bin/ssh", "node1", "/cfg", 30)
    assert argv == [
        "/usr/bin/ssh", "-T", "-F", "/cfg", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30",
        "--", "node1", AGENT_COMMAND,
    ]  # fmt: skip
    assert "-F" not in openssh_command("ssh", "node1", None, 5)


def test_srun_steps_of_relaying_hosts_are_unbuffered_only():
    assert "--unbuffered" in srun_command("n1", cpus=None, unbuffered=True)
    assert "--unbuffered" not in srun_command("n1", cpus=None)


def test_relay_on_listens_on_loopback_only_unless_told_otherwise():
    assert listen_hosts(None, ["ssh", "ssh"], {}, relay="on") == ["127.0.0.1"]
    assert listen_hosts(None, ["ssh", "ssh"], {}, relay="auto") == [None]
    assert listen_hosts(None, ["ssh"], {"TORCHRUNX_LISTEN_ADDR": "*"}, relay="on") == [None]


@pytest.mark.parametrize("value", ["yes", True, None, "ON"])
def test_relay_takes_off_auto_or_on(value):
    with pytest.raises(ValueError, match=r"expected one of 'off', 'auto', 'on'"):
        check_relay(value)
    for good in ("off", "auto", "on"):
        check_relay(good)


def test_a_relaying_hosts_bootstrap_line_carries_the_mode_as_a_typed_field():
    from torchrunx.hosts import HostSlots
    from torchrunx.launcher.starts.agent_starts import AgentStarts
    from torchrunx.launcher.state.records import AgentRecord
    from torchrunx.wire.bootstrap import AgentBootstrap

    base = trx.Launcher(hostnames=["localhost"], workers_per_host=1, relay="auto").plan()
    hosts = dataclasses.replace(base.hosts, slots=(HostSlots("node1", 1),), methods=("ssh",))
    plan = dataclasses.replace(base, hosts=hosts)
    agent = AgentRecord(0, plan.hosts.slots[0], "ssh", role="host")
    starts = AgentStarts(plan, [agent], 1234, b"s" * 32, 20, lambda *_: None)
    line = starts.bootstrap(agent, "10.0.0.1", relays=True)
    relayed = AgentBootstrap.from_json_line(line)
    assert (relayed.relay, relayed.launcher_port) == ("auto", 1234)
    own = starts.bootstrap(agent, "10.0.0.1")
    assert "relay" not in json.loads(own)  # an agent's own line: as before, without it
    assert AgentBootstrap.from_json_line(own).relay == ""
    # What the relay hands its agent: the same line, the mode taken out.
    assert dataclasses.replace(relayed, relay="").to_json_line() == own
    with pytest.raises(ProtocolError, match="field 'relay' must be"):
        AgentBootstrap.from_json_line(json.dumps({**json.loads(line), "relay": "sideways"}))


def test_the_dry_run_says_when_hosts_relay(tmp_path):
    import torchrunx as trx

    config = tmp_path / "ssh_config"
    config.write_text("Host node1\n  HostName 10.9.9.9\n")
    fields = {"hostnames": ["node1"], "workers_per_host": 1, "ssh_config_file": config}
    assert "relay:" not in trx.Launcher(**fields).dry_run()
    on = trx.Launcher(relay="on", **fields).dry_run()
    assert "relay: on (remote hosts' connections travel over their agent's channel, always)" in on
    auto = trx.Launcher(relay="auto", **fields).dry_run()
    assert "for hosts whose test connection to the launcher fails" in auto


def test_a_frame_without_data_is_its_header_alone():
    assert frame(EOF, 3) == [HEADER.pack(EOF, 3, 0)]
    assert frame(DATA, 3, b"xy") == [HEADER.pack(DATA, 3, 2), b"xy"]


def test_a_broken_stream_shows_its_first_40_bytes():
    text = b"Hello, I am a banner that a login script printed\n"
    with pytest.raises(ProtocolError) as info:
        FrameSplitter().feed(text)
    assert f"it begins {text[:40]!r};" in str(info.value)


def test_a_byte_queue_hands_at_most_64_pieces_to_one_write():
    queue = ByteQueue()
    for index in range(100):
        queue.append(bytes([index]))
    sizes = []

    def write_all(views: list[memoryview]) -> int:
        sizes.append(len(views))
        return sum(map(len, views))

    assert queue.write_to(write_all) == 64
    assert queue.write_to(write_all) == 36
    assert sizes == [64, 36]
    assert len(queue) == 0


def test_a_byte_queue_write_that_ends_inside_a_piece_keeps_the_rest_of_it():
    queue = ByteQueue()
    queue.append(b"abcdef")
    queue.append(b"gh")
    assert queue.write_to(lambda _views: 6) == 6  # exactly the first piece
    assert len(queue) == 2
    got: list[bytes] = []
    queue.write_to(lambda views: got.append(b"".join(views)) or 2)
    assert got == [b"gh"]


@pytest.mark.parametrize("kind", [0, 6, 255])
def test_a_relay_frame_of_an_unknown_kind_is_refused_whatever_its_length(kind):
    with pytest.raises(ProtocolError, match=f"frame kind {kind}, length 0 "):
        FrameSplitter().feed(HEADER.pack(kind, 1, 0))  # a length that is fine: the kind alone


@pytest.mark.parametrize("kind", [OPEN, DATA, EOF, OUT, TREE])
def test_every_known_kind_is_taken_up_to_the_longest_data(kind):
    data = bytes(MAX_DATA)
    assert FrameSplitter().feed(HEADER.pack(kind, 9, MAX_DATA) + data) == [(kind, 9, data)]
    with pytest.raises(ProtocolError, match=f"frame kind {kind}, length {MAX_DATA + 1} "):
        FrameSplitter().feed(HEADER.pack(kind, 9, MAX_DATA + 1))  # a known kind: the length alone


def test_rule_a_frames_header_is_kind_then_channel_then_length_big_endian():
    # As the module documents it: kind (1 byte), channel and length (4 bytes each, big endian).
    assert frame(TREE, 0x01020304, b"xyz") == [b"\x05\x01\x02\x03\x04\x00\x00\x00\x03", b"xyz"]
    assert FrameSplitter().feed(b"\x02\x00\x00\x01\x00\x00\x00\x00\x02hi") == [(DATA, 256, b"hi")]
