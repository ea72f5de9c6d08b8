"""Host lists as SLURM and hostfiles give them, parsed into :class:`HostSlots`.

Pure, but for ``scontrol``: everything reads an environment mapping or file text given to it.
:mod:`torchrunx.launcher.settings.resolve` resolves the ``hostnames`` field with these parsers
and the host providers of :mod:`torchrunx.plugins`, which are built on them too.

* SLURM: the allocation a process runs in (``SLURM_JOB_ID`` with ``SLURM_JOB_NODELIST``), whose
  compressed node list (``gpu-[01-04],cpu7``) is expanded by ``scontrol show hostnames`` where
  it exists and by :func:`expand_nodelist` where it does not.
* An MPI/DeepSpeed-style hostfile (``node1 slots=4`` lines).

Every name that one of them gives is checked where it is read (:func:`check_host_name`), so that
an error names the entry and where it came from: a hostfile and its line, SLURM's variable.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import string
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torchrunx.errors import SlurmError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

_SCONTROL_TIMEOUT = 30.0

HOST_NAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + ".-_:%@[]")
"""What a host name may hold: DNS names and ``~/.ssh/config`` aliases, ``user@host``, IPv4 and
IPv6 addresses (``fe80::1%eth0``, ``[::1]``). Shell syntax never: a name can reach a shell (an
SSH config's ``Match exec``, ``ProxyCommand``'s ``%h``), and OpenSSH 9.6 and later refuse
names with it."""


@dataclass(frozen=True)
class HostSlots:
    """One entry of the resolved host list.

    Attributes:
        hostname: Name as the user gave it (used for SSH and srun, and in results).
        workers: Number of workers, or ``None`` to let the agent count its GPUs / CPU cores.
    """

    hostname: str
    workers: int | None


def host_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a host name (what to give instead), or ``None`` if it can be one.

    Refused: an empty name, whitespace or control characters, a ``/`` (a name also names its
    host's log file: ``/tmp/x`` would write outside the launch's folder), a leading ``-`` (it
    would read as an option), ``.`` and ``..``, and any character outside
    :data:`HOST_NAME_CHARACTERS`.
    """
    others = sorted(set(name) - HOST_NAME_CHARACTERS) if isinstance(name, str) else []
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
    elif others:
        reason = (
            f"it contains {', '.join(map(repr, others))}, which no host name has: a host name "
            "holds only ASCII letters, digits and . - _ : % @ [ ] (shell syntax is refused, as "
            "OpenSSH 9.6 and later refuse it)"
        )
    else:
        return None
    return reason


def check_host_name(name: object, where: str) -> None:
    """Refuse what cannot be a host name, naming it and where it came from.

    Args:
        name: The entry.
        where: Where it came from, the subject of the message (``"hostnames"``, ``"hostfile
            'PATH', line 3"``, ``"SLURM_JOB_NODELIST='n[1-2]'"``).

    Raises:
        ValueError: ``where contains an invalid host name NAME: WHY`` (see
            :func:`host_name_problem`).
    """
    problem = host_name_problem(name)
    if problem is not None:
        raise ValueError(f"{where} contains an invalid host name {name!r}: {problem}")


def combine_slots(entries: Iterable[tuple[str, int | None]]) -> list[HostSlots]:
    """Each host once, in the order first listed, with the sum of its slots.

    A host with ``None`` slots in any of its entries (let its agent count) gets ``None``.
    """
    slots: dict[str, int | None] = {}
    for name, count in entries:
        if name in slots:
            previous = slots[name]
            slots[name] = None if previous is None or count is None else previous + count
        else:
            slots[name] = count
    return [HostSlots(name, count) for name, count in slots.items()]


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
        SlurmError: No allocation was detected.
        ValueError: A ``SLURM_*`` variable cannot be parsed, or its node list names what is no
            host name (see :func:`check_host_name`).
    """
    env = os.environ if environ is None else environ
    if not in_slurm_allocation(env):
        raise SlurmError(
            f"{what} but no SLURM allocation was detected (SLURM_JOB_ID and "
            "SLURM_JOB_NODELIST are not set); run inside sbatch or salloc, or give the hosts "
            "and workers per host explicitly"
        )
    job_id = env.get("SLURM_JOB_ID") or env["SLURM_JOBID"]
    variable = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    nodes = tuple(expand_hostnames(env[variable]))
    for node in nodes:
        check_host_name(node, f"{variable}={env[variable]!r}")
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


def expand_hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list with ``scontrol show hostnames``, or our own parser.

    :func:`expand_nodelist` is used where ``scontrol`` is not installed or fails (for example
    without a readable ``slurm.conf``). Each list is expanded once per process.

    Raises:
        ValueError: ``scontrol`` is missing or failed, and the list cannot be parsed either.
    """
    return list(_expand_hostnames(nodelist))


@functools.lru_cache(maxsize=64)
def _expand_hostnames(nodelist: str) -> tuple[str, ...]:
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
                return tuple(completed.stdout.split())
    return tuple(expand_nodelist(nodelist))


# -- hostfiles --------------------------------------------------------------------------------


def parse_hostfile(text: str, source: str = "<hostfile>") -> list[HostSlots]:
    """Parse an MPI/DeepSpeed-style hostfile: ``hostname [slots=N]`` per line.

    ``#`` starts a comment; blank lines are skipped; other ``key=value`` options (such as
    Open MPI's ``max_slots``) are ignored. A host listed twice gets the sum of its slots, as in
    Open MPI (see :func:`combine_slots`). A host without ``slots=`` has its workers counted by
    its agent.

    Raises:
        ValueError: A line that is not in this form, or whose name is no host name (see
            :func:`check_host_name`), with ``source`` and its line number; or a file with no
            host.
    """
    entries: list[tuple[str, int | None]] = []
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
        check_host_name(name, f"line {number} of {source}")
        entries.append((name, count))
    if not entries:
        raise ValueError(f"{source} lists no host")
    return combine_slots(entries)


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
