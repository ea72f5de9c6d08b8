"""torchrunx: run a PyTorch function on many GPUs and machines, and get every rank's result.

Example::

    import torchrunx as trx

    result = trx.launch(train, func_args=(10,), hostnames=["node1", "node2"], workers_per_host=2)
    loss0 = result.rank(0)
"""

from __future__ import annotations

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
