"""The launcher's log handlers: the public helpers and the handlers of ``log_handlers="auto"``.

:func:`stream_handler`, :func:`file_handler` and :func:`add_filter_to_handler` (re-exported as
``trx.stream_handler``, ...) make handlers that receive one agent's or worker's records. The
launcher's :class:`~torchrunx.launcher.view.logrouter.LogRouter` writes to these handlers directly
(:class:`DirectWriter`), the text their formatter would make, as long as they are as made here.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, TypeGuard

if TYPE_CHECKING:
    import io

    from torchrunx.wire.lines import Record


@dataclasses.dataclass(frozen=True)
class LogSetup:
    """What a ``log_handlers`` function is given, if it takes an argument: the resolved launch.

    Attributes:
        hostnames: The hosts, resolved (from SLURM, a hostfile, ...), in launch order: host
            ``i`` runs the ranks after those of hosts ``0..i-1``.
        workers_per_host: Each host's number of workers, or ``None`` where its agent counts
            them when it starts (``"auto"``, ``"gpu"``, ``"cpu"``).
        log_level: The level of ``TORCHRUNX_LOG_LEVEL`` (``logging.INFO`` if unset).
    """

    hostnames: tuple[str, ...]
    workers_per_host: tuple[int | None, ...]
    log_level: int


HandlerList = Sequence[logging.Handler | Literal["auto"]]
"""Handlers (a list); an ``"auto"`` among them adds the default handlers to the others."""

LogHandlers = (
    HandlerList
    | Callable[[], HandlerList]
    | Callable[[LogSetup], HandlerList]
    | Literal["auto"]
    | None
)
"""What ``Launcher.log_handlers`` takes (see :class:`~torchrunx.Launcher`)."""

ConsoleRanks = Literal["all"] | tuple[int, ...]
"""What ``Launcher.console_ranks`` takes: ``"all"``, or the global ranks to show."""


def call_handler_factory(
    factory: Callable[..., object], setup: LogSetup
) -> list[logging.Handler | Literal["auto"]]:
    """Call a ``log_handlers`` function: with ``setup`` if it takes an argument, else without.

    Raises:
        TypeError: It returned something other than a list of handlers (and ``"auto"``).
    """
    made = factory(setup) if _takes_an_argument(factory) else factory()
    if not is_handler_list(made):
        raise TypeError(
            f"the log_handlers function {getattr(factory, '__qualname__', factory)!r} returned "
            f'{made!r}; it must return a list of logging.Handler (and "auto" for the defaults)'
        )
    return list(made)


def _takes_an_argument(function: Callable[..., object]) -> bool:
    """Whether ``function`` has a positional parameter without a default (or ``*args``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): call it bare
        return False
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        and p.default is p.empty
        for p in parameters
    )


def is_handler_list(value: object) -> TypeGuard[Sequence[logging.Handler | Literal["auto"]]]:
    """Whether ``value`` is a list (or tuple) of handlers and ``"auto"``."""
    return isinstance(value, list | tuple) and all(
        isinstance(entry, logging.Handler) or entry == "auto" for entry in value
    )


