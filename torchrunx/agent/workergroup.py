"""The worker group: the workers of one attempt on one host, as processes of the agent.

The group forks the workers (each with its stdout, stderr and stack pipes, its watchdog
page, see :mod:`torchrunx.timer`, and its channel: a socket pair that carries its messages
to and from the launcher through the agent), registers their descriptors on the agent's selector,
reads those descriptors when the agent's loop says they are ready, reaps each worker once its
pidfd tells it ended, signals workers, and ends them all with one :meth:`WorkerGroup.close`:
SIGTERM to every live worker's process group and to every other process the workers left
below the agent (daemons included, see :mod:`torchrunx.agent.leftovers`), a wait until the grace
period is over, then SIGKILL to all of them. That one path serves a ``Stop``, a restart, the
end of an attempt whose workers all returned, and the agent's final cleanup.

What the forked child does before it runs the function is in :mod:`torchrunx.agent.workerprocess`;
what is sent to the launcher is decided for the agent by :mod:`torchrunx.agent.attempt`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NoReturn

from torchrunx import preemption, timer
from torchrunx.agent import leftovers
from torchrunx.agent.outbox import Outbox
from torchrunx.wire.channel import ChannelReader
from torchrunx.wire.frozen import frozen
from torchrunx.wire.lines import LineSplitter

if TYPE_CHECKING:
    import mmap
    from collections.abc import Callable, Sequence

    from torchrunx.agent.leftovers import Proc
    from torchrunx.wire.messages import Message
    from torchrunx.wire.records import Frame

# The agent's records all carry this name (the launcher routes and filters them by it).
logger = logging.getLogger("torchrunx.agent")

STACK_DUMP_WAIT = 2.0
"""Seconds a worker gets to write its stacks after SIGUSR1 (:meth:`WorkerGroup.dump_stacks`).

A live worker answers at once (``faulthandler`` writes from its signal handler); the wait only
runs out for one that cannot (stopped, or not scheduled on a host under heavy load: 0.5 s was
too short there). Once every live worker has begun its dump, :data:`STACK_SETTLE` ends it.
"""
STACK_SETTLE = 0.05
"""Once a dump has begun, it is complete this soon after (faulthandler writes it in one go)."""
_STACK_BYTES = 16 * 1024  # the tail of a worker's stacks that is kept
_READ_SIZE = 65536
_STRAY_POLL = 0.05  # seconds between two looks for strays that outlive their SIGTERM


@dataclass(eq=False)
class Output:
    """One of a worker's output pipes (stdout or stderr), read by the agent."""

    fd: int
    is_stderr: bool
    splitter: LineSplitter = field(default_factory=LineSplitter)


@dataclass(eq=False)
class Channel:
    """The agent's end of a worker's channel: the socket pair's end, read and written."""

    sock: socket.socket
    reader: ChannelReader = field(default_factory=ChannelReader)
    outbox: Outbox = field(init=False)
    """What the launcher sent the worker (:class:`ToWorker`), written as the worker reads."""
    events: int = 0
    """What the selector watches the socket for now (0: not registered)."""

    def __post_init__(self) -> None:
        """Make the socket non-blocking and its outbox."""
        self.sock.settimeout(0.0)  # non-blocking: the agent's loop never waits on a worker
        self.outbox = Outbox(self.sock, None)  # plain frames (see torchrunx.wire.channel)


