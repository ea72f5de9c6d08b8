"""The text of :meth:`torchrunx.Launcher.dry_run`: what a launch would start (pure).

It reads the SSH config to name each host's target, nothing more: no host is contacted.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Protocol

from torchrunx.devices import AUTO_BACKEND_RULE, resolve_backend
from torchrunx.launcher.agent_starts import count_mode, slurm_cpus
from torchrunx.launcher.ssh import resolve_ssh_target
from torchrunx.launcher.transport import AGENT_COMMAND, srun_command

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from torchrunx.hosts import HostSlots
    from torchrunx.launcher.plan import StartMethod


class Launcher(Protocol):
    """The fields of :class:`torchrunx.Launcher` the description reads."""

    @property
    def workers_per_host(self) -> object: ...  # noqa: D102
    @property
    def backend(self) -> str | None: ...  # noqa: D102
    @property
    def timeout(self) -> float: ...  # noqa: D102
    @property
    def env_file(self) -> str | Path | None: ...  # noqa: D102
    @property
    def ssh_config_file(self) -> str | Path | None: ...  # noqa: D102
    @property
    def start_timeout(self) -> float: ...  # noqa: D102


def describe_plan(  # noqa: PLR0913 (what the plan resolved, each apart)
    launcher: Launcher,
    hosts: list[HostSlots],
    methods: list[StartMethod],
    env_names: list[str],
    gpus: Sequence[int | None] | None = None,
    *,
    spares: int = 0,
) -> str:
    """The text of :meth:`Launcher.dry_run` (pure: it reads the SSH config, nothing more).

    ``gpus``: each host's GPU count where known (hosts that are this machine), else None.
    ``spares``: the last ``spares`` of ``hosts`` are spare hosts (they run no rank at first).
    """
    running = hosts[: len(hosts) - spares]
    known = all(h.workers is not None for h in running)
    world = sum(h.workers or 0 for h in running) if known else None
    lines = [
        "torchrunx dry run: nothing was started",
        f"hosts: {len(running)}" + (f", and {spares} spare host(s)" if spares else ""),
        f"world size: {world if world is not None else 'known once every agent has counted'}",
        *_backend_lines(launcher, hosts, gpus or [None] * len(hosts)),
        "",
        "host  name                 workers  ranks      agent start",
    ]
    count = count_mode(launcher.workers_per_host)
    lines += _host_rows(hosts, methods, count, len(running))
    if not known:
        counted = {"gpu": "GPUs", "cpu": "CPU cores"}.get(count, "GPUs, else CPU cores")
        lines.append(f"({count}: the agent counts its {counted}; ranks follow host order)")
    if count == "gpu":
        without = [h.hostname for h, g in zip(hosts, gpus or [], strict=False) if g == 0]
        if without:
            lines.append(f"workers_per_host='gpu' would fail: no GPU on {', '.join(without)}")
    lines += ["", f"forwarded environment variables ({len(env_names)}, values not shown):"]
    lines.append("  " + (" ".join(env_names) or "(none)"))
    if "local" in methods:
        lines.append("  (workers on this machine also see the rest of the launcher's environment)")
    if launcher.env_file is not None:
        lines.append(f"sourced on every host first: {launcher.env_file}")
    lines += ["", "agent command lines (the script and secret go on stdin, never here):"]
    for host, method in zip(hosts, methods, strict=True):
        lines.append(f"  {host.hostname}: {_agent_command_line(launcher, host.hostname, method)}")
    return "\n".join(lines)


def _host_rows(
    hosts: list[HostSlots], methods: list[StartMethod], count: str, running: int
) -> list[str]:
    """One row per host: its workers and ranks (``"spare"`` from index ``running`` on)."""
    rows = []
    offset: int | None = 0
    for index, (host, method) in enumerate(zip(hosts, methods, strict=True)):
        workers = count if host.workers is None else str(host.workers)
        if index >= running:
            ranks = "spare"
        elif host.workers is None or offset is None:
            ranks, offset = "-", None
        else:
            last = offset + host.workers - 1
            ranks = f"{offset}" if last == offset else f"{offset}-{last}"
            offset += host.workers
        rows.append(f"{index:<5} {host.hostname:<20} {workers:<8} {ranks:<10} {method}")
    return rows


def _backend_lines(
    launcher: Launcher, hosts: list[HostSlots], gpus: Sequence[int | None]
) -> list[str]:
    """The dry run's backend: ``"auto"`` resolved where the GPU counts allow it."""
    line = f"(process-group timeout {launcher.timeout:g} s)"
    if launcher.backend != "auto":
        return [f"backend: {launcher.backend} {line}"]
    pairs = list(zip(hosts, gpus, strict=True))
    backend = resolve_backend("auto", [(h.workers, g) for h, g in pairs])
    counted = ", ".join(f"{h.hostname} {g}" for h, g in pairs if g is not None)
    seen = f" (GPUs counted here: {counted})" if counted else ""
    if backend == "auto":
        why = f"auto: decided when the agents report their GPUs: {AUTO_BACKEND_RULE}{seen}"
    elif backend == "nccl":
        why = f"auto resolves to nccl: every worker has a GPU{seen}"
    else:
        why = f"auto resolves to gloo: not every worker has a GPU{seen}"
    return [f"backend: {backend} {line}", f"  {why}"]


def _agent_command_line(launcher: Launcher, hostname: str, method: StartMethod) -> str:
    if method == "local":
        return AGENT_COMMAND
    if method == "srun":
        return shlex.join(srun_command(hostname, cpus=slurm_cpus(hostname)))
    try:
        target = resolve_ssh_target(hostname, launcher.ssh_config_file, launcher.start_timeout)
    except ValueError as exc:
        return f"ssh (cannot read the SSH config: {exc})"
    via = f" via {target.proxy_jump}" if target.proxy_jump else ""
    return f"ssh {target.user}@{target.hostname} -p {target.port}{via} {AGENT_COMMAND}"
