"""Train on several workers, then test the trained model on one worker, in one script.

Usage::

    python examples/02_train_then_test.py                  # train on 2 workers, test on 1
    python examples/02_train_then_test.py --workers 4 --steps 100

Two launches, one after the other, from the same Python process: the first trains with DDP
and returns the weights from rank 0 (tensors come back to the launcher as they are), the
second gets those weights as an argument and evaluates them on held-out data in a single
worker without a process group (``backend=None``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import torchrunx as trx

TRUE_WEIGHTS = torch.tensor([[2.0], [-3.0]])
TRUE_BIAS = 0.5


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator)
    return x, x @ TRUE_WEIGHTS + TRUE_BIAS


def train(steps: int, lr: float) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_data(256, seed=0)
    x, y = x[rank::world], y[rank::world]  # this rank's shard
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.module.state_dict()


def test(weights: dict[str, torch.Tensor]) -> float:
    model = nn.Linear(2, 1)
    model.load_state_dict(weights)
    x, y = make_data(64, seed=1)  # held-out data
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    trained = trx.launch(
        train,
        func_args=(args.steps, args.lr),
        hostnames=["localhost"],
        workers_per_host=args.workers,
        backend="gloo",
    )
    weights = trained.rank(0)
    print(f"trained on {trained.world_size} workers: weight {weights['weight'].tolist()}")

    tested = trx.launch(
        test, func_args=(weights,), hostnames=["localhost"], workers_per_host=1, backend=None
    )
    print(f"tested on {tested.world_size} worker: test loss {tested.rank(0):.5f}")


if __name__ == "__main__":
    main()
