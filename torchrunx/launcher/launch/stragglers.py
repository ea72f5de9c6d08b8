r"""Straggler detection: a rank that enters collectives last again and again, named while it runs.

While an attempt's ranks run, :class:`Stragglers` (the launch's part) asks every live agent,
every :data:`STRAGGLER_EVERY` seconds, for its workers' collective timings
(:class:`~torchrunx.wire.messages.AskTimings`; each worker's probe answers with
:class:`~torchrunx.wire.messages.RankTimings`, the group, sequence number and creation time of
its newest collectives, see :mod:`torchrunx.worker.stallprobe`). Once every live rank answered,
or :data:`ANSWER_WAIT` passed, :func:`~torchrunx.launcher.state.hangs.find_stragglers` compares
them with ``Launcher.straggler_threshold`` as the lateness: a rank named for the first time in
the run is logged as a warning and sent as a :class:`~torchrunx.events.StragglerFound` event.
Each rank also sends its timings before its outcome, so that the run's end compares the last
collectives too; the ranks named in the run are in ``LaunchFinished.stragglers`` and
``LaunchResult.stragglers``. Ctrl-\ (the collective view) adds the stragglers of the entries
it gathered.

:class:`StragglerWatch` holds what that needs, with no I/O: when to ask, the ranks' latest
timings, their clocks' offsets, whom it named.

Hosts' clocks differ: each answer carries the worker's clock when it was sent, and the
launcher's clock when it arrived less that is the offset plus the message's delay; the
largest of a rank's last :data:`OFFSET_SAMPLES` (the least delayed) is taken as its offset.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchrunx.events import StragglerFound
from torchrunx.launcher.state.hangs import (
    CollectiveEntry,
    Straggler,
    StragglerRule,
    find_stragglers,
    ranks_text,
)
from torchrunx.launcher.state.records import Phase
from torchrunx.wire.messages import AskTimings

if TYPE_CHECKING:
    from collections.abc import Iterable

    from torchrunx.events import EventSink
    from torchrunx.launcher.launch.inbox import Inbox
    from torchrunx.launcher.settings.plan import LaunchPlan
    from torchrunx.launcher.state.state import LaunchState
    from torchrunx.wire.messages import RankState, RankTimings

logger = logging.getLogger("torchrunx.launcher")

STRAGGLER_EVERY = 2.0
"""Seconds between two requests for every rank's timings (each costs a worker about 6 ms)."""
ANSWER_WAIT = 1.0
"""Seconds a request waits for the ranks' answers before it compares what came."""
OFFSET_SAMPLES = 8
"""A rank's answers whose clock offsets are kept; the least delayed one counts."""
DEFAULT_STRAGGLER_THRESHOLD = 0.1
"""``Launcher.straggler_threshold``'s default, in seconds."""


def check_straggler_threshold(value: object) -> None:
    """``straggler_threshold``: None, or a positive number of seconds.

    Raises:
        ValueError: Anything else.
    """
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf
    ):
        raise ValueError(
            f"straggler_threshold must be a positive number of seconds (a rank's median "
            f"lateness into collectives), or None to turn straggler detection off, got {value!r}"
        )


def entries_of(timings: RankTimings) -> tuple[CollectiveEntry, ...]:
    """A rank's timings as the rule's entries."""
    return tuple(
        CollectiveEntry(group, seq, "", done=True, created_ns=created)
        for group, seq, created in timings.entries
    )


@dataclass
class TimingsRound:
    """One request for every live rank's timings: who was asked, who answered, by when."""

    ranks: set[int]
    deadline: float
    answered: set[int] = field(default_factory=set)

    def due(self, now: float) -> bool:
        """Every rank answered, or the wait is over."""
        return self.ranks <= self.answered or now >= self.deadline


