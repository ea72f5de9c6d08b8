"""Example torchrunx plugins (see docs/plugins.md).

* ``envhosts``: hosts from ``$TRX_HOSTS``, e.g. ``"node1=4,node2=4"`` (name=slots).
* ``two_local_workers``: a preset for two gloo workers on this machine.
* ``rank_sum``: a function that sums ``rank + OFFSET`` over every worker with ``all_reduce``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrunx.hosts import HostSlots

if TYPE_CHECKING:
    from collections.abc import Mapping


class EnvHosts:
    """A host provider: ``hostnames="envhosts"`` (or ``"envhosts:node1=2,node2=2"``)."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Used by ``hostnames="auto"``: applies when ``TRX_HOSTS`` is set."""
        return bool(environ.get("TRX_HOSTS"))

    def hosts(self, argument: str | None, environ: Mapping[str, str]) -> list[HostSlots]:
        """Parse ``name=slots`` pairs from the argument, else from ``TRX_HOSTS``."""
        spec = argument or environ.get("TRX_HOSTS", "")
        if not spec:
            raise RuntimeError("envhosts: set TRX_HOSTS, e.g. TRX_HOSTS=node1=4,node2=4")
        hosts = []
        for item in spec.split(","):
            name, _, slots = item.partition("=")
            if not name or (slots and not slots.isdigit()):
                raise ValueError(f"envhosts: {item!r} is not name or name=slots")
            hosts.append(HostSlots(name, int(slots) if slots else None))
        return hosts


ENV_HOSTS = EnvHosts()

TWO_LOCAL_WORKERS = {"hostnames": ["localhost"], "workers_per_host": 2, "backend": "gloo"}


def rank_sum(offset: str = "1") -> int:
    """Sum rank + OFFSET over every worker (an all_reduce); every rank returns the total."""
    import torch  # noqa: PLC0415 (only workers need torch)
    import torch.distributed as dist  # noqa: PLC0415

    total = torch.tensor([dist.get_rank() + int(offset)])
    dist.all_reduce(total)
    return int(total.item())
