"""Both ends of a relayed host under another user's flood, each against this test as the other.

The launcher's end (LauncherRelay, real threads, pipes and socket pairs): each channel costs a
descriptor only while the launcher uses it, and one that cannot be opened is refused alone. The
host's relay (HostRelay, in a process of its own, the test on its stdin and stdout): a channel
the launcher ended is closed, its peer's side ended or not; at most MAX_CHANNELS are open; out
of descriptors it rests; the launcher gone and a connection reported in one batch end nothing
but the relay, with its agent's status."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from torchrunx.engines.relay import LauncherRelay
from torchrunx.wire.relay import DATA, EOF, OPEN, FrameSplitter, frame

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Iterator


class _Host:
    """The host's end of the agent's stdio: frames written to the relay, frames read from it."""

    def __init__(self) -> None:
        self.to_launcher_r, self.to_launcher_w = os.pipe()
        self.from_launcher: list[tuple[int, int, bytes]] = []
        self.lock = threading.Lock()
        self.splitter = FrameSplitter()
        self.adopted: list[socket.socket] = []

    def read_out(self) -> bytes:
        return os.read(self.to_launcher_r, 1 << 16)

    def write_in(self, data: bytes) -> None:
        with self.lock:
            self.from_launcher.extend(self.splitter.feed(data))

    def send(self, kind: int, number: int, data: bytes = b"") -> None:
        os.write(self.to_launcher_w, b"".join(frame(kind, number, data)))

    def got(self, kind: int, number: int) -> bool:
        with self.lock:
            return any(k == kind and n == number for k, n, _ in self.from_launcher)


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def _relay(host: _Host) -> LauncherRelay:
    return LauncherRelay(
        "node2",
        read_out=host.read_out,
        write_in=host.write_in,
        close_in=lambda: None,
        adopt=lambda sock, _addresses: host.adopted.append(sock),
    )


@contextlib.contextmanager
def _relayed() -> Iterator[tuple[_Host, LauncherRelay]]:
    """A host and the launcher's relay of it; everything closed afterwards."""
    host = _Host()
    relay = _relay(host)
    try:
        yield host, relay
    finally:
        relay.stop()
        for sock in host.adopted:
            sock.close()
        os.close(host.to_launcher_w)
        relay.join(5)
        os.close(host.to_launcher_r)
        relay.close_output()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_channel_the_launcher_closed_is_released_at_once_though_the_host_never_ends_it():
    with _relayed() as (host, _):
        before = _open_fds()
        host.send(OPEN, 1, b"10.0.0.7\n10.0.0.1")
        _until(lambda: len(host.adopted) == 1)
        assert _open_fds() == before + 2  # the pair
        host.adopted[0].close()  # the launcher's end closes (a shed or failed handshake)
        _until(lambda: host.got(EOF, 1))  # the host is told: it closes the connection
        _until(lambda: _open_fds() == before)  # and the pair is gone, with no EOF from the host
        host.send(DATA, 1, b"late")  # what the host still sends is dropped, harmlessly
        host.send(OPEN, 2, b"10.0.0.7\n10.0.0.1")
        _until(lambda: len(host.adopted) == 2)  # the relay goes on


def test_channels_that_come_and_go_each_carry_their_own_bytes_as_descriptors_are_reused():
    """The writing thread watches each pair from its opening to the launcher's end of it; a
    new pair often gets the number of a descriptor just closed, and must not be taken for it."""
    with _relayed() as (host, _):
        before = _open_fds()
        for number in range(1, 41):
            host.send(OPEN, number, b"10.0.0.7\n10.0.0.1")
            _until(lambda n=number: len(host.adopted) == n)
            ours = host.adopted[-1]
            ours.sendall(f"from the launcher on {number}".encode())
            if number % 2:  # every other one stays open a while: several are watched at once
                ours.close()
                _until(lambda n=number: host.got(EOF, n))
        for sock in host.adopted[1::2]:
            sock.close()
        _until(lambda: all(host.got(EOF, n) for n in range(1, 41)))
        with host.lock:
            data = [(n, d) for k, n, d in host.from_launcher if k == DATA]
        assert sorted(data) == sorted(
            (n, f"from the launcher on {n}".encode()) for n in range(1, 41)
        )
        host.adopted.clear()
        for number in range(1, 41):  # the host ends its side too: every pair is released
            host.send(EOF, number)
        _until(lambda: _open_fds() == before)


