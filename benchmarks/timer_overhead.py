"""Cost of the watchdog: ``with torchrunx.timer.expires(...)`` per use, inside a real worker.

Usage::

    python benchmarks/timer_overhead.py [--uses 200000] [--runs 5]

Each run launches one worker (``backend=None``) that times N empty loop iterations, then N
iterations each wrapped in ``timer.expires`` (armed: the page is shared with the agent, which
polls it), then N wrapped in ``contextlib.nullcontext`` for scale. Prints medians in
microseconds per use, and the overhead of the timer over the bare loop.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torchrunx as trx


def measure(uses: int) -> dict[str, float]:
    def per_use(body) -> float:  # noqa: ANN001 (a local helper)
        started = time.perf_counter()
        body()
        return (time.perf_counter() - started) / uses * 1e6

    def bare() -> None:
        for _ in range(uses):
            pass

    def with_timer() -> None:
        expires = trx.timer.expires
        for _ in range(uses):
            with expires(after=60.0, scope="step"):
                pass

    def with_nullcontext() -> None:
        for _ in range(uses):
            with contextlib.nullcontext():
                pass

    armed = trx.timer._page is not None  # noqa: SLF001 (check we run in a worker)
    return {
        "armed": float(armed),
        "bare": per_use(bare),
        "timer": per_use(with_timer),
        "nullcontext": per_use(with_nullcontext),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uses", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = [
        trx.launch(
            measure,
            func_args=(args.uses,),
            hostnames=["localhost"],
            workers_per_host=1,
            backend=None,
            log_handlers=None,
        ).rank(0)
        for _ in range(args.runs)
    ]
    assert all(run["armed"] for run in runs), "the timer was not armed in the worker"
    bare = statistics.median(r["bare"] for r in runs)
    timer = statistics.median(r["timer"] for r in runs)
    null = statistics.median(r["nullcontext"] for r in runs)
    print(f"uses per run: {args.uses}, runs: {args.runs} (medians, microseconds per use)")
    print(f"  bare loop iteration           {bare:8.3f}")
    print(f"  with contextlib.nullcontext() {null:8.3f}")
    print(f"  with timer.expires(...)       {timer:8.3f}")
    print(f"  timer overhead per use        {timer - bare:8.3f}")


if __name__ == "__main__":
    main()
