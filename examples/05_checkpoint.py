"""Save a checkpoint in rank 0, return its path, and load it in the launcher.

Usage::

    python examples/05_checkpoint.py                            # into ./checkpoints
    python examples/05_checkpoint.py --out-dir /shared/ckpts --steps 100

For large models, return a path instead of the weights: rank 0 writes the checkpoint with
``torch.save`` and returns where it is; the launcher loads it once the launch returned. The
folder must be reachable from the launcher and rank 0's host (a shared filesystem, or
localhost as here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import torchrunx as trx


def train(steps: int, out_dir: str) -> str | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(128, 3)[rank::world]
    y = x @ torch.tensor([[1.0], [2.0], [3.0]])
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    if rank != 0:
        return None
    path = Path(out_dir) / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.module.state_dict(), "steps": steps}, path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out-dir", default="checkpoints")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    result = trx.launch(
        train,
        func_args=(args.steps, str(Path(args.out_dir).resolve())),
        hostnames=["localhost"],
        workers_per_host=args.workers,
        backend="gloo",
    )
    path = result.rank(0)
    print(f"rank 0 saved {path}")

    checkpoint = torch.load(path, weights_only=True)
    model = nn.Linear(3, 1, bias=False)
    model.load_state_dict(checkpoint["model"])
    weights = [round(w, 2) for w in model.weight.flatten().tolist()]
    print(f"loaded after {checkpoint['steps']} steps: weights {weights}")


if __name__ == "__main__":
    main()
