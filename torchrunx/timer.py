"""The watchdog: ``with torchrunx.timer.expires(after=60, scope="step"):`` in worker code.

If the block is still running ``after`` seconds after it was entered, the worker's agent
dumps the worker's Python stack, and the launch fails (or restarts, see
``Launcher.max_restarts``) with a :class:`~torchrunx.errors.WorkerTimeoutError` that names the
host, the rank, the scope and the limit.

It costs about a microsecond per use: entering and leaving a block write a deadline into a
small page of memory shared with the agent (created by the agent before it forks the worker);
no message is sent and no lock is taken. The agent reads the pages of its workers every
0.1 s once they have used a timer, using the same monotonic clock (one per host). Blocks
nest: the innermost block's limit applies while it runs, then the enclosing block's again.

Outside a torchrunx worker (plain ``python``, a unit test) the block runs without a watchdog.
"""

from __future__ import annotations

import mmap
import struct
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import TracebackType

PAGE_SIZE = 512
"""Bytes of one worker's shared page."""
_DEADLINE = struct.Struct("=d")  # offset 0: monotonic deadline, 0.0 when no block runs
_DETAILS = struct.Struct("=dH")  # offset 8: the limit in seconds, then the scope's length
_SCOPE_OFFSET = _DEADLINE.size + _DETAILS.size
_SCOPE_MAX = PAGE_SIZE - _SCOPE_OFFSET - 17
ASK_OFFSET = PAGE_SIZE - 9
"""Offset of a ``=Q`` counter the agent raises to ask for the worker's state on a stall
(:mod:`torchrunx.worker.stallprobe`)."""
TIMINGS_OFFSET = PAGE_SIZE - 17
"""Offset of a ``=Q`` counter the agent raises to ask for the worker's collective timings."""
_USED_OFFSET = PAGE_SIZE - 1  # 1 once the worker used a timer: the agent starts polling

_page: mmap.mmap | None = None
_stack: list[tuple[float, bytes]] = []  # (deadline, packed limit and scope) of open blocks
_pack_deadline = _DEADLINE.pack_into
_monotonic = time.monotonic


def new_page() -> mmap.mmap:
    """A zeroed page shared between an agent and the worker it forks next."""
    return mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_SHARED)


def attach(page: mmap.mmap) -> None:
    """Called in a freshly forked worker: timers now report to its agent through ``page``."""
    global _page  # noqa: PLW0603 (one page per worker process)
    _page = page
    _stack.clear()


def current_page() -> mmap.mmap | None:
    """This worker's page, if it has one."""
    return _page


def read_page(page: mmap.mmap) -> tuple[float, float, str] | None:
    """The agent's view: ``(deadline, limit, scope)`` of the running block, or ``None``."""
    (deadline,) = _DEADLINE.unpack_from(page, 0)
    if deadline == 0.0:
        return None
    limit, length = _DETAILS.unpack_from(page, _DEADLINE.size)
    scope = bytes(page[_SCOPE_OFFSET : _SCOPE_OFFSET + min(length, _SCOPE_MAX)])
    return deadline, limit, scope.decode(errors="replace")


def page_used(page: mmap.mmap) -> bool:
    """Whether the worker behind ``page`` has ever entered a timer block."""
    return page[_USED_OFFSET] == 1


def _arm(page: mmap.mmap, deadline: float, details: bytes) -> None:
    # Details first, the deadline last: the agent reads the deadline first. (A block's scope
    # seen with the previous block's deadline is the worst a racing read can get.)
    page[_DEADLINE.size : _DEADLINE.size + len(details)] = details
    _pack_deadline(page, 0, deadline)
    page[_USED_OFFSET] = 1


_prepared: dict[tuple[float, str], tuple[float, bytes]] = {}
_PREPARED_MAX = 4096


def _prepare(after: float, scope: str) -> tuple[float, bytes]:
    """Check a limit and pack it with its scope, once per distinct pair (loops reuse it)."""
    if isinstance(after, bool) or not isinstance(after, int | float) or not after > 0:
        raise ValueError(f"after must be a positive number of seconds, got {after!r}")
    if not isinstance(scope, str):
        raise TypeError(f"scope must be a string, got {scope!r}")
    encoded = scope.encode()[:_SCOPE_MAX]
    prepared = (float(after), _DETAILS.pack(float(after), len(encoded)) + encoded)
    if len(_prepared) < _PREPARED_MAX:
        _prepared[after, scope] = prepared
    return prepared


class expires:  # noqa: N801 (used like a function: ``with timer.expires(...)``)
    """Fail the launch if this block runs longer than ``after`` seconds.

    Args:
        after: The limit in seconds (positive).
        scope: A name for the block, shown in the error (for example ``"step"``, ``"eval"``).

    Raises:
        ValueError: ``after`` is not a positive number.

    Example::

        for batch in loader:
            with torchrunx.timer.expires(after=60, scope="step"):
                train_step(batch)
    """

    __slots__ = ("_details", "_limit")

    def __init__(self, after: float, scope: str = "step") -> None:
        """Check and keep the limit and the scope name (nothing is armed yet)."""
        cached = None if isinstance(after, bool) else _prepared.get((after, scope))
        if cached is None:
            cached = _prepare(after, scope)
        self._limit, self._details = cached

    def __enter__(self) -> expires:  # noqa: PYI034 (Self needs Python 3.11)
        """Arm the watchdog for this block."""
        page = _page
        if page is not None:
            deadline = _monotonic() + self._limit
            _stack.append((deadline, self._details))
            _arm(page, deadline, self._details)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Disarm it, or re-arm the enclosing block's limit."""
        page = _page
        if page is None or not _stack:
            return
        _stack.pop()
        if _stack:
            _arm(page, *_stack[-1])
        else:
            _pack_deadline(page, 0, 0.0)


def pause() -> float | None:
    """The worker stops in the debugger: its watchdog sees no block until :func:`resume`.

    Returns:
        When it paused (for :func:`resume`), or ``None`` if no block runs (nothing to pause).
    """
    if _page is None or not _stack:
        return None
    _pack_deadline(_page, 0, 0.0)
    return _monotonic()


def resume(paused_at: float | None) -> None:
    """The worker runs on: every open block's deadline moves by the time it was paused."""
    if _page is None or paused_at is None or not _stack:
        return
    shift = _monotonic() - paused_at
    _stack[:] = [(deadline + shift, details) for deadline, details in _stack]
    _arm(_page, *_stack[-1])
