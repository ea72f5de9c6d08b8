"""The files and folders the launcher creates for its logs: never through a planted name.

A shared ``TORCHRUNX_LOG_DIR`` (mode 1777, like ``/tmp``) lets other users create names in it,
and the launch folder's name (the time to the second) and its events file's are predictable.
Whatever is planted there is never followed, written to nor reused: the launch takes other
names. Modes are 0600 for files and 0700 for folders whatever the umask.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import stat
from typing import TYPE_CHECKING

import pytest

import torchrunx as trx
from torchrunx.events import EventSink, LaunchStarted
from torchrunx.launcher.view import logdirs

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

WHEN = dt.datetime(2025, 6, 1, 14, 3, 27, 512345)  # noqa: DTZ001 (local time, as the names)
SECOND = WHEN.isoformat(timespec="seconds")
PRECIOUS = "the user's own file, which no launch may touch\n"


def clock() -> dt.datetime:
    return WHEN


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """Umask 0: whatever mode a file or folder gets is the one torchrunx sets itself."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def shared_root(tmp_path: Path) -> Path:
    """A log root every user may create names in, like ``/tmp`` (mode 1777)."""
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    return root


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A file of the user's that a planted symbolic link points to."""
    target = tmp_path / "precious.txt"
    target.write_text(PRECIOUS)
    target.chmod(0o644)
    return target


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_symlink_planted_as_the_events_file_is_never_followed(
    shared_root, precious, caplog, permissive_umask
):
    planted = shared_root / f"{SECOND}.events.jsonl"
    planted.symlink_to(precious)
    with caplog.at_level(logging.WARNING, logger="torchrunx.logs"):
        folder = logdirs.new_log_dir(shared_root, now=clock)
    assert folder.name != SECOND  # the name whose events file was taken is given up
    assert not (shared_root / SECOND).exists()  # and its folder removed again
    assert precious.read_text() == PRECIOUS
    assert planted.is_symlink()
    assert f"{planted} already exists" in caplog.text
    events = logdirs.events_file(folder)
    assert mode(folder) == 0o700
    assert mode(events) == 0o600
    sink = EventSink([], events)
    sink.emit(LaunchStarted(hostnames=("localhost",), workers_per_host=(1,), max_restarts=0))
    sink.close()
    assert "LaunchStarted" in events.read_text()
    assert precious.read_text() == PRECIOUS


