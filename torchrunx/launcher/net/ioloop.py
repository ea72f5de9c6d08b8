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
import select
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable


_Posted = tuple["Callable[[], None]", "Callable[[], None] | None"]
"""A posted callback, and what releases what it holds if it never runs."""
_READY_TO_READ = select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP
_READY_TO_WRITE = select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP


class IOLoop:
    """An epoll set with callbacks, and a thread-safe way to hand it work (:meth:`post`).

    Straight on ``select.epoll`` (the launcher runs on Linux): at thousands of connections,
    the ``selectors`` module's bookkeeping cost more than the system calls it wraps. An error
    or hang-up on a descriptor calls both of its callbacks, so each sees the end. A descriptor
    is removed (:meth:`remove`) before it is closed, as with any selector.
    """

    def __init__(self) -> None:
        """An empty loop with its wake-up pipe registered."""
        self._epoll = select.epoll()
        self._masks: dict[int, int] = {}
        """Each registered descriptor's events, as epoll holds them."""
        self._readers: dict[int, Callable[[], None]] = {}
        self._writers: dict[int, Callable[[], None]] = {}
        self._posted: collections.deque[_Posted] = collections.deque()
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
        mask = (select.EPOLLIN if fd in self._readers else 0) | (
            select.EPOLLOUT if fd in self._writers else 0
        )
        now = self._masks.get(fd, 0)
        if now == mask:
            return
        if not mask:
            del self._masks[fd]
            with contextlib.suppress(OSError):  # closed already: the kernel forgot it
                self._epoll.unregister(fd)
        else:
            self._epoll.modify(fd, mask) if now else self._epoll.register(fd, mask)
            self._masks[fd] = mask

    def post(self, callback: Callable[[], None], on_drop: Callable[[], None] | None = None) -> None:
        """Run ``callback`` in the loop's thread at its next round (callable from any thread).

        ``on_drop``: called instead when the callback will never run (the loop is closed, or
        closes first), so that what it was handed (a socket, say) is released, not left open.
        """
        with self._lock:
            if not self._closed:
                self._posted.append((callback, on_drop))
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_write, b"\0")
                return
        if on_drop is not None:
            on_drop()

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
        wait = -1.0 if timeout is None else max(timeout, 0.0)  # epoll waits forever below 0
        for fd, events in self._epoll.poll(wait, max(len(self._masks), 1)):
            if events & _READY_TO_WRITE:
                writer = self._writers.get(fd)
                if writer is not None:
                    writer()
            if events & _READY_TO_READ:
                reader = self._readers.get(fd)
                if reader is not None:
                    reader()
        while self._posted:
            self._posted.popleft()[0]()

    def close(self) -> None:
        """Release the selector and the wake-up pipe; posts not run, and later ones, are dropped.

        Each dropped post's ``on_drop`` is called (see :meth:`post`).
        """
        with self._lock:
            self._closed = True
            os.close(self._wake_write)
            dropped, self._posted = list(self._posted), collections.deque()
        os.close(self._wake_read)
        self._epoll.close()
        for _callback, on_drop in dropped:
            if on_drop is not None:
                on_drop()
