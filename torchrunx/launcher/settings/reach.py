"""Hosts that do not share the launcher's files: their own Python, and the code shipped to them.

``Launcher(python=...)`` names the interpreter of the remote hosts (one for all, or one per host)
when it is not at the launcher's path; ``Launcher(ship=...)`` copies code to them
(:mod:`torchrunx.engines.ship`). Either way such a host keeps its interpreter's own ``sys.path``
(its installation's packages), after the launch's project entries (:func:`host_sys_path`).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from torchrunx.engines.ssh import read_ssh_config

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.engines.ship import Bundle

logger = logging.getLogger("torchrunx.launcher")

PACKAGE = Path(__file__).resolve().parents[2]
"""torchrunx's own package folder."""

Python = str | Mapping[str, str] | None
"""``Launcher.python``: one interpreter for every remote host, one per host, or the launcher's."""


def check_python(python: object) -> None:
    """``python`` is None, a non-empty string, or a dict of host names to non-empty strings.

    Raises:
        TypeError: It is none of these.
    """
    if python is None or (isinstance(python, str) and python.strip()):
        return
    if isinstance(python, Mapping) and all(
        isinstance(host, str) and isinstance(path, str) and path.strip()
        for host, path in python.items()
    ):
        return
    raise TypeError(
        "python must be an interpreter's path (or a name on PATH) for every remote host, or a "
        f"dict of hostname to path, got {python!r}"
    )


def check_python_hosts(
    python: Python, hostnames: Sequence[str], methods: Sequence[str] = ()
) -> None:
    """Every host a ``python`` dict names is a host of the launch, every ``@METHOD`` in use.

    Args:
        python: The ``python`` field.
        hostnames: The launch's hosts (spares included).
        methods: How each of them starts (``ssh``, ``srun``...), in the same order.

    A host on this machine (started ``local``) runs the launcher's own interpreter: a dict
    entry naming it is refused, and a single path given for every host is said (a warning) to
    apply to the other hosts only, so that ``python=`` is never dropped without a word.

    Raises:
        ValueError: One is not (a typo would otherwise run the launcher's path there), or one
            is a host on this machine.
    """
    local = [h for h, m in zip(hostnames, methods, strict=False) if m == "local"]
    if isinstance(python, str) and local:
        logger.warning(
            "python=%r is the interpreter of the other hosts: %s, on this machine, runs the "
            "launcher's own (%s)",
            python,
            ", ".join(dict.fromkeys(local)),
            sys.executable,
        )
    if not isinstance(python, Mapping):
        return
    named_local = sorted({key for key in python if key in local})
    if named_local:
        raise ValueError(
            f"python names {named_local}, which run on this machine with the launcher's own "
            f"interpreter ({sys.executable}): python= gives other hosts theirs; drop the entry, "
            "or run the launcher with that interpreter"
        )
    used = {f"@{method}" for method in methods if method != "local"}
    unknown = sorted(key for key in python if key not in hostnames and key not in used)
    if unknown:
        starts = f"; @METHOD keys may name {sorted(used)}" if used else ""
        raise ValueError(
            f"python names hosts that are not in the launch: {unknown} (the hosts are "
            f"{list(hostnames)}{starts})"
        )


def python_for(python: Python, hostname: str, method: str | None = None) -> str | None:
    """The interpreter ``python`` gives a remote host; None: the launcher's own path.

    A dict gives the host's own entry, else that of how it starts (``"@srun"``, ``"@ssh"``,
    ``"@kubectl"``: every host of that provider).
    """
    if isinstance(python, str):
        return python
    if isinstance(python, Mapping):
        given = python.get(hostname)
        return given if given is not None or method is None else python.get(f"@{method}")
    return None


def check_ship(ship: object, exclude: object) -> None:
    """``ship`` is a tuple of existing paths, ``exclude`` a tuple of patterns.

    Raises:
        TypeError: Either has the wrong type.
        ValueError: A path does not exist (relative to the working directory).
    """
    if isinstance(ship, str | os.PathLike) or not isinstance(ship, list | tuple):
        raise TypeError(f"ship must be a tuple of paths, for example ('.',), got {ship!r}")
    if isinstance(exclude, str) or not isinstance(exclude, list | tuple):
        raise TypeError(f"ship_exclude must be a tuple of patterns, got {exclude!r}")
    if not all(isinstance(pattern, str) for pattern in exclude):
        raise TypeError(f"ship_exclude must be a tuple of patterns, got {exclude!r}")
    for path in ship:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"ship must be a tuple of paths, got an entry {path!r}")
        if not Path(path).exists():
            raise ValueError(
                f"ship: {str(path)!r} does not exist (relative to the working directory "
                f"{Path.cwd()})"
            )


