"""The launcher: starts one agent per host, hands out the function, and gathers the results.

Phases of one launch (:meth:`Launcher.run`)::

    validate fields ─ pickle the call ─ resolve hosts ─ listen ─ start agents (in parallel)
      ─ await AgentHello from every host ─ assign ranks, send WorkerSpec + call
      ─ monitor (results straight from workers; exits, heartbeats from agents)
      ─ stop everything on the first failure ─ clean up ─ return or raise

One thread (the caller's) owns every decision; helper threads only move bytes (accept and
authenticate connections, read frames, copy agent output, wait for agent exits) and report
through one queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import queue
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, ParamSpec, TypeVar

import tyro

from torchrunx import protocol, serialization
from torchrunx.devices import AUTO_BACKEND_RULE, resolve_backend
from torchrunx.env import DEFAULT_ENV_VARS, exported_env, local_agent_env, split_extra_env_vars
from torchrunx.errors import (
    AgentFailedError,
    LaunchTimeoutError,
    ProtocolError,
    RemoteTraceback,
    SerializationError,
    TorchrunxError,
    WorkerFailedError,
    WorkerRaisedError,
    WorkerTimeoutError,
    describe_exit,
    exception_text,
)
from torchrunx.events import (
    AgentStarted,
    AgentState,
    EventHandler,
    EventSink,
    LaunchFinished,
    LaunchStarted,
    Restarting,
    WorkerFailed,
    WorkerState,
    WorkerStateChanged,
)
from torchrunx.events import WorkersStarted as WorkersStartedEvent
from torchrunx.health import (
    AgentHealth,
    HealthReport,
    HealthServer,
    WorkerHealth,
    health_port_from_env,
)
from torchrunx.hosts import (
    HostSlots,
    check_hostname,
    count_local_gpus,
    hostnames_source,
    in_slurm_allocation,
    is_local_host,
    resolve_hosts,
    slurm_allocation,
)
from torchrunx.logs import (
    Line,
    LogHandlers,
    LogRouter,
    events_file,
    log_level_from_env,
    parse_line,
)
from torchrunx.protocol import (
    AgentDone,
    AgentHello,
    Connection,
    Heartbeat,
    LogLines,
    Stop,
    WorkerException,
    WorkerExited,
    WorkerHello,
    WorkerResult,
    WorkersEnded,
    WorkerSpec,
    WorkersStarted,
    WorkerStacks,
    WorkerTimedOut,
)
from torchrunx.results import LaunchResult, LaunchTimings
from torchrunx.transport import (
    AGENT_COMMAND,
    AgentBootstrap,
    AgentProcess,
    LocalAgent,
    SrunAgent,
    SshAgent,
    agent_script,
    read_ssh_config,
    resolve_ssh_target,
    route_address,
    srun_command,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

Backend = Literal["nccl", "gloo", "mpi", "ucc", "auto"] | None

_HEARTBEAT_INTERVAL = 1.0
_HANDSHAKE_TIMEOUT = 10.0
_SETTLE_TIMEOUT = 2.0
_UNCONNECTED_SETTLE_TIMEOUT = 1.0
_AGENT_END_SETTLE_TIMEOUT = 2.0
_CAUSE_WINDOW = 0.5
"""Seconds a collective error (a peer's echo of a failure) waits for the failure behind it."""
_STOP_GRACE = 3.0
_MAX_STACKS_SHOWN = 16
_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "auto", None)
_AGENT_STARTS = ("auto", "ssh", "srun")
_RESTART_CATEGORIES = ("exceptions", "deaths", "timeouts")
_ALL_RESTART_CATEGORIES = (*_RESTART_CATEGORIES, "hosts")

StartMethod = Literal["local", "ssh", "srun"]

_RENAMED = {
    "worker_timeout": "renamed in torchrunx 0.5: use timeout=SECONDS (the process-group timeout)",
    "handler_factory": (
        "renamed in torchrunx 0.5: use log_handlers=... (or launcher.set_logging_handlers(...))"
    ),
    "env_vars": "renamed: use default_env_vars=(patterns, ...)",
    "log_dir": "removed: set the TORCHRUNX_LOG_DIR environment variable instead",
}
"""Keywords of earlier torchrunx releases (0.1 to 0.4) that no longer exist, and what replaces
them. Kept apart from unknown keywords so that a migrating script is told what to write."""


def _refuse_renamed(caller: str, keywords: Iterable[str]) -> None:
    """Raise a TypeError naming the replacement of a keyword of an earlier release."""
    for name in keywords:
        if name in _RENAMED:
            raise TypeError(f"{caller} got {name}=..., which was {_RENAMED[name]}")


_C = TypeVar("_C")


