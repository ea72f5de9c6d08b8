"""Error reports: remote exceptions rebuilt, and the notes that say where and what else happened.

Pure functions of the launch's facts: the exception a worker raised comes back with its own
type (or as :class:`~torchrunx.errors.WorkerRaisedError` when its type cannot travel), the
remote traceback as ``__cause__`` and where it ran in a note; the raised error then gets the
worker's output tail, the other failures, the restart history and the stacks of the ranks
that were still running.
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

from torchrunx import serialization
from torchrunx.errors import (
    AgentFailedError,
    LaunchTimeoutError,
    RemoteTraceback,
    SerializationError,
    WorkerRaisedError,
    WorkerTimeoutError,
    add_note,
    exception_text,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from torchrunx.wire.messages import WorkerException, WorkerTimedOut

MAX_STACKS_SHOWN = 16
PROBE_FILE = "stallprobe.py"
"""The file of torchrunx's own thread in every worker (it answers the launcher's looks)."""


def summary(error: BaseException) -> str:
    """``Type: first line of the message`` (just the type for an empty message)."""
    lines = exception_text(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def count_repeats(lines: Iterable[str]) -> list[str]:
    """Each distinct line once, in first-seen order, with ``(xN)`` when it came N > 1 times."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return [line if n == 1 else f"{line} (x{n})" for line, n in counts.items()]


def worker_where(rank: int, local_rank: int, hostname: str, pid: int) -> str:
    """``worker rank R (local rank L on host 'H', pid P)``."""
    return f"worker rank {rank} (local rank {local_rank} on host {hostname!r}, pid {pid})"


def rebuild_exception(
    message: WorkerException, payload: list[bytearray], where: str
) -> BaseException:
    """The exception a worker raised, with its remote traceback and where it ran."""
    error: BaseException | None = None
    if message.unpicklable_result:
        error = SerializationError(f"{message.message} (in {where})")
    elif payload:
        with contextlib.suppress(Exception):
            loaded = serialization.loads(payload)
            error = loaded if isinstance(loaded, BaseException) else None
    if error is None:
        error = WorkerRaisedError(
            f"{message.type_name}: {message.message} (raised in {where}; the exception "
            "object could not be sent back, so its type is not kept)"
        )
        error.type_name = message.type_name
    error.__cause__ = RemoteTraceback(message.traceback)
    error.__suppress_context__ = True
    add_note(error, f"raised in {where}")
    return error


def watchdog_error(hostname: str, rank: int, message: WorkerTimedOut) -> WorkerTimeoutError:
    """A worker's watchdog report as the error to raise, with its stack at that moment."""
    error = WorkerTimeoutError(hostname, message.local_rank, rank, message.scope, message.limit)
    if message.stack.strip():
        add_note(
            error, f"Python stack of rank {rank} when its limit passed:\n{message.stack.rstrip()}"
        )
    return error


def output_tail_note(tail: Sequence[str], path: object | None) -> str | None:
    """The note with a failed worker's last lines of output (and where its full log is)."""
    where = f" (full log: {path})" if path is not None else ""
    if tail:
        body = "\n".join("    " + line.replace("\n", "\n    ") for line in tail)
        return f"last {len(tail)} lines of its output{where}:\n{body}"
    if path is not None:
        return f"it wrote no output{where}"
    return None


def stacks_note(stacks: dict[int, str], where: dict[int, tuple[int, str]]) -> str:
    """The note with the Python stacks of ranks still running when the launch stopped.

    Ranks whose stacks are the same (thread ids aside) share one section, headed by their
    ranks and the innermost frame of the dumping thread, so a rank stuck elsewhere stands out
    (torchrunx's own probe thread is left out of each: see :func:`without_probe`)::

        --- ranks 0-6,8 on hosts 'node1', 'node2' (the same stack; innermost: train.py:41 in
        step) ---

    One rank's section keeps its local rank: ``--- rank 7 (local rank 7 on host 'node1') ---``.
    At most :data:`MAX_STACKS_SHOWN` sections. ``where`` maps a rank to its local rank and host.
    """
    stacks = {rank: without_probe(text) for rank, text in stacks.items()}
    groups: dict[str, list[int]] = {}
    for rank in sorted(stacks):
        groups.setdefault(_same_stack(stacks[rank]), []).append(rank)
    lines = ["Python stacks of the workers that were still running when the launch stopped:"]
    for key, ranks in list(groups.items())[:MAX_STACKS_SHOWN]:
        if len(ranks) == 1:
            local_rank, host = where[ranks[0]]
            lines.append(f"--- rank {ranks[0]} (local rank {local_rank} on host {host!r}) ---")
        else:
            names = list(dict.fromkeys(where[r][1] for r in ranks))
            hosts = ("host " if len(names) == 1 else "hosts ") + ", ".join(map(repr, names))
            inner = innermost_frame(key)
            what = "the same stack" + (f"; innermost: {inner}" if inner else "")
            lines.append(f"--- ranks {rank_ranges(ranks)} on {hosts} ({what}) ---")
        lines.append(stacks[ranks[0]].rstrip())
    if len(groups) > MAX_STACKS_SHOWN:
        left = [r for ranks in list(groups.values())[MAX_STACKS_SHOWN:] for r in ranks]
        more = len(groups) - MAX_STACKS_SHOWN
        lines.append(f"... and {more} more stacks, of ranks {rank_ranges(sorted(left))}")
    return "\n".join(lines)