def _installation() -> tuple[str, ...]:
    """Where the launcher's interpreter and its packages live (what a host has its own of)."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return tuple(os.path.realpath(p).rstrip("/") + "/" for p in prefixes)


def project_paths(path: Sequence[str] | None = None) -> tuple[str, ...]:
    """The launcher's ``sys.path`` entries outside its installation, and torchrunx's own root.

    The script's folder, ``PYTHONPATH``, editable installs: what a host with its own
    interpreter still needs from the launcher (on a shared filesystem). torchrunx's root is
    added when torchrunx is not installed in the launcher's interpreter (an editable checkout).
    """
    installed = _installation()
    entries = list(sys.path if path is None else path)
    root = str(PACKAGE.parent)
    kept: list[str] = []
    for entry in [*entries, root]:
        absolute = os.path.abspath(entry or ".")  # noqa: PTH100 ("": the working directory)
        real = os.path.realpath(absolute) + "/"
        if not real.startswith(installed) and absolute not in kept:
            kept.append(absolute)
    return tuple(kept)


def host_sys_path(bundle: Bundle | None, path: Sequence[str] | None = None) -> tuple[str, ...]:
    """The ``sys.path`` entries a host with its own interpreter is given (before its own).

    Without shipped code: :func:`project_paths`. With it: each entry's place in the tree
    (relative: the agent's working directory is the tree), torchrunx's folder there first, then
    the project entries that were not shipped (a shared folder the host may have).
    """
    projects = project_paths(path)
    if bundle is None:
        return projects
    from torchrunx.engines.ship import lib_entry  # noqa: PLC0415 (pathspec: only when shipping)

    lib = lib_entry(bundle)
    placed: list[str] = [lib] if lib is not None else []
    for entry in [*(sys.path if path is None else path), *projects]:
        place = bundle.place(entry or ".")
        if place is not None and place not in placed:
            placed.append(place)
        elif place is None and entry in projects and entry not in placed:
            placed.append(entry)
    return tuple(placed)


def package_root(bundle: Bundle | None) -> str:
    """The ``sys.path`` entry of a host that holds the launcher's torchrunx.

    The launcher's own root, or, for shipped code, its place in the tree (relative, as the
    tree's other entries): the agent's boot code keeps the working folder on ``sys.path`` only
    when it is this entry (a checkout launched from: the launcher runs its code already).
    """
    root = str(PACKAGE.parent)
    if bundle is None:
        return root
    from torchrunx.engines.ship import lib_entry  # noqa: PLC0415 (pathspec: only when shipping)

    return lib_entry(bundle) or bundle.place(root) or root


def check_files(env_file: str | Path | None, ssh_config_file: str | Path | None) -> None:
    """``env_file`` and ``ssh_config_file`` exist, can be read, and the SSH config parses.

    Raises:
        ValueError: Either is missing or unreadable.
    """
    if env_file is not None and not Path(env_file).expanduser().is_file():
        raise ValueError(f"env_file {str(env_file)!r} does not exist or is not a file")
    if ssh_config_file is not None:
        path = Path(ssh_config_file).expanduser()
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ValueError(f"ssh_config_file {str(path)!r} does not exist or is not readable")
        read_ssh_config(path)  # a syntax error is reported now, before any host is touched


def check_container(container: object) -> None:
    """``container`` is None or a command line (``podman exec -i NAME``).

    Raises:
        TypeError: It is not a string.
        ValueError: It is empty or cannot be split like a shell command line.
    """
    if container is None:
        return
    if not isinstance(container, str):
        raise TypeError(
            f"container must be a command line such as 'podman exec -i NAME', got {container!r}"
        )
    try:
        words = shlex.split(container)
    except ValueError as exc:
        raise ValueError(f"container {container!r} is not a command line: {exc}") from exc
    if not words:
        raise ValueError(
            "container is empty: give the command that runs a command in the container, such "
            "as 'podman exec -i NAME', or None"
        )


def default_python(
    python: Python, hostname: str, container: Sequence[str], method: str | None = None
) -> str | None:
    """The interpreter a remote host runs: ``python``'s, else ``python3`` in a container."""
    given = python_for(python, hostname, method)
    return given if given is not None or not container else "python3"
