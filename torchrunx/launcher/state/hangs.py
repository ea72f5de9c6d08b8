"""What a stalled launch is waiting for, and which rank is slow: pure, on the ranks' snapshots.

When no rank has made progress for a while, the launcher asks every rank for a
:class:`RankSnapshot`: the recent entries of PyTorch's flight recorder (one per collective:
its process group, sequence number, op, sizes, whether it finished, where the user's code
called it) and the Python stacks of all its threads. :func:`diagnose` reads them together:

- the collective the waiting ranks are in, and the ranks that have not entered it, with
  where they are (grouped: ``ranks 5, 7: data.py:12 in __next__``);
- ranks in different collectives at the same sequence number: a mismatch
  (``ranks 0-3 in all_reduce #41, ranks 4-7 in broadcast #41``);
- for each rank, whether it is stuck before its process group formed, in the user's code, or
  in a collective.

:func:`find_stragglers` reads the recorder's creation times: a rank that enters collectives
last again and again, by more than a threshold, is named (``rank 5 enters collectives 0.9 s
after the median, over the last 50``).

Nothing here does I/O: the worker takes its snapshot (:func:`entry_from_recorder` turns one
recorder entry into a :class:`CollectiveEntry`), the launcher gathers them and prints
:func:`render`'s text.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from torchrunx.launcher.state.reports import rank_ranges

Phase = Literal["before the process group formed", "in the user's code", "in a collective"]

_OWN_CODE = ("/torch/", "/torchrunx/", "<frozen ", "/threading.py")
"""Frames skipped when looking for the user's call site (PyTorch's, ours, Python's)."""


@dataclass(frozen=True)
class CollectiveEntry:
    """One collective of one rank, as its flight recorder saw it."""

    group: str
    """The process group's name (``default_pg``, or the name it was given)."""
    seq: int
    """Its sequence number in that group (the same collective has the same one on every rank)."""
    op: str
    """``all_reduce``, ``broadcast``, ... (the recorder's ``profiling_name``, backend left out)."""
    sizes: tuple[tuple[int, ...], ...] = ()
    """The input tensors' shapes."""
    dtypes: tuple[str, ...] = ()
    done: bool = False
    """Whether it finished on this rank."""
    created_ns: int = 0
    """When this rank entered it (wall clock, ns)."""
    site: str = ""
    """The user's call site, ``file:line in function`` ("" if none was recorded)."""


@dataclass(frozen=True)
class RankSnapshot:
    """One rank's state, taken when the launch looked stalled."""

    rank: int
    host: str
    group_formed: bool
    """Whether its default process group exists (``torch.distributed.is_initialized()``)."""
    entries: tuple[CollectiveEntry, ...] = ()
    """Its recent collectives, oldest first."""
    where: str = ""
    """The innermost frame of the user's code in its main thread (``file:line in function``)."""
    stacks: str = ""
    """The Python stacks of all its threads, as text."""

    @property
    def pending(self) -> CollectiveEntry | None:
        """The collective it waits in (the newest that has not finished), if any."""
        for entry in reversed(self.entries):
            if not entry.done:
                return entry
        return None

    @property
    def phase(self) -> Phase:
        """Where it is stuck, in a word."""
        if not self.group_formed:
            return "before the process group formed"
        if self.pending is not None:
            return "in a collective"
        return "in the user's code"

    def last_seq(self, group: str) -> int:
        """The newest sequence number it entered in ``group`` (0 if none)."""
        return max((e.seq for e in self.entries if e.group == group), default=0)


@dataclass(frozen=True)
class Waiting:
    """Ranks waiting in one collective."""

    entry: CollectiveEntry
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Diagnosis:
    """What a stalled launch waits for."""

    waiting: tuple[Waiting, ...]
    """Each collective that some ranks wait in, the most waited-in first."""
    absent: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Where the ranks that are in no collective are (``where`` -> ranks), for the first
    collective of :attr:`waiting`'s group that they have not entered; where every rank is
    when none waits in a collective."""
    mismatch: bool = False
    """Whether ranks wait in different collectives at the same sequence number of one group."""
    phases: dict[Phase, tuple[int, ...]] = field(default_factory=dict)
    """Each rank's phase."""
    unanswered: tuple[int, ...] = ()
    """Ranks that sent no snapshot (their host did not answer in time)."""

    def to_json(self) -> dict[str, Any]:
        """The diagnosis as JSON-ready values (written beside the text in the log folder)."""
        return {
            "waiting": [
                {
                    "group": w.entry.group,
                    "seq": w.entry.seq,
                    "op": w.entry.op,
                    "sizes": [list(s) for s in w.entry.sizes],
                    "dtypes": list(w.entry.dtypes),
                    "site": w.entry.site,
                    "ranks": list(w.ranks),
                }
                for w in self.waiting
            ],
            "absent": {where: list(ranks) for where, ranks in self.absent.items()},
            "mismatch": self.mismatch,
            "phases": {phase: list(ranks) for phase, ranks in self.phases.items()},
            "unanswered": list(self.unanswered),
        }