def test_out_of_descriptors_a_channel_is_refused_alone_and_the_others_go_on():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with _relayed() as (host, relay):
        host.send(OPEN, 1, b"10.0.0.7\n10.0.0.1")  # the agent's channel, opened in time
        _until(lambda: len(host.adopted) == 1)
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 8, hard))
        hogs: list[int] = []
        try:
            with contextlib.suppress(OSError):  # every free descriptor taken ...
                while True:
                    hogs.append(os.open("/dev/null", os.O_RDONLY))
            os.close(hogs.pop())  # ... but one: no room for a pair
            host.send(OPEN, 2, b"10.0.0.7\n10.0.0.1")
            _until(lambda: host.got(EOF, 2))  # refused: the host is told to close it
            assert relay.refused == 1
        finally:
            for fd in hogs:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        host.send(DATA, 1, b"still here")  # the first channel was not torn down
        host.adopted[0].settimeout(5)
        assert host.adopted[0].recv(64) == b"still here"
        host.adopted[0].sendall(b"and back")
        _until(lambda: any(d == b"and back" for k, n, d in host.from_launcher if n == 1))
        assert relay.broken is None


# -- the host's relay ------------------------------------------------------------------------

HOST_RELAY_AT_EMFILE = r"""
import contextlib, os, resource, socket, subprocess, sys, time
from torchrunx.agent import relay

listener = socket.create_server(("127.0.0.1", 0), backlog=64)
child = subprocess.Popen(["sleep", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
host = relay.HostRelay(listener, child, b"10.0.0.7\n10.0.0.1")
top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (top + 8, hard))
hogs = []
with contextlib.suppress(OSError):
    while True:
        hogs.append(os.open("/dev/null", os.O_RDONLY))
os.write(2, f"PORT {listener.getsockname()[1]}\n".encode())
time.sleep(0.5)  # the test connects now: they wait in the backlog
before = resource.getrusage(resource.RUSAGE_SELF)
started = time.monotonic()
code = host.run()
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
os.write(2, f"RAN {time.monotonic() - started:.2f} CPU {cpu:.2f} CHANNELS {len(host.channels)}\n".encode())
"""


