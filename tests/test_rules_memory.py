"""Rules of a SIGKILL's cause from the kernel's counts, on made-up kernel file texts (pure).

The first rules are in tests/test_oom.py (with a real OOM kill); these pin the edges: which
lines count, which mount wins, the numbers a cgroup writes for "no limit", sizes in words.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from torchrunx.agent import memory
from torchrunx.agent.memory import (
    MemoryFacts,
    _number,
    _size,
    cgroup_mounts,
    memory_cgroup,
    oom_kill_count,
    read_facts,
    sigkill_cause,
)

if TYPE_CHECKING:
    from pathlib import Path

_ADVICE = (
    "; use less memory per worker (a smaller batch, fewer workers_per_host) or ask for more "
    "(SLURM's --mem)"
)


def test_rule_only_an_oom_kill_line_with_a_number_counts():
    assert oom_kill_count("oom_kill_disable 1\noom 3\noom_kill x\noom_kill 12\n") == 12
    assert oom_kill_count("oom_kill 5\noom_kill 6\n") == 5  # the first
    assert oom_kill_count("oom_kill\noom_kill \n") is None
    assert oom_kill_count("oom_kill 0\n") == 0
    assert oom_kill_count("oom_kill  3\n") == 3  # the name is what comes before the first space
    assert oom_kill_count("x oom_kill 3\n") is None
    assert oom_kill_count("") is None


def test_rule_the_v1_memory_line_wins_over_the_v2_line_wherever_it_is():
    assert memory_cgroup("0::/unified\n5:memory:/v1/job\n") == ("/v1/job", False)
    assert memory_cgroup("0::/unified\n3:cpu:/x\n") == ("/unified", True)
    assert memory_cgroup("2:memory_x:/no\n") is None  # a controller named like it is not it
    assert memory_cgroup("1::/not-v2\n") is None  # v2's line is hierarchy 0
    assert memory_cgroup("0::/with:colons\n") == ("/with:colons", True)
    assert memory_cgroup("7:memory\n") == ("", False)  # a line cut short: an empty path
    assert memory_cgroup("") is None


def test_rule_the_first_mount_of_each_kind_is_taken_and_short_lines_are_skipped():
    mountinfo = (
        "1 2 0:1 / /a rw - cgroup2 cgroup2 rw\n"
        "3 2 0:3 / /b rw - cgroup2 cgroup2 rw\n"
        "4 2 0:4 / /c rw - cgroup cgroup rw,cpu,memory\n"
        "5 2 0:5 / /d rw - cgroup cgroup rw,memory\n"
        "6 2 0:6 / /e rw - cgroup cgroup rw,memoryx\n"
    )
    assert cgroup_mounts(mountinfo) == ("/a", "/c")
    assert cgroup_mounts("1 2 - cgroup2\n") == (None, None)  # 4 fields: skipped
    assert cgroup_mounts("1 2 /a - cgroup2\n") == ("cgroup2", None)  # 5: the 5th is the mount
    assert cgroup_mounts("1 2 0:1 / /a rw cgroup2 cgroup2 rw\n") == (None, None)  # no " - "
    assert cgroup_mounts("1 2 0:1 / /m rw - cgroup cgroup\n") == (None, None)  # no options
    assert cgroup_mounts("1 2 0:1 / /m rw - cgroup cgroup memory\n") == (None, "/m")
    # The filesystem's type is the first word after the first " - " (a source may be "-").
    assert cgroup_mounts("1 2 0:1 / /m rw - cgroup - rw,memory\n") == (None, "/m")
    assert cgroup_mounts("1 2 0:1 / /m rw - rw - cgroup2 x y\n") == (None, None)
    # A short line is skipped, not the end of the table.
    assert cgroup_mounts("1 2 - cgroup2\n1 2 0:1 / /u rw - cgroup2 cgroup2 rw\n") == ("/u", None)
    v1_only = "9 2 0:9 / /mem rw - cgroup cgroup rw,memory\n"
    assert cgroup_mounts(v1_only) == (None, "/mem")


def test_rule_a_cgroup_number_is_none_for_max_and_for_v1s_no_limit():
    assert _number(" 1024\n") == 1024
    assert _number("0") == 0
    assert _number("max\n") is None
    assert _number(None) is None
    assert _number(str((1 << 62) - 1)) == (1 << 62) - 1
    assert _number(str(1 << 62)) is None
    assert _number("9223372036854771712") is None  # v1's "no limit"
    assert _number("-1") is None


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        ((1 << 20) - 1, "1.02e+03 KiB"),
        (1 << 20, "1 MiB"),
        (300 << 20, "300 MiB"),
        (1 << 30, "1 GiB"),
        (3 << 29, "1.5 GiB"),
        (2000 << 30, "2e+03 GiB"),
    ],
)
def test_rule_sizes_are_written_in_the_largest_binary_unit_they_reach(count, text):
    assert _size(count) == text


def test_rule_a_grown_cgroup_count_says_what_the_cgroup_tells_limit_and_peak_each_alone():
    before = MemoryFacts(cgroup="/j", cgroup_oom_kills=1)
    start = "most likely the kernel's OOM killer (its memory cgroup (/j) counted an OOM kill"
    limit_only = MemoryFacts(cgroup="/j", cgroup_oom_kills=2, limit=2 << 30)
    assert sigkill_cause(before, limit_only) == (start + ": the cgroup's limit is 2 GiB)" + _ADVICE)
    peak_only = MemoryFacts(cgroup="/j", cgroup_oom_kills=2, peak=3 << 20)
    assert sigkill_cause(before, peak_only) == start + ": its highest use 3 MiB)" + _ADVICE
    neither = MemoryFacts(cgroup="/j", cgroup_oom_kills=2, limit=None, peak=None)
    assert sigkill_cause(before, neither) == start + ")" + _ADVICE


def test_rule_the_cgroup_count_wins_over_the_machines_and_a_lower_count_is_no_kill():
    before = MemoryFacts(oom_kills=1, cgroup="/j", cgroup_oom_kills=1)
    both = MemoryFacts(oom_kills=2, cgroup="/j", cgroup_oom_kills=2)
    assert "its memory cgroup (/j) counted an OOM kill" in sigkill_cause(before, both)
    machine_only = MemoryFacts(oom_kills=2, cgroup="/j", cgroup_oom_kills=1)
    assert sigkill_cause(before, machine_only) == (
        "most likely the kernel's OOM killer (the host counted an OOM kill meanwhile "
        "(/proc/vmstat))" + _ADVICE
    )
    fewer = MemoryFacts(oom_kills=0, cgroup="/j", cgroup_oom_kills=0)  # a new cgroup, a reboot
    assert sigkill_cause(before, fewer) == ""


def test_rule_a_count_unknown_on_either_side_says_nothing_of_its_own():
    grown = MemoryFacts(oom_kills=5, cgroup="/j", cgroup_oom_kills=5)
    unknown = MemoryFacts(cgroup="/j")
    assert sigkill_cause(unknown, grown) == ""
    assert sigkill_cause(grown, unknown) == ""
    cgroup_unknown_before = MemoryFacts(oom_kills=5)
    assert "the host counted" in sigkill_cause(MemoryFacts(oom_kills=4), grown)
    assert sigkill_cause(cgroup_unknown_before, grown) == ""
    machine_unknown_after = MemoryFacts(cgroup="/j", cgroup_oom_kills=6)
    assert "its memory cgroup" in sigkill_cause(grown, machine_unknown_after)


def test_rule_the_cause_names_the_cgroup_the_worker_was_killed_in():
    before = MemoryFacts(cgroup="/old", cgroup_oom_kills=0)
    after = MemoryFacts(cgroup="/job/step", cgroup_oom_kills=1)
    assert "its memory cgroup (/job/step) counted an OOM kill" in sigkill_cause(before, after)


def _machine(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    """A made-up ``/proc`` under ``root``: a v2 and a v1 memory mount, ``cgroup``, ``files``."""
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "vmstat").write_text("pgfault 10\noom_kill 3\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(
        f"30 1 0:26 / {root / 'v2'} rw - cgroup2 cgroup2 rw\n"
        f"31 1 0:27 / {root / 'v1'} rw - cgroup cgroup rw,memory\n"
    )
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc


def test_rule_a_v2_cgroups_facts_are_read_under_the_v2_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    files = {
        "v2/job/step/memory.events": "low 0\noom 2\noom_kill 1\n",
        "v2/job/step/memory.max": "4294967296\n",
        "v2/job/step/memory.peak": "1073741824\n",
        "v1/job/step/memory.oom_control": "oom_kill 9\n",  # the other mount: never read
    }
    monkeypatch.setattr(memory, "_PROC", _machine(tmp_path, "0::/job/step\n", files))
    assert read_facts() == MemoryFacts(
        oom_kills=3, cgroup="/job/step", cgroup_oom_kills=1, limit=4 << 30, peak=1 << 30
    )


def test_rule_a_v1_cgroups_facts_are_its_oom_control_limit_and_highest_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    files = {
        "v1/slurm/job/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        "v1/slurm/job/memory.limit_in_bytes": "9223372036854771712\n",  # no limit
        "v1/slurm/job/memory.max_usage_in_bytes": "2097152\n",
        "v1/slurm/job/memory.usage_in_bytes": "1024\n",  # the use now: not the highest
        "v2/slurm/job/memory.events": "oom_kill 7\n",  # the v2 mount: not this cgroup's
    }
    proc = _machine(tmp_path, "0::/\n4:memory:/slurm/job\n", files)
    monkeypatch.setattr(memory, "_PROC", proc)
    assert read_facts() == MemoryFacts(
        oom_kills=3, cgroup="/slurm/job", cgroup_oom_kills=2, limit=None, peak=2 << 20
    )


def test_rule_a_cgroup_file_without_an_oom_kill_line_leaves_the_count_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    files = {"v2/j/memory.events": "low 0\nhigh 0\n", "v2/j/memory.max": "max\n"}
    monkeypatch.setattr(memory, "_PROC", _machine(tmp_path, "0::/j\n", files))
    assert read_facts() == MemoryFacts(oom_kills=3, cgroup="/j")
