r"""Logs: capture in agents and workers, forwarding, and the launcher's handlers.

Capture. Each worker's file descriptors 1 and 2 are pipes read by its agent, so everything
the worker writes (``print``, C extensions, child processes) is captured at the descriptor
level and survives the worker's death. ``logging`` and ``warnings`` records in workers and
agents are written to stderr as *marked lines* that keep their level and logger name::

    \x1e<levelno>\x1f<logger name>\x1f<message, newlines as \x1d>\n

Forwarding. The agent splits its workers' output into whole lines (never mid-line) and sends
them in batches (:class:`torchrunx.wire.messages.LogLines`) over its authenticated connection, as
it reads them, and always before it reports that worker's exit. Once connected, the agent's
own ``logging`` records go in the same stream (local rank ``None``), so they keep their order
with its workers' lines; the rest of the agent's output comes to the launcher on its
stdout/stderr (SSH channel or pipe) and is parsed the same way.

Records. In the launcher every line becomes a :class:`logging.LogRecord` with the extra
attributes ``hostname``, ``host_index``, ``local_rank`` (``None`` for the agent) and ``rank``.
Plain stdout lines are INFO, plain stderr lines WARNING; marked lines keep their own level.
The handlers made here get, instead, the text such records would give them, a message's lines
in one write (:meth:`LogRouter.emit_batch`): a ``LogRecord`` per line would cost more than all
the rest of a line's way from a worker's ``print`` to its file.
"""

from __future__ import annotations

import datetime as dt
import grp
import logging
import os
import pwd
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Literal

_logger = logging.getLogger("torchrunx.logs")

if TYPE_CHECKING:
    import io

RECORD_START = "\x1e"
FIELD_SEP = "\x1f"
NEWLINE = "\x1d"
STDOUT_LEVEL = logging.INFO
STDERR_LEVEL = logging.WARNING
TAIL_LINES = 20
TAIL_LINE_BYTES = 4 * 1024
"""A line kept for a failure note is cut to this many UTF-8 bytes (the log files keep it all)."""
TAIL_BYTES = 32 * 1024
"""At most this many bytes of lines in one failure note: older lines are left out."""
MAX_LINE_BYTES = 1 << 20

LogHandlers = list[logging.Handler] | Callable[[], list[logging.Handler]] | Literal["auto"] | None


class MarkedLineFormatter(logging.Formatter):
    """Formats a record as one marked line (used inside agents and workers)."""

    def format(self, record: logging.LogRecord) -> str:
        """One line: marker, level, logger name, message (with the traceback, if any)."""
        text = super().format(record).rstrip("\n").replace("\n", NEWLINE)
        return f"{RECORD_START}{record.levelno}{FIELD_SEP}{record.name}{FIELD_SEP}{text}"


def capture_logging(level: int) -> None:
    """In an agent or a worker: send ``logging`` and ``warnings`` records to stderr, marked."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(MarkedLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(capture=True)


@dataclass(frozen=True)
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


def log_level_from_env(environ: dict[str, str] | None = None) -> int:
    """``TORCHRUNX_LOG_LEVEL`` as a number: a level name (``DEBUG``) or number; default INFO.

    Raises:
        ValueError: The value is neither a known level name nor a number.
    """
    value = (os.environ if environ is None else environ).get("TORCHRUNX_LOG_LEVEL", "INFO")
    value = value.strip()
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ValueError(  # noqa: TRY004 (a bad value of a string setting)
            f"TORCHRUNX_LOG_LEVEL={value!r} is not a logging level (DEBUG, INFO, WARNING, ...)"
        )
    return level


# --------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------


class _SourceFilter(logging.Filter):
    def __init__(self, hostname: str, local_rank: int | None, host_index: int | None) -> None:
        super().__init__()
        self.hostname = hostname
        self.local_rank = local_rank
        self.host_index = host_index

    def filter(self, record: logging.LogRecord) -> bool:
        return self.accepts(
            getattr(record, "hostname", None),
            getattr(record, "host_index", None),
            getattr(record, "local_rank", None),
        )

    def accepts(self, hostname: object, host_index: object, local_rank: object) -> bool:
        """Whether records of this source pass."""
        if hostname != self.hostname:
            return False
        if self.host_index is not None and host_index != self.host_index:
            return False
        return local_rank == self.local_rank


def add_filter_to_handler(
    handler: logging.Handler,
    hostname: str,
    local_rank: int | None,
    log_level: int = logging.NOTSET,
) -> None:
    """Let ``handler`` receive only the records of one agent (``local_rank=None``) or worker.

    Args:
        handler: Any ``logging.Handler``.
        hostname: Host of the agent or worker, as given in ``hostnames``.
        local_rank: Rank of the worker on that host, or ``None`` for the agent itself.
        log_level: Records below this level are dropped.
    """
    _filter(handler, hostname, local_rank, log_level, host_index=None)


def _filter(
    handler: logging.Handler,
    hostname: str,
    local_rank: int | None,
    log_level: int,
    *,
    host_index: int | None,
) -> logging.Handler:
    """Route one source's records to ``handler``; ``host_index`` tells repeated names apart."""
    handler.addFilter(_SourceFilter(hostname, local_rank, host_index))
    handler.setLevel(log_level)
    return handler