def test_out_of_descriptors_the_hosts_relay_rests_instead_of_spinning(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", HOST_RELAY_AT_EMFILE, "3"],
        stdin=subprocess.PIPE,  # open, silent: the launcher is there
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    clients = []
    try:
        assert process.stderr is not None
        port = int(process.stderr.readline().split()[1])
        clients = [socket_connect(port) for _ in range(5)]  # accept() fails: no descriptor
        _, err = process.communicate(timeout=60)
    finally:
        for client in clients:
            client.close()
        process.kill()
    ran = next(line for line in err.splitlines() if line.startswith("RAN"))
    seconds, cpu = float(ran.split()[1]), float(ran.split()[3])
    assert seconds > 1.5, err  # the agent (sleep 3) ran its course meanwhile
    assert cpu < seconds / 4, err  # not a busy loop on a listener it cannot accept from


def socket_connect(port: int) -> socket.socket:
    import socket as socket_module

    return socket_module.create_connection(("127.0.0.1", port), timeout=5)


# -- the host's relay, played against by the test as the launcher -----------------------------

HOST_RELAY = r"""
import socket, subprocess, sys
from torchrunx.agent import relay

relay.MAX_CHANNELS = int(sys.argv[1])
listener = socket.create_server(("127.0.0.1", 0), backlog=64)
agent = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # ends at EOF
sys.stderr.write(f"PORT {listener.getsockname()[1]}\n")
sys.stderr.flush()
code = relay.HostRelay(listener, agent, b"10.0.0.7\n10.0.0.1").run()
sys.stderr.write(f"EXIT {code}\n")
sys.exit(code)
"""


class _HostRelay:
    """A host's relay in a process of its own; the test is its launcher, on its stdin and stdout."""

    def __init__(self, max_channels: int = 256) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOST_RELAY, str(max_channels)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        assert self.process.stderr is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        line = b""
        while not line.endswith(b"\n"):  # unbuffered: the rest of stderr is read at the end
            chunk = os.read(self.process.stderr.fileno(), 1)
            assert chunk, "the relay did not start"
            line += chunk
        self.port = int(line.split()[1])
        self.splitter = FrameSplitter()
        self.frames: list[tuple[int, int, bytes]] = []

    def send(self, kind: int, number: int, data: bytes = b"") -> None:
        self.stdin.write(b"".join(frame(kind, number, data)))
        self.stdin.flush()

    def read_until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        """Read the relay's frames until ``condition()`` holds."""
        deadline = time.monotonic() + timeout
        while not condition():
            left = deadline - time.monotonic()
            assert left > 0, f"not in time; frames so far: {self.frames}"
            if select.select([self.stdout], [], [], left)[0]:
                chunk = os.read(self.stdout.fileno(), 1 << 16)
                assert chunk, f"the relay ended: {self.stderr_text()}"
                self.frames += self.splitter.feed(chunk)

    def opened(self) -> list[int]:
        return [number for kind, number, _ in self.frames if kind == OPEN]

    def sockets(self) -> int:
        """Sockets the relay holds: its listener and its channels."""
        count = 0
        for fd in os.listdir(f"/proc/{self.process.pid}/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                count += os.readlink(f"/proc/{self.process.pid}/fd/{fd}").startswith("socket:")
        return count

    def backlog(self) -> int:
        """Connections waiting in the relay's listening socket's queue, not accepted."""
        with open("/proc/net/tcp") as table:
            for row in (line.split() for line in table.readlines()[1:]):
                if row[3] == "0A" and int(row[1].split(":")[1], 16) == self.port:
                    return int(row[4].split(":")[1], 16)
        raise LookupError(f"nothing listens on port {self.port}")

    def stderr_text(self) -> str:
        assert self.process.stderr is not None
        if self.process.poll() is None:
            return "(running)"
        return self.process.stderr.read().decode(errors="replace")

    def end(self, timeout: float = 20.0) -> tuple[int, str]:
        """Close its stdin (the launcher is gone); its exit status and the rest of its stderr."""
        with contextlib.suppress(BrokenPipeError):
            self.stdin.close()
        self.process.stdin = None  # closed here: communicate() only reads
        _, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, err.decode(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_channel_the_launcher_ended_is_closed_on_the_host_though_its_peer_never_ends_it():
    # Another user's idle connection, refused or shed by the launcher: once the launcher's EOF
    # and what came before it are written, the relay closes the connection and frees its
    # descriptor at once, though the peer never closes its side.
    relay = _HostRelay()
    idle = None
    try:
        idle = socket_connect(relay.port)
        relay.read_until(lambda: relay.opened() == [1])
        held = relay.sockets()
        relay.send(DATA, 1, b"greeting")
        relay.send(EOF, 1)
        idle.settimeout(10)
        assert idle.recv(64) == b"greeting"  # what came before the EOF, then the end
        assert idle.recv(64) == b""
        _until(lambda: relay.sockets() == held - 1)  # its descriptor is free on the host too
        code, err = relay.end()
        assert (code, err.splitlines()[-1]) == (0, "EXIT 0"), err
    finally:
        if idle is not None:
            idle.close()
        relay.kill()


def test_the_hosts_relay_keeps_at_most_max_channels_and_the_rest_wait_in_its_backlog():
    relay = _HostRelay(max_channels=8)
    clients = []
    try:
        clients = [socket_connect(relay.port) for _ in range(12)]
        relay.read_until(lambda: len(relay.opened()) == 8)
        _until(lambda: relay.backlog() == 4)  # the other 4: queued, not accepted
        relay.send(EOF, 1)  # the launcher ends one: one more is accepted
        relay.read_until(lambda: len(relay.opened()) == 9)
        _until(lambda: relay.backlog() == 3)
        assert relay.opened() == list(range(1, 10))
        code, err = relay.end()
        assert (code, err.splitlines()[-1]) == (0, "EXIT 0"), err
    finally:
        for client in clients:
            client.close()
        relay.kill()


def test_the_hosts_relay_survives_the_launcher_gone_and_a_connection_in_one_batch():
    # Stopped, the relay is sent both at once: its stdin ends (the launcher is gone, so it
    # closes its listener) and a connection waits on that listener. One poll then reports
    # both; the listener's turn comes after it was closed, and is skipped: the relay ends
    # with its agent's status, without a traceback.
    relay = _HostRelay()
    client = None
    try:
        os.kill(relay.process.pid, signal.SIGSTOP)
        _until(lambda: _stopped(relay.process.pid))
        client = socket_connect(relay.port)  # accepted by the kernel, queued for the relay
        relay.stdin.close()
        os.kill(relay.process.pid, signal.SIGCONT)
        code, err = relay.end()
        assert "Traceback" not in err, err
        assert (code, err.splitlines()[-1]) == (0, "EXIT 0"), err
    finally:
        if client is not None:
            client.close()
        relay.kill()
