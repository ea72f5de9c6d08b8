"""More rules of the pure core, each test named after the rule it guards.

Written to kill the mutants that ``scripts/mutation.py`` found surviving (see
docs/mutation.md): each test states a documented rule, on made-up facts, with no process and
no network. Sections:

- what arrives during a launch (torchrunx/launcher/launch/inbox.py), driven with stand-in peers, pool,
  listener, log router and event sink;
- failure analysis (torchrunx/launcher/state/failures.py): restart_on's type names;
- environment forwarding (torchrunx/env.py): a worker's variables, exact, and full messages;
- device choice (torchrunx/devices.py): isolation, threads, the device of a worker;
- the launch state (torchrunx/launcher/state/state.py): every record's fields, settling, waits,
  silence, kept workers, attempts, health and timings;
- SLURM allocations and hostfiles (torchrunx/hosts/hostlists.py), with no ``scontrol`` process;
- host names (the checks of torchrunx/launcher/settings/resolve.py): every reason, in full;
- the checks of the Launcher's fields (torchrunx/launcher/launcher.py): every message, in full;
- the handshake, sealed records and frames (torchrunx/wire/handshake.py, records.py, messages.py):
  the frame parser however its input is cut, the limits, the close record, both reading styles,
  the wire format's HMAC and HKDF computed independently, connect's retries on a fake clock.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import pickle
import re
import select
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from wire_helpers import RecordReader

import torchrunx as trx
from torchrunx import logs as trx_logs
from torchrunx import plugins, serialization
from torchrunx.devices import count_slots, cuda_device, device_env
from torchrunx.env import (
    DEFAULT_ENV_VARS,
    check_env_fields,
    exported_env,
    forwarded_env,
    local_agent_env,
    split_extra_env_vars,
    worker_env,
)
from torchrunx.errors import (
    AgentFailedError,
    ProtocolError,
    ShipError,
    SlurmError,
    TorchrunxError,
    WorkerFailedError,
    WorkerRaisedError,
    WorkerTimeoutError,
)
from torchrunx.events import AgentStarted as AgentStartedEvent
from torchrunx.events import AgentState, HostQuarantined, WorkerFailed, WorkerState
from torchrunx.events import WorkersStarted as WorkersStartedEvent
from torchrunx.hosts import hostlists
from torchrunx.hosts.hostlists import HostSlots
from torchrunx.launcher import launcher as launcher_module
from torchrunx.launcher.launch.inbox import Inbox
from torchrunx.launcher.net.channels import WorkerChannel
from torchrunx.launcher.net.listener import FrameReceived, PeerClosed
from torchrunx.launcher.settings import plan as plan_module
from torchrunx.launcher.settings import resolve as hosts
from torchrunx.launcher.settings.plan import LaunchPlan
from torchrunx.launcher.starts.agent_pool import AgentExited, AgentStarted, AgentStartFailed
from torchrunx.launcher.state import failures as failures_module
from torchrunx.launcher.state.failures import choose_cause, restarts_for
from torchrunx.launcher.state.health import AgentHealth, HealthReport, WorkerHealth
from torchrunx.launcher.state.records import OUTCOME_WAIT, AgentRecord, Fault, Phase
from torchrunx.launcher.state.results import LaunchTimings
from torchrunx.launcher.state.state import LaunchState
from torchrunx.wire import handshake, messages
from torchrunx.wire.messages import (
    AgentDone,
    AgentHello,
    DebugInput,
    DebugOutput,
    DebugpyListening,
    DirectOutcome,
    FromWorker,
    Heartbeat,
    LogLines,
    PreemptionNotice,
    Stop,
    ToWorker,
    WorkerChannelClosed,
    WorkerException,
    WorkerExited,
    WorkerHello,
    WorkerResult,
    WorkersEnded,
    WorkerSpec,
    WorkersStarted,
    WorkerStacks,
    WorkerTimedOut,
)
from torchrunx.wire.records import (
    _FRAME,
    _MAX_HEADER,
    _MAX_PARTS,
    _MAX_RECORD,
    _PART,
    _RECORD,
    COALESCE_BYTES,
    IDLE_BUFFER_BYTES,
    MAX_FRAME_BYTES,
    RECORD_BYTES,
    TAG_BYTES,
    Connection,
    FrameParser,
    FrameReader,
    Sealer,
    encode_frame_start,
    take_plaintext,
)


def test_rule_small_pieces_share_a_record_up_to_the_limit_and_a_large_one_stands_alone():
    big = b"L" * COALESCE_BYTES
    pieces = collections.deque([b"a" * 10, memoryview(b"b" * 20), b"c" * 30, big, b"d" * 5])
    assert bytes(take_plaintext(pieces)) == b"a" * 10 + b"b" * 20 + b"c" * 30
    assert take_plaintext(pieces) is big  # a large piece: a record of its own, not copied
    assert take_plaintext(pieces) == b"d" * 5 and not pieces  # a lone piece as it is
    half = COALESCE_BYTES // 2
    pieces = collections.deque([b"x" * half, b"y" * half, b"z"])
    assert bytes(take_plaintext(pieces)) == b"x" * half + b"y" * half  # full, not past it
    assert list(pieces) == [b"z"]
    pieces = collections.deque([b"s", big])
    assert take_plaintext(pieces) == b"s" and list(pieces) == [big]  # not merged with a large one


# -- what arrives during a launch (torchrunx/launcher/launch/inbox.py) -------------------------------------


class StubPeer:
    """A connection as the inbox sees it: who it says it is, what is sent, whether closed."""

    def __init__(self, ident: int, role: str) -> None:
        self.ident, self.role = ident, role
        self.sent: list[object] = []
        self.closed = False

    def send(self, message: object, payload: object = ()) -> None:
        del payload  # the tests look at the messages
        self.sent.append(message)

    def close(self) -> None:
        self.closed = True


class WorkerVia:
    """A worker as the inbox sees it: its messages come inside FromWorker on its agent's
    connection, and the launcher ends its channel with ToWorker(pid, None) there."""

    def __init__(self, agent: StubPeer, local_rank: int, pid: int) -> None:
        self.agent, self.local_rank, self.pid = agent, local_rank, pid
        self.ident: int | None = None
        """Its channel's ident in the inbox, once its hello opened one."""

    @property
    def drops(self) -> int:
        """How many times the launcher asked the agent to end this worker's channel."""
        return self.agent.sent.count(ToWorker(self.pid, None))

    @property
    def closed(self) -> bool:
        return self.drops > 0

    def ended(self) -> FrameReceived:
        """The agent reports that this worker's channel ended."""
        return frame(self.agent, WorkerChannelClosed(self.local_rank, clean=False))


class StubProcess:
    def __init__(self, tail: str = "", status: int | None = None) -> None:
        self.tail = tail
        self.status = status
        """Its exit status once it ended (None: running)."""

    def stderr_tail(self) -> str:
        return self.tail


@dataclass
class Parts:
    """What a message may touch, recorded."""

    dropped: list[StubPeer] = field(default_factory=list)
    processes: dict[int, StubProcess] = field(default_factory=dict)
    batches: list[tuple[int, int, tuple]] = field(default_factory=list)
    events: list[object] = field(default_factory=list)
    agent_timeout: float = 7.5
    start_timeout: float = 42.0
    env_file: str | None = None
    python: str | None = None
    spares: int = 0
    min_hosts: int | None = None
    quarantines = LaunchPlan.quarantines
    """The plan's own decision (spares or min_hosts: a failed host of the world is quarantined)."""
    preemption_grace: float = 0.0

    def exit_status_now(self, host_index: int) -> int | None:
        """As the agent pool's: the process's status if it ended, without waiting."""
        process = self.processes.get(host_index)
        return None if process is None else process.status

    # the plan's groups, as the inbox reads them (LaunchPlan.hosts, .timeouts, ...)
    @property
    def hosts(self) -> SimpleNamespace:
        return SimpleNamespace(spares=self.spares)

    @property
    def reach(self) -> SimpleNamespace:
        return SimpleNamespace(env_file=self.env_file, python=self.python)

    @property
    def timeouts(self) -> SimpleNamespace:
        return SimpleNamespace(agent=self.agent_timeout, start=self.start_timeout)

    @property
    def resilience(self) -> SimpleNamespace:
        return SimpleNamespace(min_hosts=self.min_hosts, preemption_grace=self.preemption_grace)

    # the listener, the pool, the log router and the event sink in one
    def drop(self, peer: StubPeer) -> None:
        self.dropped.append(peer)

    def emit_batch(self, index: int, offset: int, records: tuple) -> None:
        self.batches.append((index, offset, records))

    def emit(self, event: object) -> None:
        self.events.append(event)


def new_inbox(hosts: int = 2, workers: int = 2, **launcher: object) -> tuple[Inbox, Parts]:
    parts = Parts(**launcher)  # type: ignore[arg-type]
    agents = [AgentRecord(i, HostSlots(f"node{i}", workers), "ssh") for i in range(hosts)]
    state = LaunchState(agents, started=time.monotonic(), agent_timeout=7.5, start_timeout=42.0)
    inbox = Inbox(
        parts,  # type: ignore[arg-type]
        state,
        listener=parts,  # type: ignore[arg-type]
        pool=parts,  # type: ignore[arg-type]
        logs=parts,  # type: ignore[arg-type]
        sink=parts,  # type: ignore[arg-type]
    )
    return inbox, parts


def frame(
    peer: StubPeer | WorkerVia, message: object, payload: list | None = None, at: float = 0.0
):
    if isinstance(peer, WorkerVia):  # forwarded by its agent
        return FrameReceived(
            peer.agent,  # type: ignore[arg-type]
            FromWorker(peer.local_rank, message),  # type: ignore[arg-type]
            payload or [],
            at,
        )
    return FrameReceived(peer, message, payload or [], at)  # type: ignore[arg-type]


def hello(index: int, slots: int = 2, gpus: int = 0) -> AgentHello:
    return AgentHello(index, f"node{index}", 1000 + index, slots, 29500 + index, gpus)


def spec(index: int, workers: int = 2, hosts: int = 2) -> WorkerSpec:
    return WorkerSpec(
        index, f"node{index}", workers, index * workers, hosts * workers, "n0", 29500, "gloo", 60
    )


def connected(hosts: int = 2, workers: int = 2, **launcher: object):
    """An inbox whose agents said hello (peers 0..hosts-1) and got their specs."""
    inbox, parts = new_inbox(hosts, workers, **launcher)
    peers = [StubPeer(i, "agent") for i in range(hosts)]
    for i, peer in enumerate(peers):
        inbox.apply(frame(peer, hello(i, workers)))
        inbox.state.current.assign(inbox.state.agents[i], spec(i, workers, hosts))
    parts.events.clear()
    return inbox, parts, peers


def with_workers(hosts: int = 2, workers: int = 2, **launcher: object):
    """Also every rank's worker (pid 2000 + rank) said hello through its agent."""
    inbox, parts, peers = connected(hosts, workers, **launcher)
    ranks = [WorkerVia(peers[r.host_index], r.local_rank, 2000 + r.rank) for r in inbox.state.ranks]
    for rank, via in zip(inbox.state.ranks, ranks, strict=True):
        inbox.apply(frame(via, WorkerHello(rank.rank, rank.local_rank, via.pid)))
        via.ident = rank.conn
    parts.events.clear()
    return inbox, parts, peers, ranks


def test_rule_an_agents_hello_binds_its_connection_and_says_it_started():
    inbox, parts = new_inbox()
    peer = StubPeer(7, "agent")
    inbox.apply(frame(peer, hello(1, slots=3, gpus=2)))
    agent = inbox.state.agents[1]
    assert agent.conn == 7 and agent.state is AgentState.RUNNING and agent.free_port == 29501
    assert inbox.owners == {7: ("agent", 1)} and inbox.peers == {7: peer}
    assert inbox.peer_of(agent) is peer
    (event,) = parts.events
    assert isinstance(event, AgentStartedEvent)
    assert (event.host_index, event.hostname, event.pid, event.workers, event.gpus) == (
        1,
        "node1",
        1001,
        3,
        2,
    )
    assert not peer.closed and peer.sent == []


@pytest.mark.parametrize("index", [-1, 2, 5])
def test_rule_a_hello_for_a_host_the_launch_does_not_have_is_refused(index):
    inbox, parts = new_inbox(hosts=2)
    peer = StubPeer(7, "agent")
    inbox.apply(frame(peer, hello(index)))
    assert peer.closed and inbox.owners == {} and parts.events == []
    assert all(a.conn is None for a in inbox.state.agents)


def test_rule_a_second_hello_for_a_connected_host_is_refused_and_the_first_stays():
    inbox, _ = new_inbox(hosts=2)
    first, second = StubPeer(7, "agent"), StubPeer(8, "agent")
    inbox.apply(frame(first, hello(0)))
    inbox.apply(frame(second, hello(0)))
    assert second.closed and not first.closed
    assert inbox.state.agents[0].conn == 7 and 8 not in inbox.owners


def test_rule_an_agent_that_starts_while_the_launch_stops_is_sent_the_last_stop():
    inbox, _ = new_inbox()
    inbox.final_stop = Stop("the launch failed")
    peer = StubPeer(7, "agent")
    inbox.apply(frame(peer, hello(0)))
    assert peer.sent == [inbox.final_stop]


def test_rule_no_gpu_for_workers_per_host_gpu_fails_that_agent_naming_its_host():
    inbox, _ = new_inbox()
    inbox.apply(frame(StubPeer(7, "agent"), hello(1, slots=0)))
    agent = inbox.state.agents[1]
    assert agent.state is AgentState.FAILED
    (fault,) = inbox.state.faults
    assert fault.kind == "agent" and fault.host_index == 1 and fault.rank is None
    assert isinstance(fault.error, AgentFailedError)
    assert "node1" in str(fault.error)
    assert (
        "workers_per_host='gpu' but this host has no GPU (its agent looked at "
        "CUDA_VISIBLE_DEVICES, the NVIDIA driver and nvidia-smi); give a number of workers, or "
        "'auto' (GPUs, else CPU cores)"
    ) in str(fault.error)
    assert abs(fault.at - time.time()) < 60


@pytest.mark.parametrize(
    ("role", "message"),
    [
        ("agent", Heartbeat()),  # says nothing of who it is first
        ("agent", WorkerHello(0, 0, 1)),  # an agent's connection claiming a worker's hello
        ("worker", hello(0)),  # a worker's connection claiming an agent's hello
        ("worker", WorkerResult(0)),
    ],
)
def test_rule_a_peer_must_say_who_it_is_first_and_as_its_role(role, message):
    inbox, parts = new_inbox()
    inbox.state.current.assign(inbox.state.agents[0], spec(0))
    peer = StubPeer(9, role)
    inbox.apply(frame(peer, message))
    assert peer.closed and inbox.owners == {} and parts.events == []
    assert all(a.conn is None for a in inbox.state.agents)
    assert all(r.conn is None for r in inbox.state.ranks)


def test_rule_a_workers_hello_binds_its_rank_and_makes_it_healthy():
    inbox, parts, peers = connected()
    via = WorkerVia(peers[1], 1, 4242)
    inbox.apply(frame(via, WorkerHello(3, 1, 4242)))
    rank = inbox.state.ranks[3]
    assert rank.conn is not None and (rank.pid, rank.state) == (4242, WorkerState.HEALTHY)
    channel = inbox.peers[rank.conn]
    assert isinstance(channel, WorkerChannel) and channel.agent is peers[1]
    assert (channel.local_rank, channel.pid) == (1, 4242)
    assert inbox.owners[rank.conn] == ("rank", 3) and rank.conn not in (0, 1)  # not an agent's
    assert len(parts.events) == 1 and not via.closed
    channel.send(DebugInput("c"))  # what the launch sends the rank goes to its agent, wrapped
    channel.close()
    assert peers[1].sent == [ToWorker(4242, DebugInput("c")), ToWorker(4242, None)]


@pytest.mark.parametrize(
    "message",
    [
        WorkerHello(1, 1, 5, attempt=1),  # of another attempt
        WorkerHello(4, 0, 5),  # no such rank
        WorkerHello(-1, 0, 5),
    ],
)
def test_rule_a_worker_hello_for_no_rank_of_this_attempt_is_refused(message):
    inbox, parts, peers = connected()
    via = WorkerVia(peers[0], message.local_rank, 5)
    inbox.apply(frame(via, message))
    assert via.closed and inbox.channels == {} and parts.events == []
    assert all(r.conn is None for r in inbox.state.ranks)


