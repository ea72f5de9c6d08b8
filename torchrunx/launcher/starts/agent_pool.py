"""The agent pool: starts one agent per host, replaces one, and closes them all.

Starting is blocking work (an SSH connection and login, ``srun``, ``fork``/``exec``), done by a
small pool of threads (at most :data:`START_THREADS`, whatever the number of hosts); each start
and each agent's exit is handed to the launch's loop as an :class:`AgentStarted` /
:class:`AgentStartFailed` / :class:`AgentExited` event on its queue. How an agent is started is
in :mod:`torchrunx.engines.command` and :mod:`torchrunx.engines.ssh`; what a started agent
says comes on its connection (:mod:`torchrunx.launcher.net.listener`).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchrunx.errors import AgentFailedError

if TYPE_CHECKING:
    from torchrunx.engines.protocol import AgentProcess
    from torchrunx.launcher.net.ioloop import IOLoop

START_THREADS = 32
"""Agents started at once (SSH logins are slow but light: they wait on the network)."""


@dataclass(frozen=True)
class AgentStarted:
    """The agent of ``host_index`` was started (it connects back on its own)."""

    host_index: int
    process: AgentProcess


@dataclass(frozen=True)
class AgentStartFailed:
    """The agent of ``host_index`` could not be started."""

    host_index: int
    error: AgentFailedError


@dataclass(frozen=True)
class AgentExited:
    """The agent process of ``host_index`` ended (``status``: its exit status, if known)."""

    host_index: int
    status: int | None
    process: AgentProcess


PoolEvent = AgentStarted | AgentStartFailed | AgentExited


Starter = Callable[[int], "AgentProcess"]
"""Starts the agent of one host index (raises :class:`AgentFailedError` if it cannot)."""


class AgentPool:
    """Every agent process of one launch; owned by the launch's thread."""

    def __init__(
        self,
        loop: IOLoop,
        emit: Callable[[PoolEvent], None],
        starter: Starter,
        hostnames: list[str],
    ) -> None:
        """A pool that starts agents with ``starter``; ``emit`` (in the loop) gets its events."""
        self.hostnames = hostnames
        self.loop = loop
        self.emit = emit
        self.starter = starter
        self.processes: dict[int, AgentProcess] = {}
        """The current agent process of each host index."""
        self.retired: list[tuple[AgentProcess, bool]] = []
        """Replaced agents (and whether lost), closed at the end."""
        self._lock = threading.Lock()
        self._closing = False
        self._starts = ThreadPoolExecutor(
            max_workers=max(1, min(START_THREADS, len(hostnames))),
            thread_name_prefix="torchrunx-start",
        )
        self._exit_fds: dict[int, int] = {}
        self._output_fds: dict[int, list[int]] = {}
        self._exited: set[int] = set()

    def start(self, host_index: int) -> None:
        """Start the agent of ``host_index`` in the background."""
        self._starts.submit(self._start, host_index)

    def replace(self, host_index: int, *, lost: bool) -> None:
        """Retire the agent of ``host_index`` (closed at the end) and start a new one."""
        old = self.processes.pop(host_index, None)
        if old is not None:
            self.retired.append((old, lost))
        self._forget_fds(host_index)
        self._exited.discard(host_index)
        self.start(host_index)

    def _start(self, host_index: int) -> None:
        try:
            process = self.starter(host_index)
        except AgentFailedError as exc:
            self._report(AgentStartFailed(host_index, exc))
            return
        except Exception as exc:  # noqa: BLE001 (any failure to start is this host's failure)
            hostname = self.hostnames[host_index]
            error = AgentFailedError(hostname, f"cannot start the agent: {exc!r}")
            error.__cause__ = exc
            self._report(AgentStartFailed(host_index, error))
            return
        with self._lock:
            closing = self._closing
            if not closing:
                self.loop.post(functools.partial(self._started, host_index, process))
        if closing:  # the launch ended while this agent was starting
            process.close()

    def _started(self, host_index: int, process: AgentProcess) -> None:
        self.processes[host_index] = process
        self.emit(AgentStarted(host_index, process))
        for fd, read in process.readers():  # its own stdout and stderr, read in the loop
            self._output_fds.setdefault(host_index, []).append(fd)
            self.loop.add_reader(fd, functools.partial(self._read_output, fd, read))
        fd = process.exit_fd
        if fd >= 0:  # a local child: its pidfd wakes the loop the moment it ends
            self._exit_fds[host_index] = fd
            self.loop.add_reader(fd, functools.partial(self._check_exit, host_index, process))

    def _read_output(self, fd: int, read: Callable[[], bool]) -> None:
        if not read():  # the stream ended
            self.loop.remove(fd)

    def _check_exit(self, host_index: int, process: AgentProcess) -> None:
        if host_index in self._exited or self.processes.get(host_index) is not process:
            return
        status = process.wait(0)
        if status is None:
            return
        self._exited.add(host_index)
        for _fd, read in process.readers():  # what it wrote last comes before its end
            read()
        fd = self._exit_fds.pop(host_index, -1)
        if fd >= 0:
            self.loop.remove(fd)
        self.emit(AgentExited(host_index, status, process))

    def _forget_fds(self, host_index: int) -> None:
        for fd in [self._exit_fds.pop(host_index, -1), *self._output_fds.pop(host_index, [])]:
            if fd >= 0:
                self.loop.remove(fd)  # before the process closes it

    def exit_status_now(self, host_index: int) -> int | None:
        """The exit status of host ``host_index``'s agent process if it has ended, or None.

        Without waiting; its :class:`AgentExited` is reported as always.
        """
        process = self.processes.get(host_index)
        if process is None:
            return None
        self._check_exit(host_index, process)
        return process.wait(0) if host_index in self._exited else None

    def poll(self) -> None:
        """Report agents that ended (for those without an exit descriptor: SSH; once a tick)."""
        for host_index, process in list(self.processes.items()):
            if host_index not in self._exit_fds:
                self._check_exit(host_index, process)

    def _report(self, event: PoolEvent) -> None:
        self.loop.post(functools.partial(self.emit, event))

    def close(self, lost: set[int]) -> None:
        """End every agent (``lost`` ones are not waited for) and release everything.

        Starts still under way end within their connect timeout and close what they made.
        """
        with self._lock:
            self._closing = True
        self._starts.shutdown(wait=True, cancel_futures=True)
        self.loop.run_once(0)  # agents whose start finished meanwhile
        for host_index in list(self.processes):
            self._forget_fds(host_index)
        processes = [(p, index in lost) for index, p in self.processes.items()]
        everything = [*processes, *self.retired]
        pending = collections.deque(everything)
        try:
            with ThreadPoolExecutor(
                max_workers=max(1, min(START_THREADS, len(everything))),
                thread_name_prefix="torchrunx-close",
            ) as closers:
                while pending:
                    process, was_lost = pending[0]
                    closers.submit(process.close, 0.0 if was_lost else 5.0)
                    pending.popleft()
        except RuntimeError:  # at interpreter exit (warm agents) no thread starts: in turn
            for process, was_lost in pending:
                process.close(0.0 if was_lost else 5.0)
