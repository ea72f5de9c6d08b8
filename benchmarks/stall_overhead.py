"""Cost of stall detection: a gloo all_reduce loop with it off and on, settings taking turns.

Usage::

    python benchmarks/stall_overhead.py [--steps 500] [--rounds 40] [--workers 2]
        [--size 65536] [--hostnames localhost] [--ssh-config FILE]

Four settings, each on warm agents of its own (``Launcher.warm()``, opened once; every run
has fresh workers, as a launch does, without a launch's two seconds of start-up):

- **recorder off**: ``stall_timeout=None``, ``straggler_threshold=None`` and
  ``TORCH_FR_BUFFER_SIZE=0``: nothing at all (the floor);
- **off**: ``stall_timeout=None`` and ``straggler_threshold=None``: no probe thread, no
  requests; torch's own recorder stays as torch sets it (on, 2,000 entries, in torch 2.13);
- **on (default)**: the recorder at 256 entries, the probe reading it every 0.1 s, the
  launcher asking for the ranks' timings every 2 s;
- **on, 20,000 entries**: the same with the user's ``TORCH_FR_BUFFER_SIZE=20000``.

A round runs each setting once, in an order that rotates from round to round (so no setting
is always first after another); a run is ``--steps`` steps (one all_reduce of ``--size``
floats and a 64x64 matrix product) after 50 warm-up steps. Each rank measures its own steps:
the wall time per step (rank 0's: the total over the steps, so that the probe's occasional
reads count), the CPU time per step of its main thread (``time.thread_time()``), and the CPU
time of its probe thread (``torchrunx-stall-probe``, through ``pthread_getcpuclockid``) over
the same steps, as a share of their wall time: the probe's whole cost, read directly, where
the settings' differences in the loop's own times are smaller than this machine's noise.
Within a round each setting is compared with "off" (and "off" with "recorder off"): the median
of the rounds' ratios, their interquartile range, and a bootstrap 95% interval of that median.
Rounds of one setting vary by tens of percent on a busy 2-core machine; a round's settings run
seconds apart and see about the same load, so their ratios vary less. Prints figures, asserts
nothing (issue #45's target: a cost of at most 2%).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torchrunx as trx

SETTINGS: dict[str, dict[str, object]] = {
    "recorder off": {
        "stall_timeout": None,
        "straggler_threshold": None,
        "extra_env_vars": ("TORCH_FR_BUFFER_SIZE=0",),
    },
    "off": {"stall_timeout": None, "straggler_threshold": None},
    "on (default)": {},
    "on, 20,000 entries": {"extra_env_vars": ("TORCH_FR_BUFFER_SIZE=20000",)},
}
BASE = {"recorder off": "recorder off", "off": "recorder off"}
"""The setting each is compared with within a round (the others: with "off")."""


def loop(steps: int, size: int) -> tuple[float, float, float]:
    """An all_reduce loop, after warm-up: seconds per step (wall, and the main thread's CPU),
    and the probe thread's CPU as a share of the wall time (0 without a probe)."""
    import threading  # noqa: PLC0415 (in the worker)

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    tensor = torch.ones(size)
    weights = torch.rand(64, 64)
    for _ in range(50):
        weights = torch.tanh(weights @ weights)
        dist.all_reduce(tensor)
    probe = next((t for t in threading.enumerate() if t.name == "torchrunx-stall-probe"), None)
    clock = None if probe is None else time.pthread_getcpuclockid(probe.ident or 0)
    probe_cpu = 0 if clock is None else time.clock_gettime_ns(clock)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        weights = torch.tanh(weights @ weights)
        dist.all_reduce(tensor)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    probe_cpu = 0 if clock is None else time.clock_gettime_ns(clock) - probe_cpu
    return wall / steps, cpu / steps, probe_cpu / 1e9 / wall


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """The 25th, 50th and 75th percentiles."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, mid, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, mid, high


def bootstrap(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 95% interval of the median of ``values`` (percentile bootstrap, fixed seed)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, default=65536)
    parser.add_argument("--hostnames", default="localhost")
    parser.add_argument("--ssh-config", default=None)
    args = parser.parse_args()
    names = list(SETTINGS)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    probe: dict[str, list[float]] = {name: [] for name in names}
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        warm = {
            name: stack.enter_context(
                trx.Launcher(
                    hostnames=args.hostnames.split(","),
                    workers_per_host=args.workers,
                    backend="gloo",
                    ssh_config_file=args.ssh_config,
                    log_handlers=None,
                    **fields,  # type: ignore[arg-type]
                ).warm()
            )
            for name, fields in SETTINGS.items()
        }
        for name in names:  # each agent's torch import, and a first run, before any round
            warm[name].run(loop, 10, args.size)
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                ranks = warm[name].run(loop, args.steps, args.size).ranks
                runs[name].append((ranks[0][0], statistics.mean(r[1] for r in ranks)))
                probe[name].extend(r[2] for r in ranks)
    seconds = time.monotonic() - started
    print(
        f"hosts {args.hostnames}, {args.workers} workers each, {args.rounds} rounds of "
        f"{args.steps} steps (an all_reduce of {args.size} floats and a 64x64 product) per "
        f"setting, settings in turn; {seconds:.0f} s in all"
    )
    print()
    print(
        "| setting | wall per step (rank 0), median run | main thread's CPU per step "
        "(mean of ranks), median run | probe thread's CPU, % of wall time: median, max "
        "| against | wall: median ratio - 1 [IQR] (95% interval) "
        "| main thread's CPU: median ratio - 1 [IQR] (95% interval) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        wall = statistics.median(w for w, _ in runs[name])
        cpu = statistics.median(c for _, c in runs[name])
        share = f"{statistics.median(probe[name]) * 100:.3f}%, {max(probe[name]) * 100:.3f}%"
        base = BASE.get(name, "off")
        cells = []
        for index in (0, 1):
            if base == name:
                cells.append("")
                continue
            ratios = [
                (mine[index] / theirs[index] - 1) * 100
                for mine, theirs in zip(runs[name], runs[base], strict=True)
            ]
            low, mid, high = quartiles(ratios)
            lo, hi = bootstrap(ratios)
            cells.append(f"{mid:+.2f}% [{low:+.2f}, {high:+.2f}] ({lo:+.2f}, {hi:+.2f})")
        print(
            f"| {name} | {wall * 1e6:.0f} µs | {cpu * 1e6:.0f} µs | {share} "
            f"| {base if base != name else ''} | {cells[0]} | {cells[1]} |"
        )


if __name__ == "__main__":
    main()