@pytest.mark.parametrize(
    ("agent", "local", "message"),
    [
        (0, 0, WorkerHello(2, 0, 5)),  # rank 2 is host 1's local rank 0, not host 0's
        (1, 1, WorkerHello(3, 0, 5)),  # a hello whose local rank is not its channel's
        (1, 0, WorkerHello(3, 1, 5)),  # rank 3 is host 1's local rank 1
    ],
)
def test_rule_a_worker_hello_for_a_rank_of_another_host_or_slot_is_refused(agent, local, message):
    inbox, parts, peers = connected()
    via = WorkerVia(peers[agent], local, 5)
    inbox.apply(frame(via, message))
    assert via.closed and inbox.channels == {} and parts.events == []
    assert all(r.conn is None for r in inbox.state.ranks)


def test_rule_a_second_channel_for_a_rank_is_refused():
    inbox, _, peers, ranks = with_workers()
    inbox.apply(ranks[0].ended())  # its worker's channel ended (say it forked, and the child
    again = WorkerVia(peers[0], 0, 2100)  # says hello again): a rank has one channel
    inbox.apply(frame(again, WorkerHello(0, 0, 2100)))
    assert again.closed and inbox.state.ranks[0].conn == ranks[0].ident


def test_rule_frames_of_a_channel_that_ended_are_not_acted_on():
    inbox, _parts, _, ranks = with_workers()
    inbox.apply(ranks[1].ended())
    inbox.apply(frame(ranks[1], WorkerResult(1), [bytearray(b"late")]))
    assert inbox.state.ranks[1].result is None and inbox.state.faults == []
    assert not ranks[1].closed  # nothing to end: the agent said it ended


def test_rule_every_message_of_an_agent_counts_as_hearing_from_it():
    inbox, _, peers = connected()
    agent = inbox.state.agents[1]
    inbox.state.agent_table.heard_from(agent, 0.0)
    before = time.monotonic()
    inbox.apply(frame(peers[1], Heartbeat()))
    assert before <= agent.last_heard <= time.monotonic()
    assert not peers[1].closed and inbox.state.agents[0].last_heard != 0.0


def test_rule_log_lines_are_routed_with_the_ranks_of_that_agent():
    inbox, parts, peers = connected()
    records = ((0, 20, "stdout", "hello", 1.0),)
    inbox.apply(frame(peers[1], LogLines(records)))
    assert parts.batches == [(1, 2, records)]  # host 1's ranks start at 2


def test_rule_log_lines_of_an_agent_without_workers_yet_have_offset_0():
    inbox, parts = new_inbox()
    peer = StubPeer(7, "agent")
    inbox.apply(frame(peer, hello(1)))
    records = ((None, 30, "torchrunx.agent", "warming up", 1.0),)
    inbox.apply(frame(peer, LogLines(records)))
    assert parts.batches == [(1, 0, records)]


def test_rule_workers_started_records_their_pids_and_says_so():
    inbox, parts, peers = connected()
    inbox.apply(frame(peers[1], WorkersStarted((31, 32))))
    assert inbox.state.agents[1].pids == (31, 32)
    assert [r.pid for r in inbox.state.ranks] == [0, 0, 31, 32]
    (event,) = parts.events
    assert isinstance(event, WorkersStartedEvent) and event.ranks == (2, 3)


def test_rule_workers_ended_makes_the_agent_wait_and_agent_done_ends_it():
    inbox, _, peers = connected()
    inbox.apply(frame(peers[0], WorkersEnded(free_port=30000, attempt=0)))
    assert inbox.state.agents[0].ready and inbox.state.agents[0].free_port == 30000
    inbox.apply(frame(peers[0], AgentDone()))
    assert inbox.state.agents[0].state is AgentState.DONE
    assert inbox.state.agents[1].state is AgentState.RUNNING


@pytest.mark.parametrize("message", [WorkerResult(0), WorkerHello(0, 0, 1), hello(0)])
def test_rule_a_workers_message_on_an_agents_connection_drops_it(message):
    inbox, parts, peers = connected()
    inbox.apply(frame(peers[0], message))
    assert parts.dropped == [peers[0]]
    assert inbox.state.ranks[0].state is WorkerState.INIT


def test_rule_stacks_are_kept_by_global_rank():
    inbox, _, peers = connected()
    inbox.apply(frame(peers[1], WorkerStacks({0: "stack of 2", 1: "stack of 3"})))
    assert inbox.state.current.stacks == {2: "stack of 2", 3: "stack of 3"}


def test_rule_stacks_of_an_agent_without_workers_are_ignored():
    inbox, _ = new_inbox()
    peer = StubPeer(7, "agent")
    inbox.apply(frame(peer, hello(0)))
    inbox.apply(frame(peer, WorkerStacks({0: "a stack"})))
    assert inbox.state.current.stacks == {}


def test_rule_a_report_about_a_worker_the_agent_does_not_have_is_ignored():
    inbox, parts, peers = connected()
    inbox.apply(frame(peers[1], WorkerExited(5, 99, 1, None)))
    inbox.apply(frame(peers[1], WorkerTimedOut(5, "step", 1.0, "")))
    assert inbox.state.faults == [] and parts.events == [] and parts.dropped == []


def test_rule_a_worker_that_exits_non_zero_after_its_connection_ended_died():
    inbox, parts, peers, ranks = with_workers()
    inbox.apply(ranks[3].ended())
    inbox.apply(frame(peers[1], WorkerExited(1, 2003, 3, None, at=12.5)))
    rank = inbox.state.ranks[3]
    assert rank.settled and rank.state is WorkerState.FAILED
    (fault,) = inbox.state.faults
    assert fault.kind == "death" and fault.rank == 3 and fault.at == 12.5
    assert isinstance(fault.error, WorkerFailedError)
    assert len(parts.events) == 2  # its move to FAILED, and WorkerFailed


def test_rule_a_large_outcome_on_a_connection_of_its_own_is_waited_for():
    inbox, parts, peers, ranks = with_workers()
    rank = inbox.state.ranks[3]
    inbox.apply(frame(ranks[3], DirectOutcome(3)))  # on its channel: the outcome comes apart
    inbox.apply(ranks[3].ended())
    inbox.apply(frame(peers[1], WorkerExited(1, 2003, 0, None)))
    assert not rank.settled and rank.settle_by is not None  # waits for that connection
    direct = StubPeer(300, "worker")
    inbox.apply(frame(direct, WorkerHello(3, 1, 2003)))
    assert rank.direct == 300 and inbox.owners[300] == ("direct", 3) and not direct.closed
    payload = [bytearray(b"big")]
    inbox.apply(frame(direct, WorkerResult(3), payload))
    assert rank.result is payload and rank.state is WorkerState.SUCCEEDED
    inbox.apply(PeerClosed(direct))  # type: ignore[arg-type]
    assert rank.settled and inbox.state.faults == [] and parts.dropped == []


def test_rule_a_large_outcome_is_waited_for_though_the_exit_and_the_channels_end_came_first():
    inbox, _, peers, ranks = with_workers()
    rank = inbox.state.ranks[3]
    inbox.apply(frame(ranks[3], DirectOutcome(3)))
    inbox.apply(frame(peers[1], WorkerExited(1, 2003, 0, None)))
    inbox.apply(ranks[3].ended())  # exited, channel over: the outcome's connection is not
    assert not rank.settled and inbox.state.faults == []
    direct = StubPeer(300, "worker")
    inbox.apply(frame(direct, WorkerHello(3, 1, 2003)))
    inbox.apply(frame(direct, WorkerResult(3), [bytearray(b"big")]))
    inbox.apply(PeerClosed(direct))  # type: ignore[arg-type]
    assert rank.settled and rank.state is WorkerState.SUCCEEDED and inbox.state.faults == []


def test_rule_a_large_outcome_settles_its_exited_rank_when_its_connection_ends():
    inbox, _, peers, ranks = with_workers()
    rank = inbox.state.ranks[3]
    inbox.apply(frame(ranks[3], DirectOutcome(3)))
    inbox.apply(frame(peers[1], WorkerExited(1, 2003, 0, None)))  # before the outcome came
    assert not rank.settled
    direct = StubPeer(300, "worker")
    inbox.apply(frame(direct, WorkerHello(3, 1, 2003)))
    inbox.apply(frame(direct, WorkerResult(3), [bytearray(b"big")]))
    inbox.apply(PeerClosed(direct))  # type: ignore[arg-type]
    assert rank.settled and rank.settle_by is None  # its channel has not ended: no wait
    assert rank.state is WorkerState.SUCCEEDED and inbox.state.faults == []


def test_rule_a_large_outcome_that_never_comes_is_a_death_once_the_wait_is_over():
    inbox, _, peers, ranks = with_workers()
    rank = inbox.state.ranks[3]
    inbox.apply(frame(ranks[3], DirectOutcome(3)))
    inbox.apply(ranks[3].ended())  # its channel's end does not settle it
    assert not rank.settled
    inbox.apply(frame(peers[1], WorkerExited(1, 2003, None, 9)))
    assert not rank.settled and rank.settle_by is not None
    inbox.settle(rank)  # OUTCOME_WAIT is over (the orchestrator's timer)
    assert [f.kind for f in inbox.state.faults] == ["death"]


def test_rule_a_large_outcome_that_came_before_its_notice_settles_at_the_exit():
    inbox, _, peers, ranks = with_workers()
    rank = inbox.state.ranks[2]
    direct = StubPeer(300, "worker")
    inbox.apply(frame(direct, WorkerHello(2, 0, 2002)))
    inbox.apply(frame(direct, WorkerResult(2), [bytearray(b"big")]))
    inbox.apply(PeerClosed(direct))  # type: ignore[arg-type]
    inbox.apply(frame(ranks[2], DirectOutcome(2)))  # its agent's stream was slower
    assert not ranks[2].closed  # a late notice is no fault: a worker that stays stays
    inbox.apply(ranks[2].ended())
    inbox.apply(frame(peers[1], WorkerExited(0, 2002, 0, None)))
    assert rank.settled and rank.state is WorkerState.SUCCEEDED and inbox.state.faults == []


@pytest.mark.parametrize(
    "hello",
    [
        WorkerHello(3, 1, 9999),  # not the pid its worker said hello with on its channel
        WorkerHello(3, 1, 2003, attempt=1),  # of another attempt
        WorkerHello(7, 1, 2003),  # no such rank
    ],
)
def test_rule_a_connection_of_its_own_must_match_its_workers_channel(hello):
    inbox, _, _, _ = with_workers()
    direct = StubPeer(300, "worker")
    inbox.apply(frame(direct, hello))
    assert direct.closed and 300 not in inbox.owners
    assert all(r.direct is None for r in inbox.state.ranks)


def test_rule_a_second_outcome_on_a_connection_of_its_own_ends_that_connection_only():
    inbox, parts, _, ranks = with_workers()
    direct = StubPeer(300, "worker")
    inbox.apply(frame(direct, WorkerHello(3, 1, 2003)))
    first = [bytearray(b"first")]
    inbox.apply(frame(direct, WorkerResult(3), first))
    inbox.apply(frame(direct, WorkerResult(3), [bytearray(b"second")]))
    assert inbox.state.ranks[3].result is first
    assert parts.dropped == [direct] and not ranks[3].closed  # its channel stays


def test_rule_frames_of_an_earlier_attempts_channel_or_connection_are_not_acted_on():
    inbox, parts, _, ranks = with_workers()
    direct = StubPeer(300, "worker")
    inbox.apply(frame(direct, WorkerHello(3, 1, 2003)))
    inbox.state.begin_stop(restart=True)
    inbox.state.next_attempt()
    for agent in inbox.state.agents:
        inbox.state.current.assign(agent, spec(agent.index))
    inbox.apply(frame(ranks[1], WorkerResult(1), [bytearray(b"old")]))  # its channel is old
    inbox.apply(frame(direct, WorkerResult(3), [bytearray(b"old")]))
    assert all(r.result is None for r in inbox.state.ranks) and inbox.state.faults == []
    assert parts.dropped == [direct]


def test_rule_a_rank_has_one_connection_of_its_own_and_it_carries_only_its_outcome():
    inbox, parts, _, _ = with_workers()
    first, second = StubPeer(300, "worker"), StubPeer(301, "worker")
    inbox.apply(frame(first, WorkerHello(3, 1, 2003)))
    inbox.apply(frame(second, WorkerHello(3, 1, 2003)))
    assert second.closed and not first.closed and inbox.state.ranks[3].direct == 300
    inbox.apply(frame(first, DebugOutput(3, "(Pdb) ", waiting=True)))
    assert parts.dropped == [first]
    none_yet = StubPeer(302, "worker")  # before its worker said hello on its channel
    fresh, _, _ = connected()
    fresh.apply(frame(none_yet, WorkerHello(0, 0, 2000)))
    assert none_yet.closed


def test_rule_a_reported_exit_waits_for_the_workers_connection_to_end():
    inbox, _, peers, ranks = with_workers()
    inbox.apply(frame(peers[1], WorkerExited(1, 2003, 3, None)))
    rank = inbox.state.ranks[3]
    assert not rank.settled and inbox.state.faults == []
    inbox.apply(ranks[3].ended())
    assert rank.settled and [f.kind for f in inbox.state.faults] == ["death"]


class StubDebugger:
    """The inbox's debugger, recorded: what each rank's pdb wrote, and which ranks ended."""

    def __init__(self) -> None:
        self.outputs: list[tuple[int, DebugOutput]] = []
        self.forgotten: list[int] = []

    def on_output(self, rank: int, message: DebugOutput) -> None:
        self.outputs.append((rank, message))

    def forget(self, rank: int) -> None:
        self.forgotten.append(rank)


def test_rule_a_ranks_debugger_output_goes_to_the_debugger_and_its_end_forgets_it():
    inbox, parts, _, ranks = with_workers()
    debugger = StubDebugger()
    inbox.debugger = debugger  # type: ignore[assignment]
    message = DebugOutput(3, "(Pdb) ", waiting=True)
    inbox.apply(frame(ranks[3], message))
    assert debugger.outputs == [(3, message)]
    assert parts.dropped == [] and not ranks[3].closed
    inbox.apply(ranks[3].ended())
    assert debugger.forgotten == [3]


def test_rule_debugger_output_without_a_debugger_drops_that_connection():
    inbox, parts, _, ranks = with_workers()
    inbox.apply(frame(ranks[2], DebugOutput(2, "(Pdb) ", waiting=True)))
    assert ranks[2].drops == 1 and parts.dropped == []
    (closed,) = [e for e in parts.events if isinstance(e, PeerClosed)]  # its end, queued
    inbox.apply(closed)
    assert inbox.state.ranks[2].conn_closed


def test_rule_stacks_shown_on_request_go_to_the_look_and_are_not_kept():
    inbox, _, peers, _ = with_workers()
    shown: list[tuple[object, dict[int, str]]] = []
    inbox.on_shown = lambda agent, stacks: shown.append((agent, stacks))
    inbox.apply(frame(peers[1], WorkerStacks({0: "  File a\n"}, shown=True)))
    assert shown == [(inbox.state.agents[1], {0: "  File a\n"})]
    assert inbox.state.current.stacks == {}  # a look, not a dump before a stop
    inbox.on_shown = None
    inbox.apply(frame(peers[1], WorkerStacks({1: "  File b\n"}, shown=True)))  # no look: dropped
    assert len(shown) == 1


def test_rule_a_watchdog_report_is_a_hang_of_that_rank():
    inbox, parts, peers, _ = with_workers()
    inbox.apply(frame(peers[1], WorkerTimedOut(0, "epoch", 2.5, "  File x\n")))
    rank = inbox.state.ranks[2]
    (fault,) = inbox.state.faults
    assert fault.kind == "hang" and fault.rank == 2 and fault.error is rank.error
    assert isinstance(fault.error, WorkerTimeoutError)
    assert "node1" in str(fault.error) and "epoch" in str(fault.error)
    assert fault.error.rank == 2 and fault.error.local_rank == 0
    assert abs(fault.at - time.time()) < 60
    assert rank.state is WorkerState.FAILED and len(parts.events) == 2


def test_rule_a_watchdog_report_after_the_rank_ended_is_ignored():
    inbox, _, peers, ranks = with_workers()
    inbox.apply(frame(ranks[2], WorkerResult(2), [bytearray(b"x")]))
    inbox.apply(frame(peers[1], WorkerTimedOut(0, "epoch", 2.5, "")))
    assert inbox.state.faults == [] and inbox.state.ranks[2].error is None


def test_rule_a_result_is_recorded_once_and_a_second_outcome_drops_the_connection():
    inbox, parts, _, ranks = with_workers()
    payload = [bytearray(b"value")]
    inbox.apply(frame(ranks[1], WorkerResult(1), payload, at=5.0))
    rank = inbox.state.ranks[1]
    assert rank.result is payload and rank.received_at == 5.0 and rank.timing == WorkerResult(1)
    assert rank.state is WorkerState.SUCCEEDED and len(parts.events) == 1
    inbox.apply(frame(ranks[1], WorkerResult(1), [bytearray(b"other")]))
    inbox.apply(frame(ranks[1], WorkerException(1, "ValueError", "late", "")))
    assert rank.result is payload and inbox.state.faults == []
    assert ranks[1].drops == 1  # dropped at the second; the third came on an ended channel


