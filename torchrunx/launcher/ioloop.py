"""The launcher's one I/O loop: a selector over every socket, pipe and pidfd of a launch.

Every connection (agents and workers), every agent's output pipes and exit descriptor, and a
wake-up pipe for the few helper threads (SSH starts) are registered here; the thread that runs
the launch calls :meth:`IOLoop.run_once` and gets the callbacks of whatever is ready. Nothing in
here decides anything: callbacks turn bytes into events for the launch to apply.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable


class IOLoop:
    """A selector with callbacks, and a thread-safe way to hand it work (:meth:`post`)."""

    def __init__(self) -> None:
        """An empty loop with its wake-up pipe registered."""
        self._selector = selectors.DefaultSelector()
        self._readers: dict[int, Callable[[], None]] = {}
        self._writers: dict[int, Callable[[], None]] = {}
        self._posted: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._closed = False
        self.add_reader(self._wake_read, self._drain_wake)

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever ``fd`` is readable (replacing an earlier one)."""
        self._readers[fd] = callback
        self._update(fd)

    def add_writer(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever ``fd`` is writable."""
        self._writers[fd] = callback
        self._update(fd)

    def remove_reader(self, fd: int) -> None:
        """Stop watching ``fd`` for reading (no error if it was not)."""
        if self._readers.pop(fd, None) is not None:
            self._update(fd)

    def remove_writer(self, fd: int) -> None:
        """Stop watching ``fd`` for writing (no error if it was not)."""
        if self._writers.pop(fd, None) is not None:
            self._update(fd)

    def remove(self, fd: int) -> None:
        """Forget ``fd`` entirely (before it is closed)."""
        self._readers.pop(fd, None)
        self._writers.pop(fd, None)
        self._update(fd)

    def _update(self, fd: int) -> None:
        events = (selectors.EVENT_READ if fd in self._readers else 0) | (
            selectors.EVENT_WRITE if fd in self._writers else 0
        )
        try:
            self._selector.modify(fd, events) if events else self._selector.unregister(fd)
        except KeyError:
            if events:
                self._selector.register(fd, events)

    def post(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` in the loop's thread at its next round (callable from any thread)."""
        with self._lock:
            if self._closed:
                return
            self._posted.append(callback)
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_write, b"\0")

    def wake(self) -> None:
        """Make the loop's current or next wait return at once; safe in a signal handler.

        Takes no lock (a handler may run while its own thread holds one) and runs nothing.
        """
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway), or closed
            os.write(self._wake_write, b"\0")

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass

    def run_once(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds for readiness; run the callbacks of what is ready."""
        if self._posted:
            timeout = 0.0
        for key, events in self._selector.select(timeout):
            fd = int(key.fd)
            if events & selectors.EVENT_WRITE:
                writer = self._writers.get(fd)
                if writer is not None:
                    writer()
            if events & selectors.EVENT_READ:
                reader = self._readers.get(fd)
                if reader is not None:
                    reader()
        while self._posted:
            self._posted.popleft()()

    def close(self) -> None:
        """Release the selector and the wake-up pipe; later posts are dropped."""
        with self._lock:
            self._closed = True
            os.close(self._wake_write)
        os.close(self._wake_read)
        self._selector.close()
