"""One attempt's workers as the agent serves them: what it reports, their stacks, the drain.

The :class:`~torchrunx.agent.workergroup.WorkerGroup` forks, reads, reaps and signals the
workers; :class:`Attempt` decides what of that goes to the launcher: each worker's output as
:class:`LogLines` (see :mod:`torchrunx.wire.lines`; its last lines before its death notice), its
messages (hello, result or exception, debugger) as :class:`FromWorker`, the end of its channel
as :class:`WorkerChannelClosed`, its exit as :class:`WorkerExited` (after all of those), and
on a stop that asks for them, the live workers' Python stacks as :class:`WorkerStacks`. It
also runs the attempt's timers: the hang watch (:class:`~torchrunx.agent.watchdog.HangWatch`),
the reaping of processes adopted from the
workers, and the short drain of the pipes once every worker has ended.

The agent (:mod:`torchrunx.agent.agent`) makes one per attempt, forks the workers through its
group, dispatches the group's events to :meth:`Attempt.on_ready`, and owns the loop that serves
it all.
"""

from __future__ import annotations

import logging
import selectors
import signal
import time
from typing import TYPE_CHECKING

from torchrunx.agent.memory import read_facts, sigkill_cause
from torchrunx.agent.watchdog import HangWatch
from torchrunx.agent.workergroup import STACK_DUMP_WAIT, STACK_SETTLE, WorkerGroup
from torchrunx.wire.lines import STACKS_LOGGER, line_records
from torchrunx.wire.messages import (
    WORKER_MESSAGE_TYPES,
    DebugInput,
    FromWorker,
    LogLines,
    ToWorker,
    WorkerCall,
    WorkerChannelClosed,
    WorkerExited,
    WorkerHello,
    WorkerStacks,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from torchrunx.agent.workergroup import Output, Ready, Worker
    from torchrunx.wire.lines import Record
    from torchrunx.wire.messages import Message
    from torchrunx.wire.records import Frame

logger = logging.getLogger("torchrunx.agent")

_DRAIN_WAIT = 1.0


class Attempt:
    """The workers of one attempt and what the agent tells the launcher about them."""

    def __init__(
        self,
        selector: selectors.BaseSelector,
        *,
        root: int | None,
        send: Callable[[Message], None],
        forward: Callable[[Message, Sequence[bytes | bytearray | memoryview]], None],
    ) -> None:
        """An empty group on the agent's ``selector``.

        ``root``: the agent's pid (None: end only the group's own workers, in a process whose
        other children are not the group's). ``send``: queues a message for the launcher;
        ``forward``: the same with payload parts.
        """
        self.group = WorkerGroup(selector, root=root, on_channel_end=self._channel_ended)
        self.memory = read_facts()
        """The kernel's OOM counts when the attempt began (a SIGKILL is compared with them)."""
        self.hangs = HangWatch(self.group, send)
        self.send = send
        self.forward = forward
        self.dump_deadline: float | None = None
        self.drain_deadline: float | None = None
        self.shown_by: dict[Worker, float] = {}
        """Workers whose stacks came unasked (``kill -USR1``): forwarded then as their output."""
        self.show_deadline: float | None = None
        """When the stacks the launcher asked for (:class:`ShowStacks`) are sent, at the latest."""

    def done(self) -> bool:
        """Every worker was reaped and its output read, or the drain after that is over."""
        if self.group.done():
            return True
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    def on_timers(self, now: float, *, stopping: bool) -> None:
        """Look for hung workers, reap adopted processes, start the drain once all ended.

        Also forwards the stacks a worker wrote unasked, once they are complete.
        """
        for worker, due in list(self.shown_by.items()):
            if now >= due:
                self._show_stacks(worker)
        if self.show_deadline is not None and now >= self.show_deadline:
            self._send_shown()
        self.hangs.check(now, stopping=stopping)
        self.group.reap_adopted()
        if self.drain_deadline is None and self.group.all_ended():
            # Something the workers started outside their process group may hold the
            # pipes open: it is told to end now; read what comes for a moment, then give
            # up on it (the group's close kills it).
            self.group.term_strays()
            self.drain_deadline = now + _DRAIN_WAIT

    def deadlines(self) -> list[float]:
        """When :meth:`on_timers` or a wait of this attempt has something to do (monotonic)."""
        timers = [t for t in (self.dump_deadline, self.drain_deadline) if t is not None]
        timers.extend(self.shown_by.values())
        if self.show_deadline is not None:
            timers.append(self.show_deadline)
        if (hang_deadline := self.hangs.next_deadline()) is not None:
            timers.append(hang_deadline)
        return timers

    def on_ready(self, ready: Ready, events: int) -> None:
        """One of the group's descriptors is ready: a worker's end, output, stacks or channel."""
        if ready.kind == "exited":
            self._on_exited(ready.worker)
        elif ready.kind == "output" and ready.output is not None:
            self._forward_output(ready.worker, ready.output)
        elif ready.kind == "stacks":
            self._on_stacks(ready.worker)
        elif ready.kind == "channel":
            if events & selectors.EVENT_WRITE:
                self.group.on_channel_writable(ready.worker)
            if events & selectors.EVENT_READ:
                self._forward_channel(ready.worker)

    def _forward_channel(self, worker: Worker, *, until_empty: bool = False) -> None:
        """Send what the worker sent to the launcher, each as :class:`FromWorker`, in order.

        At the channel's end, :class:`WorkerChannelClosed` follows them.
        """
        frames, ended = self.group.read_channel(worker, until_empty=until_empty)
        self._forward_frames(worker, frames)
        if ended:
            self.group.end_channel(worker, clean=self.group.channel_clean(worker))

    def _forward_frames(self, worker: Worker, frames: list[Frame]) -> None:
        for message, payload in frames:
            if worker.channel is None:
                return  # ended below for a message that is not a worker's: the rest goes too
            if not isinstance(message, WORKER_MESSAGE_TYPES):
                logger.warning(
                    "worker %d sent %s on its channel, not a worker's message: closing it",
                    worker.local_rank,
                    type(message).__name__,
                )
                self.group.end_channel(worker)
            elif isinstance(message, WorkerHello) and (
                message.pid != worker.pid or message.local_rank != worker.local_rank
            ):
                # Not the process this agent forked for that local rank (a child that kept
                # the channel, say): the launcher would bind the rank to another pid.
                logger.warning(
                    "a hello for local rank %d, pid %d, came on the channel of worker %d "
                    "(pid %d): closing it",
                    message.local_rank,
                    message.pid,
                    worker.local_rank,
                    worker.pid,
                )
                self.group.end_channel(worker)
            else:
                self.forward(FromWorker(worker.local_rank, message), payload)

    def _channel_ended(self, worker: Worker, clean: bool) -> None:
        self.send(WorkerChannelClosed(worker.local_rank, clean))

    def to_worker(
        self, message: ToWorker, payload: Sequence[bytes | bytearray | memoryview]
    ) -> None:
        """The launcher's message for one of these workers (by pid); a gone one's is dropped.

        Only what a worker reads is written to its channel (a run's call, debugger input);
        ``None`` ends its channel.
        """
        for worker in self.group.workers:
            if worker.pid == message.pid and not worker.ended:
                if message.message is None:
                    self.group.end_channel(worker)
                elif isinstance(message.message, WorkerCall | DebugInput):
                    self.group.send_to(worker, message.message, payload)
                return

    def _forward_output(self, worker: Worker, output: Output, *, until_empty: bool = False) -> None:
        """Send the whole lines available on one output pipe as :class:`LogLines`."""
        lines = self.group.read_output(worker, output, until_empty=until_empty)
        if lines:
            name = f"worker.{worker.local_rank}.{'stderr' if output.is_stderr else 'stdout'}"
            records = line_records(
                lines,
                is_stderr=output.is_stderr,
                default_name=name,
                local_rank=worker.local_rank,
                created=time.time(),
            )
            self.send(LogLines(tuple(records)))

    def _on_exited(self, worker: Worker) -> None:
        for output in list(worker.outputs):  # its last words go out before its death notice
            self._forward_output(worker, output, until_empty=True)
        self._forward_channel(worker, until_empty=True)  # and its outcome
        if worker in self.shown_by:
            self._show_stacks(worker)
        self.hangs.before_reap(worker)
        exitcode = self.group.reap(worker)
        sig = -exitcode if exitcode < 0 else None
        logger.info(
            "worker %d (pid %d) exited with status %d", worker.local_rank, worker.pid, exitcode
        )
        killed = sig == signal.SIGKILL and not worker.signalled
        self.send(
            WorkerExited(
                worker.local_rank,
                worker.pid,
                None if sig else exitcode,
                sig,
                stopped=worker.signalled,
                at=time.time(),
                cause=sigkill_cause(self.memory, read_facts()) if killed else "",
            )
        )

    def _on_stacks(self, worker: Worker) -> None:
        if not self.group.read_stacks(worker):
            return
        now = time.monotonic()
        self.hangs.stacks_arrived(worker, now)
        if self.show_deadline is not None:  # the launcher asked (ShowStacks)
            if all(w.stacks for w in self.group.live()):
                self.show_deadline = min(self.show_deadline, now + STACK_SETTLE)
        elif self.dump_deadline is None and not self.hangs.asked(worker):
            # Unasked: someone sent the worker SIGUSR1 to see where it is. Shown once the dump,
            # written in one go, is complete.
            self.shown_by.setdefault(worker, now + STACK_SETTLE)
        if self.dump_deadline is not None and all(w.stacks for w in self.group.live()):
            # Every live worker has begun its dump; a dump is written in one go.
            self.dump_deadline = min(self.dump_deadline, now + STACK_SETTLE)

    def show_stacks(self) -> None:
        """The launcher asks where every worker is: ask each live one for its stacks.

        They are sent (:class:`WorkerStacks` with ``shown``) once every live worker has
        written its dump, or after :data:`STACK_DUMP_WAIT`; the workers go on. A request
        while one is under way is answered by it.
        """
        if self.show_deadline is not None:
            return
        for worker in self.group.live():
            worker.stacks.clear()
            self.shown_by.pop(worker, None)
            self.group.dump_stacks(worker)
        self.show_deadline = time.monotonic() + STACK_DUMP_WAIT

    def _send_shown(self) -> None:
        self.show_deadline = None
        stacks = {}
        for worker in self.group.live():
            self.group.read_stacks(worker)
            if worker.stacks:
                stacks[worker.local_rank] = worker.stacks.decode(errors="replace")
                worker.stacks.clear()
        self.send(WorkerStacks(stacks, shown=True))

    def _show_stacks(self, worker: Worker) -> None:
        """Forward the stacks ``worker`` wrote unasked as a record of its own output."""
        del self.shown_by[worker]
        self.group.read_stacks(worker)
        text = worker.stacks.decode(errors="replace").rstrip()
        worker.stacks.clear()
        if not text:
            return
        logger.info("worker %d (pid %d) wrote its Python stacks", worker.local_rank, worker.pid)
        self.send(LogLines((stacks_record(worker.local_rank, worker.pid, text, time.time()),)))

    def _dump_over(self) -> bool:
        # _on_stacks brings the deadline forward once every live worker has begun its dump.
        deadline = self.dump_deadline
        return self.done() or deadline is None or time.monotonic() >= deadline

    def dump_stacks(self, serve: Callable[[Callable[[], bool]], None]) -> None:
        """Ask every live worker for its stacks; send them, unless all workers ended first.

        ``serve``: the agent's loop, run until the function it is given returns true.
        """
        group = self.group
        self.shown_by.clear()  # what came unasked is part of this dump
        if self.show_deadline is not None:  # a look under way: these stacks answer it below
            self.show_deadline = None
            self.send(WorkerStacks({}, shown=True))
        for worker in group.live():
            group.dump_stacks(worker)
        self.dump_deadline = time.monotonic() + STACK_DUMP_WAIT
        serve(self._dump_over)
        self.dump_deadline = None
        if self.done():
            return
        stacks = {}
        for worker in group.workers:
            group.read_stacks(worker)
            if not worker.ended and worker.stacks:
                stacks[worker.local_rank] = worker.stacks.decode(errors="replace")
        self.send(WorkerStacks(stacks))


def stacks_record(local_rank: int, pid: int, stacks: str, now: float) -> Record:
    """The record of a worker's own output that carries the stacks it wrote on SIGUSR1."""
    message = f"Python stacks of worker {local_rank} (pid {pid}), on SIGUSR1:"
    return (local_rank, logging.WARNING, STACKS_LOGGER, f"{message}\n{stacks}", now)
