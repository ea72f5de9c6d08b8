"""Train a small regression model with an Accelerate loop in every worker; load it back here.

Usage::

    python examples/07_accelerate.py                      # 2 workers on localhost, gloo
    python examples/07_accelerate.py --steps 100 --out-dir /shared/mlp
    python examples/07_accelerate.py --hostnames node1 node2 --out-dir /shared/mlp

Needs ``pip install -e ".[accelerate]"``, in a checkout of torchrunx. ``Accelerator()`` needs no
glue: it reads ``LOCAL_RANK`` and ``WORLD_SIZE`` and keeps the process group that torchrunx
created. On a host without a GPU, torchrunx sets ``ACCELERATE_USE_CPU=true`` in the workers, so
the processes still train one model together (``MULTI_CPU``) rather than one model each.
Settings that ``accelerate launch`` would read from ``accelerate config`` are not read here:
pass them to ``Accelerator(...)`` (``mixed_precision="bf16"``, ``gradient_accumulation_steps``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

import torchrunx as trx

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

logger = get_logger(__name__)  # logs on the main process only, unless told otherwise


def new_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def make_data(count: int, seed: int) -> torch.utils.data.TensorDataset:
    """Inputs and a target that a small MLP can fit: the sum of the squared inputs."""
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
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = new_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(make_data(4096, seed=1), batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # shards the data
    processes, kind = accelerator.num_processes, accelerator.distributed_type
    logger.info("%d processes (%s), %d batches each", processes, kind, len(loader))

    batches = forever(loader)
    for step in tqdm(range(1, steps + 1), disable=not accelerator.is_main_process):
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % max(1, steps // 4) == 0:
            mean = accelerator.reduce(loss.detach(), reduction="mean").item()
            logger.info("step %d: loss %.4f", step, mean)

    accelerator.wait_for_everyone()
    accelerator.save_model(model, out_dir)  # model.safetensors, written by the main process
    return {
        "path": out_dir,
        "workers": accelerator.num_processes,
        "device": str(accelerator.device),  # cuda:LOCAL_RANK on GPUs
        "eval_loss": eval_loss(accelerator.unwrap_model(model)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps")
    parser.add_argument(
        "--out-dir", default="checkpoints/mlp", help="where the main process saves the model"
    )
    trx.add_launcher_arguments(parser)
    parser.set_defaults(hostnames=["localhost"], workers_per_host=2, backend="gloo")
    args = parser.parse_args()

    launcher = trx.launcher_from_args(args)
    result = launcher.run(train, args.steps, str(Path(args.out_dir).resolve()))
    done = result.rank(0)
    print(f"{done['workers']} workers trained; rank 0 saved {done['path']}")
    print(f"devices: {[worker['device'] for worker in result.ranks]}")

    model = new_model()
    model.load_state_dict(load_file(Path(done["path"]) / "model.safetensors"))
    loaded = eval_loss(model)
    print(f"loaded back: eval loss {loaded:.4f} (rank 0 measured {done['eval_loss']:.4f})")


if __name__ == "__main__":
    main()
