"""GPU conventions without a GPU: device and backend choice as pure code, and fake GPUs.

A fake ``nvidia-smi`` first on ``PATH`` makes the probe (``devices.count_local_gpus``) count GPUs
on this machine, in the launcher (the dry run) and in a local agent (its hello); no CUDA is
needed until a worker selects its device.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchrunx as trx
from torchrunx import events as ev
from torchrunx.devices import cuda_device, device_env, process_group_options, resolve_backend
from torchrunx.wire.messages import WorkerSpec


@pytest.fixture
def fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """Two fake GPUs on this machine: an ``nvidia-smi`` that lists them, first on ``PATH``."""
    if Path("/proc/driver/nvidia/gpus").is_dir():
        pytest.skip("this machine has an NVIDIA driver: /proc answers before nvidia-smi")
    folder = tmp_path / "fake-bin"
    folder.mkdir()
    fake = folder / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = -L ] || exit 9\n'
        "echo 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n"
        "echo 'GPU 1: NVIDIA H100 (UUID: GPU-1)'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return 2


# -- pure: a worker's devices and process-group arguments from its host's GPU count ---------


def test_every_worker_sees_every_gpu_by_default():
    # torchrun's convention: nothing hides GPUs, LOCAL_RANK picks one.
    env = device_env({}, local_rank=1, local_world_size=2, gpus=2, cpus=4)
    assert env == {"OMP_NUM_THREADS": "2"}
    assert cuda_device(local_rank=1, gpus=2, isolated="CUDA_VISIBLE_DEVICES" in env) == 1
    assert trx.Launcher().isolate_gpus is False
    assert WorkerSpec(0, "h", 2, 0, 2, "a", 1, "nccl", 600).isolate_gpus is False


def test_isolation_is_an_opt_in_and_its_one_device_is_cuda_0():
    env = device_env({}, local_rank=3, local_world_size=4, gpus=2, cpus=8, isolate_gpus=True)
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "2"}
    assert cuda_device(local_rank=3, gpus=2, isolated=True) == 0
    # CUDA_VISIBLE_DEVICES already set (SLURM, the user): left alone, LOCAL_RANK picks among it.
    user = {"CUDA_VISIBLE_DEVICES": "4,5"}
    env = device_env(user, local_rank=1, local_world_size=2, gpus=2, cpus=8, isolate_gpus=True)
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert cuda_device(local_rank=1, gpus=2, isolated=False) == 1


def test_cuda_device_wraps_around_and_is_none_without_gpus():
    assert cuda_device(local_rank=5, gpus=4, isolated=False) == 1
    assert cuda_device(local_rank=0, gpus=0, isolated=False) is None
    assert cuda_device(local_rank=0, gpus=0, isolated=True) is None


def test_nccl_binds_the_group_to_the_workers_device():
    options = process_group_options("nccl", rank=3, world_size=4, timeout=1.5, device=1)
    assert options == {
        "backend": "nccl",
        "init_method": "env://",
        "rank": 3,
        "world_size": 4,
        "timeout": dt.timedelta(seconds=1.5),
        "device_id": torch.device("cuda", 1),
    }
    # gloo, or no GPU: no device.
    assert "device_id" not in process_group_options(
        "gloo", rank=0, world_size=2, timeout=60, device=1
    )
    assert "device_id" not in process_group_options(
        "nccl", rank=0, world_size=2, timeout=60, device=None
    )


@pytest.mark.parametrize(
    ("backend", "hosts", "expected"),
    [
        ("auto", [(8, 8), (4, 4)], "nccl"),
        ("auto", [(2, 8)], "nccl"),  # fewer workers than GPUs
        ("auto", [(None, 2)], "nccl"),  # workers "auto": one per GPU
        ("auto", [(8, 8), (4, 0)], "gloo"),  # one host without a GPU: gloo for every host
        ("auto", [(None, 0)], "gloo"),
        ("auto", [(3, 2)], "gloo"),  # a worker without a GPU of its own
        ("auto", [(2, None)], "auto"),  # a remote host, not counted yet
        ("auto", [(2, None), (2, 0)], "gloo"),  # ... unless another host already rules out nccl
        ("auto", [], "gloo"),
        ("gloo", [(8, 8)], "gloo"),  # an explicit backend is kept
        ("nccl", [(2, 0)], "nccl"),
        (None, [(8, 8)], None),
    ],
)
def test_resolve_backend(backend, hosts, expected):
    assert resolve_backend(backend, hosts) == expected


# -- fake GPUs: the probe, the dry run, and a launch whose agent reports them ---------------


def test_dry_run_counts_this_machines_gpus(fake_gpus):
    text = trx.Launcher(hostnames=["localhost"], workers_per_host=2).dry_run()
    assert "backend: nccl (" in text, text
    assert "GPUs counted here: localhost 2" in text, text
    # Workers "auto": one per GPU.
    assert "backend: nccl (" in trx.Launcher(hostnames=["localhost"]).dry_run()
    # More workers than GPUs: one would have none.
    text = trx.Launcher(hostnames=["localhost"], workers_per_host=3).dry_run()
    assert "backend: gloo (" in text, text


def test_dry_run_of_remote_hosts_states_the_rule(fake_gpus):
    text = trx.Launcher(hostnames=["localhost", "far.invalid"], workers_per_host=2).dry_run()
    assert "backend: auto (" in text, text
    assert "decided when the agents report their GPUs" in text, text
    assert "nccl if every host has a GPU for each of its workers, else gloo" in text, text


def test_dry_run_without_gpus_says_gloo(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever this machine has
    text = trx.Launcher(hostnames=["localhost"], workers_per_host=2).dry_run()
    assert "backend: gloo (" in text, text
    assert "nccl" not in text.split("\n\n")[0], text


def visible_devices() -> tuple[str, str | None]:
    return os.environ["LOCAL_RANK"], os.environ.get("CUDA_VISIBLE_DEVICES")


def test_agents_report_gpus_and_auto_is_gloo_when_a_worker_has_none(fake_gpus):
    seen: list[ev.Event] = []
    result = trx.Launcher(
        hostnames=["localhost"], workers_per_host=3, event_handlers=(seen.append,)
    ).run(visible_devices)
    # Default: no isolation, every worker sees every GPU.
    assert result.ranks == [("0", None), ("1", None), ("2", None)]
    (agent,) = [e for e in seen if isinstance(e, ev.AgentStarted)]
    assert agent.gpus == fake_gpus
    (started,) = [e for e in seen if isinstance(e, ev.WorkersStarted)]
    assert started.backend == "gloo"  # 3 workers, 2 GPUs: one worker would have none


def test_auto_is_nccl_for_every_worker_when_each_has_a_gpu(fake_gpus):
    """The fake GPUs make the launch choose nccl; without CUDA the worker fails selecting one."""
    seen: list[ev.Event] = []
    launcher = trx.Launcher(
        hostnames=["localhost"], workers_per_host=2, event_handlers=(seen.append,)
    )
    with pytest.raises(Exception) as caught:  # noqa: PT011 (torch's CPU build: its own type)
        launcher.run(visible_devices)
    (started,) = [e for e in seen if isinstance(e, ev.WorkersStarted)]
    assert started.backend == "nccl"
    remote = str(caught.value.__cause__)  # the worker's traceback
    assert "torch.cuda.set_device" in remote, remote


def test_isolate_gpus_is_an_opt_in(fake_gpus):
    local = {"hostnames": ["localhost"], "workers_per_host": 2, "backend": None}
    assert trx.Launcher(**local).run(visible_devices).ranks == [("0", None), ("1", None)]
    isolated = trx.Launcher(**local, isolate_gpus=True).run(visible_devices)
    assert isolated.ranks == [("0", "0"), ("1", "1")]


def test_command_gives_a_function_every_gpu_too(fake_gpus, tmp_path):
    # The command's defaults are trx.launch's: a function is not isolated either.
    argv = ["--hostnames", "localhost", "--workers-per-host", "2", "--backend", "None"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchrunx",
            *argv,
            "--",
            "os:getenv",
            "CUDA_VISIBLE_DEVICES",
            "unset",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == '"unset"', done.stdout  # rank 0's getenv


def test_dry_run_says_auto_means_one_worker_per_core_where_there_is_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever this machine has
    text = trx.Launcher(hostnames=["localhost"], backend=None).dry_run()
    assert (
        f"(auto on localhost: no GPU there, so one worker per CPU core, {os.cpu_count()} on this "
        "machine; give workers_per_host=N for fewer)"
    ) in text.splitlines()


def test_dry_run_says_nothing_of_cores_where_auto_counts_gpus(fake_gpus):
    text = trx.Launcher(hostnames=["localhost"], backend=None).dry_run()
    assert "one worker per CPU core" not in text
