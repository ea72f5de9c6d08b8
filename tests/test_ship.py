"""The shipped-code exchange, end to end on this machine: the launcher's side
(:meth:`torchrunx.engines.ship.Bundle.exchange`) with the real unpacker in a child process,
started as the agent's script starts it (``python -I -S -c SOURCE CACHE DIGEST``), on pipes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest

from torchrunx.engines import ship
from torchrunx.engines.command import unpack_source
from torchrunx.engines.ship import write_within

if TYPE_CHECKING:
    from pathlib import Path


class Host:
    """One run of the unpacker, as a host's agent script runs it, on its own cache."""

    def __init__(self, cache: Path, digest: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", unpack_source(), str(cache), digest],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.written = 0

    def write(self, data: bytes, timeout: float = 60.0) -> None:
        assert self.process.stdin is not None
        write_within(self.process.stdin, data, timeout)
        self.written += len(data)

    def exchange(self, bundle: ship.Bundle) -> tuple[bytes, int, str]:
        """The exchange, then what follows on stdin: what the host read after, exit, stderr."""
        assert self.process.stdout is not None
        try:
            bundle.exchange("h", ship.read_fd(self.process.stdout.fileno()), self.write)
            # What follows on an agent's stdin (its bootstrap) is the next command's: the
            # unpacker reads only its part and may have exited already (then the pipe is
            # closed: a series run saw BrokenPipeError here).
            with contextlib.suppress(BrokenPipeError):
                self.write(b"BOOTSTRAP LINE\n")
        finally:
            self.close()
        return b"", self.status, self.err

    def close(self) -> None:
        """Close its stdin, wait for it, keep its stderr and close its pipes."""
        process = self.process
        assert process.stdin is not None and process.stdout is not None
        assert process.stderr is not None
        process.stdin.close()
        self.status = process.wait(30)
        self.err = process.stderr.read().decode()
        process.stdout.close()
        process.stderr.close()


def _project(root: Path, size: int = 200_000) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (root / "pkg" / "model.py").write_bytes(os.urandom(size))
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)


def test_the_first_exchange_sends_every_file_and_the_second_nothing(tmp_path):
    _project(tmp_path / "work")
    cache = tmp_path / "home" / ".cache" / "torchrunx" / "code"
    bundle = ship.make_bundle(["."], cwd=tmp_path / "work")
    host = Host(cache, bundle.digest)
    _, status, err = host.exchange(bundle)
    assert status == 0, err
    tree = cache / "trees" / bundle.digest
    assert (tree / "pkg" / "model.py").read_bytes() == (tmp_path / "work/pkg/model.py").read_bytes()
    assert os.access(tree / "run.sh", os.X_OK)
    assert not os.access(tree / "pkg" / "__init__.py", os.W_OK) or os.geteuid() == 0
    assert (tree / "pkg" / "__init__.py").stat().st_mode & 0o222 == 0  # read-only copies
    assert (tree / ".torchrunx-lib" / "torchrunx" / "agent" / "unpack.py").is_file()
    assert bundle.size < host.written < bundle.size + len(bundle.manifest) + 1000
    assert (cache.parent.stat().st_mode & 0o777, cache.stat().st_mode & 0o777) == (0o700, 0o700)

    again = Host(cache, bundle.digest)
    _, status, err = again.exchange(bundle)
    assert status == 0, err
    assert again.written == len(b"BOOTSTRAP LINE\n")  # the tree is there: nothing is sent


def test_a_changed_file_sends_only_that_file(tmp_path):
    _project(tmp_path / "work", size=500_000)
    cache = tmp_path / "cache"
    first = ship.make_bundle(["."], cwd=tmp_path / "work")
    assert Host(cache, first.digest).exchange(first)[1] == 0
    (tmp_path / "work" / "pkg" / "__init__.py").write_text("VALUE = 2\n")
    second = ship.make_bundle(["."], cwd=tmp_path / "work")
    host = Host(cache, second.digest)
    assert host.exchange(second)[1] == 0
    assert host.written < len(second.manifest) + 200  # the manifest, one 10-byte file, lines
    assert (cache / "trees" / second.digest / "pkg" / "__init__.py").read_text() == "VALUE = 2\n"
    assert (cache / "trees" / first.digest / "pkg" / "__init__.py").read_text() == "VALUE = 1\n"


