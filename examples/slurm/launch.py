"""Run a function on every node of the SLURM allocation this script runs in; no arguments needed.

Usage (from a batch script, see ``train.sbatch`` next to this file)::

    python examples/slurm/launch.py                     # every node, workers from SLURM
    python examples/slurm/launch.py --agent-start ssh   # start agents over SSH, not srun
    python examples/slurm/launch.py --help              # every Launcher field

``trx.Launcher()`` with no arguments finds the allocation's nodes (``SLURM_JOB_NODELIST``)
and how many workers each node gets (GPUs per node if the job has GPUs, else tasks per node),
and starts the agents of the other nodes as ``srun`` job steps. Each worker joins the process
group, takes part in an ``all_reduce`` and reports where it ran; the launcher prints one line
per rank and, last, every rank's report as one JSON line.
"""

from __future__ import annotations

import json
import os
import socket

import torch
import torch.distributed as dist
import tyro

import torchrunx as trx


def report() -> dict[str, object]:
    """Runs in every worker: sum the ranks across the group and say where this rank ran."""
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "hostname": socket.gethostname(),
        "backend": dist.get_backend(),
        "slurm_step": os.environ.get("SLURM_STEP_ID"),  # set where srun started the agent
        "rank_sum": int(total.item()),
    }


def main() -> None:
    launcher = tyro.cli(trx.Launcher)  # no arguments: every default fits an sbatch job
    result = launcher.run(report)
    reports = result.ranks  # every rank's return value, in rank order
    for entry in reports:
        print(
            f"rank {entry['rank']} of {entry['world_size']} on {entry['hostname']} "
            f"(local rank {entry['local_rank']}): all_reduce sum {entry['rank_sum']}"
        )
    print(json.dumps({"hostnames": list(result.results), "reports": reports}))


if __name__ == "__main__":
    main()
