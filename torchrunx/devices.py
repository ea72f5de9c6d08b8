"""Devices: which GPUs a worker sees and uses, its CPU threads, and what ``backend="auto"`` is.

Pure functions, and the two probes of the agent's host. The agent counts its host's GPUs without
torch (:func:`count_local_gpus`)
and reports the count in its hello, so the launcher decides the backend once for the whole
launch, and each worker derives its device from that count and its ``LOCAL_RANK``::

    agent hello (workers, gpus) per host ──▶ resolve_backend ──▶ WorkerSpec.backend (concrete)
    worker: device_env (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS) ──▶ cuda_device
            ──▶ torch.cuda.set_device, init_process_group(..., device_id=cuda:index)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

AUTO_BACKEND_RULE = "nccl if every host has a GPU for each of its workers, else gloo"
"""What ``backend="auto"`` resolves to, in words (for docs, help and the dry run)."""


def device_env(  # noqa: PLR0913 (one argument per fact about the host)
    environ: Mapping[str, str],
    *,
    local_rank: int,
    local_world_size: int,
    gpus: int,
    cpus: int,
    isolate_gpus: bool = False,
) -> dict[str, str]:
    """Per-worker device settings, each only where the worker's environment lacks it.

    * ``CUDA_VISIBLE_DEVICES`` (only with ``isolate_gpus``): on a host with GPUs, the worker's
      own device (``local_rank % gpus``), so every worker sees one GPU as ``cuda:0``. Without
      it every worker sees every GPU of its host, as under torchrun.
    * ``OMP_NUM_THREADS``: the host's usable CPU cores shared among its workers (at least 1),
      so that workers do not oversubscribe the cores with OpenMP threads.
    """
    settings: dict[str, str] = {}
    if isolate_gpus and gpus > 0 and "CUDA_VISIBLE_DEVICES" not in environ:
        settings["CUDA_VISIBLE_DEVICES"] = str(local_rank % gpus)
    if "OMP_NUM_THREADS" not in environ:
        settings["OMP_NUM_THREADS"] = str(max(1, cpus // max(1, local_world_size)))
    return settings


def cuda_device(*, local_rank: int, gpus: int, isolated: bool) -> int | None:
    """The index of the CUDA device a worker uses, as its process numbers them; None: no GPU.

    Args:
        local_rank: The worker's ``LOCAL_RANK``.
        gpus: GPUs its host's agent counted (before any isolation).
        isolated: Whether :func:`device_env` gave the worker a ``CUDA_VISIBLE_DEVICES`` of
            its own (then its one device is ``cuda:0``).
    """
    if gpus <= 0:
        return None
    return 0 if isolated else local_rank % gpus


def resolve_backend(
    backend: str | None, hosts: Sequence[tuple[int | None, int | None]]
) -> str | None:
    """The backend every worker uses: ``backend`` itself, unless it is ``"auto"``.

    ``"auto"`` is ``"nccl"`` when every host has at least one GPU per worker, else ``"gloo"``
    (decided once for all workers: a group that mixes backends would hang). It stays
    ``"auto"`` while the answer depends on a count not known yet (the dry run of a remote host).

    Args:
        backend: The launcher's ``backend``.
        hosts: ``(workers, gpus)`` per host; ``workers`` None: as many as its GPUs (else CPU
            cores), ``gpus`` None: not counted yet.
    """
    if backend != "auto":
        return backend
    undecided = False
    for workers, gpus in hosts:
        if gpus is None:
            undecided = True
        elif gpus == 0 or (workers is not None and workers > gpus):
            return "gloo"
    if undecided:
        return "auto"
    return "nccl" if hosts else "gloo"


def process_group_options(
    backend: str, *, rank: int, world_size: int, timeout: float, device: int | None
) -> dict[str, Any]:
    """Keyword arguments of ``torch.distributed.init_process_group`` for one worker.

    With NCCL and a GPU, ``device_id`` binds the group to the worker's own device, so that
    barriers and collectives do not all land on ``cuda:0``.
    """
    import datetime as dt  # noqa: PLC0415 (a worker's, after torch imported it; not the agent's)

    options: dict[str, Any] = {
        "backend": backend,
        "init_method": "env://",
        "rank": rank,
        "world_size": world_size,
        "timeout": dt.timedelta(seconds=timeout),
    }
    if backend == "nccl" and device is not None:
        import torch  # noqa: PLC0415 (only workers with a backend import torch)

        options["device_id"] = torch.device("cuda", device)
    return options


# -- probes of this machine (the agent's hello) ---------------------------------------------

_NVIDIA_SMI_TIMEOUT = 10.0


_KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")
"""AMD's kernel driver (amdgpu's KFD) lists every CPU and GPU node here; a GPU has SIMDs."""
_VISIBLE = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
"""Variables that hide GPUs: CUDA's (which ROCm builds of torch honour too), then ROCm's."""


def count_local_gpus(
    environ: Mapping[str, str] | None = None, kfd_nodes: Path | None = None
) -> int:
    """GPUs this process may use, NVIDIA or AMD, without importing torch or initialising CUDA.

    The first of ``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES`` and ``ROCR_VISIBLE_DEVICES``
    that is set; else the NVIDIA driver's ``/proc/driver/nvidia/gpus``; else ``nvidia-smi -L``
    if installed; else the GPU nodes of AMD's KFD topology (``kfd_nodes``: what ``rocm-smi``
    reads); else 0.
    """
    env = os.environ if environ is None else environ
    visible = next((env[name] for name in _VISIBLE if name in env), None)
    if visible is not None:
        devices = []
        for device in (d.strip() for d in visible.split(",")):
            if not device or device.startswith("-"):
                break  # CUDA stops at the first invalid entry
            devices.append(device)
        return len(devices)
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return len(list(proc.iterdir()))
    return _nvidia_smi_gpus() or count_amd_gpus(_KFD_NODES if kfd_nodes is None else kfd_nodes)


def _nvidia_smi_gpus() -> int:
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return 0
    import subprocess  # noqa: PLC0415 (3 ms of the agent's start, where no nvidia-smi is run)

    try:
        listed = subprocess.run(
            [nvidia_smi, "-L"],
            capture_output=True,
            text=True,
            check=False,
            timeout=_NVIDIA_SMI_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if listed.returncode != 0:
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def count_amd_gpus(kfd_nodes: Path) -> int:
    """AMD GPUs in the KFD topology: the nodes whose ``properties`` give a ``simd_count`` > 0.

    A CPU node has none. An unreadable node counts as none (0 where there is no ``amdgpu``).
    """
    count = 0
    for properties in sorted(kfd_nodes.glob("*/properties")):
        try:
            lines = properties.read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(maxsplit=1) for line in lines if len(line.split()) == 2)
        simds = fields.get("simd_count", "0")
        if simds.isdigit() and int(simds) > 0:
            count += 1
    return count


def count_slots(workers: int | None, count: str, gpus: int, cpus: int) -> int:
    """Workers this host runs: the given number, else what ``count`` counts (0: no GPU)."""
    if workers is not None:
        return int(workers)
    if count == "gpu":
        return gpus  # 0 tells the launcher that workers_per_host="gpu" found none here
    if count == "cpu":
        return cpus
    return gpus or cpus


def count_local_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, as SLURM or taskset set it)."""
    return len(os.sched_getaffinity(0))
