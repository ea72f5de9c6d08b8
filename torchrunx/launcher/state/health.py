"""The health report of a running launch, and the endpoint's settings from the environment.

:class:`HealthReport` is the snapshot that ``GET /health`` serves (the launch state makes it);
:func:`health_port_from_env`, :func:`health_host_from_env`, :func:`health_details_from_env` and
:func:`health_token_from_env` read where and how the launcher serves it. The server itself is
:mod:`torchrunx.launcher.view.health_server`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torchrunx.env import flag_from_env
from torchrunx.events import AgentState, WorkerState, dataclass_to_dict

if TYPE_CHECKING:
    from collections.abc import Mapping

ENV_VAR = "TORCHRUNX_HEALTH_CHECK_PORT"
"""The environment variable that turns the endpoint on when ``health_check_port`` is not set."""

HOST_ENV_VAR = "TORCHRUNX_HEALTH_CHECK_HOST"
"""The address the launcher serves the endpoint on (unset: ``127.0.0.1``; ``*``: every one)."""

DETAILS_ENV_VAR = "TORCHRUNX_HEALTH_CHECK_DETAILS"
"""``1`` serves the first line of each failure's message, not only its exception type."""

TOKEN_ENV_VAR = "TORCHRUNX_HEALTH_CHECK_TOKEN"  # noqa: S105 (a variable's name)
"""A token: when set, a request is answered only with ``Authorization: Bearer <token>``."""

DEFAULT_HOST = "127.0.0.1"
"""Where the launcher serves the endpoint unless :data:`HOST_ENV_VAR` says otherwise."""


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


# --------------------------------------------------------------------------------------------
# The port
# --------------------------------------------------------------------------------------------


def health_port_from_env(
    field_value: int | None, environ: Mapping[str, str] | None = None
) -> int | None:
    """The port to serve the health endpoint on, or None for no endpoint.

    Args:
        field_value: ``Launcher.health_check_port``; when not None it wins.
        environ: Where to read ``TORCHRUNX_HEALTH_CHECK_PORT`` (default: ``os.environ``). An
            unset or empty variable means no endpoint.

    Returns:
        A port number from 0 to 65535 (0: any free port), or None.

    Raises:
        ValueError: The field or the variable is not a port number from 0 to 65535.
    """
    if field_value is not None:
        if isinstance(field_value, bool) or not isinstance(field_value, int):
            raise TypeError(f"health_check_port must be an int or None, not {field_value!r}")
        if not 0 <= field_value <= 65535:
            raise ValueError(
                f"health_check_port={field_value} is not a port number (an integer from 0 to "
                "65535; 0: any free port)"
            )
        return field_value
    raw = (os.environ if environ is None else environ).get(ENV_VAR)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if re.fullmatch(r"[0-9]{1,5}", text) is None or int(text) > 65535:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not a port number (an integer from 0 to 65535; 0: any free "
            "port; empty or unset: no health endpoint)"
        )
    return int(text)


def health_host_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The address the launcher serves the endpoint on, from ``TORCHRUNX_HEALTH_CHECK_HOST``.

    Unset or empty: ``127.0.0.1`` (this machine only); ``*``: ``""``, every interface (IPv6
    and IPv4 where the machine has both); else the value, an address or a name of this machine
    (``0.0.0.0``: every IPv4 interface).
    """
    value = (os.environ if environ is None else environ).get(HOST_ENV_VAR, "").strip()
    if not value:
        return DEFAULT_HOST
    return "" if value == "*" else value


def health_token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The token requests must carry, from ``TORCHRUNX_HEALTH_CHECK_TOKEN`` (unset, empty: none)."""
    value = (os.environ if environ is None else environ).get(TOKEN_ENV_VAR, "").strip()
    return value or None


def health_details_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether failures are served with their messages (``TORCHRUNX_HEALTH_CHECK_DETAILS``).

    Raises:
        ValueError: The variable is neither ``1``, ``true``, ``yes``, ``on`` nor ``0``,
            ``false``, ``no``, ``off`` or empty (any case).
    """
    return flag_from_env(DETAILS_ENV_VAR, environ)
