"""The agent imports torch once, in a background thread, so that its workers inherit it.

The thread also imports :mod:`torchrunx.worker.worker` (with cloudpickle and the rest of what a
worker
runs), with or without torch, so that no worker imports it after its fork.

Then it imports the modules of ``TORCHRUNX_PRELOAD`` (:attr:`AgentBootstrap.preload
<torchrunx.wire.bootstrap.AgentBootstrap.preload>`), so that each worker inherits them too
instead of importing them itself: for heavy imports that are safe to fork (they must not start
CUDA or read ``RANK`` when imported).

The import (``torch.distributed``, which never initialises CUDA) starts right after the
agent's hello and overlaps the wait for the other hosts. The agent's loop waits for it like
for any other source: the thread writes to a pipe when done (:meth:`TorchPreload.fileno`).
Before the agent forks, :meth:`TorchPreload.join` makes sure the thread is gone from the
kernel, not only from Python (:func:`wait_for_thread_exit`), so the agent is single-threaded
when it forks.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
import warnings


class TorchPreload:
    """One import of ``torch.distributed`` in a background thread (or none, if not enabled)."""

    def __init__(self, *, enabled: bool, modules: tuple[str, ...] = ()) -> None:
        """Start the thread; it imports torch only if ``enabled``, and says when it is done.

        ``modules`` (``TORCHRUNX_PRELOAD``) are imported after torch; one that fails to import
        is left to the workers (which import it themselves, and fail there if it cannot be),
        and the agent logs why (:attr:`failed`).
        """
        self._done_read, self._done_write = os.pipe()
        self._tid: list[int] = []
        self.failed: list[str] = []
        """``"module: error"`` for each of ``modules`` that could not be imported."""
        self._thread = threading.Thread(
            target=_preload_torch,
            args=(enabled, modules, self.failed, self._done_write, self._tid),
            name="torchrunx-preload",
        )
        self._thread.start()

    def fileno(self) -> int:
        """A descriptor that becomes readable when the import is over (for a selector)."""
        return self._done_read

    def join(self) -> None:
        """Wait for the thread to end and leave the kernel; then release the pipe."""
        self._thread.join()
        wait_for_thread_exit(self._tid)
        os.close(self._done_read)
        os.close(self._done_write)


def _preload_torch(
    enabled: bool, modules: tuple[str, ...], failed: list[str], done_fd: int, tid: list[int]
) -> None:
    # Importing torch.distributed does not initialise CUDA; forked workers inherit the modules.
    tid.append(threading.get_native_id())
    try:
        # The workers' own module and what it imports (cloudpickle, ...): imported once here,
        # not in every forked worker (where it took 30 ms of each warm run's start).
        import torchrunx.worker.worker  # noqa: F401, PLC0415

        if enabled:
            with contextlib.suppress(ImportError), warnings.catch_warnings():
                # torch's import warns where numpy is missing; torchrunx does not need it,
                # and the agent's import is ours, not the user's.
                warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
                import torch.distributed  # noqa: F401, PLC0415
        failed.extend(filter(None, map(_import, modules)))
    finally:
        os.write(done_fd, b"1")


def _import(name: str) -> str | None:
    """Import module ``name``; None, or why it could not be: ``"name: Error: message"``."""
    try:
        importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 (any error of the user's module: reported)
        return f"{name}: {type(exc).__name__}: {exc}"
    return None


def wait_for_thread_exit(tid: list[int], limit: float = 2.0) -> None:
    """Wait until a thread's OS thread is gone, not only its Python side.

    ``Thread.join`` returns before the thread's C-level destructors have run; MKL's run under
    a lock of its own. A worker forked meanwhile inherits that lock held, and its first matrix
    product spins forever in ``mm_account_ptr_by_tid`` (seen with gdb, about once in 20
    launches). No event tells when a thread has left the kernel, so this looks at
    ``/proc/self/task`` every millisecond, for at most ``limit`` seconds.

    Args:
        tid: The thread's native id (``threading.get_native_id()``) as its only item, or
            nothing if the thread never ran.
        limit: The longest wait, in seconds.
    """
    if not tid:
        return
    task = f"/proc/self/task/{tid[0]}"
    deadline = time.monotonic() + limit
    while os.path.exists(task) and time.monotonic() < deadline:  # noqa: PTH110 (hot, tiny)
        time.sleep(0.001)
