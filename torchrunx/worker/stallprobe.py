"""In each worker: its progress for the launcher's stall detection, and its state on request.

A daemon thread of the worker (started when ``Launcher.stall_timeout`` is on) wakes every
:data:`POLL` seconds and

- reads its progress: the collectives completed in each process group (the flight recorder's
  ``pg_status``, about 0.2 ms without its entries) and the calls of
  :func:`torchrunx.progress`; when either moved, and at most every
  ``WorkerSpec.progress_every`` seconds, it sends :class:`RankProgress` on the channel, with
  the count of collectives completed (which ``torchrunx top`` shows);
- reads the counter its agent raises in the page they share (:data:`torchrunx.timer.ASK_OFFSET`)
  when the launch looks stalled, and answers with :class:`RankState`: the recorder's recent
  entries (without their C++ stack traces, whose symbolizing takes seconds), whether the
  default process group exists, the innermost frame of the user's code in the main thread,
  and the Python stacks of all threads;
- reads a second counter, raised when the launcher looks for stragglers (every
  ``STRAGGLER_EVERY`` seconds, :mod:`torchrunx.launcher.launch.stragglers`), and answers with
  :class:`RankTimings`: the group, sequence number and creation time of its newest
  :data:`TIMINGS` collectives, nothing else (:func:`timings`; also sent before each outcome).

A thread can answer while the main thread waits in a collective, sleeps or blocks on a lock
(each releases the GIL); one that holds the GIL for good is named by the launcher as not
answering, and its agent still sends its stacks (faulthandler, :class:`ShowStacks`).

Before the process group is made, :func:`recorder_env` turns the recorder on
(``TORCH_FR_BUFFER_SIZE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` for a torch whose only recorder is
NCCL's), unless the user set its size.
"""

from __future__ import annotations

import os  # noqa: TC003 (os.environ at run time)
import pickle
import struct
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from torchrunx import stall, timer
from torchrunx.wire.messages import RankProgress, RankState, RankTimings

if TYPE_CHECKING:
    from torchrunx.wire.channel import ChannelConnection

POLL = 0.1
"""Seconds between two looks at the progress and the agent's request."""
RECORDER_ENTRIES = 256
"""``TORCH_FR_BUFFER_SIZE`` set for the workers unless the user set a size: reading the
recorder costs about 18 us per entry it holds (36 ms at 2,000), and a look uses the newest."""
RECENT = 64
"""The newest recorder entries sent in a :class:`RankState`."""
TIMINGS = 100
"""The newest recorder entries sent in a :class:`RankTimings` (the launcher compares 50 that
every rank has: the rest covers ranks asked a poll apart in a fast loop)."""
_ASK = struct.Struct("=Q")
_OWN_CODE = ("/torch/", "/torchrunx/", "<frozen ", "/threading.py", "/selectors.py")


def recorder_env(
    env: dict[str, str] | os._Environ[str],
    c10d: Any = None,  # noqa: ANN401 (a module of torch's, or None)
) -> dict[str, str]:
    """The variables that turn the flight recorder on: none if the user sized it already.

    ``c10d``: ``torch._C._distributed_c10d`` where torch is loaded (:func:`loaded_c10d`). One
    without ``_dump_fr_trace`` is a torch from before the recorder served every backend: its
    only recorder is NCCL's, which reads ``TORCH_NCCL_TRACE_BUFFER_SIZE`` alone (and is off
    unless it is set). Newer ones read ``TORCH_FR_BUFFER_SIZE`` for NCCL's and gloo's both.
    """
    if "TORCH_FR_BUFFER_SIZE" in env or "TORCH_NCCL_TRACE_BUFFER_SIZE" in env:
        return {}
    if c10d is not None and not hasattr(c10d, "_dump_fr_trace"):
        return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(RECORDER_ENTRIES)}
    return {"TORCH_FR_BUFFER_SIZE": str(RECORDER_ENTRIES)}


def loaded_c10d() -> Any:  # noqa: ANN401 (a module of torch's)
    """``torch._C._distributed_c10d`` if torch is loaded (a worker inherits it), else None."""
    return getattr(sys.modules.get("torch._C"), "_distributed_c10d", None)


def ask(page: Any, offset: int = timer.ASK_OFFSET) -> None:  # noqa: ANN401 (an mmap)
    """The agent's side: ask the worker behind ``page`` for its :class:`RankState`.

    ``offset``: :data:`torchrunx.timer.TIMINGS_OFFSET` asks for its :class:`RankTimings`.
    """
    (count,) = _ASK.unpack_from(page, offset)
    _ASK.pack_into(page, offset, count + 1)


def user_frame(frame: Any) -> str:  # noqa: ANN401 (a frame)
    """The innermost frame of the user's code in a stack, ``file:line in function``."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not any(part in filename for part in _OWN_CODE):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


def _dist() -> Any:  # noqa: ANN401 (torch.distributed, if imported and usable)
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return None
    return dist


_DUMPS = ("_dump_fr_trace", "_dump_nccl_trace")
"""The recorders: gloo's (and other CPU backends'), and NCCL's in a CUDA build of torch."""


