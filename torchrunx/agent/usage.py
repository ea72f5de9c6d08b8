"""What each worker uses of its host: CPU, resident memory, and its GPUs' use and memory.

The agent samples its running workers at each heartbeat (once a second) and sends the figures
in it (:class:`~torchrunx.wire.messages.Heartbeat`'s ``usage``), for ``torchrunx top`` and
``/health``. A sample is cheap: two small ``/proc`` reads per worker (``stat``: CPU ticks;
``statm``: resident pages). CPU is the worker process's own (not its children's), as a share
of one core over the time since the last sample.

GPUs (only on a host where the agent counted some): ``nvidia-smi`` runs in the background every
:data:`GPU_EVERY` seconds, never waited on in the agent's loop, with two queries, per GPU
(``uuid,utilization.gpu``) and per process using one (``pid,gpu_uuid,used_memory``); its answer
is read at the next sample, so the figures are one to three seconds old. A worker's GPU
figures are the memory its process holds on every GPU, and the busiest of those GPUs'
utilisation (NVIDIA reports utilisation per GPU, not per process). Nothing here can fail a
launch: a figure that cannot be read is None, and ``nvidia-smi`` is given up after
:data:`GPU_FAILURES` failed or slow queries in a row.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterable

    from torchrunx.wire.messages import WorkerUsage

logger = logging.getLogger("torchrunx.agent")

GPU_QUERY = "--query-gpu=uuid,utilization.gpu"
APPS_QUERY = "--query-compute-apps=pid,gpu_uuid,used_memory"
FORMAT = "--format=csv,noheader,nounits"
GPU_EVERY = 2.0
"""Seconds between two starts of the queries (each ``nvidia-smi`` costs the host some CPU)."""
QUERY_LIMIT = 5.0
"""Seconds a query may take; one slower is killed, and counts as failed."""
GPU_FAILURES = 3
"""Failed or slow ``nvidia-smi`` queries in a row after which the agent stops asking."""
MIB = 1 << 20

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


# -- pure: nvidia-smi's answers to per-pid figures ------------------------------------------


def _number(text: str) -> int | None:
    """An integer field of nvidia-smi's CSV (``[N/A]``, ``[Not Supported]``: None)."""
    text = text.strip()
    return int(text) if text.isdigit() else None


def parse_gpus(text: str) -> dict[str, int | None]:
    """``uuid, utilization.gpu`` lines: each GPU's utilisation (%) by UUID."""
    found: dict[str, int | None] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0]:
            found[fields[0]] = _number(fields[1])
    return found


def parse_apps(text: str) -> list[tuple[int, str, int | None]]:
    """``pid, gpu_uuid, used_memory`` lines: each process's memory (MiB) on each GPU."""
    found = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0].isdigit():
            found.append((int(fields[0]), fields[1], _number(fields[2])))
    return found


def gpu_by_pid(
    gpus: dict[str, int | None], apps: list[tuple[int, str, int | None]]
) -> dict[int, tuple[int | None, int | None]]:
    """Per pid: the busiest utilisation (%) of the GPUs it uses, and its memory on them (bytes).

    Memory is summed over the process's GPUs (None if none of them reported it).
    """
    found: dict[int, tuple[int | None, int | None]] = {}
    for pid, uuid, mib in apps:
        busy, memory = found.get(pid, (None, None))
        util = gpus.get(uuid)
        if util is not None:
            busy = util if busy is None else max(busy, util)
        if mib is not None:
            memory = mib * MIB + (memory or 0)
        found[pid] = (busy, memory)
    return found


# -- the host's side: /proc and nvidia-smi ----------------------------------------------------


