"""Stall detection: no rank made progress for ``Launcher.stall_timeout``; gather, diagnose, act.

The clock runs while the attempt's ranks run (``Phase.RUNNING``), from its start: each
:class:`~torchrunx.wire.messages.RankProgress` a worker sends (a collective completed, or
``torchrunx.progress()``; see :mod:`torchrunx.worker.stallprobe`) sets it back. Time with a rank
in the debugger does not count. With ``backend=None`` it starts at the first progress.

Once it passes ``stall_timeout``, :class:`StallWatch` asks every live agent for its workers'
stacks and states (:class:`~torchrunx.wire.messages.ShowStacks` with ``states``); what came
within :data:`ANSWER_WAIT` is diagnosed (:mod:`torchrunx.launcher.state.hangs`), the ranks that did
not answer named as such. The diagnosis is printed, written to the log folder
(``stall-N.txt`` and ``stall-N.json``) and sent as a :class:`~torchrunx.events.Stalled`
event; then ``on_stall`` says what follows: ``"report"`` (keep waiting; the next report comes
after progress and another ``stall_timeout``), ``"fail"`` (the run raises
:class:`~torchrunx.errors.StallError`) or ``"restart"`` (the attempt fails with it, and
``max_restarts`` and ``restart_on`` decide).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from torchrunx.launcher.net.listener import FrameReceived
from torchrunx.launcher.state.hangs import CollectiveEntry, RankSnapshot, diagnose, render
from torchrunx.launcher.state.reports import stacks_note, without_probe
from torchrunx.wire.messages import FromWorker, RankProgress, RankState, RankTimings

if TYPE_CHECKING:
    from pathlib import Path

    from torchrunx.launcher.launch.inbox import Inbox
    from torchrunx.launcher.settings.plan import StallAction
    from torchrunx.launcher.state.records import AgentRecord, RankRecord

logger = logging.getLogger("torchrunx.launcher")

STALL_ACTIONS: tuple[StallAction, ...] = ("report", "fail", "restart")
LookReason = Literal["stall", "on demand", "view", "launch_timeout"]
DEFAULT_STALL_TIMEOUT = 300.0
ANSWER_WAIT = 2.0
"""Seconds the launcher waits for the agents' and ranks' answers before it diagnoses."""
LOST_ANSWER_WAIT = 0.5
"""The same wait when a host was lost: the note on its error is a help, the error is what
matters, and a lost host's error must come within about ``agent_timeout + 1`` s (a rank blocked
in a collective with the lost host may not answer at all)."""
ON_DEMAND = "torchrunx: the collectives every rank is in (Ctrl-\\; the launch goes on):"
HEADLINE = "torchrunx: no rank made progress for {seconds:.3g} s (stall_timeout): the diagnosis"


def stall_note(
    event: object, inbox: Inbox
) -> tuple[int, RankProgress | RankState | RankTimings] | None:
    """A rank's progress, state or timings in an event of the launch's queue: rank, message.

    Read here, before the inbox (which takes any other message of a worker's), from a worker
    whose channel is open; None for every other event (the inbox applies those).
    """
    if not isinstance(event, FrameReceived) or not isinstance(event.message, FromWorker):
        return None
    inner = event.message.message
    if not isinstance(inner, RankProgress | RankState | RankTimings):
        return None
    channel = inbox.channels.get((event.peer.ident, event.message.local_rank))
    owner = None if channel is None else inbox.owners.get(channel.ident)
    if owner is None or owner[0] != "rank" or owner[1] >= len(inbox.state.ranks):
        return None
    agent = inbox.owners.get(event.peer.ident)
    if agent is not None and agent[0] == "agent":
        inbox.state.agent_table.heard_from(inbox.state.agents[agent[1]], time.monotonic())
    return owner[1], inner


def progress_every(stall_timeout: float | None, *, stragglers: bool = False) -> float | None:
    """How often a worker may say it progressed: a fifth of the timeout, 5 s at most.

    None (no probe in the workers) when stall detection is off, unless ``stragglers`` are
    looked for (the probe answers for both; its progress is then not read).
    """
    if stall_timeout is None:
        return 5.0 if stragglers else None
    return min(5.0, stall_timeout / 5)


def check_stall_fields(stall_timeout: object, on_stall: object, restarts: object) -> None:
    """``stall_timeout``: None or a positive number of seconds; ``on_stall``: one of three.

    Raises:
        ValueError: A value out of range, or ``"restart"`` without ``max_restarts``.
    """
    if stall_timeout is not None and (
        isinstance(stall_timeout, bool)
        or not isinstance(stall_timeout, int | float)
        or not 0 < stall_timeout < float("inf")
    ):
        raise ValueError(
            f"stall_timeout must be a positive number of seconds, or None to turn stall "
            f"detection off, got {stall_timeout!r}"
        )
    if on_stall not in STALL_ACTIONS:
        raise ValueError(f"on_stall={on_stall!r} is not one of {list(STALL_ACTIONS)}")
    if on_stall == "restart" and not restarts:
        raise ValueError(
            'on_stall="restart" restarts the workers after a stall: it needs max_restarts >= 1 '
            '(or use on_stall="fail" to raise StallError)'
        )


@dataclass
class StallLook:
    """One request for every rank's state on a stall: who was asked, what came, by when."""

    seconds: float
    """Seconds without progress when it was asked."""
    pending: set[int]
    """Agents (by index) whose stacks did not come yet."""
    ranks: set[int]
    """The live ranks whose states are awaited."""
    deadline: float
    why: LookReason = "stall"
    """What asked: stall detection, Ctrl-\\ (the collective view beside the stacks), a
    ``torchrunx top`` viewer, or ``launch_timeout`` (its error's note)."""
    states: dict[int, RankState] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)

    def due(self, now: float) -> bool:
        """Every agent and rank answered, or the wait is over."""
        return (not self.pending and self.ranks <= set(self.states)) or now >= self.deadline


