"""Fit a LightningModule with Lightning's ``Trainer`` in every worker; load the checkpoint here.

Usage::

    python examples/08_lightning_trainer.py               # 2 workers on localhost, gloo
    python examples/08_lightning_trainer.py --steps 100 --out-dir /shared/ckpts
    python examples/08_lightning_trainer.py --hostnames node1 node2 --out-dir /shared/ckpts

Needs ``pip install -e ".[lightning]"``, in a checkout of torchrunx. Lightning finds the launch
by itself: every worker has ``TORCHELASTIC_RUN_ID`` set, so Lightning reads the ranks from the
worker's variables (its ``TorchElasticEnvironment``) and keeps the process group that torchrunx
created. Tell the ``Trainer`` how many processes there are: ``devices`` is the number of workers
on each host (``LOCAL_WORLD_SIZE``) and ``num_nodes`` the number of hosts; on CPU, ``devices``
defaults to 1, and each worker would train a model of its own. Passing
``plugins=[TorchrunxEnvironment()]`` (torchrunx 0.4's ``TorchrunxClusterEnvironment``) also
checks these two numbers against the launch.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import torchrunx as trx
from torchrunx.integrations.lightning import TorchrunxEnvironment


class Regression(LightningModule):
    """A small MLP fitting the sum of its squared inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def make_data(count: int, seed: int) -> torch.utils.data.TensorDataset:
    x = torch.randn(count, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, (x**2).sum(dim=1, keepdim=True))


def eval_loss(model: Regression) -> float:
    """Mean squared error on held-out data, on the CPU."""
    x, y = make_data(256, seed=2).tensors
    model.cpu().eval()
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def train(steps: int, out_dir: str) -> dict[str, Any]:
    # The `lightning` package prints each of its log records on stderr itself, and the record
    # reaches torchrunx as well: keep one copy.
    logging.getLogger("lightning").handlers.clear()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    checkpoint = ModelCheckpoint(dirpath=out_dir, filename="final", every_n_train_steps=steps)
    trainer = Trainer(
        devices=local,  # processes on this host
        num_nodes=int(os.environ["WORLD_SIZE"]) // local,  # hosts
        plugins=[TorchrunxEnvironment()],  # optional: Lightning would pick TorchElastic's
        max_steps=steps,
        callbacks=[checkpoint],
        logger=False,
    )
    torch.manual_seed(0)
    model = Regression()
    loader = torch.utils.data.DataLoader(make_data(4096, seed=1), batch_size=32, shuffle=True)
    trainer.fit(model, loader)  # Lightning adds a DistributedSampler: each rank gets a shard
    return {
        "path": checkpoint.best_model_path,  # written by rank 0 only
        "workers": trainer.world_size,
        "device": str(trainer.strategy.root_device),  # cuda:LOCAL_RANK on GPUs
        "train_loss": trainer.callback_metrics["train_loss"].item(),
        "eval_loss": eval_loss(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps")
    parser.add_argument("--out-dir", default="checkpoints/lightning", help="checkpoint folder")
    trx.add_launcher_arguments(parser)
    parser.set_defaults(hostnames=["localhost"], workers_per_host=2, backend="gloo")
    args = parser.parse_args()

    launcher = trx.launcher_from_args(args)
    result = launcher.run(train, args.steps, str(Path(args.out_dir).resolve()))
    done = result.rank(0)
    print(f"{done['workers']} workers trained; rank 0 saved {done['path']}")
    print(f"devices: {[worker['device'] for worker in result.ranks]}")
    print(f"final training loss {done['train_loss']:.4f}")

    loaded = eval_loss(Regression.load_from_checkpoint(done["path"]))
    print(f"loaded back: eval loss {loaded:.4f} (rank 0 measured {done['eval_loss']:.4f})")


if __name__ == "__main__":
    main()
