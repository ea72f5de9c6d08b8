"""Training frameworks inside a launch: Transformers, Accelerate, Lightning and DeepSpeed.

Each framework example runs as a user runs it (a script that launches, then loads back what
rank 0 saved), on the two SSH test hosts with two workers each (so every framework reads a
node rank and a local rank other than 0, as on GPU nodes); its own log and progress lines
must reach the launcher's console from rank 0 only, and rank 0's log file. A framework's
exception in one rank must come back with its type and traceback while the other ranks are
stopped. The frameworks are optional extras: outside CI a missing one skips its tests; on CI
(``CI`` set) it fails them.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import torchrunx as trx
from torchrunx.integrations import framework_env
from torchrunx.wire.lines import LineSplitter

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8


def need(module: str, request: pytest.FixtureRequest) -> None:
    """Skip the test where ``module`` is not installed, except on CI, where that fails it.

    For DeepSpeed, also have its CPU op compiled (:func:`deepspeed_ops`).
    """
    if importlib.util.find_spec(module) is None:
        reason = f"{module} is not installed (pip install -e '.[frameworks]')"
        if os.environ.get("CI"):
            pytest.fail(f"required on CI: {reason}")
        pytest.skip(reason)
    if module == "deepspeed":
        request.getfixturevalue("deepspeed_ops")


EXTENSIONS = (
    Path.home()
    / ".cache"
    / "torchrunx-tests"
    / "torch_extensions"
    / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
)
"""Where the tests have torch build DeepSpeed's op: a folder only :func:`deepspeed_ops` builds in.

