"""Preemption in the workers: the launch will stop soon; save and return (public).

When the launcher receives SIGTERM (SLURM's ``--signal``, ``scancel --signal``, a spot
notice, a plain ``kill``), or one host's agent does, and ``Launcher.preemption_grace`` is more
than 0, every rank is told, and has until the deadline to save its state and return::

    import torchrunx

    def train(ckpt: str) -> int:
        step = resume(ckpt)
        while step < total:
            step = train_one_step(step)
            if torchrunx.preemption_requested():   # a read of shared memory: poll freely
                save(ckpt, step)
                return step
        return step

Then every process is stopped, as after any launch, and the caller gets
:class:`torchrunx.Preempted`, with the values of the ranks that returned.

How a worker learns it (no syscall per poll): its agent shares one small page with it
(:func:`new_page`) and writes the deadline there (:func:`request`). With a grace period, a
worker also takes a SIGTERM that reaches it from outside (SLURM signals every process of a
job step) as the notice, not as the end: the agent marks the page before it sends its own
SIGTERM to stop a worker (:func:`mark_stopping`), and that one ends the worker as before.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import struct
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger("torchrunx.preemption")

PAGE_SIZE = 256
_DEADLINE = struct.Struct("=d")  # offset 0: wall-clock deadline (time.time()), 0.0: none
_STOPPING = 8  # 1 once the agent stops this worker: its SIGTERM is no notice
_REASON_LENGTH = struct.Struct("=H")  # offset 10: the reason's length, then the reason
_REASON = 12
_REASON_MAX = PAGE_SIZE - _REASON

_page: mmap.mmap | None = None
_grace = 0.0
_callbacks: list[Callable[[float], None]] = []
_watcher: threading.Thread | None = None
_lock = threading.Lock()


def new_page() -> mmap.mmap:
    """A page an agent shares with one worker (made before the fork)."""
    return mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_SHARED)


def request(page: mmap.mmap, deadline: float, reason: str) -> None:
    """Tell the worker of ``page``: save and return by ``deadline`` (wall-clock seconds)."""
    if _DEADLINE.unpack_from(page, 0)[0]:
        return  # the first notice's deadline stands
    encoded = reason.encode(errors="replace")[:_REASON_MAX]
    page[_REASON : _REASON + len(encoded)] = encoded
    _REASON_LENGTH.pack_into(page, 10, len(encoded))
    _DEADLINE.pack_into(page, 0, deadline)  # last: a reader that sees it sees the reason


def mark_stopping(page: mmap.mmap) -> None:
    """The agent is about to stop the worker of ``page`` with SIGTERM: that ends it."""
    page[_STOPPING] = 1


def attach(page: mmap.mmap, grace: float) -> None:
    """In a worker: read notices from ``page``; ``grace`` > 0: an outside SIGTERM is one."""
    global _page, _grace
    _page, _grace = page, grace
    if grace > 0:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: object) -> None:
    del frame
    page = _page
    if page is None or page[_STOPPING]:  # the agent stops this worker: end as before
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    # From outside (SLURM signals every process of a step): the notice, with the launch's
    # grace from now, unless the launcher's own notice came first.
    request(page, time.time() + _grace, "this worker received SIGTERM")


def preemption_requested() -> bool:
    """Whether this rank was told to save and return (see the module); False outside workers."""
    page = _page
    return page is not None and _DEADLINE.unpack_from(page, 0)[0] != 0.0


def preemption_deadline() -> float | None:
    """When the rank is stopped (``time.time()`` seconds), once preemption was requested."""
    page = _page
    if page is None:
        return None
    (deadline,) = _DEADLINE.unpack_from(page, 0)
    return deadline or None


def preemption_reason() -> str | None:
    """Why the launch is being stopped (``"the launcher received SIGTERM"``), once requested."""
    page = _page
    if page is None or not preemption_requested():
        return None
    (length,) = _REASON_LENGTH.unpack_from(page, 10)
    return bytes(page[_REASON : _REASON + length]).decode(errors="replace")


def on_preemption(callback: Callable[[float], None]) -> None:
    """Call ``callback(deadline)`` once, when preemption is requested (in a worker).

    It runs in a background thread of the worker (a daemon that looks every 0.1 s), so it
    should only set a flag or start a save that the training loop waits for. One registered
    after the request is called at once (in that thread). In the launcher's process, where
    nothing is ever requested, it is never called.
    """
    global _watcher  # noqa: PLW0603 (one watcher per process)
    with _lock:
        _callbacks.append(callback)
        if _page is not None and _watcher is None:
            _watcher = threading.Thread(target=_watch, name="torchrunx-preemption", daemon=True)
            _watcher.start()


_called = 0
"""Callbacks called so far (in the order registered)."""


def _watch() -> None:
    global _called, _watcher  # noqa: PLW0603 (the watcher thread's own count)
    while not preemption_requested():
        time.sleep(0.1)
    deadline = preemption_deadline() or time.time()
    while True:  # callbacks added meanwhile are called too
        with _lock:
            pending = _callbacks[_called:]
            _called = len(_callbacks)
            if not pending:
                _watcher = None  # a later callback starts a new watcher
                return
        for callback in pending:
            _call(callback, deadline)


def _call(callback: Callable[[float], None], deadline: float) -> None:
    """One callback; its failure is logged and the others still run."""
    try:
        callback(deadline)
    except Exception:
        logger.exception("on_preemption callback %r failed", callback)
