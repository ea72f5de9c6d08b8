"""torchrunx's own transports: ``local``, ``ssh`` and ``srun`` (see :mod:`torchrunx.engines`).

Each is a thin, stateless front for its agent processes: a local child
(:class:`~torchrunx.engines.command.LocalAgent`), an SSH connection
(:class:`~torchrunx.engines.ssh.SshAgent`, or OpenSSH's ``ssh`` as a
:class:`~torchrunx.engines.command.CommandAgent`), or a SLURM job step (:class:`SrunAgent`,
here); they are registered as entry points like any plugin's.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
from typing import TYPE_CHECKING, ClassVar

from torchrunx.engines.command import (
    AGENT_ARGV,
    CommandAgent,
    LocalAgent,
    remote_command,
    route_address,
)
from torchrunx.engines.protocol import Transport
from torchrunx.engines.ssh import SshAgent, resolve_ssh_target
from torchrunx.errors import AgentFailedError
from torchrunx.hosts.hostlists import slurm_allocation
from torchrunx.wire.bootstrap import AGENT_COMMAND

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from torchrunx.engines.protocol import AgentProcess, AgentStart, OnLine
    from torchrunx.engines.relay import Adopt
    from torchrunx.engines.ship import Bundle


def no_argument(name: str, argument: str | None) -> None:
    """Refuse an argument for a transport that takes none.

    Raises:
        ValueError: ``argument`` is set.
    """
    if argument is not None:
        raise ValueError(f"agent_start={name}:{argument!r}: the {name} transport takes no argument")


class LocalTransport(Transport):
    """An agent on this machine: a plain subprocess in its own session."""

    name = "local"
    remote = False

    def __init__(self, argument: str | None = None) -> None:
        """Takes no argument (raises ValueError for one)."""
        no_argument(self.name, argument)

    def start(self, start: AgentStart) -> AgentProcess:
        """Fork the agent, with the launcher's environment."""
        return LocalAgent(
            start.hostname,
            start.script,
            lambda: start.bootstrap("127.0.0.1"),
            start.on_line,
            environ=dict(start.environ),
        )

    def describe(self, hostname: str) -> str:  # noqa: ARG002 (the same for every host)
        """The agent command itself."""
        return AGENT_COMMAND

    def close(self) -> None:
        """Nothing is held."""


class SshTransport(Transport):
    """An agent over one SSH connection (``~/.ssh/config`` or ``ssh_config_file``)."""

    name = "ssh"
    remote = True
    relays = True
    """Its agents can relay connections (``AgentStart.relay``) over the SSH channel."""
    ships = True
    """Its agents can fetch shipped code (``AgentStart.ship``) over the SSH channel."""
    containers = True
    """Its agents can run in a container (``AgentStart.container``)."""
    settings: ClassVar[tuple[str, ...]] = ("ssh_config_file",)
    """What :func:`torchrunx.plugins.transport` passes on from the launch."""

    def __init__(
        self, argument: str | None = None, ssh_config_file: str | Path | None = None
    ) -> None:
        """Takes no argument (raises ValueError for one); ``ssh_config_file`` for ``describe``."""
        no_argument(self.name, argument)
        self.ssh_config_file = ssh_config_file

    def start(self, start: AgentStart) -> AgentProcess:
        """Connect, run the agent command, write its script and bootstrap.

        A relaying host's agent starts with OpenSSH's ``ssh`` when it is installed: in a
        process of its own, its C ciphers carry the relayed bytes without taking the launcher's
        CPU and interpreter lock (paramiko's, in the launcher, would); else with paramiko.
        """
        ssh = shutil.which("ssh") if start.relay is not None else None
        if ssh is not None:
            return self._openssh(start, ssh)
        if start.on_tree is not None:
            raise AgentFailedError(
                start.hostname,
                "tree_radix needs OpenSSH's ssh client on this machine (not found on PATH); "
                "install it, or launch without tree_radix",
            )
        return SshAgent(
            start.hostname,
            start.script,
            start.bootstrap,
            start.ssh_config_file,
            connect_timeout=start.connect_timeout,
            on_line=start.on_line,
            relay=start.relay,
            ship=start.ship,
            container=start.container,
        )

    def _openssh(self, start: AgentStart, ssh: str) -> AgentProcess:
        try:
            target = resolve_ssh_target(
                start.hostname, start.ssh_config_file, start.connect_timeout
            )
        except ValueError as exc:
            raise AgentFailedError(start.hostname, f"cannot read the SSH config: {exc}") from exc
        address = start.launcher_address
        if address is None:  # what relay="auto" tries first; "on" never uses it
            try:
                address = route_address(target.hostname)
            except OSError:
                address = "127.0.0.1"  # no route: the host relays
        argv = openssh_command(
            ssh,
            start.hostname,
            start.ssh_config_file,
            math.ceil(target.connect_timeout),
            start.container,
        )
        return CommandAgent(
            start.hostname,
            argv,
            dict(start.environ),
            start.script,
            lambda: start.bootstrap(address),
            start.on_line,
            relay=start.relay,
            ship=start.ship,
            on_tree=start.on_tree,
        )

    def describe(self, hostname: str) -> str:
        """``ssh USER@HOST -p PORT [via JUMP] COMMAND``, from the SSH config."""
        try:
            target = resolve_ssh_target(hostname, self.ssh_config_file, 30.0)
        except ValueError as exc:
            return f"ssh (cannot read the SSH config: {exc})"
        via = f" via {target.proxy_jump}" if target.proxy_jump else ""
        return f"ssh {target.user}@{target.hostname} -p {target.port}{via} {AGENT_COMMAND}"

    def close(self) -> None:
        """Nothing is held (each agent owns its connection)."""