def entry_from_recorder(raw: dict[str, Any]) -> CollectiveEntry:
    """One entry of ``torch._C._distributed_c10d._dump_fr_trace()``'s ``entries``.

    gloo leaves ``state`` at ``scheduled`` and marks a finished collective ``retired``; NCCL
    also says ``completed``. The call site is the outermost frame that is neither PyTorch's,
    torchrunx's nor Python's own (the recorder lists frames innermost first).
    """
    group = raw.get("process_group") or ("", "")
    name = str(raw.get("profiling_name", ""))
    site = ""
    for frame in raw.get("frames") or ():
        filename = str(frame.get("filename", ""))
        if not any(part in filename for part in _OWN_CODE):
            site = f"{filename}:{frame.get('line', '?')} in {frame.get('name', '?')}"
            break
    return CollectiveEntry(
        group=str(group[1] if len(group) > 1 else group[0]),
        seq=int(raw.get("collective_seq_id") or 0),
        op=name.split(":", 1)[-1],
        sizes=tuple(tuple(int(n) for n in s) for s in raw.get("input_sizes") or ()),
        dtypes=tuple(str(d) for d in raw.get("input_dtypes") or ()),
        done=bool(raw.get("retired")) or raw.get("state") == "completed",
        created_ns=int(raw.get("time_created_ns") or 0),
        site=site,
    )


def diagnose(snapshots: list[RankSnapshot], world_size: int) -> Diagnosis:
    """What the ranks of a stalled launch wait for, from the snapshots that came."""
    by_rank = {s.rank: s for s in snapshots}
    phases: dict[Phase, list[int]] = defaultdict(list)
    for snapshot in sorted(snapshots, key=lambda s: s.rank):
        phases[snapshot.phase].append(snapshot.rank)
    groups: dict[tuple[str, int, str], list[int]] = defaultdict(list)
    entries: dict[tuple[str, int, str], CollectiveEntry] = {}
    for snapshot in snapshots:
        pending = snapshot.pending
        if pending is not None:
            key = (pending.group, pending.seq, pending.op)
            groups[key].append(snapshot.rank)
            entries.setdefault(key, pending)
    order = sorted(groups, key=lambda k: (-len(groups[k]), k[0], k[1], k[2]))
    waiting = tuple(Waiting(entries[k], tuple(sorted(groups[k]))) for k in order)
    seen_at: dict[tuple[str, int], set[str]] = defaultdict(set)
    for group, seq, op in groups:
        seen_at[(group, seq)].add(op)
    mismatch = any(len(ops) > 1 for ops in seen_at.values())
    absent: dict[str, list[int]] = defaultdict(list)
    first = waiting[0].entry if waiting else None
    for snapshot in sorted(snapshots, key=lambda s: s.rank):
        if first is None or (
            snapshot.pending is None and snapshot.last_seq(first.group) < first.seq
        ):
            absent[snapshot.where or "(no frame of the user's code)"].append(snapshot.rank)
    return Diagnosis(
        waiting=waiting,
        absent={where: tuple(ranks) for where, ranks in absent.items()},
        mismatch=mismatch,
        phases={phase: tuple(ranks) for phase, ranks in phases.items()},
        unanswered=tuple(r for r in range(world_size) if r not in by_rank),
    )


def ranks_text(ranks: tuple[int, ...] | list[int]) -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0-2, 5, 7-8``: consecutive ranks as ranges."""
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {rank_ranges(sorted(ranks)).replace(',', ', ')}"


def _collective_text(entry: CollectiveEntry) -> str:
    """``all_reduce #41 of default_pg ([4] Float) at train.py:57 in step``."""
    shapes = ", ".join(f"[{', '.join(map(str, s))}]" for s in entry.sizes)
    dtype = f" {entry.dtypes[0]}" if entry.dtypes else ""
    detail = f" ({shapes}{dtype})" if shapes else ""
    site = f" at {entry.site}" if entry.site else ""
    return f"{entry.op} #{entry.seq} of {entry.group}{detail}{site}"


