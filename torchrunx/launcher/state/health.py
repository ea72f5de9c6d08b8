"""The health report of a running launch.

:class:`HealthReport` is the snapshot that ``GET /health`` serves (the launch state makes it);
where and how the launcher serves it comes from the plan
(:mod:`torchrunx.launcher.settings.environ` reads the variables). The server itself is
:mod:`torchrunx.launcher.view.health_server`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from torchrunx.events import AgentState, WorkerState, dataclass_to_dict

# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentHealth:
    """One host's agent, as seen by the launcher."""

    host_index: int
    """The agent's index: its host's position in the launch's host list (spares after it)."""
    hostname: str
    """The host's name, as given to the launcher."""
    state: AgentState
    """Where the agent is in its life."""
    last_heartbeat_age: float | None
    """Seconds since the launcher last heard from the agent; None before it first did."""
    role: str = "host"
    """``"host"`` (it runs ranks), ``"spare"`` (it waits to replace a failed host) or
    ``"quarantined"`` (its host failed; it takes no further part)."""


@dataclass(frozen=True)
class WorkerHealth:
    """One worker of the current attempt."""

    rank: int | None
    """Global rank; None while not yet assigned."""
    host_index: int
    """Position of the worker's host in the launch's host list."""
    hostname: str
    """The worker's host."""
    local_rank: int
    """Rank among the workers of its host."""
    pid: int | None
    """Process id on its host; None before the agent forked it."""
    state: WorkerState
    """Where the worker is in its life."""
    cpu_percent: float | None = None
    """CPU it used (its own process) over the last second, in % of one core; None: unknown."""
    rss_bytes: int | None = None
    """Its resident memory, in bytes."""
    gpu_percent: int | None = None
    """The utilisation (%) of the busiest GPU it uses; None without GPU figures."""
    gpu_memory_bytes: int | None = None
    """The GPU memory its process holds, on all its GPUs, in bytes."""
    collectives: int | None = None
    """Collectives it completed (its flight recorder's count, sent with its progress while
    ``stall_timeout`` is on: up to 5 s old); None before the first."""


@dataclass(frozen=True)
class HealthReport:
    """A snapshot of one launch, as served by ``GET /health``."""

    healthy: bool
    """False once anything failed (until a restart's workers are all ``HEALTHY``); the status
    code is 200 when True, 503 when False."""
    launch_state: str
    """What the launch as a whole is doing (set by the launcher)."""
    attempt: int
    """The current attempt: 0 for the first, 1 after the first restart, ..."""
    restarts: int
    """Restarts done so far."""
    max_restarts: int
    """Restarts allowed."""
    uptime: float
    """Seconds since the launch started."""
    agents: tuple[AgentHealth, ...]
    """Every host's agent, by host index."""
    workers: tuple[WorkerHealth, ...]
    """Every worker of the current attempt, by host index and local rank."""
    failures: tuple[str, ...]
    """One line per failure seen so far in this launch, oldest first."""
    world_changes: tuple[str, ...] = ()
    """One line per host quarantined, replaced by a spare, or dropped, oldest first."""

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data.

        Keys are in field order (nested ones too), enums are their values and floats are
        rounded to the millisecond.
        """
        return dataclass_to_dict(self, ndigits=3)

    def to_json(self) -> bytes:
        """The report as UTF-8 JSON on one line, the body of ``GET /health``."""
        return json.dumps(self.to_dict(), allow_nan=False).encode()

    def redacted(self) -> HealthReport:
        """The report without failure messages: ``attempt N: Type: message`` -> ``attempt N: Type``.

        A message may hold anything the failing code put in it (a path, a URL with a password);
        the type says what kind of failure it was, and the log and the error raised say more.
        """
        return replace(self, failures=tuple(": ".join(f.split(": ", 2)[:2]) for f in self.failures))