class SrunTransport(Transport):
    """An agent as a job step on a node of the SLURM allocation."""

    name = "srun"
    remote = True
    relays = True
    """Its agents can relay connections (``AgentStart.relay``) over the step's stdio."""
    ships = True
    """Its agents can fetch shipped code (``AgentStart.ship``) over the step's stdio."""
    containers = True
    """Its agents can run in a container (``AgentStart.container``)."""
    container_options = True
    """``AgentStart.container`` may be options of ``srun`` itself: pyxis's
    ``--container-image=IMAGE`` and its other ``--container-*`` options."""

    def __init__(self, argument: str | None = None) -> None:
        """Takes no argument (raises ValueError for one)."""
        no_argument(self.name, argument)

    def start(self, start: AgentStart) -> AgentProcess:
        """Start ``srun`` for the host; the agent connects back on the route to its node."""
        address = start.launcher_address or agent_route(start.hostname)
        return SrunAgent(
            start.hostname,
            start.script,
            lambda: start.bootstrap(address),
            start.on_line,
            cpus=slurm_cpus(start.hostname),  # srun runs with this process's environment
            relay=start.relay,
            ship=start.ship,
            container=start.container,
        )

    def describe(self, hostname: str) -> str:
        """The ``srun`` command line."""
        return shlex.join(srun_command(hostname, cpus=slurm_cpus(hostname)))

    def close(self) -> None:
        """Nothing is held (SLURM owns the steps)."""


def agent_route(hostname: str, address: str | None = None) -> str:
    """This machine's address on the route to ``hostname`` (or to its ``address``).

    For transports without a connection of their own to ask (``srun``, ``kubectl``, Ray).

    Raises:
        AgentFailedError: No route; the message says to set ``launcher_address``.
    """
    try:
        return route_address(address or hostname)
    except OSError as exc:
        raise AgentFailedError(
            hostname,
            f"cannot find this machine's address on the route to {address or hostname}: {exc}; "
            "set launcher_address (or TORCHRUNX_LAUNCHER_ADDR) to an address the host can reach",
        ) from exc


def openssh_command(
    ssh: str,
    hostname: str,
    config_file: str | Path | None,
    connect_timeout: int,
    container: Sequence[str] = (),
) -> list[str]:
    """OpenSSH's command line that runs the agent command on ``hostname`` (no values in it).

    ``container``: the command that runs the agent in a container there (an argv prefix).

    No terminal (``-T``), never a prompt (``BatchMode``: keys or an agent, as with paramiko),
    the launch's SSH config if it has one, and the config's ``ConnectTimeout`` else ours.
    """
    config = ["-F", str(config_file)] if config_file is not None else []
    options = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout}"]
    return [ssh, "-T", *config, *options, "--", hostname, remote_command(container)]


def slurm_cpus(hostname: str) -> int | None:
    """CPUs the allocation has on ``hostname``, for the srun step of its agent."""
    try:
        return slurm_allocation().cpus(hostname)
    except (RuntimeError, ValueError):
        return None


# What a fresh SSH login would have: an srun step gets these (and SLURM's own) like a remote
# agent over SSH; everything else travels on stdin.
_LOGIN_VARIABLES = ("HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TZ", "PATH")


def srun_command(
    hostname: str,
    *,
    cpus: int | None,
    srun: str = "srun",
    unbuffered: bool = False,
    container: Sequence[str] = (),
) -> list[str]:
    """The ``srun`` command line that starts the agent of ``hostname`` as a job step.

    One task on that one node, sharing the job's resources with other steps (``--overlap``),
    unbound (``--cpu-bind=none``) and given the node's CPUs (``cpus``), so that all workers the
    agent forks can use them. The step's environment is only what a login would have
    (``--export`` lists names, never values) plus SLURM's own variables; everything else travels
    on stdin as for every agent. ``unbuffered``: the step's stdout as it comes, not line by line
    (a relaying host's frames are not lines).
    """
    command = [
        srun,
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={hostname}",
        "--cpu-bind=none",
        "--quiet",
        "--job-name=torchrunx-agent",
        f"--export={','.join(_LOGIN_VARIABLES)}",
    ]
    if cpus is not None:
        command.append(f"--cpus-per-task={cpus}")
    if unbuffered:
        command.append("--unbuffered")
    return [*command, *container, *AGENT_ARGV]


class SrunAgent(CommandAgent):
    """An agent on another node of the SLURM allocation, started as a job step by ``srun``.

    ``srun`` relays the agent's stdin, stdout and stderr, so the agent behaves as over SSH; its
    processes live in SLURM's accounting and are cleaned up with the job.
    """

    def __init__(  # noqa: PLR0913 (what a start needs)
        self,
        hostname: str,
        script: bytes,
        bootstrap: Callable[[], bytes],
        on_line: OnLine,
        *,
        cpus: int | None,
        environ: dict[str, str] | None = None,
        relay: Adopt | None = None,
        ship: Bundle | None = None,
        container: Sequence[str] = (),
    ) -> None:
        """Start ``srun`` and hand the agent its script and bootstrap (``bootstrap()``) on stdin.

        ``srun`` itself runs with the launcher's environment (it needs the ``SLURM_*``
        variables of the job); the step gets only login variables (see :func:`srun_command`).

        Raises:
            AgentFailedError: ``srun`` is not installed or cannot be started.
        """
        srun = shutil.which("srun")
        if srun is None:
            raise AgentFailedError(hostname, "cannot start the agent with srun: srun not found")
        env = dict(os.environ if environ is None else environ)
        super().__init__(
            hostname,
            srun_command(
                hostname, cpus=cpus, srun=srun, unbuffered=relay is not None, container=container
            ),
            env,
            script,
            bootstrap,
            on_line,
            relay,
            ship,
        )