def test_rule_a_workers_exception_is_its_ranks_fault_at_the_time_it_was_raised():
    inbox, parts, _, ranks = with_workers()
    message = WorkerException(3, "KeyError", "k", "Traceback ...", at=7.25)
    inbox.apply(frame(ranks[3], message, at=9.0))
    rank = inbox.state.ranks[3]
    (fault,) = inbox.state.faults
    assert fault.kind == "exception" and fault.rank == 3 and fault.at == 7.25
    assert fault.error is rank.error
    assert "worker rank 3 (local rank 1 on host 'node1', pid 2003)" in str(fault.error)
    assert rank.state is WorkerState.FAILED and len(parts.events) == 2


def test_rule_an_exception_without_its_time_is_dated_when_it_was_read():
    inbox, _, _, ranks = with_workers()
    inbox.apply(frame(ranks[0], WorkerException(0, "KeyError", "k", ""), at=9.0))
    assert inbox.state.faults[0].at == 9.0


@pytest.mark.parametrize(
    ("flag", "raised", "kind"),
    [
        (True, RuntimeError("boom"), "collective"),
        (False, RuntimeError("Connection closed by peer"), "collective"),
        (False, RuntimeError("boom"), "exception"),
    ],
)
def test_rule_a_peers_echo_is_a_collective_error_by_its_flag_or_its_message(flag, raised, kind):
    inbox, _, _, ranks = with_workers()
    message = WorkerException(0, "RuntimeError", str(raised), "", collective=flag)
    payload = [bytearray(part) for part in serialization.dumps(raised)]
    inbox.apply(frame(ranks[0], message, payload))
    assert [f.kind for f in inbox.state.faults] == [kind]
    assert isinstance(inbox.state.faults[0].error, RuntimeError)


@pytest.mark.parametrize("message", [Heartbeat(), AgentDone(), WorkersStarted((1,))])
def test_rule_an_agents_message_on_a_workers_connection_drops_it(message):
    inbox, _parts, _, ranks = with_workers()
    inbox.apply(frame(ranks[2], message))
    assert ranks[2].drops == 1 and inbox.state.faults == []


def test_rule_a_connection_that_never_said_hello_ends_with_nothing_to_judge():
    inbox, parts, _, _ = with_workers()
    inbox.apply(PeerClosed(StubPeer(55, "agent")))  # type: ignore[arg-type]
    stranger = WorkerVia(StubPeer(0, "agent"), 5, 1)  # a channel that never said hello
    inbox.apply(frame(stranger, WorkerResult(0)))
    inbox.apply(stranger.ended())
    assert inbox.state.faults == [] and parts.events == []


def test_rule_a_stale_connection_of_a_rank_ends_without_judging_it():
    inbox, _, _, ranks = with_workers()
    inbox.state.begin_stop(restart=True)  # a restart: the old workers' connections stay open
    inbox.state.next_attempt()
    for agent in inbox.state.agents:
        inbox.state.current.assign(agent, spec(agent.index))
    inbox.apply(ranks[0].ended())  # the old worker's channel ends as the new attempt begins
    assert not inbox.state.ranks[0].conn_closed
    again = WorkerVia(ranks[0].agent, 0, 3000)
    inbox.apply(frame(again, WorkerHello(0, 0, 3000, attempt=1)))
    assert inbox.state.ranks[0].conn not in (None, ranks[0].ident)


def test_rule_a_rank_whose_connection_ended_after_a_restart_is_not_looked_up():
    inbox, _, _, ranks = with_workers()
    inbox.state.begin_stop(restart=True)
    inbox.state.next_attempt()  # the ranks of the last attempt are gone
    inbox.apply(ranks[3].ended())
    assert inbox.state.faults == []
    inbox.state.current.assign(inbox.state.agents[0], spec(0, 2, 2))
    inbox.state.current.assign(inbox.state.agents[1], spec(1, 1, 2))  # ranks 0..2 now
    inbox.apply(ranks[2].ended())
    assert inbox.state.faults == [] and not any(r.conn_closed for r in inbox.state.ranks)


def test_rule_an_agents_connection_cut_fails_it_with_its_stderr():
    inbox, parts, peers = connected()
    parts.processes[1] = StubProcess("Traceback: the agent's last words")
    inbox.apply(PeerClosed(peers[1]))  # type: ignore[arg-type]
    agent = inbox.state.agents[1]
    assert agent.state is AgentState.FAILED and agent.conn_closed
    (fault,) = inbox.state.faults
    assert fault.kind == "agent" and fault.host_index == 1
    text = str(fault.error)
    assert (
        "node1" in text
        and (
            "the connection to the agent closed unexpectedly (the agent process died or was killed)"
        )
        in text
    )
    assert "the agent's last words" in text and abs(fault.at - time.time()) < 60
    assert inbox.state.agents[0].state is AgentState.RUNNING


def test_rule_an_agents_connection_cut_ends_its_own_workers_channels_and_no_others():
    inbox, _, peers, _ = with_workers()  # 2 hosts x 2 workers: ranks 0, 1 on host 0; 2, 3 on 1
    kept = {key: inbox.channels[key] for key in ((0, 0), (0, 1))}
    ended = [inbox.channels[(1, 0)], inbox.channels[(1, 1)]]
    inbox.apply(PeerClosed(peers[1]))  # type: ignore[arg-type]
    assert inbox.channels == kept  # host 1's channels are gone, host 0's stay open
    assert all(channel.closed for channel in ended)  # nothing more is sent on them
    assert [r.conn_closed for r in inbox.state.ranks] == [False, False, True, True]


def test_rule_an_agents_connection_cut_after_its_process_ended_names_how_it_ended():
    # The agent's process (the guardian the launcher started) ended before the connection's
    # end was seen, its exit not yet reported: the fault says how it ended.
    inbox, parts, peers = connected()
    parts.processes[1] = StubProcess("", status=3)
    inbox.apply(PeerClosed(peers[1]))  # type: ignore[arg-type]
    (fault,) = inbox.state.faults
    assert "exit status 3" in str(fault.error), fault.error
    assert "closed unexpectedly" not in str(fault.error)
    assert inbox.state.agents[1].exited and inbox.state.agents[1].exit_status == 3


def test_rule_an_agents_connection_cut_while_stopping_fails_it_without_a_fault():
    inbox, _, peers = connected()
    inbox.state.begin_stop(restart=False)
    inbox.apply(PeerClosed(peers[0]))  # type: ignore[arg-type]
    assert inbox.state.agents[0].state is AgentState.FAILED and inbox.state.faults == []


def test_rule_the_end_of_a_done_agents_connection_is_no_failure():
    inbox, _, peers = connected()
    inbox.apply(frame(peers[0], AgentDone()))
    inbox.apply(PeerClosed(peers[0]))  # type: ignore[arg-type]
    assert inbox.state.agents[0].state is AgentState.DONE and inbox.state.faults == []


def test_rule_an_old_connection_of_a_replaced_agent_ends_without_judging_it():
    inbox, _, peers = connected()
    inbox.state.begin_stop(restart=True)  # a restart replaces agent 0 ...
    inbox.state.agent_table.replace_agent(0)
    inbox.apply(frame(StubPeer(77, "agent"), hello(0)))  # ... its new one, on another connection
    inbox.state.agent_table.replacements_started([0])
    inbox.apply(PeerClosed(peers[0]))  # type: ignore[arg-type]
    assert inbox.state.agents[0].state is AgentState.RUNNING and inbox.state.faults == []
    assert not inbox.state.agents[0].conn_closed


def test_rule_an_agent_whose_process_ended_first_is_judged_when_its_connection_ends():
    inbox, parts, peers = connected()
    process = StubProcess("tail")
    parts.processes[0] = process
    inbox.apply(AgentExited(0, 3, process))  # type: ignore[arg-type]
    agent = inbox.state.agents[0]
    assert agent.exited and agent.judge_by is not None and inbox.state.faults == []
    inbox.apply(PeerClosed(peers[0]))  # type: ignore[arg-type]
    assert agent.state is AgentState.FAILED and agent.judge_by is None
    (fault,) = inbox.state.faults
    assert fault.kind == "agent" and abs(fault.at - time.time()) < 60
    assert isinstance(fault.error, AgentFailedError) and fault.error.hostname == "node0"
    assert "the agent process ended unexpectedly (exit status 3)" in str(fault.error)
    assert "tail" in str(fault.error)
    assert "env_file" not in str(fault.error)  # it had connected: its env_file worked


def test_rule_an_agent_that_never_connected_is_judged_when_its_process_ends():
    inbox, parts = new_inbox(env_file="/etc/env.sh")
    process = StubProcess()
    parts.processes[1] = process
    inbox.apply(AgentExited(1, 1, process))  # type: ignore[arg-type]
    assert inbox.state.agents[1].state is AgentState.FAILED
    (fault,) = inbox.state.faults
    assert fault.kind == "agent" and fault.host_index == 1
    assert "env_file '/etc/env.sh' is sourced first" in str(fault.error)


@pytest.mark.parametrize("env_file", [None, "/etc/env.sh"])
def test_rule_the_env_file_is_named_only_for_an_agent_that_never_connected(env_file):
    inbox, _, _ = connected(env_file=env_file)  # both agents said hello
    agent = inbox.state.agents[0]
    inbox.state.agent_table.agent_exited(agent, 1, time.monotonic())
    inbox.judge_agent(agent)
    assert "env_file" not in str(inbox.state.faults[0].error)
    inbox2, _ = new_inbox()
    inbox2.judge_agent(inbox2.state.agents[0])  # never connected, no env_file
    assert "env_file" not in str(inbox2.state.faults[0].error)


def test_rule_the_end_of_a_replaced_agent_process_is_ignored():
    inbox, parts = new_inbox()
    parts.processes[1] = StubProcess()
    inbox.apply(AgentExited(1, 1, StubProcess()))  # type: ignore[arg-type]
    assert inbox.state.agents[1].state is AgentState.STARTING and inbox.state.faults == []


def test_rule_a_started_agent_is_nothing_until_it_says_hello():
    inbox, parts = new_inbox()
    inbox.apply(AgentStarted(0, StubProcess()))  # type: ignore[arg-type]
    assert inbox.state.agents[0].state is AgentState.STARTING
    assert inbox.state.faults == [] and parts.events == []


def test_rule_an_agent_that_could_not_start_failed():
    inbox, _ = new_inbox()
    error = AgentFailedError("node1", "ssh: connect refused")
    inbox.apply(AgentStartFailed(1, error))
    assert inbox.state.agents[1].state is AgentState.FAILED
    (fault,) = inbox.state.faults
    assert (fault.kind, fault.error, fault.host_index) == ("agent", error, 1)
    assert abs(fault.at - time.time()) < 60


def test_rule_an_agent_silent_too_long_is_lost_and_the_message_names_both_limits():
    inbox, _, _ = connected()
    inbox.agent_silent(inbox.state.agents[1], 8.04)
    assert inbox.state.agents[1].state is AgentState.LOST
    (fault,) = inbox.state.faults
    assert fault.kind == "lost" and fault.host_index == 1
    text = str(fault.error)
    assert "node1" in text and "no heartbeat for 8.0 s" in text
    assert "agent_timeout=7.5" in text and "start_timeout=42 until workers start" in text
    assert "the host is unreachable, its link is cut, or the agent is frozen" in text
    assert abs(fault.at - time.time()) < 60
    inbox.agent_silent(inbox.state.agents[0], 8.0, through="host node0 ... fell silent with it")
    text = str(inbox.state.faults[-1].error)
    assert "no heartbeat for 8.0 s" in text and "agent_timeout=7.5" in text
    assert text.endswith("; host node0 ... fell silent with it")  # the cause, instead of guesses
    assert "link is cut, or the agent is frozen" not in text
    inbox.agent_silent(inbox.state.agents[1], 8.0, through=None, subtree="it is interior: ...")
    text = str(inbox.state.faults[-1].error)
    assert text.endswith("its link is cut, or the agent is frozen; it is interior: ...")


def test_rule_a_done_agent_is_not_judged_again():
    inbox, _, peers = connected()
    agent = inbox.state.agents[0]
    inbox.state.agent_table.agent_exited(
        agent, 0, 3.0
    )  # its exit overtook its AgentDone: judged by 5.0
    inbox.apply(frame(peers[0], AgentDone()))
    inbox.judge_agent(agent)
    assert agent.state is AgentState.DONE and agent.judge_by is None
    assert inbox.state.faults == []


def test_rule_an_agent_that_ended_while_the_launch_stops_failed_without_a_fault():
    inbox, _, _ = connected()
    inbox.state.begin_stop(restart=False)
    inbox.judge_agent(inbox.state.agents[0])
    assert inbox.state.agents[0].state is AgentState.FAILED and inbox.state.faults == []


def test_rule_a_remote_agent_killed_by_a_signal_is_named_so():
    inbox, parts, _ = connected()
    parts.processes[0] = StubProcess("ssh: broken pipe")
    agent = inbox.state.agents[0]
    inbox.state.agent_table.agent_exited(agent, -9, time.monotonic())
    inbox.judge_agent(agent)
    (fault,) = inbox.state.faults
    assert "the agent ended without an exit status" in str(fault.error)
    assert "ssh: broken pipe" in str(fault.error)


def test_rule_a_forgotten_rank_is_dropped_and_its_late_frames_are_refused():
    inbox, _parts, _, ranks = with_workers()
    inbox.forget_rank(inbox.state.ranks[1])
    assert ranks[1].drops == 1 and ranks[1].ident not in inbox.owners
    assert ranks[0].ident in inbox.owners  # the others stay
    inbox.apply(frame(ranks[1], WorkerResult(1)))  # late: its channel is closed
    assert inbox.state.ranks[1].result is None and ranks[1].drops == 1


def test_rule_forgetting_a_rank_that_never_connected_drops_nothing():
    inbox, parts, _ = connected()
    inbox.forget_rank(inbox.state.ranks[0])  # nothing to forget
    inbox.owners[-1] = ("rank", 9)
    inbox.forget_rank(inbox.state.ranks[0])
    assert parts.dropped == [] and -1 not in inbox.owners


def test_rule_forgetting_a_rank_twice_is_harmless():
    inbox, _parts, _, ranks = with_workers()
    inbox.forget_rank(inbox.state.ranks[1])
    inbox.forget_rank(inbox.state.ranks[1])
    assert ranks[1].ident not in inbox.owners and ranks[1].drops == 1


def test_rule_dropping_no_connection_or_an_unknown_one_does_nothing():
    inbox, parts, _ = connected()
    inbox.drop(None)
    inbox.drop(12345)
    assert parts.dropped == []


def test_rule_the_stderr_tail_of_an_agent_without_a_process_is_empty():
    inbox, parts = new_inbox()
    parts.processes[0] = StubProcess("last words")
    assert inbox.stderr_tail(0) == "last words"
    assert inbox.stderr_tail(1) == ""


def test_rule_settling_a_rank_emits_what_follows():
    inbox, parts, peers, _ = with_workers()
    inbox.apply(frame(peers[0], WorkerExited(0, 2000, None, 9)))
    rank = inbox.state.ranks[0]
    assert not rank.settled
    inbox.settle(rank)
    assert rank.settled and rank.state is WorkerState.FAILED and len(parts.events) == 2


# -- failure analysis (torchrunx/launcher/state/failures.py) ----------------------------------------------


def test_rule_choosing_a_cause_out_of_no_failure_is_a_bug_said_plainly():
    with pytest.raises(ValueError, match=r"^no failure to choose from$"):
        choose_cause([])


@pytest.mark.parametrize(
    ("type_name", "wanted", "expected"),
    [
        ("pkg.mod.CustomError", {"CustomError"}, True),  # its bare name: after the last dot
        ("pkg.mod.CustomError", {"mod.CustomError"}, False),  # not a partial qualified name
        ("pkg.mod.CustomError", {"pkg.mod.CustomError"}, True),  # its qualified name
        ("CustomError", {"CustomError"}, True),  # a name without a module
        ("CustomError", {"OtherError"}, False),
    ],
)
def test_rule_restart_on_names_a_type_that_could_not_travel_back_bare_or_qualified(
    type_name, wanted, expected
):
    """Rule (docs/restarts.md): an exception type in ``restart_on`` is matched by its bare or
    its qualified name, also when the exception object could not be sent back."""
    error = WorkerRaisedError(f"{type_name}: boom")
    error.type_name = type_name
    assert restarts_for(error, wanted, from_worker=True) is expected


# -- environment forwarding (torchrunx/env.py) ---------------------------------------------


