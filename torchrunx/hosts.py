"""Host and slot resolution: which hosts a launch uses and how many workers each runs.

Everything here but the probes of this machine is pure: it reads an environment mapping and
file text given to it. Sources of hosts:

* a list of names;
* a SLURM allocation (``SLURM_JOB_ID`` with ``SLURM_JOB_NODELIST``), whose compressed node
  list (``gpu-[01-04],cpu7``) is expanded by ``scontrol show hostnames`` where it exists and by
  :func:`expand_nodelist` where it does not;
* an MPI/DeepSpeed-style hostfile (``node1 slots=4`` lines).

Workers per host come from the user, from SLURM (GPUs per node, else tasks per node), from a
hostfile's ``slots``, or are counted by each agent on its own host (:func:`count_local_slots`:
GPUs, else CPU cores). Agents start in parallel, so remote hosts are probed in parallel, and
never with torch (``CUDA_VISIBLE_DEVICES``, the driver's ``/proc`` entries, ``nvidia-smi -L``).
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Mapping

HostnamesSpec = list[str] | tuple[str, ...] | str | os.PathLike[str]
"""A list of names, ``"auto"``, ``"slurm"``, or a hostfile path (see :func:`resolve_hosts`)."""
WorkersSpec = Literal["auto", "slurm", "gpu", "cpu"] | int | list[int] | tuple[int, ...]

_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "127.0.0.1", "::1", "0.0.0.0"})  # noqa: S104 (a name to recognise, not an address to bind)
_SCONTROL_TIMEOUT = 30.0
_NVIDIA_SMI_TIMEOUT = 10.0


@dataclass(frozen=True)
class HostSlots:
    """One entry of the resolved host list.

    Attributes:
        hostname: Name as the user gave it (used for SSH and srun, and in results).
        workers: Number of workers, or ``None`` to let the agent count its GPUs / CPU cores.
    """

    hostname: str
    workers: int | None


# -- SLURM ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmAllocation:
    """What SLURM tells a process about the allocation it runs in (pure data).

    Attributes:
        job_id: The job's id.
        nodes: Node names, expanded, in SLURM's order.
        tasks_per_node: Tasks per node, one entry per node, if SLURM says.
        gpus_per_node: GPUs per node if the job asked for GPUs per node (or the batch node
            has some), else ``None``.
        cpus_per_node: CPUs allocated per node, one entry per node, if SLURM says.
    """

    job_id: str
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...] | None
    gpus_per_node: int | None
    cpus_per_node: tuple[int, ...] | None

    def slots(self, node: str) -> int | None:
        """Workers for ``node`` when they come from SLURM: GPUs if any, else tasks.

        ``None`` when SLURM says neither, or ``node`` is not in the allocation.
        """
        if node not in self.nodes:
            return None
        if self.gpus_per_node:
            return self.gpus_per_node
        if self.tasks_per_node is not None:
            return self.tasks_per_node[self.nodes.index(node)]
        return None

    def cpus(self, node: str) -> int | None:
        """CPUs allocated on ``node``, if SLURM says."""
        if self.cpus_per_node is None or node not in self.nodes:
            return None
        return self.cpus_per_node[self.nodes.index(node)]


def in_slurm_allocation(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a SLURM allocation with a node list."""
    env = os.environ if environ is None else environ
    has_job = bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))
    return has_job and bool(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"))


def slurm_allocation(
    environ: Mapping[str, str] | None = None, *, what: str = "hostnames='slurm'"
) -> SlurmAllocation:
    """Read the allocation this process runs in from its ``SLURM_*`` variables.

    Args:
        environ: The environment to read (default: this process's).
        what: The setting that needs the allocation, named in the error.

    Raises:
        RuntimeError: No allocation was detected.
        ValueError: A ``SLURM_*`` variable cannot be parsed.
    """
    env = os.environ if environ is None else environ
    if not in_slurm_allocation(env):
        raise RuntimeError(
            f"{what} but no SLURM allocation was detected (SLURM_JOB_ID and "
            "SLURM_JOB_NODELIST are not set); run inside sbatch or salloc, or give the hosts "
            "and workers per host explicitly"
        )
    job_id = env.get("SLURM_JOB_ID") or env["SLURM_JOBID"]
    nodes = tuple(expand_hostnames(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]))
    tasks = _per_node(env, "SLURM_TASKS_PER_NODE", len(nodes))
    cpus = _per_node(env, "SLURM_JOB_CPUS_PER_NODE", len(nodes))
    return SlurmAllocation(job_id, nodes, tasks, _slurm_gpus(env), cpus)


