"""Debug one rank: ``breakpoint()`` in a worker opens pdb in this terminal.

Usage::

    python examples/12_debug_a_rank.py                  # rank 1 of 2 stops at step 3
    python examples/12_debug_a_rank.py --rank 0 --at-step 1

Run it in a terminal. Rank ``--rank`` stops at ``breakpoint()``; the prompt names it,
``(Pdb rank 1 on localhost)``. Try ``p loss.item()``, ``p [p.grad for p in
model.parameters()]``, ``l``, ``n``, then ``c`` to let it go on (``q`` fails the launch with
``BdbQuit``). The other rank waits in DDP's all-reduce meanwhile; ``launch_timeout`` does not
count the pause, and a rank waiting in a collective waits up to the process group's
``timeout`` (``Launcher(timeout=...)``, 600 s by default).
Without a terminal (stdin not a TTY: a pipe, a batch job) the breakpoint is skipped with a
warning naming the rank and line, and the run completes. See ``docs/debugging.md``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import torchrunx as trx


def train(steps: int, stop_rank: int, at_step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(64, 4)[rank::world]
    y = x.sum(dim=1, keepdim=True)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.tensor(0.0)
    for step in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if rank == stop_rank and step == at_step:
            breakpoint()  # noqa: T100 (the point of this example: look, then c goes on)
        optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument("--rank", type=int, default=1, help="the rank that stops")
    parser.add_argument("--at-step", type=int, default=3, help="the step it stops at")
    args = parser.parse_args()
    result = trx.launch(
        train,
        func_args=(args.steps, args.rank, args.at_step),
        hostnames=["localhost"],
        workers_per_host=2,
        backend="gloo",
    )
    print(f"final loss per rank: {[round(loss, 4) for loss in result.ranks]}")


if __name__ == "__main__":
    main()
