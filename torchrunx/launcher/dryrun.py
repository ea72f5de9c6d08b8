"""The text of :meth:`torchrunx.Launcher.dry_run`: what a launch would start (pure).

It reads the SSH config to name each host's target, nothing more: no host is contacted. Each
host's command line comes from its transport's ``describe`` (:mod:`torchrunx.engines`).
"""

from __future__ import annotations

import os
import shlex
from typing import TYPE_CHECKING

from torchrunx import plugins
from torchrunx.devices import AUTO_BACKEND_RULE, count_local_gpus, resolve_backend
from torchrunx.launcher.settings.reach import default_python
from torchrunx.launcher.starts.agent_starts import count_mode
from torchrunx.launcher.starts.tree import tree_children

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.hosts import HostSlots
    from torchrunx.launcher.settings.plan import LaunchPlan, StartMethod
    from torchrunx.launcher.settings.resolve import HostsSource


def describe_launch(plan: LaunchPlan, unmatched: Sequence[str] = ()) -> str:
    """The dry run of ``plan``: GPUs counted where the hosts are this machine, then the text.

    ``unmatched``: env patterns of the user's that match no launcher variable.
    """
    counts_gpus = plan.backend == "auto" or plan.hosts.workers_per_host in ("gpu", "auto")
    local = counts_gpus and "local" in plan.hosts.methods
    here = count_local_gpus(plan.from_env.environ) if local else None
    gpus = [here if method == "local" else None for method in plan.hosts.methods]
    return describe_plan(plan, gpus, unmatched=unmatched)


def describe_plan(
    plan: LaunchPlan,
    gpus: Sequence[int | None] | None = None,
    *,
    unmatched: Sequence[str] = (),
) -> str:
    """The text of :meth:`Launcher.dry_run` (pure: it reads the SSH config, nothing more).

    ``gpus``: each host's GPU count where known (hosts that are this machine), else None.
    The last ``plan.hosts.spares`` hosts are spare hosts (they run no rank at first).
    """
    hosts, methods, spares = list(plan.hosts.slots), list(plan.hosts.methods), plan.hosts.spares
    env_names, transport_argument = sorted(plan.reach.env), plan.hosts.transport_argument
    running = hosts[: len(hosts) - spares]
    known = all(h.workers is not None for h in running)
    world = sum(h.workers or 0 for h in running) if known else None
    lines = [
        "torchrunx dry run: nothing was started",
        f"hosts: {len(running)}" + (f", and {spares} spare host(s)" if spares else ""),
        f"hosts from: {_source(plan.hosts.source)}",
        f"agent start: {_transports(methods, transport_argument)}",
        *_relay_lines(plan.reach.relay),
        *_tree_lines(plan.reach.tree_radix, len(running), spares),
        f"world size: {world if world is not None else 'known once every agent has counted'}",
        *_backend_lines(plan, hosts, gpus or [None] * len(hosts)),
        "",
        "host  name                 workers  ranks      agent start",
    ]
    count = count_mode(plan.hosts.workers_per_host)
    lines += _host_rows(hosts, methods, count, len(running))
    if not known:
        counted = {"gpu": "GPUs", "cpu": "CPU cores"}.get(count, "GPUs, else CPU cores")
        lines.append(f"({count}: the agent counts its {counted}; ranks follow host order)")
    without = [h.hostname for h, g in zip(hosts, gpus or [], strict=False) if g == 0]
    if count == "gpu" and without:
        lines.append(f"workers_per_host='gpu' would fail: no GPU on {', '.join(without)}")
    if count == "auto" and without and not known:
        lines.append(
            f"(auto on {', '.join(without)}: no GPU there, so one worker per CPU core, "
            f"{os.cpu_count()} on this machine; give workers_per_host=N for fewer)"
        )
    lines += ["", f"forwarded environment variables ({len(env_names)}, values not shown):"]
    lines.append("  " + (" ".join(env_names) or "(none)"))
    if unmatched:
        lines.append(
            "  matching no variable here, so forwarding nothing (a typo?): " + " ".join(unmatched)
        )
    if "local" in methods:
        lines.append("  (workers on this machine also see the rest of the launcher's environment)")
    if plan.reach.env_file is not None:
        lines.append(f"sourced on every host first: {plan.reach.env_file}")
    lines += _reach_lines(
        plan, [(h.hostname, m) for h, m in zip(hosts, methods, strict=True) if m != "local"]
    )
    lines += ["", "agent command lines (the script and secret go on stdin, never here):"]
    transports: dict[str, object] = {}
    try:
        for host, method in zip(hosts, methods, strict=True):
            lines.append(
                f"  {host.hostname}: "
                + _agent_command_line(plan, transports, method, transport_argument, host)
            )
    finally:
        for made in transports.values():
            getattr(made, "close", lambda: None)()
    return "\n".join(lines)


