"""Environment forwarding: which launcher variables reach agents and workers.

Values never appear on a command line: they travel on the agent's stdin (see
:mod:`torchrunx.transport`), are exported by the agent's shell, and workers inherit them.
"""

from __future__ import annotations

import fnmatch
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

DEFAULT_ENV_VARS: tuple[str, ...] = (
    "PATH",
    "LD_LIBRARY_PATH",
    "LIBRARY_PATH",
    "PYTHON*",
    "CUDA*",
    "TORCH*",
    "PYTORCH*",
    "NCCL*",
    "OMP_*",
)
"""``fnmatch`` patterns of the launcher's variables that are copied by default."""

_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Variables that describe one process and must never be copied to another one.
_NEVER_FORWARDED = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHRUNX_RESTART_COUNT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
    }
)


def forwarded_env(
    patterns: Iterable[str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The launcher's variables whose names match any of ``patterns`` (``fnmatch``, case-sensitive).

    Per-process variables (``RANK``, ``MASTER_PORT``, ...) are never copied: every worker gets
    its own.
    """
    env = os.environ if environ is None else environ
    pattern_list = list(patterns)
    return {
        name: value
        for name, value in env.items()
        if name not in _NEVER_FORWARDED
        and _SHELL_NAME.fullmatch(name)  # a name bash can export; others cannot be forwarded
        and any(fnmatch.fnmatchcase(name, pattern) for pattern in pattern_list)
    }


def worker_env(  # noqa: PLR0913 (the variables torch.distributed expects, one argument each)
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    group_rank: int,
    master_addr: str,
    master_port: int,
    attempt: int = 0,
    max_restarts: int = 0,
) -> dict[str, str]:
    """The torch.distributed variables of one worker (torchrun's names), and its attempt.

    ``TORCHRUNX_RESTART_COUNT`` is 0 for the first worker group and n after the n-th
    restart; ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS`` carry the same
    for code written for torchrun.
    """
    return {
        "TORCHRUNX_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def device_env(  # noqa: PLR0913 (one argument per fact about the host)
    environ: Mapping[str, str],
    *,
    local_rank: int,
    local_world_size: int,
    gpus: int,
    cpus: int,
    isolate_gpus: bool = True,
) -> dict[str, str]:
    """Per-worker device settings, each only where the worker's environment lacks it.

    * ``CUDA_VISIBLE_DEVICES`` (with ``isolate_gpus``): on a host with GPUs, the worker's own
      device (``local_rank % gpus``), so every worker sees one GPU as ``cuda:0``.
    * ``OMP_NUM_THREADS``: the host's usable CPU cores shared among its workers (at least 1),
      so that workers do not oversubscribe the cores with OpenMP threads.
    """
    settings: dict[str, str] = {}
    if isolate_gpus and gpus > 0 and "CUDA_VISIBLE_DEVICES" not in environ:
        settings["CUDA_VISIBLE_DEVICES"] = str(local_rank % gpus)
    if "OMP_NUM_THREADS" not in environ:
        settings["OMP_NUM_THREADS"] = str(max(1, cpus // max(1, local_world_size)))
    return settings
