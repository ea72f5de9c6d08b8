"""The launcher's end of a relayed host (LauncherRelay) under another user's flood: each channel
costs a descriptor only while the launcher uses it, and one that cannot be opened is refused
alone (real threads, pipes and socket pairs; the host's side is played by this test)."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from typing import TYPE_CHECKING

from torchrunx.launcher.relay import LauncherRelay
from torchrunx.wire.relay import DATA, EOF, OPEN, FrameSplitter, frame

if TYPE_CHECKING:
    import socket


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


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_channel_the_launcher_closed_is_released_at_once_though_the_host_never_ends_it():
    host = _Host()
    relay = _relay(host)
    try:
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
    finally:
        relay.stop()
        for sock in host.adopted:
            sock.close()
        os.close(host.to_launcher_w)
        relay.join(5)
        os.close(host.to_launcher_r)
        relay.close_output()


def test_out_of_descriptors_a_channel_is_refused_alone_and_the_others_go_on():
    host = _Host()
    relay = _relay(host)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
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
    finally:
        relay.stop()
        for sock in host.adopted:
            sock.close()
        os.close(host.to_launcher_w)
        relay.join(5)
        os.close(host.to_launcher_r)
        relay.close_output()


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
    import subprocess
    import sys

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