One per Python environment: the build's command names the environment's paths, so two
checkouts (CI's clone and a working copy) sharing one folder rebuilt it in turn, each time
the other had run (2.5 minutes on two cores, inside the suite's time)."""


def build_deepspeed_ops() -> None:
    """Compile DeepSpeed's C++ op for CPU collectives in :data:`EXTENSIONS` (quick if it is).

    The first engine on a machine compiles it (a minute on two cores, with a C++ compiler);
    done inside a launch, that would count against the test's time and crowd the machine.
    ``scripts/test.sh`` runs this (``python tests/test_frameworks.py``) as a build step after
    installing DeepSpeed, so the suite finds it built; :func:`deepspeed_ops` runs it too.

    torch guards a build with a bare ``lock`` file, which a killed build (or a worker killed
    while it loads the op) leaves behind, and every later load then waits on it for ever. So the
    tests build in their own folder, under an ``flock`` (which dies with its holder), and remove
    such a leftover ``lock`` first: while the flock is held, no build of theirs is running there.
    """
    EXTENSIONS.mkdir(parents=True, exist_ok=True)
    build = "from deepspeed.accelerator import get_accelerator as a\n"
    build += "a().create_op_builder('ShareMemCommBuilder').load()"
    with (EXTENSIONS / "tests.flock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for stale in EXTENSIONS.glob("*/lock"):
            stale.unlink()
        done = subprocess.run(
            [sys.executable, "-c", build],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(EXTENSIONS)},
        )
    assert done.returncode == 0, f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"


@pytest.fixture(scope="session")
def deepspeed_ops() -> Iterator[None]:
    """DeepSpeed's C++ op for CPU collectives, compiled once, before any launch needs it.

    The launches of this session find the op through ``TORCH_EXTENSIONS_DIR`` (a ``TORCH*``
    variable: copied to the workers by default).
    """
    build_deepspeed_ops()
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS)
    yield
    if before is None:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = before


@dataclass(frozen=True)
class Example:
    """A framework example and what its rank 0 must show (regexes, without the host prefix)."""

    script: str
    module: str
    rank0_lines: tuple[str, ...]


EXAMPLES = {
    "transformers": Example(
        "06_transformers.py",
        "transformers",
        (
            r"\[transformers\] \*\*\*\*\* Running training \*\*\*\*\*",  # Trainer's logger
            # 8 per device on 4 workers: one model trained by all (DDP), not one model each.
            r"\[transformers\]   Total train batch size \(w\. parallel, distributed & accumulation\) = 32",
            r"\{'loss': '[\d.]+', 'grad_norm': .*\}",  # Trainer's metrics, printed
            rf" *50%\|█+ *\| {STEPS // 2}/{STEPS} \[.*\]",  # tqdm redraws as lines, as they come
            rf"100%\|█+\| {STEPS}/{STEPS} \[.*\]",
        ),
    ),
    "accelerate": Example(
        "07_accelerate.py",
        "accelerate",
        (
            # Accelerate's logger; MULTI_CPU: torchrunx set ACCELERATE_USE_CPU on this CPU host.
            r"\[RANK 0\] 4 processes \(DistributedType\.MULTI_CPU\), \d+ batches each",
            rf"\[RANK 0\] step {STEPS}: loss [\d.]+",
            rf"100%\|█+\| {STEPS}/{STEPS} \[.*\]",  # tqdm
        ),
    ),
    "lightning_trainer": Example(
        "08_lightning_trainer.py",
        "lightning",
        (
            r"GPU available: False, used: False",  # Lightning's logger
            r"Total params: 321 *",  # the model summary
            rf"`Trainer\.fit` stopped: `max_steps={STEPS}` reached\.",
            rf"Epoch 0.* {STEPS}/{STEPS} .*",  # the progress bar, closed
        ),
    ),
    "lightning_fabric": Example(
        "09_lightning_fabric.py",
        "lightning",
        (r"\[rank: 0\] Seed set to 0", rf"step {STEPS}: loss [\d.]+"),
    ),
    "deepspeed": Example(
        "10_deepspeed.py",
        "deepspeed",
        (
            # DeepSpeed's logger (its own handler, on stdout), and the print of its CPU op.
            r"\[.+\] \[WARNING\] \[real_accelerator\.py:\d+:get_accelerator\] Setting accelerator to CPU\. .*",
            r"DeepSpeed deepspeed\.ops\.comm\.deepspeed_shm_comm_op built successfully",
        ),
    ),
}
"""Every framework example, by framework (tests/test_examples.py runs the others)."""

RESULT_LINES = (
    r"4 workers trained; rank 0 saved {out}.*",
    r"devices: \[" + ", ".join([r"'cpu(:0)?'"] * 4) + r"\]",
    r"loaded back: eval loss (\d+\.\d+) \(rank 0 measured \1\)",  # complete when launch returned
)


def run_example(example: Example, tmp_path: Path, *launcher_args: str) -> list[str]:
    """Run the example's script with a few steps; return its stdout lines."""
    script = ROOT / "examples" / example.script
    args = ["--steps", str(STEPS), "--out-dir", str(tmp_path / "out"), *launcher_args]
    process = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:  # DeepSpeed's first engine on a machine compiles a C++ op: allow for it
        stdout, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # as Ctrl-C: the launcher stops what it started
        try:
            stdout, stderr = process.communicate(timeout=30)
        finally:
            process.kill()
        pytest.fail(f"{example.script} hung\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")
    assert process.returncode == 0, f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    assert "\r" not in stdout, "a progress bar's carriage returns reached the console"
    return stdout.splitlines()


def check_output(example: Example, lines: list[str], rank0: str, out: Path, logs: Path) -> None:
    """Rank 0's framework lines on the console and in its log file; the result loaded back."""
    text = "\n".join(lines)
    for pattern in example.rank0_lines:
        regex = re.compile(re.escape(f"[{rank0}] ") + pattern)
        assert any(regex.fullmatch(line) for line in lines), f"no {regex.pattern!r} in:\n{text}"
    for pattern in RESULT_LINES:
        regex = re.compile(pattern.replace("{out}", re.escape(str(out))))
        assert any(regex.fullmatch(line) for line in lines), f"no {regex.pattern!r} in:\n{text}"
    others = [line for line in lines if re.match(r"\[[^\]]+:\d+\] ", line)]
    assert not [line for line in others if not line.startswith(f"[{rank0}] ")], "not rank 0's"

    (folder,) = (path for path in logs.iterdir() if path.is_dir() and not path.is_symlink())
    rank0_file = (folder / f"{rank0.replace(':', '[')}].log").read_text()
    for pattern in example.rank0_lines:
        assert re.search(rf"^\S+ \S+ \w+ \S+: {pattern}$", rank0_file, re.MULTILINE), (
            f"no {pattern!r} in rank 0's log file:\n{rank0_file}"
        )
    assert "\r" not in rank0_file


@pytest.mark.cluster
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_on_two_hosts_with_two_workers_each(name, cluster, tmp_path, log_dir, request):
    """Two hosts x two workers: ranks 0-3, node ranks 0-1, local ranks 0-1 (one host with two
    workers, the examples' default, was a test of its own; each framework reads the same
    variables either way, and this one run costs a launcher and an agent fewer)."""
    example = EXAMPLES[name]
    need(example.module, request)
    lines = run_example(
        example,
        tmp_path,
        *("--hostnames", *cluster.names(), "--workers-per-host", "2"),
        *("--ssh-config-file", str(cluster.ssh_config)),
    )
    check_output(example, lines, f"{cluster.names()[0]}:0", tmp_path / "out", log_dir)


# -- a framework's exception in one rank ----------------------------------------------------


def transformers_without_labels_on_rank_1(out_dir: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    rows = torch.zeros(32, 8, dtype=torch.long)
    keep_labels = dist.get_rank() != 1
    data = [{"input_ids": row, **({"labels": row} if keep_labels else {})} for row in rows]
    args = TrainingArguments(output_dir=out_dir, max_steps=2, report_to="none", save_strategy="no")
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data).train()


def accelerate_misconfigured_on_rank_1(_: str) -> None:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    both = dist.get_rank() == 1  # Accelerate takes the steps or the plugin, not both
    plugin = GradientAccumulationPlugin(num_steps=2) if both else None
    accelerator = Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=plugin)
    accelerator.prepare(torch.nn.Linear(2, 1))
    dist.barrier()


