"""Running one measured launch of one tool in a fresh process, and cleaning up after it."""

from __future__ import annotations

import compileall
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cases import Measure, Outcome, Tool
from driver import RESULT_PREFIX
from workloads import LINE_MARKER

if TYPE_CHECKING:
    from cluster import TestCluster

HERE = Path(__file__).resolve().parent
UPSTREAM_VENV = HERE / ".venv-upstream"
UPSTREAM_VERSION = "0.4.0"
TORCH_VERSION = "2.13.0"


@dataclass(frozen=True)
class Context:
    """What every measurement needs.

    Attributes:
        cluster: The bench-profile test hosts, or ``None`` where they cannot be made.
        runs_root: Directory under which each measurement gets its scratch directory (the
            processes of a measurement are recognised by a working directory under it).
        cap: Seconds a measurement may take before it is killed and reported as "> cap".
        failure_cap: The same for the failure cases, where a tool may not notice at all.
        upstream_python: Interpreter of the torchrunx 0.4 virtual environment, if it is used.
    """

    cluster: TestCluster | None
    runs_root: Path
    cap: float
    failure_cap: float
    upstream_python: Path | None

    def cap_for(self, spec: Measure) -> float:
        """The cap of a measurement."""
        return self.failure_cap if spec.expect_error else self.cap


def compile_ours() -> None:
    """Compile this checkout's package to bytecode, as ``pip install`` does for 0.4's.

    The editable install used for development compiles nothing, and where
    ``PYTHONDONTWRITEBYTECODE`` is set (it is on the machine the tests run on) imports never
    write the caches either: every launcher, agent and worker would compile torchrunx from
    source, which 0.4 (compiled at install) never does.
    """
    package = HERE.parent / "torchrunx"
    if not compileall.compile_dir(package, quiet=1):
        raise RuntimeError(f"cannot compile {package} to bytecode")