class SourceFilter(logging.Filter):
    """Passes the records of one agent or worker: its host name (and index), its local rank."""

    def __init__(self, hostname: str, local_rank: int | None, host_index: int | None) -> None:
        """The source: ``host_index`` ``None`` passes every host of that name."""
        super().__init__()
        self.hostname = hostname
        self.local_rank = local_rank
        self.host_index = host_index

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` comes from this source."""
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
    add_source_filter(handler, hostname, local_rank, log_level, host_index=None)


def add_source_filter(
    handler: logging.Handler,
    hostname: str,
    local_rank: int | None,
    log_level: int,
    *,
    host_index: int | None,
) -> logging.Handler:
    """Route one source's records to ``handler``; ``host_index`` tells repeated names apart."""
    handler.addFilter(SourceFilter(hostname, local_rank, host_index))
    handler.setLevel(log_level)
    return handler


class BatchFlush:
    """Mixin: skip the flush after every record; the launcher's router flushes once per batch.

    :class:`~torchrunx.launcher.view.logrouter.LogRouter` calls :meth:`flush_batch`.

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


class _StreamHandler(BatchFlush, logging.StreamHandler):  # type: ignore[type-arg]
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
    return add_source_filter(console_handler(), hostname, local_rank, log_level, host_index=None)


def console_handler() -> logging.Handler:
    """A handler printing records on stdout, prefixed ``[host:rank]``, not yet filtered."""
    handler = _StreamHandler(sys.stdout)
    handler.setFormatter(_PrefixFormatter())
    return handler


AGENT_CONSOLE_LOGGER = "torchrunx.agent"
"""The launcher-side logger whose level decides which agent records the default console shows."""


class LauncherLevelFilter(logging.Filter):
    """Passes a record only if a logger of the launcher is enabled for its level.

    The standard switch for a library's chatter: the agents' lifecycle lines (INFO) stay off
    the console until ``logging.getLogger("torchrunx").setLevel(logging.INFO)`` (or a root
    logger at INFO), while their warnings and errors pass under Python's default WARNING.
    """

    def __init__(self, logger_name: str) -> None:
        """Follow the level of the logger named ``logger_name``."""
        super().__init__()
        self.logger = logging.getLogger(logger_name)

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether the logger is enabled for the record's level."""
        return self.logger.isEnabledFor(record.levelno)


_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC


class _PrivateFileHandler(BatchFlush, logging.FileHandler):
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
    return add_source_filter(
        private_file_handler(file_path), hostname, local_rank, log_level, host_index=None
    )


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


def private_file_handler(
    file_path: str | os.PathLike[str], *, exclusive: bool = False
) -> logging.Handler:
    """A handler writing records to ``file_path`` (mode 0600), not yet filtered.

    ``exclusive``: the file must be new (see :class:`_PrivateFileHandler`).
    """
    handler = _PrivateFileHandler(file_path, exclusive=exclusive)
    handler.setFormatter(_FileFormatter())
    return handler


class _Admitted(dict[int, bool]):
    """Per level: whether a handler's level and level filters let a line of it pass.

    Kept per level only for a handler without a :class:`LauncherLevelFilter`: a logger's
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


def direct_writer(handler: logging.Handler) -> DirectWriter | None:
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
        if type(each) is LauncherLevelFilter:
            loggers.append(each.logger)
        elif type(each) is not SourceFilter:
            return None
    assert formatter is not None  # noqa: S101 (one of ours, above)
    return DirectWriter(handler, formatter, loggers)


class DirectWriter:
    """Writes runs of one source's lines to a handler of torchrunx: one formatted string each.

    Made for the handler as it is; :meth:`fits` tells whether it still is (its level, filters,
    formatter and stream unchanged), so that it can be kept from line to line.
    """

    def __init__(
        self, handler: logging.Handler, formatter: logging.Formatter, loggers: list[logging.Logger]
    ) -> None:
        """Take the handler as it is now; ``loggers``: those its level filters follow."""
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


def check_log_fields(handlers: object, console_ranks: object = (0,)) -> None:
    """Check ``Launcher.log_handlers`` and ``Launcher.console_ranks`` (and that they agree).

    Raises:
        TypeError: ``handlers`` is not one of the forms ``log_handlers`` takes.
        ValueError: ``console_ranks`` is not ``"all"`` or ranks, or it chooses among default
            handlers that ``handlers`` does not have.
    """
    if not (handlers is None or handlers == "auto" or callable(handlers)) and not is_handler_list(
        handlers
    ):
        raise TypeError(
            f'log_handlers must be "auto", None, a list of logging.Handler (with "auto" among '
            f"them to keep the default handlers) or a function returning one, got {handlers!r}"
        )
    if console_ranks != "all" and not (
        isinstance(console_ranks, list | tuple)
        and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in console_ranks)
    ):
        raise ValueError(
            f'console_ranks must be "all" or global ranks (integers >= 0), got {console_ranks!r}'
        )
    default = tuple(console_ranks) == (0,)  # "all" is no such tuple
    if not default and not _may_have_defaults(handlers):
        raise ValueError(
            f"console_ranks={console_ranks!r} chooses what the default console shows, but "
            f'log_handlers={handlers!r} has no default handlers: put "auto" in the list '
            f'(log_handlers=["auto", ...]), or use trx.stream_handler(hostname, local_rank) for '
            f"each worker to show"
        )


def _may_have_defaults(handlers: object) -> bool:
    """Whether ``log_handlers`` has the defaults (a function may return them: not known yet)."""
    if handlers == "auto" or callable(handlers):
        return True
    return isinstance(handlers, list | tuple) and "auto" in handlers