class _BatchFlush:
    """Mixin: skip the flush after every record; :class:`LogRouter` flushes once per batch.

    Forwarded lines arrive in batches of up to thousands; one write and flush per line would
    make the launcher the bottleneck of a chatty worker.
    """

    def flush(self) -> None:
        """Deferred: see :meth:`flush_batch`."""

    def flush_batch(self) -> None:
        """Flush what the records of the last batch wrote."""
        super().flush()  # type: ignore[misc]  # the handler class this is mixed into

    def close(self) -> None:
        """Flush, then close."""
        self.flush_batch()
        super().close()  # type: ignore[misc]  # the handler class this is mixed into


class _StreamHandler(_BatchFlush, logging.StreamHandler):  # type: ignore[type-arg]
    pass


class _PrefixFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        local_rank = getattr(record, "local_rank", None)
        source = getattr(record, "hostname", "?")
        prefix = f"[{source}]" if local_rank is None else f"[{source}:{local_rank}]"
        return "\n".join(f"{prefix} {line}" for line in record.getMessage().split("\n"))

    @staticmethod
    def format_run(
        run: Sequence[Record], hostname: str, local_rank: int | None, admitted: _Admitted, end: str
    ) -> str:
        """What :meth:`format` makes of each admitted line of a run, each followed by ``end``."""
        prefix = f"[{hostname}] " if local_rank is None else f"[{hostname}:{local_rank}] "
        parts = []
        for _, levelno, _, text, _ in run:
            if admitted[levelno]:
                if "\n" in text:
                    text = text.replace("\n", "\n" + prefix)  # noqa: PLW2901 (its lines, prefixed)
                parts.append(f"{prefix}{text}{end}")
        return "".join(parts)


def stream_handler(
    hostname: str, local_rank: int | None, log_level: int = logging.NOTSET
) -> logging.Handler:
    """A handler printing one agent's or worker's records on stdout, prefixed ``[host:rank]``.

    Args:
        hostname: Host of the agent or worker.
        local_rank: Rank of the worker on that host, or ``None`` for the agent.
        log_level: Records below this level are dropped.
    """
    return _filter(_console(), hostname, local_rank, log_level, host_index=None)


def _console() -> logging.Handler:
    handler = _StreamHandler(sys.stdout)
    handler.setFormatter(_PrefixFormatter())
    return handler


AGENT_CONSOLE_LOGGER = "torchrunx.agent"
"""The launcher-side logger whose level decides which agent records the default console shows."""


class _LauncherLevelFilter(logging.Filter):
    """Passes a record only if a logger of the launcher is enabled for its level.

    The standard switch for a library's chatter: the agents' lifecycle lines (INFO) stay off
    the console until ``logging.getLogger("torchrunx").setLevel(logging.INFO)`` (or a root
    logger at INFO), while their warnings and errors pass under Python's default WARNING.
    """

    def __init__(self, logger_name: str) -> None:
        super().__init__()
        self.logger = logging.getLogger(logger_name)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.logger.isEnabledFor(record.levelno)