def test_rule_a_worker_gets_exactly_torchruns_variables_with_its_own_values():
    env = worker_env(
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=2,
        group_rank=2,
        group_world_size=4,
        master_addr="10.0.0.1",
        master_port=29511,
        attempt=3,
        max_restarts=4,
    )
    assert env == {
        "TORCHRUNX_RESTART_COUNT": "3",
        "TORCHELASTIC_RUN_ID": "torchrunx",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_MAX_RESTARTS": "4",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2",
        "GROUP_WORLD_SIZE": "4",
        "ROLE_NAME": "default",
        "ROLE_RANK": "5",
        "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
    }


def test_rule_the_first_worker_group_is_restart_0_of_0_unless_told():
    env = worker_env(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        group_rank=0,
        master_addr="h",
        master_port=1,
    )
    assert env["TORCHRUNX_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "0"


def test_rule_a_local_agent_starts_from_this_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("TORCHRUNX_RULES_MARK", "here")
    monkeypatch.setenv("LOCAL_RANK", "3")
    env = local_agent_env()
    assert env["TORCHRUNX_RULES_MARK"] == "here" and "LOCAL_RANK" not in env


def test_rule_forwarding_reads_this_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("TORCHRUNX_RULES_MARK", "here")
    assert forwarded_env(("TORCHRUNX_RULES_*",)) == {"TORCHRUNX_RULES_MARK": "here"}
    assert exported_env(("TORCHRUNX_RULES_*",), {"B": "1"}) == {
        "TORCHRUNX_RULES_MARK": "here",
        "B": "1",
    }


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"1A": "x"},
            (
                "extra_env_vars: '1A' is not a variable name bash can export (letters, digits "
                "and _, not starting with a digit)"
            ),
        ),
        (
            ("RANK=0",),
            (
                "extra_env_vars: RANK is set by torchrunx for each worker and cannot be given "
                "for all of them"
            ),
        ),
        ({"A": "x\0y"}, "extra_env_vars: the value of A contains a NUL byte"),
    ],
)
def test_rule_a_refused_extra_env_var_says_why_in_full(extra, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        split_extra_env_vars(extra)


# -- device choice (torchrunx/devices.py) --------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "local_rank", "expected"), [(0, 3, None), (1, 3, "0"), (2, 3, "1"), (4, 3, "3")]
)
def test_rule_isolation_gives_a_worker_its_own_gpu_on_a_host_that_has_one(
    gpus, local_rank, expected
):
    settings = device_env(
        {}, local_rank=local_rank, local_world_size=4, gpus=gpus, cpus=8, isolate_gpus=True
    )
    assert settings.get("CUDA_VISIBLE_DEVICES") == expected


@pytest.mark.parametrize(
    ("workers", "count", "gpus", "cpus", "slots"),
    [
        (3, "gpu", 8, 16, 3),  # a number given is the number
        (None, "gpu", 4, 16, 4),
        (None, "gpu", 0, 16, 0),  # no GPU: 0 tells the launcher, never the CPU count
        (None, "cpu", 4, 16, 16),
        (None, "auto", 4, 16, 4),  # auto: the GPUs where there are some
        (None, "auto", 0, 16, 16),  # else the cores
    ],
)
def test_rule_a_hosts_worker_count_is_the_number_given_or_what_it_counts(
    workers, count, gpus, cpus, slots
):
    assert count_slots(workers, count, gpus, cpus) == slots


@pytest.mark.parametrize(
    ("cpus", "workers", "threads"),
    [(8, 1, "8"), (8, 0, "8"), (8, 2, "4"), (8, 3, "2"), (1, 4, "1")],
)
def test_rule_a_hosts_cores_are_shared_among_its_workers_at_least_one_each(cpus, workers, threads):
    settings = device_env({}, local_rank=0, local_world_size=workers, gpus=0, cpus=cpus)
    assert settings == {"OMP_NUM_THREADS": threads}


@pytest.mark.parametrize(
    ("gpus", "local_rank", "isolated", "expected"),
    [
        (0, 0, False, None),
        (-1, 0, False, None),
        (1, 0, False, 0),
        (1, 2, False, 0),
        (1, 2, True, 0),
        (3, 4, False, 1),
        (3, 4, True, 0),
    ],
)
def test_rule_a_worker_uses_its_gpu_by_local_rank_or_cuda_0_when_isolated(
    gpus, local_rank, isolated, expected
):
    assert cuda_device(local_rank=local_rank, gpus=gpus, isolated=isolated) == expected


# -- the launch state (torchrunx/launcher/state/state.py) ------------------------------------------


def launch(
    hosts: int = 2,
    workers: int = 2,
    *,
    attempt: int = 0,
    reasons: tuple[str, ...] = (),
    ready_at: float = 101.0,
    **fields,
) -> LaunchState:
    """A launch whose agents said hello (at 101, started at 100, all in at ``ready_at``) and
    got their specs; ``attempt`` restarts before (``reasons``: those recorded, in order)."""
    agents = [AgentRecord(i, HostSlots(f"node{i}", workers), "ssh") for i in range(hosts)]
    state = LaunchState(agents, started=100.0, **{"agent_timeout": 30.0, **fields})
    for agent in agents:
        state.agent_table.agent_hello(agent, agent.index, hello(agent.index, workers), 101.0)
    state.agent_table.agents_ready(ready_at)
    state.start_run(ready_at, warm=False)
    state.run_workers(fresh=True)
    assign_all(state, workers)
    for restart in range(attempt):
        restart_workers(state, workers, reasons[restart] if restart < len(reasons) else None)
    return state


def assign_all(state: LaunchState, workers: int) -> None:
    """Every agent gets its spec of this attempt (``workers`` each)."""
    for agent in state.agents:
        state.current.assign(agent, spec(agent.index, workers, len(state.agents)))


def restart_workers(state: LaunchState, workers: int, reason: str | None = None) -> None:
    """A restart as the launch makes it: the workers stop, why is recorded (unless ``None``),
    the next attempt gets new specs."""
    state.begin_stop(restart=True)
    if reason is not None:
        state.record_restart(reason)
    state.next_attempt()
    assign_all(state, workers)


def running(hosts: int = 2, workers: int = 2, **fields) -> LaunchState:
    """Also every rank connected (conn 100 + rank, pid 2000 + rank)."""
    state = launch(hosts, workers, **fields)
    for rank in state.ranks:
        state.current.worker_hello(rank, 100 + rank.rank, 2000 + rank.rank)
    return state


def without_time(event: object) -> dict:
    return {k: v for k, v in vars(event).items() if k != "time"}


def test_rule_a_rank_moves_with_an_event_naming_it_its_host_and_the_attempt():
    state = launch(attempt=2)
    (event,) = state.current.move_rank(state.ranks[3], WorkerState.HEALTHY)
    assert without_time(event) == {
        "rank": 3,
        "host_index": 1,
        "hostname": "node1",
        "local_rank": 1,
        "attempt": 2,
        "old": WorkerState.INIT,
        "new": WorkerState.HEALTHY,
    }


def test_rule_the_launch_runs_and_is_healthy_again_only_once_every_worker_runs():
    state = launch(1, 2)
    state.current.add_fault("exception", ValueError("x"), 1.0, rank=state.ranks[0])  # degraded
    restart_workers(state, 2, "ValueError: x")
    state.current.worker_hello(state.ranks[0], 100, 2000)
    state.current.worker_result(
        state.ranks[0], WorkerResult(0), [bytearray()], 1.0
    )  # still running
    assert state.phase is Phase.RESTARTING and state.progress.degraded is True
    state.current.worker_hello(state.ranks[1], 101, 2001)
    assert state.phase is Phase.RUNNING and state.progress.degraded is False


def test_rule_a_fault_is_recorded_as_it_happened_and_in_the_order_learnt():
    state = running()
    state.begin_stop(restart=False)
    error = ValueError("bad")
    state.current.add_fault("agent", AgentFailedError("node1", "gone"), 5.0, host_index=1)
    events = state.current.add_fault("exception", error, 3.0, rank=state.ranks[2])
    assert state.faults[1] == Fault("exception", error, 3.0, 1, 2, 1, while_stopping=True)
    assert state.faults[0].while_stopping is True and state.faults[0].host_index == 1
    assert state.progress.degraded is True
    changed, failed = events
    assert changed.new is WorkerState.FAILED
    assert isinstance(failed, WorkerFailed)
    assert without_time(failed) == {
        "rank": 2,
        "host_index": 1,
        "hostname": "node1",
        "local_rank": 0,
        "attempt": 0,
        "reason": "ValueError: bad",
        "traceback": None,  # raised here, not in a worker
    }
    # A worker's exception carries the worker's traceback (its cause), and so does the event.
    from torchrunx.errors import RemoteTraceback

    raised = ValueError("in the worker")
    raised.__cause__ = RemoteTraceback("Traceback (most recent call last):\nValueError: x\n")
    _, from_worker = state.current.add_fault("exception", raised, 4.0, rank=state.ranks[0])
    assert isinstance(from_worker, WorkerFailed)
    assert from_worker.traceback == "Traceback (most recent call last):\nValueError: x\n"


def test_rule_a_fault_before_the_launch_stops_is_not_a_consequence_of_stopping():
    state = running()
    state.current.add_fault("agent", AgentFailedError("node0", "gone"), 5.0, host_index=0)
    assert state.faults[0].while_stopping is False


def test_rule_a_fault_of_a_rank_that_already_ended_is_kept_without_an_event():
    state = running()
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray()], 1.0)
    assert state.current.add_fault("death", ValueError("late"), 1.0, rank=state.ranks[0]) == []
    assert len(state.faults) == 1 and state.ranks[0].state is WorkerState.SUCCEEDED


def test_rule_a_kept_worker_that_dies_between_runs_is_reported_failed():
    state = running(1, 1, keep_workers=True)
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray()], 1.0)
    state.keep_workers_for_next_call()
    (failed,) = state.current.add_fault("death", ValueError("died"), 1.0, rank=state.ranks[0])
    assert isinstance(failed, WorkerFailed) and failed.rank == 0 and failed.reason
    assert state.ranks[0].state is WorkerState.SUCCEEDED  # a final state never changes


def test_rule_an_agents_hello_records_its_port_its_start_time_and_says_so():
    agents = [AgentRecord(0, HostSlots("node0", 2), "ssh")]
    state = LaunchState(agents, agent_timeout=30.0, started=100.0)
    (event,) = state.agent_table.agent_hello(agents[0], 7, hello(0, slots=3, gpus=1), 102.5)
    assert agents[0].free_port == 29500 and agents[0].started_after == 2.5
    assert agents[0].conn == 7 and agents[0].last_heard == 102.5
    assert without_time(event) == {
        "host_index": 0,
        "hostname": "node0",
        "pid": 1000,
        "workers": 3,
        "start_seconds": 2.5,
        "gpus": 1,
    }


def test_rule_forked_workers_are_recorded_and_announced_with_their_global_ranks():
    state = launch(2, 2, attempt=1)
    state.current.worker_hello(
        state.ranks[3], 103, 77
    )  # its hello came first: the pid it gave stays
    agent = state.agents[1]
    (event,) = state.current.workers_forked(agent, WorkersStarted((31, 32)))
    assert agent.pids == (31, 32) and agent.forked is True
    assert [r.pid for r in state.ranks] == [0, 0, 31, 77]
    assert without_time(event) == {
        "host_index": 1,
        "hostname": "node1",
        "attempt": 1,
        "ranks": (2, 3),
        "pids": (31, 32),
        "backend": "gloo",
    }


def test_rule_workers_forked_before_a_spec_are_noted_without_an_event():
    agents = [AgentRecord(0, HostSlots("node0", 2), "ssh")]
    state = LaunchState(agents, agent_timeout=30.0, started=0.0)
    assert state.current.workers_forked(agents[0], WorkersStarted((5,))) == []
    assert agents[0].pids == (5,) and agents[0].forked is True


def test_rule_an_agent_process_that_ends_before_its_connection_waits_to_be_judged():
    state = running()
    agent = state.agents[1]
    assert state.agent_table.agent_exited(agent, 3, now=50.0) is False
    assert agent.exited is True and agent.exit_status == 3
    assert agent.judge_by == 50.0 + OUTCOME_WAIT
    assert state.next_due() == 50.0 + OUTCOME_WAIT
    assert state.due(50.0 + OUTCOME_WAIT - 0.01) == ([], [])
    assert state.due(50.0 + OUTCOME_WAIT) == ([agent], [])  # due at that very time
    state.agent_table.agent_judged(agent)
    assert state.due(99.0) == ([], []) and state.next_due() is None


def test_rule_an_agent_process_that_ends_after_its_connection_is_judged_at_once():
    state = running()
    agent = state.agents[0]
    assert state.agent_table.agent_conn_closed(agent) is True and agent.conn_closed is True
    assert state.agent_table.agent_exited(agent, 1, now=50.0) is True and agent.judge_by is None


def test_rule_a_spec_ends_the_wait_between_runs_and_numbers_local_ranks():
    state = kept(2, 3)  # between runs (the kept workers' ranks stay)
    state.current.assign(state.agents[0], spec(0, 3, 2))
    assert state.progress.between_runs is False
    assert [r.local_rank for r in state.ranks] == [0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_rule_a_worker_beyond_its_agents_ranks_is_no_rank():
    state = launch(2, 2)
    assert state.current.rank_of(state.agents[1], 1) is state.ranks[3]
    assert state.current.rank_of(state.agents[1], 2) is None
    assert state.current.hello_rank(WorkerHello(4, 0, 1)) is None
    assert state.current.hello_rank(WorkerHello(3, 1, 1)) is state.ranks[3]


def test_rule_the_run_is_over_once_each_rank_returned_once():
    state = running(1, 2, keep_workers=True)
    result = WorkerResult(0)
    state.current.worker_result(state.ranks[0], result, [bytearray()], 1.0)
    assert not state.finished
    state.current.worker_result(
        state.ranks[0], result, [bytearray()], 2.0
    )  # a second one: not twice
    assert not state.finished
    state.current.worker_result(state.ranks[1], result, [bytearray()], 3.0)
    assert state.finished


def test_rule_an_exit_settles_at_once_when_the_connection_ended_or_the_outcome_came():
    state = running()
    assert state.current.worker_conn_closed(state.ranks[0]) is False  # its exit is not known yet
    assert state.ranks[0].conn_closed is True
    assert state.current.worker_exited(state.ranks[0], WorkerExited(0, 2000, 1, None), 5.0) is True
    state.current.worker_result(state.ranks[1], WorkerResult(1), [bytearray()], 1.0)
    assert state.current.worker_exited(state.ranks[1], WorkerExited(1, 2001, 0, None), 5.0) is True
    assert state.current.worker_exited(state.ranks[2], WorkerExited(0, 2002, 0, None), 5.0) is False
    assert state.ranks[2].settle_by == 5.0 + OUTCOME_WAIT


def test_rule_a_rank_settles_once_and_its_death_names_where_and_how_it_ended():
    state = running()
    rank = state.ranks[3]
    state.current.worker_exited(rank, WorkerExited(1, 2003, 7, None, at=4.5), 5.0)
    assert state.current.alarm
    events = state.current.settle(rank)
    assert len(events) == 2 and rank.settled is True and rank.settle_by is None
    assert not state.current.alarm and state.due(99.0) == ([], []) and state.next_due() is None
    (fault,) = state.faults
    assert fault.kind == "death" and fault.at == 4.5 and fault.rank == 3
    error = fault.error
    assert isinstance(error, WorkerFailedError)
    assert (error.hostname, error.local_rank, error.rank, error.pid) == ("node1", 1, 3, 2003)
    assert (error.exitcode, error.signal) == (7, None)
    assert state.current.settle(rank) == [] and len(state.faults) == 1  # not twice


def test_rule_a_rank_whose_exit_is_unknown_does_not_settle():
    state = running()
    assert state.current.settle(state.ranks[0]) == []
    assert state.ranks[0].settled is False and state.faults == []


def test_rule_a_stale_rank_record_is_never_due():
    state = running(1, 2)
    old = state.ranks[1]
    state.begin_stop(restart=True)
    state.next_attempt()
    state.current.assign(state.agents[0], spec(0, 1, 1))  # one rank this time
    state.current.worker_exited(old, WorkerExited(1, 2001, 1, None), 5.0)
    assert state.due(99.0) == ([], [])
    assert state.next_due() is None


def test_rule_a_watchdog_counts_only_while_the_rank_runs():
    state = running()
    assert state.current.worker_timed_out(state.ranks[0]) is True
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray()], 1.0)
    assert state.current.worker_timed_out(state.ranks[0]) is False


def test_rule_silence_is_measured_from_the_last_word_and_over_the_limit_only():
    state = launch(3, 1, agent_timeout=10.0, start_timeout=10.0)
    for agent in state.agents:
        state.agent_table.heard_from(agent, 100.0)
        state.current.workers_forked(agent, WorkersStarted((2000 + agent.index,)))
    state.agent_table.move_agent(
        state.agents[0], AgentState.DONE
    )  # over: never silent, and not the last
    state.agent_table.replace_agent(2)  # its new agent never said hello: not silent either
    assert state.agent_table.silent_agents(110.0) == []  # exactly the limit
    assert state.agent_table.silent_agents(110.5) == [(state.agents[1], 10.5)]
    # With slack: those within that many seconds of the limit too (silent together).
    assert state.agent_table.silent_agents(108.0, slack=2.0) == []  # exactly limit - slack
    assert state.agent_table.silent_agents(108.5, slack=2.0) == [(state.agents[1], 8.5)]


