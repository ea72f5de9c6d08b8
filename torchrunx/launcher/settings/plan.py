"""The plan of one launch: the settings resolved once, frozen, before anything starts.

:meth:`torchrunx.Launcher.plan` checks the fields, resolves the hosts and how each agent
starts, and reads the environment once (:mod:`~torchrunx.launcher.settings.environ`: forwarded
variables, ``TORCHRUNX_*``); the launch (:mod:`~torchrunx.launcher.launch.orchestrator`), its
inbox and its agent starts read only this plan, never the :class:`~torchrunx.Launcher` itself
nor ``os.environ``::

    Launcher (fields, as given) ──validate──▶ hosts, start methods, environment ──▶ LaunchPlan
        (frozen: hosts, reach, timeouts, resilience, observability, from_env)
        ──▶ Launch(plan, call) ──▶ AgentStarts(plan), Inbox(plan), LaunchState(plan's limits)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Literal

from torchrunx import plugins
from torchrunx.errors import SlurmError
from torchrunx.launcher.settings.resolve import (
    HostsSource,
    in_slurm_allocation,
    local_hosts,
    slurm_allocation,
)
from torchrunx.wire.bootstrap import AgentTimings
from torchrunx.wire.messages import HEARTBEAT_INTERVAL
from torchrunx.wire.relay import MODES as RELAY_MODES

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from torchrunx.events import EventHandler
    from torchrunx.hosts import HostSlots
    from torchrunx.launcher.settings.environ import LauncherEnviron
    from torchrunx.logs import ConsoleRanks, LogHandlers

StartMethod = str
"""How one host's agent starts: a transport's name (``"local"``, ``"ssh"``, ``"srun"``,
``"ray"``, ``"kubectl"`` or a plugin's, see :mod:`torchrunx.engines`)."""

Backend = Literal["nccl", "gloo", "mpi", "ucc", "auto"] | None
StallAction = Literal["report", "fail", "restart"]
"""``Launcher.on_stall`` (:mod:`torchrunx.launcher.launch.stalls`)."""


LAUNCHER_GROUPS: dict[str, tuple[str, ...]] = {
    "hosts": ("hostnames", "workers_per_host", "agent_start", "spare_hosts"),
    "workers": ("backend", "isolate_gpus"),
    "reach": (
        *("ssh_config_file", "default_env_vars", "copy_env_vars", "extra_env_vars", "env_file"),
        *("launcher_address", "relay", "tree_radix", "python", "ship", "ship_exclude"),
        "container",
    ),
    "timeouts": ("timeout", "agent_timeout", "start_timeout", "launch_timeout"),
    "resilience": (
        *("max_restarts", "restart_on", "min_hosts", "preemption_grace"),
        "requeue_on_preemption",
    ),
    "observability": (
        *("stall_timeout", "on_stall", "straggler_threshold", "health_check_port"),
        *("console_ranks", "event_handlers", "log_handlers"),
    ),
}
"""``Launcher``'s fields by group: the plan's groups (``workers``: the plan's own fields). Its
docstring, the ``torchrunx`` command's ``--help`` and the API page show them."""


@dataclass(frozen=True)
class PlanHosts:
    """Where a launch runs: its hosts, how each agent starts, the spares."""

    slots: tuple[HostSlots, ...]
    """The hosts and their workers, in launch order (the spares last)."""
    methods: tuple[StartMethod, ...]
    """How each host's agent starts (:func:`start_methods`)."""
    source: HostsSource
    """What the ``hostnames`` field named (a list, ``"auto"``, a provider, a hostfile): classified
    once, by :func:`~torchrunx.launcher.settings.resolve.hostnames_source`."""
    transport_argument: str | None
    """The argument of the launch's transport (``"namespace=ml"`` of ``"kubectl:namespace=ml"``)."""
    workers_per_host: object
    """As given: how an agent counts its workers where the plan does not say."""
    spares: int
    """The last ``spares`` of ``slots`` are spare hosts (:mod:`torchrunx.launcher.state.spares`)."""

    @property
    def world_hosts(self) -> int:
        """How many of ``slots`` run the first attempt (the others are spares)."""
        return len(self.slots) - self.spares

    @property
    def hostnames(self) -> tuple[str, ...]:
        """The hosts' names, in launch order."""
        return tuple(h.hostname for h in self.slots)


@dataclass(frozen=True)
class Reach:
    """How the agents are reached and what they start with: variables, files, interpreters."""

    env: Mapping[str, str] = field(repr=False)
    """The variables every agent exports (forwarded patterns and given values): never in a
    repr, since values may be secrets."""
    env_file: str | Path | None
    """The file sourced on every host first, as given (resolved when the agents start)."""
    launcher_address: str | None
    """The ``launcher_address`` field (``TORCHRUNX_LAUNCHER_ADDR``: in the plan's ``from_env``)."""
    relay: str
    """Whether remote agents relay their connections (:mod:`torchrunx.engines.relay`); "on"
    with a tree start."""
    tree_radix: int | None
    """Tree start (:mod:`torchrunx.launcher.starts.tree`): the launcher starts at most this many
    agents, each of them its children over SSH; None: the launcher starts every agent."""
    python: str | Mapping[str, str] | None
    """The remote hosts' interpreter, or each one's (:mod:`torchrunx.launcher.settings.reach`)."""
    ship: tuple[str, ...]
    """Paths shipped to the remote hosts (:mod:`torchrunx.engines.ship`)."""
    ship_exclude: tuple[str, ...]
    container: tuple[str, ...]
    """The command (an argument vector) that runs remote agents in a container."""
    ssh_config_file: str | Path | None


@dataclass(frozen=True)
class Timeouts:
    """The launch's timeouts, in seconds (``Launcher`` holds their one default)."""

    process_group: float
    """``timeout``: the process group's, for collectives and its set-up."""
    agent: float
    """``agent_timeout``: the silence after which a host counts as lost."""
    start: float
    """``start_timeout``: for every agent to start and connect back."""
    launch: float | None
    """``launch_timeout``: the whole launch's (None: no limit)."""

    @cached_property
    def agent_timings(self) -> AgentTimings:
        """The host side's timings, from ``agent`` (:func:`agent_timings`), made once."""
        return agent_timings(self.agent)


@dataclass(frozen=True)
class Resilience:
    """What a failure or a preemption leads to: restarts, quarantines, a grace."""

    max_restarts: int
    restart_on: tuple[str, ...]
    min_hosts: int | None
    """The fewest hosts a restart may go on with (None: never fewer)."""
    preemption_grace: float
    """Seconds the ranks get to save and return after a SIGTERM (0: it stops at once)."""
    requeue: bool
    """Requeue the SLURM job after a preemption."""


@dataclass(frozen=True)
class Observability:
    """What the launch shows and serves: logs, events, the health endpoint, hang detection."""

    stall_timeout: float | None
    """Stall detection's timeout in seconds (None: off; :mod:`torchrunx.launcher.launch.stalls`)."""
    on_stall: StallAction
    straggler_threshold: float | None
    """Straggler detection's lateness in seconds (None: off;
    :mod:`torchrunx.launcher.launch.stragglers`)."""
    health_port: int | None
    """The health endpoint's port (field, else ``TORCHRUNX_HEALTH_CHECK_PORT``); None: none."""
    event_handlers: tuple[EventHandler, ...]
    log_handlers: LogHandlers
    console_ranks: ConsoleRanks
    """The workers the default console shows: global ranks, or ``"all"``."""


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch (or a set of warm agents) runs with; made by ``Launcher.plan()``.

    Grouped as the docs group ``Launcher``'s fields; every value is given (the ``Launcher``
    holds each setting's one default), and ``from_env`` holds what the environment says.
    """

    hosts: PlanHosts
    reach: Reach
    timeouts: Timeouts
    resilience: Resilience
    observability: Observability
    from_env: LauncherEnviron
    """What the launcher's environment variables say, read once
    (:func:`~torchrunx.launcher.settings.environ.read_environ`): the launch's parts take them
    from here, never from ``os.environ``."""
    backend: Backend
    isolate_gpus: bool
    warm: bool
    """Warm agents: they stay after each run for the next (see :mod:`torchrunx.launcher.warm`)."""
    keep_workers: bool
    """Warm agents whose workers stay from run to run too."""

    @property
    def quarantines(self) -> bool:
        """Whether a failed host is quarantined (replaced by a spare, or dropped), not restarted."""
        return self.hosts.spares > 0 or self.resilience.min_hosts is not None


STOP_SLACK = 3.0
"""Seconds the guardian's grace adds for the agent to stop its workers (their SIGTERM's grace
period, the agent's ``_DEFAULT_GRACE``) once it has noticed the launcher gone."""


def agent_timings(
    agent_timeout: float, heartbeat_interval: float = HEARTBEAT_INTERVAL
) -> AgentTimings:
    """What the agent and its workers wait for, derived from ``agent_timeout`` here only.

    They travel in the bootstrap by name (:class:`~torchrunx.wire.bootstrap.AgentTimings`):
    the host side reads them and derives none.

    - heartbeats every ``heartbeat_interval`` s (the launcher's own interval, by default);
    - the launcher is gone after ``agent_timeout`` s of silence; the agent's last messages get
      as long to reach it;
    - a connection to the launcher (the agent's, a worker's) gets twice as long, handshake
      included;
    - the guardian kills an agent that has not ended ``2 * agent_timeout + 3`` s after its stdin
      closed: time to notice the silence, deliver its last messages, and stop its workers.
    """
    return AgentTimings(
        heartbeat_interval=heartbeat_interval,
        launcher_silence=agent_timeout,
        connect_timeout=2 * agent_timeout,
        finish_timeout=agent_timeout,
        guardian_grace=2 * agent_timeout + STOP_SLACK,
    )


def check_agent_start(agent_start: object) -> None:
    """Refuse an ``agent_start`` that names no transport, or an argument its transport refuses.

    Raises:
        TypeError: Not a string.
        ValueError: No transport has that name, or it refuses the argument.
    """
    if not isinstance(agent_start, str):
        raise TypeError(f"agent_start must be a string such as 'ssh', got {agent_start!r}")
    if agent_start == "auto":
        return
    name, argument = plugins.transport_spec(agent_start)
    known = plugins.transport_names()
    if name not in known:
        raise ValueError(
            f"agent_start={agent_start!r}: no transport named {name!r} (known: "
            f"{', '.join(['auto', *known])}; a package adds one under the entry point group "
            f"{plugins.TRANSPORTS_GROUP!r}: see the Engines page of torchrunx's documentation)"
        )
    plugins.transport(name, argument).close()  # it checks its argument, starts nothing


def check_relay(relay: object) -> None:
    """Refuse a ``relay`` other than "off", "auto" and "on".

    Raises:
        ValueError: Any other value.
    """
    if relay not in RELAY_MODES:
        raise ValueError(
            f'relay={relay!r}: expected one of {", ".join(map(repr, RELAY_MODES))} ("auto" '
            "relays only for hosts that cannot open a connection to the launcher)"
        )


def check_tree_radix(radix: object) -> None:
    """Refuse a ``tree_radix`` that is neither None nor a positive integer.

    Raises:
        ValueError: Any other value.
    """
    if radix is not None and (isinstance(radix, bool) or not isinstance(radix, int) or radix < 1):
        raise ValueError(
            f"tree_radix={radix!r}: expected None (the launcher starts every agent) or a "
            "positive integer (it starts that many, and each of them starts as many more)"
        )


def check_tree(radix: int | None, methods: list[StartMethod], spares: int, **more: object) -> None:
    """Refuse a tree start (``radix``) that this version cannot run: what it needs, said.

    ``methods``: every host's, the ``spares`` last (the launcher starts those itself). ``more``:
    the fields a tree start cannot use yet (``python``, ``ship``, ``container``).

    Raises:
        ValueError: A host is not started over SSH, the tree is deeper than 2, or one of
            ``more`` is set.
    """
    if radix is None:
        return
    if any(method != "ssh" for method in methods):
        raise ValueError(
            f"tree_radix={radix}: every host must be started over SSH (agent_start='ssh'), "
            f"got {sorted(set(methods))}; launch without tree_radix"
        )
    world = len(methods) - spares
    if world > radix + radix * radix:
        raise ValueError(
            f"tree_radix={radix}: {world} hosts need a tree of depth 3 or more, which "
            f"is not built yet (at most {radix + radix * radix} hosts); give a larger radix"
        )
    for name, value in more.items():
        if value:
            raise ValueError(f"tree_radix={radix}: {name} is not supported yet with a tree")


def check_event_handlers(handlers: object) -> None:
    """Refuse ``event_handlers`` that are not functions or objects with ``record(event)``.

    Raises:
        TypeError: Anything else.
    """
    if not isinstance(handlers, list | tuple) or not all(
        callable(h) or callable(getattr(h, "record", None)) for h in handlers
    ):
        raise TypeError(
            "event_handlers must be a tuple of functions or of objects with a record(event) "
            f"method, got {handlers!r}"
        )


def paired_transport(source: HostsSource) -> str | None:
    """The transport the host provider of ``source`` names, if it names one (Ray's: ray)."""
    if source.provider is None:
        return None
    return plugins.provider_transport(*source.provider)


def start_methods(
    agent_start: str,
    hostnames: list[str],
    paired: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[StartMethod], str | None]:
    """How each host's agent starts (a transport per host), and the transport's argument.

    ``agent_start`` is ``"auto"`` or a transport, optionally with an argument
    (``"kubectl:namespace=ml"``). ``"auto"`` takes ``paired``, the transport the host provider
    names (Ray's nodes start through Ray), if any; else srun when this process runs in a SLURM
    allocation, ``srun`` is installed and every remote host is a node of the allocation;
    otherwise ssh. With ssh and srun, a host that is this machine gets a plain subprocess
    (``"local"``); any other transport starts every host's agent. ``environ``: where SLURM's
    variables are read (the plan's; None: this process's, for a call outside a launch).

    Raises:
        SlurmError: ``"srun"`` outside an allocation, without ``srun``, or for a host that is
            not a node of the allocation.
    """
    spec = paired if agent_start == "auto" and paired else agent_start
    name, sep, argument = spec.partition(":")
    if name not in ("auto", "ssh", "srun"):
        return [name] * len(hostnames), (argument if sep else None)
    local = local_hosts(hostnames)
    remote = [host for host, here in zip(hostnames, local, strict=True) if not here]
    method: StartMethod = "ssh"
    if name == "srun":
        allocation = slurm_allocation(environ, what="agent_start='srun'")
        if shutil.which("srun") is None:
            raise SlurmError("agent_start='srun' but srun is not installed on this machine")
        outside = [host for host in remote if host not in allocation.nodes]
        if outside:
            raise SlurmError(
                f"agent_start='srun' but {outside} are not nodes of SLURM job "
                f"{allocation.job_id} ({list(allocation.nodes)}); use agent_start='ssh'"
            )
        method = "srun"
    elif name == "auto" and remote and in_slurm_allocation(environ) and shutil.which("srun"):
        nodes = set(slurm_allocation(environ).nodes)
        if all(host in nodes for host in remote):
            method = "srun"
    return ["local" if here else method for here in local], None