class StragglerWatch:
    """The straggler clock of a launch, the ranks' latest timings, and whom it named."""

    def __init__(self, threshold: float | None) -> None:
        """``threshold``: ``Launcher.straggler_threshold`` (None: no request, no warning)."""
        self.rule = None if threshold is None else StragglerRule(threshold_s=threshold)
        self.attempt: int | None = None
        self.running = False
        self.next_ask = 0.0
        self.round: TimingsRound | None = None
        self.latest: dict[int, tuple[CollectiveEntry, ...]] = {}
        """Each rank's newest timings, this attempt's."""
        self._offsets: dict[int, collections.deque[int]] = {}
        self.named: dict[int, Straggler] = {}
        """Every rank named in this run, with its figures when it was last named."""
        self.current: tuple[Straggler, ...] = ()
        """The stragglers of the newest comparison (replaced whole: other threads read it)."""
        self.last_run: tuple[str, ...] = ()
        """The ranks named in the run that ended last, as sentences (:meth:`end_run`)."""
        self.since_ns = 0
        """When the last run ended (the launcher's wall clock): a warm run's workers that stay
        keep the last run's collectives in their recorder, which this run does not compare."""

    def run_state(self, attempt: int | None, now: float) -> None:
        """The attempt running now (None: none runs); a new one's ranks start afresh."""
        self.running = attempt is not None
        if attempt is not None and attempt != self.attempt:
            self.attempt = attempt
            self.latest.clear()
            self._offsets.clear()
            self.round, self.current = None, ()
            self.next_ask = now + STRAGGLER_EVERY

    def due(self, now: float) -> bool:
        """Whether to ask every rank for its timings now."""
        return (
            self.rule is not None and self.running and self.round is None and now >= self.next_ask
        )

    def next_due(self) -> float | None:
        """When the next request or comparison is due (monotonic), if one can be."""
        if self.rule is None or not self.running:
            return None
        return self.next_ask if self.round is None else self.round.deadline

    def begin(self, ranks: set[int], now: float) -> None:
        """The request to the live ``ranks`` (sent already) starts."""
        self.round = TimingsRound(ranks, now + ANSWER_WAIT)
        self.next_ask = now + STRAGGLER_EVERY

    def answer(self, rank: int, timings: RankTimings, received_ns: int) -> None:
        """A rank's timings, which arrived at ``received_ns`` (the launcher's wall clock)."""
        self.latest[rank] = entries_of(timings)
        samples = self._offsets.setdefault(rank, collections.deque(maxlen=OFFSET_SAMPLES))
        samples.append(timings.sent_ns - received_ns)
        if self.round is not None:
            self.round.answered.add(rank)

    def offsets(self) -> dict[int, int]:
        """Each rank's clock minus the launcher's, in ns (its least delayed answer's)."""
        return {rank: max(samples) for rank, samples in self._offsets.items() if samples}

    def compare(self, ranks: Iterable[int]) -> list[Straggler]:
        """Compare the timings of ``ranks``; the ranks named for the first time in this run.

        The round is over. Nothing is compared unless every one of ``ranks`` sent timings.
        """
        self.round = None
        wanted = sorted(ranks)
        if self.rule is None or not wanted or any(r not in self.latest for r in wanted):
            return []
        offsets = self.offsets()
        entries = {
            rank: tuple(
                e for e in self.latest[rank] if e.created_ns - offsets[rank] > self.since_ns
            )
            for rank in wanted  # a rank's timings came with its offset (answer)
        }
        found = find_stragglers(entries, self.rule, offsets)
        self.current = tuple(found)
        new = [s for s in found if s.rank not in self.named]
        self.named.update({s.rank: s for s in found})
        return new

    def end_run(self, now_ns: int) -> tuple[str, ...]:
        """The run is over (at ``now_ns``): the ranks named in it; the next run starts afresh."""
        self.last_run = tuple(str(s) for _, s in sorted(self.named.items()))
        self.named.clear()
        self.latest.clear()
        self.since_ns = now_ns
        return self.last_run

    def view_lines(self, states: dict[int, RankState]) -> list[str]:
        r"""For the collective view (Ctrl-\): the stragglers in the entries it gathered."""
        rule = self.rule or StragglerRule(threshold_s=DEFAULT_STRAGGLER_THRESHOLD)
        entries = {
            rank: tuple(CollectiveEntry(*raw) for raw in state.entries)
            for rank, state in states.items()
        }
        found = find_stragglers(entries, rule, self.offsets())
        if found:
            return [f"straggler: {s}" for s in found]
        if len(states) < 2:  # one rank has nobody to be late after
            return []
        ranks = ranks_text(sorted(states))
        threshold = f"{rule.threshold_s:g} s"
        return [
            f"no straggler: no rank of {ranks} entered most recent collectives last by {threshold}"
        ]


class Stragglers:
    """The launch's part that runs the watch: asks the agents, warns, tells the event handlers."""

    def __init__(self, plan: LaunchPlan, state: LaunchState, inbox: Inbox, sink: EventSink) -> None:
        """The parts of the launch it reads and sends through."""
        self.threshold = plan.observability.straggler_threshold
        self.watch = StragglerWatch(self.threshold)
        self.state, self.inbox, self.sink = state, inbox, sink

    def turn(self, now: float) -> None:
        """A turn of the launch's loop: ask every live rank for its timings, or compare."""
        st, watch = self.state, self.watch
        running = st.phase is Phase.RUNNING and not st.progress.stopping
        watch.run_state(st.attempt if running else None, now)
        if watch.due(now):
            agents = [a for a in st.agents if a.conn is not None and not a.over]
            for agent in agents:
                self.inbox.peer_of(agent).send(AskTimings())
            live = {r.rank for r in st.ranks if not r.state.is_final and r.conn is not None}
            watch.begin(live, now)
        if watch.round is not None and watch.round.due(now):
            self.name(watch.compare(watch.round.ranks))

    def name(self, found: list[Straggler]) -> None:
        """Warn of each rank named a straggler for the first time in the run, and tell."""
        st = self.state
        for straggler in found:
            rank = straggler.rank
            host = st.agent_table.hostname(st.ranks[rank]) if rank < len(st.ranks) else "?"
            logger.warning("%s", straggler_warning(straggler, host, self.threshold))
            self.sink.emit(
                StragglerFound(
                    rank,
                    host,
                    straggler.lateness_s,
                    straggler.window,
                    straggler.last_share,
                    str(straggler),
                )
            )

    def end_run(self) -> tuple[str, ...]:
        """The run's end: compare the ranks' last timings; the ranks named in the run."""
        if self.watch.rule is not None:
            self.name(self.watch.compare(r.rank for r in self.state.ranks))
        return self.watch.end_run(time.time_ns())


def straggler_warning(straggler: Straggler, host: str, threshold: float | None) -> str:
    """The warning of a rank named a straggler for the first time in a run."""
    return f"torchrunx: {straggler}: a straggler, on {host} (straggler_threshold={threshold:g} s)"
