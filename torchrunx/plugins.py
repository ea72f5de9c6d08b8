"""Plugin points, found through Python entry points (``importlib.metadata``).

Four groups; a package declares entries in its ``pyproject.toml``::

    [project.entry-points."torchrunx.hosts"]        # hostnames="NAME" or "NAME:ARGUMENT"
    pbs = "torchrunx.plugins:PBS"

    [project.entry-points."torchrunx.transports"]   # agent_start="NAME" or "NAME:ARGUMENT"
    kubectl = "torchrunx.engines.kubernetes:KubectlTransport"

    [project.entry-points."torchrunx.presets"]      # Launcher.from_preset("NAME"), --preset NAME
    gpu_x8 = "torchrunx.plugins:GPU_X8"

    [project.entry-points."torchrunx.functions"]    # torchrunx run NAME -- ARGS...
    allreduce = "torchrunx.plugins:allreduce"

* A **host provider** is an object with ``detect(environ) -> bool`` (used by
  ``hostnames="auto"``) and ``hosts(argument, environ) -> list[HostSlots]`` (the hosts, with
  their slots, or ``None`` slots to let each agent count). torchrunx's own SLURM, hostfile,
  PBS/Torque and LSF providers are registered the same way. A provider may pair with a
  transport: its optional ``transport(argument) -> str`` names the one its hosts' agents
  start with (``"kubectl:namespace=ml"``), used when ``agent_start`` is ``"auto"``. Every
  name a provider gives is checked before anything starts
  (:func:`torchrunx.hosts.hostlists.check_host_name`): a name with shell syntax is refused,
  naming the provider.
* A **transport** starts an agent on a host (:class:`torchrunx.engines.Transport`): a callable
  that takes the argument after ``NAME:`` (or ``None``) and returns one.
* A **preset** is a mapping of ``Launcher`` field names to values (or a function returning
  one), like TorchX's named resources.
* A **function** is any picklable callable, like a TorchX component; it receives the
  command line's arguments as strings.

Entry points are read on use, never at import, and a broken plugin is reported by name.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torchrunx.engines.protocol import Transport, with_declared_capabilities
from torchrunx.hosts.hostlists import (
    HostSlots,
    check_host_name,
    combine_slots,
    in_slurm_allocation,
    read_hostfile,
    slurm_allocation,
)

if TYPE_CHECKING:
    import importlib.metadata

logger = logging.getLogger(__name__)

HOSTS_GROUP = "torchrunx.hosts"
TRANSPORTS_GROUP = "torchrunx.transports"
PRESETS_GROUP = "torchrunx.presets"
FUNCTIONS_GROUP = "torchrunx.functions"


@runtime_checkable
class HostProvider(Protocol):
    """Where the hosts of a launch come from (a scheduler's allocation, a file, a service)."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Whether this process runs where the provider applies (for ``hostnames="auto"``)."""
        ...

    def hosts(self, argument: str | None, environ: Mapping[str, str]) -> list[HostSlots]:
        """The hosts and their slots; ``argument`` is what follows ``NAME:``, if anything.

        Raises:
            RuntimeError: Not in an environment this provider understands.
            ValueError: The environment or the argument cannot be parsed.
        """
        ...


_SCANNED: list[tuple[tuple[object, ...], dict[str, dict[str, importlib.metadata.EntryPoint]]]] = []
"""The last scan: the :func:`_install_state` it was made in, and our groups' entry points."""


def _install_state() -> tuple[object, ...]:
    """What changes when a distribution is installed or removed: the path and its folders.

    Installing or removing a package adds or removes its ``.dist-info`` folder, which changes
    the modification time of the ``sys.path`` folder that holds it.
    """
    return tuple((entry, _mtime(Path(entry or "."))) for entry in sys.path)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    # Scanning every installed distribution takes 10-30 ms: once for all four groups, again
    # only after something was installed or removed.
    state = _install_state()
    if not _SCANNED or _SCANNED[0][0] != state:
        # Imported here: it takes 15-30 ms, and agents import this module (through hosts)
        # without reading any entry point.
        import importlib.metadata  # noqa: PLC0415

        installed = importlib.metadata.entry_points()
        groups: dict[str, dict[str, importlib.metadata.EntryPoint]] = {}
        for name in (HOSTS_GROUP, TRANSPORTS_GROUP, PRESETS_GROUP, FUNCTIONS_GROUP):
            found = groups[name] = {}
            for entry in installed.select(group=name):
                found.setdefault(entry.name, entry)  # the first installed distribution wins
        _SCANNED[:] = [(state, groups)]
    return _SCANNED[0][1][group]


def _load(group: str, name: str, what: str) -> object:
    entries = _entry_points(group)
    entry = entries.get(name)
    if entry is None:
        known = ", ".join(sorted(entries)) or "none installed"
        raise ValueError(f"no {what} named {name!r} (entry point group {group!r}; known: {known})")
    try:
        return entry.load()
    except Exception as exc:
        dist = entry.dist.name if entry.dist is not None else "an unknown distribution"
        raise RuntimeError(
            f"the {what} {name!r} from {dist} ({entry.value}) failed to load: {exc!r}"
        ) from exc


def host_provider_names() -> list[str]:
    """Names of every host provider: the installed ones and torchrunx's own."""
    return sorted({*_entry_points(HOSTS_GROUP), *_BUILTIN_PROVIDERS, *_LAZY_PROVIDERS})


def host_provider(name: str) -> HostProvider:
    """The host provider registered under ``name``.

    torchrunx's own (``slurm``, ``hostfile``, ``pbs``, ``lsf``, ``ray``, ``kubernetes``) are
    registered as entry points like any plugin, and are also found when torchrunx runs from a
    source tree that was not installed.

    Raises:
        ValueError: No provider has that name.
        RuntimeError: The provider's package failed to import.
        TypeError: The entry point is not a provider.
    """
    if name in _BUILTIN_PROVIDERS and name not in _entry_points(HOSTS_GROUP):
        return _BUILTIN_PROVIDERS[name]
    provider = (
        _import_ref(_LAZY_PROVIDERS[name])
        if name in _LAZY_PROVIDERS and name not in _entry_points(HOSTS_GROUP)
        else _load(HOSTS_GROUP, name, "host provider")
    )
    if not isinstance(provider, HostProvider):
        raise TypeError(
            f"host provider {name!r} is {provider!r}, which has no detect() and hosts() methods"
        )
    return provider


def provider_spec(spec: str) -> tuple[str, str | None] | None:
    """The provider that ``spec`` names, and its argument, if it names one.

    ``"pbs"`` is ``("pbs", None)``, ``"hostfile:/etc/hosts.mpi"`` is
    ``("hostfile", "/etc/hosts.mpi")``; ``"auto"`` and any other name are None. Whether a
    ``hostnames`` value names a provider, a hostfile or hosts is for
    :func:`torchrunx.launcher.settings.resolve.hostnames_source` to say.
    """
    name, sep, argument = spec.partition(":")
    if spec == "auto" or name not in host_provider_names():
        return None
    return name, (argument if sep else None)


def provider_transport(name: str, argument: str | None) -> str | None:
    """The transport the provider ``name`` pairs with (``"NAME[:ARGUMENT]"``), if it names one.

    Raises:
        ValueError, RuntimeError, TypeError: As :func:`host_provider`.
    """
    pick = getattr(host_provider(name), "transport", None)
    return None if pick is None else str(pick(argument))


def transport_names() -> list[str]:
    """Names of every transport: the installed ones and torchrunx's own."""
    return sorted({*_entry_points(TRANSPORTS_GROUP), *_BUILTIN_TRANSPORTS})


def transport_spec(spec: str) -> tuple[str, str | None]:
    """A transport and its argument: ``"kubectl:namespace=ml"``, ``"ssh"`` (no argument)."""
    name, sep, argument = spec.partition(":")
    return name, (argument if sep else None)


def transport(name: str, argument: str | None = None, **settings: Any) -> Transport:  # noqa: ANN401
    """A new transport of the kind registered under ``name``, for one launch.

    A capability it does not declare (``relays``, ``ships``...) is ``False`` on it from here
    on (:func:`torchrunx.engines.protocol.with_declared_capabilities`).

    ``settings`` go to torchrunx's own transports that take them (``ssh_config_file``).

    Raises:
        ValueError: No transport has that name, or it refuses ``argument``.
        RuntimeError: The transport's package failed to import.
        TypeError: The entry point does not make a transport.
    """
    if name in _BUILTIN_TRANSPORTS and name not in _entry_points(TRANSPORTS_GROUP):
        factory: object = _import_ref(_BUILTIN_TRANSPORTS[name])
    else:
        factory = _load(TRANSPORTS_GROUP, name, "transport")
    if not callable(factory):
        raise TypeError(f"transport {name!r} is {factory!r}, which is not callable")
    accepted = getattr(factory, "settings", ())
    made = factory(argument, **{k: v for k, v in settings.items() if k in accepted})
    for needed in ("start", "describe", "close"):
        if not callable(getattr(made, needed, None)):
            raise TypeError(f"transport {name!r} made {made!r}, which has no {needed}() method")
    return with_declared_capabilities(made)


def _import_ref(ref: str) -> object:
    """The object at ``"module:attribute"`` (torchrunx's own plugins, imported on use)."""
    import importlib  # noqa: PLC0415

    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def detected_hosts(environ: Mapping[str, str]) -> tuple[str, list[HostSlots]] | None:
    """``hostnames="auto"``: the first provider that detects its environment, and its hosts.

    SLURM is asked first, then the other providers by name. ``None`` when none applies.
    """
    names = host_provider_names()
    ordered = ["slurm", *(n for n in names if n != "slurm")] if "slurm" in names else names
    for name in ordered:
        try:
            provider = host_provider(name)
            detected = provider.detect(environ)
        except Exception:
            logger.warning("host provider %r is skipped: it failed", name, exc_info=True)
            continue
        if detected:
            return name, provider.hosts(None, environ)
    return None


def preset_names() -> list[str]:
    """Names of every installed preset."""
    return sorted(_entry_points(PRESETS_GROUP))


def preset(name: str) -> dict[str, Any]:
    """The ``Launcher`` field values of the preset ``name``.

    Raises:
        ValueError: No preset has that name, or it is not a mapping of field values.
        RuntimeError: The preset's package failed to import.
    """
    value = _load(PRESETS_GROUP, name, "preset")
    if callable(value) and not isinstance(value, Mapping):
        value = value()
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"preset {name!r} is not a mapping of Launcher fields: {value!r}")
    return dict(value)


