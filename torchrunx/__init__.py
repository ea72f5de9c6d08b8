"""torchrunx: run a PyTorch function on many GPUs and machines, and get every rank's result.

Example::

    import torchrunx as trx

    result = trx.launch(train, func_args=(10,), hostnames=["node1", "node2"], workers_per_host=2)
    loss0 = result.rank(0)

The public names are imported on first use, so agents and workers (which import
``torchrunx.agent.agent`` and ``torchrunx.worker.worker``) never load the launcher's side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrunx.cli import add_launcher_arguments, launcher_from_args
    from torchrunx.env import DEFAULT_ENV_VARS_FOR_COPY
    from torchrunx.errors import (
        AgentFailedError,
        LaunchTimeoutError,
        Preempted,
        SerializationError,
        SlurmError,
        StallError,
        TorchrunxError,
        WorkerError,
        WorkerFailedError,
        WorkerRaisedError,
        WorkerTimeoutError,
    )
    from torchrunx.events import AgentState, WorkerState
    from torchrunx.launcher.launcher import Launcher, launch
    from torchrunx.launcher.state.results import LaunchResult, LaunchTimings
    from torchrunx.launcher.submit import SlurmJob, submit
    from torchrunx.launcher.warm import WarmLauncher
    from torchrunx.logs import LogSetup, add_filter_to_handler, file_handler, stream_handler
    from torchrunx.preemption import (
        on_preemption,
        preemption_deadline,
        preemption_reason,
        preemption_requested,
    )
    from torchrunx.stall import progress
    from torchrunx.worker.worker import worker_cache

__version__ = "0.5.0"
"""The release: the successor of the original torchrunx 0.4 (pyproject.toml reads it here)."""

__all__ = [  # noqa: RUF022 (plain sorted(), as tests/test_api.py checks, not isort's order)
    "AgentFailedError",
    "AgentState",
    "DEFAULT_ENV_VARS_FOR_COPY",
    "LaunchResult",
    "LaunchTimeoutError",
    "LaunchTimings",
    "Launcher",
    "LogSetup",
    "Preempted",
    "SerializationError",
    "SlurmError",
    "SlurmJob",
    "StallError",
    "TorchrunxError",
    "WarmLauncher",
    "WorkerError",
    "WorkerFailedError",
    "WorkerRaisedError",
    "WorkerState",
    "WorkerTimeoutError",
    "add_filter_to_handler",
    "add_launcher_arguments",
    "file_handler",
    "launch",
    "launcher_from_args",
    "on_preemption",
    "preemption_deadline",
    "preemption_reason",
    "preemption_requested",
    "progress",
    "stream_handler",
    "submit",
    "worker_cache",
]

_HOME = {
    "AgentFailedError": "torchrunx.errors",
    "LaunchTimeoutError": "torchrunx.errors",
    "SerializationError": "torchrunx.errors",
    "SlurmError": "torchrunx.errors",
    "SlurmJob": "torchrunx.launcher.submit",
    "StallError": "torchrunx.errors",
    "submit": "torchrunx.launcher.submit",
    "TorchrunxError": "torchrunx.errors",
    "Preempted": "torchrunx.errors",
    "on_preemption": "torchrunx.preemption",
    "preemption_deadline": "torchrunx.preemption",
    "preemption_reason": "torchrunx.preemption",
    "preemption_requested": "torchrunx.preemption",
    "progress": "torchrunx.stall",
    "WorkerError": "torchrunx.errors",
    "WorkerFailedError": "torchrunx.errors",
    "WorkerRaisedError": "torchrunx.errors",
    "WorkerTimeoutError": "torchrunx.errors",
    "AgentState": "torchrunx.events",
    "WorkerState": "torchrunx.events",
    "DEFAULT_ENV_VARS_FOR_COPY": "torchrunx.env",
    "add_launcher_arguments": "torchrunx.cli",
    "launcher_from_args": "torchrunx.cli",
    "Launcher": "torchrunx.launcher.launcher",
    "launch": "torchrunx.launcher.launcher",
    "LogSetup": "torchrunx.logs",
    "add_filter_to_handler": "torchrunx.logs",
    "file_handler": "torchrunx.logs",
    "stream_handler": "torchrunx.logs",
    "LaunchResult": "torchrunx.launcher.state.results",
    "LaunchTimings": "torchrunx.launcher.state.results",
    "WarmLauncher": "torchrunx.launcher.warm",
    "worker_cache": "torchrunx.worker.worker",
}

_SUBMODULES = frozenset({"timer", "events", "hosts"})
"""Modules reachable as attributes (``trx.timer.expires``) without an explicit import."""


def __getattr__(name: str) -> object:
    """Import a public name from its module on first use."""
    if name in _SUBMODULES:
        return importlib.import_module(f"torchrunx.{name}")
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrunx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and the module's own attributes."""
    return sorted({*globals(), *__all__})