def test_rule_an_agent_without_hello_is_never_silent():
    agents = [AgentRecord(0, HostSlots("node0", 1), "ssh")]
    state = LaunchState(agents, started=0.0, agent_timeout=1.0, start_timeout=1.0)
    assert state.agent_table.silent_agents(1e9) == []


def test_rule_unready_agents_are_those_that_ended_or_do_not_wait():
    state = launch(3, 1)
    state.agent_table.workers_ended(state.agents[0], WorkersEnded(29600, attempt=0))
    state.agent_table.workers_ended(state.agents[2], WorkersEnded(29600, attempt=0))
    state.agent_table.move_agent(state.agents[2], AgentState.FAILED)
    assert state.agent_table.unready_agents() == [state.agents[1], state.agents[2]]


def kept(hosts: int = 1, workers: int = 2) -> LaunchState:
    state = running(hosts, workers, keep_workers=True)
    for rank in state.ranks:
        state.current.worker_result(rank, WorkerResult(rank.rank), [bytearray()], 1.0)
    state.results_in(110.0)
    state.succeeded()
    state.after_run(keep_workers=True)  # the workers stay for the next call
    return state


def rank_1_never_connected(state: LaunchState) -> None:
    """Robustness: the next run's workers are kept, but rank 1's moved on without its own
    connection (no hello: moved by hand, which no message does)."""
    state.begin_stop(restart=True)
    state.next_attempt(keep_ready=True)
    assign_all(state, 2)
    state.current.worker_hello(state.ranks[0], 100, 2000)
    state.current.move_rank(state.ranks[1], WorkerState.HEALTHY)
    for rank in state.ranks:
        state.current.worker_result(rank, WorkerResult(rank.rank), [bytearray()], 2.0)
    state.succeeded()
    state.after_run(keep_workers=True)


def rank_1_failed_yet_kept(state: LaunchState) -> None:
    """Robustness: the workers are kept though rank 1 failed before it returned (after_run
    keeps none after a failure: kept by hand)."""
    state.next_call()
    state.current.worker_failed(state.ranks[1], "hang", ValueError("stuck"), 2.0)
    for rank in state.ranks:
        state.current.worker_result(rank, WorkerResult(rank.rank), [bytearray()], 3.0)
    state.keep_workers_for_next_call()


def test_rule_after_a_failed_warm_run_with_keep_workers_no_worker_is_kept():
    state = running(1, 2, keep_workers=True)
    state.current.worker_failed(state.ranks[1], "exception", ValueError("boom"), 2.0)
    for rank in state.ranks:  # every rank answered: the run is over, and it failed
        state.current.worker_result(rank, WorkerResult(rank.rank), [bytearray()], 3.0)
    assert state.finished and state.failed
    state.begin_failure()
    state.failed_run()
    attempt = state.attempt
    state.after_run(keep_workers=True)  # as the warm launcher's _after does, failed or not
    assert state.progress.kept_workers is False and state.current.kept_workers_well() is False
    assert state.ranks == [] and state.faults == [] and state.attempt == attempt + 1
    assert state.progress.between_runs is True  # the agents wait for the next run's spec


def test_rule_kept_workers_wait_between_runs():
    state = kept()
    assert state.progress.kept_workers is True and state.progress.between_runs is True
    assert state.current.kept_workers_well() is True


@pytest.mark.parametrize(
    "spoil",
    [
        rank_1_never_connected,
        lambda s: s.current.worker_conn_closed(s.ranks[1]),
        lambda s: s.current.worker_exited(s.ranks[1], WorkerExited(1, 2001, 0, None), 5.0),
        rank_1_failed_yet_kept,
        lambda s: s.agent_table.move_agent(s.agents[0], AgentState.LOST),
        lambda s: s.next_call(),  # they took a call: kept no more
    ],
)
def test_rule_kept_workers_take_a_call_only_if_each_is_alive_connected_and_its_agent_well(
    spoil,
):
    state = kept()
    spoil(state)
    assert not state.current.kept_workers_well()


def test_rule_the_next_call_runs_the_same_ranks_again_from_a_clean_slate():
    state = kept(1, 2)
    state.begin_stop(restart=True)
    state.current.add_fault("agent", AgentFailedError("node0", "x"), 1.0, host_index=0)
    state.current.add_stacks(state.agents[0], {0: "a stack"})
    old = state.ranks
    state.next_call()
    assert state.progress.kept_workers is False and state.progress.between_runs is False
    assert state.progress.stopping is False and state.faults == [] and state.current.stacks == {}
    assert [(r.rank, r.host_index, r.local_rank, r.state, r.conn, r.pid) for r in state.ranks] == [
        (0, 0, 0, WorkerState.HEALTHY, 100, 2000),
        (1, 0, 1, WorkerState.HEALTHY, 101, 2001),
    ]
    assert all(new is not was for new, was in zip(state.ranks, old, strict=True))
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray()], 2.0)
    assert not state.finished  # one result of two
    state.current.worker_exited(state.ranks[1], WorkerExited(1, 2001, 1, None), 3.0)
    assert state.current.alarm
    state.current.worker_result(state.ranks[1], WorkerResult(1), [bytearray()], 2.0)
    assert state.finished


def test_rule_the_next_attempt_forgets_the_last_ones_ranks_faults_and_counts():
    state = running(2, 1, attempt=1)
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray()], 1.0)
    state.keep_workers_for_next_call()
    state.begin_stop(restart=True)  # the kept workers stop: a new attempt starts
    state.current.add_stacks(state.agents[0], {0: "a stack"})
    state.agent_table.workers_ended(state.agents[0], WorkersEnded(29600, attempt=1))
    state.next_attempt()
    assert (
        state.attempt == 2
        and state.progress.kept_workers is False
        and state.progress.stopping is False
    )
    assert state.ranks == [] and state.faults == [] and state.current.stacks == {}
    assert [a.ready for a in state.agents] == [False, False]
    assert [a.pids for a in state.agents] == [(), ()]
    for agent in state.agents:
        state.current.assign(agent, spec(agent.index, 1, 2))
    state.current.worker_hello(state.ranks[0], 100, 2000)
    assert state.phase is Phase.RESTARTING  # one of two workers runs
    state.current.worker_hello(state.ranks[1], 101, 2001)
    assert state.phase is Phase.RUNNING
    state.current.worker_result(state.ranks[1], WorkerResult(1), [bytearray()], 1.0)
    state.agent_table.workers_ended(state.agents[1], WorkersEnded(29600, attempt=2))
    assert not state.finished  # rank 0 has not returned, and agent 0 does not wait yet
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray()], 1.0)
    assert not state.finished  # agent 0 does not wait yet
    state.agent_table.workers_ended(state.agents[0], WorkersEnded(29600, attempt=2))
    assert state.finished


def test_rule_warm_agents_that_wait_for_a_spec_still_do_in_the_next_attempt():
    state = running(2, 1)
    state.agent_table.workers_ended(state.agents[0], WorkersEnded(29600, attempt=0))
    state.next_attempt(keep_ready=True)
    assert [a.ready for a in state.agents] == [True, False]


def test_rule_health_lists_every_agent_and_worker_as_they_are():
    state = launch(2, 1, attempt=1)
    state.current.worker_hello(state.ranks[0], 100, 2000)
    state.current.worker_hello(state.ranks[1], 101, 0)  # its pid is not known
    state.agent_table.heard_from(state.agents[0], 110.12345)
    state.agent_table.replace_agent(
        1
    )  # robustness: its new agent runs, moved by hand without a hello
    state.agent_table.move_agent(state.agents[1], AgentState.RUNNING)
    report = state.health(112.5, max_restarts=3, cause=None)
    assert report == HealthReport(
        healthy=True,
        launch_state=Phase.RUNNING.value,
        attempt=1,
        restarts=1,
        max_restarts=3,
        uptime=12.5,
        agents=(
            AgentHealth(0, "node0", AgentState.RUNNING, 2.377),
            AgentHealth(1, "node1", AgentState.RUNNING, None),
        ),
        workers=(
            WorkerHealth(0, 0, "node0", 0, 2000, WorkerState.HEALTHY),
            WorkerHealth(1, 1, "node1", 0, None, WorkerState.HEALTHY),
        ),
        failures=(),
    )


def test_rule_health_names_this_attempts_cause_unless_it_restarts():
    state = running(1, 1, attempt=1, reasons=("ValueError: first",))
    report = state.health(101.0, max_restarts=3, cause="ValueError: second")
    assert report.healthy is False
    assert report.failures == ("attempt 0: ValueError: first", "attempt 1: ValueError: second")
    state.begin_stop(restart=True)  # the second failure restarts too
    report = state.health(101.0, max_restarts=3, cause="ValueError: second")
    assert report.failures == ("attempt 0: ValueError: first",)


def test_rule_a_failed_agent_makes_the_launch_unhealthy_even_once_recovered():
    state = running(2, 1)
    state.agent_table.move_agent(state.agents[1], AgentState.FAILED)
    state.begin_failure()  # a warm run failed, and the agents wait for the next
    state.failed_run()
    state.after_run(keep_workers=False)  # recovered: degraded no more
    assert state.health(101.0, max_restarts=0, cause=None).healthy is False


def test_rule_timings_are_read_from_each_rank_and_transfer_is_never_negative():
    state = running(3, 1, ready_at=101.5)
    state.results_in(109.0)
    sent = WorkerResult(0, init_seconds=0.5, function_seconds=2.0, pickle_seconds=0.25, sent_at=10)
    late = WorkerResult(1, init_seconds=0.7, function_seconds=3.0, pickle_seconds=0.5, sent_at=20)
    state.current.worker_result(state.ranks[0], sent, [bytearray()], 10.75)  # received 0.75 s later
    state.current.worker_result(
        state.ranks[1], late, [bytearray()], 19.0
    )  # clocks apart: not negative
    assert state.timings((0.1, 0.2, 0.3)) == LaunchTimings(
        total=9.0,
        agents_started=1.5,
        connect=(0.1, 0.2, 0.3),
        agent_start=(1.0, 1.0, 1.0),
        process_group_init=(0.5, 0.7, 0.0),
        function=(2.0, 3.0, 0.0),
        result_transfer=(1.0, 0.5, 0.0),
    )


# -- SLURM allocations and hostfiles (torchrunx/hosts/hostlists.py) ------------------------------


@pytest.fixture
def no_scontrol(monkeypatch):
    """Node lists are expanded by torchrunx's own parser: no ``scontrol`` process."""
    monkeypatch.setattr(hostlists.shutil, "which", lambda _name: None)
    hostlists._expand_hostnames.cache_clear()
    yield
    hostlists._expand_hostnames.cache_clear()


ALLOCATION = {
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NODELIST": "cn[01-03]",
    "SLURM_TASKS_PER_NODE": "2(x2),1",
    "SLURM_JOB_CPUS_PER_NODE": "8(x2),4",
}


@pytest.mark.parametrize(
    ("environ", "inside"),
    [
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a"}, True),
        ({"SLURM_JOBID": "1", "SLURM_NODELIST": "a"}, True),  # the older names
        ({"SLURM_JOB_ID": "1", "SLURM_NODELIST": "a"}, True),
        ({"SLURM_JOBID": "1", "SLURM_JOB_NODELIST": "a"}, True),
        ({"SLURM_JOB_ID": "1"}, False),  # a job without a node list
        ({"SLURM_JOB_NODELIST": "a"}, False),
        ({"SLURM_JOB_ID": "", "SLURM_JOB_NODELIST": "a"}, False),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": ""}, False),
        ({}, False),
    ],
)
def test_rule_an_allocation_is_a_job_id_and_a_node_list(environ, inside):
    assert hostlists.in_slurm_allocation(environ) is inside


def test_rule_the_allocation_is_read_from_this_process_by_default(monkeypatch, no_scontrol):
    for name in ("SLURM_JOBID", "SLURM_NODELIST", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in ALLOCATION.items():
        monkeypatch.setenv(name, value)
    assert hostlists.in_slurm_allocation() is True
    assert hostlists.slurm_allocation().nodes == ("cn01", "cn02", "cn03")
    monkeypatch.delenv("SLURM_JOB_ID")
    assert hostlists.in_slurm_allocation() is False


def test_rule_an_allocation_is_every_fact_slurm_gives_in_its_order(no_scontrol):
    allocation = hostlists.slurm_allocation(ALLOCATION)
    assert allocation == hostlists.SlurmAllocation(
        job_id="42",
        nodes=("cn01", "cn02", "cn03"),
        tasks_per_node=(2, 2, 1),
        gpus_per_node=None,
        cpus_per_node=(8, 8, 4),
    )
    assert [allocation.slots(n) for n in allocation.nodes] == [2, 2, 1]
    assert [allocation.cpus(n) for n in allocation.nodes] == [8, 8, 4]
    assert allocation.slots("elsewhere") is None and allocation.cpus("elsewhere") is None


def test_rule_the_older_variable_names_give_the_same_allocation(no_scontrol):
    environ = {"SLURM_JOBID": "7", "SLURM_NODELIST": "a,b"}
    allocation = hostlists.slurm_allocation(environ)
    assert (allocation.job_id, allocation.nodes) == ("7", ("a", "b"))
    assert allocation.tasks_per_node is None and allocation.cpus_per_node is None
    assert allocation.slots("a") is None and allocation.cpus("a") is None


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        ({"SLURM_GPUS_PER_NODE": "4"}, 4),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, 4),
        ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, 3),  # several types: summed
        ({"SLURM_GPUS_PER_NODE": "gpu:a100:2"}, 2),  # the count is after the last ':'
        ({"SLURM_GPUS_PER_NODE": "0"}, None),
        ({"SLURM_GPUS_PER_NODE": "  "}, None),
        ({"SLURM_GPUS_ON_NODE": "2"}, 2),
        ({"SLURM_GPUS_PER_NODE": "3", "SLURM_GPUS_ON_NODE": "2"}, 3),  # per node comes first
        ({"SLURM_GPUS_PER_NODE": "", "SLURM_GPUS_ON_NODE": "2"}, 2),
    ],
)
def test_rule_gpus_per_node_win_over_tasks_and_are_read_in_every_form(gpus, expected, no_scontrol):
    allocation = hostlists.slurm_allocation({**ALLOCATION, **gpus})
    assert allocation.gpus_per_node == expected
    assert allocation.slots("cn03") == (expected or 1)


@pytest.mark.parametrize("name", ["SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"])
def test_rule_a_gpu_count_that_cannot_be_read_is_refused_naming_its_variable(name, no_scontrol):
    with pytest.raises(ValueError, match=f"^cannot read a GPU count from {name}='a100:x'$"):
        hostlists.slurm_allocation({**ALLOCATION, name: "a100:x"})


@pytest.mark.parametrize("name", ["SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE"])
def test_rule_per_node_counts_must_cover_every_node(name, no_scontrol):
    message = f"{name}='2(x2)' describes 2 nodes but the allocation has 3"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hostlists.slurm_allocation({**ALLOCATION, name: "2(x2)"})


def test_rule_outside_an_allocation_the_error_names_the_setting_that_needs_one():
    message = (
        "agent_start='srun' but no SLURM allocation was detected (SLURM_JOB_ID and "
        "SLURM_JOB_NODELIST are not set); run inside sbatch or salloc, or give the hosts and "
        "workers per host explicitly"
    )
    with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
        hostlists.slurm_allocation({}, what="agent_start='srun'")
    with pytest.raises(RuntimeError, match=r"^hostnames='slurm' but no SLURM allocation"):
        hostlists.slurm_allocation({})


def test_rule_what_slurm_cannot_give_is_a_slurm_error_and_still_a_runtime_error():
    with pytest.raises(SlurmError) as raised:
        hostlists.slurm_allocation({})
    assert isinstance(raised.value, TorchrunxError)
    assert isinstance(raised.value, RuntimeError)  # what callers caught before it had a class
    allocation = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1", "SLURM_TASKS_PER_NODE": "1"}
    with pytest.raises(SlurmError, match=r"\['other'\] are not nodes of SLURM job 7"):
        hosts.resolve_hosts(["other"], "slurm", allocation)


def test_rule_a_failed_exchange_of_shipped_code_is_a_torchrunx_error():
    assert issubclass(ShipError, TorchrunxError)
    assert not issubclass(ShipError, RuntimeError)


def test_rule_without_scontrol_node_lists_are_expanded_by_torchrunx(no_scontrol):
    assert hostlists.expand_hostnames("gpu-[01-02],cpu1") == ["gpu-01", "gpu-02", "cpu1"]