@dataclass(eq=False)
class Worker:
    """A forked worker and the agent's ends of its descriptors (compared by identity)."""

    local_rank: int
    pid: int
    pidfd: int
    stack_fd: int
    """Read end of the pipe the worker's ``faulthandler`` writes its stacks to; -1 once closed."""
    outputs: list[Output]
    """Its stdout and stderr pipes still open (a pipe leaves the list at its end)."""
    page: mmap.mmap
    """Shared with the worker: its watchdog deadline (see :mod:`torchrunx.timer`)."""
    notice: mmap.mmap
    """Shared with the worker: a preemption notice (see :mod:`torchrunx.preemption`)."""
    channel: Channel | None
    """Its channel to the launcher through the agent; ``None`` once ended."""
    stacks: bytearray = field(default_factory=bytearray)
    """What its stack pipe has brought so far (the last 16 KiB)."""
    ended: bool = False
    """Reaped: its pid may belong to another process now, never signal it."""
    signalled: bool = False
    """The agent sent it SIGTERM or SIGKILL: its end is not a failure of its own."""


@frozen
class Ready:
    """The ``data`` of a group descriptor on the selector: what became ready, and whose."""

    kind: Literal["exited", "output", "stacks", "channel"]
    worker: Worker
    output: Output | None = None


@frozen
class Fork:
    """What the group hands a forked child: the descriptors it keeps, and those it must close.

    Descriptors 1 and 2 of the child are not set yet:
    :func:`torchrunx.agent.workerprocess.become_worker`
    makes ``stdout`` and ``stderr`` its 1 and 2.
    """

    local_rank: int
    stdout: int
    stderr: int
    stack: int
    """Write end of its stack pipe, for ``faulthandler``."""
    channel: socket.socket
    """Its end of its channel (:class:`torchrunx.wire.channel.ChannelConnection`)."""
    page: mmap.mmap
    notice: mmap.mmap
    """Shared with the agent: a preemption notice (:mod:`torchrunx.preemption`)."""
    inherited: tuple[int, ...]
    """The agent's descriptors of this group (its siblings' and its own read ends): the child
    closes them."""


