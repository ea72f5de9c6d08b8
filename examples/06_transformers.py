"""Train a tiny GPT-2 with Hugging Face's ``Trainer`` in every worker; load it back here.

Usage::

    python examples/06_transformers.py                    # 2 workers on localhost, gloo
    python examples/06_transformers.py --steps 40 --out-dir /shared/gpt2
    python examples/06_transformers.py --hostnames node1 node2 --out-dir /shared/gpt2

Needs ``pip install -e ".[transformers]"``, in a checkout of torchrunx. The model is built from
a config here and the data is made up, so nothing is downloaded (``HF_HUB_OFFLINE=1`` makes sure
of it on every host: ``HF_*`` variables reach other hosts only when named in ``extra_env_vars``,
as here).

``Trainer`` needs no glue: it reads ``LOCAL_RANK`` and ``WORLD_SIZE``, keeps the process group
that torchrunx created, shards the data with a ``DistributedSampler``, logs and shows its
progress bar on rank 0 only (torchrunx prints rank 0's output as ``[host:0] ...``), and saves
the model from rank 0. The output folder must be reachable from the launcher and from rank
0's host (a shared filesystem, or localhost).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import torchrunx as trx

VOCAB = 64


def make_data(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences that count up (modulo VOCAB) from a random start: easy to learn."""
    starts = torch.randint(0, VOCAB, (count, 1), generator=torch.Generator().manual_seed(seed))
    ids = (starts + torch.arange(16)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def new_model() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    config.bos_token_id = config.eos_token_id = 0  # inside the tiny vocabulary
    return GPT2LMHeadModel(config)


def eval_loss(model: GPT2LMHeadModel) -> float:
    """The model's mean next-token loss on the held-out sequences, on the CPU."""
    batch = torch.stack([item["input_ids"] for item in make_data(64, seed=2)])
    model.cpu().eval()
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def train(steps: int, out_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=max(1, steps // 4),
        log_level="info",  # Trainer's own log lines on rank 0 (replicas: warnings only)
        save_strategy="no",  # saved once, below
        ddp_find_unused_parameters=False,  # every parameter gets a gradient
        report_to="none",
    )
    trainer = Trainer(model=new_model(), args=args, train_dataset=make_data(512, seed=1))
    trained = trainer.train()
    trainer.save_model(out_dir)  # written by rank 0 only
    return {
        "path": out_dir,
        "workers": args.world_size,
        "device": str(args.device),  # cuda:LOCAL_RANK on GPUs
        "train_loss": trained.training_loss,
        "eval_loss": eval_loss(trainer.model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument(
        "--out-dir", default="checkpoints/gpt2-tiny", help="where rank 0 saves the model"
    )
    trx.add_launcher_arguments(parser)
    parser.set_defaults(
        hostnames=["localhost"],
        workers_per_host=2,
        backend="gloo",
        extra_env_vars=("HF_HUB_OFFLINE", "HF_HOME"),  # HF_* is not forwarded by default
    )
    args = parser.parse_args()

    launcher = trx.launcher_from_args(args)
    result = launcher.run(train, args.steps, str(Path(args.out_dir).resolve()))
    done = result.rank(0)
    print(f"{done['workers']} workers trained; rank 0 saved {done['path']}")
    print(f"devices: {[worker['device'] for worker in result.ranks]}")
    print(f"final training loss {done['train_loss']:.4f}")

    loaded = eval_loss(GPT2LMHeadModel.from_pretrained(done["path"]))
    print(f"loaded back: eval loss {loaded:.4f} (rank 0 measured {done['eval_loss']:.4f})")


if __name__ == "__main__":
    main()
