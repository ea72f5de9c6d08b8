"""How the agent of one host is started: its script, its bootstrap line, and the transport.

The launcher's start threads (:mod:`torchrunx.launcher.starts.agent_pool`) call :class:`AgentStarts`
with a host index; it hands the start to the host's transport (:mod:`torchrunx.engines`: a local
subprocess, SSH, ``srun``, Ray, ``kubectl`` or a plugin's), made once per launch, and builds the one
JSON line the agent reads first (:class:`AgentBootstrap`), including the address the agent calls
back on; and where the launcher listens for them (:func:`listen_socket`): only where they connect,
when that is known before they start.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torchrunx import plugins
from torchrunx.engines import AgentStart
from torchrunx.engines.command import agent_script
from torchrunx.env import local_agent_env
from torchrunx.errors import AgentFailedError, add_note
from torchrunx.launcher.net import listener as listener_module
from torchrunx.launcher.settings.environ import ADDRESS_ENV_VAR, LISTEN_ENV_VAR, PORT_ENV_VAR
from torchrunx.launcher.settings.reach import (
    default_python,
    host_sys_path,
    package_root,
    python_for,
)
from torchrunx.launcher.starts.tree import Tree
from torchrunx.wire.bootstrap import BOOT_CODE, RELAY_BOOT_CODE, AgentBootstrap, TreeChild
from torchrunx.wire.lines import parse_line

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Mapping, Sequence

    from torchrunx.engines import Transport
    from torchrunx.engines.protocol import AgentProcess
    from torchrunx.engines.relay import Adopt
    from torchrunx.engines.ship import Bundle
    from torchrunx.launcher.settings.plan import LaunchPlan, StartMethod
    from torchrunx.launcher.state.records import AgentRecord
    from torchrunx.wire.lines import Record

logger = logging.getLogger("torchrunx.agent_starts")


@dataclass
class AgentStarts:
    """Starts the agents of one launch; called with a host index, from a start thread."""

    plan: LaunchPlan
    agents: list[AgentRecord]
    """The launch state's agents (a replaced agent's new record shows up here)."""
    port: int
    secret: bytes = field(repr=False)
    log_level: int
    emit: Callable[[int, Record], None]
    """Where an agent's own stdout and stderr lines go: ``(host index, log record)``."""
    script: bytes = field(default=b"", repr=False)
    """The agents' script (forwarded variables' values): never in a repr."""
    transports: dict[str, Transport] = field(default_factory=dict, repr=False)
    """The launch's transports by name, made on first use (:meth:`transport`)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    adopt: Adopt | None = field(default=None, repr=False)
    """Hands a relayed connection to the launch's listener (from any thread); None: none relay."""
    relay_script: bytes = field(default=b"", repr=False)
    """The script of a relaying host: the same, but its interpreter runs the relay first."""
    bundle: Bundle | None = field(default=None, repr=False)
    """The code shipped to the remote hosts (``Launcher(ship=...)``), read by :meth:`prepare`."""
    _scripts: dict[tuple[str, bool], bytes] = field(default_factory=dict, repr=False)
    tree: Tree | None = field(default=None, repr=False)
    """Tree start (``plan.reach.tree_radix``): the hosts other hosts start (:meth:`prepare`)."""
    boot_code: ClassVar[str] = BOOT_CODE
    """What the agent's interpreter runs (``torchrunx check``'s probes run their own)."""

    def prepare(self) -> None:
        """Build the script every agent runs first (the forwarded variables, ``env_file``).

        The launch's transports are made here too (they connect to nothing yet), so that
        :meth:`close` releases what a provider opened for them even if no agent starts.

        Raises:
            ValueError, RuntimeError: A transport cannot be made (see :func:`open_transport`).
        """
        for method in dict.fromkeys(self.plan.hosts.methods):
            self.transport(method)
        self._refuse_unable_transports()
        if self.plan.reach.ship and any(agent.remote for agent in self.agents):
            from torchrunx.engines.ship import make_bundle  # noqa: PLC0415 (only when shipping)

            self.bundle = make_bundle(
                self.plan.reach.ship, self.plan.reach.ship_exclude, timeout=self.plan.timeouts.start
            )
            logger.info(
                "shipping %d files (%.1f MB) to the remote hosts, as tree %s",
                len(self.bundle.files),
                self.bundle.size / 1e6,
                self.bundle.digest,
            )
        self.script = self._script(sys.executable, remote=False, code=self.boot_code)
        if self.plan.reach.relay != "off" and self.adopt is not None:
            self.relay_script = self._script(sys.executable, remote=False, code=RELAY_BOOT_CODE)
        if self.plan.reach.tree_radix is not None:  # checked by the plan (check_tree)
            # The world's hosts only: the launcher starts the spares itself, as interior hosts.
            world = self.agents[: self.plan.hosts.world_hosts]
            self.tree = Tree(self.plan.reach.tree_radix, [a.slots.hostname for a in world])

    def _refuse_unable_transports(self) -> None:
        """Refuse ``relay="on"`` or ``ship`` where a remote host's transport cannot do it."""
        for method, transport in self.transports.items():
            if not transport.remote:
                if self.plan.reach.container:
                    msg = (
                        "container runs remote hosts' agents in a container; this machine's "
                        "run here: leave it out of hostnames, or reach it over ssh by a name "
                        "that is not this machine's"
                    )
                    raise ValueError(msg)
                continue
            if self.plan.reach.relay == "on" and not transport.relays:
                msg = (
                    f"relay='on': agents started with {method!r} cannot relay connections "
                    "(ssh, srun and kubectl can); use relay='auto', which connects them "
                    "back directly, or another agent_start"
                )
                raise ValueError(msg)
            if self.plan.reach.container and not transport.containers:
                msg = (
                    f"container: agents started with {method!r} cannot run in a container "
                    "(ssh and srun can; kubectl's are in their pod's container already)"
                )
                raise ValueError(msg)
            options = bool(self.plan.reach.container) and self.plan.reach.container[0].startswith(
                "-"
            )
            if options and not transport.container_options:
                msg = (
                    f"container {shlex.join(self.plan.reach.container)!r} is options of srun "
                    f"(pyxis's --container-image), but agents started with {method!r} "
                    "need a command that runs one in a container, such as "
                    "'podman exec -i NAME'"
                )
                raise ValueError(msg)
            if self.plan.reach.ship and not transport.ships:
                msg = (
                    f"ship: agents started with {method!r} cannot fetch shipped code (ssh, "
                    "srun and kubectl can); give the hosts the code another way (Ray: its "
                    "runtime_env working_dir), or use another agent_start"
                )
                raise ValueError(msg)

    def _script(self, python: str, *, remote: bool, code: str) -> bytes:
        """The script of an agent run by ``python``; ``remote``: on another host (it may ship)."""
        bundle = self.bundle if remote else None
        env_file = self.plan.reach.env_file
        if env_file is not None:
            env_file = str(Path(env_file).expanduser().resolve())
            if bundle is not None:  # inside a shipped path: the copy's, else as it is
                env_file = bundle.place(env_file) or env_file
        return agent_script(
            env=dict(self.plan.reach.env),
            cwd=str(Path.cwd()),
            python=python,
            env_file=env_file,
            code=code,
            ship=None if bundle is None else bundle.digest,
        )

    def script_for(self, agent: AgentRecord, *, relays: bool) -> bytes:
        """The script of ``agent``'s host: its interpreter, shipped code, relay or not."""
        hostname = agent.slots.hostname
        python = (
            default_python(
                self.plan.reach.python, hostname, self.plan.reach.container, agent.method
            )
            if agent.remote
            else None
        )
        if python is None and (self.bundle is None or not agent.remote):
            return self.relay_script if relays else self.script
        python = python or sys.executable
        with self._lock:
            key = (python, relays)
            if key not in self._scripts:
                code = RELAY_BOOT_CODE if relays else self.boot_code
                self._scripts[key] = self._script(python, remote=True, code=code)
            return self._scripts[key]

    def python_of(self, agent: AgentRecord) -> str:
        """The interpreter ``agent``'s host runs: ``python=``'s, a container's, else ours."""
        if not agent.remote:
            return sys.executable
        chosen = default_python(
            self.plan.reach.python, agent.slots.hostname, self.plan.reach.container, agent.method
        )
        return chosen or sys.executable

    def keeps_path(self, agent: AgentRecord) -> bool:
        """Whether ``agent``'s host runs its own interpreter or shipped code (its own sys.path)."""
        hostname = agent.slots.hostname
        return agent.remote and (
            self.bundle is not None
            or default_python(
                self.plan.reach.python, hostname, self.plan.reach.container, agent.method
            )
            is not None
        )

    def __call__(self, index: int) -> AgentProcess:
        """Start the agent of host ``index`` with its transport.

        Raises:
            AgentFailedError: It cannot be started (SSH, ``srun``, Ray or ``fork`` failed).
        """
        agent = self.agents[index]

        def on_line(is_stderr: bool, text: str) -> None:
            line = parse_line(text, is_stderr=is_stderr, default_name="agent")
            self.emit(index, (None, line.levelno, line.name, line.text, time.time()))

        if self.tree is not None and self.tree.is_child(index):  # its interior host starts it
            return self.tree.child(index, on_line)
        transport = self.transport(agent.method)
        relays = bool(self.relay_script) and agent.remote and transport.relays
        try:
            started = self._start(transport, agent, on_line, relays=relays)
        except AgentFailedError as exc:
            named = python_for(self.plan.reach.python, agent.slots.hostname, agent.method)
            if named is None or "(exit status 127)" not in exc.reason or not agent.remote:
                raise
            reason = (  # the interpreter python= names is the likely missing command
                "the agent could not start (exit status 127): a command it needs is missing on "
                f"that host (its message is below); it ran {named}, the interpreter "
                "Launcher(python=...) names for it: check that path on that host"
            )
            raise AgentFailedError(exc.hostname, reason, exc.stderr) from exc
        if self.bundle is not None and agent.remote:
            sent = self.bundle.sent.get(agent.slots.hostname, 0)
            logger.info(
                "host %s: shipped code %s (%d bytes sent)",
                agent.slots.hostname,
                self.bundle.digest,
                sent,
            )
        return started

    def _start(
        self,
        transport: Transport,
        agent: AgentRecord,
        on_line: Callable[[bool, str], None],
        *,
        relays: bool,
    ) -> AgentProcess:
        """Hand ``agent``'s start to ``transport``."""
        return transport.start(
            AgentStart(
                index=agent.index,
                hostname=agent.slots.hostname,
                script=self.script_for(agent, relays=relays),
                bootstrap=lambda address: self.bootstrap(agent, address, relays=relays),
                on_line=on_line,
                launcher_address=self.configured_address(),
                connect_timeout=min(self.plan.timeouts.start, 30.0),
                ssh_config_file=self.plan.reach.ssh_config_file,
                environ=self.local_env,
                hostnames=tuple(a.slots.hostname for a in self.agents if a.method == agent.method),
                relay=self.adopt if relays else None,
                ship=self.bundle if agent.remote else None,
                container=self.plan.reach.container if agent.remote else (),
                on_tree=self.tree.on_tree(agent.index) if self.tree is not None else None,
            )
        )

    def transport(self, method: str) -> Transport:
        """The launch's transport named ``method``, made on first use (from any start thread)."""
        with self._lock:
            made = self.transports.get(method)
            if made is None:
                made = self.transports[method] = open_transport(self.plan, method)
            return made

    def close(self) -> None:
        """Close the transports (once every agent has closed): what they hold for the launch."""
        with self._lock:
            made, self.transports = list(self.transports.values()), {}
        for transport in made:
            try:
                transport.close()
            except Exception:  # noqa: PERF203 (each transport closes, whatever the others do)
                logger.warning("closing the %s transport failed", transport.name, exc_info=True)

    @functools.cached_property
    def local_env(self) -> dict[str, str]:
        """This machine's agents start with the launcher's environment (the plan's)."""
        return local_agent_env(self.plan.from_env.environ)

    def configured_address(self) -> str | None:
        """The launcher address the user set (field, else environment), if any."""
        return configured_address(self.plan.reach.launcher_address, self.plan.from_env.environ)

    def bootstrap(self, agent: AgentRecord, local_address: str, *, relays: bool = False) -> bytes:
        """The agent's bootstrap line; ``local_address``: this machine's, as the host sees it.

        ``relays``: for the host's relay, which reads the launch's relay mode in it
        (:attr:`AgentBootstrap.relay`) and hands the agent the line without it.
        """
        return self._bootstrap(agent, local_address, self.plan.reach.relay if relays else "")

    def _bootstrap(self, agent: AgentRecord, local_address: str, relay: str) -> bytes:
        address = (self.configured_address() or local_address) if agent.remote else local_address
        keep_path = self.keeps_path(agent)
        return AgentBootstrap(
            host_index=agent.index,
            hostname=agent.slots.hostname,
            launcher_address=address,
            launcher_port=self.port,
            secret=self.secret,
            workers=agent.slots.workers,
            preload_torch=self.plan.backend is not None,
            preload=self.plan.from_env.preload,
            timings=self.plan.timeouts.agent_timings,
            log_level=self.log_level,
            sys_path=host_sys_path(self.bundle) if keep_path else tuple(sys.path),
            keep_path=keep_path,
            count=count_mode(self.plan.hosts.workers_per_host),
            warm=self.plan.warm,
            local_only=all(not a.remote for a in self.agents),
            package_root=package_root(self.bundle if agent.remote else None),
            relay=relay,
            **self._tree_fields(agent),
        ).to_json_line()

    def _tree_fields(self, agent: AgentRecord) -> dict[str, Any]:
        """The bootstrap fields of an interior host of a tree start: its children, their script."""
        if self.tree is None:
            return {}
        children = [self.agents[index] for index in self.tree.children(agent.index)]
        if not children:
            return {}
        config = self.plan.reach.ssh_config_file
        return {
            "tree": tuple(
                TreeChild(child.index, child.slots.hostname, child.slots.workers)
                for child in children
            ),
            "tree_script": self.script.rstrip(b"\0").decode(errors="surrogateescape"),
            "tree_ssh_config": "" if config is None else str(Path(config).expanduser().resolve()),
        }