def _refuses_renamed_keywords(cls: type[_C]) -> type[_C]:
    """Make the dataclass's ``__init__`` name the replacement of an earlier release's keyword.

    Without it, ``Launcher(worker_timeout=60)`` fails with Python's bare "unexpected keyword
    argument". The wrapper keeps the generated signature (``inspect.signature``, tyro).
    """
    init: Callable[..., None] = cls.__init__

    @functools.wraps(init)
    def checked_init(self: object, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401 (the fields)
        _refuse_renamed(f"{cls.__name__}()", kwargs)
        init(self, *args, **kwargs)

    setattr(cls, "__init__", checked_init)  # noqa: B010 (replacing a method mypy knows)
    return cls


@_refuses_renamed_keywords
@dataclass(frozen=True)
class Launcher:
    """How to run a function on many hosts and workers; `run` does it.

    Every field has a default, so `Launcher().run(func)` runs one worker per GPU (or CPU
    core) on this machine, or on every node of the SLURM allocation it runs in.
    """

    hostnames: Literal["auto", "slurm"] | list[str] | Path = "auto"
    """Hosts to run on: a list of names; "auto" (the SLURM allocation, or another detected
scheduler's, if inside one, else localhost); a host provider such as "slurm", "pbs", "lsf"
or "hostfile:PATH"; or the path of a hostfile (with a slash on the command line: ./hostfile)."""

    workers_per_host: Literal["auto", "slurm", "gpu", "cpu"] | int | list[int] = "auto"
    """Workers per host: one number, one per host, "slurm" (what SLURM gave each node), or
the GPUs of each host with "gpu" (an error for a host without any), its CPU cores with "cpu",
or the default "auto" (a hostfile's or scheduler's slots, else GPUs, else CPU cores)."""

    agent_start: Literal["auto", "ssh", "srun"] = "auto"
    """How agents start on other hosts. "srun": one SLURM job step per host (inside an
allocation); "ssh": over SSH; "auto": srun inside an allocation whose nodes are the hosts,
else ssh. An agent on this machine is always a plain subprocess."""

    ssh_config_file: str | Path | None = None
    """SSH config for reaching hosts; None: ~/.ssh/config if it exists."""

    backend: Backend = "auto"
    """torch.distributed backend. "auto": nccl if every host has a GPU for each of its workers,
else gloo (one choice for the whole launch, from the GPUs each agent counts); None: no process
group. With nccl each worker's current CUDA device is LOCAL_RANK's GPU, bound to the group."""

    timeout: float = 600
    """Process-group timeout in seconds (for collectives and process-group set-up); a
fraction such as 1.5 is fine."""

    isolate_gpus: bool = False
    """False: every worker sees every GPU of its host and LOCAL_RANK picks one, as under
torchrun. True: each worker sees only its own GPU, as cuda:0 (CUDA_VISIBLE_DEVICES = local
rank modulo the host's GPUs, unless CUDA_VISIBLE_DEVICES is already set)."""

    default_env_vars: tuple[str, ...] = DEFAULT_ENV_VARS
    """Launcher environment variables (fnmatch patterns) copied to agents and workers on every
host. Workers on this machine see the launcher's whole environment anyway."""

    copy_env_vars: tuple[str, ...] | None = None
    """torchrunx 0.4's name for default_env_vars: give one or the other (None: not given)."""

    extra_env_vars: tuple[str, ...] | dict[str, str] | None = ()
    """More variables for every agent and worker on every host: fnmatch patterns of launcher
variables to copy, on top of default_env_vars, and NAME=VALUE entries to set (in Python also a
dict of names and values, as in torchrunx 0.4)."""

    env_file: str | Path | None = None
    """A bash file sourced on every host before the agent starts (after copied variables)."""

    launcher_address: str | None = None
    """Address remote agents connect back to; None: $TORCHRUNX_LAUNCHER_ADDR if set, else the
local address of each SSH connection (srun agents: this machine's address on the route to
their node)."""

    agent_timeout: float = 5.0
    """Seconds without a heartbeat after which a host counts as lost (cut link, frozen host)."""

    start_timeout: float = 60.0
    """Seconds for every agent to start and connect back (SSH connect included)."""

    launch_timeout: float | None = None
    """Wall-clock limit in seconds for the whole launch (None: no limit)."""

    max_restarts: int = 0
    """Restart the whole worker group, on the same agents, up to this many times after a
worker fails; then raise the last failure, with the earlier ones in its notes."""

    restart_on: tuple[str, ...] = _RESTART_CATEGORIES
    """Failures that restart: "exceptions" (the function raised), "deaths" (a worker exited
or was killed), "timeouts" (a torchrunx.timer watchdog expired), "hosts" (an agent died or
its host was lost: a new agent is started there; not in the default), or exception type
names, for example "OSError" (those types and their subclasses only)."""

    health_check_port: int | None = None
    """Serve GET /health (JSON; 200 while healthy, 503 after a failure) on this port while
the launch runs; 0 picks a free port; None: $TORCHRUNX_HEALTH_CHECK_PORT if set, else none."""

    event_handlers: Annotated[tuple[EventHandler, ...], tyro.conf.Suppress] = ()
    """Functions, or objects with a record(event) method, that receive every launch event."""

    log_handlers: Annotated[LogHandlers, tyro.conf.Suppress] = "auto"
    """Where forwarded logs go. "auto": the first worker on stdout, with its agent's warnings
(its INFO lines too where the torchrunx.agent logger allows INFO), and every agent and worker
in files under $TORCHRUNX_LOG_DIR; None: nowhere; or logging.Handlers, or a function making
them, that receive every record."""

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> Launcher:  # noqa: ANN401 (field values)
        """A launcher from a named preset (entry point group ``torchrunx.presets``).

        Args:
            name: The preset's name, e.g. ``"gpu_x8"``.
            **overrides: Fields to set on top of the preset.

        Raises:
            ValueError: No preset has that name.
            TypeError: The preset or an override names a field ``Launcher`` does not have.
        """
        from torchrunx import plugins  # noqa: PLC0415 (entry points are read on use)

        values = {**plugins.preset(name), **overrides}
        _refuse_renamed(f"Launcher.from_preset({name!r})", values)
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"preset {name!r} or its overrides set unknown fields {unknown}")
        for key, value in values.items():
            if isinstance(value, list) and key in (
                "default_env_vars",
                "copy_env_vars",
                "extra_env_vars",
                "restart_on",
            ):
                values[key] = tuple(value)
        return cls(**values)

    def run(self, func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> LaunchResult[R]:
        """Run ``func(*args, **kwargs)`` in every worker and return every rank's value.

        Raises:
            ValueError: A field is invalid (raised before any host is touched).
            TypeError: ``func`` is not callable.
            SerializationError: The function, an argument or a return value cannot be pickled.
            AgentFailedError: An agent could not be started, died, or its host was lost.
            WorkerFailedError: A worker died without raising (exit code or signal).
            Exception: The exception a worker raised, with its own type, the remote traceback
                as ``__cause__`` and the host and rank in its notes.
        """
        self.validate()
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")
        call = _pickle_call(func, args, kwargs)
        hosts = resolve_hosts(self.hostnames, self.workers_per_host)
        methods = start_methods(self.agent_start, [h.hostname for h in hosts])
        launch = _Launch(self, hosts, methods, call)
        try:
            with _sigterm_raises_system_exit():
                per_host = launch.execute()
        finally:
            launch.close()
        return LaunchResult(
            tuple(h.hostname for h in hosts), per_host, launch.attempt, launch.timings()
        )

    def validate(self) -> None:
        """Check every field; raise a clear error before anything starts.

        Raises:
            ValueError: A field has an invalid value.
            TypeError: A field has the wrong type.
        """
        _validate_hostnames(self.hostnames)
        _validate_workers(self.workers_per_host, self.hostnames)
        _validate_choice("agent_start", self.agent_start, _AGENT_STARTS)
        _validate_choice("backend", self.backend, _BACKENDS)
        if not isinstance(self.isolate_gpus, bool):
            raise TypeError(f"isolate_gpus must be True or False, got {self.isolate_gpus!r}")
        for name in ("timeout", "agent_timeout", "start_timeout", "launch_timeout"):
            value = getattr(self, name)
            if value is not None or name != "launch_timeout":
                _validate_seconds(name, value)
        _validate_env_vars(self.default_env_vars, self.copy_env_vars, self.extra_env_vars)
        _validate_log_handlers(self.log_handlers)
        _validate_restarts(self.max_restarts, self.restart_on)
        _validate_event_handlers(self.event_handlers)
        health_port_from_env(self.health_check_port)  # raises ValueError for a bad port
        log_level_from_env()  # raises ValueError for a bad TORCHRUNX_LOG_LEVEL
        if self.env_file is not None and not Path(self.env_file).expanduser().is_file():
            raise ValueError(f"env_file {str(self.env_file)!r} does not exist or is not a file")
        if self.ssh_config_file is not None:
            path = Path(self.ssh_config_file).expanduser()
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ValueError(f"ssh_config_file {str(path)!r} does not exist or is not readable")
            read_ssh_config(path)  # a syntax error is reported now, before any host is touched

    def set_logging_handlers(self, handler_factory: LogHandlers) -> Launcher:
        """Set :attr:`log_handlers` as torchrunx 0.4 did; returns this launcher.

        Sets ``log_handlers`` on this launcher itself, as 0.4 did, so that both
        ``Launcher(...).set_logging_handlers(f).run(g)`` and a separate call before ``run``
        work. Prefer ``Launcher(log_handlers=f)``.

        Args:
            handler_factory: A function returning ``logging.Handler`` objects, a list of them,
                ``"auto"`` or ``None`` (see ``log_handlers``).

        Raises:
            TypeError: ``handler_factory`` is none of these.
        """
        _validate_log_handlers(handler_factory)
        # Launcher is frozen, but 0.4's method changed the launcher it was called on, and
        # scripts call it without using the return value.
        object.__setattr__(self, "log_handlers", handler_factory)
        return self

    def exported_env(self) -> dict[str, str]:
        """The variables every agent exports, on every host (values as the launcher has them).

        The launcher's variables matching ``default_env_vars`` (or ``copy_env_vars``) and the
        patterns of ``extra_env_vars``, then the values given in ``extra_env_vars``.

        Raises:
            TypeError: ``extra_env_vars`` has the wrong type.
            ValueError: ``extra_env_vars`` sets a name that cannot be exported.
        """
        patterns, values = split_extra_env_vars(self.extra_env_vars)
        defaults = self.default_env_vars if self.copy_env_vars is None else self.copy_env_vars
        return exported_env((*defaults, *patterns), values)

    def dry_run(self) -> str:
        """Describe what :meth:`run` would start, without starting or contacting anything.

        The description lists the resolved hosts, workers per host and ranks, the names (never
        the values) of the forwarded environment variables, and the command line each agent
        would be started with.

        Raises:
            ValueError: A field is invalid, as for :meth:`run`.
            RuntimeError: ``"slurm"`` outside an allocation, as for :meth:`run`.
        """
        self.validate()
        hosts = resolve_hosts(self.hostnames, self.workers_per_host)
        methods = start_methods(self.agent_start, [h.hostname for h in hosts])
        env = self.exported_env()
        counts_gpus = self.backend == "auto" or self.workers_per_host == "gpu"
        here = count_local_gpus() if counts_gpus and "local" in methods else None
        gpus = [here if method == "local" else None for method in methods]
        return describe_plan(self, hosts, methods, sorted(env), gpus)


def describe_plan(
    launcher: Launcher,
    hosts: list[HostSlots],
    methods: list[StartMethod],
    env_names: list[str],
    gpus: Sequence[int | None] | None = None,
) -> str:
    """The text of :meth:`Launcher.dry_run` (pure: it reads the SSH config, nothing more).

    ``gpus``: each host's GPU count where known (hosts that are this machine), else None.
    """
    known = all(h.workers is not None for h in hosts)
    world = sum(h.workers or 0 for h in hosts) if known else None
    lines = [
        "torchrunx dry run: nothing was started",
        f"hosts: {len(hosts)}",
        f"world size: {world if world is not None else 'known once every agent has counted'}",
        *_backend_lines(launcher, hosts, gpus or [None] * len(hosts)),
        "",
        "host  name                 workers  ranks      agent start",
    ]
    offset: int | None = 0
    count = _count_mode(launcher.workers_per_host)
    for index, (host, method) in enumerate(zip(hosts, methods, strict=True)):
        if host.workers is None:
            workers, ranks = count, "-"
            offset = None
        else:
            workers = str(host.workers)
            if offset is None:
                ranks = "-"
            else:
                last = offset + host.workers - 1
                ranks = f"{offset}" if last == offset else f"{offset}-{last}"
                offset += host.workers
        lines.append(f"{index:<5} {host.hostname:<20} {workers:<8} {ranks:<10} {method}")
    if not known:
        counted = {"gpu": "GPUs", "cpu": "CPU cores"}.get(count, "GPUs, else CPU cores")
        lines.append(f"({count}: the agent counts its {counted}; ranks follow host order)")
    if count == "gpu":
        without = [h.hostname for h, g in zip(hosts, gpus or [], strict=False) if g == 0]
        if without:
            lines.append(f"workers_per_host='gpu' would fail: no GPU on {', '.join(without)}")
    lines += ["", f"forwarded environment variables ({len(env_names)}, values not shown):"]
    lines.append("  " + (" ".join(env_names) or "(none)"))
    if "local" in methods:
        lines.append("  (workers on this machine also see the rest of the launcher's environment)")
    if launcher.env_file is not None:
        lines.append(f"sourced on every host first: {launcher.env_file}")
    lines += ["", "agent command lines (the script and secret go on stdin, never here):"]
    for host, method in zip(hosts, methods, strict=True):
        lines.append(f"  {host.hostname}: {_agent_command_line(launcher, host.hostname, method)}")
    return "\n".join(lines)


def _count_mode(workers_per_host: object) -> str:
    """What agents count for a host without a worker count: "gpu", "cpu" or "auto"."""
    return str(workers_per_host) if workers_per_host in ("gpu", "cpu") else "auto"


def _backend_lines(
    launcher: Launcher, hosts: list[HostSlots], gpus: Sequence[int | None]
) -> list[str]:
    """The dry run's backend: ``"auto"`` resolved where the GPU counts allow it."""
    line = f"(process-group timeout {launcher.timeout:g} s)"
    if launcher.backend != "auto":
        return [f"backend: {launcher.backend} {line}"]
    pairs = list(zip(hosts, gpus, strict=True))
    backend = resolve_backend("auto", [(h.workers, g) for h, g in pairs])
    counted = ", ".join(f"{h.hostname} {g}" for h, g in pairs if g is not None)
    seen = f" (GPUs counted here: {counted})" if counted else ""
    if backend == "auto":
        why = f"auto: decided when the agents report their GPUs: {AUTO_BACKEND_RULE}{seen}"
    elif backend == "nccl":
        why = f"auto resolves to nccl: every worker has a GPU{seen}"
    else:
        why = f"auto resolves to gloo: not every worker has a GPU{seen}"
    return [f"backend: {backend} {line}", f"  {why}"]


def _agent_command_line(launcher: Launcher, hostname: str, method: StartMethod) -> str:
    if method == "local":
        return AGENT_COMMAND
    if method == "srun":
        return shlex.join(srun_command(hostname, cpus=_slurm_cpus(hostname)))
    try:
        target = resolve_ssh_target(hostname, launcher.ssh_config_file, launcher.start_timeout)
    except ValueError as exc:
        return f"ssh (cannot read the SSH config: {exc})"
    via = f" via {target.proxy_jump}" if target.proxy_jump else ""
    return f"ssh {target.user}@{target.hostname} -p {target.port}{via} {AGENT_COMMAND}"


def launch(
    func: Callable[..., R],
    func_args: tuple[Any, ...] | None = None,
    func_kwargs: dict[str, Any] | None = None,
    **launcher_fields: Any,  # noqa: ANN401 (the Launcher's fields, checked by its constructor)
) -> LaunchResult[R]:
    """Run ``func(*func_args, **func_kwargs)`` on every worker: ``Launcher(**fields).run(...)``.

    Raises:
        TypeError: An unknown launcher field (for one of an earlier release, it names what
            replaces it).
        Exception: Whatever :meth:`Launcher.run` raises.
    """
    _refuse_renamed("launch()", launcher_fields)
    launcher = Launcher(**launcher_fields)
    return launcher.run(func, *(func_args or ()), **(func_kwargs or {}))


def _validate_log_handlers(handlers: object) -> None:
    if handlers is None or handlers == "auto" or callable(handlers):
        return
    if not isinstance(handlers, list | tuple) or not all(
        isinstance(h, logging.Handler) for h in handlers
    ):
        raise TypeError(
            f'log_handlers must be "auto", None, a list of logging.Handler or a function '
            f"returning one, got {handlers!r}"
        )


def _validate_restarts(max_restarts: object, restart_on: object) -> None:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if isinstance(restart_on, str) or not isinstance(restart_on, list | tuple):
        raise TypeError(
            f"restart_on must be a tuple of categories {list(_ALL_RESTART_CATEGORIES)} and/or "
            f"exception type names, got {restart_on!r}"
        )
    for entry in restart_on:
        if not isinstance(entry, str) or not entry.replace(".", "").replace("_", "").isalnum():
            raise ValueError(
                f"restart_on entry {entry!r} is neither one of {list(_ALL_RESTART_CATEGORIES)} "
                "nor an exception type name"
            )


def _validate_event_handlers(handlers: object) -> None:
    if not isinstance(handlers, list | tuple) or not all(
        callable(h) or callable(getattr(h, "record", None)) for h in handlers
    ):
        raise TypeError(
            "event_handlers must be a tuple of functions or of objects with a record(event) "
            f"method, got {handlers!r}"
        )


def _validate_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}")


