"""Warm agents (issues #18, #23): from the call to the function's start on every rank, per run.

    python benchmarks/warm.py [--runs N] [--idle SECONDS] [--smoke] [--setups local ssh]
                              [--tools floor floor-init floor-cold upstream cold warm warm-keep]
                              [--results-file benchmarks/RESULTS.md]

In one invocation, on 1 host x 2 workers (``localhost``) and on 2 bench test hosts x 2 workers
(over SSH), all with gloo, the same function (``workloads.start_time``) is run ``1 + N`` times by:

- ``upstream``: torchrunx 0.4 (its virtual environment, through ``driver.py``): ``Launcher.run``
  in one process; 0.4 has no warm agents, so every launch is cold;
- ``cold``: ours, the same through ``driver.py`` with this checkout;
- ``warm``: ours, ``Launcher.warm()`` once, then ``warm.run`` on the same agents (fresh workers
  each run); then the agents are left idle for ``--idle`` seconds, and their CPU time and the
  launcher's are measured;
- ``warm-keep``: the same with workers that stay (``warm(keep_workers=True)``): the first run
  forks them, the later ones only send the call to each;
- ``floor``: a process per host that has imported torch (as an agent has) is told, over a pipe
  (over SSH on test hosts), to fork its ranks; they join one gloo group through a TCP store
  that this process keeps listening;
- ``floor-cold``: a cold floor: every launch starts a new such process per host (over SSH on
  test hosts), which imports torch and forks its ranks once, onto a store that listens
  already; from before the processes start to every rank's start;
- ``floor-init``: the same as ``floor``, but the ranks join with
  ``init_process_group(init_method="tcp://")``, whose store rank 0 makes (as torchrunx 0.4's
  workers do): a rank that connects before rank 0 listens backs off for a while (torch's
  retry, 0.25 s or more). Ours no longer do: the store's port listens before the workers
  start (``torchrunx.agent.store``).

Targets (issue #23), on runs 2 and later: fresh workers median <= 0.10 s and slowest <= 0.25 s;
workers that stay median <= 0.02 s; cold launches no run more than 0.2 s over their median
(``floor-cold`` shows how much this machine's cold starts vary by themselves).

The figure is the latest rank's ``time.time()`` at its function's first line (after the group is
joined) less ``time.time()`` just before the call: the first run, and the median, min and max of
the N after it. Prints a Markdown table on stdout, progress on stderr. See ``README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import workloads
from driver import RESULT_PREFIX
from harness import (
    Context,
    compile_ours,
    elastic_temp_dirs,
    ensure_upstream_venv,
    free_port,
    kill_leftovers,
    log,
    parse_report,
    remove_peer_leftovers,
    run_process,
    shared_semaphores,
    tail,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cluster import TestCluster, cluster_unavailable_reason, start_cluster  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import paramiko

HERE = Path(__file__).resolve().parent
TARGETS: dict[str, tuple[float | None, float | None]] = {
    "warm": (0.10, 0.25),
    "warm-keep": (0.02, None),
}
"""Issue #23, runs 2 and later: (median, slowest) from the call to every rank's start."""
COLD_SPREAD_S = 0.2
"""Issue #23: no cold launch more than this over the median (torch's connect back-off is gone)."""
BEGIN, END = "<!-- warm:begin -->", "<!-- warm:end -->"
FLOOR_READY = "floor-ready"

Tool = Literal["floor", "floor-init", "floor-cold", "upstream", "cold", "warm", "warm-keep"]
TOOLS: tuple[Tool, ...] = (
    "floor",
    "floor-init",
    "floor-cold",
    "upstream",
    "cold",
    "warm",
    "warm-keep",
)
ROWS: dict[Tool, str] = {
    "upstream": "torchrunx 0.4: `Launcher.run` (every launch cold)",
    "cold": "ours: `Launcher.run` (every launch cold)",
    "warm": "ours: warm agents, `warm.run` (fresh workers each run)",
    "warm-keep": "ours: warm agents, workers that stay (`warm(keep_workers=True)`)",
    "floor": "floor: running processes fork the ranks, gloo group on a listening store",
    "floor-init": "floor, rank 0 makes the store (`init_method=tcp://`)",
    "floor-cold": "floor, cold: a new process per host imports torch, then forks the ranks",
}