def configured_address(launcher_address: str | None, environ: Mapping[str, str]) -> str | None:
    """The launcher address the user set: ``launcher_address``, else ``TORCHRUNX_LAUNCHER_ADDR``.

    ``environ``: the launcher's environment, the plan's.
    """
    return launcher_address or environ.get(ADDRESS_ENV_VAR) or None


def listen_hosts(
    launcher_address: str | None,
    methods: Sequence[StartMethod],
    environ: Mapping[str, str],
    relay: str = "off",
) -> list[str | None]:
    """Where the launcher may listen for agents and workers, best first (``None``: everywhere).

    - ``TORCHRUNX_LISTEN_ADDR`` when set, and nothing else (``*``: every interface);
    - every host is this machine, or ``relay="on"`` (every other host's connections come over
      its agent's channel): ``127.0.0.1``, the address this machine's agents are given;
    - every host is another one and the address they are given (``launcher_address``, else
      ``TORCHRUNX_LAUNCHER_ADDR``) is an IP address: that one, then every interface, for an
      address that is not this machine's (behind NAT, say);
    - else every interface: an SSH agent connects back to the address its connection came
      from, an ``srun`` agent to the one on the route to its node, which are known only once
      they start, and a name may resolve to other addresses on the hosts than here.
    """
    override = environ.get(LISTEN_ENV_VAR, "").strip()
    if override:
        return [None if override == "*" else override]
    if relay == "on" or all(method == "local" for method in methods):
        return ["127.0.0.1"]
    address = configured_address(launcher_address, environ)
    if address is not None and "local" not in methods and _is_ip(address):
        return [address, None]
    return [None]


