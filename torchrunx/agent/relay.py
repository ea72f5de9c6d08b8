"""The relay on a host: the agent's and workers' connections carried on the agent's own stdio.

Started instead of the agent when the launch relays (``Launcher(relay="on")``, or ``"auto"``
and this host cannot open a connection to the launcher): it reads the bootstrap line, listens on
``127.0.0.1`` (an ephemeral port), and starts the agent as its child with that address in place
of the launcher's, so the agent and its workers connect here. Each connection becomes a channel
of :mod:`torchrunx.wire.relay`, written to this process's stdout; what the launcher sends comes on
its stdin. The agent's own stdout travels as :data:`~torchrunx.wire.relay.OUT` frames; its stderr
is this process's (plain lines, as without a relay).

The relay holds no key: the handshake and the sealed records run end to end between the agent or
worker and the launcher. It never blocks: every descriptor is non-blocking, and while more than
:data:`BUFFER_LIMIT` bytes wait for stdout it stops reading the connections (they wait in their
socket buffers), while more than that wait for the connections it stops reading stdin.

An EOF from the launcher ends a channel for good: once what came before it is written, the
connection is closed, whether or not its own side has ended (a connection the launcher refused,
say another user's idle one, costs this host nothing more). At most :data:`MAX_CHANNELS` channels
are open at once (more wait in the listening socket's backlog), and out of descriptors the relay
rests :data:`ACCEPT_PAUSE` before it accepts again.

An interior host of a tree start (``Launcher(tree_radix=...)``) also starts its children and
carries their connections (:mod:`torchrunx.agent.tree.starts`): it listens on ``127.0.0.1`` for
its agent and, for its children, on each of its addresses on its routes to them, bound to that
address only.

It ends with its agent (with its exit status). At EOF on stdin (the launcher is gone) it closes
the agent's stdin, which stops the agent as it would without a relay; it forwards SIGTERM to the
agent (a preemption notice) and ignores SIGINT, as the agent does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from torchrunx.agent.tree.starts import LOOPBACK, TreeStarts, child_listeners, child_routes
from torchrunx.errors import ProtocolError
from torchrunx.wire.bootstrap import BOOT_CODE, AgentBootstrap, agent_environ
from torchrunx.wire.relay import (
    DATA,
    EOF,
    MAX_DATA,
    OPEN,
    OUT,
    PIPE_SIZE,
    TREE,
    ByteQueue,
    FrameSplitter,
    frame,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

BUFFER_LIMIT = 16 << 20
"""Bytes waiting for stdout (or for the connections) above which the relay stops reading more."""
PROBE_TIMEOUT = 3.0
"""Seconds ``relay="auto"`` waits for its test connection to the launcher."""
_STOP_GRACE = 60.0
"""Seconds the agent has to end after the launcher is gone, before the relay SIGKILLs it."""
_END_GRACE = 10.0
"""Seconds the relay goes on writing after its agent ended (its last output, its channels)."""
MAX_CHANNELS = 256
"""Channels open at once; more connections wait, unaccepted, in the listening socket's backlog
(an agent and its workers need a few; the launcher sheds connections that do not authenticate)."""
ACCEPT_PAUSE = 0.1
"""Seconds the relay stops accepting after ``accept`` failed for want of descriptors."""
_LOOPBACK = ("127.", "::1", "::ffff:127.")


class _Channel:
    """One relayed connection: its socket here and the bytes waiting for it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = ByteQueue()
        """Bytes from the launcher, not yet written to the socket."""
        self.eof_from_launcher = False
        """The launcher's side ended: shut down writing once ``pending`` is written."""
        self.eof_to_launcher = False
        """This side ended (EOF read from the socket, sent as an EOF frame)."""
        self.shut = False


def reaches(address: tuple[str, int], timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether a TCP connection to ``address`` opens within ``timeout`` seconds."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:
        return False


def own_address(launcher: tuple[str, int]) -> str:
    """This host's address on its route to ``launcher`` (no packet sent); else its name's.

    The launcher gives it to the other hosts as ``MASTER_ADDR`` when rank 0 runs here.
    """
    with contextlib.suppress(OSError, IndexError):
        family, _, _, _, sockaddr = socket.getaddrinfo(*launcher, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0]).removeprefix("::ffff:")
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return socket.gethostname()


