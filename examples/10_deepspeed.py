"""Train with a DeepSpeed engine (ZeRO stage 2) in every worker; load the checkpoint here.

Usage::

    python examples/10_deepspeed.py                       # 2 workers on localhost, gloo, CPU
    python examples/10_deepspeed.py --steps 100 --out-dir /shared/ds
    python examples/10_deepspeed.py --hostnames node1 node2 --out-dir /shared/ds
    python examples/10_deepspeed.py --backend nccl --bf16 # on GPUs (scripts/gpu_check.sh)

Needs ``pip install -e ".[deepspeed]"``, in a checkout of torchrunx (DeepSpeed builds from
source: install torch first, then ``pip install --no-build-isolation -e ".[deepspeed]"``).
``deepspeed`` the command is not used: ``deepspeed.initialize`` reads ``LOCAL_RANK`` and keeps
the process group torchrunx created.

On CPU, DeepSpeed uses its CPU accelerator with gloo: engine creation, ZeRO stages 0 to 3,
steps and checkpoints all run. Its first engine on a machine compiles a C++ op
(``deepspeed_shm_comm``, about 30 s; it needs ``g++`` and the Python headers) into
``~/.cache/torch_extensions`` (``TORCH_EXTENSIONS_DIR``); later runs load it. DeepSpeed's
fused optimizers would compile more ops (``FusedAdam`` on CPU takes a minute), so this example
asks for ``torch.optim.AdamW`` (``"torch_adam": true``). ``fp16`` needs a GPU; ``--bf16``
works on both (rank 0 then measures its bfloat16 weights, the checkpoint keeps float32 ones:
the two losses differ a little). Every rank writes its own ZeRO shard of the checkpoint: on
several hosts, ``--out-dir`` must be on a filesystem they share.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deepspeed
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn

import torchrunx as trx

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator


def new_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def make_data(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(count, 8, generator=torch.Generator().manual_seed(seed))
    return x, (x**2).sum(dim=1, keepdim=True)


def eval_loss(model: nn.Module) -> float:
    """Mean squared error on held-out data, in float32 on the CPU."""
    x, y = make_data(256, seed=2)
    with torch.no_grad():
        return nn.functional.mse_loss(model.float().cpu()(x), y).item()


def forever(loader: Iterable[list[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def ds_config(*, bf16: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 32,  # train_batch_size follows from the world size
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},  # optimizer state and gradients sharded
        "bf16": {"enabled": bf16},
    }


def train(steps: int, out_dir: str, config: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = new_model()
    engine, _, loader, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=torch.utils.data.TensorDataset(*make_data(4096, seed=1)),
        config=config,
    )  # the loader has a DistributedSampler: each rank gets a shard
    dtype = next(engine.module.parameters()).dtype  # bfloat16 with "bf16", else float32
    for _, batch in zip(range(steps), forever(loader), strict=False):
        x, y = (t.to(engine.device, dtype) for t in batch)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out_dir, tag="final")  # every rank writes its shard; rank 0 the model
    return {
        "path": out_dir,
        "workers": engine.world_size,
        "device": str(engine.device),  # cuda:LOCAL_RANK on GPUs
        "eval_loss": eval_loss(engine.module),  # ZeRO 2 shards no weights: all are here
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps")
    parser.add_argument("--out-dir", default="checkpoints/deepspeed", help="checkpoint folder")
    parser.add_argument("--bf16", action="store_true", help="train in bfloat16")
    trx.add_launcher_arguments(parser)
    parser.set_defaults(hostnames=["localhost"], workers_per_host=2, backend="gloo")
    args = parser.parse_args()

    launcher = trx.launcher_from_args(args)
    config = ds_config(bf16=args.bf16)
    result = launcher.run(train, args.steps, str(Path(args.out_dir).resolve()), config)
    done = result.rank(0)
    print(f"{done['workers']} workers trained; rank 0 saved {done['path']}")
    print(f"devices: {[worker['device'] for worker in result.ranks]}")

    model = new_model()  # ZeRO shards merged into one float32 state dict, on this machine
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(done["path"], tag="final"))
    loaded = eval_loss(model)
    print(f"loaded back: eval loss {loaded:.4f} (rank 0 measured {done['eval_loss']:.4f})")


if __name__ == "__main__":
    main()