class WorkerGroup:
    """The workers of one attempt on this host (see the module's description)."""

    def __init__(
        self,
        selector: selectors.BaseSelector,
        *,
        root: int | None = None,
        on_channel_end: Callable[[Worker, bool], None] | None = None,
    ) -> None:
        """A group whose descriptors go on ``selector``.

        ``root``: this process's pid if it is a child subreaper whose only children are its
        workers (the agent): the group then also ends every other process below ``root``, the
        strays. ``None``: only the workers' process groups (in a process with other children).
        ``on_channel_end``: called once for each worker's channel when it ends, with whether
        it ended cleanly (between two frames, by the worker).
        """
        self.selector = selector
        self.root = root
        self.on_channel_end = on_channel_end
        self.workers: list[Worker] = []
        self.output_paused = False
        self.closed = False
        self.strays_termed_at: float | None = None
        """When :meth:`term_strays` sent the strays SIGTERM, if it did."""

    # -- start ------------------------------------------------------------------------------

    def start(self, count: int, become_worker: Callable[[Fork], NoReturn]) -> None:
        """Fork ``count`` workers; each child calls ``become_worker`` and never returns here.

        The agent must be single-threaded now (see :mod:`torchrunx.agent.preload`).
        """
        sys.stdout.flush()  # else a child would write the agent's buffered text again
        sys.stderr.flush()
        for local_rank in range(count):
            stack_read, stack_write = os.pipe()
            out_read, out_write = os.pipe()
            err_read, err_write = os.pipe()
            ours, theirs = socket.socketpair()
            page = timer.new_page()
            notice = preemption.new_page()
            pid = os.fork()
            if pid == 0:
                try:
                    inherited = (stack_read, out_read, err_read, ours.fileno(), *self._fds())
                    ends = (out_write, err_write, stack_write, theirs)
                    fork = Fork(local_rank, *ends, page, notice, inherited)
                    become_worker(fork)
                finally:
                    os._exit(1)  # never back into the agent's code
            for fd in (stack_write, out_write, err_write):
                os.close(fd)
            theirs.close()
            outputs = [Output(out_read, is_stderr=False), Output(err_read, is_stderr=True)]
            pidfd = os.pidfd_open(pid)
            worker = Worker(
                local_rank, pid, pidfd, stack_read, outputs, page, notice, Channel(ours)
            )
            self.workers.append(worker)
            self._watch_channel(worker)
            self.selector.register(worker.pidfd, selectors.EVENT_READ, Ready("exited", worker))
            os.set_blocking(stack_read, False)
            self.selector.register(stack_read, selectors.EVENT_READ, Ready("stacks", worker))
            for output in outputs:
                os.set_blocking(output.fd, False)
                if not self.output_paused:
                    self.selector.register(
                        output.fd, selectors.EVENT_READ, Ready("output", worker, output)
                    )

    def _fds(self) -> list[int]:
        fds = []
        for worker in self.workers:
            fds += [worker.pidfd, worker.stack_fd, *(output.fd for output in worker.outputs)]
            if worker.channel is not None:
                fds.append(worker.channel.sock.fileno())
        return [fd for fd in fds if fd >= 0]

    # -- state ------------------------------------------------------------------------------

    def live(self) -> list[Worker]:
        """The workers not reaped yet."""
        return [worker for worker in self.workers if not worker.ended]

    def all_ended(self) -> bool:
        """Whether every worker was reaped."""
        return all(worker.ended for worker in self.workers)

    def done(self) -> bool:
        """Whether every worker was reaped and its output pipes and channel read to their end."""
        return all(
            worker.ended and not worker.outputs and worker.channel is None
            for worker in self.workers
        )

    # -- reading ----------------------------------------------------------------------------

    def read_output(
        self, worker: Worker, output: Output, *, until_empty: bool = False
    ) -> list[str]:
        """The whole lines now available on one output pipe (the rest too at its end).

        Reads once, or until nothing is left with ``until_empty``. At its end the pipe is
        closed and leaves ``worker.outputs``; a pipe that already left gives nothing.
        """
        if output not in worker.outputs:
            # Its worker was reaped earlier in this round of the loop: read to its end, closed.
            return []
        lines: list[str] = []
        while True:
            try:
                chunk = os.read(output.fd, _READ_SIZE)
            except BlockingIOError:
                break
            lines += output.splitter.feed(chunk)
            if not chunk:
                with contextlib.suppress(KeyError):  # not registered while output is paused
                    self.selector.unregister(output.fd)
                os.close(output.fd)
                worker.outputs.remove(output)
                break
            if not until_empty:
                break
        return lines

    def read_stacks(self, worker: Worker) -> bool:
        """Add what the worker's stack pipe holds to ``worker.stacks``; whether anything came."""
        if worker.stack_fd < 0:
            return False
        try:
            chunk = os.read(worker.stack_fd, _READ_SIZE)
        except BlockingIOError:
            return False
        if not chunk:
            self.selector.unregister(worker.stack_fd)
            os.close(worker.stack_fd)
            worker.stack_fd = -1
            return False
        worker.stacks += chunk
        del worker.stacks[:-_STACK_BYTES]
        return True

    # -- channels ---------------------------------------------------------------------------

    def read_channel(
        self, worker: Worker, *, until_empty: bool = False
    ) -> tuple[list[Frame], bool]:
        """The whole frames the worker's channel holds now, and whether its stream is over.

        ``until_empty``: read until nothing is left (the worker has ended). The caller ends the
        channel (:meth:`end_channel`) after it has handled the frames; a channel that ended
        gives nothing.
        """
        channel = worker.channel
        if channel is None:
            return [], False
        return channel.reader.read(channel.sock, drain=until_empty)

    def channel_clean(self, worker: Worker) -> bool:
        """Whether the worker's channel ended between two frames (nothing was cut)."""
        channel = worker.channel
        return channel is not None and channel.reader.closed_by_peer

    def send_to(
        self,
        worker: Worker,
        message: Message,
        payload: Sequence[bytes | bytearray | memoryview] = (),
    ) -> None:
        """Queue a message for the worker on its channel; written as it reads (never blocks)."""
        if worker.channel is not None:
            worker.channel.outbox.put(message, payload)
            self._watch_channel(worker)

    def on_channel_writable(self, worker: Worker) -> None:
        """The worker's channel has room: write what waits for it."""
        if worker.channel is not None:
            worker.channel.outbox.flush()
            self._watch_channel(worker)

    def end_channel(self, worker: Worker, *, clean: bool = False) -> None:
        """Close the worker's channel (its end: it reads no more and may exit); once."""
        channel = worker.channel
        if channel is None:
            return
        worker.channel = None
        if channel.events:
            self.selector.unregister(channel.sock)
        with contextlib.suppress(OSError):
            channel.sock.shutdown(socket.SHUT_RDWR)
        channel.sock.close()
        if self.on_channel_end is not None:
            self.on_channel_end(worker, clean)

    def _watch_channel(self, worker: Worker) -> None:
        """Watch the channel for what it needs: reading (unless paused), room for writing."""
        channel = worker.channel
        if channel is None:
            return
        events = 0 if self.output_paused else selectors.EVENT_READ
        if channel.outbox.alive and len(channel.outbox):
            events |= selectors.EVENT_WRITE
        if events == channel.events:
            return
        if not events:
            self.selector.unregister(channel.sock)
        elif channel.events:
            self.selector.modify(channel.sock, events, Ready("channel", worker))
        else:
            self.selector.register(channel.sock, events, Ready("channel", worker))
        channel.events = events

    def pause_output(self, paused: bool) -> None:
        """Stop (or resume) watching the workers' output pipes and channels: backpressure."""
        if paused == self.output_paused:
            return
        self.output_paused = paused
        for worker in self.workers:
            self._watch_channel(worker)
            for output in worker.outputs:
                if paused:
                    self.selector.unregister(output.fd)
                else:
                    self.selector.register(
                        output.fd, selectors.EVENT_READ, Ready("output", worker, output)
                    )

    # -- ending -----------------------------------------------------------------------------

    def reap(self, worker: Worker) -> int:
        """Collect an ended worker (its pidfd is readable); return its exit code.

        A negative code is the signal that ended it. What the worker left running in its
        process group is killed with it.
        """
        _, status = os.waitpid(worker.pid, 0)
        self.selector.unregister(worker.pidfd)
        os.close(worker.pidfd)
        worker.pidfd = -1
        worker.ended = True
        # Whatever the worker started in its own process group goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        return os.waitstatus_to_exitcode(status)

    # -- strays -----------------------------------------------------------------------------

    def strays(self) -> list[Proc]:
        """Live processes below the agent outside every live worker and its process group.

        What the workers started and left: in a session of their own (daemons), or orphans
        adopted by the agent. Signals to the workers' groups do not reach them. Always empty
        without a ``root``.
        """
        if self.root is None:
            return []
        live = {worker.pid for worker in self.live()}  # a worker's process group id is its pid
        return [
            proc
            for proc in leftovers.descendants(self.root)
            if not proc.zombie and proc.pid not in live and proc.pgid not in live
        ]

    def term_strays(self) -> None:
        """Send SIGTERM to the strays, once: their grace period starts now (see :meth:`close`)."""
        if self.strays_termed_at is None:
            self.strays_termed_at = time.monotonic()
            for proc in self.strays():
                leftovers.send(proc, signal.SIGTERM)

    def reap_adopted(self) -> None:
        """Reap the orphans the agent adopted that ended; never a worker (see :meth:`reap`)."""
        if self.root is not None:
            leftovers.reap_adopted(keep={worker.pid for worker in self.live()})

    def dump_stacks(self, worker: Worker) -> None:
        """Ask a live worker for its Python stacks (SIGUSR1: ``faulthandler`` writes them)."""
        if not worker.ended:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGUSR1)

    def kill(self, worker: Worker) -> None:
        """SIGKILL a live worker's process group."""
        _signal_group(worker, signal.SIGKILL)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every live worker's process group."""
        for worker in self.live():
            _signal_group(worker, signum)

    def close(
        self,
        grace: float,
        wait: Callable[[float | None], None] | None = None,
        pause: Callable[[float], None] | None = None,
    ) -> None:
        """End every worker and stray, wait until each is reaped, release every descriptor.

        SIGTERM to every live worker's process group and to every stray (:meth:`strays`) not
        sent it yet, then ``wait(now + grace)``, and ``pause`` until the strays are gone or
        their grace period (from their SIGTERM) is over; SIGKILL to the groups of the workers
        still running and to the strays; then ``wait(None)``; then SIGKILL to whatever is
        still below the agent until nothing is, all reaped. ``wait(deadline)`` must return
        when every worker was reaped (:meth:`reap`) or ``deadline`` (monotonic; ``None``: no
        limit) passed; ``pause(deadline)`` must return at ``deadline``: the agent passes its
        loop for both, which goes on forwarding output, reporting exits and sending heartbeats
        meanwhile. Without them the group reaps by itself and reports nothing, and sleeps.
        With no grace, SIGKILL comes at once. Safe to call again: then it does nothing.
        """
        if self.closed:
            return
        wait = wait or self._wait
        pause = pause or _sleep_until
        if grace > 0:
            deadline = time.monotonic() + grace
            self.signal(signal.SIGTERM)
            self.term_strays()
            if self.live():
                wait(deadline)
            assert self.strays_termed_at is not None  # noqa: S101 (term_strays set it)
            deadline = min(deadline, self.strays_termed_at + grace)
            while time.monotonic() < deadline and self.strays():
                pause(min(deadline, time.monotonic() + _STRAY_POLL))
        self.signal(signal.SIGKILL)
        for proc in self.strays():  # they may hold the workers' pipes open: gone before the wait
            leftovers.send(proc, signal.SIGKILL)
        wait(None)
        if self.root is not None and (left := leftovers.kill_descendants(self.root)):
            # The workers are reaped: all of it goes, but one in uninterruptible sleep may not.
            logger.warning("could not end processes %s", [proc.pid for proc in left])
        self._release()

    def _wait(self, deadline: float | None) -> None:
        """Reap workers as they end, reporting nothing, until all ended or ``deadline``."""
        while live := self.live():
            poller = select.poll()
            for worker in live:
                poller.register(worker.pidfd, select.POLLIN)
            if deadline is None:
                ready = poller.poll()
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                ready = poller.poll(max(int(left * 1000), 1))
            for worker in live:
                if any(fd == worker.pidfd for fd, _ in ready):
                    self.reap(worker)

    def _release(self) -> None:
        """Close every descriptor and page of the group (all workers were reaped)."""
        self.closed = True
        for worker in self.workers:
            if worker.stack_fd >= 0:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(worker.stack_fd)
                os.close(worker.stack_fd)
                worker.stack_fd = -1
            for output in worker.outputs:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(output.fd)
                os.close(output.fd)
            worker.outputs.clear()
            self.end_channel(worker)
            worker.page.close()
            worker.notice.close()


def _sleep_until(deadline: float) -> None:
    time.sleep(max(deadline - time.monotonic(), 0.0))


def _signal_group(worker: Worker, signum: int) -> None:
    """Send ``signum`` to a live worker's process group, or to the worker if it has none yet."""
    if worker.ended:  # never signal a reaped pid: it may belong to someone else now
        return
    worker.signalled = worker.signalled or signum in (signal.SIGTERM, signal.SIGKILL)
    if signum == signal.SIGTERM:  # this SIGTERM ends the worker: it is no preemption notice
        preemption.mark_stopping(worker.notice)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            os.killpg(worker.pid, signum)
        except ProcessLookupError:
            # Just forked, it has not made its own group yet (setsid): the worker alone.
            os.kill(worker.pid, signum)