def function_names() -> dict[str, str]:
    """Every installed function: name to the first line of its docstring (loaded to read it)."""
    described: dict[str, str] = {}
    for name in sorted(_entry_points(FUNCTIONS_GROUP)):
        try:
            func = registered_function(name)
        except (RuntimeError, ValueError, TypeError) as exc:
            described[name] = f"(cannot be loaded: {exc})"
            continue
        doc = (getattr(func, "__doc__", None) or "").strip()
        described[name] = doc.splitlines()[0] if doc else ""
    return described


def registered_function(name: str) -> Callable[..., Any]:
    """The function registered under ``name``.

    Raises:
        ValueError: No function has that name.
        RuntimeError: Its package failed to import.
        TypeError: The entry point is not callable.
    """
    func = _load(FUNCTIONS_GROUP, name, "function")
    if not callable(func):
        raise TypeError(f"function {name!r} is {func!r}, which is not callable")
    return func


# -- built-in host providers ------------------------------------------------------------------
# Plain classes without state: agents import this module, and each dataclass would cost them
# half a millisecond.


class SlurmProvider:
    """The nodes of the SLURM allocation this process runs in (slots: SLURM's counts)."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Inside an allocation (``SLURM_JOB_ID`` and a node list)."""
        return in_slurm_allocation(environ)

    def hosts(self, argument: str | None, environ: Mapping[str, str]) -> list[HostSlots]:
        """The allocation's nodes; workers per node from SLURM (GPUs, else tasks)."""
        del argument
        allocation = slurm_allocation(environ)
        return [HostSlots(node, allocation.slots(node)) for node in allocation.nodes]


