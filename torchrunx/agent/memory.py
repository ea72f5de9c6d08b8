"""Why a worker was SIGKILLed, where the host can tell: the kernel's OOM killer.

A process cannot learn who sent a SIGKILL to its child. But the kernel counts the processes its
OOM killer ends, machine-wide (``oom_kill`` in ``/proc/vmstat``, Linux 4.13+), and a memory
cgroup counts its own (``oom_kill`` in ``memory.events`` for cgroup v2, in
``memory.oom_control`` for v1). The agent reads the counts when an attempt starts and again when
a worker dies of SIGKILL that it did not send: if one grew, the OOM killer is the likely cause,
and the worker's cgroup says how much memory it was allowed and how much it used at most.

The parsers are pure (made-up file texts in the tests); :func:`read_facts` reads this host's.
"""

from __future__ import annotations

from pathlib import Path

from torchrunx.wire.frozen import frozen

_PROC = Path("/proc")


@frozen
class MemoryFacts:
    """What the kernel says of OOM kills and of the agent's memory cgroup, at one moment."""

    oom_kills: int | None = None
    """Machine-wide OOM kills so far (``/proc/vmstat``); None where unreadable."""
    cgroup: str | None = None
    """The memory cgroup of the agent (and its workers), as ``/proc/self/cgroup`` names it."""
    cgroup_oom_kills: int | None = None
    limit: int | None = None
    """The cgroup's memory limit in bytes (None: none, or unknown)."""
    peak: int | None = None
    """The cgroup's highest memory use in bytes (None where the kernel does not say)."""


def oom_kill_count(text: str) -> int | None:
    """The ``oom_kill N`` line of ``/proc/vmstat``, ``memory.events`` or ``memory.oom_control``."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def memory_cgroup(proc_cgroup: str) -> tuple[str, bool] | None:
    """The memory cgroup in ``/proc/PID/cgroup``'s text: ``(path, is_v2)``; v1's wins if both."""
    v2 = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if "memory" in controllers.split(","):
            return path, False
        if controllers == "" and line.startswith("0::"):
            v2 = path
    return None if v2 is None else (v2, True)


def cgroup_mounts(mountinfo: str) -> tuple[str | None, str | None]:
    """Where the cgroup v2 hierarchy and v1's memory controller are mounted (``mountinfo``)."""
    v2 = v1 = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        fstype, options = after[0], after[2] if len(after) > 2 else ""
        if fstype == "cgroup2" and v2 is None:
            v2 = fields[4]
        elif fstype == "cgroup" and "memory" in options.split(",") and v1 is None:
            v1 = fields[4]
    return v2, v1


def _number(text: str | None) -> int | None:
    """A cgroup file's number; None for ``max`` (v2) or v1's no-limit value (about 2**63)."""
    if text is None:
        return None
    value = text.strip()
    if not value.isdigit() or int(value) >= 1 << 62:
        return None
    return int(value)


def _read(path: Path) -> str | None:
    """A small kernel file's text, None where it cannot be read."""
    try:
        return path.read_text()
    except OSError:
        return None


def read_facts() -> MemoryFacts:
    """This host's OOM counts and the agent's memory cgroup (unknown parts left None)."""
    vmstat = _read(_PROC / "vmstat")
    facts = MemoryFacts(oom_kills=None if vmstat is None else oom_kill_count(vmstat))
    found = memory_cgroup(_read(_PROC / "self" / "cgroup") or "")
    v2_mount, v1_mount = cgroup_mounts(_read(_PROC / "self" / "mountinfo") or "")
    if found is None:
        return facts
    path, is_v2 = found
    mount = v2_mount if is_v2 else v1_mount
    if mount is None:
        return facts
    folder = Path(mount) / path.lstrip("/")
    if is_v2:
        events = _read(folder / "memory.events")
        limit, peak = _read(folder / "memory.max"), _read(folder / "memory.peak")
    else:
        events = _read(folder / "memory.oom_control")
        limit, peak = (
            _read(folder / "memory.limit_in_bytes"),
            _read(folder / "memory.max_usage_in_bytes"),
        )
    return MemoryFacts(
        oom_kills=facts.oom_kills,
        cgroup=path,
        cgroup_oom_kills=None if events is None else oom_kill_count(events),
        limit=_number(limit),
        peak=_number(peak),
    )


def _size(count: int) -> str:
    """Bytes as ``1.5 GiB`` or ``300 MiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.3g} {unit}"
    return f"{count} B"


def sigkill_cause(before: MemoryFacts, after: MemoryFacts) -> str:
    """Why a worker died of a SIGKILL the agent did not send, as far as the counts tell.

    "" when nothing points to the OOM killer (the launcher then lists the usual causes).
    """
    in_cgroup = (
        before.cgroup_oom_kills is not None
        and after.cgroup_oom_kills is not None
        and after.cgroup_oom_kills > before.cgroup_oom_kills
    )
    machine = (
        before.oom_kills is not None
        and after.oom_kills is not None
        and after.oom_kills > before.oom_kills
    )
    if not (in_cgroup or machine):
        return ""
    if in_cgroup:
        where = f"its memory cgroup ({after.cgroup}) counted an OOM kill"
        sizes = []
        if after.limit is not None:
            sizes.append(f"the cgroup's limit is {_size(after.limit)}")
        if after.peak is not None:
            sizes.append(f"its highest use {_size(after.peak)}")
        if sizes:
            where += ": " + ", ".join(sizes)
    else:
        where = "the host counted an OOM kill meanwhile (/proc/vmstat)"
    return (
        f"most likely the kernel's OOM killer ({where}); use less memory per worker (a smaller "
        "batch, fewer workers_per_host) or ask for more (SLURM's --mem)"
    )
