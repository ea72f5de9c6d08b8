"""Spare hosts and a shrinking world: which hosts run the next attempt (pure).

With ``spare_hosts`` or ``min_hosts`` (and ``"hosts"`` in ``restart_on``), a host whose agent
failed or was lost is *quarantined*: it takes no further part in the launch (nor in the later
runs of warm agents). Its place goes to a spare; without one, the world shrinks to the hosts
left, down to ``min_hosts``::

    world (agent ids, in rank order) ──a host fails──▶ quarantined
        ├─ a spare is left ─▶ the spare takes the failed host's place: same position, same ranks
        │                     (its own worker count, if it differs, shifts the later ranks)
        └─ none ───────────▶ the host's place is dropped: later hosts move up, ranks follow
                              (below min_hosts: the launch raises the failure)

Every agent has a fixed id: the hosts' positions in ``hostnames``, then the spares'. The
world is the list of ids in rank order; ``WorkerSpec.host_index`` is an id's position in it.
Spare agents start with the launch and wait, torch imported, until one is needed (hot spares).

:func:`split_spares` and :func:`check_resilience` check the fields; :func:`reshape` decides the
next world. The launch (:mod:`~torchrunx.launcher.launch.orchestrator`) applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchrunx.launcher.settings.resolve import check_hostnames, resolve_hosts

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from torchrunx.hosts import HostSlots
    from torchrunx.launcher.settings.resolve import HostnamesSpec, HostsSource, WorkersSpec


def check_resilience(
    spare_hosts: object, min_hosts: object, restart_on: Sequence[str], max_restarts: int
) -> None:
    """Check ``spare_hosts`` and ``min_hosts`` (against the hosts: :func:`split_spares`).

    Raises:
        TypeError: Either has the wrong type.
        ValueError: A bad value, or one that would never be used: without ``"hosts"`` in
            ``restart_on`` and a restart to make, no host is ever replaced.
    """
    if isinstance(spare_hosts, list | tuple):
        for name in spare_hosts:
            if not isinstance(name, str) or not name.strip():
                raise TypeError(f"spare_hosts must be host names or a count, got {name!r} in it")
    elif isinstance(spare_hosts, bool) or not isinstance(spare_hosts, int):
        raise TypeError(f"spare_hosts must be a count or a list of host names, got {spare_hosts!r}")
    elif spare_hosts < 0:
        raise ValueError(f"spare_hosts must be 0 or more, got {spare_hosts}")
    if min_hosts is not None and (isinstance(min_hosts, bool) or not isinstance(min_hosts, int)):
        raise TypeError(f"min_hosts must be a number of hosts or None, got {min_hosts!r}")
    if min_hosts is not None and min_hosts < 1:
        raise ValueError(f"min_hosts must be 1 or more, got {min_hosts}")
    used = bool(spare_hosts) or min_hosts is not None
    if used and ("hosts" not in restart_on or max_restarts < 1):
        given = "spare_hosts" if spare_hosts else "min_hosts"
        raise ValueError(
            f"{given} is used only when a failed host is restarted: add 'hosts' to restart_on "
            f"(it is {tuple(restart_on)!r}) and set max_restarts >= 1 (it is {max_restarts})"
        )


def check_spare_names(
    spare_hosts: object, workers_per_host: object, requeue: object
) -> HostsSource | None:
    """Check the names of ``spare_hosts`` (if names), and ``requeue_on_preemption``.

    Returns what the names name (classified here, once: the plan resolves them with it), or
    None for a count.

    Raises:
        ValueError: A name is not a host name, or ``workers_per_host`` is a list (it counts
            the workers of ``hostnames``' hosts only).
        TypeError: ``requeue_on_preemption`` is not True or False.
    """
    source = None
    if isinstance(spare_hosts, list | tuple):
        source = check_hostnames(list(spare_hosts), "spare_hosts")
        if isinstance(workers_per_host, list | tuple):
            raise ValueError(  # noqa: TRY004 (a value that does not fit another)
                "spare_hosts names hosts, but workers_per_host is a list (one count per "
                "host of hostnames): give one count for every host, or make the spares "
                "the last hosts of hostnames and set spare_hosts to their number"
            )
    if not isinstance(requeue, bool):
        raise TypeError(f"requeue_on_preemption must be True or False, got {requeue!r}")
    return source


def split_spares(
    hosts: Sequence[HostSlots],
    spare_hosts: int | Sequence[str],
    min_hosts: int | None,
    spare_slots: Sequence[HostSlots] = (),
) -> tuple[list[HostSlots], list[HostSlots]]:
    """The hosts that run the first attempt, and the spares.

    ``spare_hosts`` as a count takes the last hosts of ``hosts`` (a SLURM allocation, a
    hostfile); as names, the spares are ``spare_slots`` (resolved from those names) and
    ``hosts`` all run.

    Raises:
        ValueError: No host would be left to run, a spare is also a running host, or
            ``min_hosts`` is more than the hosts that run.
    """
    hosts = list(hosts)
    if isinstance(spare_hosts, int):
        if spare_hosts >= len(hosts):
            raise ValueError(
                f"spare_hosts={spare_hosts} takes every one of the {len(hosts)} hosts "
                f"({[h.hostname for h in hosts]}): at least one must run the function"
            )
        cut = len(hosts) - spare_hosts
        world, spares = hosts[:cut], hosts[cut:]
    else:
        world, spares = hosts, list(spare_slots)
        running = {h.hostname for h in world}
        both = sorted({h.hostname for h in spares} & running)
        if both:
            raise ValueError(
                f"spare_hosts {both} are also in hostnames: a spare must be another host "
                "(a failed host's spare on the same host would fail with it)"
            )
    if min_hosts is not None and min_hosts > len(world):
        raise ValueError(
            f"min_hosts={min_hosts} is more than the {len(world)} hosts that run "
            f"({[h.hostname for h in world]})"
        )
    return world, spares


@dataclass(frozen=True)
class Reshape:
    """The next attempt's world, or why there is none."""

    world: tuple[int, ...]
    """Agent ids in rank order."""
    replaced: tuple[tuple[int, int], ...] = ()
    """``(failed id, spare id)``: the spare took the failed host's place."""
    dropped: tuple[int, ...] = ()
    """Failed ids whose places were dropped (no spare was left)."""
    short: str | None = None
    """Why the world cannot go on (fewer hosts than ``min_hosts``); None if it can."""


def reshape(
    world: Sequence[int],
    failed: Sequence[int],
    spares: Sequence[int],
    min_hosts: int | None,
) -> Reshape:
    """The world after the hosts ``failed`` are quarantined.

    Args:
        world: Agent ids in rank order.
        failed: The ids of ``world`` whose agents failed, were lost, or did not get ready.
        spares: Spare ids still usable, best first (ready before still starting).
        min_hosts: The fewest hosts the world may shrink to (None: it may not shrink).
    """
    left = list(spares)
    new: list[int] = []
    replaced: list[tuple[int, int]] = []
    dropped: list[int] = []
    out = set(failed)
    for agent_id in world:
        if agent_id not in out:
            new.append(agent_id)
        elif left:
            spare = left.pop(0)
            new.append(spare)
            replaced.append((agent_id, spare))
        else:
            dropped.append(agent_id)
    short = None
    floor = len(world) if min_hosts is None else min_hosts
    if dropped and len(new) < floor:
        short = f"{len(dropped)} host(s) failed and no spare host was left: {len(new)} host(s) " + (
            f"would be fewer than min_hosts={min_hosts}"
            if min_hosts is not None
            else "would be fewer than the launch's hosts (set min_hosts to go on with fewer)"
        )
    return Reshape(tuple(new), tuple(replaced), tuple(dropped), short)


def world_and_spares(  # noqa: PLR0913 (one argument per field it reads, and what they name)
    hostnames: HostnamesSpec,
    workers_per_host: WorkersSpec,
    *,
    spare_hosts: int | Sequence[str],
    min_hosts: int | None,
    sources: tuple[HostsSource, HostsSource | None],
    environ: Mapping[str, str],
) -> tuple[list[HostSlots], list[HostSlots]]:
    """The resolved hosts of the first attempt, and the spares (:func:`split_spares`).

    ``sources``: what ``hostnames`` and ``spare_hosts`` (None: a count) name, as the fields'
    checks classified them (each once per launch).
    """
    hosts = resolve_hosts(hostnames, workers_per_host, environ, source=sources[0])
    if isinstance(spare_hosts, int):
        return split_spares(hosts, spare_hosts, min_hosts)
    names = tuple(spare_hosts)
    spares = resolve_hosts(names, workers_per_host, environ, field="spare_hosts", source=sources[1])
    return split_spares(hosts, names, min_hosts, spares)
