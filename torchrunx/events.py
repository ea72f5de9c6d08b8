"""Lifecycle states and typed events of a launch, and where events are delivered.

States::

    WorkerState:  INIT ──▶ HEALTHY ──▶ SUCCEEDED
                    │         │
                    │         ├──────▶ FAILED      (raised, exited non-zero, killed, hung)
                    │         └──────▶ STOPPED     (stopped because another rank failed,
                    ├──────────────▶ FAILED         for a restart, or by Ctrl-C / timeout)
                    └──────────────▶ STOPPED

    AgentState:   STARTING ──▶ RUNNING ──▶ DONE
                     │            ├──────▶ FAILED  (died, or could not start its workers)
                     │            └──────▶ LOST    (no heartbeat for agent_timeout)
                     └──────────────────▶ FAILED   (could not be started)

A worker is ``INIT`` from the moment its agent is told to start it until it connects to the
launcher, ``HEALTHY`` while it runs the function, and ends in exactly one of the three final
states. A restart starts a new generation of workers, each ``INIT`` again.

Events are frozen dataclasses. Each has ``time`` (seconds since the epoch) and is delivered, in
order and from the launcher's own thread, to every handler of ``Launcher.event_handlers`` and,
when the log folder is on, to ``<log folder>.events.jsonl`` beside it.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

logger = logging.getLogger("torchrunx.events")


class WorkerState(str, enum.Enum):
    """Where a worker is in its life; see the module docstring for the transitions."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def is_final(self) -> bool:
        """Whether the worker has ended."""
        return self in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED)


class AgentState(str, enum.Enum):
    """Where a host's agent is in its life; see the module docstring for the transitions."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    DONE = "DONE"
    FAILED = "FAILED"
    LOST = "LOST"


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class LaunchStarted:
    """A launch began: its hosts and (where known) workers per host."""

    hostnames: tuple[str, ...]
    workers_per_host: tuple[int | None, ...]
    max_restarts: int
    health_url: str | None = None
    """Where ``GET /health`` is served, if the endpoint is on (the port 0 picked, too)."""
    spare_hosts: tuple[str, ...] = ()
    """The spare hosts, whose agents start too and wait to replace a failed host."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class AgentStarted:
    """An agent connected back and reported its host's worker and GPU counts."""

    host_index: int
    hostname: str
    pid: int
    workers: int
    start_seconds: float
    """From the start of the launch to this agent's hello (SSH or srun and Python start)."""
    gpus: int = 0
    """GPUs the agent counted on its host (``CUDA_VISIBLE_DEVICES``, the driver, nvidia-smi)."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class WorkersStarted:
    """An agent forked its workers (one event per host and attempt)."""

    host_index: int
    hostname: str
    attempt: int
    ranks: tuple[int, ...]
    pids: tuple[int, ...]
    backend: str | None = None
    """The workers' process-group backend (``"auto"`` resolved: ``"nccl"`` or ``"gloo"``)."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class WorkerStateChanged:
    """One worker moved from one state to another."""

    rank: int
    host_index: int
    hostname: str
    local_rank: int
    attempt: int
    old: WorkerState
    new: WorkerState
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class WorkerFailed:
    """A worker failed: what happened, in one line (and the worker's traceback, if it raised)."""

    rank: int
    host_index: int
    hostname: str
    local_rank: int
    attempt: int
    reason: str
    time: float = field(default_factory=_now)
    traceback: str | None = None
    """The traceback as the worker printed it, when the worker raised; else None."""


