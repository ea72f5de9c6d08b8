"""torchrunx: run a PyTorch function on many GPUs and machines, and get every rank's result.

Example::

    import torchrunx as trx

    result = trx.launch(train, func_args=(10,), hostnames=["node1", "node2"], workers_per_host=2)
    loss0 = result.rank(0)

The public names are imported on first use, so agents and workers (which import
``torchrunx.agent`` and ``torchrunx.worker``) never load the launcher's side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrunx.errors import (
        AgentFailedError,
        LaunchTimeoutError,
        SerializationError,
        TorchrunxError,
        WorkerFailedError,
        WorkerRaisedError,
    )
    from torchrunx.launcher import Launcher, launch
    from torchrunx.logs import add_filter_to_handler, file_handler, stream_handler
    from torchrunx.results import LaunchResult

__all__ = [
    "AgentFailedError",
    "LaunchResult",
    "LaunchTimeoutError",
    "Launcher",
    "SerializationError",
    "TorchrunxError",
    "WorkerFailedError",
    "WorkerRaisedError",
    "add_filter_to_handler",
    "file_handler",
    "launch",
    "stream_handler",
]

_HOME = {
    "AgentFailedError": "torchrunx.errors",
    "LaunchTimeoutError": "torchrunx.errors",
    "SerializationError": "torchrunx.errors",
    "TorchrunxError": "torchrunx.errors",
    "WorkerFailedError": "torchrunx.errors",
    "WorkerRaisedError": "torchrunx.errors",
    "Launcher": "torchrunx.launcher",
    "launch": "torchrunx.launcher",
    "add_filter_to_handler": "torchrunx.logs",
    "file_handler": "torchrunx.logs",
    "stream_handler": "torchrunx.logs",
    "LaunchResult": "torchrunx.results",
}


def __getattr__(name: str) -> object:
    """Import a public name from its module on first use."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrunx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and the module's own attributes."""
    return sorted({*globals(), *__all__})
