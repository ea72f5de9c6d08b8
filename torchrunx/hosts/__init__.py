"""Which hosts a launch runs on: hostnames, node lists and host providers (launcher side).

The names here are the ones host providers use (see docs/plugins.md): :class:`HostSlots` and
the SLURM and hostfile readers of :mod:`~torchrunx.hosts.hostlists`. Resolving a launch's
``hostnames`` is :mod:`~torchrunx.hosts.resolve`; this package imports neither it nor the
entry points of :mod:`torchrunx.plugins`.
"""

from torchrunx.hosts.hostlists import (
    HostSlots,
    in_slurm_allocation,
    read_hostfile,
    slurm_allocation,
)

__all__ = ["HostSlots", "in_slurm_allocation", "read_hostfile", "slurm_allocation"]