def test_rule_balanced_nested_brackets_are_not_called_unbalanced():
    assert hostlists.expand_nodelist("a[[1]]") == ["a1"]  # brackets are counted, not paired


def test_rule_a_hostfile_comment_starts_at_the_first_hash():
    assert hostlists.parse_hostfile("a # one # two\nb slots=2 # c slots=9") == [
        HostSlots("a", None),
        HostSlots("b", 2),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=4=5", "<hostfile>, line 1: slots must be a positive integer, got '4=5'"),
        (
            "a=b slots=1",
            "line 1 of <hostfile> contains an invalid host name 'a=b': it contains '='",
        ),
        ("\nx/y", "line 2 of <hostfile> contains an invalid host name 'x/y': a host name cannot"),
        ("a=b", "line 1 of <hostfile> contains an invalid host name 'a=b': it contains '='"),
    ],
)
def test_rule_a_hostfile_line_that_is_no_host_is_refused_naming_its_line(text, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        hostlists.parse_hostfile(text)


def test_rule_a_hostfiles_errors_name_its_path(tmp_path):
    path = tmp_path / "hosts.txt"
    path.write_text("good\nbad/name\n")
    with pytest.raises(
        ValueError, match=f"^line 2 of {re.escape(str(path))} contains .* 'bad/name'"
    ):
        hostlists.read_hostfile(path)
    path.write_text("a slots=2\n")
    assert hostlists.read_hostfile(str(path)) == [HostSlots("a", 2)]
    with pytest.raises(
        ValueError, match=f"^cannot read hostfile {re.escape(repr(str(tmp_path)))}: "
    ):
        hostlists.read_hostfile(tmp_path)  # a folder


def test_rule_a_host_listed_with_and_without_slots_has_its_workers_counted_by_its_agent():
    assert hostlists.parse_hostfile("a slots=2\nb slots=1\na\nb slots=3\n") == [
        HostSlots("a", None),
        HostSlots("b", 4),
    ]
    assert hostlists.parse_hostfile("a\na slots=2\n") == [HostSlots("a", None)]


@pytest.mark.parametrize("slots", ["0", "00", "-1", "", "2.5"])
def test_rule_a_hostfiles_slots_are_a_positive_integer(slots):
    message = f"<hostfile>, line 2: slots must be a positive integer, got {slots!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hostlists.parse_hostfile(f"a slots=1\nb slots={slots}\n")
    assert hostlists.parse_hostfile("a slots=01") == [HostSlots("a", 1)]


def test_rule_three_brackets_expand_in_slurms_order_last_fastest_then_the_first():
    assert hostlists.expand_nodelist("a[1-2]b[1-2]c[1-2]") == [
        *("a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2"),
        *("a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"),
    ]
    assert hostlists.expand_nodelist("r[1-2]-n[01-02]") == ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]


def test_rule_per_node_counts_for_more_nodes_than_the_allocation_are_refused(no_scontrol):
    message = "SLURM_TASKS_PER_NODE='2(x4)' describes 4 nodes but the allocation has 3"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hostlists.slurm_allocation({**ALLOCATION, "SLURM_TASKS_PER_NODE": "2(x4)"})


@pytest.mark.parametrize("name", ["...", "...."])
def test_rule_a_name_of_dots_only_is_no_host_name(name):
    message = f"hostnames contains an invalid host name {name!r}: it is not a host name"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hosts.check_hostname(name)
    hosts.check_hostname(f"{name}a")  # dots and a letter: a name (an alias, say)


# -- host names (the checks of torchrunx/launcher/settings/resolve.py) ---------------------------------------


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "give each host as a non-empty string (a name or an address)"),
        (5, "give each host as a non-empty string (a name or an address)"),
        (None, "give each host as a non-empty string (a name or an address)"),
        ("a b", "it contains whitespace or control characters; give one host per entry"),
        ("a\x00", "it contains whitespace or control characters; give one host per entry"),
        (
            "a/b",
            (
                "a host name cannot contain '/' (it also names the host's log file); to read "
                "hosts from a hostfile, give its path alone: hostnames='PATH' or ['PATH']"
            ),
        ),
        ("-oProxyCommand=x", "a host name cannot start with '-'"),
        (".", "it is not a host name"),
        ("..", "it is not a host name"),
    ],
)
def test_rule_what_cannot_be_a_host_name_is_refused_saying_why(name, reason):
    message = f"hostnames contains an invalid host name {name!r}: {reason}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hosts.check_hostname(name)


@pytest.mark.parametrize(
    "name",
    ["X", "XX", "x.y", "user@host", "fe80::1%eth0", "10.0.0.1", "[::1]", "gpu_box", "a-b.c:2"],
)
def test_rule_names_addresses_and_aliases_are_host_names(name):
    hosts.check_hostname(name)


SHELL_SYNTAX = {  # a hostile name without whitespace: the characters it is refused for
    "n1$(touch${IFS}x)": "'$', '(', ')', '{', '}'",
    "n1`touch${IFS}x`": "'$', '`', '{', '}'",
    "n1;id": "';'",
    "n1|id": "'|'",
    "n1&&id": "'&'",
    "n1'x": '"\'"',
    'n1"x': "'\"'",
    "n1>x": "'>'",
    "n1\\x": "'\\\\'",
    "n1,n2": "','",
    "n1*": "'*'",
    "n1=x": "'='",
    "bücher": "'ü'",
}
WHITESPACE = ["n1 id", "n1\nid", "n1\tid", "n1;\nid"]
HOSTILE = [*SHELL_SYNTAX, *WHITESPACE]


