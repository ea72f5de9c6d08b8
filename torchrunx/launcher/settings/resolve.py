"""Host and slot resolution: which hosts a launch uses and how many workers each runs.

Sources of hosts, told apart by :func:`hostnames_source`:

* a list of names;
* ``"auto"``: the hosts of a detected scheduler (a SLURM allocation first), else this machine;
* a host provider (``"slurm"``, ``"pbs"``, ``"lsf"``, ``"hostfile:PATH"`` or a plugin's, see
  :mod:`torchrunx.plugins`);
* an MPI/DeepSpeed-style hostfile (``node1 slots=4`` lines).

Workers per host come from the user, from SLURM (GPUs per node, else tasks per node), from a
hostfile's ``slots``, or are counted by each agent on its own host (:func:`count_local_slots`:
GPUs, else CPU cores). Agents start in parallel, so remote hosts are probed in parallel, and
never with torch (``CUDA_VISIBLE_DEVICES``, the driver's ``/proc`` entries, ``nvidia-smi -L``).

SLURM's variables and hostfiles are parsed by :mod:`torchrunx.hosts.hostlists`, below the host
providers; its :class:`HostSlots`, :func:`in_slurm_allocation` and :func:`slurm_allocation` are
also this module's.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from torchrunx import plugins
from torchrunx.devices import count_local_cpus, count_local_gpus
from torchrunx.errors import SlurmError
from torchrunx.hosts.hostlists import (
    HostSlots,
    check_host_name,
    in_slurm_allocation,
    read_hostfile,
    slurm_allocation,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "HostSlots",
    "Hostnames",
    "HostnamesSpec",
    "HostsSource",
    "WorkersSpec",
    "check_hostname",
    "check_hostnames",
    "count_local_cpus",
    "count_local_gpus",
    "count_local_slots",
    "hostnames_source",
    "in_slurm_allocation",
    "is_local_host",
    "local_hosts",
    "resolve_hosts",
    "slurm_allocation",
]

HostnamesSpec = list[str] | tuple[str, ...] | str | os.PathLike[str]
"""A list of names, ``"auto"``, a host provider, or a hostfile path (see :func:`resolve_hosts`)."""
if TYPE_CHECKING:  # what type checkers accept for Launcher.hostnames: every documented value
    Hostnames = HostnamesSpec
else:
    Hostnames = Literal["auto", "slurm"] | list[str] | Path
    """What tyro reads for ``--hostnames``: ``"auto"``, ``"slurm"`` and a path are choices, any
    other value a list of names (``--hostnames node1`` is a host; :func:`hostnames_source`
    finds provider names in it). A plain ``str`` would make ``--hostnames node1`` a hostfile."""
WorkersSpec = Literal["auto", "slurm", "gpu", "cpu"] | int | list[int] | tuple[int, ...]

_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "127.0.0.1", "::1", "0.0.0.0"})  # noqa: S104 (a name to recognise, not an address to bind)


# -- what the hostnames field names -----------------------------------------------------------


@dataclass(frozen=True)
class HostsSource:
    """What the ``hostnames`` field names; one attribute is set (none for ``"auto"``).

    Attributes:
        hostfile: A hostfile path (it may not exist: :func:`check_hostnames` says so).
        provider: A host provider's name and its argument (``"pbs"``, ``"hostfile:PATH"``).
        names: The host names of a plain list.
    """

    hostfile: Path | None = None
    provider: tuple[str, str | None] | None = None
    names: tuple[str, ...] = ()


def hostnames_source(hostnames: object) -> HostsSource:
    """Tell a hostfile, a host provider and a list of names apart (``"auto"``: all unset).

    This is the one place that decides whether ``hostnames`` names a hostfile:

    * an ``os.PathLike`` is a hostfile;
    * a string, or the entry of a one-entry list (as ``--hostnames X`` arrives from the command
      line), is a host provider if it names one (``"pbs"``, ``"hostfile:PATH"``) and no file
      of that name exists; else a string is a hostfile, and so is an entry with a ``/`` (a host
      name never has one); another entry is a host name;
    * any other list or tuple holds host names.

    Raises:
        TypeError: ``hostnames`` is none of these.
    """
    if isinstance(hostnames, os.PathLike):
        return HostsSource(hostfile=Path(hostnames))
    if hostnames == "auto":
        return HostsSource()
    if isinstance(hostnames, list | tuple):
        if len(hostnames) != 1 or not isinstance(hostnames[0], str):
            return HostsSource(names=tuple(hostnames))
        spec = hostnames[0]
    elif isinstance(hostnames, str):
        spec = hostnames
    else:
        raise TypeError(f"hostnames must be a list, 'auto', a provider or a path: {hostnames!r}")
    provider = plugins.provider_spec(spec)
    if provider is not None and not Path(spec).expanduser().is_file():
        return HostsSource(provider=provider)
    if provider is not None or isinstance(hostnames, str) or "/" in spec:
        return HostsSource(hostfile=Path(spec))
    return HostsSource(names=(spec,))


def check_hostname(name: object, where: str = "hostnames") -> None:
    """Refuse what cannot be a host name, before it reaches DNS, SSH, a shell or a file's name.

    Accepted: DNS names, ``~/.ssh/config`` aliases, ``user@host``, IPv4 and IPv6 literals
    (``fe80::1%eth0``, ``[::1]``): ASCII letters, digits and ``. - _ : % @ [ ]``. Refused: an
    empty name, whitespace or control characters, a ``/`` (the name is also its log file's
    name: ``/tmp/x`` would write outside the launch's folder), a leading ``-`` (it would read
    as an option), ``.`` or ``..``, and any other character (shell syntax: ``$( )``, backticks,
    ``;``, ``|``, ``&``, quotes), as OpenSSH 9.6 and later refuse it. See
    :func:`torchrunx.hosts.hostlists.host_name_problem`.

    Args:
        name: The entry.
        where: The field it came from (``"hostnames"``, ``"spare_hosts"``).

    Raises:
        ValueError: ``name`` is not a usable host name; the message names ``where``, says why
            and what to do.
    """
    check_host_name(name, where)


def check_hostnames(hostnames: object, field: str = "hostnames") -> HostsSource:
    """Refuse a ``hostnames`` field that names no hosts, before anything is started.

    A hostfile must exist (its content is read by :func:`resolve_hosts`); a provider is
    accepted by name (it is asked for its hosts by :func:`resolve_hosts`); every name of a list
    must pass :func:`check_hostname`. ``field``: the field's name in the messages
    (``"spare_hosts"``). Returns what ``hostnames`` names (:func:`hostnames_source`): the plan
    keeps it, so that the field is classified once per launch.

    Raises:
        ValueError: An empty list, a missing hostfile, a string that is neither ``"auto"``, a
            provider nor a file, or an invalid host name; the message says what to give.
    """
    if hostnames == "auto":
        return HostsSource()
    try:
        source = hostnames_source(hostnames)
    except TypeError:
        source = HostsSource()
    if source.provider is not None:
        return source
    hostfile = source.hostfile
    if hostfile is not None:
        if hostfile.expanduser().is_file():
            return source
        if isinstance(hostnames, os.PathLike) or "/" in str(hostfile):
            hint = ""
            if isinstance(hostnames, list | tuple):  # ["a/b"]: a path, as from the CLI
                hint = " (a one-entry list with '/' names a hostfile: host names have no '/')"
            raise ValueError(f"hostfile {str(hostfile)!r} does not exist or is not a file{hint}")
        raise ValueError(
            f"hostnames={str(hostfile)!r} is neither 'auto', a host provider "
            f"({', '.join(plugins.host_provider_names())}) nor an existing hostfile; for a "
            f"single host give a list: hostnames=[{str(hostfile)!r}]"
        )
    if not source.names:
        raise ValueError(f"hostnames must be a non-empty list of host names, got {hostnames!r}")
    for name in source.names:
        check_hostname(name, field)
    return source


def resolve_hosts(
    hostnames: HostnamesSpec,
    workers_per_host: WorkersSpec,
    environ: Mapping[str, str] | None = None,
    *,
    field: str = "hostnames",
    source: HostsSource | None = None,
) -> list[HostSlots]:
    """Resolve the ``hostnames`` and ``workers_per_host`` fields into hosts and their workers.

    ``hostnames``: a list of names; ``"auto"`` (the SLURM allocation inside one, or another
    detected scheduler's, else ``["localhost"]``); a host provider's name, optionally with an
    argument (``"slurm"``, ``"pbs"``, ``"lsf"``, ``"hostfile:PATH"``, or a plugin's, see
    :mod:`torchrunx.plugins`); or a hostfile path (see :func:`hostnames_source`).

    ``workers_per_host``: an int for every host; a list, one per host; ``"slurm"`` (what SLURM
    gave each node: GPUs per node, else tasks per node); ``"auto"`` (a hostfile's slots, else
    SLURM's count inside an allocation, else ``None``: GPUs or CPU cores, counted by each agent);
    ``"gpu"`` or ``"cpu"`` (``None``: each agent counts its GPUs, or its CPU cores).

    ``field``: the field's name in the messages (``"spare_hosts"``). ``source``: what
    ``hostnames`` names, if already classified (the plan's :func:`hostnames_source`).

    Raises:
        SlurmError: ``"slurm"`` outside an allocation, or a host that is not in it.
        ValueError: A list whose length differs from the number of hosts; a bad hostfile; a
            resolved name that is not a host name (see :func:`check_hostname`), naming where
            it came from: the field, a hostfile and its line, SLURM's node list, a provider.
    """
    # os.environ only for a call outside a launch: the plan passes the environment it read.
    env = os.environ if environ is None else environ
    source = hostnames_source(hostnames) if source is None else source
    where = field
    if source.hostfile is not None:
        hosts = read_hostfile(source.hostfile)  # checks each line's name, naming its line
        where = f"hostfile {str(source.hostfile)!r}"
    elif source.provider is not None:
        name, argument = source.provider
        hosts = plugins.host_provider(name).hosts(argument, env)
        where = f"the host list of provider {name!r} ({field}={_source_text(hostnames)!r})"
    elif hostnames == "auto":
        detected = plugins.detected_hosts(env)
        name, hosts = detected or ("", [HostSlots("localhost", None)])
        where = f"the host list of provider {name!r} ({field}='auto')"
    else:
        hosts = [HostSlots(str(name), None) for name in source.names]
    for host in hosts:  # whatever the source: a plugin's or a cluster's names too
        check_hostname(host.hostname, where)
    return _assign_workers(hosts, workers_per_host, env)


def _source_text(hostnames: object) -> str:
    """The ``hostnames`` value as a user gave it, for a message (a one-entry list's entry)."""
    if isinstance(hostnames, list | tuple) and len(hostnames) == 1:
        return str(hostnames[0])
    return str(hostnames)


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
            raise SlurmError(
                f"workers_per_host='slurm' but {missing} are not nodes of SLURM job "
                f"{allocation.job_id} ({list(allocation.nodes)})"
            )
        return [HostSlots(h, allocation.slots(h)) for h in names]
    # "auto": a hostfile's slots, else SLURM's, else counted by each agent.
    if in_slurm_allocation(env):
        allocation = slurm_allocation(env)
        return [HostSlots(h.hostname, h.workers or allocation.slots(h.hostname)) for h in hosts]
    return hosts


# -- probes of this machine -------------------------------------------------------------------


def count_local_slots(environ: Mapping[str, str] | None = None) -> int:
    """Workers for ``"auto"`` on this host: usable GPUs, else usable CPU cores."""
    return count_local_gpus(environ) or count_local_cpus()


LOOKUPS_AT_ONCE = 32
"""Host names looked up at once when a launch decides which hosts are this machine: a plan of
1,024 hosts waits for the slowest lookups, not for the sum of them all."""


class _ThisMachine:
    """This machine's names, and (looked up once, on first need) the addresses they resolve to.

    One per plan: each host name is compared with these, not with a new lookup of them.
    ``names`` costs no lookup (``localhost`` and the kernel's host name); the fully qualified
    name (a reverse lookup, seconds on a slow resolver) and the addresses are looked up only
    when a host is none of those, once.
    """

    def __init__(self) -> None:
        self.names = _LOCAL_NAMES | {socket.gethostname()}
        self._fqdn: str | None = None
        self._addresses: set[str] | None = None
        self._lock = threading.Lock()

    def fqdn(self) -> str:
        with self._lock:  # hosts are looked up from several threads (local_hosts)
            if self._fqdn is None:
                self._fqdn = socket.getfqdn()
            return self._fqdn

    def addresses(self) -> set[str]:
        fqdn = self.fqdn()
        with self._lock:
            if self._addresses is None:
                self._addresses = set()
                for name in (self.names | {fqdn}) - _LOCAL_NAMES:
                    self._addresses.update(_addresses_of(name))
            return self._addresses


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


def _is_local(hostname: str, here: _ThisMachine) -> bool:
    if hostname in here.names or (not _is_address(hostname) and hostname == here.fqdn()):
        return True
    try:
        infos = socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):  # UnicodeError: not a DNS name ("a..b"), maybe an SSH alias
        return False
    for info in infos:
        address = str(info[4][0])
        if ipaddress.ip_address(address.split("%", maxsplit=1)[0]).is_loopback:
            return True
        if address in here.addresses() or _bindable(address):
            return True
    return False


def is_local_host(hostname: str) -> bool:
    """Whether ``hostname`` names this machine (then no SSH is used).

    True for ``localhost``, loopback addresses, this machine's own names, and any name that
    resolves to an address bound on this machine.
    """
    return _is_local(hostname, _ThisMachine())


def local_hosts(hostnames: Sequence[str]) -> list[bool]:
    """:func:`is_local_host` for each of ``hostnames``, in order.

    Each distinct name is looked up once, up to :data:`LOOKUPS_AT_ONCE` at a time (a name
    lookup waits on the resolver: one after the other, 1,024 hosts at 1 ms each would be a
    second before anything starts; an address needs no lookup and no thread), and this
    machine's own names and addresses once in all.
    An exception (Ctrl-C) ends the lookups not yet begun; those under way end by themselves.
    """
    here = _ThisMachine()
    answers: dict[str, bool] = {}
    names: list[str] = []  # what a resolver answers; an address needs none (no thread for it)
    for name in dict.fromkeys(hostnames):
        if _is_address(name) or name in here.names:
            answers[name] = _is_local(name, here)
        else:
            names.append(name)
    if len(names) < 2:  # no thread for one name
        answers.update((name, _is_local(name, here)) for name in names)
    else:
        pool = ThreadPoolExecutor(
            min(LOOKUPS_AT_ONCE, len(names)), thread_name_prefix="torchrunx-resolve"
        )
        try:
            answers.update(zip(names, pool.map(lambda n: _is_local(n, here), names), strict=True))
        except BaseException:  # a lookup under way may hold its thread a while: not waited for
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()  # every lookup is done: its threads end now, none is left running
    return [answers[name] for name in hostnames]


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%", maxsplit=1)[0])
    except ValueError:
        return False
    return True


def check_workers(workers: object, hostnames: object) -> None:
    """``workers_per_host``: positive counts (one, or one per host), or a named choice."""
    if workers in ("auto", "slurm", "gpu", "cpu"):
        return
    counts = workers if isinstance(workers, list | tuple) else [workers]
    for count in counts:
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(
                "workers_per_host must be positive integers (one, or one per host), 'auto', "
                f"'slurm', 'gpu' or 'cpu', got {workers!r}"
            )
    if isinstance(workers, list | tuple) and isinstance(hostnames, list | tuple):
        _check_lengths(len(workers), len(hostnames))


def _check_lengths(workers: int, hosts: int) -> None:
    if workers != hosts:
        raise ValueError(
            f"workers_per_host has {workers} entries but hostnames has {hosts}; "
            "give one count per host or a single int"
        )
