"""A SIGKILLed worker says why: the kernel's OOM killer where the host's counts tell, else the
usual causes (pure rules on made-up kernel files; a real OOM kill in a memory cgroup)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx.agent.memory import (
    MemoryFacts,
    cgroup_mounts,
    memory_cgroup,
    oom_kill_count,
    sigkill_cause,
)
from torchrunx.errors import SIGKILL_CAUSES

ROOT = Path(__file__).resolve().parent.parent

# -- the rules ---------------------------------------------------------------------------------


def test_rule_the_oom_kill_count_is_read_from_vmstat_events_and_oom_control():
    assert oom_kill_count("nr_free_pages 3\noom_kill 7\nnuma_hit 1\n") == 7  # /proc/vmstat
    assert oom_kill_count("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n") == 1  # v2 memory.events
    assert oom_kill_count("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n") == 4  # v1 oom_control
    assert oom_kill_count("oom_kill_disable 0\n") is None  # a kernel before 4.13


def test_rule_the_memory_cgroup_is_v1s_memory_line_else_v2s_unified_line():
    v1 = "9:name=systemd:/\n4:memory:/job/42\n1:cpu:/\n0::/\n"
    assert memory_cgroup(v1) == ("/job/42", False)
    assert memory_cgroup("4:cpu,memory:/a\n") == ("/a", False)
    assert memory_cgroup("0::/user.slice/job.scope\n") == ("/user.slice/job.scope", True)
    assert memory_cgroup("1:cpu:/\n") is None


def test_rule_cgroup_mounts_are_found_by_filesystem_type():
    mountinfo = textwrap.dedent(
        """\
        31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
        32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
        35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
        40 31 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
        """
    )
    assert cgroup_mounts(mountinfo) == ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory")
    assert cgroup_mounts("") == (None, None)


def test_rule_a_grown_cgroup_count_names_the_oom_killer_with_the_limit_and_the_peak():
    before = MemoryFacts(oom_kills=3, cgroup="/job", cgroup_oom_kills=0)
    after = MemoryFacts(
        oom_kills=4, cgroup="/job", cgroup_oom_kills=1, limit=256 << 20, peak=256 << 20
    )
    assert sigkill_cause(before, after) == (
        "most likely the kernel's OOM killer (its memory cgroup (/job) counted an OOM kill: the "
        "cgroup's limit is 256 MiB, its highest use 256 MiB); use less memory per worker (a "
        "smaller batch, fewer workers_per_host) or ask for more (SLURM's --mem)"
    )


def test_rule_a_grown_machine_count_alone_still_points_to_the_oom_killer():
    before, after = MemoryFacts(oom_kills=3), MemoryFacts(oom_kills=5)
    assert sigkill_cause(before, after).startswith(
        "most likely the kernel's OOM killer (the host counted an OOM kill meanwhile"
    )


def test_rule_unchanged_or_unknown_counts_say_nothing():
    assert sigkill_cause(MemoryFacts(oom_kills=3), MemoryFacts(oom_kills=3)) == ""
    assert sigkill_cause(MemoryFacts(), MemoryFacts(oom_kills=9)) == ""
    same = MemoryFacts(oom_kills=1, cgroup="/x", cgroup_oom_kills=2)
    assert sigkill_cause(same, same) == ""


def test_rule_the_error_says_the_cause_or_the_usual_causes():
    told = trx.WorkerFailedError("h", 1, 3, 77, None, signal.SIGKILL, "most likely X")
    assert str(told).endswith("died with signal 9 (SIGKILL) without raising: most likely X")
    untold = trx.WorkerFailedError("h", 1, 3, 77, None, signal.SIGKILL)
    assert str(untold).endswith(f"without raising: {SIGKILL_CAUSES}")
    assert "OOM killer" in SIGKILL_CAUSES and "kill -9" in SIGKILL_CAUSES
    segv = trx.WorkerFailedError("h", 1, 3, 77, None, signal.SIGSEGV)
    assert str(segv).endswith("died with signal 11 (SIGSEGV) without raising")
    import pickle

    assert pickle.loads(pickle.dumps(told)).cause == "most likely X"  # noqa: S301 (our own)


# -- real processes ----------------------------------------------------------------------------


def _killed(how: str) -> None:
    if os.environ["RANK"] == "1":
        if how == "self":
            os.kill(os.getpid(), signal.SIGKILL)
        else:  # far past the cgroup's limit: the OOM killer takes this process
            blocks = [bytearray(64 << 20) for _ in range(64)]  # zero-filled: pages touched
            del blocks
    time.sleep(120)


def test_a_worker_killed_by_someone_lists_the_usual_causes():
    with pytest.raises(trx.WorkerFailedError) as info:
        trx.launch(_killed, ("self",), hostnames=["localhost"], workers_per_host=2, backend=None)
    assert info.value.signal == signal.SIGKILL
    assert info.value.cause == ""
    assert str(info.value).endswith(f"without raising: {SIGKILL_CAUSES}")


def _memory_cgroup_parent() -> Path | None:
    """A writable memory cgroup folder (v1's memory hierarchy, or v2's unified one)."""
    v2, v1 = cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    for mount, file in ((v1, "memory.limit_in_bytes"), (v2, "memory.max")):
        if mount is not None and (Path(mount) / "cgroup.procs").exists():
            if (
                file == "memory.max"
                and "memory" not in (Path(mount) / "cgroup.controllers").read_text()
            ):
                continue
            return Path(mount)
    return None


LAUNCH = """
import sys
sys.path.insert(0, sys.argv[1])
import torchrunx as trx
from test_oom import _killed
try:
    trx.launch(_killed, ("oom",), hostnames=["localhost"], workers_per_host=2, backend=None)
except trx.WorkerFailedError as error:
    print("RANK", error.rank, "SIGNAL", error.signal)
    print("MESSAGE", error)
"""


def test_a_worker_the_oom_killer_ends_is_said_to_be_oom_killed(tmp_path):
    parent = _memory_cgroup_parent()
    if parent is None or os.geteuid() != 0:
        pytest.skip("needs root and a memory cgroup hierarchy to make a cgroup in")
    group = parent / f"trx-oom-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        limit = 256 << 20
        if (group / "memory.limit_in_bytes").exists():  # v1
            (group / "memory.limit_in_bytes").write_text(str(limit))
            if (group / "memory.memsw.limit_in_bytes").exists():
                (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
        else:
            (group / "memory.max").write_text(str(limit))
            (group / "memory.swap.max").write_text("0")
        procs = str(group / "cgroup.procs")

        def enter() -> None:  # the launcher, and so its agent and workers, in the cgroup
            Path(procs).write_text(str(os.getpid()))

        done = subprocess.run(
            [sys.executable, "-c", LAUNCH, str(Path(__file__).parent)],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=enter,  # only writes this child's pid to a file
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
        assert "RANK 1 SIGNAL 9" in done.stdout, done.stdout + done.stderr
        message = next(line for line in done.stdout.splitlines() if line.startswith("MESSAGE"))
        assert (
            "without raising: most likely the kernel's OOM killer (its memory cgroup (" in message
        )
        assert "the cgroup's limit is 256 MiB" in message, message
    finally:
        deadline = time.monotonic() + 30
        while True:  # empty once every process of the launch has ended
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