def listen_socket(plan: LaunchPlan) -> socket.socket:
    """The launch's listening socket, on the first of :func:`listen_hosts` that can be bound.

    Raises:
        OSError: It cannot be bound (``TORCHRUNX_LISTEN_ADDR`` is not this machine's, say).
    """
    environ = plan.from_env.environ
    first, *fallback = listen_hosts(
        plan.reach.launcher_address, plan.hosts.methods, environ, plan.reach.relay
    )
    ports = plan.from_env.launcher_ports
    try:
        return _bind(first, fallback, ports, environ.get(LISTEN_ENV_VAR, "").strip())
    except OSError as exc:
        if ports != (0,) and exc.errno == errno.EADDRINUSE:
            add_note(
                exc,
                f"{PORT_ENV_VAR}={plan.from_env.port_text!r}: every port of it is in use "
                "(another launch on this machine?); give a wider range",
            )
        raise


def _bind(
    first: str | None, fallback: list[str | None], ports: tuple[int, ...], where: str
) -> socket.socket:
    """Listen on ``first``, else (not for want of a free port) on the fallback.

    ``where``: ``TORCHRUNX_LISTEN_ADDR``'s value, for a note (empty: unset).
    """
    try:
        return listener_module.listen_socket(first, ports)
    except OSError as exc:
        if fallback and exc.errno != errno.EADDRINUSE:
            logger.debug("cannot listen on %s only (%s); listening on every interface", first, exc)
            return listener_module.listen_socket(fallback[0], ports)
        if where:
            add_note(exc, f"{LISTEN_ENV_VAR}={where!r}: where to listen")
        raise


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def open_transport(plan: LaunchPlan, method: str) -> Transport:
    """A new transport named ``method`` for a launch of ``plan`` (its argument from the plan).

    Raises:
        ValueError: No transport has that name, or it refuses the plan's argument.
        RuntimeError: The transport's package failed to import.
    """
    argument = None if method == "local" else plan.hosts.transport_argument
    made: Transport = plugins.transport(
        method, argument, ssh_config_file=plan.reach.ssh_config_file
    )
    return made


def count_mode(workers_per_host: object) -> str:
    """How an agent counts its workers when none is given: ``"gpu"``, ``"cpu"`` or ``"auto"``."""
    return workers_per_host if isinstance(workers_per_host, str) else "auto"
