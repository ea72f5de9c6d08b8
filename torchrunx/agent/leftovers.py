"""What workers leave behind on their host: processes, however daemonised, and temporary files.

A worker's children that stay in its process group die with that group. A daemon leaves it:
``setsid`` gives it a session and a process group of its own, and a double fork takes its
parent away, so that it would be adopted by ``init`` and outlive the launch. Not here: the
agent and its guardian (:mod:`torchrunx.agent.guardian`) are *child subreapers*
(``prctl(PR_SET_CHILD_SUBREAPER)``, Linux 3.4), so an orphan below them is adopted by the
nearest of the two, never by ``init``, and stays their descendant whatever it does. What
either must end is then exactly its descendants:

- :func:`descendants` finds them, from ``/proc/PID/task/TID/children`` downwards (or from
  every ``/proc/PID/stat`` where the kernel has no ``children`` files);
- :func:`send` signals one through a pidfd opened after checking its start time, so a pid
  reused meanwhile is never signalled;
- :func:`kill_descendants` sends SIGKILL to every one until none is left, and reaps the ones
  adopted;
- :func:`reap_adopted` reaps the adopted orphans that ended, never a worker.

Only processes that leave the tree through another process (``systemd-run``, ``at``, a
container runtime, ``ssh`` to this host) are out of reach: they are not descendants.

The workers' temporary files go in one private directory per agent (:func:`make_private_dir`),
their ``TMPDIR``, emptied between attempts (:func:`empty_dir`) and removed when the agent ends
(:func:`remove_dir`): a worker ends with ``os._exit``, so ``atexit`` clean-ups, such as
``multiprocessing``'s ``pymp-*`` folders, never run. A directory whose agent and guardian were
both SIGKILLed (a Ray actor killed takes its whole process tree) is removed by the next agent
that starts on the host: each directory holds a lock file that its agent, guardian and workers
keep locked while any of them lives (:func:`sweep_stale_dirs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torchrunx.wire.frozen import frozen

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator, Mapping

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_KILL_TIMEOUT = 5.0
"""Seconds :func:`kill_descendants` keeps killing (a process in uninterruptible sleep waits)."""


# -- the kernel's settings ----------------------------------------------------------------------


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, value, 0, 0, 0)) == 0


def set_child_subreaper() -> bool:
    """Make this process adopt the orphans among its descendants; whether it could (Linux)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def set_parent_death_signal(signum: int) -> bool:
    """Get ``signum`` when the parent (the thread that forked this process) ends (Linux)."""
    return _prctl(_PR_SET_PDEATHSIG, signum)


# -- finding the descendants --------------------------------------------------------------------


@frozen
class Proc:
    """One process as ``/proc/PID/stat`` describes it."""

    pid: int
    ppid: int
    pgid: int
    state: str
    """``R``, ``S``, ``D``, ``Z`` (ended, not reaped yet), ..."""
    start: int
    """Start time in clock ticks since boot: with the pid, it names one process for good."""

    @property
    def zombie(self) -> bool:
        """Ended, not reaped yet: nothing to signal."""
        return self.state in {"Z", "X"}


def parse_stat(line: str) -> Proc | None:
    """The fields of one ``/proc/PID/stat`` line (``None`` if it is not one).

    The command name, in parentheses, may hold spaces and parentheses itself: the fields after
    it are found from the last ``)``.
    """
    try:
        pid, rest = line.split(" (", 1)
        fields = rest.rsplit(")", 1)[1].split()
        return Proc(int(pid), int(fields[1]), int(fields[2]), fields[0], int(fields[19]))
    except (ValueError, IndexError):
        return None


def read_proc(pid: int) -> Proc | None:
    """Process ``pid`` now, or ``None`` if there is none."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def tree(root: int, table: Mapping[int, Proc]) -> list[Proc]:
    """The descendants of ``root`` in a table of processes by pid, each reached from its parent."""
    children: dict[int, list[Proc]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc)
    found: list[Proc] = []
    todo = [root]
    while todo:
        for proc in children.get(todo.pop(), ()):
            if proc.pid != root:
                found.append(proc)
                todo.append(proc.pid)
    return found


def _all_processes() -> dict[int, Proc]:
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (proc := read_proc(int(entry.name))) is not None:
            table[proc.pid] = proc
    return table


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # ended meanwhile
        return ""


def _children(pid: int) -> Iterator[int]:
    """The children of ``pid`` as its threads' ``children`` files list them."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return
    for task in tasks:
        yield from map(int, _read(task / "children").split())


def _children_files() -> bool:
    pid = os.getpid()
    return Path(f"/proc/{pid}/task/{pid}/children").exists()  # CONFIG_PROC_CHILDREN


def descendants(root: int) -> list[Proc]:
    """Every process below ``root`` now, zombies included (``root`` itself is not).

    Read from the ``children`` files downwards from ``root``, which reads only this tree;
    without them (a kernel built without ``CONFIG_PROC_CHILDREN``), from every process's
    ``stat``. A process seen is kept only if its parent is still the one it was found under.
    """
    if not _children_files():
        return tree(root, _all_processes())
    found: list[Proc] = []
    seen = {root}
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid in _children(parent):
            proc = read_proc(pid)
            if proc is not None and proc.ppid == parent and pid not in seen:
                seen.add(pid)
                found.append(proc)
                todo.append(pid)
    return found


# -- ending them -------------------------------------------------------------------------------