@dataclass(frozen=True)
class Restarting:
    """The worker group is being restarted after a failure."""

    attempt: int
    """The attempt about to start (1 for the first restart)."""
    max_restarts: int
    reason: str
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Preempting:
    """The launch is preempted: every rank was told, and has ``grace`` seconds to return."""

    reason: str
    """``"the launcher received SIGTERM"``, or ``"the agent on node3 received SIGTERM"``."""
    grace: float
    """``Launcher.preemption_grace``, resolved."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Stalled:
    """No rank made progress for ``Launcher.stall_timeout`` seconds: the diagnosis.

    See :mod:`torchrunx.launcher.state.hangs` (the fields of ``diagnosis``) and docs/debugging.md.
    """

    seconds: float
    """Seconds since the last progress of any rank."""
    text: str
    """The diagnosis as printed."""
    diagnosis: dict[str, Any]
    """The same as JSON-ready values (also in the log folder's ``stall-*.json``)."""
    action: str
    """``Launcher.on_stall``: ``"report"``, ``"fail"`` or ``"restart"``."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class StragglerFound:
    """A rank entered most of the recent collectives last, by ``Launcher.straggler_threshold``.

    Once per rank and run, when first named (see docs/debugging.md).
    """

    rank: int
    hostname: str
    lateness: float
    """Its median lateness after the median rank, in seconds."""
    window: int
    """How many collectives every rank recorded were compared (50 at most)."""
    last_share: float
    """The share of them it entered last."""
    text: str
    """``rank 5 enters collectives 0.9 s after the median, over the last 50``."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class HostQuarantined:
    """A host's agent failed or was lost: it takes no further part (spare hosts, ``min_hosts``).

    Nor in later runs of warm agents.
    """

    host_index: int
    """The agent's index (its host's position in ``hostnames``, spares after them)."""
    hostname: str
    state: str
    """The agent's state when it was quarantined: ``"FAILED"`` or ``"LOST"``."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class HostsChanged:
    """The hosts of the next attempt differ: spares took failed hosts' places, or fewer go on."""

    attempt: int
    """The attempt that runs on them."""
    hostnames: tuple[str, ...]
    """The hosts of that attempt, in rank order."""
    changes: tuple[str, ...]
    """What changed, one line each (``spare node4 replaces node2 (host 1)``)."""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class LaunchFinished:
    """The launch (or a warm run) ended: with every result, or with the error it raises."""

    succeeded: bool
    attempts: int
    """Attempts of this run (1 + its restarts)."""
    duration: float
    """Seconds from the launch's start (a warm run: the run's start), as ``LaunchTimings.total``."""
    error: str | None
    stragglers: tuple[str, ...] = ()
    """The ranks named stragglers in this run, one sentence each (``StragglerFound.text``)."""
    time: float = field(default_factory=_now)


Event = (
    LaunchStarted
    | AgentStarted
    | WorkersStarted
    | WorkerStateChanged
    | WorkerFailed
    | Restarting
    | Preempting
    | Stalled
    | StragglerFound
    | HostQuarantined
    | HostsChanged
    | LaunchFinished
)


@runtime_checkable
class EventRecorder(Protocol):
    """An object that takes events, like TorchElastic's event and metric handlers."""

    def record(self, event: Event) -> None:
        """Take one event."""


EventHandler = Callable[[Event], None] | EventRecorder
"""A function taking an event, or an object with ``record(event)``."""


def dataclass_to_dict(instance: object, *, ndigits: int | None = None) -> dict[str, Any]:
    """A dataclass instance as plain JSON-ready data, in field order.

    Nested dataclasses become dicts, enums their values, and tuples and lists lists, at any
    depth; with ``ndigits``, floats are rounded to that many decimals. The events file and the
    health report (:mod:`torchrunx.launcher.state.health`) are both written with it.

    Raises:
        TypeError: ``instance`` is not a dataclass instance.
    """
    if not dataclasses.is_dataclass(instance) or isinstance(instance, type):
        raise TypeError(f"not a dataclass instance: {instance!r}")
    return {
        item.name: _plain(getattr(instance, item.name), ndigits)
        for item in dataclasses.fields(instance)
    }


def _plain(value: object, ndigits: int | None) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclass_to_dict(value, ndigits=ndigits)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(item, ndigits) for item in value]
    if isinstance(value, float) and ndigits is not None:
        return round(value, ndigits)
    return value


def event_to_dict(event: Event) -> dict[str, Any]:
    """The event as plain JSON-ready data, with its type under ``"event"``."""
    return {"event": type(event).__name__, **dataclass_to_dict(event)}


class EventSink:
    """Delivers events to the user's handlers and to a JSON-lines file (owned by the launcher).

    A handler that raises is reported once on the ``torchrunx`` logger and not called again;
    it never breaks the launch.
    """

    def __init__(self, handlers: Sequence[object], path: Path | None) -> None:
        """Keep the handlers; open ``path`` (mode 0600) if given.

        Each handler's call is found once here: its ``record`` method (an
        :class:`EventRecorder`), else the handler itself if it is callable (a check against
        the protocol at every event cost more than the rest of the event's delivery).
        """
        self._handlers = [(h, c) for h in handlers if (c := _handler_call(h)) is not None]
        self._file = None
        if path is not None:
            fd = _open_private(path)
            self._file = open(fd, "a", encoding="utf-8", buffering=1)  # noqa: SIM115, PTH123 (closed in close())

    def emit(self, event: Event) -> None:
        """Deliver one event."""
        if self._file is not None:
            self._file.write(json.dumps(event_to_dict(event)) + "\n")
        for pair in list(self._handlers):
            try:
                pair[1](event)
            except Exception:  # noqa: PERF203 (each handler is isolated from the others)
                logger.exception("event handler %r failed; it gets no more events", pair[0])
                self._handlers = [kept for kept in self._handlers if kept is not pair]

    def close(self) -> None:
        """Close the JSON-lines file."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _handler_call(handler: object) -> Callable[[Event], object] | None:
    """What delivers an event to ``handler``: its ``record``, else itself if callable."""
    if isinstance(handler, EventRecorder):
        return handler.record
    return handler if callable(handler) else None


def _open_private(path: Path) -> int:
    """Open (or create) the events file for appending: mode 0600, never through a symlink.

    The launcher's file was created empty, 0600, by
    :func:`torchrunx.launcher.view.logdirs.new_log_dir` in a log root it checked; reopening it here
    must find that same file: a regular file, owned by this user, with one link. Whatever the
    umask, the mode is set to 0600.

    Raises:
        PermissionError: ``path`` is a symbolic link, or not such a file.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise PermissionError(
            f"the events file {path} is a symbolic link: not followed. Remove it, or set "
            f"TORCHRUNX_LOG_DIR to a folder only you can write in"
        ) from None
    try:
        _check_own_file(fd, path)
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_own_file(fd: int, path: Path) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
        raise PermissionError(
            f"the events file {path} is not a plain file of yours with one link "
            f"(uid {info.st_uid}, {info.st_nlink} links): not written to. Remove it, or set "
            f"TORCHRUNX_LOG_DIR to a folder only you can write in"
        )
