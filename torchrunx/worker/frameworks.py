"""What training frameworks read in a worker, set by the worker before it calls the function.

The worker-side glue of :mod:`torchrunx.integrations`, which re-exports :func:`framework_env`
(its documented path). It is apart from that package so that a worker never imports the
package's other modules: the 0.4 command-line shim (:mod:`torchrunx.integrations.cli`) is the
launcher's side.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["framework_env"]


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