def send(proc: Proc, signum: int) -> bool:
    """Send ``signum`` to ``proc`` if it is still the process that was seen; whether it was.

    The pidfd is opened first, then the start time checked: a pid reused in between would have
    another, and the pidfd then names the newcomer, which is not signalled.
    """
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:  # gone (or no pidfds: Linux < 5.3)
        return False
    try:
        now = read_proc(proc.pid)
        if now is None or now.start != proc.start:
            return False
        signal.pidfd_send_signal(pidfd, signum)
    except OSError:
        return False
    finally:
        os.close(pidfd)
    return True


def reap_adopted(keep: Collection[int] = ()) -> int:
    """Reap this process's ended children, except those in ``keep``; how many were reaped.

    ``keep``: the workers not reaped yet, which their group reaps itself (it needs their
    status). Stops at the first of them that ended, and finds the rest on a later call.
    """
    reaped = 0
    while True:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if ended is None or ended.si_pid in keep:
            return reaped
        with contextlib.suppress(ChildProcessError):
            os.waitpid(ended.si_pid, 0)
        reaped += 1


def kill_descendants(root: int, timeout: float = _KILL_TIMEOUT) -> list[Proc]:
    """SIGKILL every descendant of ``root`` until none is left; what is left after ``timeout``.

    ``root`` must be this process (or its children are reaped by no one). Each round kills
    what it finds, then reaps what ``root`` adopted meanwhile: the children of a killed
    process come up to ``root`` and are found in the next round, a fork racing the kill too.
    Zombies of other parents count until their (killed) parent's end hands them up as well.
    """
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        found = descendants(root)
        for proc in found:
            if proc.zombie and proc.ppid == root:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(proc.pid, os.WNOHANG)
            elif not proc.zombie:
                send(proc, signal.SIGKILL)
        if not found:
            return []
        if time.monotonic() >= deadline:
            return found
        time.sleep(pause)  # let the kills land
        pause = min(pause * 2, 0.05)


# -- the private temporary directory ------------------------------------------------------------


def make_private_dir() -> str | None:
    """A new directory (mode 0700) in the temporary directory (``TMPDIR``, else ``/tmp``...).

    One per agent, shared by all its workers. ``None`` if none can be made there: then a
    warning (see :func:`_warn_agent`) names the folder and the error, and the workers keep the
    ``TMPDIR`` they inherit, shared with the host's other processes and not emptied by the
    launch.
    """
    try:
        path = tempfile.mkdtemp(prefix="torchrunx-")
        lock = os.open(Path(path) / LOCK_NAME, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)  # held open (and locked) until this process tree ends
    except OSError as error:
        where = tempfile.tempdir or os.environ.get("TMPDIR") or "/tmp"  # noqa: S108 (a name)
        inherited = os.environ.get("TMPDIR")
        _warn_agent(
            f"could not make the workers' private temporary folder in {where}: {error}. The "
            f"workers keep the inherited TMPDIR ({inherited or 'unset: /tmp'}), shared with "
            f"the other processes of this host, and what they leave there is not removed when "
            f"the launch ends. Free space there, or point TMPDIR to a writable folder"
        )
        return None
    sweep_stale_dirs(Path(path).parent, keep=path)
    return path


LOCK_NAME = ".torchrunx-lock"
"""The lock file of a private directory: locked while its agent, guardian or a worker lives."""


def sweep_stale_dirs(parent: Path, keep: str) -> list[str]:
    """Remove this user's private directories in ``parent`` whose lock nobody holds.

    A directory without a lock file is left alone (its agent may be making it, or it is of
    another release). Returns the directories removed.
    """
    removed = []
    with contextlib.suppress(OSError):
        for entry in parent.glob("torchrunx-*"):
            if str(entry) == keep:
                continue
            with contextlib.suppress(OSError):
                info = entry.lstat()
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                    continue
                fd = os.open(entry / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: it lives
                    _remove(entry)
                    removed.append(str(entry))
                finally:
                    os.close(fd)
    return removed


def _warn_agent(message: str) -> None:
    """A warning of the agent's, as its logging writes one, before that logging is set up.

    :func:`make_private_dir` runs in the guardian, before the fork and before the agent's
    :func:`torchrunx.worker.capture.capture_logging`; the agent's stderr goes to the launcher,
    which reads this marked line as a ``WARNING`` record of ``torchrunx.agent.leftovers`` on
    that host.
    """
    from torchrunx.wire.lines import MarkedLineFormatter  # noqa: PLC0415 (leftovers stays lean)

    record = logging.LogRecord(
        "torchrunx.leftovers", logging.WARNING, __file__, 0, message, None, None
    )
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(MarkedLineFormatter().format(record) + "\n")
        sys.stderr.flush()


def _open_up(path: Path) -> None:
    """Give the owner every right on ``path`` and the folders below it (rmtree needs them)."""
    with contextlib.suppress(OSError):
        path.chmod(stat.S_IRWXU)
        for entry in path.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                _open_up(entry)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        _open_up(path)  # a read-only folder (a worker's chmod) would keep what it holds
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def empty_dir(path: str | None) -> None:
    """Remove everything in ``path``, read-only folders included, and keep ``path``."""
    if path is None:
        return
    try:
        entries = list(Path(path).iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name != LOCK_NAME:  # the lock says the directory is in use
            with contextlib.suppress(OSError):
                _remove(entry)


def remove_dir(path: str | None) -> None:
    """Remove ``path`` and everything in it, read-only folders included."""
    if path is not None:
        with contextlib.suppress(OSError):
            _remove(Path(path))