@dataclass(frozen=True)
class Setup:
    """Where the function runs: ``localhost`` (``hosts`` 0) or the first bench test hosts."""

    name: str
    label: str
    hosts: int
    workers: int = 2

    @property
    def world_size(self) -> int:
        return max(self.hosts, 1) * self.workers


SETUPS = {
    "local": Setup("local", "1 host x 2 workers, gloo", 0),
    "ssh": Setup("ssh", "2 test hosts x 2 workers, gloo, SSH", 2),
}


@dataclass
class Series:
    """One tool's runs in one setup (seconds).

    Attributes:
        starts: Per run, from the call to the function's start on every rank.
        walls: Per run, from the call to the result (floor: to every rank's exit).
        opened: Warm: ``Launcher.warm()`` until every agent is ready.
        closed: Warm: the end of the ``with`` block (the agents stopped).
        idle: Warm: CPU seconds per minute of the idle agents, the launcher, its idle thread.
        error: Why the runs stopped early, if they did.
        leftovers: Processes still running afterwards, killed.
    """

    starts: list[float] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    opened: float | None = None
    closed: float | None = None
    idle: dict[str, float] | None = None
    error: str | None = None
    leftovers: int = 0


@dataclass
class Invocation:
    """Everything one invocation measured, for the table."""

    args: argparse.Namespace
    setups: list[Setup]
    tools: list[Tool]
    load: float
    results: dict[tuple[str, Tool], Series] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    minutes: float = 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs after the first (median)")
    parser.add_argument(
        "--idle", type=float, default=20.0, help="seconds the warm agents stay idle, measured"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="1 run after the first, 2 s idle, local only, ours and the floor only (tests)",
    )
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    parser.add_argument(
        "--results-file", type=Path, help=f"also write the table between {BEGIN} and {END} here"
    )
    # Internal: the processes this script starts.
    parser.add_argument("--warm-child", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--floor-agent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.idle, args.setups = 1, 2.0, ["local"]
        args.tools = [t for t in args.tools if t != "upstream"]
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.warm_child is not None:
        warm_child(json.loads(args.warm_child))
        return 0
    if args.floor_agent:
        floor_agent()
        return 0
    began = time.monotonic()
    run = Invocation(
        args,
        setups=[SETUPS[name] for name in SETUPS if name in args.setups],
        tools=[tool for tool in TOOLS if tool in args.tools],
        load=os.getloadavg()[0],
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the test hosts
    if {"cold", "warm", "warm-keep"} & set(run.tools):
        compile_ours()
    upstream_python = ensure_upstream_venv() if "upstream" in run.tools else None
    with tempfile.TemporaryDirectory(prefix="trxwarm-") as tmp:
        cluster = start_bench_cluster(run.setups, Path(tmp) / "cluster", run.notes)
        try:
            launches = 1 + args.runs
            ctx = Context(
                cluster,
                Path(tmp) / "runs",
                cap=120.0 + 30.0 * launches,
                failure_cap=0.0,
                upstream_python=upstream_python,
            )
            for setup in run.setups:
                if setup.hosts and cluster is None:
                    continue
                for tool in run.tools:
                    series = measure(tool, setup, ctx, launches, args.idle)
                    run.results[setup.name, tool] = series
                    log(f"{setup.label} | {tool}: {summary(series)}")
        finally:
            if cluster is not None:
                cluster.stop()
    run.minutes = (time.monotonic() - began) / 60
    report = render(run)
    print(report)
    if args.results_file is not None:
        write_results(args.results_file, report)
    return 0


def start_bench_cluster(setups: list[Setup], workdir: Path, notes: list[str]) -> TestCluster | None:
    """The bench-profile test hosts the setups need, or ``None`` (with a note if they cannot)."""
    needed = max(setup.hosts for setup in setups)
    if needed == 0:
        return None
    reason = cluster_unavailable_reason()
    if reason is not None:
        notes.append(f"setups on test hosts skipped: {reason}")
        return None
    workdir.mkdir()
    log(f"starting {needed} bench test hosts")
    return start_cluster(needed, workdir, profile="bench")


def summary(series: Series) -> str:
    parts = ["starts " + ", ".join(f"{s:.3f}" for s in series.starts)]
    if series.opened is not None:
        parts.append(f"opened in {series.opened:.2f}")
    if series.idle:
        parts.append("idle " + ", ".join(f"{k} {v:.3f}" for k, v in series.idle.items()))
    if series.error:
        parts.append(f"error {series.error[:200]}")
    if series.leftovers:
        parts.append(f"{series.leftovers} leftover processes killed")
    return "; ".join(parts)


# -- one tool in one setup ----------------------------------------------------------------------


def measure(tool: Tool, setup: Setup, ctx: Context, launches: int, idle: float) -> Series:
    """``launches`` runs of ``tool`` in ``setup``, in a fresh scratch directory; clean up after."""
    scratch = Path(ctx.runs_root, f"{time.monotonic_ns()}")
    scratch.mkdir(parents=True)
    peer = tool == "upstream"  # leaves semaphores and elastic folders
    semaphores, elastic = (shared_semaphores(), elastic_temp_dirs()) if peer else (set(), set())
    try:
        if tool in ("floor", "floor-init"):
            series = run_floor(setup, ctx, scratch, launches, own_store=tool == "floor")
        elif tool == "floor-cold":
            series = run_floor_cold(setup, ctx, scratch, launches)
        elif tool in ("warm", "warm-keep"):
            keep = tool == "warm-keep"
            series = run_warm(setup, ctx, scratch, launches, 0.0 if keep else idle, keep=keep)
        else:
            series = run_driver(tool, setup, ctx, scratch, launches)
    finally:
        leftovers = kill_leftovers(ctx.runs_root)
        if peer:
            remove_peer_leftovers(semaphores, elastic)
        shutil.rmtree(scratch, ignore_errors=True)
    series.leftovers = leftovers
    return series


def hostnames(setup: Setup, ctx: Context) -> list[str]:
    if not setup.hosts:
        return ["localhost"]
    if ctx.cluster is None:
        raise RuntimeError("this setup needs the bench test hosts")
    return ctx.cluster.names()[: setup.hosts]


def run_driver(tool: Tool, setup: Setup, ctx: Context, scratch: Path, launches: int) -> Series:
    """``launches`` calls of ``Launcher.run`` in one ``driver.py`` process (ours or 0.4)."""
    cluster = ctx.cluster if setup.hosts else None
    payload = {
        "tool": "upstream" if tool == "upstream" else "ours",
        "workload": "start_time",
        "hosts": hostnames(setup, ctx),
        "workers": setup.workers,
        "backend": "gloo",
        "args": [],
        "launches": launches,
        "agent_timeout": None,
        "cut_veth": None,
        "world_size": setup.world_size,
        "import_torch": False,
        "ssh_config": str(cluster.ssh_config) if cluster else None,
        "launcher_name": cluster.profile.launcher_name if cluster else None,
    }
    python = ctx.upstream_python if tool == "upstream" else Path(sys.executable)
    if python is None:
        raise RuntimeError("torchrunx 0.4 is measured without its virtual environment")
    argv = [str(python), str(HERE / "driver.py"), json.dumps(payload)]
    with without_pythonpath() if tool == "upstream" else contextlib.nullcontext():
        stdout, stderr, capped, _ = run_process(argv, scratch, ctx.cap)
    report = parse_report(stdout)
    if report is None:
        why = f"killed at the {ctx.cap:g} s cap" if capped else f"driver failed: {tail(stderr)}"
        return Series(error=why)
    per_rank = [read_lines(scratch / f"starts-{rank}") for rank in range(setup.world_size)]
    series = Series(error=report["error"])
    for i, (called, returned) in enumerate(zip(report["calls"], report["results"], strict=True)):
        if not all(len(times) > i for times in per_rank):
            series.error = series.error or f"run {i + 1}: a rank recorded no start"
            break
        series.starts.append(max(times[i] for times in per_rank) - called)
        series.walls.append(returned - called)
    return series


@contextlib.contextmanager
def without_pythonpath() -> Iterator[None]:
    """No ``PYTHONPATH`` for 0.4's processes: a checkout on it would shadow 0.4's ``torchrunx``
    (in the driver, and in 0.4's agents, which copy ``PYTHON*`` variables).
    """
    saved = os.environ.pop("PYTHONPATH", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["PYTHONPATH"] = saved


def read_lines(path: Path) -> list[float]:
    """The times in ``path``, one a line (none if it is missing)."""
    with contextlib.suppress(OSError):
        return [float(line) for line in path.read_text().split()]
    return []


def run_warm(  # noqa: PLR0913 (the setup, and how to run the warm agents)
    setup: Setup, ctx: Context, scratch: Path, launches: int, idle: float, *, keep: bool
) -> Series:
    """Warm agents in a fresh process (``--warm-child``): open, ``launches`` runs, idle, close.

    ``keep``: workers that stay (``warm(keep_workers=True)``).
    """
    cluster = ctx.cluster if setup.hosts else None
    spec = {
        "hosts": hostnames(setup, ctx),
        "workers": setup.workers,
        "ssh_config": str(cluster.ssh_config) if cluster else None,
        "launches": launches,
        "idle": idle,
        "keep": keep,
    }
    argv = [sys.executable, str(Path(__file__).resolve()), "--warm-child", json.dumps(spec)]
    stdout, stderr, capped, _ = run_process(argv, scratch, ctx.cap + idle)
    report = parse_report(stdout)
    if report is None:
        why = f"killed at the {ctx.cap:g} s cap" if capped else f"child failed: {tail(stderr)}"
        return Series(error=why)
    return Series(
        starts=[s - c for c, s in zip(report["calls"], report["starts"], strict=True)],
        walls=[r - c for c, r in zip(report["calls"], report["results"], strict=True)],
        opened=report["opened"],
        closed=report["closed"],
        idle=report["idle"],
        error=report["error"],
    )


def warm_child(spec: dict[str, Any]) -> None:
    """In the measured process: warm agents, their runs, their idle time; print the report."""
    import cloudpickle  # noqa: PLC0415 (only here)

    cloudpickle.register_pickle_by_value(workloads)
    import torchrunx  # noqa: PLC0415 (only here)

    fields: dict[str, Any] = {
        "hostnames": spec["hosts"],
        "workers_per_host": spec["workers"],
        "backend": "gloo",
    }
    if spec["ssh_config"] is not None:
        fields["ssh_config_file"] = spec["ssh_config"]
    scratch = str(Path.cwd())
    report: dict[str, Any] = {"calls": [], "results": [], "starts": [], "error": None}
    report.update(opened=None, closed=None, idle=None)
    try:
        began = time.time()
        with torchrunx.Launcher(**fields).warm(keep_workers=spec["keep"]) as warm:
            report["opened"] = time.time() - began
            agents: set[int] = set()
            for _ in range(spec["launches"]):
                called = time.time()
                result = warm.run(workloads.start_time, scratch)
                returned = time.time()
                report["calls"].append(called)
                report["results"].append(returned)
                report["starts"].append(max(start for start, _ in result.ranks))
                agents = {agent for _, agent in result.ranks}
            if spec["idle"] > 0:
                report["idle"] = idle_cpu(sorted(agents), spec["idle"])
            closing = time.time()
        report["closed"] = time.time() - closing
    except Exception as exc:  # noqa: BLE001 (reported in the table)
        report["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        traceback.print_exc()
    print(RESULT_PREFIX + json.dumps(report), flush=True)


def idle_cpu(agents: list[int], seconds: float) -> dict[str, float]:
    """CPU seconds per minute of the agents (and their children: the guardians), of this
    process (the launcher: its main thread sleeps here) and of its idle thread, over ``seconds``
    of idleness after the last run.
    """
    time.sleep(1.0)  # the last run's workers are reaped, its messages done
    processes = agents + descendants(agents)
    thread = next(
        (t.native_id for t in threading.enumerate() if t.name == "torchrunx-warm-agents"), None
    )
    own = [Path("/proc/self/stat")]
    threads = [Path(f"/proc/self/task/{thread}/stat")] if thread is not None else []
    paths = [Path(f"/proc/{pid}/stat") for pid in processes]
    before = [cpu_ticks(paths), cpu_ticks(own), cpu_ticks(threads)]
    started = time.monotonic()
    time.sleep(seconds)
    after = [cpu_ticks(paths), cpu_ticks(own), cpu_ticks(threads)]
    per_minute = 60 / (time.monotonic() - started) / os.sysconf("SC_CLK_TCK")
    agents_cpu, launcher_cpu, thread_cpu = (
        (a - b) * per_minute for a, b in zip(after, before, strict=True)
    )
    return {
        "agents": agents_cpu,
        "launcher": launcher_cpu,
        "idle_thread": thread_cpu if thread is not None else float("nan"),
        "processes": float(len(processes)),
    }


def cpu_ticks(stat_files: list[Path]) -> int:
    """utime + stime, in clock ticks, summed over ``/proc/.../stat`` files (gone ones: 0)."""
    total = 0
    for path in stat_files:
        with contextlib.suppress(OSError):
            fields = path.read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)
    return total


def descendants(pids: list[int]) -> list[int]:
    """Every live descendant of ``pids`` (the test hosts share this pid namespace)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(pids)
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


# -- the floor ------------------------------------------------------------------------------------


def floor_agent() -> None:
    """A bare agent: import torch, then per line on stdin fork the ranks it names; say ``done``.

    A line is ``PORT WORLD_SIZE ADDRESS FIRST_RANK COUNT TAG MODE``; each rank joins the gloo
    group at ``ADDRESS:PORT`` (``MODE`` ``store``: a TCP store that listens there already;
    ``init``: ``init_method="tcp://..."``, rank 0 makes the store), then writes ``time.time()``
    to ``floor-TAG-RANK`` in the working directory and exits.
    """
    import torch.distributed as dist  # noqa: PLC0415 (as an agent imports torch before runs)

    print(FLOOR_READY, flush=True)
    for line in sys.stdin:
        port, world_size, address, first, count, tag, mode = line.split()
        pids = []
        for rank in range(int(first), int(first) + int(count)):
            pid = os.fork()
            if pid == 0:
                floor_rank(dist, (address, int(port), mode), rank, int(world_size), tag)
            pids.append(pid)
        statuses = [os.waitpid(pid, 0)[1] for pid in pids]
        print("done" if not any(statuses) else f"failed {statuses}", flush=True)


def floor_rank(
    dist: Any,  # noqa: ANN401 (torch.distributed, imported by the caller)
    store: tuple[str, int, str],
    rank: int,
    world_size: int,
    tag: str,
) -> None:
    """In a forked child: join the group, record the time, leave, exit (never returns)."""
    code = 1
    address, port, mode = store
    try:
        group = {"rank": rank, "world_size": world_size, "timeout": dt.timedelta(seconds=30)}
        if mode == "store":
            client = dist.TCPStore(address, port, is_master=False, timeout=group["timeout"])
            prefixed = dist.PrefixStore(f"round-{tag}/", client)
            dist.init_process_group("gloo", store=prefixed, **group)
        else:
            dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", **group)
        now = time.time()
        Path(f"floor-{tag}-{rank}").write_text(repr(now))
        # Leave together: a rank that destroyed its group while another still finished joining
        # it failed that one (seen under load: "failed [0, 256]"). After the time is taken.
        dist.barrier()
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001 (the parent reports the exit status)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@dataclass
class FloorAgent:
    """One running floor agent: its stdin and stdout, and what to close."""

    stdin: IO[str] | IO[bytes]
    stdout: IO[str] | IO[bytes]
    close: Callable[[], None]

    def send(self, line: str) -> None:
        self.stdin.write(line)  # type: ignore[arg-type] (paramiko's files take str too)
        self.stdin.flush()

    def reply(self) -> str:
        line = self.stdout.readline()
        return (line.decode() if isinstance(line, bytes) else line).strip()


def run_floor(
    setup: Setup, ctx: Context, scratch: Path, launches: int, *, own_store: bool
) -> Series:
    """``launches`` rounds of the floor: the ranks forked by running agents join a group.

    ``own_store``: through a TCP store that this process keeps listening (else rank 0 makes
    one each round, on the first host).
    """
    agents: list[FloorAgent] = []
    try:
        address = start_floor_agents(setup, ctx, scratch, agents)
        server = None
        if own_store:
            if setup.hosts:
                assert ctx.cluster is not None  # hostnames() checked
                address = ctx.cluster.launcher_address  # this machine, from the test hosts
            server = listening_store(address)
        ready = [agent.reply() for agent in agents]
        if any(line != FLOOR_READY for line in ready):
            series = Series(error=f"a floor agent did not start: {ready}")
        else:
            store = (address, server.port if server is not None else None)
            series = floor_rounds(agents, setup, store, scratch, launches)
    finally:
        for agent in agents:
            agent.close()
        agents.clear()
        gc.collect()  # paramiko's files now, not at interpreter exit (it complains then)
    return with_tracebacks(series, scratch)


def with_tracebacks(series: Series, scratch: Path) -> Series:
    """``series``, its error (if any) followed by the last lines the floor agents wrote."""
    if series.error is not None:
        for path in sorted(scratch.glob("floor-agent-*.err")):
            lines = [line for line in path.read_text().splitlines() if "Warning" not in line]
            series.error += f" [{path.name}: {' | '.join(lines[-4:])}]"
    return series


def run_floor_cold(setup: Setup, ctx: Context, scratch: Path, launches: int) -> Series:
    """``launches`` cold rounds: each starts new floor agents (over SSH on test hosts), which
    import torch, fork the ranks, and join a group on a store that listens already.

    The least a cold launch does: the figure is from before the agents start to every rank's
    start, so its spread is what this machine's starts and imports of torch vary by.
    """
    series = Series()
    address = "127.0.0.1"
    if setup.hosts:
        assert ctx.cluster is not None  # hostnames() checked
        address = ctx.cluster.launcher_address
    server = listening_store(address)
    for round_ in range(launches):
        agents: list[FloorAgent] = []
        try:
            called = time.time()
            start_floor_agents(setup, ctx, scratch, agents)
            ready = [agent.reply() for agent in agents]
            if any(line != FLOOR_READY for line in ready):
                series.error = f"round {round_ + 1}: a floor agent did not start: {ready}"
                break
            figures = floor_round(agents, setup, (address, server.port), scratch, round_, called)
        finally:
            for agent in agents:
                agent.close()
            gc.collect()
        if isinstance(figures, str):
            series.error = figures
            break
        series.starts.append(figures[0])
        series.walls.append(figures[1])
    del server
    return with_tracebacks(series, scratch)


def start_floor_agents(setup: Setup, ctx: Context, scratch: Path, agents: list[FloorAgent]) -> str:
    """Start one floor agent per host (added to ``agents``); the address of rank 0's host."""
    floor = [sys.executable, str(Path(__file__).resolve()), "--floor-agent"]
    if not setup.hosts:
        agents.append(local_floor_agent(floor, scratch))
        return "127.0.0.1"
    assert ctx.cluster is not None  # hostnames() checked
    config = str(ctx.cluster.ssh_config)
    for host in hostnames(setup, ctx):
        command = (
            f"cd {shlex.quote(str(scratch))} && exec {shlex.join(floor)} 2> floor-agent-{host}.err"
        )
        agents.append(ssh_floor_agent(host, config, command))
    return ctx.cluster.hosts[0].address


def listening_store(address: str) -> Any:  # noqa: ANN401 (a torch.distributed.TCPStore)
    """A TCP store server in this process, on a free port, that clients reach at ``address``."""
    import torch.distributed as dist  # noqa: PLC0415 (only this floor needs torch here)

    timeout = dt.timedelta(seconds=30)
    return dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def floor_rounds(
    agents: list[FloorAgent],
    setup: Setup,
    store: tuple[str, int | None],
    scratch: Path,
    launches: int,
) -> Series:
    """``launches`` rounds, until one fails."""
    series = Series()
    for round_ in range(launches):
        figures = floor_round(agents, setup, store, scratch, round_)
        if isinstance(figures, str):
            series.error = figures
            break
        series.starts.append(figures[0])
        series.walls.append(figures[1])
    return series


def local_floor_agent(argv: list[str], scratch: Path) -> FloorAgent:
    with (scratch / "floor-agent-localhost.err").open("w") as stderr:  # warnings, tracebacks
        proc = subprocess.Popen(
            argv,
            cwd=scratch,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    assert proc.stdin is not None  # PIPE
    assert proc.stdout is not None

    def close() -> None:
        assert proc.stdin is not None  # PIPE
        proc.stdin.close()  # EOF: the agent exits
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return FloorAgent(proc.stdin, proc.stdout, close)


def ssh_floor_agent(host: str, config_file: str, command: str) -> FloorAgent:
    from torchrunx.engines.ssh import resolve_ssh_target, ssh_connect  # noqa: PLC0415

    clients: list[paramiko.SSHClient] = ssh_connect(
        resolve_ssh_target(host, config_file, 10.0), config_file
    )
    stdin, stdout, _ = clients[-1].exec_command(command)

    def close() -> None:
        stdin.close()  # flushed, then EOF: the agent exits
        stdout.channel.recv_exit_status()
        for client in reversed(clients):
            client.close()

    return FloorAgent(stdin, stdout, close)


def floor_round(  # noqa: PLR0913, PLR0917 (a round, and when its clock started)
    agents: list[FloorAgent],
    setup: Setup,
    store: tuple[str, int | None],
    scratch: Path,
    tag: int,
    since: float | None = None,
) -> tuple[float, float] | str:
    """One round: tell every agent at once, wait for their ranks to exit.

    ``store``: the address of the group's store, and its port if it listens already (else rank
    0 makes it, on a free port). ``since``: the time the figures count from (default: now).

    Returns:
        Seconds to the start on every rank and to every agent's reply, or what went wrong.
    """
    address, port = store
    mode = "store" if port is not None else "init"
    if port is None:
        port = free_port() if not setup.hosts else random.randint(20000, 60000)
    lines = [
        f"{port} {setup.world_size} {address} {i * setup.workers} {setup.workers} {tag} {mode}\n"
        for i in range(len(agents))
    ]
    called = time.time()
    for agent, line in zip(agents, lines, strict=True):
        agent.send(line)
    replies = [agent.reply() for agent in agents]
    returned = time.time()
    if any(reply != "done" for reply in replies):
        return f"round {tag + 1}: {replies}"
    starts = [read_lines(scratch / f"floor-{tag}-{rank}") for rank in range(setup.world_size)]
    if not all(starts):
        return f"round {tag + 1}: a rank recorded no time"
    base = called if since is None else since
    return max(times[0] for times in starts) - base, returned - base


# -- the table ------------------------------------------------------------------------------------


def render(run: Invocation) -> str:
    """The table of figures, the table of idle CPU, the notes."""
    runs = run.args.runs
    header = [
        "setup",
        "launcher",
        "first run",
        f"runs 2 to {runs + 1}: median" if runs > 1 else "run 2",
        "min",
        "max",
        "call to result (median)",
        "median / 0.4's",
        "target",
        "met?",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for setup in run.setups:
        for tool in run.tools:
            series = run.results.get((setup.name, tool))
            if series is not None:
                upstream = run.results.get((setup.name, "upstream"))
                lines.append(table_row(setup, tool, series, upstream))
    text = "\n".join(lines)
    if "warm" in run.tools:
        text += "\n\n" + idle_table(run)
    return text + "\n\n" + "\n".join(f"- {note}" for note in all_notes(run))


def table_row(setup: Setup, tool: Tool, series: Series, upstream: Series | None) -> str:
    later = series.starts[1:]
    cells = [setup.label, ROWS[tool]]
    cells.append(show_s(series.starts[0]) if series.starts else "error")
    if later:
        cells += [show_s(statistics.median(later)), show_s(min(later)), show_s(max(later))]
        cells.append(show_s(statistics.median(series.walls[1:])))
    else:
        cells += ["-"] * 4
    theirs = upstream.starts[1:] if upstream is not None else []
    if tool in ("cold", "warm", "warm-keep") and later and theirs:
        ratio = statistics.median(later) / statistics.median(theirs)
        cells.append(f"{ratio:.3f}" if ratio < 0.1 else f"{ratio:.2f}")
    else:
        cells.append("")
    target, met = target_of(tool, later)
    cells += [target, {True: "yes", False: "**no**", None: "?"}[met] if target else ""]
    return "| " + " | ".join(cells) + " |"


def target_of(tool: Tool, later: list[float]) -> tuple[str, bool | None]:
    """The target of ``tool``'s runs after the first (text, and whether ``later`` meets it)."""
    if tool == "cold":
        spread = max(later) - statistics.median(later) if later else None
        return f"max ≤ median + {COLD_SPREAD_S:g} s", None if spread is None else (
            spread <= COLD_SPREAD_S
        )
    if tool not in TARGETS:
        return "", None
    median_s, max_s = TARGETS[tool]
    parts, met = [], None if not later else True
    if median_s is not None:
        parts.append(f"median ≤ {median_s:g} s")
        met = met and statistics.median(later) <= median_s
    if max_s is not None:
        parts.append(f"max ≤ {max_s:g} s")
        met = met and max(later) <= max_s
    return ", ".join(parts), met


def idle_table(run: Invocation) -> str:
    """CPU time of the idle warm agents and of the launcher, per minute, per setup."""
    results = run.results
    measured = [s for s in run.setups if (found := results.get((s.name, "warm"))) and found.idle]
    if not measured:
        return "Idle warm agents: not measured."
    window = run.args.idle
    header = [f"idle warm agents: CPU over {window:g} s, per minute", *(s.label for s in measured)]
    rows = [
        ("the agents, with their guardian processes", "agents"),
        ("launcher process, all threads (its main thread sleeps)", "launcher"),
        ("of which the launcher's idle thread (`torchrunx-warm-agents`)", "idle_thread"),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, key in rows:
        cells = [label]
        for setup in measured:
            idle_cpu_s = results[setup.name, "warm"].idle or {}
            value = idle_cpu_s.get(key)
            cells.append("-" if value is None else show_cpu(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def all_notes(run: Invocation) -> list[str]:
    """What the figures are, the machine, and what happened (errors, leftovers, skipped)."""
    out = [
        (
            "Seconds from `time.time()` just before the call to the latest rank's `time.time()` "
            "at the first line of the function (after the gloo group is joined): the first "
            f"run, then the median, min and max of the {run.args.runs} after it; every tool's runs "
            "in one process. The floors: one process per host, torch imported, is told (over "
            "SSH on test hosts) to fork its 2 ranks, which join one gloo group: through a TCP "
            "store that the benchmark keeps listening, or with `init_method=tcp://`, whose store "
            "rank 0 makes, as the original torchrunx's workers do. The cold floor starts such "
            "a process per host for every launch (over SSH on test hosts): it imports torch, "
            "then forks its ranks onto the listening store; its spread is this machine's own."
        ),
        (
            f"{os.cpu_count()} cores; {run.minutes:.1f} min in all; load average {run.load:.2f} "
            "at the "
            "start. ours: this checkout, compiled to bytecode first."
        ),
    ]
    for (setup_name, tool), series in run.results.items():
        label = SETUPS[setup_name].label
        if tool in ("warm", "warm-keep") and series.opened is not None:
            closed = "" if series.closed is None else f", its end {series.closed:.2f} s"
            out.append(
                f"{label}, {tool}: `Launcher.warm()` took {series.opened:.2f} s{closed}. It "
                "returns once "
                "every agent has said hello; the agents' import of torch, which starts then, "
                "ends within the first run."
            )
        if series.error:
            out.append(f"Error, {ROWS[tool]}, {label}: {series.error[:300]}")
        if series.leftovers:
            out.append(f"{ROWS[tool]}, {label}: {series.leftovers} leftover processes killed.")
    return out + run.notes


def show_s(value: float) -> str:
    if value < 1:
        return f"{value:.3f} s"
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def show_cpu(per_minute: float) -> str:
    if per_minute != per_minute:  # noqa: PLR0124 (NaN: not measured)
        return "-"
    return f"{per_minute:.2f} CPU-s ({per_minute / 60:.2%} of a core)"


def write_results(path: Path, report: str) -> None:
    """Replace the part of ``path`` between the markers with the table (append it if missing)."""
    from run import machine  # noqa: PLC0415 (run.py's description of this machine)

    command = "python benchmarks/warm.py " + " ".join(sys.argv[1:])
    block = (
        f"{BEGIN}\n"
        f"Run on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: {machine()}.\n\n"
        f"Command: `{command.strip()}`\n\n{report}\n\n{END}"
    )
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if BEGIN not in text:
        text = text.rstrip("\n") + f"\n\n## Warm agents (issue #18)\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail_text = rest.partition(END)
    path.write_text(head + block + tail_text)


if __name__ == "__main__":
    sys.exit(main())
