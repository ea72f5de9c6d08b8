"""What each worker uses (``torchrunx.agent.usage``): nvidia-smi's answers as pure code, /proc
read from real processes, and a fake ``nvidia-smi`` on ``PATH`` for the GPU figures."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchrunx.agent.usage import (
    GPU_EVERY,
    GPU_FAILURES,
    MIB,
    GpuQueries,
    UsageSampler,
    gpu_by_pid,
    parse_apps,
    parse_gpus,
    read_proc,
)

# -- pure: nvidia-smi's CSV ---------------------------------------------------------------------

GPUS = "GPU-aaa, 37\nGPU-bbb, 90\nGPU-ccc, [N/A]\n\n"
APPS = (
    "101, GPU-aaa, 1536\n"
    "102, GPU-bbb, 2048\n"
    "102, GPU-aaa, 512\n"  # one process on two GPUs
    "103, GPU-ccc, [N/A]\n"  # what a MIG instance or a container may report
    "garbage line\n"
)


def test_rule_nvidia_smi_lines_are_parsed_field_by_field():
    assert parse_gpus(GPUS) == {"GPU-aaa": 37, "GPU-bbb": 90, "GPU-ccc": None}
    assert parse_apps(APPS) == [
        (101, "GPU-aaa", 1536),
        (102, "GPU-bbb", 2048),
        (102, "GPU-aaa", 512),
        (103, "GPU-ccc", None),
    ]
    assert parse_gpus("") == {} and parse_apps("No running processes found\n") == []


def test_rule_a_process_gets_its_busiest_gpu_and_the_memory_it_holds_on_all():
    figures = gpu_by_pid(parse_gpus(GPUS), parse_apps(APPS))
    assert figures[101] == (37, 1536 * MIB)
    assert figures[102] == (90, (2048 + 512) * MIB)
    assert figures[103] == (None, None)  # nothing known: "-" in the view
    assert 104 not in figures  # a worker on no GPU


# -- /proc: real processes ----------------------------------------------------------------------


def test_cpu_and_memory_of_a_busy_process_and_none_for_a_gone_one():
    busy = subprocess.Popen([sys.executable, "-c", "x = bytearray(64 << 20)\nwhile True: pass"])
    try:
        sampler = UsageSampler(gpus=0)
        deadline = time.monotonic() + 30
        while (first := read_proc(busy.pid)) is None or first[1] < 64 << 20:
            assert time.monotonic() < deadline, first  # its 64 MiB are resident
            time.sleep(0.05)
        ((rank, pid, cpu, rss, gpu, gpu_memory),) = sampler.sample([(3, busy.pid)], 100.0)
        assert (rank, pid, cpu, gpu, gpu_memory) == (3, busy.pid, None, None, None)  # no rate yet
        assert rss >= 64 << 20
        time.sleep(0.5)
        ((_, _, cpu, _, _, _),) = sampler.sample([(3, busy.pid)], 100.5)
        assert cpu is not None and cpu > 5.0  # a busy loop (the machine is shared: not 100)
    finally:
        busy.kill()
        busy.wait()
    assert UsageSampler(gpus=0).sample([(3, busy.pid)], 101.0) == ()  # gone: no row
    assert read_proc(busy.pid) is None


# -- a fake nvidia-smi ----------------------------------------------------------------------------


def fake_nvidia_smi(folder: Path, pid_folder: Path) -> Path:
    """An ``nvidia-smi`` that lists two GPUs, and each pid written in ``pid_folder`` on GPU-0."""
    folder.mkdir(exist_ok=True)
    fake = folder / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  -L) echo 'GPU 0: NVIDIA H100 (UUID: GPU-0)'; echo 'GPU 1: NVIDIA H100 (UUID: GPU-1)';;\n"
        "  --query-gpu=uuid,utilization.gpu) echo 'GPU-0, 37'; echo 'GPU-1, 0';;\n"
        "  --query-compute-apps=pid,gpu_uuid,used_memory)\n"
        f'    for f in "{pid_folder}"/pid-*; do [ -e "$f" ] && echo "$(cat "$f"), GPU-0, 1536"; '
        "done;;\n"
        "  *) exit 9;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    return fake


def test_gpu_figures_come_from_nvidia_smi_in_the_background(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "pid-0").write_text(str(sleeper.pid))
        fake = fake_nvidia_smi(tmp_path / "bin", tmp_path)
        sampler = UsageSampler(gpus=2, nvidia_smi=str(fake))
        deadline = time.monotonic() + 30
        while True:  # the first sample starts the queries, a later one reads them
            ((_, _, _, _, gpu, gpu_memory),) = sampler.sample([(0, sleeper.pid)], time.monotonic())
            if gpu is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (gpu, gpu_memory) == (37, 1536 * MIB)
        sampler.close()
        assert sampler.gpu is not None and not sampler.gpu.running
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_failing_nvidia_smi_gives_no_figures_and_is_given_up(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    queries = GpuQueries(str(fake))
    deadline = time.monotonic() + 30
    clock = 0.0  # the agent's: the next query is due GPU_EVERY after the last one started
    while not queries.given_up:
        assert time.monotonic() < deadline, queries.failures
        queries.poll(clock)
        clock += 0.0 if queries.running else GPU_EVERY
        time.sleep(0.02)
    assert queries.failures == GPU_FAILURES and queries.figures == {} and not queries.running
    missing = GpuQueries(str(tmp_path / "absent"))  # not even there: no exception either
    for i in range(GPU_FAILURES):
        missing.poll(i * GPU_EVERY)
    assert missing.given_up


def test_a_host_without_gpus_never_runs_nvidia_smi():
    assert UsageSampler(gpus=0, nvidia_smi="/bin/false").gpu is None


STEPS = """
import os, sys, time
from pathlib import Path
import torchrunx as trx

def work(folder):
    Path(folder, f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
    while not Path(folder, "end").exists():
        time.sleep(0.05)
    return 1

print(trx.launch(work, (sys.argv[1],), hostnames=["localhost"], workers_per_host=2, backend=None))
"""


@pytest.mark.skipif(
    Path("/proc/driver/nvidia/gpus").is_dir(),
    reason="this machine has an NVIDIA driver: /proc answers before nvidia-smi",
)
def test_top_shows_each_ranks_gpu_figures_from_a_fake_nvidia_smi(tmp_path):
    fake = fake_nvidia_smi(tmp_path / "bin", tmp_path)
    (tmp_path / "steps.py").write_text(STEPS)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    launch = subprocess.Popen(
        [sys.executable, "steps.py", str(tmp_path)], cwd=tmp_path, env=env, text=True
    )
    try:
        deadline = time.monotonic() + 60
        rows: list[str] = []
        while len(rows) < 2:
            assert time.monotonic() < deadline, rows
            shown = subprocess.run(
                [sys.executable, "-m", "torchrunx", "top", "--pid", str(launch.pid), "--once"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            ).stdout
            # rank, host, state, age, "s", pid, cpu, rss, gpu%, gpu mem, collectives
            rows = [r for r in shown.splitlines() if r.split()[9:10] == ["1.5G"]]
            time.sleep(0.1)
        assert "gpu% gpu mem" in shown, shown
        for row in rows:
            fields = row.split()
            assert fields[8] == "37" and fields[7].endswith(("M", "K")), row
    finally:
        (tmp_path / "end").touch()
        launch.wait(timeout=120)
    assert launch.returncode == 0