def ensure_upstream_venv() -> Path:
    """The interpreter of a virtual environment with torchrunx 0.4.0, created if missing."""
    python = UPSTREAM_VENV / "bin" / "python"
    # -I: not the checkout's own torchrunx.egg-info in the working directory
    check = [
        str(python),
        "-I",
        "-c",
        "import importlib.metadata as m; print(m.version('torchrunx'))",
    ]
    if python.exists():
        found = subprocess.run(check, capture_output=True, text=True, check=False)
        if found.stdout.strip() == UPSTREAM_VERSION:
            return python
    log(f"creating {UPSTREAM_VENV} with torchrunx=={UPSTREAM_VERSION} (once)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(UPSTREAM_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # torch first, pinned, so that torchrunx's dependency on torch does not pull another build.
    subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([*pip, f"torchrunx=={UPSTREAM_VERSION}"], check=True)
    return python


def log(message: str) -> None:
    """Progress, on stderr (the table goes to stdout)."""
    print(message, file=sys.stderr, flush=True)


def measure(tool: Tool, spec: Measure, ctx: Context) -> Outcome:
    """Run one launch of ``spec`` with ``tool`` in a fresh scratch directory; clean up after."""
    scratch = Path(ctx.runs_root, f"{time.monotonic_ns()}")
    scratch.mkdir(parents=True)
    cap = ctx.cap_for(spec)
    peer = tool in ("torchrun", "upstream")  # only they leave semaphores and elastic folders
    semaphores_before = shared_semaphores() if peer else set()
    elastic_before = elastic_temp_dirs() if peer else set()
    cpu_before = machine_cpu_seconds()
    try:
        outcome = launch(tool, spec, scratch, ctx)
        outcome.cpu_s = machine_cpu_seconds() - cpu_before
        read_rank_files(outcome, spec, scratch)
        if tool == "torchrun":  # its launcher is its agent
            outcome.launcher_rss_mb = outcome.agent_rss_mb
    finally:
        if spec.cut and ctx.cluster is not None:
            ctx.cluster.restore_link(ctx.cluster.hosts[spec.hosts - 1])
        leftovers = kill_leftovers(ctx.runs_root)
        if peer:
            remove_peer_leftovers(semaphores_before, elastic_before)
        shutil.rmtree(scratch, ignore_errors=True)
    outcome.leftovers = leftovers
    if outcome.capped and spec.expect_error:
        outcome.latency = math.inf
    elif outcome.capped:
        outcome.error = f"killed at the {cap:g} s cap"
    elif outcome.error is None and spec.expect_error:
        outcome.error = "expected a failure, but the launch succeeded"
    return outcome


def remove_peer_leftovers(semaphores_before: set[str], elastic_before: set[Path]) -> None:
    """What torchrun and 0.4 made during a measurement and left behind.

    Multiprocessing semaphores (their temp files went to the scratch directory through
    ``TMPDIR``), and torch.distributed.elastic's run folders: torchrunx 0.4's agents start over
    SSH and do not get our ``TMPDIR``, so theirs land in the system temp folder.
    """
    for name in shared_semaphores() - semaphores_before:
        with contextlib.suppress(OSError):
            (SHM / name).unlink()
    for path in elastic_temp_dirs() - elastic_before:
        shutil.rmtree(path, ignore_errors=True)


def launch(tool: Tool, spec: Measure, scratch: Path, ctx: Context) -> Outcome:
    """The measured process of ``tool``: a driver, torchrun, or one of the floors."""
    if spec.workload == "ssh_floor":
        outcome = run_driver(tool, spec, scratch, ctx, script="ssh_floor.py")
        outcome.harness_error = outcome.harness_error or outcome.error is not None
        return outcome
    if spec.workload == "floor":
        return run_floor(scratch, ctx.cap_for(spec))
    if tool == "torchrun":
        return run_torchrun(spec, scratch, ctx.cap_for(spec))
    return run_driver(tool, spec, scratch, ctx)


def run_driver(
    tool: Tool, spec: Measure, scratch: Path, ctx: Context, script: str = "driver.py"
) -> Outcome:
    """Launch with ours or 0.4 through ``driver.py`` (or the SSH floor through ``ssh_floor.py``)."""
    python = ctx.upstream_python if tool == "upstream" else Path(sys.executable)
    if python is None:
        raise RuntimeError("torchrunx 0.4 is measured without its virtual environment")
    cluster = ctx.cluster
    hosts = ["localhost"]
    if spec.hosts:
        if cluster is None:
            raise RuntimeError("this setup needs the bench test hosts")
        hosts = cluster.names()[: spec.hosts]
    payload = {
        "tool": tool,
        "workload": spec.workload,
        "hosts": hosts,
        "workers": spec.workers,
        "backend": spec.backend,
        "args": list(spec.args),
        "launches": spec.launches,
        "agent_timeout": spec.agent_timeout,
        "cut_veth": cluster.hosts[spec.hosts - 1].veth if spec.cut and cluster else None,
        "world_size": spec.world_size,
        "import_torch": spec.import_torch,
        "ssh_config": str(cluster.ssh_config) if cluster else None,
        "launcher_name": cluster.profile.launcher_name if cluster else None,
    }
    argv = [str(python), str(HERE / script), json.dumps(payload)]
    stdout, stderr, capped, _ = run_process(argv, scratch, ctx.cap_for(spec))
    outcome = Outcome(capped=capped, lines=stdout.count(LINE_MARKER))
    report = parse_report(stdout)
    if report is None:
        if not capped:
            outcome.error = f"driver failed: {tail(stderr)}"
            outcome.harness_error = True
        return outcome
    outcome.walls = [r - c for c, r in zip(report["calls"], report["results"], strict=True)]
    outcome.error = report["error"]
    outcome.file_lines = report["log_lines_in_files"]
    outcome.launcher_rss_mb = report["launcher_rss_kb"] / 1024
    outcome.launcher_cpu_s = report["launcher_cpu_s"]
    if report["error_at"] is not None and spec.expect_error:
        outcome.latency = since_fault(scratch, report["error_at"])
    if report["calls"]:
        first_call, last_result = report["calls"][0], report["results"][-1]
        outcome.start = latest(scratch, "start-", spec.world_size, first_call)
        lines = max(outcome.lines, outcome.file_lines)
        outcome.lines_per_s = lines_rate(lines, scratch, last_result)
        outcome.transfer = transfer_time(scratch, spec.world_size, last_result)
        value = report.get("value")
        outcome.transferred_bytes = sum(value) if isinstance(value, list) else 0
    return outcome


def run_torchrun(spec: Measure, scratch: Path, cap: float) -> Outcome:
    """Launch with ``torchrun`` (one host); the call is the command's start, the result its exit."""
    payload = {"workload": spec.workload, "backend": spec.backend, "args": list(spec.args)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    argv += ["--nproc-per-node", str(spec.workers), str(HERE / "torchrun_worker.py")]
    argv.append(json.dumps(payload))
    started = time.time()
    stdout, stderr, capped, returncode = run_process(argv, scratch, cap)
    ended = time.time()
    outcome = Outcome(capped=capped, lines=stdout.count(LINE_MARKER))
    if returncode != 0 and not capped:
        outcome.error = f"torchrun exited with {returncode}"
        outcome.latency = since_fault(scratch, ended)
        if not spec.expect_error:
            outcome.error += f": {tail(stderr)}"
        return outcome
    outcome.walls = [ended - started]
    outcome.start = latest(scratch, "start-", spec.world_size, started)
    outcome.lines_per_s = lines_rate(outcome.lines, scratch, ended)
    return outcome


def run_floor(scratch: Path, cap: float) -> Outcome:
    """Two bare processes that import torch and join a gloo group."""
    port = free_port()
    started = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "floor.py"), str(rank), str(port)],
            cwd=scratch,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        errors = [proc.communicate(timeout=cap)[1] for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        return Outcome(capped=True, harness_error=True)
    ended = time.time()
    outcome = Outcome(walls=[ended - started], start=latest(scratch, "start-", 2, started))
    if any(proc.returncode for proc in procs):
        outcome.error = f"floor failed: {tail(''.join(errors))}"
        outcome.harness_error = True
    return outcome


SHM = Path("/dev/shm")


def shared_semaphores() -> set[str]:
    """Names of the multiprocessing semaphores in /dev/shm (torchrun's workers make them)."""
    return {p.name for p in SHM.glob("sem.mp-*")} if SHM.is_dir() else set()


def elastic_temp_dirs() -> set[Path]:
    """Folders torch.distributed.elastic made in the system temp folder.

    They are ``tmp*/`` folders that hold only ``test_run_id_*`` entries.
    """
    found = set()
    for path in Path(tempfile.gettempdir()).glob("tmp*"):
        with contextlib.suppress(OSError):
            entries = list(path.iterdir()) if path.is_dir() else [path]
            if entries and all(e.name.startswith("test_run_id_") for e in entries):
                found.add(path)
    return found


def run_process(argv: list[str], cwd: Path, cap: float) -> tuple[str, str, bool, int]:
    """Run a command in its own session; kill the session after ``cap`` seconds.

    Its temporary files (``TMPDIR``) go to ``cwd/tmp``, which is removed with ``cwd``.

    Returns:
        stdout, stderr, whether it was killed at the cap, and the exit status.
    """
    tmp = cwd / "tmp"
    tmp.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)},
    )
    try:
        stdout, stderr = proc.communicate(timeout=cap)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return stdout, stderr, True, proc.returncode
    return stdout, stderr, False, proc.returncode