def _validate_seconds(name: str, value: object) -> None:
    """A timeout must be a finite number of seconds above 0 (an int or a float)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and not math.isfinite(value):
        no_limit = " (for no limit, use launch_timeout=None)" if name == "launch_timeout" else ""
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}{no_limit}")
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _validate_hostnames(hostnames: object) -> None:
    if hostnames == "auto":
        return
    from torchrunx import plugins  # noqa: PLC0415 (entry points are read on use)

    try:
        source = hostnames_source(hostnames)
    except TypeError:
        source = None
    if source is not None and source.hostfile is not None:
        hostfile = source.hostfile
        if hostfile.expanduser().is_file():
            return
        if isinstance(hostnames, os.PathLike) or "/" in str(hostfile):
            hint = ""
            if isinstance(hostnames, list | tuple):  # ["a/b"]: a path, as from the CLI
                hint = " (a one-entry list with '/' names a hostfile: host names have no '/')"
            raise ValueError(f"hostfile {str(hostfile)!r} does not exist or is not a file{hint}")
        raise ValueError(
            f"hostnames={str(hostfile)!r} is neither 'auto', a host provider "
            f"({', '.join(plugins.host_provider_names())}) nor an existing hostfile; for a "
            f"single host give a list: hostnames=[{str(hostfile)!r}]"
        )
    if source is not None and source.provider is not None:
        return
    if source is None or not source.names:
        raise ValueError(f"hostnames must be a non-empty list of host names, got {hostnames!r}")
    for name in source.names:
        check_hostname(name)


def _validate_env_vars(default: object, copy: object, extra: object) -> None:
    for name, value in (("default_env_vars", default), ("copy_env_vars", copy)):
        if value is None and name == "copy_env_vars":
            continue
        if not isinstance(value, list | tuple) or not all(isinstance(p, str) for p in value):
            raise TypeError(f"{name} must be a tuple of fnmatch patterns, got {value!r}")
    if copy is not None and tuple(default) != DEFAULT_ENV_VARS:  # type: ignore[arg-type]  # checked above
        raise ValueError(
            "copy_env_vars (torchrunx 0.4's name) and default_env_vars are the same setting: "
            "give only one of them"
        )
    split_extra_env_vars(extra)  # raises TypeError or ValueError


def _validate_workers(workers: object, hostnames: object) -> None:
    if workers in ("auto", "slurm", "gpu", "cpu"):
        return
    counts = workers if isinstance(workers, list | tuple) else [workers]
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(
                "workers_per_host must be positive integers (one, or one per host), 'auto', "
                f"'slurm', 'gpu' or 'cpu', got {workers!r}"
            )
    if isinstance(workers, list | tuple) and isinstance(hostnames, list | tuple):
        _check_lengths(len(workers), len(hostnames))


def start_methods(agent_start: str, hostnames: list[str]) -> list[StartMethod]:
    """How each host's agent starts: ``"local"`` for this machine, else ssh or srun.

    ``agent_start="auto"`` picks srun when this process runs in a SLURM allocation, ``srun`` is
    installed and every remote host is a node of the allocation; otherwise ssh.

    Raises:
        RuntimeError: ``"srun"`` outside an allocation, without ``srun``, or for a host that is
            not a node of the allocation.
    """
    local = [is_local_host(name) for name in hostnames]
    remote = [name for name, here in zip(hostnames, local, strict=True) if not here]
    method: StartMethod = "ssh"
    if agent_start == "srun":
        allocation = slurm_allocation(what="agent_start='srun'")
        if shutil.which("srun") is None:
            raise RuntimeError("agent_start='srun' but srun is not installed on this machine")
        outside = [name for name in remote if name not in allocation.nodes]
        if outside:
            raise RuntimeError(
                f"agent_start='srun' but {outside} are not nodes of SLURM job "
                f"{allocation.job_id} ({list(allocation.nodes)}); use agent_start='ssh'"
            )
        method = "srun"
    elif agent_start == "auto" and remote and in_slurm_allocation() and shutil.which("srun"):
        nodes = set(slurm_allocation().nodes)
        if all(name in nodes for name in remote):
            method = "srun"
    return ["local" if here else method for here in local]


def _check_lengths(workers: int, hosts: int) -> None:
    if workers != hosts:
        raise ValueError(
            f"workers_per_host has {workers} entries but hostnames has {hosts}; "
            "give one count per host or a single int"
        )


def _restarts_for(error: BaseException, wanted: set[str], from_worker: bool) -> bool:  # noqa: PLR0911 (one answer per kind of failure)
    """Whether ``restart_on`` (``wanted``) covers ``error``."""
    if isinstance(error, WorkerTimeoutError):
        return "timeouts" in wanted
    if isinstance(error, WorkerFailedError):
        return "deaths" in wanted
    if isinstance(error, AgentFailedError):
        return "hosts" in wanted
    if isinstance(error, WorkerRaisedError) and from_worker:  # its type could not travel back
        type_name = error.type_name
        return "exceptions" in wanted or bool({type_name, type_name.rsplit(".", 1)[-1]} & wanted)
    if not from_worker or isinstance(error, TorchrunxError | KeyboardInterrupt | SystemExit):
        return False  # lost hosts, the launch's own timeouts, pickling, protocol errors
    if "exceptions" in wanted:
        return True
    return bool(_type_names(error) & (wanted - set(_ALL_RESTART_CATEGORIES)))


def _type_names(error: BaseException) -> set[str]:
    """Names an exception answers to in ``restart_on``: bare and qualified, for its whole MRO."""
    names: set[str] = set()
    for cls in type(error).__mro__:
        names.update({cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"})
    return names


def _slurm_cpus(hostname: str) -> int | None:
    """CPUs the allocation has on ``hostname``, for the srun step of its agent."""
    try:
        return slurm_allocation().cpus(hostname)
    except (RuntimeError, ValueError):
        return None


def _pickle_call(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[memoryview]:
    try:
        return serialization.dumps((func, args, kwargs))
    except Exception as exc:
        name = getattr(func, "__qualname__", repr(func))
        raise SerializationError(
            f"cannot pickle the function {name} or its arguments with cloudpickle: {exc}. "
            "Everything passed to a launch must be picklable (no open files, locks, sockets)."
        ) from exc


# ------------------------------------------------------------------------------------------
# The live launch
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Started:
    host_index: int
    process: AgentProcess


@dataclass(frozen=True)
class _StartFailed:
    host_index: int
    error: AgentFailedError


@dataclass(frozen=True)
class _AgentEnded:
    host_index: int
    status: int | None
    process: AgentProcess


@dataclass(frozen=True)
class _Received:
    conn: Connection
    message: protocol.Message
    payload: list[bytearray]
    received_at: float = 0.0


@dataclass(frozen=True)
class _Closed:
    conn: Connection


_Event = _Started | _StartFailed | _AgentEnded | _Received | _Closed


@dataclass
class _AgentState:
    slots: HostSlots
    method: StartMethod
    remote: bool
    process: AgentProcess | None = None
    conn: Connection | None = None
    hello: AgentHello | None = None
    spec: WorkerSpec | None = None
    pids: tuple[int, ...] = ()
    last_heard: float = 0.0
    done: bool = False
    ended: bool = False
    lost: bool = False
    """Silent for agent_timeout: its host is unreachable; never waited for again."""
    failed: bool = False
    free_port: int = 0
    idle: bool = False
    """Its workers of this attempt ended; it waits for a new spec or a Stop (WorkersEnded)."""
    started_after: float = 0.0
    """Seconds from the launch's start to this agent's hello."""
    conn_closed: bool = False
    exit_status: int | None = None
    end_settle_by: float | None = None
    """Its process ended before its connection did: judged when the connection ends (its
    last messages, such as AgentDone, travel on it and may still be queued) or by then."""

    @property
    def lifecycle(self) -> AgentState:
        if self.lost:
            return AgentState.LOST
        if self.failed:
            return AgentState.FAILED
        if self.done:
            return AgentState.DONE
        return AgentState.STARTING if self.hello is None else AgentState.RUNNING


@dataclass
class _RankState:
    host_index: int
    local_rank: int
    conn: Connection | None = None
    pid: int = 0
    closed: bool = False
    result: list[bytearray] | None = None
    exited: WorkerExited | None = None
    settle_by: float | None = None
    state: WorkerState = WorkerState.INIT
    timing: WorkerResult | None = None
    received_at: float = 0.0


@dataclass
class _Failures:
    """The failure to raise, and one-line summaries of the others.

    A collective error (a rank's "Connection closed by peer" when another rank died) is only
    provisionally first: until ``provisional_until`` a failure that is not one takes its place,
    because it names the cause rather than the symptom.
    """

    first: BaseException | None = None
    others: list[str] = field(default_factory=list)
    provisional_until: float | None = None

    def add(self, error: BaseException, *, collective: bool = False) -> None:
        if self.first is None:
            self.first = error
            if collective:
                self.provisional_until = time.monotonic() + _CAUSE_WINDOW
        elif self.provisional_until is not None and not collective:
            self.replace_first(error)
        else:
            self.others.append(_summary(error))

    def settled(self, now: float) -> bool:
        """Whether there is a failure, and it is no longer waiting for its cause."""
        until = self.provisional_until
        return self.first is not None and (until is None or now >= until)

    def replace_first(self, error: BaseException) -> None:
        """Make ``error`` (a Ctrl-C, a timeout) the failure to raise; the old one is a summary."""
        if self.first is not None:
            self.others.insert(0, _summary(self.first))
        self.first = error
        self.provisional_until = None


class _Launch:
    """One launch in progress; owned by the thread that calls :meth:`execute`."""

    def __init__(
        self,
        launcher: Launcher,
        hosts: list[HostSlots],
        methods: list[StartMethod],
        call: list[memoryview],
    ) -> None:
        self.launcher = launcher
        self.call = call
        # First: it may raise (a bad TORCHRUNX_LOG_LEVEL, a failing handler factory).
        self.logs = LogRouter(launcher.log_handlers, [h.hostname for h in hosts])
        try:  # an unwritable log folder fails here, before any socket or thread exists
            self.sink = EventSink(
                launcher.event_handlers,
                None if self.logs.log_dir is None else events_file(self.logs.log_dir),
            )
        except BaseException:
            self.logs.close()
            raise
        self.secret = protocol.new_secret()
        self.events: queue.Queue[_Event] = queue.Queue()
        self.agents = [
            _AgentState(h, method, remote=method != "local")
            for h, method in zip(hosts, methods, strict=True)
        ]
        self.ranks: list[_RankState] = []
        self.failures = _Failures()
        self.started = time.monotonic()
        self.stacks: dict[int, str] = {}
        # The worker behind a failure: its output tail is added when the error is raised,
        # once the agents have forwarded everything (output travels apart from exceptions).
        self.failed_rank: dict[int, tuple[BaseException, _RankState]] = {}
        self.stopping = False
        self.closing = False
        self.threads: list[threading.Thread] = []
        self.connections: list[Connection] = []
        self.lock = threading.Lock()
        self.start_pool = ThreadPoolExecutor(
            max_workers=min(32, len(hosts)), thread_name_prefix="torchrunx-start"
        )
        self.listener = _listen()
        self.port = int(self.listener.getsockname()[1])
        self.env = launcher.exported_env()
        self.local_env = local_agent_env()  # this machine's agents: the launcher's environment
        self.attempt = 0
        self.history: list[str] = []
        self.degraded = False
        self.phase = "starting agents"
        self.agents_started_after = 0.0
        self.finished_after = 0.0
        self.health: HealthServer | None = None
        self.script = b""
        self.retired: list[tuple[AgentProcess, bool]] = []
        """Agents replaced after their host failed (restart_on "hosts"), closed at the end."""
        self._spawn(self._accept_loop, "torchrunx-accept")

    # -- phases ---------------------------------------------------------------------------

    def execute(self) -> tuple[tuple[Any, ...], ...]:
        """Run every phase; return the unpickled results per host."""
        limit = self.launcher.launch_timeout
        launch_deadline = None if limit is None else self.started + limit
        health_port = health_port_from_env(self.launcher.health_check_port)
        if health_port is not None:  # an OSError (port in use) ends the launch; close() cleans up
            self.health = HealthServer(health_port, self._health_report)
            self.health.start()
            logger.info("health endpoint: %s", self.health.url)
        self.sink.emit(
            LaunchStarted(
                tuple(a.slots.hostname for a in self.agents),
                tuple(a.slots.workers for a in self.agents),
                self.launcher.max_restarts,
                None if self.health is None else self.health.url,
            )
        )
        try:
            self._start_agents()
            start_deadline = self.started + self.launcher.start_timeout
            if launch_deadline is not None and launch_deadline < start_deadline:
                start_deadline = launch_deadline
            self._wait(lambda: all(a.hello is not None for a in self.agents), start_deadline)
            self.agents_started_after = time.monotonic() - self.started
            while True:
                self._send_specs()
                try:
                    self._wait(self._finished, launch_deadline)
                    break
                except _Abort:
                    if not self._restartable():
                        raise
                self._restart(launch_deadline)
            self.finished_after = time.monotonic() - self.started
            results = self._collect()
        except BaseException as exc:  # noqa: BLE001 (Ctrl-C included: stop everything first)
            if isinstance(exc, KeyboardInterrupt | SystemExit | LaunchTimeoutError):
                # Even in the middle of a restart, what the user did (or the limit) comes first.
                self.failures.replace_first(exc)
            elif not isinstance(exc, _Abort):  # _Abort: the failure is already recorded
                self.failures.add(exc)
            self.phase = "stopping after a failure"
            self.degraded = True
            self._stop_all()
            error = self._error()
            self.phase = "failed"
            self._emit_finished(error)
            raise error from error.__cause__
        self.phase = "succeeded"
        self._emit_finished(None)
        return results

    def _emit_finished(self, error: BaseException | None) -> None:
        self.sink.emit(
            LaunchFinished(
                succeeded=error is None,
                attempts=self.attempt + 1,
                duration=time.monotonic() - self.started,
                error=None if error is None else _summary(error),
            )
        )

    # -- restarts -------------------------------------------------------------------------

    def _restartable(self) -> bool:
        """Whether the failure just recorded may be answered with a restart."""
        error = self.failures.first
        if error is None or self.attempt >= self.launcher.max_restarts:
            return False
        return _restarts_for(
            error, set(self.launcher.restart_on), self._rank_behind(error) is not None
        )

    def _restart(self, launch_deadline: float | None) -> None:
        """Stop the worker group, keep the agents, and get them ready for the next attempt.

        Raises:
            _Abort: An agent did not get ready (it died or its host was lost meanwhile).
        """
        error = self.failures.first
        assert error is not None  # noqa: S101 (restarts answer a failure)
        reason = _summary(error)
        self.history.append(f"attempt {self.attempt}: {reason}")
        self.degraded = True
        self.phase = "restarting"
        self.stopping = True
        self.sink.emit(Restarting(self.attempt + 1, self.launcher.max_restarts, reason))
        logger.warning(
            "restarting the workers (restart %d of %d) after: %s",
            self.attempt + 1,
            self.launcher.max_restarts,
            reason,
        )
        for state in self.agents:
            if state.conn is not None and not (state.done or state.ended or state.idle):
                stop = Stop(
                    reason, _STOP_GRACE, dump_stacks=False, restart=True, attempt=self.attempt
                )
                with contextlib.suppress(OSError):
                    state.conn.send(stop)
        deadline = time.monotonic() + _STOP_GRACE + 10.0
        if launch_deadline is not None:
            deadline = min(deadline, launch_deadline)
        self._wait(
            lambda: all(a.idle or a.ended or a.lost or a.done for a in self.agents),
            deadline,
        )
        if launch_deadline is not None and time.monotonic() >= launch_deadline:
            self.stopping = False
            raise self._timeout_error(time.monotonic())
        self._drain_events()
        for rank, rank_state in enumerate(self.ranks):
            self._set_state(rank, WorkerState.STOPPED)
            if rank_state.conn is not None:
                rank_state.conn.close()  # an old worker's connection: nothing more is read
        if "hosts" in self.launcher.restart_on:
            self._replace_agents(launch_deadline)
        unready = [a.slots.hostname for a in self.agents if not a.idle]
        if unready:
            self.stopping = False
            self.history.pop()  # this failure is the one raised, not an earlier one
            self.failures.others.append(
                f"a restart was attempted, but the agents of {unready} did not get ready"
            )
            raise _Abort
        self.attempt += 1
        self.ranks = []
        self.failures = _Failures()
        self.failed_rank.clear()
        self.stacks.clear()
        self.stopping = False
        for state in self.agents:
            state.idle = False
            state.pids = ()

    def _replace_agents(self, launch_deadline: float | None) -> None:
        """Start a new agent for every host whose agent died or was lost (new SSH or srun)."""
        replaced = [i for i, a in enumerate(self.agents) if not a.idle]
        for index in replaced:
            old = self.agents[index]
            logger.warning("starting a new agent on %s", old.slots.hostname)
            if old.process is not None:
                self.retired.append((old.process, old.lost))
            self.agents[index] = _AgentState(old.slots, old.method, remote=old.remote)
            self.start_pool.submit(self._start_agent, index, self.script)
        deadline = time.monotonic() + self.launcher.start_timeout
        if launch_deadline is not None:
            deadline = min(deadline, launch_deadline)
        self._wait(
            lambda: all(self.agents[i].hello is not None or self.agents[i].ended for i in replaced),
            deadline,
        )
        for index in replaced:
            state = self.agents[index]
            state.idle = state.hello is not None

    def _rank_behind(self, error: BaseException) -> _RankState | None:
        """The worker whose failure ``error`` is (``None`` for other failures)."""
        entry = self.failed_rank.get(id(error))
        return entry[1] if entry is not None and entry[0] is error else None

    def _drain_events(self) -> None:
        while True:  # what arrived together with the last agent's reply still counts
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            self._handle(event)

    # -- states, events and health ----------------------------------------------------------

    def _set_state(self, rank: int, new: WorkerState) -> None:
        state = self.ranks[rank]
        if state.state == new or state.state.is_final:
            return
        old, state.state = state.state, new
        agent = self.agents[state.host_index]
        self.sink.emit(
            WorkerStateChanged(
                rank,
                state.host_index,
                agent.slots.hostname,
                state.local_rank,
                self.attempt,
                old,
                new,
            )
        )
        running = (WorkerState.HEALTHY, WorkerState.SUCCEEDED)
        if new in running and all(r.state in running for r in self.ranks):
            self.degraded = False  # after a restart: healthy again once every worker runs
            self.phase = "running"

    def _worker_failed(self, rank: int, error: BaseException) -> None:
        state = self.ranks[rank]
        if state.state.is_final:
            return
        self._set_state(rank, WorkerState.FAILED)
        agent = self.agents[state.host_index]
        self.sink.emit(
            WorkerFailed(
                rank,
                state.host_index,
                agent.slots.hostname,
                state.local_rank,
                self.attempt,
                _summary(error),
            )
        )

    def _health_report(self) -> HealthReport:
        """Called from the health server's threads: reads the state, changes nothing."""
        now = time.monotonic()
        agents = tuple(
            AgentHealth(
                index,
                a.slots.hostname,
                a.lifecycle,
                None if a.hello is None else round(now - a.last_heard, 3),
            )
            for index, a in enumerate(list(self.agents))
        )
        ranks = list(self.ranks)
        workers = tuple(
            WorkerHealth(
                rank,
                r.host_index,
                self.agents[r.host_index].slots.hostname,
                r.local_rank,
                r.pid or None,
                r.state,
            )
            for rank, r in enumerate(ranks)
        )
        failures = [*self.history]
        first = self.failures.first
        if first is not None and self.phase != "restarting":  # else it is in the history
            failures.append(f"attempt {self.attempt}: {_summary(first)}")
        unhealthy = self.degraded or any(
            a.state in (AgentState.FAILED, AgentState.LOST) for a in agents
        )
        return HealthReport(
            healthy=not unhealthy and first is None,
            launch_state=self.phase,
            attempt=self.attempt,
            restarts=self.attempt,
            max_restarts=self.launcher.max_restarts,
            uptime=now - self.started,
            agents=agents,
            workers=workers,
            failures=tuple(failures),
        )

    def timings(self) -> LaunchTimings:
        """Phase durations of the attempt that succeeded (see :class:`LaunchTimings`)."""
        ranks = [r.timing for r in self.ranks]
        return LaunchTimings(
            total=self.finished_after,
            agents_started=self.agents_started_after,
            connect=tuple(float(getattr(a.process, "connect_seconds", 0.0)) for a in self.agents),
            agent_start=tuple(a.started_after for a in self.agents),
            process_group_init=tuple(t.init_seconds if t else 0.0 for t in ranks),
            function=tuple(t.function_seconds if t else 0.0 for t in ranks),
            result_transfer=tuple(
                (t.pickle_seconds + max(r.received_at - t.sent_at, 0.0)) if t else 0.0
                for r, t in zip(self.ranks, ranks, strict=True)
            ),
        )

    def _start_agents(self) -> None:
        self.script = agent_script(
            env=self.env,
            cwd=str(Path.cwd()),
            python=sys.executable,
            env_file=str(Path(self.launcher.env_file).expanduser().resolve())
            if self.launcher.env_file is not None
            else None,
        )
        for index in range(len(self.agents)):
            self.start_pool.submit(self._start_agent, index, self.script)

    def _start_agent(self, index: int, script: bytes) -> None:
        state = self.agents[index]
        hostname = state.slots.hostname
        try:
            if state.method == "srun":
                process: AgentProcess = SrunAgent(
                    hostname,
                    script,
                    self._bootstrap(index, self._srun_address(hostname)),
                    functools.partial(self._on_agent_line, index),
                    cpus=_slurm_cpus(hostname),
                )
            elif state.method == "ssh":
                process = SshAgent(
                    hostname,
                    script,
                    lambda local_address: self._bootstrap(index, local_address),
                    self.launcher.ssh_config_file,
                    connect_timeout=min(self.launcher.start_timeout, 30.0),
                    on_line=functools.partial(self._on_agent_line, index),
                )
            else:
                process = LocalAgent(
                    hostname,
                    script,
                    self._bootstrap(index, "127.0.0.1"),
                    functools.partial(self._on_agent_line, index),
                    environ=self.local_env,
                )
        except AgentFailedError as exc:
            self.events.put(_StartFailed(index, exc))
            return
        except Exception as exc:  # noqa: BLE001 (any failure to start is this host's failure)
            error = AgentFailedError(hostname, f"cannot start the agent: {exc!r}")
            error.__cause__ = exc
            self.events.put(_StartFailed(index, error))
            return
        with self.lock:
            closing = self.closing
            if not closing:
                self.events.put(_Started(index, process))
        if closing:  # the launch ended while this agent was starting
            process.close()
            return
        self._spawn(
            lambda: self.events.put(_AgentEnded(index, process.wait(None), process)),
            f"torchrunx-wait-{hostname}",
        )

    def _on_agent_line(self, index: int, is_stderr: bool, text: str) -> None:
        line = parse_line(text, is_stderr=is_stderr, default_name="agent")
        self.logs.emit(index, None, None, line, time.time())
        self.logs.flush()

    def _srun_address(self, hostname: str) -> str:
        """The address an srun-started agent connects back to (no SSH socket to ask)."""
        configured = self.launcher.launcher_address or os.environ.get("TORCHRUNX_LAUNCHER_ADDR")
        if configured:
            return configured
        try:
            return route_address(hostname)
        except OSError as exc:
            raise AgentFailedError(
                hostname,
                f"cannot find this machine's address on the route to {hostname}: {exc}; "
                "set launcher_address (or TORCHRUNX_LAUNCHER_ADDR)",
            ) from exc

    def _bootstrap(self, index: int, local_address: str) -> bytes:
        state = self.agents[index]
        address = local_address
        if state.remote:
            address = (
                self.launcher.launcher_address
                or os.environ.get("TORCHRUNX_LAUNCHER_ADDR")
                or local_address
            )
        return AgentBootstrap(
            host_index=index,
            hostname=state.slots.hostname,
            launcher_address=address,
            launcher_port=self.port,
            secret=self.secret,
            workers=state.slots.workers,
            preload_torch=self.launcher.backend is not None,
            heartbeat_interval=_HEARTBEAT_INTERVAL,
            agent_timeout=float(self.launcher.agent_timeout),
            log_level=self.logs.level,
            sys_path=tuple(sys.path),
            count=_count_mode(self.launcher.workers_per_host),
        ).to_json_line()

    def _send_specs(self) -> None:
        hellos = [a.hello for a in self.agents]
        world_size = sum(h.slots for h in hellos if h is not None)
        # Decided once for every worker of every host: a group that mixes backends hangs.
        backend = resolve_backend(
            self.launcher.backend, [(h.slots, h.gpus) for h in hellos if h is not None]
        )
        master_addr, master_port = self._master_address()
        self.phase = "starting workers"
        offset = 0
        for index, state in enumerate(self.agents):
            assert state.hello is not None  # noqa: S101 (all hellos are in)
            assert state.conn is not None  # noqa: S101
            spec = WorkerSpec(
                host_index=index,
                hostname=state.slots.hostname,
                num_workers=state.hello.slots,
                rank_offset=offset,
                world_size=world_size,
                master_addr=master_addr,
                master_port=master_port,
                backend=backend,
                timeout=self.launcher.timeout,
                isolate_gpus=self.launcher.isolate_gpus,
                log_level=self.logs.level,
                attempt=self.attempt,
                max_restarts=self.launcher.max_restarts,
            )
            state.spec = spec
            if self.attempt == 0:
                self.logs.add_workers(index, spec.num_workers)
            self.ranks.extend(_RankState(index, r) for r in range(spec.num_workers))
            offset += spec.num_workers
            state.conn.send(spec, self.call)

    def _master_address(self) -> tuple[str, int]:
        """Rank 0 runs on host 0: its address as the other hosts can reach it, and its port."""
        first = self.agents[0]
        assert first.hello is not None  # noqa: S101 (all hellos are in)
        assert first.conn is not None  # noqa: S101
        if first.remote:
            address = str(first.conn.sock.getpeername()[0]).removeprefix("::ffff:")
        elif any(a.remote for a in self.agents):
            # Host 0 is this machine: use the address the remote agents reached us on.
            remote = next(a for a in self.agents if a.remote)
            assert remote.conn is not None  # noqa: S101
            address = str(remote.conn.sock.getsockname()[0]).removeprefix("::ffff:")
        else:
            address = "127.0.0.1"
        return address, first.free_port

    def _finished(self) -> bool:
        # With restarts left, agents whose workers ended stay (idle) until the end.
        agents_done = all(a.done or a.ended or a.idle for a in self.agents)
        return agents_done and all(r.result is not None for r in self.ranks)

    def _collect(self) -> tuple[tuple[Any, ...], ...]:
        per_host: list[list[Any]] = [[] for _ in self.agents]
        for rank, state in enumerate(self.ranks):
            assert state.result is not None  # noqa: S101 (checked by _finished)
            try:
                value = serialization.loads(state.result)
            except Exception as exc:
                raise SerializationError(
                    f"cannot unpickle the return value of rank {rank} in the launcher: {exc}; "
                    "is every module it needs importable here?"
                ) from exc
            state.result = None
            per_host[state.host_index].append(value)
        return tuple(tuple(values) for values in per_host)

    # -- event loop -----------------------------------------------------------------------

    def _wait(self, done: Callable[[], bool], deadline: float | None) -> None:
        next_tick = time.monotonic()
        while not done():
            now = time.monotonic()
            past_deadline = deadline is not None and now >= deadline
            # A collective error waiting for its cause stops at the deadline too: it happened.
            if not self.stopping and (
                self.failures.settled(now) or (past_deadline and self.failures.first is not None)
            ):
                self._settle_deaths_now()  # the wait for a collective error's cause is over
                raise _Abort
            if past_deadline:
                if self.stopping:
                    return
                raise self._timeout_error(now)
            if now >= next_tick:
                self._tick(now)
                next_tick = now + _HEARTBEAT_INTERVAL / 2
                continue
            wake = next_tick if deadline is None else min(next_tick, deadline)
            if self.failures.provisional_until is not None and not self.stopping:
                wake = min(wake, self.failures.provisional_until)
            wait = wake - now
            try:
                event = self.events.get(timeout=max(wait, 0.0))
            except queue.Empty:
                continue
            self._handle(event)

    def _tick(self, now: float) -> None:
        for state in self.agents:
            if state.conn is None or state.done or state.ended or state.lost:
                continue
            with contextlib.suppress(OSError):
                state.conn.send(Heartbeat())
            silent = now - state.last_heard
            # Until its workers run, an agent may be stalled importing torch (it holds the
            # GIL for seconds on a busy host): the start phase answers to start_timeout.
            limit = self.launcher.agent_timeout
            if not state.pids:
                limit = max(limit, self.launcher.start_timeout)
            if silent > limit and not self.stopping:
                state.lost = True
                self._fail(
                    AgentFailedError(
                        state.slots.hostname,
                        f"no heartbeat for {silent:.1f} s (agent_timeout="
                        f"{self.launcher.agent_timeout:g}, start_timeout="
                        f"{self.launcher.start_timeout:g} until workers start); the host is "
                        "unreachable, its link is cut, or the agent is frozen",
                    )
                )
        for state in self.agents:
            if state.end_settle_by is not None and now >= state.end_settle_by:
                self._agent_end_settled(state)
        for rank, rank_state in enumerate(self.ranks):
            if rank_state.settle_by is not None and now >= rank_state.settle_by:
                self._settle(rank)

    def _handle(self, event: _Event) -> None:
        if isinstance(event, _Started):
            self.agents[event.host_index].process = event.process
        elif isinstance(event, _StartFailed):
            self.agents[event.host_index].ended = True
            self.agents[event.host_index].failed = True
            self._fail(event.error)
        elif isinstance(event, _AgentEnded):
            if event.process is self.agents[event.host_index].process:  # not a replaced one
                self._on_agent_ended(event.host_index, event.status)
        elif isinstance(event, _Received):
            self._on_message(event.conn, event.message, event.payload, event.received_at)
        else:
            self._on_closed(event.conn)

    def _on_agent_ended(self, index: int, status: int | None) -> None:
        state = self.agents[index]
        state.exit_status = status
        if state.conn is not None and not state.conn_closed and not (state.done or self.stopping):
            # The news of its exit (a pidfd, SSH's exit status) can overtake the messages it
            # sent just before, AgentDone among them: its connection's end, after them, decides.
            state.end_settle_by = time.monotonic() + _AGENT_END_SETTLE_TIMEOUT
            return
        self._agent_end_settled(state)

    def _agent_end_settled(self, state: _AgentState) -> None:
        """Decide about an agent whose process ended: fine after AgentDone, else it failed."""
        state.end_settle_by = None
        status = state.exit_status
        state.ended = True
        state.failed = not state.done  # also while stopping: the health report shows it
        if state.done or self.stopping:
            return
        process = state.process
        tail = process.stderr_tail() if process is not None else ""
        if status == 127:
            reason = (
                f"the agent could not start (exit status 127): is {sys.executable} present "
                "on that host? torchrunx runs the launcher's interpreter on every host and "
                "assumes a shared filesystem"
            )
        elif status is not None and status < 0 and state.remote:
            reason = "the agent ended without an exit status (killed by a signal, or SSH dropped)"
        elif status is not None and status < 0:
            reason = f"the agent process ended with {describe_exit(None, -status)}"
        else:
            reason = f"the agent process ended unexpectedly (exit status {status})"
            if state.hello is None and self.launcher.env_file is not None:
                reason += (
                    f" before it connected; env_file {str(self.launcher.env_file)!r} is sourced "
                    "first: did it fail? (its output, if any, is below)"
                )
        self._fail(AgentFailedError(state.slots.hostname, reason, tail))

    def _on_message(
        self,
        conn: Connection,
        message: protocol.Message,
        payload: list[bytearray],
        received_at: float = 0.0,
    ) -> None:
        if isinstance(message, AgentHello):
            state = self.agents[message.host_index]
            state.conn, state.hello, state.last_heard = conn, message, time.monotonic()
            state.free_port = message.free_port
            state.started_after = state.last_heard - self.started
            self.sink.emit(
                AgentStarted(
                    message.host_index,
                    state.slots.hostname,
                    message.pid,
                    message.slots,
                    state.started_after,
                    gpus=message.gpus,
                )
            )
            if message.slots == 0:  # only workers_per_host="gpu" counts 0
                self._fail(
                    AgentFailedError(
                        state.slots.hostname,
                        "workers_per_host='gpu' but this host has no GPU (its agent looked at "
                        "CUDA_VISIBLE_DEVICES, the NVIDIA driver and nvidia-smi); give a number "
                        "of workers, or 'auto' (GPUs, else CPU cores)",
                    )
                )
            return
        if isinstance(message, WorkerHello):
            if message.attempt != self.attempt or message.rank >= len(self.ranks):
                conn.close()  # a worker of an earlier attempt, late: not part of this one
                return
            rank = self.ranks[message.rank]
            rank.conn, rank.pid = conn, message.pid
            self._set_state(message.rank, WorkerState.HEALTHY)
            return
        if isinstance(message, WorkerResult | WorkerException):
            rank_index = next((i for i, r in enumerate(self.ranks) if r.conn is conn), None)
            if rank_index is None:
                return  # from a worker of an earlier attempt
            if isinstance(message, WorkerResult):
                self.ranks[rank_index].result = payload
                self.ranks[rank_index].timing = message
                self.ranks[rank_index].received_at = received_at
                self._set_state(rank_index, WorkerState.SUCCEEDED)
            else:
                error = self._rebuild_exception(message, payload)
                self._worker_failed(rank_index, error)
                self._fail(error, collective=message.collective)
            return
        agent = next((a for a in self.agents if a.conn is conn), None)
        if agent is not None:
            self._on_agent_message(agent, message)

    def _on_agent_message(self, state: _AgentState, message: protocol.Message) -> None:
        state.last_heard = time.monotonic()
        if isinstance(message, WorkersStarted):
            state.pids = message.pids
            if state.spec is not None:
                offset = state.spec.rank_offset
                self.sink.emit(
                    WorkersStartedEvent(
                        state.spec.host_index,
                        state.slots.hostname,
                        self.attempt,
                        tuple(range(offset, offset + len(message.pids))),
                        message.pids,
                        backend=state.spec.backend,
                    )
                )
                for local_rank, pid in enumerate(message.pids):
                    if self.ranks[offset + local_rank].pid == 0:
                        self.ranks[offset + local_rank].pid = pid
        elif isinstance(message, WorkersEnded):
            if message.attempt == self.attempt:  # else a late reply about an earlier attempt
                state.free_port = message.free_port
                state.idle = True
        elif isinstance(message, WorkerTimedOut):
            self._on_worker_timed_out(state, message)
        elif isinstance(message, AgentDone):
            state.done = True
        else:
            self._on_worker_report(state, message)

    def _on_worker_report(self, state: _AgentState, message: protocol.Message) -> None:
        if isinstance(message, WorkerStacks):
            assert state.spec is not None  # noqa: S101 (stacks come from started workers)
            for local_rank, text in message.stacks.items():
                self.stacks[state.spec.rank_offset + local_rank] = text
        elif isinstance(message, LogLines):
            self._on_log_lines(state, message)
        elif isinstance(message, WorkerExited):
            self._on_worker_exited(state, message)

    def _on_worker_timed_out(self, agent: _AgentState, message: WorkerTimedOut) -> None:
        assert agent.spec is not None  # noqa: S101 (only started workers time out)
        rank = agent.spec.rank_offset + message.local_rank
        if rank >= len(self.ranks) or self.ranks[rank].state.is_final:
            return  # it ended (or the attempt did) before its report arrived
        error = WorkerTimeoutError(
            agent.slots.hostname, message.local_rank, rank, message.scope, message.limit
        )
        if message.stack.strip():
            _add_note(
                error,
                f"Python stack of rank {rank} when its limit passed:\n{message.stack.rstrip()}",
            )
        self.failed_rank[id(error)] = (error, self.ranks[rank])
        self._worker_failed(rank, error)
        self._fail(error)

    def _on_log_lines(self, agent: _AgentState, message: LogLines) -> None:
        assert agent.hello is not None  # noqa: S101 (lines come after the agent's hello)
        index = agent.hello.host_index
        offset = 0 if agent.spec is None else agent.spec.rank_offset  # agent records: no spec
        for local_rank, levelno, name, text, created in message.records:
            line = Line(levelno, name, text)
            rank = None if local_rank is None else offset + local_rank
            self.logs.emit(index, local_rank, rank, line, created)
        self.logs.flush()

    def _on_worker_exited(self, agent: _AgentState, message: WorkerExited) -> None:
        assert agent.spec is not None  # noqa: S101 (workers exist only after the spec)
        rank = agent.spec.rank_offset + message.local_rank
        state = self.ranks[rank]
        state.exited, state.pid = message, message.pid
        if state.conn is None:
            # Its hello may still be queued behind this report (another connection).
            state.settle_by = time.monotonic() + _UNCONNECTED_SETTLE_TIMEOUT
        elif not state.closed:
            # Its last bytes may still be in flight on its own connection.
            state.settle_by = time.monotonic() + _SETTLE_TIMEOUT
        else:
            self._settle(rank)

    def _on_closed(self, conn: Connection) -> None:
        for state in self.agents:
            if state.conn is conn:
                state.conn_closed = True
                if state.end_settle_by is not None:
                    self._agent_end_settled(state)
                    return
                if not (state.done or state.ended or self.stopping):
                    self._fail(
                        AgentFailedError(
                            state.slots.hostname,
                            "the connection to the agent closed unexpectedly (the agent process "
                            "died or was killed)",
                            state.process.stderr_tail() if state.process is not None else "",
                        )
                    )
                state.ended = state.ended or not state.done
                return
        for rank, rank_state in enumerate(self.ranks):
            if rank_state.conn is conn:
                rank_state.closed = True
                if rank_state.exited is not None:
                    self._settle(rank)
                return

    def _settle(self, rank: int) -> None:
        """Decide about a worker that exited: fine if it sent its outcome, else it failed."""
        state = self.ranks[rank]
        state.settle_by = None
        if state.result is not None or self.stopping or state.exited is None:
            return
        if state.state is WorkerState.FAILED:
            return  # it raised (or overran a watchdog) before it exited: already reported
        host = self.agents[state.host_index].slots.hostname
        exited = state.exited
        error = WorkerFailedError(
            host, state.local_rank, rank, exited.pid, exited.exitcode, exited.signal
        )
        self.failed_rank[id(error)] = (error, state)
        self._worker_failed(rank, error)
        self._fail(error)

    def _settle_deaths_now(self) -> None:
        """Decide now about workers killed by a signal or exited non-zero, still settling.

        Called when a collective error is about to be raised: a death whose connection has
        not closed yet (a forked child may hold it open) is the likelier cause, and a signal or
        an error status is a failure whatever may still be in flight.
        """
        if self.failures.provisional_until is None:
            return
        for rank, state in enumerate(self.ranks):
            exited = state.exited
            if state.settle_by is None or exited is None:
                continue
            if exited.signal is not None or exited.exitcode not in (0, None):
                self._settle(rank)

    def _add_output_tail(self, error: BaseException, state: _RankState) -> None:
        tail = self.logs.tail(state.host_index, state.local_rank)
        path = self.logs.log_file(state.host_index, state.local_rank)
        where = f" (full log: {path})" if path is not None else ""
        if tail:
            body = "\n".join("    " + line.replace("\n", "\n    ") for line in tail)
            _add_note(error, f"last {len(tail)} lines of its output{where}:\n{body}")
        elif path is not None:
            _add_note(error, f"it wrote no output{where}")

    def _rebuild_exception(
        self, message: WorkerException, payload: list[bytearray]
    ) -> BaseException:
        state = self.ranks[message.rank]
        host = self.agents[state.host_index].slots.hostname
        where = (
            f"worker rank {message.rank} (local rank {state.local_rank} on host {host!r}, "
            f"pid {state.pid})"
        )
        error: BaseException | None = None
        if message.unpicklable_result:
            error = SerializationError(f"{message.message} (in {where})")
        elif payload:
            with contextlib.suppress(Exception):
                loaded = serialization.loads(payload)
                error = loaded if isinstance(loaded, BaseException) else None
        if error is None:
            error = WorkerRaisedError(
                f"{message.type_name}: {message.message} (raised in {where}; the exception "
                "object could not be sent back, so its type is not kept)"
            )
            error.type_name = message.type_name
        error.__cause__ = RemoteTraceback(message.traceback)
        error.__suppress_context__ = True
        _add_note(error, f"raised in {where}")
        self.failed_rank[id(error)] = (error, state)
        return error

    def _fail(self, error: BaseException, *, collective: bool = False) -> None:
        if self.stopping:
            self.failures.others.append(_summary(error))
        else:
            self.failures.add(error, collective=collective)

    def _timeout_error(self, now: float) -> TorchrunxError:
        limit = self.launcher.launch_timeout
        if limit is not None and now >= self.started + limit:
            running = [r for r, s in enumerate(self.ranks) if s.result is None]
            return LaunchTimeoutError(
                f"launch_timeout={limit:g} s was hit: the launch was stopped after "
                f"{now - self.started:.1f} s with ranks {running or 'not yet started'} still "
                "running (their stacks are below, if they could be read)"
            )
        missing = next(a for a in self.agents if a.hello is None)
        address = self.launcher.launcher_address or os.environ.get("TORCHRUNX_LAUNCHER_ADDR")
        return AgentFailedError(
            missing.slots.hostname,
            "the agent did not connect back within "
            f"start_timeout={self.launcher.start_timeout:g} s; "
            f"can that host reach this machine on port {self.port}"
            + (f" at {address}" if address else "")
            + "? Set launcher_address / TORCHRUNX_LAUNCHER_ADDR to an address it can reach",
            missing.process.stderr_tail() if missing.process is not None else "",
        )

    def _error(self) -> BaseException:
        error = self.failures.first
        assert error is not None  # noqa: S101 (only called after a failure)
        behind = self._rank_behind(error)
        if behind is not None:
            self._add_output_tail(error, behind)
        others = _count_repeats(s for s in self.failures.others if s != _summary(error))
        if others:
            _add_note(error, f"other failures seen while stopping: {'; '.join(others)}")
        if self.history:
            earlier = "\n".join(f"  {line}" for line in self.history)
            _add_note(
                error,
                f"the workers were restarted {len(self.history)} time(s) "
                f"(max_restarts={self.launcher.max_restarts}); earlier failures:\n{earlier}",
            )
        if self.stacks:
            _add_note(error, self._stacks_note())
        return error

    def _stacks_note(self) -> str:
        lines = ["Python stacks of the workers that were still running when the launch stopped:"]
        for rank in sorted(self.stacks)[:_MAX_STACKS_SHOWN]:
            state = self.ranks[rank]
            host = self.agents[state.host_index].slots.hostname
            lines.append(f"--- rank {rank} (local rank {state.local_rank} on host {host!r}) ---")
            lines.append(self.stacks[rank].rstrip())
        if len(self.stacks) > _MAX_STACKS_SHOWN:
            lines.append(f"... and {len(self.stacks) - _MAX_STACKS_SHOWN} more workers")
        return "\n".join(lines)

    # -- stop and clean up ------------------------------------------------------------------

    def _stop_all(self) -> None:
        """Tell every agent to stop its workers and wait (bounded) until they did."""
        self.stopping = True
        first = self.failures.first
        if isinstance(first, SystemExit) and first.code == 128 + signal.SIGTERM:
            reason = "the launcher received SIGTERM"
        else:
            text = "" if first is None else exception_text(first)
            reason = (text.splitlines() or [type(first).__name__])[0]
        # Stacks tell where the survivors were stuck; after a Ctrl-C the user knows why.
        dump = not isinstance(first, KeyboardInterrupt | SystemExit)
        for state in self.agents:
            if state.conn is not None and not (state.done or state.ended):
                with contextlib.suppress(OSError):
                    state.conn.send(Stop(reason, _STOP_GRACE, dump_stacks=dump))
        deadline = time.monotonic() + _STOP_GRACE + 5.0
        self._wait(
            lambda: all(a.done or a.ended or a.lost or a.conn is None for a in self.agents),
            deadline,
        )
        self._drain_events()
        for rank in range(len(self.ranks)):
            self._set_state(rank, WorkerState.STOPPED)

    def close(self) -> None:
        """Release everything: agents, connections, the port, and helper threads."""
        with self.lock:
            self.closing = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        # Starts still under way end within their connect timeout and close what they made.
        self.start_pool.shutdown(wait=True, cancel_futures=True)
        while True:  # pick up agents whose start was still under way
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, _Started):
                self.agents[event.host_index].process = event.process
        processes = [(a.process, a.lost) for a in self.agents if a.process is not None]
        closers = [
            threading.Thread(target=process.close, args=(0.0 if lost else 5.0,))
            for process, lost in [*processes, *self.retired]
        ]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join()
        with self.lock:
            connections = list(self.connections)
        for conn in connections:
            conn.close()
        for thread in self.threads:
            thread.join(2.0)
        if self.health is not None:
            self.health.close()
        self.sink.close()
        self.logs.close()

    # -- helper threads -----------------------------------------------------------------------

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        with self.lock:
            self.threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self._spawn(functools.partial(self._serve, sock), "torchrunx-conn")

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(_HANDSHAKE_TIMEOUT)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            protocol.server_handshake(sock, self.secret)
        except (OSError, ProtocolError):
            sock.close()  # unauthenticated: dropped without reading anything more
            return
        sock.settimeout(None)
        conn = Connection(sock)
        with self.lock:
            if self.closing:
                conn.close()
                return
            self.connections.append(conn)
        while True:
            try:
                message, payload = conn.recv()
            except (OSError, ProtocolError):
                self.events.put(_Closed(conn))
                return
            self.events.put(_Received(conn, message, payload, time.time()))


class _Abort(Exception):  # noqa: N818 (internal control flow, never escapes)
    """Raised inside the event loop when a failure was recorded."""


@contextlib.contextmanager
def _sigterm_raises_system_exit() -> Iterator[None]:
    """During a launch, SIGTERM stops everything cleanly, then exits with status 143.

    Only where SIGTERM still has its default action (which would kill the launcher before it
    could stop its agents) and only in the main thread; the handler is restored afterwards.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def on_sigterm(signum: int, frame: object) -> None:
        del signum, frame
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _listen() -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("0.0.0.0", 0))  # noqa: S104 (agents on other hosts connect here)


def _count_repeats(lines: Iterable[str]) -> list[str]:
    """Each distinct line once, in first-seen order, with ``(xN)`` when it came N > 1 times."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return [line if n == 1 else f"{line} (x{n})" for line, n in counts.items()]


def _summary(error: BaseException) -> str:
    """``Type: first line of the message`` (just the type for an empty message)."""
    lines = exception_text(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: keep the note where 3.11+ would
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]
