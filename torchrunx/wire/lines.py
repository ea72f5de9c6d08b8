r"""The line format that agents, workers and the launcher share: marked lines and their parsing.

Each worker's file descriptors 1 and 2 are pipes read by its agent. ``logging`` and
``warnings`` records in workers and agents are written to stderr as *marked lines* that keep
their level and logger name (:class:`MarkedLineFormatter`, set up by
:func:`torchrunx.worker.capture.capture_logging`)::

    \x1e<levelno>\x1f<logger name>\x1f<message, newlines as \x1d>\n

The agent splits its workers' output into whole lines (:class:`LineSplitter`, never mid-line)
and sends them in batches of :data:`Record` (:class:`torchrunx.wire.messages.LogLines`) over its
authenticated connection, as it reads them, and always before it reports that worker's exit;
the launcher splits and parses the agent's own stdout/stderr (SSH channel or pipe) the same
way (:func:`parse_line`). Plain stdout lines are INFO, plain stderr lines WARNING; marked lines
keep their own level.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torchrunx.wire.frozen import frozen

if TYPE_CHECKING:
    from collections.abc import Sequence

RECORD_START = "\x1e"
FIELD_SEP = "\x1f"
NEWLINE = "\x1d"
STDOUT_LEVEL = logging.INFO
STDERR_LEVEL = logging.WARNING
TAIL_LINE_BYTES = 4 * 1024
"""A line kept for a failure note is cut to this many UTF-8 bytes (the log files keep it all)."""
MAX_LINE_BYTES = 1 << 20

STACKS_LOGGER = "torchrunx.stacks"
"""Logger name of the record, one of a worker's own, with the stacks it wrote on ``kill -USR1``.

The agent sends it alone in its :class:`~torchrunx.wire.messages.LogLines` message; the
default console shows it for every worker, shown or not."""


class MarkedLineFormatter(logging.Formatter):
    """Formats a record as one marked line (used inside agents and workers)."""

    def format(self, record: logging.LogRecord) -> str:
        """One line: marker, level, logger name, message (with the traceback, if any)."""
        text = super().format(record).rstrip("\n").replace("\n", NEWLINE)
        return f"{RECORD_START}{record.levelno}{FIELD_SEP}{record.name}{FIELD_SEP}{text}"


@frozen
class Line:
    """One line of output, parsed: level, logger name and text."""

    levelno: int
    name: str
    text: str


Record = tuple[int | None, int, str, str, float]
"""One forwarded line, as a :class:`~torchrunx.wire.messages.LogLines` message holds it:
``(local_rank, levelno, logger name, text, unix time)``; ``local_rank`` is ``None`` for the
agent."""


def parse_line(raw: str, *, is_stderr: bool, default_name: str) -> Line:
    """Parse a marked line, or classify a plain one by its stream."""
    if raw.startswith(RECORD_START):
        fields = raw[1:].split(FIELD_SEP, 2)
        if len(fields) == 3 and fields[0].isdigit():
            return Line(int(fields[0]), fields[1], fields[2].replace(NEWLINE, "\n"))
    return Line(STDERR_LEVEL if is_stderr else STDOUT_LEVEL, default_name, raw)


def line_records(
    lines: Sequence[str],
    *,
    is_stderr: bool,
    default_name: str,
    local_rank: int | None,
    created: float,
) -> list[Record]:
    """:class:`~torchrunx.wire.messages.LogLines` records of whole lines read from one stream.

    Each line as :func:`parse_line` parses it, without making a :class:`Line` of each.
    """
    level = STDERR_LEVEL if is_stderr else STDOUT_LEVEL
    records: list[Record] = []
    for raw in lines:
        if raw.startswith(RECORD_START):
            line = parse_line(raw, is_stderr=is_stderr, default_name=default_name)
            records.append((local_rank, line.levelno, line.name, line.text, created))
        else:
            records.append((local_rank, level, default_name, raw, created))
    return records


class LineSplitter:
    r"""Turns chunks of bytes into whole lines; keeps an unfinished line until its end.

    A carriage return ends a line too: a progress bar (tqdm) redraws itself with ``\r`` and
    ends with ``\n`` only when it closes, so each redraw becomes a line of its own, as it
    comes, instead of one line at the end of training. ``\r\n`` is one line end, and blank
    pieces between carriage returns (a bar clearing itself) are dropped. A marked record
    written after an unfinished line (a bar) starts a line of its own.
    """

    def __init__(self) -> None:
        """Start with nothing pending."""
        self.pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        """Whole lines completed by ``chunk`` (an empty chunk means EOF: flush the rest)."""
        if not chunk:
            rest, self.pending = self.pending, b""
            return [line.decode(errors="replace") for line in _redraws(rest)]
        data = self.pending + chunk
        # Most chunks hold plain lines and records that start lines: no piece to look at.
        inner = data.count(_RECORD_START) - data.count(b"\n" + _RECORD_START)
        if b"\r" not in data and inner <= data.startswith(_RECORD_START):
            # Decoded in one go: no UTF-8 sequence holds a "\n" byte, so the lines come out
            # as if each were decoded alone, invalid bytes replaced alike.
            end = data.rfind(b"\n") + 1
            text = data[: end - 1].decode(errors="replace").split("\n") if end else []
            self.pending = data[end:]
            if len(self.pending) > MAX_LINE_BYTES:  # a line without end: pass it on in pieces
                text.append(self.pending.decode(errors="replace"))
                self.pending = b""
            return text
        *done, pending = data.split(b"\n")
        done = [piece for line in done for piece in _redraws(line, keep_blank=True)]
        if b"\r" in pending and _RECORD_START not in pending:  # a record: wait for its end
            *drawn, pending = pending.split(b"\r")
            done += [piece for piece in drawn if piece.strip()]
            pending = pending or b"\r"  # so that a "\n" coming next ends no empty line
        if len(pending) > MAX_LINE_BYTES:  # a line without end: pass it on in pieces
            done.append(pending)
            pending = b""
        self.pending = pending
        return [line.decode(errors="replace") for line in done]


_RECORD_START = RECORD_START.encode()


def _redraws(line: bytes, *, keep_blank: bool = False) -> list[bytes]:
    r"""The non-blank pieces of ``line`` between ``\r``; a marked record or plain line as it is."""
    start = line.find(_RECORD_START)
    if start > 0:  # a record written after an unfinished line: a line of its own, kept whole
        return [*_redraws(line[:start]), line[start:]]
    if start == 0 or b"\r" not in line:
        return [line] if line or keep_blank else []
    return [piece for piece in line.split(b"\r") if piece.strip()]


def cut_line(text: str, limit: int = TAIL_LINE_BYTES) -> str:
    """``text`` cut to ``limit`` UTF-8 bytes, with a marker saying how many bytes were cut."""
    if len(text) * 4 <= limit:  # no character takes more than 4 bytes: short enough
        return text
    data = text.encode(errors="replace")
    if len(data) <= limit:
        return text
    kept = data[:limit].decode(errors="ignore")  # never half a character
    return f"{kept} [... {len(data) - len(kept.encode())} more bytes cut]"