class HostfileProvider:
    """``hostfile:PATH``, or the file named by ``TORCHRUNX_HOSTFILE`` (MPI/DeepSpeed style)."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        """When ``TORCHRUNX_HOSTFILE`` names a file."""
        path = environ.get("TORCHRUNX_HOSTFILE")
        return bool(path) and Path(str(path)).expanduser().is_file()

    def hosts(self, argument: str | None, environ: Mapping[str, str]) -> list[HostSlots]:
        """The hosts of the file, with their ``slots=``."""
        path = argument or environ.get("TORCHRUNX_HOSTFILE")
        if not path:
            raise RuntimeError(
                "hostnames='hostfile' names the hostfile provider, which needs a path: "
                "'hostfile:/path/to/file', TORCHRUNX_HOSTFILE, or the file's path with a "
                "slash, such as ./hostfile"
            )
        return read_hostfile(path)


class PbsProvider:
    """PBS/Torque (and PBS Pro, OpenPBS): ``$PBS_NODEFILE`` lists one line per slot."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Inside a PBS job (``PBS_JOBID`` and ``PBS_NODEFILE``)."""
        return bool(environ.get("PBS_JOBID")) and bool(environ.get("PBS_NODEFILE"))

    def hosts(self, argument: str | None, environ: Mapping[str, str]) -> list[HostSlots]:
        """Hosts in the order of the node file; slots: how often each is listed."""
        path = argument or environ.get("PBS_NODEFILE")
        if not path:
            raise RuntimeError(
                "hostnames='pbs' but PBS_NODEFILE is not set: run inside qsub, or give "
                "'pbs:/path/to/nodefile'"
            )
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the PBS node file {path!r}: {exc}") from exc
        names = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                names.append(line.split()[0])
                check_host_name(names[-1], f"line {number} of the PBS node file {path!r}")
        if not names:
            raise ValueError(f"the PBS node file {path!r} lists no host")
        return combine_slots((name, 1) for name in names)


