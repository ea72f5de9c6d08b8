"""Another local user, for the security tests: a real account made with ``useradd``.

The tests run as root; an attack by "another user on the same machine" runs as this account
(``trxattacker``), made once per machine and kept (removing it would race other test sessions).
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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

NAME = "trxattacker"


def attacker_ids() -> tuple[int, int]:
    """The account's ``(uid, gid)``, made first where it does not exist yet."""
    with open("/tmp/.trx-attacker.lock", "a") as lock:  # two sessions may make it at once
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
