"""A tree start of 1,024 hosts x 8, simulated: the real launcher, agents arriving on a tree's clock.

Usage::

    python benchmarks/tree_sim.py [--hosts 1024] [--workers 8] [--radix 32]
        [--first 1.0] [--child 0.5] [--workers-after 0.1] [--predicted SECONDS CPU_S]

The launcher is the real one, as in ``many_hosts.py`` (whose simulated agents and workers this
uses: the real protocol, without torch, from a few processes). What is simulated on top is the
tree's schedule: host ``i`` that the launcher starts (``tree_parent(i, radix)`` is None) says
hello ``--first`` seconds after the call (an SSH start from the launcher, to the agent's
hello); a host that an interior host starts says hello ``--first + --child`` seconds after the
call (its interior host starts every child at once, as a real relay does, each in
``--child`` seconds: an SSH start from the interior host); each agent's workers say hello
``--workers-after`` seconds after its spec (a real agent's fork of its workers, to their
function's start). The three come from ``benchmarks/tree.py``'s real runs.

What this does not exercise: the launcher's tree code itself. The simulated agents connect to
the launcher directly, as in a flat start, so neither the launcher's SSH sessions to the
interior hosts nor their relays carry the children's connections (in a real tree every byte of
a child passes through its interior host's relay and the launcher's SSH session to it: that CPU
is not in the figures here; ``tree.py`` measures it on real hosts). Nor does the launcher's own
SSH start of its interior hosts (paramiko) run here: ``--first`` stands for it.

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


def simulate(  # noqa: PLR0913, PLR0917 (each a knob of the simulated tree)
    hosts: int,
    workers: int,
    radix: int,
    first: float,
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

    def start_after(index: int) -> float:
        return first if tree_parent(index, radix) is None else first + child

    figures = many_hosts.measure(
        hosts,
        workers,
        simulators,
        start_after=start_after,
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
        args.first,
        args.child,
        args.workers_after,
        args.simulators,
    )
    floor = args.first + args.child + args.workers_after
    print(
        f"simulated tree: {args.hosts} hosts x {args.workers}, radix {args.radix}; first "
        f"{args.first:g} s, child {args.child:g} s, workers after {args.workers_after:g} s "
        f"(the schedule's floor: {floor:.2f} s)"
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