def test_bytes_that_do_not_match_their_hash_are_refused_and_nothing_is_left(tmp_path):
    _project(tmp_path / "work")
    cache = tmp_path / "cache"
    bundle = ship.make_bundle(["."], cwd=tmp_path / "work")
    model = tmp_path / "work" / "pkg" / "model.py"
    model.write_bytes(b"x" * model.stat().st_size)  # changed after the manifest, same size
    with pytest.raises(ship.ShipError, match="the host ended before it had the shipped code"):
        Host(cache, bundle.digest).exchange(bundle)
    assert list((cache / "trees").iterdir()) == []
    assert not [p for p in (cache / "blobs").iterdir() if p.name.startswith(".tmp-")]


def test_a_manifest_that_leaves_the_tree_is_refused(tmp_path):
    bad = ship.Bundle(
        files=(),
        roots=(),
        manifest=b'[["../../.bashrc", false, 1, "' + b"0" * 64 + b'"]]',
    )
    bad = ship.Bundle(
        files=(),
        roots=(),
        manifest=bad.manifest,
        digest=hashlib.sha256(bad.manifest).hexdigest()[:32],
    )
    host = Host(tmp_path / "cache", bad.digest)
    with pytest.raises(ship.ShipError):
        host.exchange(bad)
    err = host.err
    assert "the manifest names a path outside the tree: '../../.bashrc'" in err
    assert not (tmp_path / ".bashrc").exists()


def test_the_unpacker_reads_no_further_than_the_exchange(tmp_path):
    """The agent reads its bootstrap line next: the unpacker must leave it on stdin."""
    _project(tmp_path / "work")
    bundle = ship.make_bundle(["."], cwd=tmp_path / "work")
    script = (
        f'{sys.executable} -I -S -c "$U" {tmp_path}/cache {bundle.digest} && '
        'IFS= read -r line && printf "after:%s\\n" "$line" >&2'
    )
    process = subprocess.Popen(
        ["bash", "-c", script],
        env={**os.environ, "U": unpack_source()},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdin is not None and process.stdout is not None
    stdin = process.stdin

    def write(data: bytes, timeout: float = 60.0) -> None:
        write_within(stdin, data, timeout)

    bundle.exchange("h", ship.read_fd(process.stdout.fileno()), write)
    write(b'{"bootstrap": true}\n')
    stdin.close()
    assert process.wait(30) == 0
    assert process.stderr is not None
    err = process.stderr.read()
    process.stdout.close()
    process.stderr.close()
    assert b'after:{"bootstrap": true}' in err


def test_a_host_that_says_something_else_is_named(tmp_path):
    bundle = ship.make_bundle(["."], cwd=tmp_path)
    read, write = os.pipe()
    os.write(write, b"Welcome to the cluster!\n")
    with pytest.raises(ship.ShipError, match=r"got b'Welcome to the cluster!' \(does a login"):
        bundle.exchange("h", ship.read_fd(read), lambda _data, _timeout: None)
    os.close(read)
    os.close(write)


def test_a_host_that_never_answers_times_out(tmp_path):
    bundle = ship.make_bundle(["."], cwd=tmp_path, timeout=0.3)
    read, write = os.pipe()
    with pytest.raises(ship.ShipError, match="did not answer about the shipped code in time"):
        bundle.exchange("h", ship.read_fd(read), lambda _data, _timeout: None)
    os.close(read)
    os.close(write)


def test_a_host_that_stops_reading_mid_transfer_fails_within_the_timeout(tmp_path):
    # A host that asked for a 4 MiB file, then took nothing more (a cut link behind the
    # transport): the write of the file gives up at the exchange's deadline.
    (tmp_path / "big.bin").write_bytes(os.urandom(4 << 20))
    bundle = ship.make_bundle(["."], cwd=tmp_path, timeout=0.5)
    (big,) = [i for i, f in enumerate(bundle.files) if f.source == tmp_path / "big.bin"]
    answers, stdin = os.pipe(), os.pipe()
    os.write(answers[1], b"torchrunx-ship manifest\ntorchrunx-ship need [%d]\n" % big)
    started = time.monotonic()
    with (
        os.fdopen(stdin[1], "wb") as host_stdin,
        pytest.raises(ship.ShipError, match=r"shipping took longer than 0.5 s \(start_timeout\)"),
    ):
        bundle.exchange(
            "h",
            ship.read_fd(answers[0]),
            lambda data, timeout: write_within(host_stdin, data, timeout),
        )
    assert time.monotonic() - started < 2
    for fd in (*answers, stdin[0]):
        os.close(fd)


# -- what is kept is checked before it is used again ------------------------------------------


def _edit_in_place(path: Path, data: bytes) -> None:
    """Change a kept file's bytes as a careless rank would: in place, mode and mtime restored.

    As root (a rank in a container), mode 0444 stops nothing; elsewhere the write bit is set
    for the write and taken away after it.
    """
    info = path.stat()
    path.chmod(info.st_mode | 0o200)
    with path.open("r+b") as f:
        f.write(data)
        f.truncate()
    path.chmod(info.st_mode)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))  # only the change time tells


