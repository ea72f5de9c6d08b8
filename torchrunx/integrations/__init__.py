"""Glue for training frameworks run inside a launch (see ``docs/frameworks.md``).

Every worker starts with the variables ``torchrun`` sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RUN_ID``...) and with the default process group already initialised, so most
frameworks need nothing from this package:

* Hugging Face Transformers ``Trainer`` and Accelerate read the variables and keep the
  existing process group (``torch.distributed.is_initialized()``). On a host where torch
  sees no GPU (nor any other accelerator), they would run each worker on its own (Accelerate
  distributes over CPU processes only when told to): :func:`framework_env` tells them, with
  ``ACCELERATE_USE_CPU=true``.
* DeepSpeed's ``deepspeed.initialize`` keeps it too.
* Lightning (``Trainer`` and ``Fabric``) picks its ``TorchElasticEnvironment`` by itself,
  because ``TORCHELASTIC_RUN_ID`` is set; :mod:`torchrunx.integrations.lightning` has
  :class:`~torchrunx.integrations.lightning.TorchrunxEnvironment` for code that passes a
  cluster environment explicitly (torchrunx 0.4's ``TorchrunxClusterEnvironment``).

The framework modules are imported only when asked for, so ``import torchrunx.integrations``
needs no framework installed.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torchrunx.integrations.lightning import TorchrunxClusterEnvironment, TorchrunxEnvironment

__all__ = ["TorchrunxClusterEnvironment", "TorchrunxEnvironment", "framework_env"]


def framework_env(environ: Mapping[str, str], *, gpus: int) -> dict[str, str]:
    """Variables that frameworks read, for one worker; called by the worker before ``func``.

    ``ACCELERATE_USE_CPU=true`` where the host has no GPU that torch (or any other torch
    accelerator) can use, unless the variable is already set: Accelerate, and Transformers'
    ``Trainer`` through it, then use the launch's process group on CPU (``MULTI_CPU``)
    instead of training one model per worker. Nothing is set where torch is not imported
    (``backend=None``).

    Args:
        environ: The worker's environment so far.
        gpus: The number of GPUs the agent counted on this host.
    """
    torch = sys.modules.get("torch")
    if torch is None or gpus > 0 or "ACCELERATE_USE_CPU" in environ:
        return {}
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, ROCm, XPU, ...
    found = accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
    return {} if found else {"ACCELERATE_USE_CPU": "true"}


def __getattr__(name: str) -> Any:  # noqa: ANN401 (a class of an optional framework)
    """Import a framework's glue on first use (Lightning is needed only for its names)."""
    if name in ("TorchrunxClusterEnvironment", "TorchrunxEnvironment"):
        return getattr(importlib.import_module("torchrunx.integrations.lightning"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