def snapshots(look: StallLook, hosts: dict[int, str]) -> list[RankSnapshot]:
    """The ranks' snapshots from what came: each rank's state, its agent's stacks of it."""
    found = []
    for rank, state in sorted(look.states.items()):
        entries = tuple(CollectiveEntry(*raw) for raw in state.entries)
        stacks = look.stacks.get(rank) or state.stacks
        found.append(
            RankSnapshot(
                rank, hosts.get(rank, "?"), state.group_formed, entries, state.where, stacks
            )
        )
    return found


def diagnosis_text(
    look: StallLook, ranks: list[RankRecord], hostname: dict[int, str]
) -> tuple[str, dict[str, object], list[str]]:
    """The printed diagnosis and its JSON values (with the stacks of the ranks it names)."""
    where = {r.rank: (r.local_rank, hostname.get(r.rank, "?")) for r in ranks}
    snaps = snapshots(look, hostname)
    answered = {s.rank for s in snaps}
    silent = tuple(r for r in sorted(look.ranks) if r not in answered)
    diagnosis = dataclasses.replace(diagnose(snaps, len(ranks)), unanswered=silent)
    lines = render(diagnosis)
    view = list(lines)
    absent = {r for ranks_ in diagnosis.absent.values() for r in ranks_}
    # The stacks of the ranks that hold the others up, or of every rank when none is named.
    shown = {
        r: text
        for r, text in ((s.rank, s.stacks) for s in snaps)
        if text and (r in absent or not absent) and r in where
    }
    shown.update({r: look.stacks[r] for r in silent if r in look.stacks and r in where})
    shown = {r: without_probe(text) for r, text in shown.items()}  # the JSON's as the note's
    if shown:
        lines.append("Python stacks (ranks with the same stack together):")
        lines.extend(stacks_note(shown, where).splitlines()[1:])
    values: dict[str, object] = {"seconds": look.seconds, **diagnosis.to_json()}
    values["stacks"] = {str(r): text for r, text in sorted(shown.items())}
    return "\n".join(lines) + "\n", values, view


