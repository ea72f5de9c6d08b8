"""The agent's timers: heartbeats, the launcher's silence, and workers that overrun a timer.

- :class:`Heartbeats`: the agent sends a heartbeat every ``heartbeat_interval`` seconds, and
  takes the launcher for gone after ``agent_timeout`` seconds without any message from it.
- :class:`HangWatch`: a worker in a ``torchrunx.timer.expires`` block writes the block's
  deadline into a page it shares with the agent (:mod:`torchrunx.timer`, the worker's side).
  Once a worker has used a timer, the agent reads its page every 0.1 s; a worker past its
  deadline is asked for its Python stacks (SIGUSR1), and once they are in (or 0.5 s later) a
  :class:`WorkerTimedOut` with them goes to the launcher and the worker's process group is
  killed. The launcher decides what happens next (a stop, or a restart).

Neither waits: the agent's loop asks each for its next deadline and calls it back then.
"""

from __future__ import annotations

import logging
import select
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchrunx import timer
from torchrunx.agent.workergroup import STACK_DUMP_WAIT, STACK_SETTLE
from torchrunx.wire.messages import WorkerTimedOut

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable

    from torchrunx.agent.workergroup import Worker, WorkerGroup
    from torchrunx.wire.messages import Message

# The agent's records all carry this name (the launcher routes and filters them by it).
logger = logging.getLogger("torchrunx.agent")

_TIMER_POLL = 0.1


class Heartbeats:
    """When the agent's next heartbeat is due, and whether the launcher went silent."""

    def __init__(self, interval: float, timeout: float) -> None:
        """Heartbeats every ``interval`` s; silent after ``timeout`` s (``agent_timeout``)."""
        self.interval = interval
        self.timeout = timeout
        now = time.monotonic()
        self.last_heard = now
        self.next_beat = now

    def heard(self) -> None:
        """A message came from the launcher: it is alive."""
        self.last_heard = time.monotonic()

    def due(self, now: float) -> bool:
        """Whether a heartbeat is due now; if so, the next one is scheduled."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.interval
        return True

    def silent_for(self, now: float, sock: socket.socket) -> float | None:
        """Seconds the launcher has been silent if more than the timeout, else ``None``.

        A message waiting unread on ``sock`` counts as heard: after a stall (a long import
        holding the GIL) heartbeats may be waiting there.
        """
        silent = now - self.last_heard
        if silent <= self.timeout or select.select([sock], [], [], 0)[0]:
            return None
        return silent

    def next_deadline(self, *, launcher_alive: bool) -> float:
        """When the loop must call back: the next heartbeat, or the end of the silence."""
        if not launcher_alive:
            return self.next_beat
        return min(self.next_beat, self.last_heard + self.timeout)


@dataclass
class _Hang:
    scope: str
    limit: float
    report_by: float
    reported: bool = False


class HangWatch:
    """Reports the workers of one group that overran a timer (see the module)."""

    def __init__(self, group: WorkerGroup, send: Callable[[Message], None]) -> None:
        """Watch ``group``'s workers; ``send`` queues a message for the launcher."""
        self.group = group
        self.send = send
        self.hangs: dict[Worker, _Hang] = {}
        self.next_poll = 0.0

    def check(self, now: float, *, stopping: bool) -> None:
        """Read the timer pages (every 0.1 s, unless ``stopping``); report what is due."""
        if now >= self.next_poll:
            self.next_poll = now + _TIMER_POLL
            for worker in self.group.workers:
                if worker.ended or worker in self.hangs or stopping:
                    continue
                armed = timer.read_page(worker.page)
                if armed is not None and now >= armed[0]:
                    _, limit, scope = armed
                    logger.warning(
                        "worker %d stayed in timer scope %r longer than %g s: dumping its stack",
                        worker.local_rank,
                        scope,
                        limit,
                    )
                    worker.stacks.clear()
                    self.hangs[worker] = _Hang(scope, limit, now + STACK_DUMP_WAIT)
                    self.group.dump_stacks(worker)
        for worker, hang in self.hangs.items():
            if not worker.ended and not hang.reported and now >= hang.report_by:
                self._report(worker, hang)

    def stacks_arrived(self, worker: Worker, now: float) -> None:
        """A worker's stack dump has begun: report its hang once the dump is complete."""
        hang = self.hangs.get(worker)
        if hang is not None and not hang.reported:
            hang.report_by = min(hang.report_by, now + STACK_SETTLE)

    def asked(self, worker: Worker) -> bool:
        """Whether this watch asked ``worker`` for stacks it has not reported yet."""
        hang = self.hangs.get(worker)
        return hang is not None and not hang.reported

    def before_reap(self, worker: Worker) -> None:
        """A worker ended: report its hang now if it overran its timer (the dump killed it?)."""
        hang = self.hangs.get(worker)
        if hang is not None and not hang.reported:
            self._report(worker, hang)

    def next_deadline(self) -> float | None:
        """When :meth:`check` must run next: the next page poll or report, if any."""
        deadlines = [hang.report_by for hang in self.hangs.values() if not hang.reported]
        if any(not w.ended and timer.page_used(w.page) for w in self.group.workers):
            deadlines.append(self.next_poll)
        return min(deadlines, default=None)

    def _report(self, worker: Worker, hang: _Hang) -> None:
        self.group.read_stacks(worker)
        hang.reported = True
        stack = worker.stacks.decode(errors="replace")
        worker.stacks.clear()
        self.send(WorkerTimedOut(worker.local_rank, hang.scope, hang.limit, stack))
        # The launcher decides what happens next (stop, or restart); the worker is no use.
        self.group.kill(worker)