def lightning_step_without_loss_on_rank_1(out_dir: str) -> None:
    import torch
    from lightning import LightningModule, Trainer

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], _: int) -> object:
            loss = self.layer(batch[0]).pow(2).mean()
            return {"not_loss": loss} if self.global_rank == 1 else loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(32, 2))
    trainer = Trainer(
        devices=2, max_steps=4, logger=False, enable_checkpointing=False, default_root_dir=out_dir
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4))


def fabric_model_set_up_twice_on_rank_1(_: str) -> None:
    import torch
    from lightning import Fabric

    fabric = Fabric(devices=2)
    fabric.launch()
    model = fabric.setup(torch.nn.Linear(2, 1))
    if fabric.global_rank == 1:
        fabric.setup(model)
    fabric.barrier()


def deepspeed_batch_mismatch_on_rank_1(_: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    model = torch.nn.Linear(2, 1)
    config = {
        "train_batch_size": 8,  # = micro batch * accumulation * world size: 4 * 1 * 2, not 8 * ...
        "train_micro_batch_size_per_gpu": 8 if dist.get_rank() == 1 else 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dist.barrier()


@dataclass(frozen=True)
class Failure:
    """A function that makes a framework raise in rank 1 only, and what must come back."""

    module: str
    func: Callable[[str], None]  # given a folder it may write to
    error: str  # the exception's class, with its module
    message: str
    raised_in: str  # a file of the framework in the remote traceback


FAILURES = {
    "transformers": Failure(
        "transformers",
        transformers_without_labels_on_rank_1,
        "builtins.ValueError",
        "The model did not return a loss",
        "transformers/trainer.py",
    ),
    "accelerate": Failure(
        "accelerate",
        accelerate_misconfigured_on_rank_1,
        "builtins.ValueError",
        "only pass one of `gradient_accumulation_steps`",
        "accelerate/accelerator.py",
    ),
    "lightning_trainer": Failure(
        "lightning",
        lightning_step_without_loss_on_rank_1,
        "lightning.fabric.utilities.exceptions.MisconfigurationException",
        "the 'loss' key needs to be present",
        "lightning/pytorch/loops/",
    ),
    "lightning_fabric": Failure(
        "lightning",
        fabric_model_set_up_twice_on_rank_1,
        "builtins.ValueError",
        "A model should be passed only once",
        "lightning/fabric/fabric.py",
    ),
    "deepspeed": Failure(
        "deepspeed",
        deepspeed_batch_mismatch_on_rank_1,
        "builtins.AssertionError",
        "Gradient accumulation steps: 0",
        "deepspeed/runtime/config.py",
    ),
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_framework_error_in_one_rank(name, request, tmp_path):
    failure = FAILURES[name]
    need(failure.module, request)
    started = time.monotonic()
    with pytest.raises(Exception, match=re.escape(failure.message)) as info:
        trx.launch(
            failure.func,
            (str(tmp_path),),
            hostnames=["localhost"],
            workers_per_host=2,
            backend="gloo",
        )
    assert time.monotonic() - started < 90  # rank 0, waiting in a collective, was stopped
    error = type(info.value)
    assert f"{error.__module__}.{error.__qualname__}" == failure.error
    traceback = str(info.value.__cause__)  # the remote traceback, down into the framework
    assert f"in {failure.func.__name__}" in traceback and failure.raised_in in traceback, traceback
    assert any("rank 1" in note and "'localhost'" in note for note in info.value.__notes__)


# -- Lightning's cluster environment --------------------------------------------------------


def lightning_environments() -> dict[str, object]:
    from lightning import Trainer

    import torchrunx.integrations
    from torchrunx.integrations.lightning import TorchrunxClusterEnvironment, TorchrunxEnvironment

    # As in agents started with srun inside an allocation: SLURM describes the agents.
    os.environ.update(SLURM_NTASKS="2", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_JOB_NAME="j")
    found = Trainer(devices=2, accelerator="cpu", logger=False)
    explicit = Trainer(devices=2, accelerator="cpu", logger=False, plugins=[TorchrunxEnvironment()])
    try:  # Lightning computes its world size when the Trainer is made
        Trainer(devices=4, accelerator="cpu", logger=False, plugins=[TorchrunxEnvironment()])
    except ValueError as exc:
        mismatch = str(exc)
    return {
        "found": type(found.strategy.cluster_environment).__name__,
        "ranks": (found.global_rank, found.world_size, explicit.global_rank, explicit.world_size),
        "explicit": type(explicit.strategy.cluster_environment).__name__,
        "mismatch": mismatch,
        "names": TorchrunxClusterEnvironment is TorchrunxEnvironment
        and torchrunx.integrations.TorchrunxClusterEnvironment is TorchrunxEnvironment
        and torchrunx.integrations.TorchrunxEnvironment is TorchrunxEnvironment,
        "detect": TorchrunxEnvironment.detect(),
    }


def test_lightning_finds_the_launch_without_glue_code(request):
    need("lightning", request)
    result = trx.launch(
        lightning_environments, hostnames=["localhost"], workers_per_host=2, backend="gloo"
    )
    for rank, got in enumerate(result.ranks):
        # Lightning chose the variables of the launch over SLURM's, by itself.
        assert got["found"] == "TorchElasticEnvironment"
        assert got["explicit"] == "TorchrunxEnvironment"
        assert got["ranks"] == (rank, 2, rank, 2)
        assert got["names"] is True and got["detect"] is True
        assert got["mismatch"] == (
            "Lightning was given devices * num_nodes = 4 processes, but this launch has "
            "WORLD_SIZE=2 (LOCAL_WORLD_SIZE=2 on this host): pass devices=2 and num_nodes=1"
        )


# -- pure glue ------------------------------------------------------------------------------


def test_progress_bar_redraws_become_lines_as_they_come():
    splitter = LineSplitter()
    assert splitter.feed(b"\r  0%|  | 0/8") == []
    assert splitter.feed(b"\r 50%|# | 4/8") == ["  0%|  | 0/8"]  # ended by the next redraw
    # A record logged while the bar is drawn starts its own line; a bar clearing itself
    # ("\r   \r") leaves no blank line; "\r\n" is one line end.
    record = b"\x1e30\x1fpy.warnings\x1fcareful"
    assert splitter.feed(record + b"\n\r      \r") == [" 50%|# | 4/8", record.decode()]
    assert splitter.feed(b"{'loss': 1.0}\r\n\r100%|##| 8/8\n") == ["{'loss': 1.0}", "100%|##| 8/8"]
    assert splitter.feed(b"done\r") == ["done"]
    assert splitter.feed(b"\n") == []  # the "\n" of "done\r\n": no extra empty line
    assert splitter.feed(b"\n") == [""]  # an empty line stays one
    assert splitter.feed(b"") == []


def fake_torch(*, accelerator: bool) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.accelerator = types.SimpleNamespace(is_available=lambda: accelerator)
    return torch


def test_accelerate_is_told_to_use_the_cpu_only_where_nothing_else_is_there(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(accelerator=False))
    assert framework_env({}, gpus=0) == {"ACCELERATE_USE_CPU": "true"}
    assert framework_env({}, gpus=2) == {}  # GPUs counted by the agent
    assert framework_env({"ACCELERATE_USE_CPU": "false"}, gpus=0) == {}  # the user's own choice
    monkeypatch.setitem(sys.modules, "torch", fake_torch(accelerator=True))  # ROCm, XPU...
    assert framework_env({}, gpus=0) == {}
    monkeypatch.delitem(sys.modules, "torch")  # backend=None: torch not imported
    assert framework_env({}, gpus=0) == {}


if __name__ == "__main__":  # scripts/test.sh: the op built before the suite, as a build step
    build_deepspeed_ops()
