"""Cost of stall detection: a gloo all_reduce loop with it on (the default) and off.

Usage::

    python benchmarks/stall_overhead.py [--steps 2000] [--rounds 5] [--workers 2]
        [--size 65536] [--hostnames localhost] [--ssh-config FILE]

Each round launches the same loop three times, in turn: stall detection off
(``stall_timeout=None`` and ``straggler_threshold=None``: no flight recorder, no probe thread),
on as by default (the recorder with 256 entries, the probe reading it every 0.1 s, the
launcher asking for the ranks' timings every 2 s), and on with the recorder's buffer at 20,000
entries (``TORCH_FR_BUFFER_SIZE``, the user's size). A step is one all_reduce of
``--size`` floats and a small matrix product; each rank times every step after 50 warm-up steps.
Prints the median step time (rank 0's median, then the median over rounds) and each setting's
cost against off. The issue's target: at most 2% (issue #45, item 4).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torchrunx as trx


def loop(steps: int, size: int) -> float:
    """Median seconds per step of rank ``RANK``'s all_reduce loop."""
    import torch  # noqa: PLC0415 (in the worker)
    import torch.distributed as dist  # noqa: PLC0415

    tensor = torch.ones(size)
    weights = torch.rand(64, 64)
    times = []
    for step in range(steps + 50):
        started = time.perf_counter()
        weights = torch.tanh(weights @ weights)
        dist.all_reduce(tensor)
        if step >= 50:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


SETTINGS: dict[str, dict[str, object]] = {
    "off": {"stall_timeout": None, "straggler_threshold": None},
    "on (default)": {},
    "on, 20,000 entries": {"extra_env_vars": ("TORCH_FR_BUFFER_SIZE=20000",)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, default=65536)
    parser.add_argument("--hostnames", default="localhost")
    parser.add_argument("--ssh-config", default=None)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, fields in SETTINGS.items():
            result = trx.launch(
                loop,
                func_args=(args.steps, args.size),
                hostnames=args.hostnames.split(","),
                workers_per_host=args.workers,
                backend="gloo",
                ssh_config_file=args.ssh_config,
                log_handlers=None,
                **fields,  # type: ignore[arg-type]
            )
            medians[name].append(result.rank(0))
    print(
        f"hosts {args.hostnames}, {args.workers} workers each, {args.steps} steps of an "
        f"all_reduce of {args.size} floats, {args.rounds} rounds (median of rank 0's medians)"
    )
    off = statistics.median(medians["off"])
    for name, values in medians.items():
        value = statistics.median(values)
        cost = (value / off - 1) * 100
        print(
            f"  {name:<20} {value * 1e6:9.1f} us/step  {cost:+6.2f}% vs off  "
            f"(rounds: {', '.join(f'{v * 1e6:.0f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
