"""Which hosts a launch runs on: node lists, hostfiles, and what host providers use.

The names here are the ones host providers use (see docs/plugins.md): :class:`HostSlots` and
the SLURM and hostfile readers of :mod:`~torchrunx.hosts.hostlists`. This package is the
bottom of the launcher side: it imports nothing of torchrunx but :mod:`torchrunx.errors`, so
:mod:`torchrunx.plugins` (whose own providers read SLURM and hostfiles here) builds on it.
Resolving a launch's ``hostnames``, which reads those providers, is the launcher's
(:mod:`torchrunx.launcher.settings.resolve`).
"""

from torchrunx.hosts.hostlists import (
    HostSlots,
    in_slurm_allocation,
    read_hostfile,
    slurm_allocation,
)

__all__ = ["HostSlots", "in_slurm_allocation", "read_hostfile", "slurm_allocation"]
