"""Train with Lightning ``Fabric`` in every worker; load the checkpoint it saved here.

Usage::

    python examples/09_lightning_fabric.py                # 2 workers on localhost, gloo
    python examples/09_lightning_fabric.py --steps 100 --out-dir /shared/fabric
    python examples/09_lightning_fabric.py --hostnames node1 node2 --out-dir /shared/fabric

Needs ``pip install -e ".[lightning]"``, in a checkout of torchrunx. As with the ``Trainer``
(see ``08_lightning_trainer.py``), Fabric reads the ranks from the worker's variables and keeps
the process group torchrunx created; give it ``devices`` (workers on this host) and
``num_nodes`` (hosts). ``fabric.launch()`` starts nothing here: the processes already exist.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning import Fabric
from torch import nn

import torchrunx as trx

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator


def new_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def make_data(count: int, seed: int) -> torch.utils.data.TensorDataset:
    x = torch.randn(count, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, (x**2).sum(dim=1, keepdim=True))


def eval_loss(model: nn.Module) -> float:
    """Mean squared error on held-out data, on the CPU."""
    x, y = make_data(256, seed=2).tensors
    with torch.no_grad():
        return nn.functional.mse_loss(model.cpu()(x), y).item()


def forever(loader: Iterable[list[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def train(steps: int, out_dir: str) -> dict[str, Any]:
    # The `lightning` package prints each of its log records on stderr itself, and the record
    # reaches torchrunx as well: keep one copy.
    logging.getLogger("lightning").handlers.clear()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    fabric = Fabric(devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local)
    fabric.launch()
    fabric.seed_everything(0)
    model = new_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)  # DDP, on this worker's device
    loader = fabric.setup_dataloaders(  # adds a DistributedSampler: each rank gets a shard
        torch.utils.data.DataLoader(make_data(4096, seed=1), batch_size=32, shuffle=True)
    )
    batches = forever(loader)
    for step in range(1, steps + 1):
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % max(1, steps // 4) == 0:
            mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
            fabric.print(f"step {step}: loss {float(mean):.4f}")  # rank 0 only

    path = Path(out_dir) / "final.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": steps})  # rank 0 writes
    return {
        "path": str(path),
        "workers": fabric.world_size,
        "device": str(fabric.device),  # cuda:LOCAL_RANK on GPUs
        "eval_loss": eval_loss(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps")
    parser.add_argument("--out-dir", default="checkpoints/fabric", help="checkpoint folder")
    trx.add_launcher_arguments(parser)
    parser.set_defaults(hostnames=["localhost"], workers_per_host=2, backend="gloo")
    args = parser.parse_args()

    launcher = trx.launcher_from_args(args)
    result = launcher.run(train, args.steps, str(Path(args.out_dir).resolve()))
    done = result.rank(0)
    checkpoint = torch.load(done["path"], weights_only=True)
    print(f"{done['workers']} workers trained; rank 0 saved {done['path']}")
    print(f"devices: {[worker['device'] for worker in result.ranks]}")
    print(f"checkpoint after {checkpoint['step']} steps")
    model = new_model()
    model.load_state_dict(checkpoint["model"])
    loaded = eval_loss(model)
    print(f"loaded back: eval loss {loaded:.4f} (rank 0 measured {done['eval_loss']:.4f})")


if __name__ == "__main__":
    main()