def parse_report(stdout: str) -> dict[str, Any] | None:
    """The driver's ``BENCH-RESULT`` line, decoded."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            report: dict[str, Any] = json.loads(line.removeprefix(RESULT_PREFIX))
            return report
    return None


def read_rank_files(outcome: Outcome, spec: Measure, scratch: Path) -> None:
    """The agent's peak RSS, which ``agent_memory`` leaves in ``agent-rss-0``."""
    if spec.workload == "agent_memory":
        path = scratch / "agent-rss-0"
        if path.exists():
            outcome.agent_rss_mb = int(path.read_text()) / 1024


def read_time(path: Path, default: float) -> float:
    """A time written by ``workloads.mark``, or ``default`` if the file is missing."""
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return default


def since_fault(scratch: Path, at: float) -> float | None:
    """Seconds from the fault (``fault``, written by the injector) to ``at``; ``None`` if none."""
    fault = scratch / "fault"
    return at - read_time(fault, at) if fault.exists() else None


def latest(scratch: Path, prefix: str, count: int, since: float) -> float | None:
    """Seconds from ``since`` to the latest of ``prefix0..prefix{count-1}``; ``None`` if missing."""
    paths = [scratch / f"{prefix}{r}" for r in range(count)]
    if not all(p.exists() for p in paths):
        return None
    return max(read_time(p, since) for p in paths) - since


def lines_rate(lines: int, scratch: Path, end: float) -> float | None:
    """Lines per second from the printing rank's start (``start-0``) to ``end``."""
    start = scratch / "start-0"
    if not lines or not start.exists():
        return None
    return lines / max(end - read_time(start, end), 1e-9)


def transfer_time(scratch: Path, world_size: int, end: float) -> float | None:
    """Seconds from the first rank's tensor being ready (``ready-<rank>``) to ``end``."""
    paths = [scratch / f"ready-{r}" for r in range(world_size)]
    if not all(p.exists() for p in paths):
        return None
    return end - min(read_time(p, end) for p in paths)


def kill_leftovers(root: Path, grace: float = 3.0) -> int:
    """SIGKILL every process still working in a directory under ``root`` after ``grace`` s.

    The test hosts share this machine's pid namespace, so this covers every host. Returns how
    many processes had to be killed.
    """
    deadline = time.monotonic() + grace
    while (pids := processes_under(root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def processes_under(root: Path) -> list[int]:
    """Pids of live processes whose working directory is ``root`` or below it."""
    found = []
    prefix = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = str((entry / "cwd").readlink())
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (cwd == prefix or cwd.startswith(prefix + "/")):
            found.append(int(entry.name))
    return found


def machine_cpu_seconds() -> float:
    """CPU time used by the whole machine so far (all cores, from ``/proc/stat``)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    busy = sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7))
    return busy / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port free on this machine right now, below the kernel's ephemeral range.

    A floor's rank 0 binds it a moment later. A port the kernel handed out (``bind`` to port 0)
    may meanwhile go to any outgoing connection of another process (a test suite beside the
    benchmark makes thousands): a floor's rank then failed to bind it. Ports below the range
    are only taken by an explicit ``bind``.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(10000, max(10001, low - 1))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found in 10000-{low - 1}")


def tail(text: str, lines: int = 5) -> str:
    """The last lines of some output, on one line."""
    return " | ".join(text.strip().splitlines()[-lines:])
