"""Train a small model with DistributedDataParallel on this machine and print what rank 0 returns.

Usage::

    python examples/01_train_ddp.py                   # 2 workers on localhost, gloo (CPU)
    python examples/01_train_ddp.py --steps 50        # fewer steps (default 200)
    python examples/01_train_ddp.py --backend nccl    # on GPUs, one per worker (or: auto)

Every worker trains on its own shard of a synthetic regression problem; DDP averages the
gradients, so all ranks end with the same weights. Rank 0 returns its final loss and weights.
With nccl the code is the usual DDP code: every worker sees every GPU of the host, and
torchrunx made ``cuda:LOCAL_RANK`` the current device before the process group started.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import torchrunx as trx


def train(steps: int, lr: float) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        if torch.cuda.current_device() != local_rank:
            raise RuntimeError(f"current device {torch.cuda.current_device()} != {local_rank}")
        device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    true_w = torch.tensor([[2.0], [-3.0]])
    x = torch.randn(256, 2)[rank::world].to(device)  # this rank's shard
    y = x @ true_w.to(device) + 0.5

    device_ids = [local_rank] if device.type == "cuda" else None
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1).to(device), device_ids=device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.tensor(0.0, device=device)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    print(f"rank {rank}/{world} (LOCAL_RANK={local_rank}): final loss {loss.item():.5f}")
    weights = model.module.weight.detach().flatten().tolist()
    bias = model.module.bias.item()
    return {"loss": loss.item(), "weights": weights, "bias": bias, "device": str(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backend", choices=["gloo", "nccl", "auto"], default="gloo")
    args = parser.parse_args()

    launcher = trx.Launcher(
        hostnames=["localhost"], workers_per_host=args.workers, backend=args.backend
    )
    result = launcher.run(train, args.steps, args.lr)
    print("rank 0 returned:", result.rank(0))
    print("devices:", [r["device"] for r in result.ranks])
    same = all(r["weights"] == result.rank(0)["weights"] for r in result.ranks)
    print("all ranks hold the same weights:", same)


if __name__ == "__main__":
    main()
