"""The launcher's log folders: the root checked, one new folder per launch, its events file.

Nothing that is in the way (a file, a symbolic link, a folder) is followed, reused or removed:
the folder and the files a launch writes are new, and private to its user.
"""

from __future__ import annotations

import datetime as dt
import grp
import logging
import os
import pwd
import stat
from typing import TYPE_CHECKING

from torchrunx.logs import create_private_file

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from pathlib import Path

_logger = logging.getLogger("torchrunx.logs")


_FRESH_STAMPS = 10
"""Fresh clock readings tried for a folder name before a ``-N`` suffix is added."""


def new_log_dir(root: Path, now: Callable[[], dt.datetime] = dt.datetime.now) -> Path:
    """A new folder under ``root`` named by the local time of the launch (mode 0700).

    The name is naive local time to the second (``2025-06-01T14:03:27``), as torchrunx 0.4
    named it, so ``datetime.fromisoformat`` reads it back. If a folder of that second exists
    (two launches in one second), the time is read again with microseconds
    (``2025-06-01T14:03:27.512345``, which ``fromisoformat`` reads too); only if that keeps
    clashing is ``-N`` appended. The names sort by time.

    The launch's events file (:func:`events_file`) is created here too, empty and mode 0600,
    so that the folder and the file beside it are both new: a name is taken only when neither
    exists. Nothing that is in the way (a file, a symbolic link, a folder) is followed, reused
    or removed; a name whose events file is in the way is given up with a warning. ``root`` is
    made (mode 0700) if missing, and checked first (:func:`check_log_root`). Modes are set with
    ``chmod`` after creation, whatever the umask.

    Raises:
        PermissionError: ``root`` is not safe to write in (see :func:`check_log_root`).
        FileExistsError: No free name was found.
    """
    make_log_root(root)
    for name in _log_dir_names(now):
        path = root / name
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        _make_private_dir(path)
        events = events_file(path)
        try:
            os.close(create_private_file(events))
        except FileExistsError:
            path.rmdir()
            _logger.warning(
                "%s already exists and is not this launch's: left alone, the launch logs under "
                "another name. Something else writes into %s, or planted that name there",
                events,
                root,
            )
            continue
        return path
    raise FileExistsError(f"cannot create a new log folder under {root}")


def make_log_root(root: Path) -> None:
    """Make ``root`` if it is missing (mode 0700, whatever the umask), then check it.

    Folders above it that are missing are made with the default mode (``mkdir -p``).

    Raises:
        PermissionError: ``root`` is not safe to write in (see :func:`check_log_root`).
    """
    if not root.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            root.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile, by another launch: checked below like any existing folder
        else:
            _make_private_dir(root)
    check_log_root(root)


def check_log_root(root: Path) -> None:
    """Refuse a log root where another user could replace what a launch creates in it.

    ``root`` (after symbolic links, which are yours to choose) must be a folder owned by you
    or by root, and, unless its sticky bit is set (as on ``/tmp``), writable by nobody else:
    not by others, and not by its group unless that group is your own private group (named as
    you, your primary group, no other member). In a sticky folder others may create names but
    not rename or remove yours; what they plant is never followed nor reused
    (:func:`new_log_dir`).

    Raises:
        PermissionError: What is wrong with it, where, and what to do.
    """
    try:
        info = root.stat()
    except FileNotFoundError:
        raise PermissionError(f"the log folder {root} does not exist") from None
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(
            f"the log folder {root} is not a folder: set TORCHRUNX_LOG_DIR to a folder of yours"
        )
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        raise PermissionError(
            f"the log folder {root} belongs to another user (uid {info.st_uid}), who could "
            f"replace the files a launch writes there; set TORCHRUNX_LOG_DIR to a folder of "
            f"yours (for example a subfolder {root / _user_name()}, made by you)"
        )
    mode = info.st_mode
    if mode & stat.S_ISVTX:
        return
    writable_by = []
    if mode & stat.S_IWOTH:
        writable_by.append("every user")
    if mode & stat.S_IWGRP and not _is_private_group(info.st_gid):
        writable_by.append(f"its group (gid {info.st_gid})")
    if writable_by:
        raise PermissionError(
            f"the log folder {root} (mode {stat.S_IMODE(mode):04o}) is writable by "
            f"{' and '.join(writable_by)} without the sticky bit, so another user could replace "
            f"the files a launch writes there; run `chmod go-w {root}` (or `chmod +t {root}` "
            f"for a shared folder), or set TORCHRUNX_LOG_DIR to a folder of yours"
        )


def _make_private_dir(path: Path) -> None:
    """Set a folder just made to mode 0700 through a descriptor that refuses a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def _is_private_group(gid: int) -> bool:
    """Whether ``gid`` is the user's own group (a user private group, as ``umask 002`` implies)."""
    try:
        user = pwd.getpwuid(os.geteuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return (
        gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}
    )


def _log_dir_names(now: Callable[[], dt.datetime]) -> Iterator[str]:
    """Names for a new log folder, to try in order (the clock is read when each is needed)."""
    yield now().isoformat(timespec="seconds")
    stamp = ""
    for _ in range(_FRESH_STAMPS):
        stamp = now().isoformat(timespec="microseconds")
        yield stamp
    for n in range(1, 1000):
        yield f"{stamp}-{n}"


def events_file(log_dir: Path) -> Path:
    """Where the events of the launch logging to ``log_dir`` go: beside it, ``<name>.events.jsonl``.

    Not inside: the folder holds one log file per agent and worker, and nothing else.
    """
    return log_dir.with_name(f"{log_dir.name}.events.jsonl")


def log_file_name(hostnames: Sequence[str], host_index: int, local_rank: int | None) -> str:
    """The file name of a worker's log (``HOST[LOCAL_RANK].log``) or its agent's (``HOST.log``).

    A host name given again (two agents on one host) gets ``-N`` for its N-th repeat:
    ``node1-1[0].log``. ``torchrunx logs`` reads the same names back.
    """
    hostname = hostnames[host_index]
    occurrence = list(hostnames[:host_index]).count(hostname)
    base = hostname if occurrence == 0 else f"{hostname}-{occurrence}"
    return f"{base}.log" if local_rank is None else f"{base}[{local_rank}].log"
