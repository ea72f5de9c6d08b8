"""The benchmark cases: what is launched, with which tools, and which numbers become table rows."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from collections.abc import Callable

Tool = Literal["ours", "upstream", "torchrun", "floor"]
TOOLS: tuple[Tool, ...] = ("ours", "upstream", "torchrun", "floor")

LINK_CUT_AGENT_TIMEOUT = 2.0


@dataclass(frozen=True)
class Sizes:
    """How big the cases are: the full benchmark, or the smoke version that only checks they run.

    Attributes:
        result_bytes: Bytes of the tensor each rank returns in the results case.
        log_lines: Lines printed in the logs case.
        scale_hosts: Host counts of the scale case; its ratio row is last / first.
    """

    result_bytes: int
    log_lines: int
    scale_hosts: tuple[int, ...]


FULL = Sizes(result_bytes=400_000_000, log_lines=100_000, scale_hosts=(1, 4, 8, 16))
SMOKE = Sizes(result_bytes=40_000_000, log_lines=10_000, scale_hosts=(1, 2))


@dataclass(frozen=True)
class Measure:
    """One launch to measure, in a fresh process.

    Attributes:
        workload: Name of a function in ``workloads.py``; for the floor column, ``"floor"``
            (``floor.py``, on this machine) or ``"ssh_floor"`` (``ssh_floor.py``, over SSH).
        hosts: 0 for ``localhost``, else the first ``hosts`` bench hosts (over SSH).
        workers: Workers per host.
        backend: Process-group backend, or ``None`` for none.
        args: Arguments after the scratch directory.
        launches: Launches back to back in the same process.
        agent_timeout: Ours' ``agent_timeout`` (0.4 keeps its default).
        cut: Cut the last host's link once every rank has started.
        expect_error: Whether the launch should raise (the failure cases).
        import_torch: Import torch in the launcher before the call, as a script that gets
            tensors back has (0.4's launcher imports torch anyway).
        max_runs: At most this many runs (a slow tool in a slow setup), else ``--runs``.
    """

    workload: str
    hosts: int = 0
    workers: int = 2
    backend: str | None = "gloo"
    args: tuple[Any, ...] = ()
    launches: int = 1
    agent_timeout: float | None = None
    cut: bool = False
    expect_error: bool = False
    import_torch: bool = False
    max_runs: int | None = None

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return max(self.hosts, 1) * self.workers


@dataclass
class Outcome:
    """What one measured launch gave (seconds unless said otherwise)."""

    walls: list[float] = field(default_factory=list)
    start: float | None = None
    latency: float | None = None
    transfer: float | None = None
    transferred_bytes: int = 0
    lines: int = 0
    file_lines: int | None = None
    lines_per_s: float | None = None
    launcher_cpu_s: float | None = None
    launcher_rss_mb: float | None = None
    agent_rss_mb: float | None = None
    cpu_s: float | None = None
    error: str | None = None
    harness_error: bool = False
    capped: bool = False
    leftovers: int = 0


@dataclass(frozen=True)
class Target:
    """A target for ours: a bound on ours/0.4 (``ratio``) or on ours' own value."""

    text: str
    limit: float
    on_ratio: bool

    def met(self, ours: float | None, ratio: float | None) -> bool | None:
        """Whether the target is met; ``None`` if the numbers are missing."""
        value = ratio if self.on_ratio else ours
        return None if value is None or math.isnan(value) else value <= self.limit


@dataclass(frozen=True)
class Metric:
    """One table row from a setup: a number taken from each tool's outcome."""

    label: str
    unit: str
    extract: Callable[[Outcome], float | None]
    target: Target | None = None


@dataclass(frozen=True)
class Setup:
    """One configuration measured with several tools; gives one row per metric.

    Attributes:
        label: Row label prefix.
        measures: What each tool launches; tools missing here are "n/a" in the table.
        metrics: The rows.
    """

    label: str
    measures: dict[Tool, Measure]
    metrics: tuple[Metric, ...]

    @property
    def hosts(self) -> int:
        """Bench hosts the setup needs."""
        return max(m.hosts for m in self.measures.values())


@dataclass(frozen=True)
class Ratio:
    """A row computed from two rows' medians, e.g. 16-host overhead / 1-host overhead."""

    label: str
    numerator: str
    denominator: str
    target: Target | None = None


@dataclass(frozen=True)
class Case:
    """A named group of setups, selectable with ``--only``."""

    name: str
    setups: tuple[Setup, ...]
    ratios: tuple[Ratio, ...] = ()


def median(values: list[float]) -> float | None:
    """Median of the values, ``None`` if there are none."""
    return statistics.median(values) if values else None


def first_wall(o: Outcome) -> float | None:
    return o.walls[0] if o.walls else None


def later_walls(o: Outcome) -> float | None:
    return median(o.walls[1:])


def throughput(o: Outcome) -> float | None:
    if o.transfer is None or not o.transferred_bytes:
        return None
    return o.transferred_bytes / 1e6 / o.transfer


WALL = Metric("wall, call to result", "s", first_wall)
OVERHEAD_TARGET = Target("ours/0.4 ≤ 0.4", 0.4, on_ratio=True)
WORKER_FAULT_TARGET = Target("ours < 1 s", 1.0, on_ratio=False)


def tools_for(
    measure: Measure, *, torchrun: bool, upstream_runs: int | None = None
) -> dict[Tool, Measure]:
    """The same launch for ours and 0.4 (at its default agent_timeout), and torchrun if it can.

    ``upstream_runs`` limits the runs of 0.4 where it is slow and its exact time does not decide
    a target (default: as many as the others).
    """
    runs = measure.max_runs if upstream_runs is None else upstream_runs
    measures: dict[Tool, Measure] = {
        "ours": measure,
        "upstream": replace(measure, agent_timeout=None, max_runs=runs),
    }
    if torchrun:
        measures["torchrun"] = measure
    return measures


def launch_overhead() -> Case:
    wall = replace(WALL, target=OVERHEAD_TARGET)
    start = Metric("call to function start on every rank", "s", lambda o: o.start, OVERHEAD_TARGET)
    local = tools_for(Measure("return_at_once"), torchrun=True)
    local["floor"] = Measure("floor")
    remote = tools_for(Measure("return_at_once", hosts=2), torchrun=False)
    remote["floor"] = Measure("ssh_floor", hosts=2)
    no_backend = tools_for(Measure("return_at_once", backend=None), torchrun=True)
    return Case(
        "launch-overhead",
        (
            Setup("launch overhead, 1 host x 2 workers, gloo", local, (wall, start)),
            Setup("launch overhead, 2 test hosts x 2 workers, gloo, SSH", remote, (wall, start)),
            Setup("launch overhead, 1 host x 2 workers, backend=None", no_backend, (wall, start)),
        ),
    )


def back_to_back() -> Case:
    measure = Measure("return_at_once", launches=5, max_runs=3)
    metrics = (
        Metric("first launch", "s", first_wall),
        Metric("per launch after the first", "s", later_walls),
    )
    return Case(
        "back-to-back",
        (
            Setup(
                "back-to-back, 5 launches of 1 host x 2 workers, gloo",
                tools_for(measure, torchrun=False, upstream_runs=2),
                metrics,
            ),
        ),
    )


def failure_latency() -> Case:
    def latency(target: Target) -> tuple[Metric, ...]:
        return (Metric("fault to exception", "s", lambda o: o.latency, target),)

    def fault(workload: str, *, torchrun: bool) -> dict[Tool, Measure]:
        return tools_for(Measure(workload, expect_error=True), torchrun=torchrun, upstream_runs=3)

    link_target = Target(
        f"ours ≤ agent_timeout + 1 = {LINK_CUT_AGENT_TIMEOUT + 1:g} s",
        LINK_CUT_AGENT_TIMEOUT + 1,
        on_ratio=False,
    )
    cut = Measure(
        "sleep_then_return",
        hosts=2,
        workers=1,
        backend=None,
        args=(60,),
        agent_timeout=LINK_CUT_AGENT_TIMEOUT,
        cut=True,
        expect_error=True,
    )
    return Case(
        "failure-latency",
        (
            Setup(
                "failure: rank 0 raises, rank 1 in barrier() (1 host x 2, gloo)",
                fault("raise_in_rank0", torchrun=True),
                latency(WORKER_FAULT_TARGET),
            ),
            Setup(
                "failure: worker SIGKILLed (1 host x 2, gloo)",
                fault("kill_self_rank1", torchrun=True),
                latency(WORKER_FAULT_TARGET),
            ),
            Setup(
                "failure: agent SIGKILLed (1 host x 2, gloo)",
                fault("kill_agent_rank1", torchrun=False),
                latency(WORKER_FAULT_TARGET),
            ),
            Setup(
                f"failure: link of test host 2 cut (2 hosts x 1; ours agent_timeout="
                f"{LINK_CUT_AGENT_TIMEOUT:g}, 0.4 default 60)",
                tools_for(cut, torchrun=False, upstream_runs=1),
                latency(link_target),
            ),
        ),
    )


def results(sizes: Sizes) -> Case:
    megabytes = sizes.result_bytes // 1_000_000
    measure = Measure(
        "big_tensor", backend=None, args=(sizes.result_bytes,), import_torch=True, max_runs=3
    )
    ready = Metric(
        "tensor ready to result",
        "s",
        lambda o: o.transfer,
        Target("ours/0.4 ≤ 0.1 (10x faster)", 0.1, on_ratio=True),
    )
    return Case(
        "results",
        (
            Setup(
                f"results: {megabytes} MB tensor from each of 2 ranks (1 host x 2, backend=None)",
                tools_for(measure, torchrun=False, upstream_runs=2),
                (ready, Metric("throughput", "MB/s", throughput), WALL),
            ),
        ),
    )


def logs(sizes: Sizes) -> Case:
    count = sizes.log_lines
    measure = Measure("print_lines", workers=1, backend=None, args=(count,), max_runs=3)

    def lost_in_files(o: Outcome) -> float | None:
        return None if o.file_lines is None else float(count - o.file_lines)

    metrics = (
        Metric("lines/s, function start to result", "lines/s", lambda o: o.lines_per_s),
        Metric("lines lost on the launcher's stdout", "lines", lambda o: float(count - o.lines)),
        Metric("lines lost in the log files", "lines", lost_in_files),
    )
    return Case(
        "logs",
        (
            Setup(
                f"logs: {count:,} lines printed by one worker (1 host x 1, backend=None)",
                tools_for(measure, torchrun=True),
                metrics,
            ),
        ),
    )


def scale(sizes: Sizes) -> Case:
    setups = []
    ratios = []
    first, last = sizes.scale_hosts[0], sizes.scale_hosts[-1]
    cpu = (
        Metric("CPU time used on the machine", "CPU-s", lambda o: o.cpu_s),
        Metric("CPU time used by the launcher", "CPU-s", lambda o: o.launcher_cpu_s),
    )
    for backend in (None, "gloo"):
        name = "gloo" if backend else "backend=None"
        for hosts in sizes.scale_hosts:
            measure = Measure("return_at_once", hosts, 1, backend)
            if backend and hosts >= 8:
                measure = replace(measure, max_runs=3)
            measures = tools_for(measure, torchrun=False, upstream_runs=3 if hosts == 1 else 1)
            measures["floor"] = replace(measure, workload="ssh_floor")
            setups.append(
                Setup(
                    f"scale, {name}, {hosts} test host{'s' if hosts > 1 else ''} x 1",
                    measures,
                    (WALL, *cpu) if hosts in (first, last) else (WALL,),
                )
            )
        ratios.append(
            Ratio(
                f"scale, {name}, {last} hosts / {first} host",
                f"{setups[-1].label}: {WALL.label}",
                f"{setups[-len(sizes.scale_hosts)].label}: {WALL.label}",
                Target("ours ≤ 2x", 2.0, on_ratio=False),
            )
        )
    return Case("scale", tuple(setups), tuple(ratios))


def memory() -> Case:
    metrics = (
        Metric("launcher", "MB", lambda o: o.launcher_rss_mb),
        Metric("one agent", "MB", lambda o: o.agent_rss_mb),
    )
    return Case(
        "memory",
        (
            Setup(
                "memory (1 host x 2 workers, gloo), peak RSS",
                tools_for(Measure("agent_memory", max_runs=3), torchrun=True),
                metrics,
            ),
        ),
    )


def build_cases(sizes: Sizes) -> tuple[Case, ...]:
    """Every case, in table order."""
    return (
        launch_overhead(),
        back_to_back(),
        failure_latency(),
        results(sizes),
        logs(sizes),
        scale(sizes),
        memory(),
    )


def with_backend(cases: tuple[Case, ...], backend: str) -> tuple[Case, ...]:
    """The cases with every gloo launch on ``backend`` instead (``nccl`` on a GPU machine).

    Launches without a process group stay so, and the floor stays a bare gloo group.
    """

    def label(text: str) -> str:
        return text.replace("gloo", backend)

    def measures(setup: Setup) -> dict[Tool, Measure]:
        return {
            tool: m
            if m.backend != "gloo" or m.workload in ("floor", "ssh_floor")
            else replace(m, backend=backend)
            for tool, m in setup.measures.items()
        }

    return tuple(
        replace(
            case,
            setups=tuple(
                replace(s, label=label(s.label), measures=measures(s)) for s in case.setups
            ),
            ratios=tuple(
                replace(
                    r,
                    label=label(r.label),
                    numerator=label(r.numerator),
                    denominator=label(r.denominator),
                )
                for r in case.ratios
            ),
        )
        for case in cases
    )


CASE_NAMES = tuple(case.name for case in build_cases(FULL))
