"""What the ranks run in the benchmarks, the same for every tool.

Each function takes the run's scratch directory first. A rank writes ``start-<rank>`` there
(``time.time()`` as text) when the function begins; a fault injector writes ``fault`` just before
the fault, and ``big_tensor`` writes ``ready-<rank>`` once its tensor exists. The hosts share the
filesystem and the clock, so the harness compares these times with its own.

The launchers pickle these functions by value (``cloudpickle.register_pickle_by_value``), so the
ranks need not import this module; ``torchrun_worker.py`` imports it directly.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

LINE_MARKER = "trxbench-line"
"""Every line ``print_lines`` prints starts with this, so the harness can count them."""


def rank() -> int:
    """This worker's global rank (every tool sets ``RANK``)."""
    return int(os.environ["RANK"])


def mark(scratch: str, name: str) -> None:
    """Write the current time to ``scratch/name``."""
    path = Path(scratch, name)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(repr(time.time()))
    temporary.rename(path)  # readers never see a half-written file


def started(scratch: str) -> None:
    """Record that this rank's function has begun."""
    mark(scratch, f"start-{rank()}")


def wait_for_all_ranks(scratch: str) -> None:
    """Block until every rank has started, then let the others settle into what they do next."""
    world = int(os.environ["WORLD_SIZE"])
    while not all(Path(scratch, f"start-{r}").exists() for r in range(world)):
        time.sleep(0.01)
    time.sleep(0.3)


def barrier() -> None:
    """Wait in a collective (the fault case's bystander)."""
    import torch.distributed as dist  # noqa: PLC0415 (imported where the group exists)

    dist.barrier()


def return_at_once(scratch: str) -> int:
    """Record the start and return."""
    started(scratch)
    return rank()


def start_time(scratch: str) -> tuple[float, int]:
    """Return when the function began, and the parent's pid (the agent, in every launcher).

    The time is also appended to ``starts-<rank>``: over launches back to back in one process
    (``driver.py``, whose report keeps only rank 0's value), line ``i`` is launch ``i``'s.
    """
    now = time.time()
    with Path(scratch, f"starts-{rank()}").open("a") as f:
        f.write(f"{now!r}\n")
    return now, os.getppid()


def raise_in_rank0(scratch: str) -> None:
    """Rank 0 raises while the others wait in ``barrier()``."""
    started(scratch)
    if rank() == 0:
        wait_for_all_ranks(scratch)
        mark(scratch, "fault")
        raise RuntimeError("benchmark fault: rank 0 raises")
    barrier()


def kill_self_rank1(scratch: str) -> None:
    """Rank 1 SIGKILLs itself while the others wait in ``barrier()``."""
    started(scratch)
    if rank() == 1:
        wait_for_all_ranks(scratch)
        mark(scratch, "fault")
        os.kill(os.getpid(), signal.SIGKILL)
    barrier()


def kill_agent_rank1(scratch: str) -> None:
    """Rank 1 SIGKILLs its parent (its agent) while the others wait in ``barrier()``.

    Rank 1 then sleeps rather than join the barrier, so that the function cannot complete
    without its agent (else both ranks could return in the moment the agent takes to die).
    """
    started(scratch)
    if rank() == 1:
        wait_for_all_ranks(scratch)
        agent = os.getppid()
        mark(scratch, "fault")
        os.kill(agent, signal.SIGKILL)
        time.sleep(60)
    barrier()


def sleep_then_return(scratch: str, seconds: float) -> int:
    """Record the start, sleep (a host's link is cut meanwhile), return."""
    started(scratch)
    time.sleep(seconds)
    return rank()


def big_tensor(scratch: str, nbytes: int) -> object:
    """Return a float32 tensor of ``nbytes`` bytes; ``ready-<rank>`` marks when it exists."""
    import torch  # noqa: PLC0415

    started(scratch)
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    mark(scratch, f"ready-{rank()}")
    return tensor


def print_lines(scratch: str, count: int) -> int:
    """Print ``count`` numbered lines to stdout."""
    started(scratch)
    for i in range(count):
        print(f"{LINE_MARKER} {i}")
    sys.stdout.flush()
    return count


def agent_memory(scratch: str) -> int:
    """After a short while, write the parent's (the agent's) peak RSS in kB to ``agent-rss-<rank>``.

    Under torchrun the parent is torchrun itself (its launcher and agent are one process).
    """
    started(scratch)
    time.sleep(0.5)
    kb = peak_rss_kb(os.getppid())
    Path(scratch, f"agent-rss-{rank()}").write_text(str(kb))
    return kb


def peak_rss_kb(pid: int | str = "self") -> int:
    """``VmHWM`` of a process, in kB (0 if it cannot be read)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0
