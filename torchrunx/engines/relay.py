"""The launcher's end of a relayed host: its channels handed to the listener as connections.

A relaying host (:mod:`torchrunx.agent.relay`) writes :mod:`torchrunx.wire.relay` frames on the
agent's stdout and reads them on its stdin. :class:`LauncherRelay` reads them in a thread of its
own: each channel the host opens becomes one end of a socket pair, whose other end the listener
adopts as if it had connected (:meth:`torchrunx.launcher.net.listener.Listener.adopt`): the
handshake, the sealed records and every message then run as for a direct connection. A second thread
reads the pairs and writes what the launcher sends, as frames, to the agent's stdin. The agent's own
stdout (:data:`~torchrunx.wire.relay.OUT` frames) is written to a pipe the launch's loop reads as
that agent's stdout.

The reading thread blocks only on the agent's stdout and on a pair the launch's loop reads (it
always does); the writing thread only on the agent's stdin. Neither waits for the other, so a
host that is slow to read its stdin never stops the launcher from reading what it sends.

A channel costs the launcher a descriptor only while the launcher uses it: once the launcher's
end closes (the connection is over, or its handshake failed, was too slow or was shed), its pair
is released at once and the host is told (an EOF from the launcher ends the channel there, see
:mod:`torchrunx.wire.relay`), whether or not the host's side ever ends. A channel that cannot
be opened (out of descriptors) is refused alone: the host is told to close it, and every other
channel goes on. So another user of a relaying host who opens idle connections to its relay
(the listener sheds them, :meth:`~torchrunx.launcher.net.listener.Listener.adopt`) cannot exhaust
the launcher's descriptors or end the host's other channels.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
from collections.abc import Callable

from torchrunx.errors import ProtocolError
from torchrunx.wire.relay import DATA, EOF, MAX_DATA, OPEN, OUT, TREE, FrameSplitter, frame

logger = logging.getLogger("torchrunx.relay")

OnTree = Callable[[bytes | None], None]
"""Receives a tree start's events from an interior host (a TREE frame's JSON), then ``None``
once that host's stream has ended (called from the relay's reading thread)."""

Adopt = Callable[[socket.socket, tuple[str, str]], None]
"""Hands a new connection to the launcher's listener (callable from any thread), with the
host's address and the launcher's as the host was given it."""


_PAIR_BUFFER = 4 << 20
"""Socket buffer asked for each end of a channel's socket pair."""