def _per_node(env: Mapping[str, str], name: str, nodes: int) -> tuple[int, ...] | None:
    value = env.get(name)
    if not value:
        return None
    counts = expand_counts(value)
    if len(counts) != nodes:
        raise ValueError(
            f"{name}={value!r} describes {len(counts)} nodes but the allocation has {nodes}"
        )
    return tuple(counts)


def _slurm_gpus(env: Mapping[str, str]) -> int | None:
    """GPUs per node, from ``SLURM_GPUS_PER_NODE``, else ``SLURM_GPUS_ON_NODE``.

    Forms: ``4``, ``a100:4``, and several types, ``a100:2,v100:1`` (summed).
    """
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        value = env.get(name, "").strip()
        if not value:
            continue
        counts = [item.rsplit(":", 1)[-1] for item in value.split(",")]
        if not all(count.isdigit() for count in counts):
            raise ValueError(f"cannot read a GPU count from {name}={value!r}")
        return sum(int(count) for count in counts) or None
    return None


def expand_counts(value: str) -> list[int]:
    """Expand SLURM's per-node count syntax: ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    Raises:
        ValueError: ``value`` is not in that syntax.
    """
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(
                f"cannot parse SLURM count list {value!r}: expected items like 2 or 2(x3)"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list syntax without ``scontrol``.

    ``"node[1-3,7]"`` is ``node1 node2 node3 node7``; ``"gpu-[01-04]"`` keeps the zero
    padding; ``"a[1-2]-b[3-4]"`` is every combination (``a1-b3 a1-b4 a2-b3 a2-b4``, in
    SLURM's order for three or more brackets: the last varies fastest, then the first); groups
    are separated by commas outside brackets (``"cpu1,gpu[1-2]"``) or by whitespace.

    Raises:
        ValueError: Unbalanced brackets, an empty range, or a range that runs backwards.
    """
    names: list[str] = []
    for group in _split_groups(nodelist):
        names.extend(_expand_group(group, nodelist))
    return names


def _split_groups(nodelist: str) -> list[str]:
    groups: list[str] = []
    depth = 0
    current: list[str] = []
    for char in nodelist:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {nodelist!r}")
        if depth == 0 and (char == "," or char.isspace()):
            if current:
                groups.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {nodelist!r}")
    if current:
        groups.append("".join(current))
    return groups


def _expand_group(group: str, nodelist: str) -> list[str]:
    literals: list[str] = []
    dimensions: list[list[str]] = []
    for match in re.finditer(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", group):
        literal, ranges = match.group(1), match.group(2)
        if ranges is None:
            if literal:
                literals.append(literal)
            continue
        literals.append(literal)
        dimensions.append(_expand_ranges(ranges, nodelist))
    if not dimensions:
        return ["".join(literals)]
    suffix = "".join(literals[len(dimensions) :])
    # SLURM's order: the last bracket varies fastest, then the first, the second, and so on
    # (for two brackets that is plain lexicographic order).
    order = [*range(len(dimensions) - 2, -1, -1), len(dimensions) - 1]
    names: list[str] = []
    for values in itertools.product(*(dimensions[i] for i in order)):
        chosen = dict(zip(order, values, strict=True))
        parts = [literals[i] + chosen[i] for i in range(len(dimensions))]
        names.append("".join(parts) + suffix)
    return names


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    values: list[str] = []
    for item in ranges.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
        if match is None:
            raise ValueError(f"bad range {item!r} in SLURM node list {nodelist!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"range {item!r} runs backwards in SLURM node list {nodelist!r}")
        width = len(first) if first.startswith("0") else 0
        values.extend(str(i).zfill(width) for i in range(int(first), int(last) + 1))
    return values


@functools.lru_cache(maxsize=64)
def _expand_hostnames_cached(nodelist: str) -> tuple[str, ...]:
    return tuple(_expand_hostnames(nodelist))


def expand_hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list (see :func:`_expand_hostnames`), once per process and list."""
    return list(_expand_hostnames_cached(nodelist))


def _expand_hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list with ``scontrol show hostnames``, or our own parser.

    :func:`expand_nodelist` is used where ``scontrol`` is not installed or fails (for example
    without a readable ``slurm.conf``).

    Raises:
        ValueError: ``scontrol`` is missing or failed, and the list cannot be parsed either.
    """
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            completed = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                check=False,
                timeout=_SCONTROL_TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass
        else:
            if completed.returncode == 0 and completed.stdout.split():
                return completed.stdout.split()
    return expand_nodelist(nodelist)


# -- hostfiles --------------------------------------------------------------------------------


def parse_hostfile(text: str, source: str = "<hostfile>") -> list[HostSlots]:
    """Parse an MPI/DeepSpeed-style hostfile: ``hostname [slots=N]`` per line.

    ``#`` starts a comment; blank lines are skipped; other ``key=value`` options (such as
    Open MPI's ``max_slots``) are ignored. A host listed twice gets the sum of its slots, as in
    Open MPI. A host without ``slots=`` has its workers counted by its agent.

    Raises:
        ValueError: A line that is not in this form, with ``source`` and its line number; or a
            file with no host.
    """
    order: list[str] = []
    slots: dict[str, int | None] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *options = line.split()
        count: int | None = None
        for option in options:
            key, sep, value = option.partition("=")
            if not sep:
                raise ValueError(
                    f"{source}, line {number}: {option!r} is not a key=value option "
                    f"(expected 'hostname slots=N'): {raw.strip()!r}"
                )
            if key == "slots":
                if not value.isdigit() or int(value) <= 0:
                    raise ValueError(
                        f"{source}, line {number}: slots must be a positive integer, got {value!r}"
                    )
                count = int(value)
        if "=" in name or "/" in name:
            raise ValueError(f"{source}, line {number}: {name!r} is not a host name")
        if name in slots:
            previous = slots[name]
            slots[name] = None if previous is None or count is None else previous + count
        else:
            order.append(name)
            slots[name] = count
    if not order:
        raise ValueError(f"{source} lists no host")
    return [HostSlots(name, slots[name]) for name in order]


def read_hostfile(path: str | os.PathLike[str]) -> list[HostSlots]:
    """Read and parse a hostfile (see :func:`parse_hostfile`).

    Raises:
        ValueError: The file cannot be read or parsed.
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read hostfile {str(file)!r}: {exc}") from exc
    return parse_hostfile(text, str(file))


def hostfile_path(hostnames: object) -> Path | None:
    """The hostfile that ``hostnames`` names, if it names one.

    A path (``str`` other than ``"auto"``/``"slurm"``, or ``os.PathLike``) names a hostfile; so
    does a one-entry list whose entry contains ``/``, because a host name never does (that is
    how ``--hostnames ./hostfile`` arrives from the command line).
    """
    if isinstance(hostnames, os.PathLike):
        return Path(hostnames)
    if isinstance(hostnames, str) and hostnames not in ("auto", "slurm"):
        return Path(hostnames)
    if (
        isinstance(hostnames, list | tuple)
        and len(hostnames) == 1
        and isinstance(hostnames[0], str)
        and "/" in hostnames[0]
    ):
        return Path(hostnames[0])
    return None


# -- resolution -------------------------------------------------------------------------------


def check_hostname(name: object) -> None:
    """Refuse what cannot be a host name, before it reaches DNS, SSH or a log file's name.

    Accepted: DNS names, ``~/.ssh/config`` aliases, ``user@host``, IPv4 and IPv6 literals
    (``fe80::1%eth0`` too). Refused: an empty name, whitespace or control characters, a
    ``/`` (the name is also its log file's name: ``/tmp/x`` would write outside the launch's
    folder), a leading ``-`` (it would read as an option), and ``.`` or ``..``.

    Raises:
        ValueError: ``name`` is not a usable host name; the message says why and what to do.
    """
    if not isinstance(name, str) or not name:
        reason = "give each host as a non-empty string (a name or an address)"
    elif any(c.isspace() or not c.isprintable() for c in name):
        reason = "it contains whitespace or control characters; give one host per entry"
    elif "/" in name:
        reason = (
            "a host name cannot contain '/' (it also names the host's log file); to read hosts "
            "from a hostfile, give its path alone: hostnames='PATH' or ['PATH']"
        )
    elif name.startswith("-"):
        reason = "a host name cannot start with '-'"
    elif name.strip(".") == "":
        reason = "it is not a host name"
    else:
        return
    raise ValueError(f"hostnames contains an invalid host name {name!r}: {reason}")


@dataclass(frozen=True)
class HostsSource:
    """What the ``hostnames`` field names; one attribute is set (none for ``"auto"``).

    Attributes:
        hostfile: A hostfile path (it may not exist: validation says so).
        provider: A host provider's name and its argument (``"pbs"``, ``"hostfile:PATH"``).
        names: The host names of a plain list.
    """

    hostfile: Path | None = None
    provider: tuple[str, str | None] | None = None
    names: tuple[str, ...] = ()


def hostnames_source(hostnames: object) -> HostsSource:
    """Tell a hostfile, a host provider and a list of names apart (``"auto"``: all unset).

    A string or path is a hostfile, unless it names a provider and no such file exists; a
    one-entry list naming a provider is that provider, unless a file of that name exists (as
    ``--hostnames hostfile`` arrives from the command line); a one-entry list with a slash is
    a hostfile (see :func:`hostfile_path`).

    Raises:
        TypeError: ``hostnames`` is none of these.
    """
    from torchrunx import plugins  # noqa: PLC0415 (plugins builds on this module)

    if hostnames == "auto":
        return HostsSource()
    provider = plugins.provider_spec(hostnames)
    hostfile = hostfile_path(hostnames)
    if provider is not None and hostfile is None and isinstance(hostnames, list | tuple):
        named = Path(str(hostnames[0])).expanduser()
        hostfile = named if named.is_file() else None
    if hostfile is not None and (provider is None or hostfile.expanduser().is_file()):
        return HostsSource(hostfile=hostfile)
    if provider is not None:
        return HostsSource(provider=provider)
    if isinstance(hostnames, list | tuple):
        return HostsSource(names=tuple(hostnames))
    raise TypeError(f"hostnames must be a list, 'auto', 'slurm' or a path: {hostnames!r}")


def resolve_hosts(
    hostnames: HostnamesSpec,
    workers_per_host: WorkersSpec,
    environ: Mapping[str, str] | None = None,
) -> list[HostSlots]:
    """Resolve the ``hostnames`` and ``workers_per_host`` fields into hosts and their workers.

    ``hostnames``: a list of names; ``"auto"`` (the SLURM allocation inside one, or another
    detected scheduler's, else ``["localhost"]``); a host provider's name, optionally with an
    argument (``"slurm"``, ``"pbs"``, ``"lsf"``, ``"hostfile:PATH"``, or a plugin's, see
    :mod:`torchrunx.plugins`); or a hostfile path (see :func:`hostfile_path`).

    ``workers_per_host``: an int for every host; a list, one per host; ``"slurm"`` (what SLURM
    gave each node: GPUs per node, else tasks per node); ``"auto"`` (a hostfile's slots, else
    SLURM's count inside an allocation, else ``None``: GPUs or CPU cores, counted by each agent);
    ``"gpu"`` or ``"cpu"`` (``None``: each agent counts its GPUs, or its CPU cores).

    Raises:
        RuntimeError: ``"slurm"`` outside an allocation, or a host that is not in it.
        ValueError: A list whose length differs from the number of hosts; a bad hostfile; a
            resolved name that is not a host name (see :func:`check_hostname`).
    """
    from torchrunx import plugins  # noqa: PLC0415 (plugins builds on this module)

    env = os.environ if environ is None else environ
    source = hostnames_source(hostnames)
    if source.hostfile is not None:
        hosts = read_hostfile(source.hostfile)
    elif source.provider is not None:
        name, argument = source.provider
        hosts = plugins.host_provider(name).hosts(argument, env)
    elif hostnames == "auto":
        hosts = plugins.detected_hosts(env) or [HostSlots("localhost", None)]
    else:
        hosts = [HostSlots(str(name), None) for name in source.names]
    for host in hosts:  # whatever the source: a provider's or a scheduler's names too
        check_hostname(host.hostname)
    return _assign_workers(hosts, workers_per_host, env)


def _assign_workers(
    hosts: list[HostSlots], workers_per_host: WorkersSpec, env: Mapping[str, str]
) -> list[HostSlots]:
    names = [h.hostname for h in hosts]
    if isinstance(workers_per_host, list | tuple):
        if len(workers_per_host) != len(hosts):
            raise ValueError(
                f"workers_per_host has {len(workers_per_host)} entries but there are "
                f"{len(hosts)} hosts ({names}); give one number per host or a single int"
            )
        return [HostSlots(h, n) for h, n in zip(names, workers_per_host, strict=True)]
    if isinstance(workers_per_host, int):
        return [HostSlots(h, workers_per_host) for h in names]
    if workers_per_host in ("gpu", "cpu"):  # torchrunx 0.4's values: counted by each agent
        return [HostSlots(h, None) for h in names]
    if workers_per_host == "slurm":
        allocation = slurm_allocation(env, what="workers_per_host='slurm'")
        missing = [h for h in names if h not in allocation.nodes]
        if missing:
            raise RuntimeError(
                f"workers_per_host='slurm' but {missing} are not nodes of SLURM job "
                f"{allocation.job_id} ({list(allocation.nodes)})"
            )
        return [HostSlots(h, allocation.slots(h)) for h in names]
    # "auto": a hostfile's slots, else SLURM's, else counted by each agent.
    if in_slurm_allocation(env):
        allocation = slurm_allocation(env)
        return [HostSlots(h.hostname, h.workers or allocation.slots(h.hostname)) for h in hosts]
    return hosts


def resolve_hostnames(hostnames: HostnamesSpec) -> list[str]:
    """Only the names of :func:`resolve_hosts` (slots ignored)."""
    return [h.hostname for h in resolve_hosts(hostnames, "auto")]


# -- probes of this machine -------------------------------------------------------------------


def count_local_gpus(environ: Mapping[str, str] | None = None) -> int:
    """GPUs this process may use, without importing torch or initialising CUDA.

    ``CUDA_VISIBLE_DEVICES`` if set; else the NVIDIA driver's ``/proc/driver/nvidia/gpus``;
    else ``nvidia-smi -L`` if installed; else 0.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = []
        for device in (d.strip() for d in visible.split(",")):
            if not device or device.startswith("-"):
                break  # CUDA stops at the first invalid entry
            devices.append(device)
        return len(devices)
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return len(list(proc.iterdir()))
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return 0
    try:
        listed = subprocess.run(
            [nvidia_smi, "-L"],
            capture_output=True,
            text=True,
            check=False,
            timeout=_NVIDIA_SMI_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if listed.returncode != 0:
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def count_local_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, as SLURM or taskset set it)."""
    return len(os.sched_getaffinity(0))


def count_local_slots(environ: Mapping[str, str] | None = None) -> int:
    """Workers for ``"auto"`` on this host: usable GPUs, else usable CPU cores."""
    return count_local_gpus(environ) or count_local_cpus()


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
    except (OSError, UnicodeError):  # UnicodeError: not a DNS name ("a..b"), maybe an SSH alias
        return False
    for info in infos:
        address = str(info[4][0])
        if ipaddress.ip_address(address.split("%", maxsplit=1)[0]).is_loopback:
            return True
        if address in _local_addresses() or _bindable(address):
            return True
    return False
