"""The launcher's :class:`LogRouter`: every forwarded line of a launch, to the handlers.

In the launcher every line becomes a :class:`logging.LogRecord` with the extra attributes
``hostname``, ``host_index``, ``local_rank`` (``None`` for the agent) and ``rank``. The handlers
of :mod:`torchrunx.logs` get, instead, the text such records would give them, a message's lines
in one write (:meth:`LogRouter.emit_batch`): a ``LogRecord`` per line would cost more than all
the rest of a line's way from a worker's ``print`` to its file.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from typing import TYPE_CHECKING

from torchrunx.launcher.view.logdirs import log_file_name, new_log_dir
from torchrunx.logs import (
    AGENT_CONSOLE_LOGGER,
    BatchFlush,
    DirectWriter,
    LauncherLevelFilter,
    LogSetup,
    SourceFilter,
    add_source_filter,
    call_handler_factory,
    console_handler,
    direct_writer,
    private_file_handler,
)
from torchrunx.wire.lines import STACKS_LOGGER, cut_line

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from torchrunx.launcher.settings.environ import LauncherEnviron
    from torchrunx.logs import ConsoleRanks, LogHandlers
    from torchrunx.wire.lines import Line, Record

logger = logging.getLogger("torchrunx.launcher")

TAIL_LINES = 20
TAIL_BYTES = 32 * 1024
"""At most this many bytes of lines in one failure note: older lines are left out."""


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
    handlers: list[tuple[logging.Handler, DirectWriter | None]] | None = None
    templates: dict[tuple[str, int], dict[str, object]] = field(default_factory=dict)

    def keep_tail(self, run: Sequence[Record]) -> None:
        """Keep the last lines of ``run`` (cut to a bounded length) in :attr:`tail`."""
        if len(run) == 1:
            self.tail.append(cut_line(run[0][3]))
        else:
            self.tail.extend([cut_line(record[3]) for record in run[-TAIL_LINES:]])


class LogRouter:
    """Receives every forwarded line of one launch and hands it to the handlers.

    Thread-safe: agent output pumps and connection readers call :meth:`emit` and
    :meth:`emit_batch` concurrently.

    The handlers of torchrunx (the ``"auto"`` console and files,
    :func:`~torchrunx.logs.file_handler`, :func:`~torchrunx.logs.stream_handler`), as long as
    their formatter and filters are still their own, are written to directly: a run of lines
    becomes one string, written in one call, flushed once per batch, without a ``LogRecord``
    per line (that alone cost more than all the rest of a line's way to its file). The result
    is the same text. Every other handler, and one of ours that was given another formatter or
    a filter of its own, gets a ``LogRecord`` per line through ``handler.handle``, as
    ``logging`` does it.
    """

    def __init__(
        self,
        spec: LogHandlers,
        hostnames: Sequence[str],
        *,
        console_ranks: ConsoleRanks = (0,),
        workers_per_host: Sequence[int | None] | None = None,
        settings: LauncherEnviron | None = None,
    ) -> None:
        """Resolve the ``log_handlers`` field; ``"auto"`` builds the default handlers.

        Args:
            spec: The ``log_handlers`` field. A function is called here, with a
                :class:`~torchrunx.logs.LogSetup` if it takes an argument.
            hostnames: The resolved hosts, in launch order.
            console_ranks: The workers the default console shows (global ranks, or ``"all"``).
            workers_per_host: Each host's number of workers, ``None`` where its agent counts
                them (for :class:`~torchrunx.logs.LogSetup`).
            settings: The plan's environment variables: the level of the default handlers
                (``TORCHRUNX_LOG_LEVEL``), the folder ``"auto"`` makes this launch's folder of
                files in (``TORCHRUNX_LOG_DIR``), the hints' folder. None: INFO, no files, no
                hint.

        Raises:
            TypeError: A ``log_handlers`` function returned something other than handlers.
        """
        self.hostnames = list(hostnames)
        self.level = logging.INFO if settings is None else settings.log_level
        self.console_ranks = console_ranks
        self.root = None if settings is None else settings.log_dir
        self.hints = None if settings is None else settings.hints
        self.log_dir: Path | None = None
        self.handlers: list[logging.Handler] = []
        self.owned: list[logging.Handler] = []
        self.sources: dict[tuple[int, int | None], _Source] = {}
        self.on_console: set[tuple[int, int | None]] = set()
        """The agents and workers the default console shows."""
        self.stacks_console: logging.Handler | None = None
        """The default console for the stacks of the workers it does not show."""
        self.lock = threading.Lock()
        # relativeCreated counts from when logging was loaded: a record made here says when.
        probe = logging.LogRecord("", logging.INFO, "", 0, "", None, None)
        self.logging_loaded = probe.created - probe.relativeCreated / 1000
        made = callable(spec)
        if callable(spec):
            setup = LogSetup(
                hostnames=tuple(self.hostnames),
                workers_per_host=tuple(
                    [None] * len(self.hostnames) if workers_per_host is None else workers_per_host
                ),
                log_level=self.level,
            )
            spec = call_handler_factory(spec, setup)
        entries: list[logging.Handler | str] = (
            [] if spec is None else ["auto"] if spec == "auto" else list(spec)
        )
        self.auto = "auto" in entries
        if self.auto:
            self._add_defaults_for_agents()
            self.stacks_console = console_handler()
            self.owned.append(self.stacks_console)
        given = [entry for entry in entries if isinstance(entry, logging.Handler)]
        self.handlers.extend(given)
        if made:
            self.owned.extend(given)  # made for this launch: closed with it

    def _file_name(self, host_index: int, local_rank: int | None) -> str:
        return log_file_name(self.hostnames, host_index, local_rank)

    def _add_defaults_for_agents(self) -> None:
        if self.root is not None:
            self.log_dir = new_log_dir(self.root)
            if self.console_ranks != "all":
                first_launch_hint(self.log_dir, self.hints)
        self._add_agent_console(0)
        for index, hostname in enumerate(self.hostnames):
            self._add_file(index, hostname, None)

    def add_workers(self, host_index: int, num_workers: int, rank_offset: int = 0) -> None:
        """Defaults for the workers of one host, once their number is known.

        Its workers' files, and a console for each of them that ``console_ranks`` names (with
        the host's agent, if it has none yet).
        """
        if not self.auto:
            return
        hostname = self.hostnames[host_index]
        shown = [
            local_rank
            for local_rank in range(num_workers)
            if self.console_ranks == "all" or rank_offset + local_rank in self.console_ranks
        ]
        if shown and host_index != 0:
            self._add_agent_console(host_index)
        for local_rank in shown:
            self.on_console.add((host_index, local_rank))
            self._own(
                add_source_filter(
                    console_handler(), hostname, local_rank, self.level, host_index=host_index
                )
            )
        for local_rank in range(num_workers):
            self._add_file(host_index, hostname, local_rank)

    def console_ranks_missing(self, world_size: int) -> list[int]:
        """The ranks of ``console_ranks`` that a launch of ``world_size`` workers does not have."""
        if not self.auto or self.console_ranks == "all":
            return []
        return sorted({rank for rank in self.console_ranks if rank >= world_size})

    def warn_missing_console_ranks(self, world_size: int) -> None:
        """Log a warning for each rank of ``console_ranks`` that the launch does not have."""
        for rank in self.console_ranks_missing(world_size):
            logger.warning(
                "console_ranks names rank %d, but the launch has %d workers: nothing of rank %d "
                "is shown",
                rank,
                world_size,
                rank,
            )

    def _add_agent_console(self, host_index: int) -> None:
        """The warnings of a host's agent on the console (its INFO lines too at torchrunx INFO)."""
        console = add_source_filter(
            console_handler(), self.hostnames[host_index], None, self.level, host_index=host_index
        )
        console.addFilter(LauncherLevelFilter(AGENT_CONSOLE_LOGGER))
        self._own(console)

    def _add_file(self, host_index: int, hostname: str, local_rank: int | None) -> None:
        if self.log_dir is None:
            return
        path = self.log_dir / self._file_name(host_index, local_rank)
        handler = private_file_handler(path, exclusive=True)
        self._own(
            add_source_filter(handler, hostname, local_rank, self.level, host_index=host_index)
        )

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
        flushed: dict[int, BatchFlush] = {}
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
        flushed: dict[int, BatchFlush] | None,
    ) -> None:
        """Hand lines of one source to its handlers; note in ``flushed`` those to flush."""
        key = (host_index, local_rank)
        source = self.sources.get(key)
        if source is None:
            source = self.sources.setdefault(key, _Source())
        source.keep_tail(run)
        handlers = source.handlers
        if handlers is None:
            handlers = self._handlers_for(source, host_index, local_rank)
        records: list[logging.LogRecord] | None = None
        if len(run) == 1 and run[0][2] == STACKS_LOGGER and key not in self.on_console:
            records = self._stacks_to_console(source, host_index, local_rank, rank, run)
        for index, (handler, known) in enumerate(handlers):
            direct = known
            if direct is not None and not direct.fits():  # changed since: look again
                direct = direct_writer(handler)
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
            if flushed is not None and isinstance(handler, BatchFlush):
                flushed[id(handler)] = handler

    def _stacks_to_console(
        self,
        source: _Source,
        host_index: int,
        local_rank: int | None,
        rank: int | None,
        run: Sequence[Record],
    ) -> list[logging.LogRecord] | None:
        """Stacks someone asked a worker for (``kill -USR1``), on the console: shown or not.

        Returns the records made for them, if any.
        """
        console = self.stacks_console
        if console is None:
            return None
        records = self._records(source, host_index, local_rank, rank, run)
        _handle(console, records)
        if isinstance(console, BatchFlush):
            _flush(console)
        return records

    def _handlers_for(
        self, source: _Source, host_index: int, local_rank: int | None
    ) -> list[tuple[logging.Handler, DirectWriter | None]]:
        """The handlers that a source filter of torchrunx does not shut to this source.

        A chatty worker sends tens of thousands of lines a second, and the default handlers are
        one per agent and worker, each filtered to its source: handing every record to all of
        them (each taking its lock and running its filters) would make the launcher the
        bottleneck. Handlers are only skipped for a :func:`~torchrunx.logs.add_filter_to_handler`
        filter that rejects the source; everything else is still decided by ``handler.handle``,
        with all of its filters. Worked out on a source's first line, again after handlers are
        added.
        """
        hostname = self.hostnames[host_index]
        with self.lock:
            chosen = [
                (handler, direct_writer(handler))
                for handler in self.handlers
                if all(
                    f.accepts(hostname, host_index, local_rank)
                    for f in handler.filters
                    if isinstance(f, SourceFilter)
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
            if isinstance(handler, BatchFlush):
                _flush(handler)

    def close(self) -> None:
        """Flush every handler; close the ones made for this launch (not a list the user gave)."""
        self.flush()
        for handler in self.handlers:
            handler.flush()
        for handler in self.owned:
            handler.close()


def _flush(handler: BatchFlush) -> None:
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


def say_once(name: str, text: str, hints: Path | None) -> bool:
    """Write the hint ``text`` to stderr once per user, on a terminal; whether it was written.

    ``hints``: the folder that remembers the hints said (the plan's, from
    :func:`~torchrunx.launcher.settings.environ.hints_folder`); None (``TORCHRUNX_HINTS=0``)
    turns every hint off. A hint is remembered by a marker file ``hints/NAME``; with no cache
    folder to keep one in, nothing is said, rather than the same hint at every launch.
    """
    if hints is None:
        return False
    if not (sys.stderr.isatty() and sys.stdout.isatty()):
        return False
    marker = hints / name
    if marker.exists():
        return False
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        return False
    sys.stderr.write(text)
    return True


def first_launch_hint(log_dir: Path, hints: Path | None) -> None:
    """Once per user, on a terminal: where every rank's output is, and how to show it here."""
    shown = os.path.relpath(log_dir) if not os.path.relpath(log_dir).startswith("..") else log_dir
    say_once(
        "logs",
        f"torchrunx: the console shows rank 0; every rank's output is in {shown}/ (a file per "
        "worker, HOST[LOCAL_RANK].log); console_ranks='all' (--console-ranks all) shows every "
        "rank here. (Said once.)\n",
        hints,
    )


def auto_cores_text(counted: list[tuple[str, int]]) -> str | None:
    """The hint for hosts where ``workers_per_host='auto'`` found no GPU: one worker per core.

    Args:
        counted: ``(hostname, workers)`` of each such host, in host order.

    Returns:
        One line, or None when there is no such host.
    """
    if not counted:
        return None
    shown = ", ".join(f"{host} ({workers})" for host, workers in counted[:4])
    more = f" and {len(counted) - 4} more" if len(counted) > 4 else ""
    return (
        f"torchrunx: workers_per_host='auto' found no GPU on {shown}{more}, so it started one "
        "worker per CPU core there; give workers_per_host=N (--workers-per-host N) for fewer. "
        "(Said once.)\n"
    )


def auto_cores_hosts(world: list[tuple[str, int | None, int, int]]) -> list[tuple[str, int]]:
    """The hosts :func:`auto_cores_text` names: ``"auto"`` there found no GPU.

    Args:
        world: each host's ``(hostname, workers given for it, workers started, GPUs found)``,
            in host order; the workers given are None where ``workers_per_host="auto"`` counted
            them (a number: given by the list or the host file, never hinted).

    Returns:
        ``(hostname, workers started)`` of each host where ``"auto"`` counted the workers and
        found no GPU: one worker per CPU core. Empty when every host had a GPU or a number.
    """
    return [(host, started) for host, given, started, gpus in world if given is None and not gpus]


def auto_cores_hint(counted: list[tuple[str, int]], hints: Path | None) -> None:
    """Once per user, on a terminal: :func:`auto_cores_text`, when there is such a host."""
    text = auto_cores_text(counted)
    if text is not None:
        say_once("auto-cores", text, hints)