def _recorder(*, entries: bool) -> dict[str, Any]:
    """The flight recorders' dumps, merged ({} if there is none).

    ``pg_status`` is keyed by recorder and process group; ``entries`` are both recorders'.
    """
    if _dist() is None:
        return {}
    c10d = sys.modules.get("torch._C._distributed_c10d")
    merged: dict[str, Any] = {"pg_status": {}, "entries": []}
    for name in _DUMPS:
        dump_trace = getattr(c10d, name, None)
        if dump_trace is None:
            continue
        try:
            raw = dump_trace(includeCollectives=entries, includeStackTraces=False)
            dump = pickle.loads(raw) if isinstance(raw, bytes) else raw  # noqa: S301 (torch's)
        except Exception:  # noqa: BLE001, S112 (no such recorder here: no progress from it)
            continue
        if isinstance(dump, dict):
            status = dump.get("pg_status") or {}
            merged["pg_status"].update({f"{name}:{key}": value for key, value in status.items()})
            merged["entries"].extend(dump.get("entries") or [])
    return merged


def completed() -> int:
    """The collectives completed so far in every process group (0 without a recorder)."""
    status = _recorder(entries=False).get("pg_status") or {}
    return sum(
        max(0, int(group.get("last_completed_collective") or 0))
        for group in status.values()
        if isinstance(group, dict)
    )


def state(main: threading.Thread) -> RankState:
    """This worker's :class:`RankState` (see the module)."""
    frames = sys._current_frames()  # noqa: SLF001 (the documented way to see every thread)
    names = {t.ident: t.name for t in threading.enumerate()}
    where = user_frame(frames.get(main.ident or -1))
    stacks = []
    for ident, frame in frames.items():
        if ident == threading.get_ident():
            continue
        stacks.append(f'Thread "{names.get(ident, ident)}":\n')
        stacks.extend(traceback.format_stack(frame))
    entries = []
    recorded = sorted(  # no recorder (torch.distributed not imported, backend=None): none
        _recorder(entries=True).get("entries") or (), key=lambda e: e.get("time_created_ns") or 0
    )
    for raw in recorded[-RECENT:]:
        group = raw.get("process_group") or ("", "")
        done = bool(raw.get("retired")) or raw.get("state") == "completed"
        entries.append(
            (
                str(group[1] if len(group) > 1 else group[0]),
                int(raw.get("collective_seq_id") or 0),
                str(raw.get("profiling_name", "")).split(":", 1)[-1],
                tuple(tuple(int(n) for n in s) for s in raw.get("input_sizes") or ()),
                tuple(str(d) for d in raw.get("input_dtypes") or ()),
                done,
                int(raw.get("time_created_ns") or 0),
                "" if done else where,
            )
        )
    dist = _dist()
    formed = dist is not None and bool(dist.is_initialized())
    return RankState(formed, tuple(entries), where, "".join(stacks))


def timings() -> RankTimings:
    """This worker's :class:`RankTimings`: its newest numbered collectives' creation times."""
    numbered = [
        e for e in _recorder(entries=True).get("entries") or () if e.get("collective_seq_id")
    ]
    numbered.sort(key=lambda e: e.get("time_created_ns") or 0)
    entries = []
    for raw in numbered[-TIMINGS:]:
        group = raw.get("process_group") or ("", "")
        name = str(group[1] if len(group) > 1 else group[0])
        entries.append((name, int(raw["collective_seq_id"]), int(raw.get("time_created_ns") or 0)))
    return RankTimings(tuple(entries), time.time_ns())


def _answer(main: threading.Thread) -> RankState:
    """:func:`state`, or, if reading it fails, a state that says so.

    The launcher's look gets an answer either way: a probe thread ended by the error would leave
    every later look waiting for this rank, and name it as not answering.
    """
    try:
        return state(main)
    except Exception as exc:  # noqa: BLE001 (said in the answer, which the launcher shows)
        return RankState(group_formed=False, where=f"(torchrunx's probe failed: {exc!r})")


class StallProbe(threading.Thread):
    """The worker's thread (see the module)."""

    def __init__(self, conn: ChannelConnection, every: float) -> None:
        """Report on ``conn``, progress at most every ``every`` seconds."""
        super().__init__(name="torchrunx-stall-probe", daemon=True)
        self.conn = conn
        self.every = every
        self.main = threading.main_thread()

    def run(self) -> None:
        """Poll until the process ends (a daemon thread), or the channel fails."""
        page = timer.current_page()
        asked = 0 if page is None else _ASK.unpack_from(page, timer.ASK_OFFSET)[0]
        timed = 0 if page is None else _ASK.unpack_from(page, timer.TIMINGS_OFFSET)[0]
        seen = (stall.calls(), completed())
        next_send = 0.0
        moved = False
        try:
            while True:
                time.sleep(POLL)
                if page is not None:
                    (count,) = _ASK.unpack_from(page, timer.ASK_OFFSET)
                    if count != asked:
                        asked = count
                        self.conn.send(_answer(self.main))
                    (count,) = _ASK.unpack_from(page, timer.TIMINGS_OFFSET)
                    if count != timed:
                        timed = count
                        self.conn.send(timings())
                now_seen = (stall.calls(), completed())
                moved = moved or now_seen != seen
                seen = now_seen
                now = time.monotonic()
                if moved and now >= next_send:
                    self.conn.send(RankProgress(collectives=seen[1]))
                    moved = False
                    next_send = now + self.every
        except (OSError, ValueError):  # the channel ended: the worker is ending
            return