def _value_in(tree: Path) -> str:
    """What ``pkg.VALUE`` is when the tree's code runs (a fresh interpreter, in the tree).

    ``-B``: no byte-code cache is written, so what is read is the source as it is now.
    """
    done = subprocess.run(
        [
            sys.executable,
            "-I",
            "-B",
            "-c",
            "import sys; sys.path.insert(0, ''); import pkg; print(pkg.VALUE)",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def _set_aside(cache: Path) -> list[Path]:
    return sorted((cache / "trees").glob(".tmp-stale-*"))


@pytest.mark.parametrize("size", ["same size", "longer"])
def test_a_tree_file_edited_in_the_cache_is_detected_and_fetched_again(tmp_path, size):
    _project(tmp_path / "work")
    cache = tmp_path / "cache"
    bundle = ship.make_bundle(["."], cwd=tmp_path / "work")
    assert Host(cache, bundle.digest).exchange(bundle)[1] == 0
    tree = cache / "trees" / bundle.digest
    assert _value_in(tree) == "1"
    edit = b"VALUE = 9\n" if size == "same size" else b"VALUE = 666  # edited\n"
    _edit_in_place(tree / "pkg" / "__init__.py", edit)  # also the blob: the same inode
    assert _value_in(tree) != "1"  # what the next launch would run, before #42

    again = Host(cache, bundle.digest)
    _, status, err = again.exchange(bundle)
    assert status == 0, err
    init = next(f for f in bundle.files if f.path == "pkg/__init__.py")
    # The manifest, then that file alone: the others were still whole.
    assert again.written == 16 + len(bundle.manifest) + init.size + len(b"BOOTSTRAP LINE\n")
    assert _value_in(tree) == "1"
    assert (tree / "pkg" / "__init__.py").stat().st_mode & 0o222 == 0
    (aside,) = _set_aside(cache)  # the edited tree, out of the way (removed after a day)
    assert (aside / "pkg" / "__init__.py").read_bytes() == edit

    third = Host(cache, bundle.digest)  # whole again: nothing is sent
    assert third.exchange(bundle)[1] == 0
    assert third.written == len(b"BOOTSTRAP LINE\n")


def test_a_tree_file_replaced_in_the_cache_is_detected_and_fetched_again(tmp_path):
    _project(tmp_path / "work")
    cache = tmp_path / "cache"
    bundle = ship.make_bundle(["."], cwd=tmp_path / "work")
    assert Host(cache, bundle.digest).exchange(bundle)[1] == 0
    tree = cache / "trees" / bundle.digest
    model = tree / "pkg" / "model.py"
    info = model.stat()
    planted = tmp_path / "planted"
    planted.write_bytes(b"#" * info.st_size)  # as long, as old, as read-only
    planted.chmod(info.st_mode & 0o777)
    os.utime(planted, ns=(info.st_atime_ns, info.st_mtime_ns))
    planted.replace(model)

    again = Host(cache, bundle.digest)
    assert again.exchange(bundle)[1] == 0, again.err
    assert model.read_bytes() == (tmp_path / "work" / "pkg" / "model.py").read_bytes()
    # Nothing was wrong with the blobs: only the manifest went, and the tree was made again.
    assert again.written == 16 + len(bundle.manifest) + len(b"BOOTSTRAP LINE\n")
    assert len(_set_aside(cache)) == 1


def test_a_kept_blob_edited_before_a_new_tree_links_it_is_fetched_again(tmp_path):
    _project(tmp_path / "work")
    cache = tmp_path / "cache"
    first = ship.make_bundle(["."], cwd=tmp_path / "work")
    assert Host(cache, first.digest).exchange(first)[1] == 0
    model = next(f for f in first.files if f.path == "pkg/model.py")
    _edit_in_place(cache / "blobs" / f"{model.sha256}-r", b"\0" * model.size)
    (tmp_path / "work" / "pkg" / "__init__.py").write_text("VALUE = 2\n")  # a new tree
    second = ship.make_bundle(["."], cwd=tmp_path / "work")
    host = Host(cache, second.digest)
    assert host.exchange(second)[1] == 0, host.err
    tree = cache / "trees" / second.digest
    assert (tree / "pkg" / "model.py").read_bytes() == model.source.read_bytes()
    assert _value_in(tree) == "2"
    # The new __init__.py and the edited blob were sent; the others were linked as kept.
    assert host.written == (
        16 + len(second.manifest) + len(b"VALUE = 2\n") + model.size + len(b"BOOTSTRAP LINE\n")
    )


def test_a_tree_without_its_record_or_with_a_forged_one_is_made_again(tmp_path):
    _project(tmp_path / "work")
    cache = tmp_path / "cache"
    bundle = ship.make_bundle(["."], cwd=tmp_path / "work")
    assert Host(cache, bundle.digest).exchange(bundle)[1] == 0
    record = cache / "records" / bundle.digest
    assert record.is_file()
    written = json.loads(record.read_text())
    assert written["manifest"].encode() == bundle.manifest

    record.unlink()  # a tree of an earlier release, or a record lost
    host = Host(cache, bundle.digest)
    assert host.exchange(bundle)[1] == 0, host.err
    assert host.written == 16 + len(bundle.manifest) + len(b"BOOTSTRAP LINE\n")  # blobs kept
    assert record.is_file()

    # A record whose manifest names other bytes for a file: not the launch's manifest.
    _edit_in_place(cache / "trees" / bundle.digest / "pkg" / "__init__.py", b"VALUE = 9\n")
    forged = json.loads(record.read_text())
    init = next(f for f in bundle.files if f.path == "pkg/__init__.py")
    forged["manifest"] = forged["manifest"].replace(
        init.sha256, hashlib.sha256(b"VALUE = 9\n").hexdigest()
    )
    forged["seen"] = [[0, 0, 0, 0, 0]] * len(forged["seen"])
    record.write_text(json.dumps(forged))
    host = Host(cache, bundle.digest)
    assert host.exchange(bundle)[1] == 0, host.err
    assert _value_in(cache / "trees" / bundle.digest) == "1"
    assert host.written == 16 + len(bundle.manifest) + init.size + len(b"BOOTSTRAP LINE\n")


def test_a_kept_file_whose_change_time_moved_is_hashed_again_and_used(tmp_path):
    # A new hard link to a blob (another tree) changes its change time, not its bytes.
    _project(tmp_path / "work")
    cache = tmp_path / "cache"
    bundle = ship.make_bundle(["."], cwd=tmp_path / "work")
    assert Host(cache, bundle.digest).exchange(bundle)[1] == 0
    record = cache / "records" / bundle.digest
    before = json.loads(record.read_text())["seen"]
    (tmp_path / "another-link").hardlink_to(cache / "trees" / bundle.digest / "pkg" / "model.py")
    host = Host(cache, bundle.digest)
    assert host.exchange(bundle)[1] == 0, host.err
    assert host.written == len(b"BOOTSTRAP LINE\n")  # still whole: nothing sent
    after = json.loads(record.read_text())["seen"]
    assert after != before  # renewed: the next launch does not hash it again
    assert _set_aside(cache) == []
