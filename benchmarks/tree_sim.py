"""A tree start of 1,024 hosts x 8, simulated: the real launcher, agents arriving on a tree's clock.

Usage::

    python benchmarks/tree_sim.py [--hosts 1024] [--workers 8] [--radix 32]
        [--first 1.0] [--per-start 0.04] [--child 0.5] [--workers-after 0.1]
        [--predicted SECONDS CPU_S]

The launcher is the real one, as in ``many_hosts.py`` (whose simulated agents and workers this
uses: the real protocol, without torch, from a few processes). What is simulated on top is the
tree's schedule (:func:`hello_after`): the launcher starts its hosts (``tree_parent(i, radix)``
is None) one ``--per-start`` apart (its SSH starts' CPU, which its threads take in turn), each
saying hello ``--first`` seconds after its start; an interior host starts its children in
parallel, as a real relay does, the first ``--child`` seconds after its own start (an SSH start
from the interior host, with the relay's ``ssh -G`` of its children before it), the next ones one
``--per-start`` apart; each agent's workers say hello ``--workers-after`` seconds after its spec
(a real agent's fork of its workers, to their function's start). The figures come from
``benchmarks/tree.py``'s real runs, which print this script's command line.

What this does not exercise: the launcher's tree code itself. The simulated agents connect to
the launcher directly, as in a flat start, so neither the launcher's SSH sessions to the
interior hosts nor their relays carry the children's connections (in a real tree every byte of
a child passes through its interior host's relay and the launcher's SSH session to it: that CPU
is not in the figures here; ``tree.py`` measures it on real hosts). Nor does the launcher's own
SSH start of its interior hosts (paramiko) run here: ``--first`` stands for it. Nor the launch's
plan, made before the clock starts: a real call first looks every host name up
(``local_hosts``, up to 32 at a time), which costs what the cluster's resolver costs.

Prints the call to every rank's function start (the launcher's last worker ``HEALTHY`` event),
the call to the result, the launcher's CPU time, and beside them the model's prediction if
``--predicted`` is given.
"""

from __future__ import annotations

import argparse
import os

import many_hosts

from torchrunx.events import LaunchStarted, WorkerState, WorkerStateChanged
from torchrunx.launcher.starts.tree import tree_parent


def hello_after(index: int, radix: int, first: float, per_start: float, child: float) -> float:
    """When host ``index`` says hello, in seconds from the call, on the simulated tree's clock.

    The launcher starts its hosts one ``per_start`` apart (its SSH starts' CPU, one at a time),
    each saying hello ``first`` seconds after its start; an interior host starts its children
    ``child`` seconds after its own start, one ``per_start`` apart.
    """
    parent = tree_parent(index, radix)
    if parent is None:
        return first + per_start * index
    sibling = index - (parent + 1) * radix
    return first + per_start * parent + child + per_start * sibling


def simulate(  # noqa: PLR0913 (each a knob of the simulated tree)
    hosts: int,
    workers: int,
    radix: int,
    *,
    first: float,
    per_start: float,
    child: float,
    workers_after: float,
    simulators: int,
) -> dict[str, float]:
    """One simulated tree launch: ``many_hosts.measure``'s figures, and the call to every
    rank's function start (from the launch's ``LaunchStarted`` event to its last worker's
    ``HEALTHY``)."""
    began: list[float] = []
    healthy: list[float] = []

    def record(event: object) -> None:
        if isinstance(event, LaunchStarted):
            began.append(event.time)
        elif isinstance(event, WorkerStateChanged) and event.new is WorkerState.HEALTHY:
            healthy.append(event.time)

    figures = many_hosts.measure(
        hosts,
        workers,
        simulators,
        start_after=lambda index: hello_after(index, radix, first, per_start, child),
        workers_after=workers_after,
        event_handlers=(record,),
    )
    assert len(healthy) == hosts * workers, len(healthy)
    figures["function_start_seconds"] = max(healthy) - began[0]
    return figures


def main() -> None:
    """Run the simulated tree launch and print its figures (and the model's, if given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--radix", type=int, default=32)
    parser.add_argument("--first", type=float, default=1.0)
    parser.add_argument("--per-start", type=float, default=0.04)
    parser.add_argument("--child", type=float, default=0.5)
    parser.add_argument("--workers-after", type=float, default=0.1)
    parser.add_argument("--simulators", type=int, default=4)
    parser.add_argument("--predicted", type=float, nargs=2, metavar=("SECONDS", "CPU_S"))
    args = parser.parse_args()
    many_hosts._raise_fd_limit()  # noqa: SLF001 (the benchmarks' own helper)
    os.environ.setdefault("TORCHRUNX_LOG_LEVEL", "WARNING")
    figures = simulate(
        args.hosts,
        args.workers,
        args.radix,
        first=args.first,
        per_start=args.per_start,
        child=args.child,
        workers_after=args.workers_after,
        simulators=args.simulators,
    )
    last = max(
        hello_after(i, args.radix, args.first, args.per_start, args.child)
        for i in range(args.hosts)
    )
    print(
        f"simulated tree: {args.hosts} hosts x {args.workers}, radix {args.radix}; first "
        f"{args.first:g} s, per start {args.per_start:g} s, child {args.child:g} s, workers "
        f"after {args.workers_after:g} s (the schedule's floor: {last + args.workers_after:.2f} s)"
    )
    predicted = args.predicted or (float("nan"), float("nan"))
    print(f"{'':34}{'simulated':>12}{'model':>12}")
    rows = (
        ("call to every function start s", figures["function_start_seconds"], predicted[0]),
        ("call to result s", figures["seconds"], float("nan")),
        ("launcher cpu s", figures["cpu_seconds"], predicted[1]),
        ("launcher cpu ms per host", figures["cpu_ms_per_host"], float("nan")),
        ("simulators cpu s", figures["simulators_cpu_seconds"], float("nan")),
        ("ranks", figures["ranks"], float("nan")),
    )
    for label, simulated, model in rows:
        print(f"{label:34}{simulated:12.3f}{model:12.3f}")


if __name__ == "__main__":
    main()
