"""Train, be preempted (SIGTERM), save a checkpoint in the grace period, and resume from it.

Usage::

    python examples/13_preempt_and_resume.py                     # preempted once, resumes
    python examples/13_preempt_and_resume.py --steps 3000 --preempt-after 5 --ckpt ./ckpt.pt

The script sends itself SIGTERM ``--preempt-after`` seconds after rank 0 starts (an event
handler starts the clock), as SLURM (``--signal``,
``scancel``, a preemption), a spot notice or ``kill`` would. Every rank sees
``torchrunx.preemption_requested()`` turn True; the ranks agree on the step to stop at (one
all-reduce per step, as they may see the notice a step apart), rank 0 saves the model and the
step (written whole: a temporary file, then a rename), and they return. The launch raises
``torchrunx.Preempted``; the script launches again, and the ranks resume from the checkpoint.

Under SLURM, let the job requeue itself instead (docs/resilience.md)::

    #SBATCH --signal=B:TERM@120 --requeue --open-mode=append
    exec python examples/13_preempt_and_resume.py --preempt-after 0 --requeue
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import torchrunx as trx


def train(steps: int, ckpt: str) -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    if Path(ckpt).exists():  # every rank loads the same state
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    started = step
    x = torch.randn(256, 3)[rank::world]
    y = x @ torch.tensor([[1.0], [2.0], [3.0]])
    while step < steps:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        step += 1
        told = torch.tensor([float(trx.preemption_requested())])
        dist.all_reduce(told, op=dist.ReduceOp.MAX)  # stop at the same step on every rank
        if told.item():
            break
    if rank == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**state, "step": step}, f"{ckpt}.tmp")
        Path(f"{ckpt}.tmp").replace(ckpt)
    dist.barrier()
    weights = [round(w, 3) for w in model.module.weight.detach().flatten().tolist()]
    return {"started": started, "step": step, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--preempt-after", type=float, default=3.0, help="0: never")
    parser.add_argument("--ckpt", default="preempt_example.pt")
    parser.add_argument("--requeue", action="store_true", help="requeue the SLURM job")
    args = parser.parse_args()
    ckpt = str(Path(args.ckpt).resolve())
    timers: list[threading.Timer] = []

    def preempt_soon(event: trx.events.Event) -> None:
        # Rank 0 runs the function: SIGTERM to this process (the launcher) a little later.
        if not isinstance(event, trx.events.WorkerStateChanged) or args.preempt_after <= 0:
            return
        if event.rank == 0 and event.new is trx.WorkerState.HEALTHY:
            timer = threading.Timer(args.preempt_after, os.kill, (os.getpid(), signal.SIGTERM))
            timers.append(timer)
            timer.start()

    launcher = trx.Launcher(
        hostnames=["localhost"] if not args.requeue else "auto",
        workers_per_host=2 if not args.requeue else "auto",
        backend="gloo",
        preemption_grace=30,
        requeue_on_preemption=args.requeue,
        event_handlers=(preempt_soon,),
    )

    def run() -> dict[str, object]:
        try:
            return launcher.run(train, args.steps, ckpt).rank(0)
        finally:
            for timer in timers:
                timer.cancel()

    while True:
        try:
            result = run()
        except trx.Preempted as preempted:
            steps = sorted({value["step"] for value in preempted.returned.values()})  # type: ignore[index]
            print(f"preempted ({preempted.reason}): saved at step {steps}, by rank 0")
            if args.requeue:
                raise  # SLURM runs the script again; it resumes from the checkpoint
            args.preempt_after = 0  # this example is preempted once
            continue
        print(f"resumed from step {result['started']}, finished at step {result['step']}")
        print(f"weights {result['weights']}")
        break


if __name__ == "__main__":
    main()