class LsfProvider:
    """IBM Spectrum LSF: ``$LSB_MCPU_HOSTS`` is ``"hostA 4 hostB 4"`` (host, slots pairs)."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Inside an LSF job (``LSB_JOBID`` and ``LSB_MCPU_HOSTS``)."""
        return bool(environ.get("LSB_JOBID")) and bool(environ.get("LSB_MCPU_HOSTS"))

    def hosts(self, argument: str | None, environ: Mapping[str, str]) -> list[HostSlots]:
        """The hosts and slots of ``LSB_MCPU_HOSTS`` (or of ``argument``, in its syntax)."""
        value = argument or environ.get("LSB_MCPU_HOSTS", "")
        fields = value.split()
        if not fields or len(fields) % 2 or not all(n.isdigit() for n in fields[1::2]):
            raise ValueError(
                f"cannot read hosts from LSB_MCPU_HOSTS={value!r}: expected 'host slots' pairs"
            )
        where = f"hostnames='lsf:{argument}'" if argument else f"LSB_MCPU_HOSTS={value!r}"
        for name in fields[::2]:
            check_host_name(name, where)
        pairs = zip(fields[::2], fields[1::2], strict=True)
        return combine_slots((name, int(slots)) for name, slots in pairs)


SLURM = SlurmProvider()
HOSTFILE = HostfileProvider()
PBS = PbsProvider()
LSF = LsfProvider()
_BUILTIN_PROVIDERS: dict[str, HostProvider] = {
    "slurm": SLURM,
    "hostfile": HOSTFILE,
    "pbs": PBS,
    "lsf": LSF,
}
# Imported on use (they read a cluster through an engine's client): also entry points.
_LAZY_PROVIDERS = {
    "ray": "torchrunx.engines.ray:PROVIDER",
    "kubernetes": "torchrunx.engines.kubernetes:PROVIDER",
}
_BUILTIN_TRANSPORTS = {
    "local": "torchrunx.engines.builtin:LocalTransport",
    "ssh": "torchrunx.engines.builtin:SshTransport",
    "srun": "torchrunx.engines.builtin:SrunTransport",
    "ray": "torchrunx.engines.ray:RayTransport",
    "kubectl": "torchrunx.engines.kubernetes:KubectlTransport",
}


# -- built-in presets and functions -----------------------------------------------------------

LOCAL_CPU: dict[str, Any] = {"hostnames": ["localhost"], "backend": "gloo"}
"""This machine, gloo (workers: one per GPU, else per CPU core, as "auto" counts)."""

GPU_X8: dict[str, Any] = {"workers_per_host": 8, "backend": "nccl"}
"""Eight GPUs per host (one worker each), NCCL."""


def allreduce(size: str = "1") -> dict[str, Any]:
    """Check the process group: all_reduce a tensor of SIZE ones and report what each rank saw."""
    import torch  # noqa: PLC0415 (runs in workers)
    import torch.distributed as dist  # noqa: PLC0415

    tensor = torch.ones(int(size))
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return {
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
        "hostname": os.uname().nodename,
        "sum": float(tensor[0]),
    }


def hello(*words: str) -> str:
    """Say where each rank runs: 'rank R of W on HOST' (and any WORDS given)."""
    text = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} on {os.uname().nodename}"
    return " ".join([text, *words])


def builtins_text() -> str:
    """What ``torchrunx builtins`` prints: what plugins (and torchrunx itself) registered."""
    lines = ["functions (torchrunx run NAME -- args):"]
    functions = function_names()
    width = max((len(name) for name in functions), default=0)
    lines += [f"  {name:<{width}}  {doc}".rstrip() for name, doc in functions.items()]
    lines.append("presets (--preset NAME, Launcher.from_preset(NAME)):")
    for name in preset_names():
        try:
            values = preset(name)
        except (ValueError, RuntimeError) as exc:
            lines.append(f"  {name}  (cannot be loaded: {exc})")
            continue
        settings = ", ".join(f"{key}={value!r}" for key, value in values.items())
        lines.append(f"  {name}  {settings}")
    lines.append("host providers (--hostnames NAME[:ARGUMENT]):")
    lines += [f"  {name}" for name in host_provider_names()]
    lines.append("transports (--agent-start NAME[:ARGUMENT]):")
    lines += [f"  {name}" for name in transport_names()]
    return "\n".join(lines)
