"""A learning-rate sweep on warm agents: the agents start once, every run gets fresh workers.

Usage::

    python examples/11_warm_sweep.py                      # 4 learning rates, 2 workers
    python examples/11_warm_sweep.py --lrs 0.01 0.1 0.3 --workers 4 --steps 100

``Launcher.warm()`` starts the agents (and their ``import torch``) once. Each ``warm.run``
then forks new workers that join a new process group, train with DDP and return; the first
run pays for the agents' start, the others only for the fork and the process group. A run
that fails (here: a learning rate so large that the loss is no longer finite) raises in
this script, and the next run works as if nothing happened. The agents end with the block.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
from torch import nn

import torchrunx as trx

TRUE_WEIGHTS = torch.tensor([[2.0], [-3.0]])


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator)
    return x, x @ TRUE_WEIGHTS


def train(lr: float, steps: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_data(256, seed=0)
    x, y = x[rank::world], y[rank::world]
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"lr={lr} diverged: loss {loss.item()}")
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.05, 0.2, 50.0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    launcher = trx.Launcher(hostnames=["localhost"], workers_per_host=args.workers, backend="gloo")
    losses: dict[float, float] = {}
    with launcher.warm() as warm:
        for lr in args.lrs:
            started = time.perf_counter()
            try:
                result = warm.run(train, lr, args.steps)
            except FloatingPointError as error:
                print(f"lr={lr}: failed ({error}); the agents stay for the next run")
                continue
            took = time.perf_counter() - started
            losses[lr] = result.rank(0)
            print(
                f"lr={lr}: loss {losses[lr]:.6f}, call to result {took:.2f} s, "
                f"of which training {max(result.timings.function):.2f} s"
            )
    best = min(losses, key=losses.__getitem__)
    print(f"best lr {best} of {len(args.lrs)} runs on the same agents")


if __name__ == "__main__":
    main()
