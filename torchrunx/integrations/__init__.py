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
needs no framework installed. :func:`framework_env`, which every worker calls, lives in
:mod:`torchrunx.worker.frameworks` (re-exported here): a worker imports nothing of this
package, whose :mod:`~torchrunx.integrations.cli` (0.4's ``argparse`` helpers) is the
launcher's side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchrunx.worker.frameworks import framework_env

if TYPE_CHECKING:
    from torchrunx.integrations.lightning import TorchrunxClusterEnvironment, TorchrunxEnvironment

__all__ = ["TorchrunxClusterEnvironment", "TorchrunxEnvironment", "framework_env"]


def __getattr__(name: str) -> Any:  # noqa: ANN401 (a class of an optional framework)
    """Import a framework's glue on first use (Lightning is needed only for its names)."""
    if name in ("TorchrunxClusterEnvironment", "TorchrunxEnvironment"):
        return getattr(importlib.import_module("torchrunx.integrations.lightning"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
