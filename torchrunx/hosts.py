"""Host and slot resolution: which hosts a launch uses and how many workers each runs.

Pure functions where possible. The number of workers for ``workers_per_host="auto"`` is
counted by each agent on its own host (:func:`count_local_slots`), so remote hosts are
probed in parallel, as part of the agents' start, without importing torch anywhere.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Mapping

HostnamesSpec = list[str] | Literal["auto", "slurm"]
WorkersSpec = int | list[int] | tuple[int, ...] | Literal["auto", "slurm"]

_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "127.0.0.1", "::1", "0.0.0.0"})  # noqa: S104 (a name to recognise, not an address to bind)


@dataclass(frozen=True)
class HostSlots:
    """One entry of the resolved host list.

    Attributes:
        hostname: Name as the user gave it (used for SSH and in results).
        workers: Number of workers, or ``None`` to let the agent count its GPUs / CPU cores.
    """

    hostname: str
    workers: int | None


def in_slurm_allocation(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a SLURM allocation with a node list."""
    env = os.environ if environ is None else environ
    has_job = "SLURM_JOB_ID" in env or "SLURM_JOBID" in env
    return has_job and ("SLURM_JOB_NODELIST" in env or "SLURM_NODELIST" in env)


def slurm_hostnames(environ: Mapping[str, str] | None = None) -> list[str]:
    """The hosts of the current SLURM allocation, expanded with ``scontrol show hostnames``.

    Raises:
        RuntimeError: No allocation was detected, or ``scontrol`` is missing or failed.
    """
    env = os.environ if environ is None else environ
    if not in_slurm_allocation(env):
        raise RuntimeError(
            "hostnames='slurm' but no SLURM allocation was detected "
            "(SLURM_JOB_ID and SLURM_JOB_NODELIST are not set); run inside sbatch/salloc "
            "or pass a list of hostnames"
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise RuntimeError(f"cannot expand SLURM node list {nodelist!r}: scontrol not found")
    completed = subprocess.run(
        [scontrol, "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"scontrol show hostnames {nodelist!r} failed: {completed.stderr.strip()}"
        )
    return completed.stdout.split()


def resolve_hostnames(hostnames: HostnamesSpec) -> list[str]:
    """Resolve the ``hostnames`` field into a list of host names.

    ``"auto"`` is the SLURM allocation inside one, else ``["localhost"]``.

    Raises:
        RuntimeError: ``"slurm"`` outside an allocation.
        ValueError: An empty list or an empty name.
    """
    if hostnames == "auto":
        return slurm_hostnames() if in_slurm_allocation() else ["localhost"]
    if hostnames == "slurm":
        return slurm_hostnames()
    return list(hostnames)


def resolve_slots(hostnames: list[str], workers_per_host: WorkersSpec) -> list[HostSlots]:
    """Pair every host with its number of workers (``None``: counted by its agent).

    Raises:
        ValueError: A list whose length differs from the number of hosts.
        RuntimeError: ``"slurm"`` outside an allocation.
    """
    if isinstance(workers_per_host, list | tuple):
        if len(workers_per_host) != len(hostnames):
            raise ValueError(
                f"workers_per_host has {len(workers_per_host)} entries but there are "
                f"{len(hostnames)} hosts ({hostnames}); give one number per host or a single int"
            )
        return [HostSlots(h, n) for h, n in zip(hostnames, workers_per_host, strict=True)]
    if isinstance(workers_per_host, int):
        return [HostSlots(h, workers_per_host) for h in hostnames]
    if workers_per_host == "slurm" and not in_slurm_allocation():
        raise RuntimeError(
            "workers_per_host='slurm' but no SLURM allocation was detected; "
            "run inside sbatch/salloc or give a number"
        )
    return [HostSlots(h, None) for h in hostnames]


def count_local_slots(environ: Mapping[str, str] | None = None) -> int:
    """Workers for ``"auto"`` on this host: visible GPUs, else usable CPU cores.

    Never imports torch or initialises CUDA: it reads ``CUDA_VISIBLE_DEVICES`` and the
    NVIDIA driver's ``/proc`` entries.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")]
        gpus = len(devices)
    else:
        proc = Path("/proc/driver/nvidia/gpus")
        gpus = len(list(proc.iterdir())) if proc.is_dir() else 0
    if gpus > 0:
        return gpus
    return len(os.sched_getaffinity(0))


def _local_addresses() -> set[str]:
    addresses: set[str] = set()
    for name in {socket.gethostname(), socket.getfqdn()}:
        addresses.update(_addresses_of(name))
    return addresses


def _addresses_of(name: str) -> list[str]:
    try:
        return [str(info[4][0]) for info in socket.getaddrinfo(name, None)]
    except OSError:
        return []


def _bindable(address: str) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def is_local_host(hostname: str) -> bool:
    """Whether ``hostname`` names this machine (then no SSH is used).

    True for ``localhost``, loopback addresses, this machine's own names, and any name that
    resolves to an address bound on this machine.
    """
    if hostname in _LOCAL_NAMES or hostname in {socket.gethostname(), socket.getfqdn()}:
        return True
    try:
        infos = socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for info in infos:
        address = str(info[4][0])
        if ipaddress.ip_address(address.split("%", maxsplit=1)[0]).is_loopback:
            return True
        if address in _local_addresses() or _bindable(address):
            return True
    return False