def render(diagnosis: Diagnosis) -> list[str]:
    """The diagnosis as lines of text, the most telling first."""
    lines: list[str] = []
    if diagnosis.mismatch:
        parts = [f"{ranks_text(w.ranks)} in {_collective_text(w.entry)}" for w in diagnosis.waiting]
        lines.append("mismatched collectives: " + "; ".join(parts))
    else:
        lines.extend(
            f"{ranks_text(w.ranks)} {'wait' if len(w.ranks) > 1 else 'waits'} in "
            f"{_collective_text(w.entry)}"
            for w in diagnosis.waiting
        )
    if diagnosis.absent:
        if diagnosis.waiting:
            first = diagnosis.waiting[0].entry
            lines.append(f"not entered {first.op} #{first.seq} of {first.group}:")
        else:
            lines.append("no rank waits in a collective; where they are:")
        lines.extend(f"  {ranks_text(ranks)}: {where}" for where, ranks in diagnosis.absent.items())
    for phase, ranks in diagnosis.phases.items():
        if phase != "in a collective" or not diagnosis.waiting:
            lines.append(f"{ranks_text(ranks)} {phase}")
    if diagnosis.unanswered:
        lines.append(
            f"{ranks_text(diagnosis.unanswered)} did not answer in time (their host is silent, "
            "or the rank holds Python's GIL)"
        )
    return lines


@dataclass(frozen=True)
class Straggler:
    """A rank that enters collectives late, again and again."""

    rank: int
    lateness_s: float
    """Its median lateness after the median rank, in seconds, over the window."""
    window: int
    """How many collectives were compared."""
    last_share: float
    """The share of them that it entered last."""

    def __str__(self) -> str:
        """``rank 5 enters collectives 0.9 s after the median, over the last 50``."""
        return (
            f"rank {self.rank} enters collectives {self.lateness_s:.2g} s after the median, "
            f"over the last {self.window}"
        )


@dataclass(frozen=True)
class StragglerRule:
    """When a rank that enters collectives late is named a straggler."""

    window: int = 50
    """How many of the newest collectives that every rank recorded are compared."""
    threshold_s: float = 0.1
    """Its median lateness after the median rank must be at least this."""
    min_share: float = 0.6
    """It must have entered at least this share of them last."""
    max_chance: float = 1e-3
    """And so often that a rank of a healthy loop, where each rank is as likely to be last, is
    last that often or more with a chance below this (:func:`chance_of_being_last`): in a
    short window, a share alone names a rank that jitter made last three times in five."""
    min_window: int = 5
    """Fewer shared collectives than this name nobody."""


def chance_of_being_last(times: int, of: int, ranks: int) -> float:
    """The chance that a rank is last in ``times`` or more of ``of`` collectives, by luck.

    Each of ``ranks`` ranks is as likely to be last: a binomial tail.
    """
    p = 1 / ranks
    return sum(math.comb(of, k) * p**k * (1 - p) ** (of - k) for k in range(times, of + 1))


def find_stragglers(
    entries: dict[int, tuple[CollectiveEntry, ...]],
    rule: StragglerRule | None = None,
    offsets_ns: dict[int, int] | None = None,
) -> list[Straggler]:
    """The ranks that entered most of the newest shared collectives last, late (see ``rule``).

    A collective counts when every rank of ``entries`` recorded it (same group and sequence
    number). ``offsets_ns``: each rank's clock minus the launcher's, taken off its times
    (hosts' clocks differ).
    """
    rule = rule or StragglerRule()
    if len(entries) < 2:
        return []
    offsets = offsets_ns or {}
    times: dict[tuple[str, int], dict[int, int]] = defaultdict(dict)
    for rank, rank_entries in entries.items():
        for entry in rank_entries:
            times[(entry.group, entry.seq)][rank] = entry.created_ns - offsets.get(rank, 0)
    shared = [
        (key, created)
        for key, created in times.items()
        if len(created) == len(entries) and key[1] > 0
    ]
    shared.sort(key=lambda item: min(item[1].values()))
    recent = shared[-rule.window :]
    if len(recent) < rule.min_window:
        return []
    late: dict[int, list[float]] = defaultdict(list)
    last_count: dict[int, int] = defaultdict(int)
    for _, created in recent:
        median = statistics.median(created.values())
        for rank, ns in created.items():
            late[rank].append((ns - median) / 1e9)
        last_count[max(created, key=lambda r: (created[r], r))] += 1
    found = []
    for rank in sorted(entries):
        share = last_count[rank] / len(recent)
        lateness = statistics.median(late[rank])
        chance = chance_of_being_last(last_count[rank], len(recent), len(entries))
        if share >= rule.min_share and chance <= rule.max_chance and lateness >= rule.threshold_s:
            found.append(Straggler(rank, lateness, len(recent), share))
    return found