_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC


class _PrivateFileHandler(_BatchFlush, logging.FileHandler):
    """A FileHandler whose file is created readable and writable by its owner only (0600).

    A file it creates gets mode 0600 whatever the umask (``fchmod`` after ``open``); a file that
    exists already is appended to, its mode unchanged. ``exclusive`` (the files of a launch's
    own folder): the file must be new, and is never a symbolic link followed
    (``O_CREAT | O_EXCL | O_NOFOLLOW``); an existing name is an error.
    """

    def __init__(self, filename: str | os.PathLike[str], *, exclusive: bool = False) -> None:
        self._exclusive = exclusive
        self._created = False
        super().__init__(filename, encoding="utf-8")

    def _open(self) -> io.TextIOWrapper:
        path = self.baseFilename
        if self._exclusive and self._created:  # reopened after close(): the file we made
            fd = os.open(path, _APPEND | os.O_NOFOLLOW)
        elif self._exclusive:
            fd = create_private_file(path)
        else:
            try:
                fd = create_private_file(path)
            except FileExistsError:
                fd = os.open(path, _APPEND)
        self._created = True
        return open(fd, "a", encoding=self.encoding, errors=self.errors)  # noqa: PTH123


def create_private_file(path: str | os.PathLike[str]) -> int:
    """Create a new file, mode 0600 whatever the umask, and open it for appending.

    ``O_CREAT | O_EXCL | O_NOFOLLOW``: never an existing file, never through a symbolic link.

    Returns:
        The open descriptor (close-on-exec).

    Raises:
        FileExistsError: Something (a file, a folder, a symbolic link) has that name already.
    """
    fd = os.open(path, _APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_handler(
    hostname: str,
    local_rank: int | None,
    file_path: str | os.PathLike[str],
    log_level: int = logging.NOTSET,
) -> logging.Handler:
    """A handler writing one agent's or worker's records to ``file_path`` (mode 0600).

    Args:
        hostname: Host of the agent or worker.
        local_rank: Rank of the worker on that host, or ``None`` for the agent.
        file_path: The log file; its folder must exist.
        log_level: Records below this level are dropped.
    """
    return _filter(_file(file_path), hostname, local_rank, log_level, host_index=None)


_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _FileFormatter(logging.Formatter):
    """``asctime level name: message``; the date and time text is made once per second."""

    def __init__(self) -> None:
        super().__init__(_FILE_FORMAT)
        self._second: tuple[int, str | None, str] | None = None  # (second, datefmt, text)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        """As :meth:`logging.Formatter.formatTime`, with one ``strftime`` per second."""
        second = int(record.created)
        cached = self._second  # one tuple: consistent even if a user shares this formatter
        if cached is None or cached[0] != second or cached[1] != datefmt:
            when = self.converter(record.created)
            text = time.strftime(datefmt or self.default_time_format, when)
            cached = self._second = (second, datefmt, text)
        if datefmt or not self.default_msec_format:
            return cached[2]
        return self.default_msec_format % (cached[2], record.msecs)

    def is_default(self) -> bool:
        """Whether it still formats as made (no other format, date format or milliseconds)."""
        return (
            self._fmt == _FILE_FORMAT
            and self.datefmt is None
            and self.default_time_format == logging.Formatter.default_time_format
            and self.default_msec_format == logging.Formatter.default_msec_format
        )

    def format_run(self, run: Sequence[Record], admitted: _Admitted, end: str) -> str:
        """What :meth:`format` makes of each admitted line of a run, each followed by ``end``."""
        parts = []
        cached = self._second
        stamp = head = ""
        stamped: float | None = None  # the lines of one read share their time
        headed: tuple[int, str] | None = None  # and, mostly, their level and logger
        for _, levelno, name, text, created in run:
            if not admitted[levelno]:
                continue
            if created != stamped:
                stamped = created
                second = int(created)
                if cached is None or cached[0] != second or cached[1] is not None:
                    when = time.strftime(self.default_time_format, self.converter(created))
                    cached = self._second = (second, None, when)
                stamp = f"{cached[2]},{int((created - second) * 1000):03d} "
            if headed is None or headed[0] != levelno or headed[1] != name:
                headed = (levelno, name)
                head = f"{logging.getLevelName(levelno)} {name}: "
            parts.append(f"{stamp}{head}{text}{end}")
        return "".join(parts)


def _file(file_path: str | os.PathLike[str], *, exclusive: bool = False) -> logging.Handler:
    handler = _PrivateFileHandler(file_path, exclusive=exclusive)
    handler.setFormatter(_FileFormatter())
    return handler


class _Admitted(dict[int, bool]):
    """Per level: whether a handler's level and level filters let a line of it pass.

    Kept per level only for a handler without a :class:`_LauncherLevelFilter`: a logger's
    level can change at any time (``logging`` itself keeps each logger's answers until then).
    """

    def __init__(self, level: int, loggers: list[logging.Logger]) -> None:
        super().__init__()
        self.level = level
        self.loggers = loggers

    def __missing__(self, levelno: int) -> bool:
        passes = levelno >= self.level and all(
            logger.isEnabledFor(levelno) for logger in self.loggers
        )
        if not self.loggers:
            self[levelno] = passes
        return passes


def _direct(handler: logging.Handler) -> _Direct | None:
    """How to write lines to one of torchrunx's handlers directly, as its formatter would.

    ``None`` where the handler needs LogRecords: not one of ours, or one of ours given another
    formatter or a filter that is not ours (the user's filter must see every record).
    """
    formatter = handler.formatter
    kind = (type(handler), type(formatter))
    if kind == (_PrivateFileHandler, _FileFormatter):
        ours = isinstance(formatter, _FileFormatter) and formatter.is_default()
    else:
        ours = kind == (_StreamHandler, _PrefixFormatter)
    if not ours or getattr(handler, "stream", None) is None:  # closed: emit would reopen it
        return None
    loggers = []
    for each in handler.filters:
        if type(each) is _LauncherLevelFilter:
            loggers.append(each.logger)
        elif type(each) is not _SourceFilter:
            return None
    assert formatter is not None  # noqa: S101 (one of ours, above)
    return _Direct(handler, formatter, loggers)


class _Direct:
    """Writes runs of one source's lines to a handler of torchrunx: one formatted string each.

    Made for the handler as it is; :meth:`fits` tells whether it still is (its level, filters,
    formatter and stream unchanged), so that it can be kept from line to line.
    """

    def __init__(
        self, handler: logging.Handler, formatter: logging.Formatter, loggers: list[logging.Logger]
    ) -> None:
        self.handler = handler
        self.formatter = formatter
        self.level = handler.level
        self.filters = list(handler.filters)
        self.stream = getattr(handler, "stream", None)
        self.end: str = getattr(handler, "terminator", "\n")
        self.admitted = _Admitted(handler.level, loggers)

    def fits(self) -> bool:
        """Whether the handler is still as it was when this was made for it."""
        handler = self.handler
        formatter = self.formatter
        return (
            handler.level == self.level
            and handler.formatter is formatter
            and getattr(handler, "stream", None) is self.stream
            and getattr(handler, "terminator", "\n") == self.end
            and handler.filters == self.filters
            and (not isinstance(formatter, _FileFormatter) or formatter.is_default())
        )

    def write(self, run: Sequence[Record], hostname: str, local_rank: int | None) -> None:
        """Format the lines the handler admits, and write them in one call (not flushed)."""
        formatter = self.formatter
        if isinstance(formatter, _FileFormatter):
            text = formatter.format_run(run, self.admitted, self.end)
        else:
            text = _PrefixFormatter.format_run(run, hostname, local_rank, self.admitted, self.end)
        if text:
            handler = self.handler
            handler.acquire()
            try:
                handler.stream.write(text)  # type: ignore[attr-defined]  # a stream handler
            finally:
                handler.release()


# --------------------------------------------------------------------------------------------
# The launcher's router
# --------------------------------------------------------------------------------------------


_FRESH_STAMPS = 10
"""Fresh clock readings tried for a folder name before a ``-N`` suffix is added."""


def new_log_dir(root: Path, now: Callable[[], dt.datetime] = dt.datetime.now) -> Path:
    """A new folder under ``root`` named by the local time of the launch (mode 0700).

    The name is naive local time to the second (``2025-06-01T14:03:27``), as torchrunx 0.4
    named it, so ``datetime.fromisoformat`` reads it back. If a folder of that second exists
    (two launches in one second), the time is read again with microseconds
    (``2025-06-01T14:03:27.512345``, which ``fromisoformat`` reads too); only if that keeps
    clashing is ``-N`` appended. The names sort by time.

    The launch's events file (:func:`events_file`) is created here too, empty and mode 0600,
    so that the folder and the file beside it are both new: a name is taken only when neither
    exists. Nothing that is in the way (a file, a symbolic link, a folder) is followed, reused
    or removed; a name whose events file is in the way is given up with a warning. ``root`` is
    made (mode 0700) if missing, and checked first (:func:`check_log_root`). Modes are set with
    ``chmod`` after creation, whatever the umask.

    Raises:
        PermissionError: ``root`` is not safe to write in (see :func:`check_log_root`).
        FileExistsError: No free name was found.
    """
    make_log_root(root)
    for name in _log_dir_names(now):
        path = root / name
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        _make_private_dir(path)
        events = events_file(path)
        try:
            os.close(create_private_file(events))
        except FileExistsError:
            path.rmdir()
            _logger.warning(
                "%s already exists and is not this launch's: left alone, the launch logs under "
                "another name. Something else writes into %s, or planted that name there",
                events,
                root,
            )
            continue
        return path
    raise FileExistsError(f"cannot create a new log folder under {root}")


def make_log_root(root: Path) -> None:
    """Make ``root`` if it is missing (mode 0700, whatever the umask), then check it.

    Folders above it that are missing are made with the default mode (``mkdir -p``).

    Raises:
        PermissionError: ``root`` is not safe to write in (see :func:`check_log_root`).
    """
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            root.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile, by another launch: checked below like any existing folder
        else:
            _make_private_dir(root)
    check_log_root(root)


def check_log_root(root: Path) -> None:
    """Refuse a log root where another user could replace what a launch creates in it.

    ``root`` (after symbolic links, which are yours to choose) must be a folder owned by you
    or by root, and, unless its sticky bit is set (as on ``/tmp``), writable by nobody else:
    not by others, and not by its group unless that group is your own private group (named as
    you, your primary group, no other member). In a sticky folder others may create names but
    not rename or remove yours; what they plant is never followed nor reused
    (:func:`new_log_dir`).

    Raises:
        PermissionError: What is wrong with it, where, and what to do.
    """
    try:
        info = root.stat()
    except FileNotFoundError:
        raise PermissionError(f"the log folder {root} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(
            f"the log folder {root} is not a folder: set TORCHRUNX_LOG_DIR to a folder of yours"
        )
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        raise PermissionError(
            f"the log folder {root} belongs to another user (uid {info.st_uid}), who could "
            f"replace the files a launch writes there; set TORCHRUNX_LOG_DIR to a folder of "
            f"yours (for example a subfolder {root / _user_name()}, made by you)"
        )
    mode = info.st_mode
    if mode & stat.S_ISVTX:
        return
    writable_by = []
    if mode & stat.S_IWOTH:
        writable_by.append("every user")
    if mode & stat.S_IWGRP and not _is_private_group(info.st_gid):
        writable_by.append(f"its group (gid {info.st_gid})")
    if writable_by:
        raise PermissionError(
            f"the log folder {root} (mode {stat.S_IMODE(mode):04o}) is writable by "
            f"{' and '.join(writable_by)} without the sticky bit, so another user could replace "
            f"the files a launch writes there; run `chmod go-w {root}` (or `chmod +t {root}` "
            f"for a shared folder), or set TORCHRUNX_LOG_DIR to a folder of yours"
        )


def _make_private_dir(path: Path) -> None:
    """Set a folder just made to mode 0700 through a descriptor that refuses a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _is_private_group(gid: int) -> bool:
    """Whether ``gid`` is the user's own group (a user private group, as ``umask 002`` implies)."""
    try:
        user = pwd.getpwuid(os.geteuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return (
        gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}
    )


def _log_dir_names(now: Callable[[], dt.datetime]) -> Iterator[str]:
    """Names for a new log folder, to try in order (the clock is read when each is needed)."""
    yield now().isoformat(timespec="seconds")
    stamp = ""
    for _ in range(_FRESH_STAMPS):
        stamp = now().isoformat(timespec="microseconds")
        yield stamp
    for n in range(1, 1000):
        yield f"{stamp}-{n}"


def events_file(log_dir: Path) -> Path:
    """Where the events of the launch logging to ``log_dir`` go: beside it, ``<name>.events.jsonl``.

    Not inside: the folder holds one log file per agent and worker, and nothing else.
    """
    return log_dir.with_name(f"{log_dir.name}.events.jsonl")


@dataclass
class _Source:
    """What :class:`LogRouter` keeps per agent or worker: one lookup per run of its lines.

    Attributes:
        tail: Its last lines, for failure notes.
        handlers: The handlers a source filter does not shut to it, each with how to write to
            it directly (``None``: it gets LogRecords); ``None`` until worked out (again after
            handlers are added).
        templates: Per logger name and level, the LogRecord attributes all its lines share.
    """

    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    handlers: list[tuple[logging.Handler, _Direct | None]] | None = None
    templates: dict[tuple[str, int], dict[str, object]] = field(default_factory=dict)


class LogRouter:
    """Receives every forwarded line of one launch and hands it to the handlers.

    Thread-safe: agent output pumps and connection readers call :meth:`emit` and
    :meth:`emit_batch` concurrently.

    The handlers of torchrunx (the ``"auto"`` console and files, :func:`file_handler`,
    :func:`stream_handler`), as long as their formatter and filters are still their own, are
    written to directly: a run of lines becomes one string, written in one call, flushed once
    per batch, without a ``LogRecord`` per line (that alone cost more than all the rest of a
    line's way to its file). The result is the same text. Every other handler, and one of ours
    that was given another formatter or a filter of its own, gets a ``LogRecord`` per line
    through ``handler.handle``, as ``logging`` does it.
    """

    def __init__(self, spec: LogHandlers, hostnames: Sequence[str]) -> None:
        """Resolve the ``log_handlers`` field; ``"auto"`` builds the default handlers.

        Raises:
            ValueError: ``TORCHRUNX_LOG_LEVEL`` is not a level.
        """
        self.hostnames = list(hostnames)
        self.level = log_level_from_env()
        self.auto = spec == "auto"
        self.log_dir: Path | None = None
        self.handlers: list[logging.Handler] = []
        self.owned: list[logging.Handler] = []
        self.sources: dict[tuple[int, int | None], _Source] = {}
        self.lock = threading.Lock()
        # relativeCreated counts from when logging was loaded: a record made here says when.
        probe = logging.LogRecord("", logging.INFO, "", 0, "", None, None)
        self.logging_loaded = probe.created - probe.relativeCreated / 1000
        if spec == "auto":
            self._add_defaults_for_agents()
        elif callable(spec):
            self.handlers = list(spec())
            self.owned = list(self.handlers)  # made for this launch: closed with it
        elif spec is not None:
            self.handlers = list(spec)

    def _file_name(self, host_index: int, local_rank: int | None) -> str:
        hostname = self.hostnames[host_index]
        occurrence = self.hostnames[:host_index].count(hostname)
        base = hostname if occurrence == 0 else f"{hostname}-{occurrence}"
        return f"{base}.log" if local_rank is None else f"{base}[{local_rank}].log"

    def _add_defaults_for_agents(self) -> None:
        root = os.environ.get("TORCHRUNX_LOG_DIR", "./torchrunx_logs")
        if root:
            self.log_dir = new_log_dir(Path(root))
        console = _filter(_console(), self.hostnames[0], None, self.level, host_index=0)
        console.addFilter(_LauncherLevelFilter(AGENT_CONSOLE_LOGGER))
        self._own(console)
        for index, hostname in enumerate(self.hostnames):
            self._add_file(index, hostname, None)

    def add_workers(self, host_index: int, num_workers: int) -> None:
        """Defaults for the workers of one host, once their number is known."""
        if not self.auto:
            return
        hostname = self.hostnames[host_index]
        if host_index == 0 and num_workers > 0:
            self._own(_filter(_console(), hostname, 0, self.level, host_index=0))
        for local_rank in range(num_workers):
            self._add_file(host_index, hostname, local_rank)

    def _add_file(self, host_index: int, hostname: str, local_rank: int | None) -> None:
        if self.log_dir is None:
            return
        path = self.log_dir / self._file_name(host_index, local_rank)
        handler = _file(path, exclusive=True)
        self._own(_filter(handler, hostname, local_rank, self.level, host_index=host_index))

    def _own(self, handler: logging.Handler) -> None:
        with self.lock:
            self.handlers.append(handler)
            self.owned.append(handler)
            for source in self.sources.values():
                source.handlers = None

    def log_file(self, host_index: int, local_rank: int | None) -> Path | None:
        """The default log file of an agent or worker, if files are written."""
        if self.log_dir is None:
            return None
        return self.log_dir / self._file_name(host_index, local_rank)

    def tail(self, host_index: int, local_rank: int | None) -> list[str]:
        """The last lines of an agent's or worker's output, at most :data:`TAIL_BYTES` of them."""
        source = self.sources.get((host_index, local_rank))
        if source is None:
            return []
        kept: list[str] = []
        size = 0
        for text in reversed(source.tail):
            size += len(text.encode(errors="replace")) + 1
            if size > TAIL_BYTES and kept:
                break
            kept.append(text)
        return kept[::-1]

    def emit(
        self,
        host_index: int,
        local_rank: int | None,
        rank: int | None,
        line: Line,
        created: float,
    ) -> None:
        """Hand one line to every handler that may want it; :meth:`flush` flushes them."""
        record = (local_rank, line.levelno, line.name, line.text, created)
        self._emit_run(host_index, local_rank, rank, (record,), None)

    def emit_batch(self, host_index: int, rank_offset: int, records: Sequence[Record]) -> None:
        """Hand the lines of one :class:`~torchrunx.wire.messages.LogLines` message to the handlers.

        In order; then flushes the handlers they were written to, once. A worker's rank is
        ``rank_offset + local_rank``; the agent's records (``local_rank`` ``None``) have none.
        """
        flushed: dict[int, _BatchFlush] = {}
        for local_rank, run in groupby(records, key=itemgetter(0)):
            rank = None if local_rank is None else rank_offset + local_rank
            self._emit_run(host_index, local_rank, rank, tuple(run), flushed)
        for handler in flushed.values():
            _flush(handler)

    def _emit_run(
        self,
        host_index: int,
        local_rank: int | None,
        rank: int | None,
        run: Sequence[Record],
        flushed: dict[int, _BatchFlush] | None,
    ) -> None:
        """Hand lines of one source to its handlers; note in ``flushed`` those to flush."""
        key = (host_index, local_rank)
        source = self.sources.get(key)
        if source is None:
            source = self.sources.setdefault(key, _Source())
        if len(run) == 1:
            source.tail.append(cut_line(run[0][3]))
        else:
            source.tail.extend([cut_line(record[3]) for record in run[-TAIL_LINES:]])
        handlers = source.handlers
        if handlers is None:
            handlers = self._handlers_for(source, host_index, local_rank)
        records: list[logging.LogRecord] | None = None
        for index, (handler, known) in enumerate(handlers):
            direct = known
            if direct is not None and not direct.fits():  # changed since: look again
                direct = _direct(handler)
                handlers[index] = (handler, direct)
            if direct is None:
                if records is None:
                    records = self._records(source, host_index, local_rank, rank, run)
                _handle(handler, records)
            else:
                try:
                    direct.write(run, self.hostnames[host_index], local_rank)
                except Exception:  # noqa: BLE001 (a broken handler must not break the launch)
                    first = self._records(source, host_index, local_rank, rank, run[:1])[0]
                    handler.handleError(first)
            if flushed is not None and isinstance(handler, _BatchFlush):
                flushed[id(handler)] = handler

    def _handlers_for(
        self, source: _Source, host_index: int, local_rank: int | None
    ) -> list[tuple[logging.Handler, _Direct | None]]:
        """The handlers that a source filter of torchrunx does not shut to this source.

        A chatty worker sends tens of thousands of lines a second, and the default handlers are
        one per agent and worker, each filtered to its source: handing every record to all of
        them (each taking its lock and running its filters) would make the launcher the
        bottleneck. Handlers are only skipped for a :func:`add_filter_to_handler` filter that
        rejects the source; everything else is still decided by ``handler.handle``, with all
        of its filters. Worked out on a source's first line, again after handlers are added.
        """
        hostname = self.hostnames[host_index]
        with self.lock:
            chosen = [
                (handler, _direct(handler))
                for handler in self.handlers
                if all(
                    f.accepts(hostname, host_index, local_rank)
                    for f in handler.filters
                    if isinstance(f, _SourceFilter)
                )
            ]
            source.handlers = chosen
        return chosen

    def _records(
        self,
        source: _Source,
        host_index: int,
        local_rank: int | None,
        rank: int | None,
        run: Sequence[Record],
    ) -> list[logging.LogRecord]:
        """LogRecords of a run of one source's lines, with the worker's times as creation times.

        The attributes that are the same for every line of a source, logger name and level
        (the launcher's process, the ``pathname`` standing for the host, torchrunx's
        ``hostname``, ``host_index`` and ``local_rank``) are made once and copied into each
        record: ``LogRecord()`` itself costs more than the rest of a line's way to a file. The
        message, rank, thread and times are each record's own.
        """
        thread = threading.current_thread()
        ident, thread_name = thread.ident, thread.name
        loaded = self.logging_loaded
        templates = source.templates
        new = logging.LogRecord.__new__
        made = []
        for _, levelno, name, text, created in run:
            template = templates.get((name, levelno))
            if template is None:
                hostname = self.hostnames[host_index]
                first = logging.LogRecord(name, levelno, hostname, 0, "", None, None)
                template = dict(vars(first))
                template.update(hostname=hostname, host_index=host_index, local_rank=local_rank)
                templates[name, levelno] = template
            record = new(logging.LogRecord)
            attributes = vars(record)
            attributes.update(template)
            attributes.update(
                msg=text,
                rank=rank,
                thread=ident,
                threadName=thread_name,
                created=created,
                msecs=int((created - int(created)) * 1000) + 0.0,
                relativeCreated=(created - loaded) * 1000,
            )
            made.append(record)
        return made

    def flush(self) -> None:
        """Flush the handlers after lines given to :meth:`emit`."""
        with self.lock:
            handlers = list(self.handlers)
        for handler in handlers:
            if isinstance(handler, _BatchFlush):
                _flush(handler)

    def close(self) -> None:
        """Flush every handler; close the ones made for this launch (not a list the user gave)."""
        self.flush()
        for handler in self.handlers:
            handler.flush()
        for handler in self.owned:
            handler.close()


def _flush(handler: _BatchFlush) -> None:
    """Flush what a batch wrote; a failure is the handler's to report, as one in ``emit``."""
    try:
        handler.flush_batch()
    except Exception:  # noqa: BLE001 (a broken handler must not break the launch)
        failed = logging.LogRecord("torchrunx", logging.ERROR, "", 0, "flush failed", None, None)
        handler.handleError(failed)  # type: ignore[attr-defined]  # mixed into a Handler


def _handle(handler: logging.Handler, records: list[logging.LogRecord]) -> None:
    """Hand records to a handler as ``logging`` does: its level, then ``handle`` (filters)."""
    level = handler.level
    for record in records:
        if record.levelno >= level:
            try:
                handler.handle(record)
            except Exception:  # noqa: BLE001 (a broken handler must not break the launch)
                handler.handleError(record)
