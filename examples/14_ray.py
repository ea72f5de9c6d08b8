"""Train with DDP on the nodes of a Ray cluster: one agent per node, started through Ray.

Usage::

    python examples/14_ray.py --address 10.0.0.1:6379     # a running cluster (ray start --head)
    python examples/14_ray.py                             # RAY_ADDRESS, else "auto"
    python examples/14_ray.py --local-cluster --workers 2  # a one-node Ray started here

``hostnames="ray:ADDRESS"`` takes every alive node of the cluster that has CPUs or GPUs, with
its GPUs as workers (else its CPUs; ``--workers`` sets a count). One placement group reserves
1 CPU and every GPU of each node for the launch, one small actor per node starts torchrunx's
agent as its own process, and the workers are forked from that agent, so ``LOCAL_RANK``,
``CUDA_VISIBLE_DEVICES`` and the process group are as under torchrun. When the launch returns,
the actors and the placement group are gone (docs/engines.md).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

import torchrunx as trx


def train(steps: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(32, 3, generator=generator)
        loss = nn.functional.mse_loss(model(x), x @ torch.tensor([[1.0], [2.0], [3.0]]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weights = [round(w, 2) for w in model.module.weight.detach().flatten().tolist()]
    return {
        "host": socket.gethostname(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "weights": weights,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address", default=None, help="the cluster's address (else RAY_ADDRESS, else auto)"
    )
    parser.add_argument(
        "--local-cluster", action="store_true", help="start a one-node Ray here first"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="workers per node (default: its GPUs, else CPUs)"
    )
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    if args.local_cluster:
        import ray  # noqa: PLC0415 (only for --local-cluster)

        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    hostnames = f"ray:{args.address}" if args.address else "ray"
    try:
        result = trx.launch(
            train,
            func_args=(args.steps,),
            hostnames=hostnames,
            workers_per_host=args.workers or "auto",
            backend="auto",
        )
    finally:
        if args.local_cluster:
            ray.shutdown()
    for node, ranks in result.results.items():
        print(f"node {node}: {len(ranks)} ranks on {ranks[0]['host']}")
    same = len({str(r["weights"]) for r in result.ranks}) == 1
    print(f"every rank holds weights {result.rank(0)['weights']}: {same}")


if __name__ == "__main__":
    main()
