"""The launcher's side of ``breakpoint()`` in a worker: pdb sessions in the launcher's terminal.

A worker that stops in its debugger (:mod:`torchrunx.worker.debugger`) sends what pdb wrote as
:class:`~torchrunx.wire.messages.DebugOutput`; :class:`Debugger` prints it, reads the line the
user types on the launcher's stdin (through the launch's own I/O loop, so heartbeats, other
ranks' output and faults go on meanwhile) and sends it to that rank.

One rank has the terminal at a time. Another rank that stops meanwhile waits: a line says so,
``:ranks`` lists the ranks in the debugger and ``:rank N`` switches to one. When the rank that
has the terminal runs on (``c``), the next waiting rank gets it. While any rank is in the
debugger, ``launch_timeout`` does not count (:meth:`Debugger.paused`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from torchrunx.wire.messages import DebugInput, DebugOutput

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.launcher.net.ioloop import IOLoop
    from torchrunx.launcher.settings.environ import LauncherEnviron

logger = logging.getLogger("torchrunx.launcher")

HELP = (
    "torchrunx: lines go to the rank whose prompt is shown; ':ranks' lists the ranks in the "
    "debugger, ':rank N' switches to rank N\n"
)


@dataclass
class _Stop:
    """A rank in the debugger."""

    hostname: str
    where: str = ""
    waiting: bool = False
    unseen: str = ""
    """Output not printed yet (the rank does not have the terminal)."""
    prompt: str = ""
    """The last prompt it showed (printed again when the terminal comes back to it)."""
    announced: bool = False


class Debugger:
    """The ranks in the debugger and the terminal they share; owned by the launch's thread."""

    def __init__(  # noqa: PLR0913 (the plan's settings: a keyword)
        self,
        loop: IOLoop,
        send: Callable[[int, DebugInput], None],
        hostname: Callable[[int], str],
        *,
        stdin_fd: int,
        out: TextIO | None = None,
        settings: LauncherEnviron | None = None,
    ) -> None:
        """Sessions on ``loop``, typed on ``stdin_fd``; ``send(rank, message)`` reaches a rank.

        ``settings``: the plan's environment variables, ``TORCHRUNX_POST_MORTEM`` and
        ``TORCHRUNX_DEBUGPY`` (:mod:`torchrunx.launcher.settings.environ`); None: neither.
        """
        self._loop = loop
        self._send = send
        self._hostname = hostname
        self._fd = stdin_fd
        self._out = out
        self.terminal = _is_tty(stdin_fd)
        """Whether the launcher has a terminal to debug in (its stdin is a TTY)."""
        self.post_mortem = settings is not None and settings.post_mortem and self.terminal
        """A rank that raises opens pdb at the raising frame first (``TORCHRUNX_POST_MORTEM``)."""
        self.debugpy = None if settings is None else settings.debugpy
        """``(rank, port)``: that rank waits for an IDE's debugger (``TORCHRUNX_DEBUGPY``)."""
        self.stops: dict[int, _Stop] = {}
        self.current: int | None = None
        self._reading = False
        self._partial = b""
        self._paused_since: float | None = None
        self._paused_total = 0.0

    # -- what the workers say ------------------------------------------------------------

    def on_output(self, rank: int, message: DebugOutput) -> None:
        """A rank's debugger wrote ``message.text``; it waits for a line if ``waiting``."""
        if message.waiting and not self.terminal:  # no terminal (any more): it runs on
            self._answer(rank, None)
            return
        stop = self.stops.get(rank)
        if stop is None:
            if message.resumed:  # not in the debugger: a breakpoint skipped (no terminal)
                sys.stderr.write(message.text)
                sys.stderr.flush()
                return
            stop = self.stops[rank] = _Stop(self._hostname(rank))
            if self._paused_since is None:
                self._paused_since = time.monotonic()
        stop.where = message.where or stop.where
        stop.waiting = message.waiting
        if message.waiting:
            stop.prompt = message.text.rsplit("\n", 1)[-1]
        stop.unseen += message.text
        current = self._current()
        if current is None or (message.waiting and not current.waiting and rank != self.current):
            self._switch(rank, stop)  # the terminal's rank runs: this one needs it
        elif rank == self.current:
            self._write(stop.unseen)
            stop.unseen = ""
        elif message.waiting and not stop.announced:
            stop.announced = True
            self._write(
                f"\ntorchrunx: rank {rank} on {stop.hostname} stopped in the debugger at "
                f"{stop.where or 'a breakpoint'} and waits; ':rank {rank}' switches to it\n"
            )
        if message.resumed:
            self._leave(rank)
        self._listen()

    def forget(self, rank: int) -> None:
        """The rank's worker is gone (it ended, or its connection did)."""
        if rank in self.stops:
            self._leave(rank)
            self._listen()

    def warn_missing_rank(self, world_size: int) -> None:
        """Warn if ``TORCHRUNX_DEBUGPY`` chose a rank the launch does not have."""
        if self.debugpy is not None and self.debugpy[0] >= world_size:
            logger.warning(
                "TORCHRUNX_DEBUGPY chose rank %d, but the launch has ranks 0 to %d: no rank "
                "waits for an IDE",
                self.debugpy[0],
                world_size - 1,
            )

    def paused(self, now: float) -> float:
        """Seconds so far with at least one rank in the debugger (not counted by timeouts)."""
        since = self._paused_since
        return self._paused_total + (0.0 if since is None else now - since)

    def close(self) -> None:
        """Stop reading the terminal; ranks still waiting are told to go on."""
        for rank, stop in list(self.stops.items()):
            if stop.waiting:
                self._answer(rank, None)
        self.stops.clear()
        self.current = None
        self._listen()

    # -- the terminal ----------------------------------------------------------------------

    def _switch(self, rank: int, stop: _Stop) -> None:
        self.current = rank
        self._write(
            f"\n--- pdb: rank {rank} on {stop.hostname}"
            f"{f' at {stop.where}' if stop.where else ''} ---\n"
        )
        if len(self.stops) > 1:
            self._write(HELP)
        text = stop.unseen
        stop.unseen = ""
        if stop.waiting and not text:  # its prompt was shown before: again
            text = stop.prompt
        self._write(text)

    def _current(self) -> _Stop | None:
        """The rank that has the terminal, if any."""
        return None if self.current is None else self.stops.get(self.current)

    def _leave(self, rank: int) -> None:
        del self.stops[rank]
        if rank == self.current:
            self.current = None
            waiting = [r for r, s in self.stops.items() if s.waiting]
            if waiting:
                self._switch(waiting[0], self.stops[waiting[0]])
            elif self.stops:  # only running ones: the first keeps the terminal
                first = next(iter(self.stops))
                self._switch(first, self.stops[first])
        if not self.stops and self._paused_since is not None:
            self._paused_total += time.monotonic() - self._paused_since
            self._paused_since = None

    def _listen(self) -> None:
        want = bool(self.stops) and self.terminal
        if want and not self._reading:
            self._loop.add_reader(self._fd, self._on_readable)
        elif not want and self._reading:
            self._loop.remove_reader(self._fd)
        self._reading = want

    def _on_readable(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # end of input (Ctrl-D at an empty line): no terminal from now on
            self.terminal = False
            self._write("\ntorchrunx: end of input: every rank in the debugger runs on\n")
            self.close()
            return
        self._partial += data
        *lines, self._partial = self._partial.split(b"\n")
        for line in lines:
            self._on_line(line.decode(errors="replace"))

    def _on_line(self, line: str) -> None:
        command = line.strip()
        if command == ":ranks":
            for rank, stop in self.stops.items():
                mark = "*" if rank == self.current else " "
                state = "waits" if stop.waiting else "runs"
                self._write(f"{mark} rank {rank} on {stop.hostname}: {state}, {stop.where}\n")
            self._prompt_again()
            return
        if command.startswith(":rank"):
            target = command.removeprefix(":rank").strip()
            if target.isdigit() and int(target) in self.stops:
                self._switch(int(target), self.stops[int(target)])
            else:
                self._write(
                    f"torchrunx: no rank {target or '?'} in the debugger; ':ranks' lists them\n"
                )
                self._prompt_again()
            return
        current = self._current()
        if current is None or not current.waiting:
            self._write(
                "torchrunx: no rank waits for a line now (the rank in the debugger runs); "
                "':ranks' lists them\n"
            )
            return
        assert self.current is not None  # noqa: S101 (current is set)
        self._answer(self.current, line)

    def _answer(self, rank: int, line: str | None) -> None:
        stop = self.stops.get(rank)
        if stop is not None:
            stop.waiting = False
        with contextlib.suppress(OSError):
            self._send(rank, DebugInput(line))

    def _prompt_again(self) -> None:
        current = self._current()
        if current is not None and current.waiting:
            self._write(current.prompt)

    def _write(self, text: str) -> None:
        if not text:
            return
        out = self._out if self._out is not None else sys.stdout
        out.write(text)
        out.flush()


def _is_tty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False
