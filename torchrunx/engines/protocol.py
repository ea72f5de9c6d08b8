"""The transport interface: what an engine implements, and what the launcher calls.

This module is the layer's contract and imports nothing of :mod:`torchrunx.launcher`:
:class:`Transport` (how agents start on hosts, with the capabilities a transport declares),
:class:`AgentStart` (what one start is given) and :class:`AgentProcess` (a started agent as the
launcher's loop reads it). The transports themselves are the engines beside it
(:mod:`~torchrunx.engines.builtin`, :mod:`~torchrunx.engines.ray`,
:mod:`~torchrunx.engines.kubernetes`, or a plugin's), built on
:mod:`~torchrunx.engines.command` and :mod:`~torchrunx.engines.ssh`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from torchrunx.engines.relay import Adopt, OnTree
    from torchrunx.engines.ship import Bundle

__all__ = [
    "CAPABILITIES",
    "AgentProcess",
    "AgentStart",
    "OnLine",
    "Reader",
    "Transport",
    "with_declared_capabilities",
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
        on_tree: Set for an interior host of a tree start (``Launcher(tree_radix=...)``, SSH
            only): its relay's TREE frames go to it (:class:`CommandAgent`'s ``on_tree``).
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
    on_tree: OnTree | None = field(default=None, repr=False)

    @property
    def payload(self) -> Callable[[str], bytes]:
        """``script`` followed by the bootstrap line for an address: what goes to stdin."""
        return lambda address: self.script + self.bootstrap(address)


@runtime_checkable
class Transport(Protocol):
    """Starts agents on hosts; one instance serves one launch (or one set of warm agents).

    The capabilities below are ``False`` unless the transport declares them (as class
    attributes: ``relays = True``); a class that subclasses :class:`Transport` inherits these
    defaults, and one that only has its methods (the protocol's structural form) gets them
    when it is loaded (:func:`with_declared_capabilities`). The launcher reads them as
    attributes, and refuses a launch that needs one its transport lacks before anything starts.

    Attributes:
        name: The transport's name, as ``agent_start`` gives it (shown by ``dry_run``).
        remote: Whether its agents run on other machines (the launcher then listens beyond
            ``127.0.0.1``, and the agents are given its address as their host sees it).
        relays: Its agents' stdin and stdout reach the host unchanged, so a host that cannot
            connect back may relay its connections over them (:attr:`AgentStart.relay`).
        ships: Over the same kind of channel, its agents can fetch shipped code
            (:attr:`AgentStart.ship`).
        containers: It can run the agent command under a prefix
            (:attr:`AgentStart.container`).
        container_options: That prefix may be options of its own command (``srun``'s pyxis
            options, ``--container-image=...``).
    """

    name: str
    remote: bool
    relays: bool = False
    ships: bool = False
    containers: bool = False
    container_options: bool = False

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


CAPABILITIES = ("relays", "ships", "containers", "container_options")
"""What a transport may declare, each ``False`` unless it does (see :class:`Transport`)."""


def with_declared_capabilities(transport: object) -> Transport:
    """``transport``, with every capability it does not declare set to ``False``.

    A transport written to the protocol's structural form (its methods, ``name`` and
    ``remote``, and only the capabilities it has, as ``docs/engines.md`` shows) has no
    attribute for a capability it lacks; from here on it has one, so the launcher reads each
    as an attribute.

    Raises:
        TypeError: A capability is missing and cannot be set on the object.
    """
    for capability in CAPABILITIES:
        if not hasattr(transport, capability):
            try:
                setattr(transport, capability, False)
            except AttributeError as exc:
                raise TypeError(
                    f"transport {transport!r} does not declare {capability!r} and it cannot be "
                    f"set on it: declare {capability} = False on its class"
                ) from exc
    return cast("Transport", transport)


class AgentProcess(Protocol):
    """A started agent, as the launcher sees it: its output and its end."""

    hostname: str

    @property
    def exit_fd(self) -> int:
        """A descriptor readable once the agent has ended (-1: none; :meth:`wait` polls)."""
        ...

    def readers(self) -> list[Reader]:
        """The descriptors of the agent's output, each with what reads it when it is readable.

        A reader takes what is there without blocking and returns ``False`` once its stream
        has ended. The launcher's loop calls them; lines go to the ``on_line`` of the start.
        """
        ...

    def stderr_tail(self) -> str:
        """The last lines the agent (or ssh) wrote to stderr."""
        ...

    def wait(self, timeout: float | None) -> int | None:
        """Wait for the agent to end (``None``: for as long as it takes).

        Returns:
            Its exit status, or ``None`` if it still runs.
        """
        ...

    def close(self, grace: float = 5.0) -> None:
        """End the agent if it still runs and release everything held for it.

        Args:
            grace: Seconds the agent gets to end by itself after its stdin closes. ``0`` for
                an agent that is lost (its host unreachable): do not wait for it at all.
        """
        ...


OnLine = Callable[[bool, str], None]
"""Receives each whole line an agent writes: ``(is_stderr, text)``."""


Reader = tuple[int, Callable[[], bool]]
"""A descriptor and the function that reads it when it is readable (``False``: it ended)."""
