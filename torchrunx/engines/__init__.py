"""Transports: how an agent is started on a host, as a plugin point (see ``docs/engines.md``).

A launch starts one agent per host. *How* it starts is a transport, named by
``Launcher.agent_start`` (``"ssh"``, ``"kubectl:namespace=ml"``) or by the host provider the hosts
came from (``hostnames="ray"`` pairs with the ``ray`` transport). torchrunx's own:

========== ===================================================================================
``local``  a subprocess of the launcher (a host that is this machine)
``ssh``    one SSH connection per host (paramiko; ``~/.ssh/config``, jump hosts)
``srun``   one SLURM job step per host, inside the allocation
``ray``    one small actor per node of a running Ray cluster, which starts the agent
``kubectl``  ``kubectl exec -i POD`` into a running pod
========== ===================================================================================

A package adds one under the ``torchrunx.transports`` entry-point group::

    [project.entry-points."torchrunx.transports"]
    docker = "my_pkg.transports:DockerExec"

The entry is a callable (a class, say) that takes the argument after ``NAME:`` (or ``None``) and
returns a :class:`Transport`. Every transport runs the same constant command
(:data:`AGENT_ARGV`) and writes :attr:`AgentStart.script` and the bootstrap line to its stdin,
which then stays open (its end tells the agent that the launcher is gone). A transport that
runs a local command which relays stdin, stdout and stderr to the host (``kubectl exec -i``,
``docker exec -i``, ``srun``) needs only :class:`CommandAgent`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torchrunx.launcher.transport import (
    AGENT_ARGV,
    AGENT_COMMAND,
    AgentProcess,
    CommandAgent,
    OnLine,
    route_address,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from pathlib import Path

    from torchrunx.launcher.relay import Adopt
    from torchrunx.launcher.ship import Bundle

__all__ = [
    "AGENT_ARGV",
    "AGENT_COMMAND",
    "AgentProcess",
    "AgentStart",
    "CommandAgent",
    "OnLine",
    "Transport",
    "route_address",
]


@dataclass(frozen=True)
class AgentStart:
    """What a transport is given to start the agent of one host.

    Attributes:
        index: The host's index in the launch (its place in ``hostnames``).
        hostname: The host, as the launch names it (a name, an address, a pod).
        script: The shell script the agent command reads first (environment values and the
            working directory): write it to the agent's stdin, then the bootstrap line.
        bootstrap: Makes the bootstrap line (it holds the launch's secret) from the address
            the launcher has *as the host sees it*; call it once, as it is written, and keep
            neither it nor the line. A ``launcher_address`` the user set wins over the one given.
        on_line: Receives each whole line the agent writes: ``(is_stderr, text)``.
        launcher_address: The address the user set for the launcher (field or
            ``TORCHRUNX_LAUNCHER_ADDR``), if any: a transport that would otherwise look up its
            route to the host may skip that.
        connect_timeout: Seconds a start may take to reach the host.
        ssh_config_file: The launch's SSH config, for transports that use SSH.
        environ: The launcher's environment (a local agent starts with it; a relaying command
            such as ``kubectl`` runs with it).
        hostnames: Every host of the launch that this transport starts, spares included, for
            a transport that reserves them all at once (Ray's placement group).
        relay: Set when this host relays (``Launcher(relay=...)``): the agent's stdout and
            stdin then carry the relay's frames, not lines. A transport that declares
            ``relays = True`` passes it to :class:`CommandAgent` (``relay=``), which handles
            them; other transports are never given one.
        ship: Set when code is shipped to this host (``Launcher(ship=...)``): the agent's
            script fetches it first, so the launcher answers on the agent's stdin and stdout
            between the script and the bootstrap line. A transport that declares
            ``ships = True`` passes it to :class:`CommandAgent` (``ship=``); other
            transports are never given one.
        container: The command that runs the agent in a container on the host, as an argument
            vector to put before the agent command (``("podman", "exec", "-i", "trx")``); empty:
            none. Given only to a transport that declares ``containers = True``.
    """

    index: int
    hostname: str
    script: bytes = field(repr=False)
    bootstrap: Callable[[str], bytes] = field(repr=False)
    on_line: OnLine = field(repr=False)
    launcher_address: str | None = None
    connect_timeout: float = 30.0
    ssh_config_file: str | Path | None = None
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)
    hostnames: tuple[str, ...] = ()
    relay: Adopt | None = field(default=None, repr=False)
    ship: Bundle | None = field(default=None, repr=False)
    container: tuple[str, ...] = ()

    @property
    def payload(self) -> Callable[[str], bytes]:
        """``script`` followed by the bootstrap line for an address: what goes to stdin."""
        return lambda address: self.script + self.bootstrap(address)


@runtime_checkable
class Transport(Protocol):
    """Starts agents on hosts; one instance serves one launch (or one set of warm agents).

    Attributes:
        name: The transport's name, as ``agent_start`` gives it (shown by ``dry_run``).
        remote: Whether its agents run on other machines (the launcher then listens beyond
            ``127.0.0.1``, and the agents are given its address as their host sees it).
    """

    name: str
    remote: bool

    def start(self, start: AgentStart) -> AgentProcess:
        """Start the agent of one host; called from a start thread, for several hosts at once.

        Raises:
            AgentFailedError: It cannot be started; name the host and what would fix it.
        """
        ...

    def describe(self, hostname: str) -> str:
        """The command that would start the agent of ``hostname`` (for ``dry_run``; pure)."""
        ...

    def close(self) -> None:
        """Release what the transport holds for the launch, once every agent has closed."""
        ...