class StallWatch:
    """The stall clock of a launch, and the look it takes when it runs out (see the module)."""

    def __init__(self, timeout: float | None, action: StallAction, *, armed: bool) -> None:
        """``armed``: the clock runs from each attempt's start (else from the first progress)."""
        self.timeout = timeout
        self.action = action
        self.arm_at_start = armed
        self.armed = False
        self.last = 0.0
        """When a rank last made progress (monotonic), or the attempt started."""
        self.paused_then = 0.0
        """The debugger's paused seconds at :attr:`last`."""
        self.reported = False
        self.attempt: int | None = None
        self.look: StallLook | None = None
        self.count = 0

    def run_state(self, attempt: int | None, now: float, paused: float) -> None:
        """The attempt running now (None: none runs): a new one starts the clock again."""
        if attempt != self.attempt:
            self.attempt = attempt
            self.armed = attempt is not None and self.arm_at_start
            self.last, self.paused_then, self.reported, self.look = now, paused, False, None

    def progressed(self, now: float, paused: float) -> None:
        """A rank made progress."""
        self.armed = self.attempt is not None
        self.last, self.paused_then, self.reported = now, paused, False

    def stalled_for(self, now: float, paused: float) -> float:
        """Seconds without progress, time in the debugger left out."""
        return now - self.last - (paused - self.paused_then)

    def next_due(self, paused: float) -> float | None:
        """When the clock runs out if nothing moves (monotonic), while it can."""
        if self.timeout is None or not self.armed or self.reported or self.look is not None:
            return None
        return self.last + self.timeout + (paused - self.paused_then)

    def due(self, now: float, paused: float) -> bool:
        """Whether to look now: stalled for ``timeout``, not looked at or reported yet."""
        return (
            self.timeout is not None
            and self.armed
            and not self.reported
            and self.look is None
            and self.stalled_for(now, paused) >= self.timeout
        )

    def begin(  # noqa: PLR0913, PLR0917 (the look's facts, each given by the loop)
        self,
        agents: list[AgentRecord],
        ranks: set[int],
        now: float,
        paused: float,
        why: LookReason = "stall",
        wait: float | None = None,
    ) -> StallLook:
        """The look at ``agents`` (asked already) and their live ``ranks`` starts.

        It waits ``wait`` seconds for the answers (None: :data:`ANSWER_WAIT`).
        """
        self.look = StallLook(
            self.stalled_for(now, paused),
            {a.index for a in agents},
            ranks,
            now + (ANSWER_WAIT if wait is None else wait),
            why,
        )
        return self.look

    def answer_stacks(self, agent: AgentRecord, stacks: dict[int, str]) -> None:
        """An agent's stacks of its workers (by local rank)."""
        look = self.look
        if look is None:
            return
        look.pending.discard(agent.index)
        if agent.spec is not None:
            for local_rank, text in stacks.items():
                look.stacks[agent.spec.rank_offset + local_rank] = text

    def note(self, rank: int, message: RankProgress | RankState, now: float, paused: float) -> None:
        """What a rank sent: its progress, or its state for the look under way."""
        if isinstance(message, RankProgress):
            self.progressed(now, paused)
        else:
            self.answer_state(rank, message)

    def answer_state(self, rank: int, state: RankState) -> None:
        """A rank's state."""
        if self.look is not None:
            self.look.states[rank] = state

    def finish(self, ranks: list[RankRecord], hostname: dict[int, str]) -> StallReport:
        """The look is over: its report (after a stall's, the next waits for progress)."""
        look = self.look
        assert look is not None  # noqa: S101 (called once it is due)
        self.look = None
        if look.why == "stall":
            self.reported = True
            self.count += 1
        text, values, view = diagnosis_text(look, ranks, hostname)
        return StallReport(look.seconds, text, values, self.count, tuple(view))


@dataclass(frozen=True)
class StallReport:
    """What a stall's look found: printed, written, sent, and maybe raised."""

    seconds: float
    text: str
    values: dict[str, object]
    number: int
    """1 for the launch's first report."""
    view: tuple[str, ...] = ()
    """The collective view alone: the diagnosis's lines without the stacks."""

    @property
    def headline(self) -> str:
        """``torchrunx: no rank made progress for 2.03 s (stall_timeout): the diagnosis``."""
        return HEADLINE.format(seconds=self.seconds)

    def write(self, log_dir: Path | None) -> None:
        """Print it on stderr; write ``stall-N.txt`` and ``stall-N.json`` in the log folder."""
        sys.stderr.write(f"{self.headline}\n{self.text}")
        sys.stderr.flush()
        if log_dir is None:
            return
        try:
            (log_dir / f"stall-{self.number}.txt").write_text(f"{self.headline}\n{self.text}")
            (log_dir / f"stall-{self.number}.json").write_text(
                json.dumps({"time": time.time(), **self.values}, indent=1) + "\n"
            )
        except OSError as exc:
            logger.warning("cannot write the stall's diagnosis in %s: %s", log_dir, exc)