def without_probe(stacks: str) -> str:
    """A rank's stacks without the thread of torchrunx's stall probe.

    That thread only answers the launcher; where it was caught (asleep, or reading the
    collective counters) says nothing of the user's code, and would part ranks whose own
    threads are in the same place.
    """
    blocks = stacks.split("\n\n")
    kept = [b for b in blocks if f"torchrunx/worker/{PROBE_FILE}" not in b]
    return "\n\n".join(kept)


def _same_stack(text: str) -> str:
    """A stack as compared with others: its threads' headers and frames, without thread ids.

    The ids differ from process to process; the whole text stands for a stack with no frame.
    """
    lines = []
    for line in (raw.strip() for raw in text.splitlines()):
        if line.startswith("File "):
            lines.append(line)
        elif line.startswith(("Current thread", "Thread ")):
            lines.append(line.partition(" 0x")[0])  # "Current thread" or "Thread"
    return "\n".join(lines) if lines else text.strip()


_FRAME = re.compile(r'File "([^"]*)", line (\d+) in (\S+)')


def innermost_frame(text: str) -> str | None:
    """``file.py:LINE in function`` of the innermost frame of the thread that dumped, or ``None``.

    That thread is ``faulthandler``'s "Current thread" (else the first one listed); its first
    frame is its innermost.
    """
    _, current, after = text.partition("Current thread")
    match = _FRAME.search(after if current else text)
    if match is None:
        return None
    path, line, function = match.groups()
    return f"{path.rpartition('/')[2]}:{line} in {function}"


def rank_ranges(ranks: Sequence[int]) -> str:
    """Sorted ranks as ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``."""
    parts: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ",".join(parts)


def finish_report(
    error: BaseException,
    *,
    others: Sequence[str],
    history: Sequence[str],
    max_restarts: int,
) -> BaseException:
    """Add the other failures and the restart history to the error about to be raised."""
    repeats = count_repeats(s for s in others if s != summary(error))
    if repeats:
        add_note(error, f"other failures seen while stopping: {'; '.join(repeats)}")
    if history:
        earlier = "\n".join(f"  {line}" for line in history)
        add_note(
            error,
            f"the workers were restarted {len(history)} time(s) "
            f"(max_restarts={max_restarts}); earlier failures:\n{earlier}",
        )
    return error


def world_changes_note(changes: Sequence[str]) -> str | None:
    """The note that lists the hosts quarantined, replaced or dropped during the launch."""
    return "hosts changed during the launch:\n  " + "\n  ".join(changes) if changes else None


def start_timeout_error(  # noqa: PLR0913 (what is known of the start)
    hostname: str,
    start_timeout: float,
    port: int,
    address: str | None,
    stderr_tail: str,
    *,
    started: bool = True,
) -> AgentFailedError:
    """An agent that did not connect back within ``start_timeout``: what to check.

    ``started``: its transport had started it (else the start itself, the SSH connection or
    the shipped code, was still under way).
    """
    if not started:
        return AgentFailedError(
            hostname,
            f"the agent's start did not finish within start_timeout={start_timeout:g} s (its "
            "transport was still connecting to the host, or sending it its script or the "
            "shipped code): is the host reachable, its link up? Give a slow start more with "
            "start_timeout",
            stderr_tail,
        )
    return AgentFailedError(
        hostname,
        "the agent did not connect back within "
        f"start_timeout={start_timeout:g} s; "
        f"can that host reach this machine on port {port}"
        + (f" at {address}" if address else "")
        + "? Set launcher_address / TORCHRUNX_LAUNCHER_ADDR to an address it can reach",
        stderr_tail,
    )


def launch_timeout_error(limit: float, elapsed: float, running: list[int]) -> LaunchTimeoutError:
    """``launch_timeout`` was hit after ``elapsed`` seconds, ``running`` ranks still running."""
    return LaunchTimeoutError(
        f"launch_timeout={limit:g} s was hit: the launch was stopped after "
        f"{elapsed:.1f} s with ranks {running or 'not yet started'} still "
        "running (their stacks are below, if they could be read)"
    )