class _Pair:
    """One channel: the launcher's end of its socket pair, and which ways have ended."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.eof_from_host = False
        self.eof_to_host = False


class LauncherRelay:
    """One relayed host's channels, carried on its agent's stdin and stdout by two threads."""

    def __init__(  # noqa: PLR0913 (the host's streams, each its own argument)
        self,
        hostname: str,
        *,
        read_out: Callable[[], bytes],
        write_in: Callable[[bytes], None],
        close_in: Callable[[], None],
        adopt: Adopt,
        initial: bytes = b"",
        on_tree: OnTree | None = None,
    ) -> None:
        """Start relaying.

        Args:
            hostname: The host (for logs).
            read_out: Reads the agent's stdout (blocking; ``b""`` at its end).
            write_in: Writes all of a chunk to the agent's stdin (blocking).
            close_in: Closes the agent's stdin (the host's relay then stops its agent).
            adopt: Hands a new connection to the listener (from this object's thread).
            initial: The start of the agent's stdout, read already (after shipped code).
            on_tree: Gets the TREE frames of an interior host of a tree start, then ``None``.
        """
        self.hostname = hostname
        self._read_out = read_out
        self._write_in = write_in
        self._close_in = close_in
        self._adopt = adopt
        self._initial = initial
        self._on_tree = on_tree
        self._pairs: dict[int, _Pair] = {}
        self._fresh: list[int] = []
        """Channels opened since the writing thread last looked: it watches them from then on."""
        self._refused: list[int] = []
        """Channels the launcher could not open: the writing thread tells the host (EOF)."""
        self.refused = 0
        """Channels refused so far (out of descriptors)."""
        self._lock = threading.Lock()
        self._stopped = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._poller = select.epoll()
        """The writing thread's: the wake pipe and each pair the launcher may still write to."""
        self.out_read, self._out_write = os.pipe()
        """Read end of the agent's own stdout (OUT frames): the launch's loop reads it."""
        os.set_blocking(self.out_read, False)
        self.sent = 0
        """Bytes written to the agent's stdin."""
        self.received = 0
        """Bytes read from the agent's stdout."""
        self.broken: str | None = None
        """Why the host's stream is not the relay's (something else wrote to it), if it is not."""
        self._reader = threading.Thread(
            target=self._read_loop, name=f"torchrunx-relay-in-{hostname}", daemon=True
        )
        self._writer = threading.Thread(
            target=self._write_loop, name=f"torchrunx-relay-out-{hostname}", daemon=True
        )
        self._reader.start()
        self._writer.start()

    def _read_loop(self) -> None:
        splitter = FrameSplitter()
        try:
            chunk, self._initial = self._initial, b""
            while True:
                chunk = chunk or self._read_out()
                if not chunk:
                    break
                self.received += len(chunk)
                for kind, number, data in splitter.feed(chunk):
                    self._on_frame(kind, number, data)
                chunk = b""
        except ProtocolError as exc:
            self._broken(str(exc))
        except OSError:
            pass  # the agent's stdout is closed: the agent is gone
        finally:
            with contextlib.suppress(OSError):
                os.close(self._out_write)
            if self._on_tree is not None:
                self._on_tree(None)
            with self._lock:  # the host is gone: every channel ends on the launcher's side
                for pair in self._pairs.values():
                    pair.eof_from_host = True
                    with contextlib.suppress(OSError):
                        pair.sock.shutdown(socket.SHUT_WR)
            self._wake()

    def _broken(self, reason: str) -> None:
        """The stream is not the relay's: end this host now, not at its start timeout.

        Closing the agent's stdin stops the host's relay and agent (as when the launcher is
        gone); the rest of the stream is read and dropped, so the host is never blocked writing.
        """
        self.broken = reason
        logger.error("host %s: %s", self.hostname, reason)
        self.stop()
        with contextlib.suppress(OSError):
            self._close_in()
        with contextlib.suppress(OSError):
            while self._read_out():
                pass

    def _on_frame(self, kind: int, number: int, data: bytes) -> None:
        if kind == OUT:
            view = memoryview(data)
            while view:
                view = view[os.write(self._out_write, view) :]
            return
        if kind == OPEN:
            self._open(number, data)
            return
        if kind == TREE:
            if self._on_tree is not None:
                self._on_tree(data)
            return
        with self._lock:
            pair = self._pairs.get(number)
        if pair is None:
            return  # ended here already
        if kind == DATA:
            try:
                pair.sock.sendall(data)
            except OSError:  # the launcher closed it: the host's EOF comes
                return
        elif kind == EOF:
            pair.eof_from_host = True
            with contextlib.suppress(OSError):
                pair.sock.shutdown(socket.SHUT_WR)
            self._forget_if_done(number)

    def _open(self, number: int, data: bytes) -> None:
        """A connection the host opened: a socket pair, one end handed to the listener."""
        host, _, launcher = data.decode(errors="replace").partition("\n")
        try:
            ours, theirs = socket.socketpair()
        except OSError as exc:  # out of descriptors: this channel only is refused
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                logger.warning(
                    "host %s: cannot open a relayed connection (%s): refused (%d so far)",
                    self.hostname,
                    exc,
                    self.refused,
                )
            with self._lock:
                self._refused.append(number)
            self._wake()
            return
        for end in (ours, theirs):  # room for whole frames: fewer wake-ups of the loop
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _PAIR_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _PAIR_BUFFER)
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._pairs[number] = _Pair(ours)
                self._fresh.append(number)
        if stopped:  # after stop() closed every pair: this one would be left open
            ours.close()
            theirs.close()
            return
        self._adopt(theirs, (host, launcher))
        self._wake()

    def _forget_if_done(self, number: int) -> None:
        """Release a pair once the launcher's end has closed (the host's end may never)."""
        with self._lock:
            pair = self._pairs.get(number)
            if pair is not None and pair.eof_to_host:
                del self._pairs[number]
                pair.sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"\0")

    def _write_loop(self) -> None:
        """Pass what the launcher writes on each pair to the host, as frames, until stopped.

        One poller for the thread's life: a pair is watched from its opening (:attr:`_fresh`,
        with a wake) to the launcher's end of it, so a turn costs what is ready, not what is
        open (an interior host of a wide tree carries a channel per child).
        """
        poller = self._poller
        watched: dict[int, tuple[int, _Pair]] = {}
        try:
            poller.register(self._wake_read, select.EPOLLIN)
            while not self._stopped:
                for fd, _events in poller.poll():
                    if fd == self._wake_read:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_read, 4096)
                        self._send_refusals()
                        self._watch_fresh(poller, watched)
                        continue
                    entry = watched.get(fd)
                    if entry is None:
                        continue
                    number, pair = entry
                    if not self._pass_on(number, pair, poller):  # the launcher's end of it
                        del watched[fd]
        except OSError:
            pass  # the agent's stdin is closed: the agent is gone or stopping
        finally:
            poller.close()

    def _watch_fresh(self, poller: select.epoll, watched: dict[int, tuple[int, _Pair]]) -> None:
        with self._lock:
            fresh, self._fresh = self._fresh, []
            pairs = [(number, self._pairs.get(number)) for number in fresh]
        for number, pair in pairs:
            if pair is not None and not pair.eof_to_host:
                fd = pair.sock.fileno()
                poller.register(fd, select.EPOLLIN)
                watched[fd] = (number, pair)

    def _send_refusals(self) -> None:
        """Tell the host to close each channel that could not be opened here."""
        with self._lock:
            refused, self._refused = self._refused, []
        for number in refused:
            self._send(EOF, number)

    def _pass_on(self, number: int, pair: _Pair, poller: select.epoll) -> bool:
        """Pass one read of the pair on; False at the launcher's end of it (then unwatched).

        The pair leaves ``poller`` before it may be closed: its descriptor's number may be a
        new pair's a moment later.
        """
        try:
            data = pair.sock.recv(MAX_DATA)
        except OSError:
            data = b""
        if data:
            self._send(DATA, number, data)
            return True
        poller.unregister(pair.sock.fileno())
        pair.eof_to_host = True
        self._send(EOF, number)
        self._forget_if_done(number)
        return False

    def _send(self, kind: int, number: int, data: bytes = b"") -> None:
        self._write_in(b"".join(frame(kind, number, data)))
        self.sent += len(data)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop writing to the agent's stdin (before it is closed); close every channel.

        The reading thread ends by itself at the end of the agent's stdout.
        """
        self._stopped = True
        self._wake()
        self._writer.join(timeout)
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            pair.sock.close()

    def join(self, timeout: float) -> None:
        """Wait for the reading thread (the agent's stdout has ended), then release its pipes.

        A reading thread still blocked (a process the agent left holds its stdout open) keeps
        its pipe's write end; the read end closes with :meth:`close_output`.
        """
        self._reader.join(timeout)
        if not self._reader.is_alive() and not self._writer.is_alive():
            for fd in (self._wake_read, self._wake_write):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def close_output(self) -> None:
        """Close the read end of the agent's own stdout (once the loop has read it)."""
        with contextlib.suppress(OSError):
            os.close(self.out_read)