class HostRelay:
    """The relay's loop: the listening socket, the channels, stdin, stdout and the agent."""

    def __init__(
        self,
        listener: socket.socket | None,
        child: subprocess.Popen[bytes],
        opened: bytes = b"",
        tree: TreeStarts | None = None,
        more: Sequence[socket.socket] = (),
    ) -> None:
        """Relay for ``child`` (the agent), whose stdout is a pipe; ``listener``: None if direct.

        ``opened``: what each OPEN frame carries (this host's address, and the launcher's).
        ``tree``: the hosts this relay starts (tree start): their events go as TREE frames,
        and the relay ends once they have ended too; ``more``: where they connect (listening
        sockets beside ``listener``, each accepted from as it is).
        """
        self.listeners = [*([] if listener is None else [listener]), *more]
        self.opened = opened
        self.child = child
        self.tree = tree
        self.tree_out: int | None = None if tree is None else tree.read_fd
        self._tree_line = bytearray()
        self.max_channels = MAX_CHANNELS * (1 + (0 if tree is None else len(tree.children)))
        self.channels: dict[int, _Channel] = {}
        self.next_channel = 1
        self.out = ByteQueue()
        """Frames waiting for stdout."""
        self.splitter = FrameSplitter()
        self.stdin_open = True
        assert child.stdout is not None  # noqa: S101 (started with a pipe)
        self.child_out: int | None = child.stdout.fileno()
        self.exit_code: int | None = None
        self.accept_after = 0.0
        """Monotonic time before which the listener is not watched (after EMFILE)."""
        self.stopping_since: float | None = None
        self.ended_at: float | None = None
        for fd in (0, 1, self.child_out):
            os.set_blocking(fd, False)
            with contextlib.suppress(OSError):  # fewer, larger writes (not a pipe: no matter)
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        for each in self.listeners:
            each.setblocking(False)  # noqa: FBT003 (the socket API)
        self.pidfd = os.pidfd_open(child.pid)

    def run(self) -> int:
        """Relay until the agent has ended and its output is written; its exit status."""
        while not self._done():
            poller, handlers = self._poll_set()
            for fd, events in poller.poll(self._timeout_ms()):
                handlers[fd](events)
            self._check_deadlines()
        return self.exit_code if self.exit_code is not None else 1

    def _done(self) -> bool:
        if self.exit_code is None or self.child_out is not None or self.tree_out is not None:
            return False
        flushed = not self.out and (not self.channels or not self.stdin_open)
        return flushed or time.monotonic() - (self.ended_at or 0.0) > _END_GRACE

    def _timeout_ms(self) -> int:
        resting = self.accept_after - time.monotonic()
        return max(1, min(1000, int(resting * 1000) + 1)) if resting > 0 else 1000

    def _waiting(self) -> int:
        return sum(len(c.pending) for c in self.channels.values())

    def _poll_set(self) -> tuple[select.poll, dict[int, Callable[[int], None]]]:
        poller = select.poll()
        handlers: dict[int, Callable[[int], None]] = {}
        room = len(self.out) < BUFFER_LIMIT

        def watch(fd: int, mask: int, handler: Callable[[int], None]) -> None:
            poller.register(fd, mask)
            handlers[fd] = handler

        if self.stdin_open and self._waiting() < BUFFER_LIMIT:
            watch(0, select.POLLIN, lambda _e: self._read_stdin())
        if self.out:
            watch(1, select.POLLOUT, lambda _e: self._write_stdout())
        accepting = room and len(self.channels) < self.max_channels
        if accepting and time.monotonic() >= self.accept_after:
            for each in self.listeners:
                watch(each.fileno(), select.POLLIN, functools.partial(self._accept, each))
        if self.child_out is not None and room:
            watch(self.child_out, select.POLLIN, lambda _e: self._read_child())
        if self.tree_out is not None and room:
            watch(self.tree_out, select.POLLIN, lambda _e: self._read_tree())
        if self.exit_code is None:
            watch(self.pidfd, select.POLLIN, lambda _e: self._reap())
        self._watch_channels(watch, room=room)
        return poller, handlers

    def _watch_channels(
        self, watch: Callable[[int, int, Callable[[int], None]], None], *, room: bool
    ) -> None:
        for number, channel in self.channels.items():
            mask = (select.POLLIN if room and not channel.eof_to_launcher else 0) | (
                select.POLLOUT if channel.pending else 0
            )
            if mask:
                watch(channel.sock.fileno(), mask, functools.partial(self._on_channel, number))

    def _send(self, kind: int, channel: int, data: bytes = b"") -> None:
        for piece in frame(kind, channel, data):
            self.out.append(piece)

    def _write_stdout(self) -> None:
        try:
            self.out.write_to(functools.partial(os.writev, 1))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the launcher's end is gone: nothing more can reach it
            self.out.clear()
            self._launcher_gone()

    def _read_stdin(self) -> None:
        try:
            chunk = os.read(0, MAX_DATA)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._launcher_gone()
            return
        try:
            frames = self.splitter.feed(chunk)
        except ProtocolError as exc:
            sys.stderr.write(f"torchrunx relay: {exc}\n")
            self._launcher_gone()
            return
        for kind, number, data in frames:
            channel = self.channels.get(number)
            if channel is None:
                continue  # closed here already: what the launcher still sent is dropped
            if kind == DATA:
                channel.pending.append(data)
                self._flush_channel(number)
            elif kind == EOF:
                channel.eof_from_launcher = True
                self._flush_channel(number)

    def _launcher_gone(self) -> None:
        """Stdin ended (or stdout broke): stop the agent as its own EOF would, drop channels."""
        if not self.stdin_open:
            return
        self.stdin_open = False
        self.stopping_since = time.monotonic()
        if self.tree is not None:
            self.tree.stop()
        if self.child.stdin is not None:
            with contextlib.suppress(OSError):
                self.child.stdin.close()
        for number in list(self.channels):
            self._close_channel(number)
        for each in self.listeners:
            each.close()
        self.listeners = []

    def _accept(self, listener: socket.socket, _events: int) -> None:
        if listener not in self.listeners:  # closed earlier in this batch (the launcher is gone)
            return
        try:
            sock, peer = listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError:  # out of descriptors: rest; the connection waits in the backlog
            self.accept_after = time.monotonic() + ACCEPT_PAUSE
            return
        sock.setblocking(False)  # noqa: FBT003 (the socket API)
        number = self.next_channel
        self.next_channel += 1
        self.channels[number] = _Channel(sock)
        opened = self.opened
        if not str(peer[0]).startswith(_LOOPBACK):  # a child's (tree start): its own address
            opened = str(peer[0]).removeprefix("::ffff:").encode() + opened[opened.find(b"\n") :]
        self._send(OPEN, number, opened)

    def _on_channel(self, number: int, events: int) -> None:
        channel = self.channels.get(number)
        if channel is None:  # closed earlier in this batch
            return
        if events & select.POLLOUT:
            self._flush_channel(number)
        if number in self.channels and events & (select.POLLIN | select.POLLHUP | select.POLLERR):
            try:
                chunk = channel.sock.recv(MAX_DATA)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if chunk:
                self._send(DATA, number, chunk)
            else:
                channel.eof_to_launcher = True
                self._send(EOF, number)
                self._maybe_forget(number)

    def _flush_channel(self, number: int) -> None:
        channel = self.channels.get(number)
        if channel is None:
            return
        if channel.pending:
            try:
                channel.pending.write_to(channel.sock.sendmsg)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the agent or worker is gone: what it was sent is dropped
                channel.pending.clear()
                channel.eof_from_launcher = True
        if not channel.pending and channel.eof_from_launcher and not channel.shut:
            channel.shut = True
            with contextlib.suppress(OSError):
                channel.sock.shutdown(socket.SHUT_WR)
        self._maybe_forget(number)

    def _maybe_forget(self, number: int) -> None:
        """Close a channel once the launcher's EOF and what came before it are through."""
        channel = self.channels.get(number)
        if channel is not None and channel.shut:
            self._close_channel(number)

    def _close_channel(self, number: int) -> None:
        channel = self.channels.pop(number, None)
        if channel is not None:
            channel.sock.close()

    def _read_child(self) -> None:
        if self.child_out is None:  # closed earlier in this batch
            return
        try:
            chunk = os.read(self.child_out, MAX_DATA)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if chunk:
            if self.stdin_open:
                self._send(OUT, 0, chunk)
            return
        os.close(self.child_out)
        self.child_out = None

    def _read_tree(self) -> None:
        """Events of the hosts this relay started: each whole line goes as a TREE frame."""
        if self.tree_out is None:
            return
        try:
            chunk = os.read(self.tree_out, MAX_DATA)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            os.close(self.tree_out)
            self.tree_out = None
            return
        self._tree_line += chunk
        *lines, rest = bytes(self._tree_line).split(b"\n")
        self._tree_line = bytearray(rest)
        for line in lines:
            if self.stdin_open:
                self._send(TREE, 0, line[:MAX_DATA])

    def _reap(self) -> None:
        code = self.child.wait()
        self.exit_code = code if code >= 0 else 128 - code
        self.ended_at = time.monotonic()
        if self.exit_code != 0 and self.tree is not None:
            self.tree.stop()  # this host's agent failed: its children stop, and say so

    def _check_deadlines(self) -> None:
        since = self.stopping_since
        if since is not None and self.exit_code is None and time.monotonic() - since > _STOP_GRACE:
            with contextlib.suppress(ProcessLookupError):
                self.child.kill()
        if self.tree is not None:
            self.tree.check_deadline()


