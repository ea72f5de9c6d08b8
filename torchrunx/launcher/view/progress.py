"""A progress line for the launch's long steps, on a terminal only (tqdm's conventions).

One line on stderr, redrawn in place with a carriage return at most every
:data:`MIN_INTERVAL_S`, shown only once a step has taken :data:`DELAY_S` (a quick launch shows
nothing), and erased when the step ends, so that nothing of it stays between the launch's own
lines. It is never written into a log, to a stderr that is not a terminal, or in a notebook,
unless ``TORCHRUNX_PROGRESS=1`` asks for it (then from a step's start, without the delay;
``0``: never). :func:`progress_text` is pure.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from collections.abc import Callable

MIN_INTERVAL_S = 0.1
"""The line is redrawn at most this often (tqdm's ``mininterval``)."""
DELAY_S = 0.5
"""A step shows no line before it has taken this long (tqdm's ``delay``)."""


def progress_enabled(stream: TextIO, forced: bool | None = None) -> bool:
    """Whether to draw: ``forced`` (the plan's ``TORCHRUNX_PROGRESS``), else on a terminal.

    Not in a notebook, unless forced.
    """
    if forced is not None:
        return forced
    if "ipykernel" in sys.modules:
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def mib(count: int) -> str:
    """Bytes as MiB with one decimal."""
    return f"{count / 2**20:.1f} MiB"


def progress_text(what: str, done: int, total: int | None, unit: str, seconds: float) -> str:
    """``torchrunx: agents starting: 3/8 hosts up [2.1 s]`` (bytes shown as MiB)."""
    if unit == "bytes":
        count = mib(done) if total is None else f"{mib(done)} of {mib(total)}"
    else:
        count = f"{done}/{total} {unit}" if total is not None else f"{done} {unit}"
    return f"torchrunx: {what}: {count} [{seconds:.1f} s]"


class ProgressLine:
    """One step's line (owned by the launch's loop).

    Args:
        what: The step, e.g. ``"agents starting"``.
        total: How many there are to do, if known.
        unit: What is counted (``"bytes"``: shown in MiB).
        stream: Where to draw (stderr).
        forced: The plan's ``TORCHRUNX_PROGRESS``: True draws at once, even off a terminal;
            False never draws; None: on a terminal, after :data:`DELAY_S`.
    """

    def __init__(
        self,
        what: str,
        total: int | None,
        unit: str,
        stream: TextIO | None = None,
        forced: bool | None = None,
    ) -> None:
        """Start timing the step; nothing is drawn yet."""
        self.what, self.total, self.unit = what, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(self.stream, forced)
        self.delay = 0.0 if forced else DELAY_S
        self.started = time.monotonic()
        self._drawn_at = 0.0
        self._width = 0
        self.extra = ""

    def due(self) -> bool:
        """Whether :meth:`update` would draw now (so that a caller counts only then)."""
        if not self.enabled:
            return False
        now = time.monotonic()
        return now - self.started >= self.delay and now - self._drawn_at >= MIN_INTERVAL_S

    def update(self, done: int, extra: str = "", *, now_or_never: bool = False) -> None:
        """Redraw with ``done`` (and ``extra`` after it), if it is time to.

        ``now_or_never``: the step's last figure, drawn at once if a line is shown at all.
        """
        if not (self.due() or (now_or_never and self._width)):
            return
        now = time.monotonic()
        text = progress_text(self.what, done, self.total, self.unit, now - self.started) + extra
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._drawn_at, self._width = now, len(text)

    def close(self) -> None:
        """Erase the line, if one was drawn."""
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


class BytesProgress:
    """A line for bytes that may come: drawn from the first byte, timed from then.

    ``count()`` gives the bytes so far (e.g. of the workers' large results, as the launcher's
    listener counts them); :meth:`update` draws ``torchrunx: WHAT: 12.0 MiB [1.5 s]`` once
    there are any, with :class:`ProgressLine`'s rules (a terminal, the delay, the interval).
    """

    def __init__(
        self,
        what: str,
        count: Callable[[], int],
        stream: TextIO | None = None,
        forced: bool | None = None,
    ) -> None:
        """Note where ``count()`` stands now: only what comes after counts.

        ``forced``: as for :class:`ProgressLine`.
        """
        self.what, self.count, self.stream, self.forced = what, count, stream, forced
        self.start = count()
        self.line: ProgressLine | None = None

    def update(self) -> None:
        """Redraw (if it is time to), once bytes have come."""
        done = self.count() - self.start
        if done and self.line is None:
            self.line = ProgressLine(self.what, None, "bytes", self.stream, self.forced)
        if self.line is not None:
            self.line.update(done)

    def close(self) -> None:
        """Draw the last count (the truth, however fast the bytes came), then erase the line.

        Only if a line was drawn: a redraw waits :data:`MIN_INTERVAL_S`, and bytes that all
        came within it would otherwise end on the first figure (``0.0 MiB``), which a log of
        a forced line (``TORCHRUNX_PROGRESS=1``) would keep.
        """
        if self.line is not None:
            self.line.update(self.count() - self.start, now_or_never=True)
            self.line.close()
