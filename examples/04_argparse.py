"""A script with its own argparse options and the launcher's, side by side.

Usage::

    python examples/04_argparse.py                        # 2 workers on localhost, gloo
    python examples/04_argparse.py --steps 50 --workers-per-host 4
    python examples/04_argparse.py --help                 # the script's and the launcher's options

``trx.add_launcher_arguments(parser)`` adds one option per ``Launcher`` field (``--hostnames``,
``--workers-per-host``, ``--backend``, ...) with its help and default, and
``trx.launcher_from_args(args)`` builds the ``Launcher``. ``parser.set_defaults`` changes the
launcher's defaults for this script.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import torchrunx as trx


def train(steps: int, lr: float) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(128, 4)[rank::world]
    y = x.sum(dim=1, keepdim=True)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    trx.add_launcher_arguments(parser)
    parser.set_defaults(hostnames=["localhost"], workers_per_host=2, backend="gloo")
    args = parser.parse_args()

    launcher = trx.launcher_from_args(args)
    result = launcher.run(train, args.steps, args.lr)
    print(f"final loss per rank: {[round(loss, 5) for loss in result.ranks]}")


if __name__ == "__main__":
    main()
