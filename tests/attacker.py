"""Another local user, for the security tests: a real account made with ``useradd``.

The tests run as root; an attack by "another user on the same machine" runs as this account
(``trxattacker``), made where missing and removed at the end of a run (:func:`remove_if_unused`)
unless another test session still uses it: each process that uses it holds a shared lock on
:data:`LEASE` for the rest of its life, and the account is removed only by a session that can
take that lock alone (a pure-test session ending beside a whole suite once removed the account
under a security test that was making it).
The namespace test hosts share this machine's ``/etc/passwd``, so the same account is the other
user on a test host: prefix :func:`as_attacker`'s command with the host's ``enter_argv``.

    subprocess.run(as_attacker([sys.executable, "-c", CODE]))                     # here
    subprocess.run([*cluster.enter_argv("node1"), *as_attacker(["python3", ...])])  # on node1
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

NAME = "trxattacker"
MAKING = "/tmp/.trx-attacker.lock"
"""Held (exclusively) while the account is made or removed: two sessions may do so at once."""
LEASE = "/tmp/.trx-attacker.lease"
"""Held shared by every process that has used the account, for the rest of its life."""
_lease: list[int] = []


def _hold_lease() -> None:
    """Take this process's shared lock on :data:`LEASE` (once; released when it exits)."""
    if not _lease:
        fd = os.open(LEASE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _lease.append(fd)


def attacker_ids() -> tuple[int, int]:
    """The account's ``(uid, gid)``, made first where it does not exist yet."""
    _hold_lease()  # before it can exist: no session may remove it from here on
    with open(MAKING, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(NAME)
        except KeyError:
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME],
                check=True,
                capture_output=True,
            )
            entry = pwd.getpwnam(NAME)
    return entry.pw_uid, entry.pw_gid


def _try_lock_alone(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_alone(fd: int, seconds: float) -> bool:
    """Take ``fd``'s lock exclusively within ``seconds`` (this run's own pytest-xdist workers
    may still be exiting, their leases with them); whether it was taken.
    """
    deadline = time.monotonic() + seconds
    while not _try_lock_alone(fd):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def remove_if_unused() -> bool:
    """Remove the account unless a live process of another session holds :data:`LEASE`, or
    one of the account's own processes is left; whether it was removed.
    """
    for fd in _lease:  # this process's own lease (a run in one process) is no other's
        os.close(fd)
    _lease.clear()
    with open(MAKING, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pwd.getpwnam(NAME)
        except KeyError:
            return False
        fd = os.open(LEASE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not _lock_alone(fd, seconds=5.0):  # another session's process still uses it
                return False
            if (
                subprocess.run(["pgrep", "-u", NAME], capture_output=True, check=False).returncode
                != 1
            ):
                return False
            return (
                subprocess.run(["userdel", NAME], capture_output=True, check=False).returncode == 0
            )
        finally:
            os.close(fd)


def as_attacker(argv: list[str]) -> list[str]:
    """``argv`` run as the other user (no supplementary groups, a clean ``HOME``)."""
    uid, gid = attacker_ids()
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={gid}",
        "--clear-groups",
        "env",
        "HOME=/tmp",
        f"USER={NAME}",
        *argv,
    ]


def attacker_env() -> dict[str, str]:
    """An environment for the other user's processes: this one, less our session's marks."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRUNX", "SSH_"))}


@contextlib.contextmanager
def shared_folder() -> Iterator[Path]:
    """A world-writable, sticky folder (mode 1777, as ``/tmp``), removed afterwards.

    Made outside pytest's base folder, which is root's alone: the other user must reach it.
    """
    path = Path(tempfile.mkdtemp(prefix="trx-shared-", dir="/tmp"))
    try:
        path.chmod(0o1777)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def plant(folder: Path, module: str, marker: Path) -> Path:
    """Write ``folder/module.py`` as the other user: it records who imported it in ``marker``.

    ``marker`` must be writable by anyone (it is made here, mode 0666): each import appends
    one line, ``PID UID argv``.
    """
    marker.touch()
    marker.chmod(0o666)
    code = (
        "import os, sys\n"
        f"with open({str(marker)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()} {os.getuid()} {sys.argv!r}\\n')\n"
    )
    target = folder / f"{module}.py"
    subprocess.run(
        as_attacker(["sh", "-c", 'cat > "$1"', "sh", str(target)]),
        input=code.encode(),
        check=True,
    )
    return target