def _read(path: str) -> bytes:
    """A small ``/proc`` file (a third of the time of ``Path.read_bytes``, measured)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def read_proc(pid: int) -> tuple[int, int] | None:
    """A process's CPU time (clock ticks, user and system) and resident memory (bytes)."""
    try:
        stat, statm = (_read(f"/proc/{pid}/{name}") for name in ("stat", "statm"))
        fields = stat.rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12]), int(statm.split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class GpuQueries:
    """``nvidia-smi``'s two queries, started at one sample and read at a later one."""

    def __init__(self, nvidia_smi: str) -> None:
        """Ask ``nvidia_smi`` (its path)."""
        self.nvidia_smi = nvidia_smi
        self.running: list[subprocess.Popen[str]] = []
        self.started = -GPU_EVERY
        self.failures = 0
        self.figures: dict[int, tuple[int | None, int | None]] = {}
        """The last answer: per pid, its GPU utilisation (%) and memory (bytes)."""

    @property
    def given_up(self) -> bool:
        """Whether it failed too often to ask again."""
        return self.failures >= GPU_FAILURES

    def poll(self, now: float) -> None:
        """Read the queries that ended, kill those too slow; start the next when none runs."""
        if self.running and all(p.poll() is not None for p in self.running):
            outputs = [self._output(p) for p in self.running]
            self.running = []
            if None in outputs:
                self._failed("it failed")
            else:
                gpus, apps = outputs
                self.figures = gpu_by_pid(parse_gpus(gpus or ""), parse_apps(apps or ""))
                self.failures = 0
        elif self.running and now - self.started > QUERY_LIMIT:
            self.close()
            self._failed(f"it took more than {QUERY_LIMIT:g} s")
        if not self.running and not self.given_up and now - self.started >= GPU_EVERY:
            self.started = now
            import subprocess  # noqa: PLC0415 (GPU hosts only: the agent's import stays lean)

            try:
                self.running = [
                    subprocess.Popen(
                        [self.nvidia_smi, query, FORMAT],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                    for query in (GPU_QUERY, APPS_QUERY)
                ]
            except OSError as exc:
                self.close()
                self._failed(str(exc))

    @staticmethod
    def _output(proc: subprocess.Popen[str]) -> str | None:
        """An ended query's output (None if it failed)."""
        import subprocess  # noqa: PLC0415 (imported by then: a query ran)

        try:
            out, _ = proc.communicate(timeout=0.1)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out if proc.returncode == 0 else None

    def _failed(self, why: str) -> None:
        self.failures += 1
        self.figures = {}
        if self.given_up:
            logger.debug("no GPU figures for torchrunx top: nvidia-smi failed (%s)", why)

    def close(self) -> None:
        """Kill and reap the queries still running."""
        import subprocess  # noqa: PLC0415 (as in _output)

        for proc in self.running:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                proc.communicate(timeout=1.0)
        self.running = []


class UsageSampler:
    """Samples the agent's workers (see the module); owned by the agent."""

    def __init__(self, gpus: int, nvidia_smi: str | None = None) -> None:
        """``gpus``: the host's GPU count (0: no GPU figures); ``nvidia_smi``: found on PATH."""
        smi = (nvidia_smi or shutil.which("nvidia-smi")) if gpus else None
        self.gpu = None if smi is None else GpuQueries(smi)
        self.last: dict[int, tuple[float, int]] = {}
        """Per pid: when it was last sampled (monotonic) and its CPU ticks then."""

    def sample(self, workers: Iterable[tuple[int, int]], now: float) -> tuple[WorkerUsage, ...]:
        """The figures of ``workers`` (``(local_rank, pid)`` of each running one)."""
        if self.gpu is not None:
            self.gpu.poll(now)
        figures: list[WorkerUsage] = []
        seen: dict[int, tuple[float, int]] = {}
        for local_rank, pid in workers:
            proc = read_proc(pid)
            if proc is None:
                continue
            ticks, rss = proc
            seen[pid] = (now, ticks)
            before = self.last.get(pid)
            cpu = None
            if before is not None and now > before[0]:
                cpu = round(100.0 * (ticks - before[1]) / _TICK / (now - before[0]), 1)
            busy, memory = (
                (None, None) if self.gpu is None else self.gpu.figures.get(pid, (None, None))
            )
            figures.append((local_rank, pid, cpu, rss, busy, memory))
        self.last = seen
        return tuple(figures)

    def close(self) -> None:
        """Kill the GPU queries still running."""
        if self.gpu is not None:
            self.gpu.close()
