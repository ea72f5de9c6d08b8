"""A script whose launcher comes from the command line, with tyro.

Usage::

    python examples/03_tyro_cli.py --help     # every Launcher field, its help and default
    python examples/03_tyro_cli.py --hostnames localhost --workers-per-host 2 --backend gloo
    python examples/03_tyro_cli.py --hostnames node1 node2 --workers-per-host 8

``tyro.cli(trx.Launcher)`` reads every field of the ``Launcher`` dataclass from the command
line (the field docstrings are the ``--help`` text); with no arguments it is ``Launcher()``:
the SLURM allocation inside one, else this machine, one worker per GPU or CPU core. Each
worker adds its rank to an ``all_reduce`` and reports where it ran.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import tyro

import torchrunx as trx


def report() -> str:
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return (
        f"rank {dist.get_rank()} of {dist.get_world_size()} on {socket.gethostname()}: "
        f"sum of ranks {total.item():g}"
    )


def main() -> None:
    launcher = tyro.cli(trx.Launcher, description=__doc__.splitlines()[0])
    result = launcher.run(report)
    for line in result.ranks:
        print(line)


if __name__ == "__main__":
    main()
