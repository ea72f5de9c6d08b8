"""How the agent of one host is started: its script, its bootstrap line, and the transport.

The launcher's start threads (:mod:`torchrunx.agent_pool`) call :class:`AgentStarts` with a
host index; it picks the transport of :mod:`torchrunx.transport` (a local subprocess, SSH or
``srun``) and builds the one JSON line the agent reads first (:class:`AgentBootstrap`),
including the address the agent calls back on.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from torchrunx.env import local_agent_env
from torchrunx.errors import AgentFailedError
from torchrunx.hosts import slurm_allocation
from torchrunx.logs import parse_line
from torchrunx.protocol import HEARTBEAT_INTERVAL, AgentBootstrap
from torchrunx.transport import (
    AgentProcess,
    LocalAgent,
    SrunAgent,
    SshAgent,
    agent_script,
    route_address,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.launch_state import AgentRecord
    from torchrunx.launcher import Launcher
    from torchrunx.logs import Record


@dataclass
class AgentStarts:
    """Starts the agents of one launch; called with a host index, from a start thread."""

    launcher: Launcher
    agents: list[AgentRecord]
    """The launch state's agents (a replaced agent's new record shows up here)."""
    port: int
    secret: bytes
    log_level: int
    emit: Callable[[int, Record], None]
    """Where an agent's own stdout and stderr lines go: ``(host index, log record)``."""
    warm: bool = False
    """Warm agents: they stay after each run for the next (see :mod:`torchrunx.warm`)."""
    script: bytes = b""
    local_env: dict[str, str] = field(default_factory=local_agent_env)
    """This machine's agents start with the launcher's environment."""

    def prepare(self) -> None:
        """Build the script every agent runs first (the forwarded variables, ``env_file``)."""
        env_file = self.launcher.env_file
        self.script = agent_script(
            env=self.launcher.exported_env(),
            cwd=str(Path.cwd()),
            python=sys.executable,
            env_file=None if env_file is None else str(Path(env_file).expanduser().resolve()),
        )

    def __call__(self, index: int) -> AgentProcess:
        """Start the agent of host ``index``.

        Raises:
            AgentFailedError: It cannot be started (SSH, ``srun`` or ``fork`` failed).
        """
        agent = self.agents[index]
        hostname = agent.slots.hostname

        def on_line(is_stderr: bool, text: str) -> None:
            line = parse_line(text, is_stderr=is_stderr, default_name="agent")
            self.emit(index, (None, line.levelno, line.name, line.text, time.time()))

        if agent.method == "srun":
            return SrunAgent(
                hostname,
                self.script,
                self.bootstrap(agent, self.srun_address(hostname)),
                on_line,
                cpus=slurm_cpus(hostname),
            )
        if agent.method == "ssh":
            return SshAgent(
                hostname,
                self.script,
                lambda local_address: self.bootstrap(agent, local_address),
                self.launcher.ssh_config_file,
                connect_timeout=min(self.launcher.start_timeout, 30.0),
                on_line=on_line,
            )
        return LocalAgent(
            hostname,
            self.script,
            self.bootstrap(agent, "127.0.0.1"),
            on_line,
            environ=self.local_env,
        )

    def configured_address(self) -> str | None:
        """The launcher address the user set (field, else environment), if any."""
        return self.launcher.launcher_address or os.environ.get("TORCHRUNX_LAUNCHER_ADDR") or None

    def srun_address(self, hostname: str) -> str:
        """The address an srun-started agent connects back to (no SSH socket to ask).

        Raises:
            AgentFailedError: No route to ``hostname`` and no address was set.
        """
        configured = self.configured_address()
        if configured:
            return configured
        try:
            return route_address(hostname)
        except OSError as exc:
            raise AgentFailedError(
                hostname,
                f"cannot find this machine's address on the route to {hostname}: {exc}; "
                "set launcher_address (or TORCHRUNX_LAUNCHER_ADDR)",
            ) from exc

    def bootstrap(self, agent: AgentRecord, local_address: str) -> bytes:
        """The agent's bootstrap line; ``local_address``: this machine's, as the host sees it."""
        address = (self.configured_address() or local_address) if agent.remote else local_address
        return AgentBootstrap(
            host_index=agent.index,
            hostname=agent.slots.hostname,
            launcher_address=address,
            launcher_port=self.port,
            secret=self.secret,
            workers=agent.slots.workers,
            preload_torch=self.launcher.backend is not None,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            agent_timeout=float(self.launcher.agent_timeout),
            log_level=self.log_level,
            sys_path=tuple(sys.path),
            count=count_mode(self.launcher.workers_per_host),
            warm=self.warm,
        ).to_json_line()


def slurm_cpus(hostname: str) -> int | None:
    """CPUs the allocation has on ``hostname``, for the srun step of its agent."""
    try:
        return slurm_allocation().cpus(hostname)
    except (RuntimeError, ValueError):
        return None


def count_mode(workers_per_host: object) -> str:
    """How an agent counts its workers when none is given: ``"gpu"``, ``"cpu"`` or ``"auto"``."""
    return workers_per_host if isinstance(workers_per_host, str) else "auto"
