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

The layer, from the bottom: :mod:`~torchrunx.engines.protocol` (the interface; it imports
nothing of the launcher), :mod:`~torchrunx.engines.command` (the agent command, its script,
agent processes behind a local command), :mod:`~torchrunx.engines.ssh` (an agent over SSH),
:mod:`~torchrunx.engines.relay` and :mod:`~torchrunx.engines.ship` (the launcher's end of a
relaying host and of shipped code, both carried on an agent's stdio),
:mod:`~torchrunx.engines.forward` (a remote port over SSH), then the engines:
:mod:`~torchrunx.engines.builtin`, :mod:`~torchrunx.engines.ray`,
:mod:`~torchrunx.engines.kubernetes`. The launcher imports this package; nothing here imports
the launcher.
"""

from __future__ import annotations

from torchrunx.engines.command import AGENT_ARGV, CommandAgent, route_address
from torchrunx.engines.protocol import AgentProcess, AgentStart, OnLine, Transport
from torchrunx.wire.bootstrap import AGENT_COMMAND

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