def _reach_lines(plan: LaunchPlan, remote: list[tuple[str, str]]) -> list[str]:
    """The remote hosts' container, their interpreters (``python=``) and shipped paths."""
    lines = []
    if plan.reach.container and remote:
        started = shlex.join(plan.reach.container)
        lines.append(f"remote agents run in a container, started with: {started}")
    for hostname, method in remote:
        python = default_python(plan.reach.python, hostname, plan.reach.container, method)
        if python is not None:
            lines.append(f"python on {hostname}: {python}")
    if plan.reach.ship and remote:
        excluded = (
            f", leaving out {' '.join(plan.reach.ship_exclude)}" if plan.reach.ship_exclude else ""
        )
        lines.append(
            f"shipped to the remote hosts (cached there by content, .gitignore honoured"
            f"{excluded}): {' '.join(plan.reach.ship)}"
        )
    return lines


def _relay_lines(relay: str) -> list[str]:
    """What ``relay`` does, unless it is "off"."""
    if relay == "off":
        return []
    when = "always" if relay == "on" else "for hosts whose test connection to the launcher fails"
    return [f"relay: {relay} (remote hosts' connections travel over their agent's channel, {when})"]


def _tree_lines(radix: int | None, count: int, spares: int = 0) -> list[str]:
    """Who starts whom in a tree start (``tree_radix``) of ``count`` hosts and ``spares``."""
    if radix is None:
        return []
    interior = min(radix, count)
    starts = [(i, tree_children(i, radix, count)) for i in range(interior)]
    parents = [f"host {i} starts {_span(children)}" for i, children in starts if children]
    spare = f" and the spares ({_span(range(count, count + spares))})" if spares else ""
    return [
        f"tree start: radix {radix}; the launcher starts hosts {_span(range(interior))}{spare}; "
        + ("; ".join(parents) + ", over SSH from their own hosts" if parents else "no more")
    ]


def _span(indexes: Sequence[int]) -> str:
    """``0-3`` for consecutive host indexes, ``none`` for none."""
    if not indexes:
        return "none"
    first, last = indexes[0], indexes[-1]
    return str(first) if first == last else f"{first}-{last}"


def _source(source: HostsSource) -> str:
    """Where the hosts come from: a provider (and its argument), a hostfile, or a list."""
    if source.provider is not None:
        name, argument = source.provider
        return f"host provider {name}" + (f" ({argument})" if argument else "")
    if source.hostfile is not None:
        return f"hostfile {source.hostfile}"
    return "the list given" if source.names else "auto (no scheduler detected: this machine)"


def _transports(methods: Sequence[str], argument: str | None) -> str:
    """Each transport the hosts use, with its argument: ``"ssh (2 hosts), local (1 host)"``."""
    named = []
    for method in dict.fromkeys(methods):
        count = methods.count(method)
        spec = method if method == "local" or argument is None else f"{method}:{argument}"
        named.append(f"{spec} ({count} host{'s' if count != 1 else ''})")
    return ", ".join(named)


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
    plan: LaunchPlan, hosts: list[HostSlots], gpus: Sequence[int | None]
) -> list[str]:
    """The dry run's backend: ``"auto"`` resolved where the GPU counts allow it."""
    line = f"(process-group timeout {plan.timeouts.process_group:g} s)"
    if plan.backend != "auto":
        return [f"backend: {plan.backend} {line}"]
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


def _agent_command_line(
    plan: LaunchPlan,
    transports: dict[str, object],
    method: str,
    argument: str | None,
    host: HostSlots,
) -> str:
    """The host's command line, as its transport describes it (made once per transport)."""
    made = transports.get(method)
    if made is None:
        try:
            made = transports[method] = plugins.transport(
                method,
                None if method == "local" else argument,
                ssh_config_file=plan.reach.ssh_config_file,
            )
        except (ValueError, RuntimeError, TypeError) as exc:
            return f"{method} (cannot be described: {exc})"
    return str(made.describe(host.hostname))  # type: ignore[attr-defined]