def _malformed(reason: str) -> NoReturn:
    sys.stderr.write(f"torchrunx relay: malformed bootstrap line ({reason})\n")
    sys.exit(2)


def main(line: bytes) -> None:
    """Entry point of the relay process (its boot code passes the bootstrap line)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        boot = AgentBootstrap.from_json_line(line)
    except ProtocolError as exc:
        _malformed(str(exc))
    finally:
        del line
    if not boot.relay:
        _malformed("malformed agent bootstrap: field 'relay' is missing")
    host, port = address = (boot.launcher_address, boot.launcher_port)
    full, tree = boot, bool(boot.tree)
    mode = boot.relay
    boot = dataclasses.replace(boot, relay="", tree=(), tree_script="", tree_ssh_config="")
    listener: socket.socket | None = None
    more: list[socket.socket] = []
    routes: dict[int, tuple[str, int]] = {}
    if tree:  # its children connect to it too, each on its route's address (tree/starts.py)
        listener, more, routes = _listen_for_tree(full)
        boot = dataclasses.replace(
            boot, launcher_address=LOOPBACK, launcher_port=listener.getsockname()[1]
        )
    elif mode != "auto" or not reaches(address):
        if mode == "auto":
            sys.stderr.write(
                f"torchrunx relay: this host cannot connect to the launcher at {host}:{port}: "
                "its connections are relayed over the agent's channel\n"
            )
        listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
        boot = dataclasses.replace(
            boot, launcher_address="127.0.0.1", launcher_port=listener.getsockname()[1]
        )
    child = subprocess.Popen(
        [sys.executable, "-u", "-c", BOOT_CODE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        close_fds=True,
        env=agent_environ(os.environ),  # nothing from the working folder, which it shares
    )
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    assert child.stdin is not None  # noqa: S101 (started with a pipe)
    with contextlib.suppress(OSError):  # it died at once: its stderr (ours) says why
        child.stdin.write(boot.to_json_line())
        child.stdin.flush()
    del boot  # the secret: no frame keeps it
    starts = TreeStarts(full, routes, _STOP_GRACE) if tree else None
    del full
    opened = f"{own_address(address)}\n{address[0]}".encode()
    code = HostRelay(listener, child, opened, starts, more).run()
    os._exit(code)


def _listen_for_tree(
    boot: AgentBootstrap,
) -> tuple[socket.socket, list[socket.socket], dict[int, tuple[str, int]]]:
    """An interior host's listening sockets, and the address and port each child is told.

    Its agent's socket (on ``127.0.0.1``), then its children's: one per address on its routes
    to them, bound to that address only (:func:`~torchrunx.agent.tree.starts.child_listeners`).
    """
    addresses = child_routes(boot.tree, boot.tree_ssh_config, own_address)
    try:
        listeners = child_listeners(addresses.values())
    except OSError as exc:
        where = ", ".join(sorted(set(addresses.values())))
        sys.stderr.write(f"torchrunx relay: cannot listen for its children on {where}: {exc}\n")
        sys.exit(1)
    ports = {address: each.getsockname()[1] for address, each in listeners.items()}
    own = listeners.pop(LOOPBACK)
    return own, list(listeners.values()), {i: (a, ports[a]) for i, a in addresses.items()}
