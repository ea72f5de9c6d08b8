"""The guardian: kills the workers' process groups when their agent dies, however it dies.

Workers die with their agent by ``PR_SET_PDEATHSIG``, but what they started would not: each
worker leads its own process group, and nothing else ends those. So the agent forks the
guardian first of all (single-threaded, before it connects to the launcher), tells it each
worker's process group as it forks the worker, and takes it back once the worker is reaped.
When the agent's end of their pipe closes (the agent exited, was killed, or crashed), the
guardian sends SIGKILL to every group it still knows, then exits. It lives in a session of
its own, so a signal to the agent's process group does not reach it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
from typing import NoReturn

_PGID = struct.Struct("!i")


class Guardian:
    """The agent's handle on its guardian process (see the module's description)."""

    def __init__(self) -> None:
        """Fork the guardian; it waits on a pipe whose write end stays here."""
        read_end, self.fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.fd)
            _guard(read_end)
        os.close(read_end)

    def watch(self, pgid: int) -> None:
        """Kill process group ``pgid`` if the agent dies."""
        os.write(self.fd, _PGID.pack(pgid))

    def forget(self, pgid: int) -> None:
        """The group's leader was reaped: its id may be reused, never signal it."""
        os.write(self.fd, _PGID.pack(-pgid))

    def close(self) -> None:
        """The agent ends: the guardian kills what it still knows of, and is reaped."""
        os.close(self.fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _guard(fd: int) -> NoReturn:
    try:
        os.setsid()  # outside the agent's process group: survives a kill of that group
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):  # hold none of the agent's pipes open
            os.dup2(devnull, std)
        groups: set[int] = set()
        pending = b""
        while chunk := os.read(fd, 4096):
            pending += chunk
            whole = len(pending) - len(pending) % _PGID.size
            for (pgid,) in _PGID.iter_unpack(pending[:whole]):
                if pgid > 0:
                    groups.add(pgid)
                else:
                    groups.discard(-pgid)
            pending = pending[whole:]
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    finally:
        os._exit(0)
