"""The agent's parts on their own: its entry point, its outbox, its worker group."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from torchrunx.agent.outbox import Outbox
from torchrunx.agent.workergroup import WorkerGroup
from torchrunx.launcher.settings.plan import agent_timings
from torchrunx.wire.bootstrap import BOOT_CODE, AgentBootstrap
from torchrunx.wire.messages import Heartbeat, LogLines
from torchrunx.wire.records import Connection, Sealer, SessionKeys


def test_an_agent_given_a_malformed_bootstrap_names_the_field_and_exits_with_2():
    boot = AgentBootstrap(
        host_index=0,
        hostname="localhost",
        launcher_address="127.0.0.1",
        launcher_port=1,
        secret=b"\x01",
        workers=1,
        preload_torch=False,
        timings=agent_timings(5.0),
        log_level=20,
        sys_path=tuple(sys.path),
    )
    data = json.loads(boot.to_json_line())
    data["workers"] = -1
    done = subprocess.run(
        [sys.executable, "-c", BOOT_CODE],
        input=json.dumps(data).encode() + b"\n",
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.decode() == (
        "torchrunx agent: malformed agent bootstrap: field 'workers' must be a positive "
        "integer or null, got -1\n"
    )


OURS = SessionKeys(send=b"a" * 32, receive=b"b" * 32)
"""The agent's end of a made-up connection; :data:`THEIRS` is the launcher's."""
THEIRS = SessionKeys(send=OURS.receive, receive=OURS.send)


def _lines(count: int, size: int) -> LogLines:
    return LogLines(
        tuple((0, 20, "worker.0.stdout", f"{i} " + "x" * size, 0.0) for i in range(count))
    )


def test_the_outbox_never_blocks_pauses_above_its_high_watermark_and_keeps_the_order():
    ours, theirs = socket.socketpair()
    ours.settimeout(5.0)
    outbox = Outbox(ours, Sealer(OURS.send), high=256 << 10, low=32 << 10)
    sent = 0
    started = time.monotonic()
    while not outbox.paused:  # nobody reads: the socket fills, then the outbox
        outbox.put(LogLines(((0, 20, "w", str(sent), 0.0),)))
        outbox.put(_lines(1, 4096))
        sent += 1
    assert time.monotonic() - started < 5  # no put waited for room
    assert len(outbox) > 256 << 10
    received: list[str] = []

    def read() -> None:
        connection = Connection(theirs, THEIRS)
        for _ in range(2 * sent):
            message, _ = connection.recv()
            assert isinstance(message, LogLines)
            if message.records[0][2] == "w":
                received.append(message.records[0][3])

    reader = threading.Thread(target=read)
    reader.start()
    outbox.drain(time.monotonic() + 30)
    reader.join(30)
    assert len(outbox) == 0
    assert not outbox.paused  # below the low watermark again
    assert received == [str(i) for i in range(sent)]
    theirs.close()
    outbox.put(_lines(100, 4096))  # the peer is gone: the outbox is lost, and stays empty
    outbox.drain(time.monotonic() + 5)
    assert not outbox.alive
    outbox.put(Heartbeat())
    assert len(outbox) == 0
    ours.close()
    with socket.socket() as plain, pytest.raises(ValueError, match="a socket with a timeout"):
        Outbox(plain, Sealer(OURS.send))


def test_the_outbox_resumes_output_only_below_its_low_watermark():
    ours, theirs = socket.socketpair()
    ours.settimeout(5.0)
    theirs.settimeout(0.0)
    outbox = Outbox(ours, Sealer(OURS.send), high=256 << 10, low=32 << 10)
    while not outbox.paused:
        outbox.put(_lines(4, 4096))
    seen_between = False
    while outbox.paused:
        with contextlib.suppress(BlockingIOError):
            theirs.recv(8192)
        outbox.flush()
        seen_between = seen_between or (32 << 10) <= len(outbox) <= (256 << 10)
    assert seen_between  # still paused between the two watermarks
    assert len(outbox) < 32 << 10
    ours.close()
    theirs.close()


def test_closing_a_worker_group_sends_sigterm_then_sigkill_once_the_grace_period_is_over():
    selector = selectors.DefaultSelector()
    group = WorkerGroup(selector)

    def child(fork):  # rank 0 ends on SIGTERM; rank 1 ignores it
        try:
            os.setsid()
            handler = signal.SIG_IGN if fork.local_rank == 1 else signal.SIG_DFL
            signal.signal(signal.SIGTERM, handler)
            os.write(fork.stdout, b"ready\n")
            time.sleep(60)
        finally:
            os._exit(0)

    exits: dict[int, int] = {}
    lines: list[str] = []

    def serve(deadline: float | None) -> None:  # what the agent's loop does meanwhile
        while group.live():
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return
            for key, _ in selector.select(timeout):
                ready = key.data
                if ready.kind == "exited":
                    exits[ready.worker.local_rank] = group.reap(ready.worker)
                elif ready.kind == "output":
                    lines.extend(group.read_output(ready.worker, ready.output))
                else:
                    group.read_stacks(ready.worker)

    try:
        group.start(2, child)
        deadline = time.monotonic() + 30
        while len(lines) < 2 and time.monotonic() < deadline:
            serve(time.monotonic() + 0.1)
        assert lines == ["ready", "ready"]
        started = time.monotonic()
        group.close(1.0, serve)
        took = time.monotonic() - started
        assert exits == {0: -signal.SIGTERM, 1: -signal.SIGKILL}
        assert 1.0 <= took < 10
        assert all(worker.ended and not worker.outputs for worker in group.workers)
        for worker in group.workers:
            with pytest.raises(ProcessLookupError):
                os.kill(worker.pid, 0)
        group.close(1.0, serve)  # a second close does nothing
        assert selector.get_map() == {}
    finally:
        group.close(0.0)
        selector.close()


def test_closing_a_worker_group_without_grace_kills_at_once_and_reaps_by_itself():
    selector = selectors.DefaultSelector()
    group = WorkerGroup(selector)

    def child(fork):
        try:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(60)
        finally:
            os._exit(0)

    try:
        group.start(3, child)
        started = time.monotonic()
        group.close(0.0)
        assert time.monotonic() - started < 5
        assert all(worker.ended for worker in group.workers)
        assert selector.get_map() == {}
    finally:
        selector.close()


def test_an_agent_on_a_kernel_without_pidfds_says_what_it_needs(monkeypatch):
    # Linux before 5.3 (or a Python without os.pidfd_open): the agent must say so, not crash.
    import errno

    from torchrunx.agent import guardian

    assert guardian.missing_pidfds() is None  # this machine has them

    def refused(_pid: int) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refused)
    assert "need Linux 5.3 or later" in (guardian.missing_pidfds() or "")
    assert "Function not implemented" in (guardian.missing_pidfds() or "")
    monkeypatch.delattr(os, "pidfd_open")
    assert "has no os.pidfd_open" in (guardian.missing_pidfds() or "")


def test_the_agent_forwards_a_hello_only_from_the_process_it_forked_for_that_local_rank():
    # Issue #42: the agent forwarded any WorkerHello a channel carried, so a child of a worker
    # (which kept the channel) could bind the worker's rank to its own pid in the launcher.
    # Real forks: rank 0 says hello itself; rank 1's child says hello with its own pid on the
    # channel it inherited; rank 2 says hello with its own pid but local rank 0.
    from torchrunx.agent.attempt import Attempt
    from torchrunx.wire.channel import ChannelConnection
    from torchrunx.wire.messages import FromWorker, WorkerChannelClosed, WorkerHello

    def child(fork):
        try:
            conn = ChannelConnection(fork.channel)
            if fork.local_rank == 1:
                grandchild = os.fork()
                if grandchild == 0:
                    try:
                        conn.send(WorkerHello(rank=1, local_rank=1, pid=os.getpid()))
                    finally:
                        os._exit(0)
                os.waitpid(grandchild, 0)
            else:
                conn.send(WorkerHello(rank=fork.local_rank, local_rank=0, pid=os.getpid()))
            fork.channel.settimeout(60)
            fork.channel.recv(1)  # until the agent ends the channel (or the test, the worker)
        finally:
            os._exit(0)

    selector = selectors.DefaultSelector()
    sent: list[object] = []
    forwarded: list[object] = []
    attempt = Attempt(
        selector,
        # Not this process's pid: the group would SIGKILL every process below it when it closes
        # (the agent's own sweep), this pytest worker's test hosts' sshd included: what killed
        # the isolated hosts' sshd in the full suite (noted by conftest's _watch_isolated_sshd).
        root=None,
        send=sent.append,
        forward=lambda message, _payload: forwarded.append(message),
    )
    try:
        attempt.group.start(3, child)
        pids = [worker.pid for worker in attempt.group.workers]
        deadline = time.monotonic() + 30

        def closed() -> set[int]:
            return {m.local_rank for m in sent if isinstance(m, WorkerChannelClosed)}

        while not (forwarded and closed() == {1, 2}) and time.monotonic() < deadline:
            for key, events in selector.select(0.1):
                attempt.on_ready(key.data, events)
        assert forwarded == [FromWorker(0, WorkerHello(rank=0, local_rank=0, pid=pids[0]))]
        assert closed() == {1, 2}  # the launcher is told those channels ended
        assert attempt.group.workers[0].channel is not None  # rank 0 keeps its own
    finally:
        attempt.group.close(0.0)
        selector.close()