@pytest.mark.parametrize(("name", "characters"), SHELL_SYNTAX.items())
def test_rule_a_name_with_shell_syntax_is_refused_naming_the_characters(name, characters):
    message = (
        f"hostnames contains an invalid host name {name!r}: it contains {characters}, which no "
        "host name has: a host name holds only ASCII letters, digits and . - _ : % @ [ ] "
        "(shell syntax is refused, as OpenSSH 9.6 and later refuse it)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hosts.check_hostname(name)


@pytest.mark.parametrize("name", HOSTILE)
def test_rule_a_hostile_name_is_refused_as_an_argument_naming_the_field(name, tmp_path):
    message = f"^hostnames contains an invalid host name {re.escape(repr(name))}: "
    for given in ([name], ["node1", name], (name,)):
        with pytest.raises(ValueError, match=message):
            hosts.check_hostnames(given)
        with pytest.raises(ValueError, match=message):
            trx.Launcher(hostnames=list(given), workers_per_host=1).validate()
        with pytest.raises(ValueError, match=message):
            hosts.resolve_hosts(given, 1, {})
    spares = f"^spare_hosts contains an invalid host name {re.escape(repr(name))}: "
    with pytest.raises(ValueError, match=spares):
        trx.Launcher(
            hostnames=["node1"], spare_hosts=[name], max_restarts=1, restart_on=["hosts"]
        ).validate()
    with pytest.raises(ValueError, match=spares):
        hosts.resolve_hosts([name], 1, {}, field="spare_hosts")


@pytest.mark.parametrize("name", SHELL_SYNTAX)  # whitespace splits a hostfile's line
def test_rule_a_hostile_name_in_a_hostfile_is_refused_naming_the_file_and_line(
    name, tmp_path, monkeypatch
):
    path = tmp_path / "hosts"
    path.write_text(f"node1 slots=2\n# a comment\n{name} slots=1\n")
    message = (
        f"^line 3 of {re.escape(str(path))} contains an invalid host name {re.escape(repr(name))}: "
    )
    with pytest.raises(ValueError, match=message):
        hostlists.read_hostfile(path)
    for spec in (path, str(path), [str(path)], f"hostfile:{path}"):
        with pytest.raises(ValueError, match=message):
            hosts.resolve_hosts(spec, "auto", {})  # type: ignore[arg-type]
    monkeypatch.setenv("TORCHRUNX_HOSTFILE", str(path))  # the provider's variable, "auto"
    for spec in ("hostfile", "auto"):
        with pytest.raises(ValueError, match=message):
            hosts.resolve_hosts(spec, "auto", {"TORCHRUNX_HOSTFILE": str(path)})


@pytest.mark.parametrize(
    ("nodelist", "name"),
    [
        ("n[1-2]$(touch${IFS}x)", "n1$(touch${IFS}x)"),
        ("n1,n2`id`", "n2`id`"),
        ("n1,n[2-3];id", "n2;id"),
        ("n1|id", "n1|id"),
        ("n1&&id", "n1&&id"),
        ("n1 n'2", "n'2"),
    ],
)
def test_rule_a_hostile_name_in_a_slurm_node_list_is_refused_naming_the_variable(
    nodelist, name, no_scontrol
):
    for variable, job in (
        ("SLURM_JOB_NODELIST", "SLURM_JOB_ID"),
        ("SLURM_NODELIST", "SLURM_JOBID"),
    ):
        environ = {job: "7", variable: nodelist}
        message = (
            f"^{variable}={re.escape(repr(nodelist))} contains an invalid host name "
            f"{re.escape(repr(name))}: "
        )
        with pytest.raises(ValueError, match=message):
            hostlists.slurm_allocation(environ)
        for hostnames, workers in (("slurm", "auto"), ("auto", "auto"), (["n1"], "slurm")):
            with pytest.raises(ValueError, match=message):
                hosts.resolve_hosts(hostnames, workers, environ)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", SHELL_SYNTAX)
def test_rule_a_hostile_name_from_pbs_or_lsf_is_refused_naming_the_source(name, tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"cn1\ncn1\n{name}\n")
    message = f"^line 3 of the PBS node file {re.escape(repr(str(nodefile)))} contains an invalid host name {re.escape(repr(name))}: "
    with pytest.raises(ValueError, match=message):
        hosts.resolve_hosts("pbs", "auto", {"PBS_JOBID": "1", "PBS_NODEFILE": str(nodefile)})
    with pytest.raises(ValueError, match=message):
        hosts.resolve_hosts("auto", "auto", {"PBS_JOBID": "1", "PBS_NODEFILE": str(nodefile)})
    value = f"hostA 4 {name} 2"
    message = f"^LSB_MCPU_HOSTS={re.escape(repr(value))} contains an invalid host name {re.escape(repr(name))}: "
    with pytest.raises(ValueError, match=message):
        hosts.resolve_hosts("lsf", "auto", {"LSB_JOBID": "1", "LSB_MCPU_HOSTS": value})
    with pytest.raises(ValueError, match=message):
        hosts.resolve_hosts("auto", "auto", {"LSB_JOBID": "1", "LSB_MCPU_HOSTS": value})
    message = f"^hostnames='lsf:{re.escape(value)}' contains an invalid host name "
    with pytest.raises(ValueError, match=message):
        hosts.resolve_hosts(f"lsf:{value}", "auto", {})


class _Provider:
    """A plugin's host provider that hands out whatever names it was given (pure)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def detect(self, environ: object) -> bool:  # noqa: ARG002 (the provider's interface)
        """Always: the provider of ``hostnames="auto"`` here."""
        return True

    def hosts(self, argument: str | None, environ: object) -> list[HostSlots]:  # noqa: ARG002 (as above)
        """The names it was given, one slot each."""
        return [HostSlots(name, 1) for name in self.names]


@pytest.mark.parametrize("name", HOSTILE)
def test_rule_a_hostile_name_from_a_plugin_provider_is_refused_naming_it(name, monkeypatch):
    monkeypatch.setattr(plugins, "_entry_points", lambda _group: {})
    monkeypatch.setattr(plugins, "_LAZY_PROVIDERS", {})
    monkeypatch.setattr(plugins, "_BUILTIN_PROVIDERS", {"mine": _Provider(["ok1", name])})
    for spec, given in (("mine", "mine"), (["mine:x"], "mine:x"), ("auto", "auto")):
        message = (
            f"^the host list of provider 'mine' \\(hostnames={re.escape(repr(given))}\\) "
            f"contains an invalid host name {re.escape(repr(name))}: "
        )
        with pytest.raises(ValueError, match=message):
            hosts.resolve_hosts(spec, "auto", {})  # type: ignore[arg-type]


def test_rule_a_one_entry_list_with_a_slash_is_a_missing_hostfile(tmp_path):
    path = str(tmp_path / "nope")
    message = (
        f"hostfile {path!r} does not exist or is not a file (a one-entry list with '/' names "
        "a hostfile: host names have no '/')"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hosts.check_hostnames([path])
    with pytest.raises(
        ValueError, match=f"^hostfile {re.escape(repr(path))} does not exist or is not a file$"
    ):
        hosts.check_hostnames(path)


def test_rule_a_word_that_is_no_provider_nor_file_lists_the_providers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    providers = ", ".join(plugins.host_provider_names())
    message = (
        f"hostnames='nosuchthing' is neither 'auto', a host provider ({providers}) nor an "
        "existing hostfile; for a single host give a list: hostnames=['nosuchthing']"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hosts.check_hostnames("nosuchthing")


# -- the checks of the Launcher's fields (torchrunx/launcher/launcher.py) ---------------------------


def refused(error: type[Exception], message: str, **fields: object) -> None:
    """``Launcher(**fields).validate()`` raises ``error`` with exactly ``message``."""
    launcher = trx.Launcher(**{"hostnames": ["localhost"], **fields})  # type: ignore[arg-type]
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        launcher.validate()


def test_rule_isolate_gpus_is_a_bool():
    refused(TypeError, "isolate_gpus must be True or False, got 1", isolate_gpus=1)


def test_rule_validate_checks_extra_env_vars_and_log_handlers():
    refused(
        ValueError, "extra_env_vars: the value of A contains a NUL byte", extra_env_vars=("A=\0",)
    )
    refused(
        TypeError,
        'log_handlers must be "auto", None, a list of logging.Handler (with "auto" among them '
        "to keep the default handlers) or a function returning one, got [1]",
        log_handlers=[1],
    )


def test_rule_validate_checks_the_health_port_field():
    with pytest.raises(ValueError, match="70000"):
        trx.Launcher(hostnames=["localhost"], health_check_port=70000).validate()


def test_rule_an_ssh_config_file_must_exist_and_be_readable(tmp_path):
    missing = tmp_path / "nope"
    refused(
        ValueError,
        f"ssh_config_file {str(missing)!r} does not exist or is not readable",
        ssh_config_file=str(missing),
    )
    refused(
        ValueError,
        f"ssh_config_file {str(tmp_path)!r} does not exist or is not readable",
        ssh_config_file=str(tmp_path),  # a folder: readable, but no file
    )


def test_rule_an_ssh_config_is_parsed_once_while_unchanged_and_again_once_changed(
    tmp_path, monkeypatch
):
    import paramiko

    from torchrunx.engines.ssh import read_ssh_config, resolve_ssh_target

    config = tmp_path / "ssh_config"
    config.write_text("Host a\n    Port 2201\n")
    parsed: list[str] = []
    real = paramiko.SSHConfig.from_path
    monkeypatch.setattr(
        paramiko.SSHConfig, "from_path", lambda path: parsed.append(path) or real(path)
    )
    assert [resolve_ssh_target("a", config, 5).port for _ in range(3)] == [2201] * 3
    assert parsed == [str(config)]  # one parse for three hosts' lookups
    config.write_text("Host a\n    Port 2202\n")  # the same size: its times tell the change
    os.utime(config, ns=(0, 0))  # a second write may fall in the clock's same tick
    assert resolve_ssh_target("a", config, 5).port == 2202
    assert len(parsed) == 2
    config.unlink()
    with pytest.raises(ValueError, match="cannot read SSH config file"):
        read_ssh_config(config)


@pytest.mark.parametrize(
    "handlers", [[logging.Handler()], (logging.StreamHandler(),), [], None, "auto", list]
)
def test_rule_log_handlers_are_handlers_a_function_none_or_auto(handlers):
    trx_logs.check_log_fields(handlers)


@pytest.mark.parametrize("handlers", [[1], [logging.Handler(), "x"], "stderr", 5])
def test_rule_anything_else_is_no_log_handlers(handlers):
    with pytest.raises(TypeError, match=r"^log_handlers must be "):
        trx_logs.check_log_fields(handlers, (0,))


@pytest.mark.parametrize("value", [-1, True, 1.5, "2", None])
def test_rule_max_restarts_is_an_integer_from_0(value):
    message = f"max_restarts must be an integer >= 0, got {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        failures_module.check_restarts(value, ())


@pytest.mark.parametrize("restart_on", ["exceptions", {"deaths"}, None])
def test_rule_restart_on_is_a_tuple_or_list(restart_on):
    message = (
        "restart_on must be a tuple of categories ['exceptions', 'deaths', 'timeouts', 'hosts'] "
        f"and/or exception type names, got {restart_on!r}"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        failures_module.check_restarts(0, restart_on)


@pytest.mark.parametrize("entry", ["", "a b", "a-b", "x.y-z", 3, "a.b.c!"])
def test_rule_a_restart_on_entry_is_a_category_or_a_type_name(entry):
    message = (
        f"restart_on entry {entry!r} is neither one of ['exceptions', 'deaths', 'timeouts', "
        "'hosts'] nor an exception type name"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        failures_module.check_restarts(0, [entry])


@pytest.mark.parametrize(
    "restart_on",
    [(), ["deaths", "hosts"], ("ValueError", "my_pkg.errors.Retry_Me", "a.b_c.D2")],
)
def test_rule_categories_and_qualified_type_names_are_accepted(restart_on):
    failures_module.check_restarts(0, restart_on)
    failures_module.check_restarts(3, restart_on)


class Recorder:
    def record(self, event):
        pass


@pytest.mark.parametrize("handlers", [(), [print], (Recorder(),), [Recorder(), print]])
def test_rule_event_handlers_are_functions_or_recorders(handlers):
    plan_module.check_event_handlers(handlers)


@pytest.mark.parametrize("handlers", [print, [1], (Recorder(), "x"), "handlers", None])
def test_rule_anything_else_is_no_event_handlers(handlers):
    message = (
        "event_handlers must be a tuple of functions or of objects with a record(event) method, "
        f"got {handlers!r}"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        plan_module.check_event_handlers(handlers)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("timeout", 0, "timeout must be a positive number of seconds, got 0"),
        ("timeout", 0.5, None),
        ("timeout", 1, None),
        ("timeout", True, "timeout must be a positive number of seconds, got True"),
        ("agent_timeout", "5", "agent_timeout must be a positive number of seconds, got '5'"),
        ("timeout", float("inf"), "timeout must be a finite number of seconds, got inf"),
        (
            "launch_timeout",
            float("inf"),
            (
                "launch_timeout must be a finite number of seconds, got inf (for no limit, use "
                "launch_timeout=None)"
            ),
        ),
        ("launch_timeout", float("nan"), None),  # below: nan is not finite
    ],
)
def test_rule_a_timeout_is_a_finite_positive_number_of_seconds(name, value, message):
    if value != value:  # nan  # noqa: PLR0124
        with pytest.raises(ValueError, match=r"^launch_timeout must be a finite number"):
            launcher_module._validate_seconds(name, value)
    elif message is None:
        launcher_module._validate_seconds(name, value)
    else:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            launcher_module._validate_seconds(name, value)


@pytest.mark.parametrize(
    ("default", "copy", "error", "message"),
    [
        (
            "PATH",
            None,
            TypeError,
            "default_env_vars must be a tuple of fnmatch patterns, got 'PATH'",
        ),
        ((1,), None, TypeError, "default_env_vars must be a tuple of fnmatch patterns, got (1,)"),
        (
            DEFAULT_ENV_VARS,
            "PATH",
            TypeError,
            "copy_env_vars must be a tuple of fnmatch patterns, got 'PATH'",
        ),
        (
            ("A*",),
            ("B*",),
            ValueError,
            (
                "copy_env_vars (torchrunx 0.4's name) and default_env_vars are the same setting: "
                "give only one of them"
            ),
        ),
    ],
)
def test_rule_env_var_patterns_are_tuples_and_one_setting_has_one_name(
    default, copy, error, message
):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        check_env_fields(default, copy, None)


def test_rule_default_env_vars_are_checked_also_without_copy_env_vars():
    check_env_fields(("A*",), None, None)
    check_env_fields(DEFAULT_ENV_VARS, ("B*",), None)  # 0.4's name alone
    with pytest.raises(TypeError, match=r"^extra_env_vars must be"):
        check_env_fields(("A*",), None, 5)


@pytest.mark.parametrize("workers", ["auto", "slurm", "gpu", "cpu", 1, [1, 2]])
def test_rule_workers_per_host_words_and_counts_are_accepted(workers):
    hosts.check_workers(workers, ["a", "b"])


@pytest.mark.parametrize("workers", [0, -2, True, 1.0, "2", [1, 0], (2, False), None])
def test_rule_workers_per_host_is_positive_ints_or_a_word(workers):
    message = (
        "workers_per_host must be positive integers (one, or one per host), 'auto', 'slurm', "
        f"'gpu' or 'cpu', got {workers!r}"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hosts.check_workers(workers, ["a", "b"])


def test_rule_one_count_per_host_or_one_for_all():
    message = (
        "workers_per_host has 3 entries but hostnames has 2; give one count per host or a single "
        "int"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        hosts.check_workers([1, 1, 1], ["a", "b"])


# -- the handshake, sealed records and frames (torchrunx/wire/: handshake, records, messages) ----

SECRET = b"s" * 32


def pair() -> tuple[Sealer, RecordReader]:
    """One direction of a connection: what one end seals, the other opens."""
    return Sealer(b"k" * 32), RecordReader(b"k" * 32)


def plaintext(message: object, payload: list[bytes]) -> bytes:
    return encode_frame_start(message, payload) + b"".join(payload)  # type: ignore[arg-type]


FRAMES = [
    (Heartbeat(), []),
    (WorkerResult(3, sent_at=1.5), [b"abc", b"", b"x" * 5000]),
    (WorkerHello(1, 0, 99), [b""]),
    (Stop("done"), [b"tail"]),
]


@pytest.mark.parametrize("chunk", [1, 2, 7, 13, 64, 4096, 1 << 20])
def test_rule_the_frame_parser_gives_the_same_frames_however_the_plaintext_is_cut(chunk):
    """Rule: frames come out whole and in order, whatever the sizes of the pieces fed."""
    data = b"".join(plaintext(m, p) for m, p in FRAMES)
    parser = FrameParser()
    frames: list = []
    for start in range(0, len(data), chunk):
        parser.feed(data[start : start + chunk], frames)
    assert [(m, [bytes(part) for part in parts]) for m, parts in frames] == FRAMES
    assert parser.idle


def test_rule_a_frame_is_complete_only_once_its_last_part_came():
    data = plaintext(WorkerResult(0), [b"12345"])
    parser = FrameParser()
    frames: list = []
    parser.feed(data[:-1], frames)
    assert frames == [] and not parser.idle
    parser.feed(data[-1:], frames)
    assert len(frames) == 1 and parser.idle


@pytest.mark.parametrize(
    ("header_size", "count", "message"),
    [
        (
            _MAX_HEADER + 1,
            0,
            f"frame of {_MAX_HEADER + 1} header bytes, 0 parts is too large",
        ),
        (
            10,
            _MAX_PARTS + 1,
            f"frame of 10 header bytes, {_MAX_PARTS + 1} parts is too large",
        ),
    ],
)
def test_rule_a_frame_larger_than_the_limits_is_refused_before_anything_is_read(
    header_size, count, message
):
    parser = FrameParser()
    with pytest.raises(ProtocolError, match=f"^{re.escape(message)}$"):
        parser.feed(_FRAME.pack(header_size, count), [])


@pytest.mark.parametrize(("header_size", "count"), [(_MAX_HEADER, 0), (10, _MAX_PARTS)])
def test_rule_a_frame_at_the_limits_is_waited_for(header_size, count):
    parser = FrameParser()
    frames: list = []
    parser.feed(_FRAME.pack(header_size, count), frames)
    assert frames == [] and not parser.idle


def test_rule_a_frame_declaring_more_payload_than_the_limit_is_refused_before_allocating():
    header = pickle.dumps(WorkerResult(0), protocol=pickle.HIGHEST_PROTOCOL)
    half = MAX_FRAME_BYTES // 2

    def start(sizes: list[int]) -> bytes:
        parts = b"".join(_PART.pack(size) for size in sizes)
        return _FRAME.pack(len(header), len(sizes)) + parts + header

    frames: list = []
    FrameParser().feed(start([half, half]), frames)  # exactly the limit: waits
    assert frames == []
    message = f"frame of {2 * half + 1} payload bytes: more than {MAX_FRAME_BYTES}"
    with pytest.raises(ProtocolError, match=f"^{re.escape(message)}$"):
        FrameParser().feed(start([half, half + 1]), [])


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (pickle.dumps(5), "unexpected message type int"),
        (b"not a pickle", None),
        (
            pickle.dumps(ValueError("x")),
            "malformed message header (UnpicklingError: builtins.ValueError is not a torchrunx message class)",
        ),
    ],
)
def test_rule_a_header_is_one_of_the_protocols_messages_or_refused_saying_why(header, message):
    with pytest.raises(ProtocolError) as raised:
        messages._load_message(header)
    if message is not None:
        assert str(raised.value) == message
    else:
        assert str(raised.value).startswith("malformed message header (UnpicklingError: ")


def test_rule_a_sealed_record_opens_to_its_frames_and_its_length_is_checked():
    sealer, reader = pair()
    records = list(sealer.seal_frame(WorkerResult(2), [b"payload"]))
    frames = [f for record in records for f in reader.open_record(record)]
    assert [(m, [bytes(p) for p in parts]) for m, parts in frames] == [
        (WorkerResult(2), [b"payload"])
    ]
    for bad in (b"\x00\x00", bytes(records[0]) + b"x", bytes(records[0])[:-1]):
        with pytest.raises(ProtocolError, match=r"^a record's length does not match its header$"):
            pair()[1].open_record(bad)


@pytest.mark.parametrize("size", [0, TAG_BYTES - 1, _MAX_RECORD + 1])
def test_rule_a_record_size_outside_a_records_bounds_is_refused(size):
    record = _RECORD.pack(size) + bytes(max(0, min(size, 64)))
    with pytest.raises(ProtocolError, match=f"^record of {size} bytes: not a torchrunx record$"):
        pair()[1].open_record(record)


def test_rule_the_smallest_record_is_the_close_record():
    sealer, reader = pair()
    close = sealer.seal_close()
    assert len(close) == _RECORD.size + TAG_BYTES
    assert reader.open_record(close) == [] and reader.closed_by_peer is True


def test_rule_nothing_may_follow_the_peers_close_record():
    sealer, reader = pair()
    reader.open_record(sealer.seal_close())
    with pytest.raises(ProtocolError, match=r"^a record after the peer's close record$"):
        reader.open_record(sealer.seal(b"more"))


def test_rule_a_forged_close_record_fails_authentication():
    _, reader = pair()
    forged = Sealer(b"o" * 32).seal_close()
    with pytest.raises(ProtocolError, match=r"^a record failed authentication"):
        reader.open_record(forged)
    assert reader.closed_by_peer is False


def test_rule_a_close_in_the_middle_of_a_frame_is_a_cut_stream():
    sealer, reader = pair()
    reader.open_record(next(iter(sealer.seal_frame(WorkerResult(2), [b"payload"]))))
    # the frame start came; its part never does
    with pytest.raises(
        ProtocolError, match=r"^the peer closed its stream in the middle of a frame$"
    ):
        reader.open_record(sealer.seal_close())


def test_rule_a_tampered_part_leaves_nothing_unverified_in_its_buffer():
    sealer, reader = pair()
    start, part = sealer.seal_frame(WorkerResult(2), [b"secret-bytes"])
    reader.open_record(start)
    tampered = bytearray(part)
    tampered[_RECORD.size] ^= 1
    with pytest.raises(ProtocolError, match=r"^a record failed authentication"):
        reader.open_record(tampered)
    assert bytes(reader._parser._parts[0]).strip(b"\x00") == b""


def stream_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(10)
    return a, b


def test_rule_a_stream_that_ends_with_its_close_record_ends_cleanly():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        for record in sealer.seal_frame(Heartbeat()):
            a.sendall(record)
        a.sendall(sealer.seal_close())
        a.close()
        b.setblocking(False)  # noqa: FBT003
        frames: list = []
        ended = False
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            more, ended = reader.read(b)
            frames += more
        assert ended and reader.error is None and reader.closed_by_peer is True
        assert [m for m, _ in frames] == [Heartbeat()]


def test_rule_a_stream_that_ends_without_its_close_record_was_cut():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        for record in sealer.seal_frame(Heartbeat()):
            a.sendall(record)
        a.close()
        b.setblocking(False)  # noqa: FBT003
        frames: list = []
        ended = False
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            more, ended = reader.read(b)
            frames += more
        assert ended and [m for m, _ in frames] == [Heartbeat()]
        assert isinstance(reader.error, ProtocolError)
        assert str(reader.error) == (
            "the connection ended without its authenticated close: the stream was cut (its "
            "last records dropped on the way, or its sender died)"
        )


def test_rule_reading_what_is_there_now_does_not_end_the_stream():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        for record in sealer.seal_frame(Heartbeat()):
            a.sendall(record)
        b.setblocking(False)  # noqa: FBT003
        time.sleep(0)  # a socketpair delivers at once
        frames, ended = reader.read(b)
        assert [m for m, _ in frames] == [Heartbeat()] and ended is False
        assert reader.read(b) == ([], False) and reader.error is None


def test_rule_read_stops_after_its_budget_and_leaves_the_rest_for_later():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        records = [r for _ in range(20) for r in sealer.seal_frame(WorkerResult(0), [b"x" * 3000])]
        a.sendall(b"".join(bytes(r) for r in records))
        b.setblocking(False)  # noqa: FBT003
        first, ended = reader.read(b, budget=1)  # one read from the socket, then it stops
        assert not ended and 1 <= len(first) < 20
        rest, _ = reader.read(b)
        assert len(first) + len(rest) == 20


def test_rule_read_record_reads_one_record_and_a_clean_end_is_connection_error():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        a.sendall(b"".join(bytes(r) for r in sealer.seal_frame(Heartbeat())))
        a.sendall(sealer.seal_close())
        a.close()
        assert [m for m, _ in reader.read_record(b)] == [Heartbeat()]
        assert reader.read_record(b) == [] and reader.closed_by_peer
        with pytest.raises(ConnectionError, match=r"^connection closed by peer$"):
            reader.read_record(b)


def test_rule_read_record_of_a_cut_stream_is_a_protocol_error():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        record = bytes(next(iter(sealer.seal_frame(Heartbeat()))))
        a.sendall(record[:-3])
        a.close()
        with pytest.raises(ProtocolError, match=r"^the stream ended in the middle of a record$"):
            reader.read_record(b)
    _, reader = pair()
    a, b = stream_pair()
    with a, b:
        a.close()
        with pytest.raises(
            ProtocolError, match=r"^the connection ended without its authenticated close"
        ):
            reader.read_record(b)


def test_rule_one_reading_style_per_connection():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        a.sendall(bytes(next(iter(sealer.seal_frame(WorkerResult(1), [b"x" * 10]))))[:10])
        b.setblocking(False)  # noqa: FBT003
        reader.read(b)  # the start of a record is buffered, the rest not yet here
        b.setblocking(True)  # noqa: FBT003
        with pytest.raises(
            ProtocolError, match=r"^read_record after read: one reading style per connection$"
        ):
            reader.read_record(b)


def test_rule_frames_before_a_bad_record_come_first_then_the_error():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        too_large = _FRAME.pack(_MAX_HEADER + 1, 0)
        a.sendall(sealer.seal(plaintext(WorkerHello(0, 0, 1), []) + too_large))
        assert [m for m, _ in reader.read_record(b)] == [WorkerHello(0, 0, 1)]
        for _ in range(2):  # the error next, and it stays
            with pytest.raises(ProtocolError, match=r"^frame of \d+ header bytes, 0 parts"):
                reader.read_record(b)
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        bad = bytearray(next(iter(sealer.seal_frame(Heartbeat()))))
        bad[-1] ^= 1
        a.sendall(bytes(bad))
        with pytest.raises(ProtocolError, match=r"^a record failed authentication"):
            reader.read_record(b)  # no frame before it: the error at once


def test_rule_a_connection_sends_its_close_record_once_and_closes_twice_safely():
    keys = handshake.SessionKeys(send=b"k" * 32, receive=b"r" * 32)
    a, b = stream_pair()
    with b:
        connection = Connection(a, keys)
        connection.send(Heartbeat())
        connection.send_close()
        connection.send_close()
        connection.close()
        connection.close()  # safe twice
        reader = FrameReader(b"k" * 32)
        assert [m for m, _ in reader.read_record(b)] == [Heartbeat()]
        assert reader.read_record(b) == [] and reader.closed_by_peer
        with pytest.raises(ConnectionError):
            reader.read_record(b)  # one close record, then the end


def test_rule_a_connection_closed_without_send_close_still_ends_cleanly():
    keys = handshake.SessionKeys(send=b"k" * 32, receive=b"r" * 32)
    a, b = stream_pair()
    with b:
        Connection(a, keys).close()
        reader = FrameReader(b"k" * 32)
        assert reader.read_record(b) == [] and reader.closed_by_peer


def test_rule_the_handshake_proofs_and_keys_are_the_documented_hmac_and_hkdf():
    """The wire format, computed independently: a change must change PROTOCOL_VERSION."""
    server_nonce = b"n" * handshake.NONCE_BYTES
    greeting = handshake.server_greeting(server_nonce)
    reply, expected_proof, client_keys = handshake.client_reply(SECRET, greeting, "worker")
    client_nonce = reply[
        len(handshake.MAGIC) + 1 : len(handshake.MAGIC) + 1 + handshake.NONCE_BYTES
    ]
    assert reply[len(handshake.MAGIC) : len(handshake.MAGIC) + 1] == b"W"
    mac = hmac.new(SECRET, b"|".join([b"client", b"W", server_nonce, client_nonce]), hashlib.sha256)
    assert reply.endswith(mac.digest())
    proof = hmac.new(SECRET, b"|".join([b"server", client_nonce, server_nonce]), hashlib.sha256)
    assert expected_proof == proof.digest()

    def derive(direction: bytes) -> bytes:
        return HKDF(
            algorithm=SHA256(),
            length=handshake.KEY_BYTES,
            salt=server_nonce + client_nonce,
            info=b"torchrunx %d W %s" % (handshake.PROTOCOL_VERSION, direction),
        ).derive(SECRET)

    assert client_keys == handshake.SessionKeys(
        send=derive(b"client->server"), receive=derive(b"server->client")
    )
    role, server_proof, server_keys = handshake.check_client_reply(SECRET, server_nonce, reply)
    assert role == "worker" and server_proof == expected_proof
    assert server_keys == handshake.SessionKeys(send=client_keys.receive, receive=client_keys.send)


def test_rule_a_reply_with_the_wrong_magic_or_length_is_not_the_protocol():
    server_nonce = b"n" * handshake.NONCE_BYTES
    reply, _, _ = handshake.client_reply(SECRET, handshake.server_greeting(server_nonce), "agent")
    wrong_magic = b"X" + reply[1:]
    message = f"peer does not speak torchrunx protocol version {handshake.PROTOCOL_VERSION}"
    for bad in (wrong_magic, reply + b"x", reply[:-1]):
        with pytest.raises(ProtocolError, match=f"^{re.escape(message)}$"):
            handshake.check_client_reply(SECRET, server_nonce, bad)
    with pytest.raises(
        ProtocolError, match=r"^peer failed to authenticate \(wrong or missing launch secret\)$"
    ):
        handshake.check_client_reply(b"o" * 32, server_nonce, reply)


def test_rule_a_greeting_with_the_wrong_magic_or_length_is_not_a_launcher():
    greeting = handshake.server_greeting(b"n" * handshake.NONCE_BYTES)
    message = f"launcher does not speak torchrunx protocol version {handshake.PROTOCOL_VERSION}"
    for bad in (b"X" + greeting[1:], greeting + b"x", greeting[:-1]):
        with pytest.raises(ProtocolError, match=f"^{re.escape(message)}$"):
            handshake.client_reply(SECRET, bad, "agent")


def test_rule_a_launcher_without_the_secret_is_refused_by_the_client():
    a, b = stream_pair()
    with a, b:
        a.sendall(handshake.server_greeting(b"n" * handshake.NONCE_BYTES))
        a.sendall(b"\x00" * handshake.MAC_BYTES)  # a proof that proves nothing
        with pytest.raises(
            ProtocolError, match=r"^launcher failed to authenticate \(wrong launch secret\)$"
        ):
            handshake.client_handshake(b, SECRET, "agent")


def test_rule_a_new_secret_is_fresh_and_of_its_size():
    first, second = handshake.new_secret(), handshake.new_secret()
    assert len(first) == handshake.SECRET_BYTES and first != second


class FakeClock:
    def __init__(self) -> None:
        self.now, self.sleeps = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_rule_connect_retries_a_shed_try_with_a_doubling_pause_until_its_timeout(monkeypatch):
    """Rule: a try that the launcher resets or closes (a shed handshake) is tried again."""
    clock = FakeClock()
    monkeypatch.setattr(handshake, "time", clock)  # handshake's clock only
    tries: list[tuple] = []

    def shed(address, secret, role, timeout):
        tries.append((address, secret, role, timeout))
        raise ConnectionResetError("reset")

    monkeypatch.setattr(handshake, "_connect_once", shed)
    with pytest.raises(ConnectionResetError):
        handshake.connect(("h", 1), SECRET, "worker", 3.0)
    assert clock.sleeps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0]  # doubling, at most 1 s
    assert tries[0] == (("h", 1), SECRET, "worker", 3.0)
    assert [round(t[3], 6) for t in tries] == [3.0, 2.95, 2.85, 2.65, 2.25, 1.45, 0.45]


def test_rule_connect_does_not_retry_a_refused_connection(monkeypatch):
    """Rule: nothing listens there (the launcher is gone): say so at once."""
    clock = FakeClock()
    monkeypatch.setattr(handshake, "time", clock)
    tries: list[float] = []

    def refuse(address, secret, role, timeout):
        tries.append(timeout)
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(handshake, "_connect_once", refuse)
    with pytest.raises(ConnectionRefusedError):
        handshake.connect(("h", 1), SECRET, "worker", 3.0)
    assert tries == [3.0] and clock.sleeps == []


def test_rule_connect_returns_the_first_try_that_works_and_never_retries_a_bad_secret(
    monkeypatch,
):
    clock = FakeClock()
    monkeypatch.setattr(handshake, "time", clock)  # handshake's clock only
    outcomes = [ConnectionResetError("shed"), "connection"]

    def once(address, secret, role, timeout):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(handshake, "_connect_once", once)
    assert handshake.connect(("h", 1), SECRET, "agent", 5.0) == "connection"
    assert clock.sleeps == [0.05]

    def wrong_secret(*_args):
        raise ProtocolError("launcher failed to authenticate")

    monkeypatch.setattr(handshake, "_connect_once", wrong_secret)
    with pytest.raises(ProtocolError):
        handshake.connect(("h", 1), SECRET, "agent", 5.0)
    assert clock.sleeps == [0.05]


def test_rule_connect_gives_the_last_try_at_least_a_moment(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(handshake, "time", clock)  # handshake's clock only
    timeouts: list[float] = []

    def refuse(address, secret, role, timeout):
        timeouts.append(timeout)
        clock.now += 10  # this try used up the time
        raise ConnectionResetError

    monkeypatch.setattr(handshake, "_connect_once", refuse)
    with pytest.raises(ConnectionResetError):
        handshake.connect(("h", 1), SECRET, "agent", 0.0)
    assert timeouts == [0.001] and clock.sleeps == []


def test_rule_after_a_restart_no_result_counts_before_it_comes():
    state = running(1, 2, keep_workers=True)
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray()], 1.0)
    state.begin_stop(restart=True)
    state.next_attempt()
    state.current.assign(state.agents[0], spec(0, 2, 1))
    for rank in state.ranks:
        state.current.worker_hello(rank, 100 + rank.rank, 2000 + rank.rank)
    state.current.worker_result(state.ranks[0], WorkerResult(0), [bytearray()], 2.0)
    assert not state.finished  # one result of this attempt, of two
    state.current.worker_result(state.ranks[1], WorkerResult(1), [bytearray()], 2.0)
    assert state.finished


@pytest.mark.parametrize("chunk", [1, 5, 13, 100, 5000])
def test_rule_frames_are_the_same_however_the_plaintext_is_cut_into_records(chunk):
    """Rule: a record may end anywhere in a frame (mid-part too): the frames are the same."""
    data = b"".join(plaintext(m, p) for m, p in FRAMES)
    sealer, reader = pair()
    frames: list = []
    for start in range(0, len(data), chunk):
        frames += reader.open_record(sealer.seal(data[start : start + chunk]))
    assert [(m, [bytes(part) for part in parts]) for m, parts in frames] == FRAMES


def test_rule_a_large_frame_is_read_whole_and_the_buffer_goes_back_to_small():
    """Rule: the reader grows its buffer to the record that comes, and gives it back once
    nothing is left to read (an idle connection costs IDLE_BUFFER_BYTES)."""
    sealer, reader = pair()
    payload = [bytes(range(256)) * 600, b"y" * (RECORD_BYTES + 10)]
    a, b = stream_pair()
    with a, b:
        sender = threading.Thread(
            target=lambda: [a.sendall(r) for r in sealer.seal_frame(WorkerResult(0), payload)]
        )
        sender.start()
        b.setblocking(False)  # noqa: FBT003
        frames: list = []
        deadline = time.monotonic() + 30
        while not frames and time.monotonic() < deadline:
            more, ended = reader.read(b)
            assert not ended, reader.error
            frames += more
            select.select([b], [], [], 0.1)
        sender.join(10)
        assert [(m, [bytes(p) for p in parts]) for m, parts in frames] == [
            (WorkerResult(0), payload)
        ]
        assert reader.read(b) == ([], False)  # nothing left now
        assert len(reader._raw) == IDLE_BUFFER_BYTES


def test_rule_one_read_takes_about_its_budget_not_everything_there_is():
    sealer, reader = pair()
    a, b = stream_pair()
    with a, b:
        records = [r for _ in range(20) for r in sealer.seal_frame(WorkerResult(0), [b"x" * 3000])]
        a.sendall(b"".join(bytes(r) for r in records))
        b.setblocking(False)  # noqa: FBT003
        first, _ = reader.read(b, budget=10_000)
        assert 1 <= len(first) < 20
        rest, _ = reader.read(b)
        assert len(first) + len(rest) == 20


def test_rule_connect_does_not_pause_past_its_deadline(monkeypatch):
    clock = FakeClock()
    clock.now = 0.0  # deadline - now is then exactly the first pause, with no rounding
    monkeypatch.setattr(handshake, "time", clock)

    def shed(*_args):
        raise ConnectionResetError

    monkeypatch.setattr(handshake, "_connect_once", shed)
    with pytest.raises(ConnectionResetError):
        handshake.connect(("h", 1), SECRET, "agent", handshake._RETRY_FIRST)  # left == pause
    assert clock.sleeps == []


# -- spare hosts and min_hosts: quarantine (docs/resilience.md) --------------------------------


def test_rule_with_spares_a_failed_host_is_quarantined_at_once():
    inbox, parts, _ = connected(spares=1)
    inbox.agent_silent(inbox.state.agents[1], 8.0)
    agent = inbox.state.agents[1]
    assert (agent.state, agent.role) == (AgentState.LOST, "quarantined")
    assert [f.kind for f in inbox.state.faults] == ["lost"]  # the cause of the restart
    (event,) = [e for e in parts.events if isinstance(e, HostQuarantined)]
    assert (event.host_index, event.hostname, event.state) == (1, "node1", "LOST")
    assert inbox.state.agent_table.world_changes == ["attempt 0: node1 (host 1, LOST) quarantined"]


def test_rule_min_hosts_without_spares_quarantines_the_failed_host():
    inbox, parts, _ = connected(min_hosts=1)
    assert inbox.plan.hosts.spares == 0
    inbox.agent_silent(inbox.state.agents[1], 8.0)
    assert inbox.state.agents[1].role == "quarantined"
    (event,) = [e for e in parts.events if isinstance(e, HostQuarantined)]
    assert event.host_index == 1


def test_rule_without_spares_a_failed_host_is_not_quarantined():
    inbox, parts, _ = connected()
    inbox.agent_silent(inbox.state.agents[1], 8.0)
    assert inbox.state.agents[1].role == "host"
    assert not [e for e in parts.events if isinstance(e, HostQuarantined)]


def test_rule_an_end_while_stopping_or_starting_quarantines_nothing():
    inbox, _, _ = connected(spares=1)
    inbox.agent_failed(inbox.state.agents[0], None)  # no fault: a consequence of a stop
    assert inbox.state.agents[0].role == "host"
    starting, _ = new_inbox(spares=1)
    starting.agent_failed(starting.state.agents[0], AgentFailedError("node0", "cannot start"))
    assert starting.state.agents[0].role == "host"  # a start failure fails the launch instead


def test_rule_a_live_agent_that_is_quarantined_is_told_to_stop_for_good():
    inbox, parts, peers = connected(spares=1)
    inbox.state.progress.attempt = 2
    agent = inbox.state.agents[0]
    inbox.quarantine(agent)
    (stop,) = peers[0].sent
    assert stop == Stop("its host was quarantined", 3.0, dump_stacks=False, attempt=2)
    assert (agent.state, agent.role, inbox.state.faults) == (AgentState.FAILED, "quarantined", [])
    inbox.quarantine(agent)  # once only
    assert len(peers[0].sent) == 1
    assert len([e for e in parts.events if isinstance(e, HostQuarantined)]) == 1


def test_rule_a_spares_failure_is_a_warning_not_a_fault(caplog):
    inbox, _, _ = connected(spares=1)
    spare = inbox.state.agents[1]
    spare.role = "spare"
    inbox.agent_failed(spare, AgentFailedError("node1", "cannot resolve"))
    assert (spare.state, spare.role, inbox.state.faults) == (AgentState.FAILED, "spare", [])
    assert caplog.messages == [
        (
            "spare host node1 is not available: AgentFailedError: agent on host 'node1' "
            "failed: cannot resolve"
        )
    ]
    other = inbox.state.agents[0]
    other.role = "spare"
    inbox.agent_failed(other, None)
    assert caplog.messages[-1] == "spare host node0 is not available: its agent failed"


def test_rule_the_quarantine_is_logged_once_with_its_line(caplog):
    inbox, _, _ = connected(spares=1)
    agent = inbox.state.agents[1]
    agent.last_heard = 0.0
    inbox.agent_silent(agent, 8.0)
    assert caplog.messages[-1] == "attempt 0: node1 (host 1, LOST) quarantined"
    (fault,) = inbox.state.faults
    assert abs(fault.at - time.time()) < 60  # a real time, not None


def test_rule_a_quarantined_live_agent_fails_without_a_fault_at_a_real_time():
    inbox, _, _ = connected(spares=1)
    inbox.quarantine(inbox.state.agents[0])
    assert inbox.state.agents[0].judge_by is None and inbox.state.faults == []


def test_rule_an_agents_preemption_notice_preempts_only_with_a_grace():
    told: list[str] = []
    for grace, expected in ((0.0, []), (0.5, ["the agent on node1 received SIGTERM"])):
        inbox, _, peers = connected(preemption_grace=grace)
        inbox.on_preempt = told.append
        inbox.apply(frame(peers[1], PreemptionNotice("the agent on node1 received SIGTERM")))
        assert told == expected
        assert not peers[1].closed  # an agent's own message: its connection stays
    quiet, _, peers = connected(preemption_grace=30.0)
    assert quiet.on_preempt is None and quiet.on_debugpy is None and quiet.on_shown is None
    quiet.apply(frame(peers[0], PreemptionNotice("no one listens")))  # nothing to call: ignored
    assert not peers[0].closed


def test_rule_a_ranks_debugpy_port_goes_to_its_handler_and_nothing_else_does():
    inbox, _, _, ranks = with_workers()
    seen: list[tuple[int, int]] = []
    inbox.apply(frame(ranks[1], DebugpyListening(1, 5678)))  # no handler: dropped
    assert ranks[1].drops == 1
    inbox, _, _, ranks = with_workers()
    inbox.on_debugpy = lambda rank, port: seen.append((rank, port))
    inbox.apply(frame(ranks[1], DebugpyListening(1, 5678)))
    assert seen == [(1, 5678)] and ranks[1].drops == 0
    inbox.apply(frame(ranks[0], WorkerResult(0, sent_at=1.0)))  # a result is no debugpy port
    assert seen == [(1, 5678)]
    assert inbox.state.ranks[0].result is not None


def test_rule_a_grace_may_be_zero_and_its_refusal_says_so():
    launcher_module._validate_seconds("preemption_grace", 0, zero=True)
    with pytest.raises(ValueError, match=r"^preemption_grace must be 0 or more seconds, got -1$"):
        launcher_module._validate_seconds("preemption_grace", -1, zero=True)


def test_rule_a_tree_child_lost_with_its_interior_host_is_named_by_its_own_hostname():
    from types import SimpleNamespace

    from torchrunx.launcher.launch.inbox import _lost_in_tree

    why = "host node3 (host index 3) was started by interior host node1 (host index 0), ..."
    error = _lost_in_tree(SimpleNamespace(lost=why), "node3")
    assert isinstance(error, trx.AgentFailedError)
    assert error.hostname == "node3" and why in str(error)
    assert _lost_in_tree(SimpleNamespace(lost=""), "node3") is None  # it ended on its own
    assert _lost_in_tree(object(), "node3") is None  # not a tree's child


def test_rule_a_test_that_guards_a_module_cannot_start_a_process():
    # This file guards modules in scripts/mutation.py: here, as in the mutation run, starting
    # a process fails the test (tests/pure_guard.py), so that no such test guards unnoticed.
    for start in (lambda: subprocess.run(["true"], check=False), lambda: os.system("true")):  # noqa: S605
        with pytest.raises(BaseException, match="process") as raised:
            start()
        assert not isinstance(raised.value, OSError)  # not a failed start the code may go past