def test_a_symlink_planted_as_the_launch_folder_is_never_followed(shared_root, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (shared_root / SECOND).symlink_to(elsewhere)
    folder = logdirs.new_log_dir(shared_root, now=clock)
    assert folder.name != SECOND
    assert not folder.is_symlink()
    assert list(elsewhere.iterdir()) == []


def test_a_planted_world_writable_events_file_is_not_reused(shared_root, permissive_umask):
    planted = shared_root / f"{SECOND}.events.jsonl"
    planted.write_text(PRECIOUS)
    planted.chmod(0o666)
    folder = logdirs.new_log_dir(shared_root, now=clock)
    assert logdirs.events_file(folder) != planted
    assert planted.read_text() == PRECIOUS
    assert mode(planted) == 0o666
    assert mode(logdirs.events_file(folder)) == 0o600


def test_the_event_sink_refuses_a_symlink_and_a_file_with_another_link(tmp_path, precious):
    link = tmp_path / "link.events.jsonl"
    link.symlink_to(precious)
    with pytest.raises(PermissionError, match="is a symbolic link: not followed"):
        EventSink([], link)
    hard = tmp_path / "hard.events.jsonl"
    os.link(precious, hard)
    with pytest.raises(PermissionError, match="2 links"):
        EventSink([], hard)
    assert precious.read_text() == PRECIOUS


def test_a_launch_in_a_shared_root_writes_elsewhere_than_planted_names(
    shared_root, precious, monkeypatch, permissive_umask
):
    """Symlinks planted as the events files of the coming seconds' folders (free names)."""
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", str(shared_root))
    start = dt.datetime.now().replace(microsecond=0)  # noqa: DTZ005 (local time, as the names)
    planted = []
    for seconds in range(-1, 30):
        name = (start + dt.timedelta(seconds=seconds)).isoformat(timespec="seconds")
        each = shared_root / f"{name}.events.jsonl"
        each.symlink_to(precious)
        planted.append(each)
    trx.launch(os.getpid, hostnames=["localhost"], workers_per_host=1, backend=None)
    assert precious.read_text() == PRECIOUS
    assert all(each.is_symlink() for each in planted)
    made = [each for each in shared_root.iterdir() if each not in planted]
    folders = [each for each in made if each.is_dir() and not each.is_symlink()]
    assert len(folders) == 1
    folder = folders[0]
    assert "." in folder.name  # the microseconds name, after the second's was found taken
    assert mode(folder) == 0o700
    events = logdirs.events_file(folder)
    assert sorted(made) == sorted([folder, events])
    assert mode(events) == 0o600
    assert "LaunchStarted" in events.read_text()
    files = sorted(folder.iterdir())
    assert [each.name for each in files] == ["localhost.log", "localhost[0].log"]
    assert all(mode(each) == 0o600 for each in files)


def test_a_missing_log_root_is_made_private_whatever_the_umask(
    tmp_path, monkeypatch, permissive_umask
):
    root = tmp_path / "new" / "logs"
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", str(root))
    trx.launch(os.getpid, hostnames=["localhost"], workers_per_host=1, backend=None)
    assert mode(root) == 0o700
    (folder,) = (each for each in root.iterdir() if each.is_dir() and not each.is_symlink())
    assert mode(folder) == 0o700
    assert all(mode(each) == 0o600 for each in root.iterdir() if each.is_file())
    assert all(mode(each) == 0o600 for each in folder.iterdir())


def test_a_root_others_can_write_in_without_the_sticky_bit_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "open"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(PermissionError, match=r"writable by every user without the sticky bit"):
        logdirs.new_log_dir(root)
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", str(root))
    with pytest.raises(PermissionError, match=r"chmod go-w"):
        trx.launch(os.getpid, hostnames=["localhost"], workers_per_host=1, backend=None)
    assert list(root.iterdir()) == []
    root.chmod(0o1777)  # shared the /tmp way: others may add names, not replace ours
    assert logdirs.new_log_dir(root).parent == root


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_root_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir()
    root.chmod(0o1777)
    os.chown(root, 65534, 65534)
    with pytest.raises(PermissionError, match=r"belongs to another user \(uid 65534\)"):
        logdirs.new_log_dir(root)
    assert list(root.iterdir()) == []


# --------------------------------------------------------------------------------------------
# The workers' private TMPDIR: a failure to make it is a warning, not silence
# --------------------------------------------------------------------------------------------

NO_TMPDIR = """
import errno, tempfile

_mkdtemp = tempfile.mkdtemp


def mkdtemp(suffix=None, prefix=None, dir=None):
    if prefix == "torchrunx-":
        raise OSError(errno.ENOSPC, "No space left on device (test)", tempfile.gettempdir())
    return _mkdtemp(suffix, prefix, dir)


tempfile.mkdtemp = mkdtemp
"""


def report_tmpdir() -> str | None:
    return os.environ.get("TMPDIR")


def test_a_private_tmpdir_that_cannot_be_made_is_a_warning_of_the_agent(
    tmp_path, monkeypatch, capsys
):
    """The agent's ``mkdtemp`` fails (as on a full disk): the launcher's logs say where and why."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TMPDIR)  # loaded by the agent's interpreter
    shared = tmp_path / "tmp"
    shared.mkdir()
    inherited = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [inherited])]))
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", str(tmp_path / "logs"))
    result = trx.launch(report_tmpdir, hostnames=["localhost"], workers_per_host=1, backend=None)
    assert result.rank(0) == str(shared)  # the inherited one, as the warning says
    logs = tmp_path / "logs"
    (folder,) = (each for each in logs.iterdir() if each.is_dir() and not each.is_symlink())
    agent_log = (folder / "localhost.log").read_text()
    assert (
        "WARNING torchrunx.leftovers: could not make the workers' private temporary " in agent_log
    )
    assert f"folder in {shared}: [Errno 28] No space left on device (test)" in agent_log
    assert f"keep the inherited TMPDIR ({shared})" in agent_log
    console = capsys.readouterr().out  # the default console shows an agent's warnings
    assert "[localhost] could not make the workers' private temporary folder" in console
