"""What a launch returns: every rank's return value, by rank and by host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")


@dataclass(frozen=True)
class LaunchTimings:
    """How long each phase of a launch took, in seconds.

    Per-rank figures are those of the attempt that succeeded; ``total`` and
    ``agents_started`` count from the start of the launch (after its fields are checked and
    its hosts resolved), restarts included.

    Attributes:
        total: From the start of the launch to the last result.
        agents_started: From the start until every agent had connected back.
        connect: Per host: SSH connection (0 for local and srun agents, which need none).
        agent_start: Per host: from the start until its agent connected back (SSH or srun,
            the interpreter's start and the torchrunx import included).
        process_group_init: Per rank: in ``init_process_group`` (0 with ``backend=None``).
        function: Per rank: in the function.
        result_transfer: Per rank: pickling the return value in the worker, plus receiving it
            in the launcher.
    """

    total: float = 0.0
    agents_started: float = 0.0
    connect: tuple[float, ...] = ()
    agent_start: tuple[float, ...] = ()
    process_group_init: tuple[float, ...] = ()
    function: tuple[float, ...] = ()
    result_transfer: tuple[float, ...] = ()


@dataclass(frozen=True)
class LaunchResult(Generic[R]):
    """The return values of every worker of one launch.

    Ranks are numbered host by host in the order of ``hostnames``: the workers of the first
    host are ranks ``0 .. n0-1``, then the second host's, and so on.

    The same hostname may appear more than once in ``hostnames`` (for example to start two
    agents on one machine). Nothing is lost then: :attr:`results` lists, under that name, the
    workers of all its entries in rank order, and :meth:`index` counts ``local_rank`` through
    that combined list (so for the second entry, ``local_rank`` continues after the first
    entry's workers). :attr:`per_host` keeps the entries apart.

    Attributes:
        hostnames: Host of each entry, in launch order (duplicates kept).
        per_host: Return values of each entry's workers, in local-rank order.
        restarts: How many times the worker group was restarted before it succeeded.
        timings: How long each phase took.
        fresh_workers: Whether this run's workers were started for it. Always ``True`` but
            for warm agents whose workers stay (``Launcher.warm(keep_workers=True)``): there
            ``False`` says the last run's workers took this call, with whatever they had
            loaded, and ``True`` that new ones were started (the first run, or after a
            failure), so nothing of earlier runs is in them.
        world_changes: With spare hosts or ``min_hosts``: one line per host quarantined,
            replaced by a spare or dropped, oldest first (``hostnames`` are the hosts of the
            attempt that succeeded); empty if none was.
        stragglers: The ranks named stragglers during the run (``Launcher.straggler_threshold``),
            one sentence each: ``rank 5 enters collectives 0.9 s after the median, over the
            last 50``; empty if none was.
    """

    hostnames: tuple[str, ...]
    per_host: tuple[tuple[R, ...], ...]
    restarts: int = 0
    timings: LaunchTimings = field(default_factory=LaunchTimings)
    fresh_workers: bool = True
    world_changes: tuple[str, ...] = ()
    stragglers: tuple[str, ...] = ()

    @property
    def ranks(self) -> list[R]:
        """Return values in global-rank order."""
        return [value for host in self.per_host for value in host]

    @property
    def results(self) -> dict[str, list[R]]:
        """Return values per hostname, in host order then local-rank order."""
        by_name: dict[str, list[R]] = {}
        for hostname, values in zip(self.hostnames, self.per_host, strict=True):
            by_name.setdefault(hostname, []).extend(values)
        return by_name

    @property
    def world_size(self) -> int:
        """Number of workers that ran."""
        return sum(len(host) for host in self.per_host)

    def rank(self, i: int) -> R:
        """Return value of global rank ``i``.

        Raises:
            IndexError: No such rank.
        """
        if not 0 <= i < self.world_size:
            raise IndexError(
                f"rank {i} does not exist; this launch had ranks 0..{self.world_size - 1}"
            )
        return self.ranks[i]

    def index(self, hostname: str, local_rank: int) -> R:
        """Return value of the worker with ``local_rank`` on ``hostname``.

        Raises:
            KeyError: ``hostname`` was not part of the launch.
            IndexError: That host ran fewer workers.
        """
        results = self.results
        if hostname not in results:
            raise KeyError(
                f"host {hostname!r} was not part of this launch (hosts: {list(results)})"
            )
        values = results[hostname]
        if not 0 <= local_rank < len(values):
            raise IndexError(
                f"host {hostname!r} ran {len(values)} workers; "
                f"local rank {local_rank} does not exist"
            )
        return values[local_rank]
