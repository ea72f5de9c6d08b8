"""Shipped code on a host: fetched once into a per-user cache, by content (``Launcher(ship=)``).

This file runs on the host *before* torchrunx can be imported there (the launch may be what
brings torchrunx), as ``python -c SOURCE CACHE DIGEST``: the agent's script (on its stdin, see
:func:`torchrunx.engines.command.agent_script`) runs it before it changes into the copy and
starts the agent. It uses the standard library only.

The cache, ``CACHE`` (``$TORCHRUNX_CACHE_DIR/code``, else ``~/.cache/torchrunx/code``), is
private to the user (mode 0700) and holds:

- ``blobs/SHA256-r`` and ``blobs/SHA256-x``: each file's bytes once, by content (and whether
  it is executable), read-only;
- ``trees/DIGEST``: one launch's tree, its files hard links to the blobs, read-only;
- ``records/DIGEST``: the tree's manifest, and what each of its files looked like
  (``lstat``: inode, size, modification and change times, mode) when its bytes were last
  checked against their SHA-256.

Nothing kept is trusted by its name (mode 0444 does not stop root, nor a rank running as
root in a container):

- a tree is used again only if its record's manifest is the launch's (its SHA-256 begins with
  ``DIGEST``) and each of its files still looks as recorded; a file that does not (an edit
  changes its change time, a replaced file its inode) is hashed again, and the tree is used
  only if every such file still has its SHA-256 (the record is then renewed). Otherwise the
  tree is set aside (``trees/.tmp-stale-*``, removed after a day: a launch running in it keeps
  its files) and made again, as if it had never been there;
- a blob kept from an earlier launch is hashed before a new tree links to it; one whose bytes
  (or whose mode) no longer match is fetched again.

The exchange runs on the agent's stdin and stdout (the launcher's side is
:mod:`torchrunx.engines.ship`). This side writes one line at a time, ``torchrunx-ship WORD``:

1. ``have``: ``trees/DIGEST`` exists and is whole (it was shipped before, and checked as
   above): nothing more is sent.
2. else ``manifest``; the launcher sends its length (16 ASCII digits) and the manifest (JSON:
   ``[[path, executable, size, sha256], ...]``, whose SHA-256 begins with ``DIGEST``);
3. ``need [i, ...]``: the files whose blob is missing or changed; the launcher sends their
   bytes, one after another; each is checked against its SHA-256 before it is kept;
4. ``done``: the tree is in place (made under a temporary name, then renamed).

stdin is read with ``os.read`` and exact lengths, never more: what follows the exchange on stdin
(the agent's bootstrap line) stays there for the agent.

Cleaning (every run, after the exchange): a tree not used by a launch for
``$TORCHRUNX_CACHE_DAYS`` days (default 14) is removed, then every blob no tree links to any more
and older than that, the record of a tree that is gone, and leftovers of an unpack that was cut
short or of a tree set aside (after a day).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any

_PREFIX = b"torchrunx-ship "
_CHUNK = 1 << 20
_DAY = 86400.0


def _say(word: str) -> None:
    data = _PREFIX + word.encode() + b"\n"
    while data:
        data = data[os.write(1, data) :]


def _read_exact(size: int) -> bytes:
    parts = []
    while size:
        chunk = os.read(0, min(size, _CHUNK))
        if not chunk:
            msg = "the launcher stopped sending the shipped code"
            raise EOFError(msg)
        parts.append(chunk)
        size -= len(chunk)
    return b"".join(parts)


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)


def _blob_name(sha: str, *, executable: bool) -> str:
    return f"{sha}-{'x' if executable else 'r'}"


def _receive_blob(blobs: Path, size: int, sha: str, *, executable: bool) -> None:
    temporary = blobs / f".tmp-{os.getpid()}-{sha}"
    digest = hashlib.sha256()
    try:
        with temporary.open("wb") as out:
            left = size
            while left:
                chunk = _read_exact(min(left, _CHUNK))
                digest.update(chunk)
                out.write(chunk)
                left -= len(chunk)
        if digest.hexdigest() != sha:
            msg = f"a shipped file's bytes do not match its SHA-256 {sha}: changed while sent?"
            raise ValueError(msg)
        temporary.chmod(0o555 if executable else 0o444)
        temporary.replace(blobs / _blob_name(sha, executable=executable))
    finally:  # never a half-written blob
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def _make_tree(root: Path, digest: str, raw: bytes, files: list[list[Any]]) -> None:
    """Make ``trees/DIGEST`` from the blobs, and its record, under ``root`` (the cache)."""
    blobs, trees = root / "blobs", root / "trees"
    temporary = trees / f".tmp-{digest}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        for path, executable, _size, sha in files:
            target = temporary / str(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            blob = blobs / _blob_name(str(sha), executable=bool(executable))
            try:
                target.hardlink_to(blob)
            except OSError:  # a filesystem without hard links, or too many of them: a copy
                shutil.copy2(blob, target)
        # The record first: a tree in place never lacks one (were it lacking, another
        # launch would set the tree aside).
        seen = [_looks(os.lstat(temporary / str(path))) for path, *_ in files]
        _write_record(root / "records", digest, raw, seen)
        with contextlib.suppress(OSError):  # else another launch made it at the same time
            temporary.rename(trees / digest)
    finally:  # never a half-made tree
        shutil.rmtree(temporary, ignore_errors=True)


def _looks(info: os.stat_result) -> list[int]:
    """What a kept file looks like: an edit changes its change time, a new file its inode."""
    return [info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_mode]


def _write_record(records: Path, digest: str, raw: bytes, seen: list[list[int]]) -> None:
    """Write ``records/DIGEST`` whole (under a temporary name, then renamed)."""
    temporary = records / f".tmp-{digest}-{os.getpid()}"
    try:
        temporary.write_text(json.dumps({"manifest": raw.decode(), "seen": seen}))
        temporary.replace(records / digest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def _sha256(path: Path) -> str | None:
    """The SHA-256 of the regular file ``path`` (a symbolic link is not followed), or None."""
    digest = hashlib.sha256()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO never blocks
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _holds(path: Path, entry: list[Any], info: os.stat_result) -> bool:
    """Whether the kept file ``path`` (``info``: its ``lstat``) holds what ``entry`` names."""
    _path, executable, size, sha = entry
    return (
        stat.S_ISREG(info.st_mode)
        and info.st_size == int(size)
        and bool(info.st_mode & stat.S_IXUSR) == bool(executable)
        and _sha256(path) == str(sha)
    )


def _tree_is_whole(tree: Path, records: Path, digest: str) -> bool:
    """Whether the kept ``tree`` holds the launch's files; hashes again what changed since."""
    try:
        record = json.loads((records / digest).read_bytes())
        raw = str(record["manifest"]).encode()
        seen = [list(map(int, looks)) for looks in record["seen"]]
        files = _parsed_manifest(raw, digest)
    except (OSError, ValueError, KeyError, TypeError):  # none, a cut one, a forged one
        return False
    if len(seen) != len(files):
        return False
    renewed = False
    for index, entry in enumerate(files):
        path = tree / str(entry[0])
        try:
            info = os.lstat(path)
        except OSError:
            return False
        if _looks(info) != seen[index]:
            if not _holds(path, entry, info):
                return False
            seen[index], renewed = _looks(info), True
    if renewed:
        _write_record(records, digest, raw, seen)
    return True


def _parsed_manifest(raw: bytes, digest: str) -> list[list[Any]]:
    if not hashlib.sha256(raw).hexdigest().startswith(digest):
        msg = "the manifest does not match the launch's digest"
        raise ValueError(msg)
    files: list[list[Any]] = json.loads(raw)
    for path, _executable, _size, _sha in files:
        parts = str(path).split("/")
        if str(path).startswith("/") or ".." in parts or "" in parts:
            msg = f"the manifest names a path outside the tree: {path!r}"
            raise ValueError(msg)
    return files


def _set_aside(tree: Path, digest: str) -> None:
    """Move a tree that is not whole out of the way; cleaning removes it after a day."""
    aside = tree.parent / f".tmp-stale-{digest}-{os.getpid()}-{time.time_ns()}"
    with contextlib.suppress(OSError):  # another launch moved it first
        tree.rename(aside)
        os.utime(aside)  # a day from now: a launch still running in it keeps its files


def _missing_blobs(blobs: Path, files: list[list[Any]]) -> list[int]:
    """The files whose blob must be fetched: missing, or kept but no longer what it was."""
    missing: dict[str, int] = {}
    whole: set[str] = set()
    for index, entry in enumerate(files):
        _path, executable, _size, sha = entry
        name = _blob_name(str(sha), executable=bool(executable))
        if name in missing or name in whole:
            continue
        blob = blobs / name
        try:
            info = os.lstat(blob)
        except FileNotFoundError:
            missing[name] = index
            continue
        if _holds(blob, entry, info):
            whole.add(name)
        else:  # edited in place, or replaced: fetched again (a tree that links it keeps it)
            _remove(blob)
            missing[name] = index
    return sorted(missing.values())


def unpack(cache: str, digest: str) -> None:
    """Put the tree ``digest`` in ``cache`` (fetching what is missing), then clean the cache."""
    root = Path(cache)
    blobs, trees, records = root / "blobs", root / "trees", root / "records"
    for folder in (root.parent, root, blobs, trees, records):  # root.parent: ~/.cache/torchrunx
        _private_dir(folder)
    tree = trees / digest
    if tree.is_dir() and _tree_is_whole(tree, records, digest):
        os.utime(tree)  # used now: the cleaning rule counts from here
        _say("have")
    else:
        if tree.is_dir():
            _set_aside(tree, digest)
        _say("manifest")
        raw = _read_exact(int(_read_exact(16)))
        files = _parsed_manifest(raw, digest)
        needed = _missing_blobs(blobs, files)
        _say("need " + json.dumps(needed))
        for index in needed:
            _path, executable, size, sha = files[index]
            _receive_blob(blobs, int(size), str(sha), executable=bool(executable))
        _make_tree(root, digest, raw, files)
        _say("done")
    clean(root, keep=digest)


def clean(cache: Path, *, keep: str, now: float | None = None) -> None:
    """Remove trees unused for the cache's age limit, then blobs no tree links to, and leftovers.

    A tree's record goes with its tree (a day later: a launch writes the record of its new tree
    just before it puts the tree in place).
    """
    limit = float(os.environ.get("TORCHRUNX_CACHE_DAYS", "") or 14) * _DAY
    now = time.time() if now is None else now
    # Trees first: their blobs and records go after.
    for folder in (cache / "trees", cache / "blobs", cache / "records"):
        with contextlib.suppress(OSError):
            for path in folder.iterdir():
                with contextlib.suppress(OSError):
                    if _expired(cache, path, keep=keep, now=now, limit=limit):
                        _remove(path)


def _expired(cache: Path, path: Path, *, keep: str, now: float, limit: float) -> bool:
    """Whether cleaning removes ``path`` (of ``trees``, ``blobs`` or ``records``) now."""
    info = path.lstat()
    age = now - info.st_mtime
    if path.name.startswith(".tmp-"):
        return age > _DAY
    if path.parent.name == "trees":
        return path.name != keep and age > limit
    if path.parent.name == "blobs":
        return info.st_nlink == 1 and age > limit
    return age > _DAY and not (cache / "trees" / path.name).is_dir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink()


if __name__ == "__main__":
    try:
        unpack(sys.argv[1], sys.argv[2])
    except Exception as exc:  # noqa: BLE001 (any failure: said on stderr, the host fails)
        hint = ""
        if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            hint = (
                "; give it a writable folder: TORCHRUNX_CACHE_DIR on that host (forwarded with "
                "Launcher(extra_env_vars=('TORCHRUNX_CACHE_DIR',))), or a writable home (in a "
                "container: a writable root, pyxis's --container-writable, or a mounted home)"
            )
        sys.stderr.write(
            f"torchrunx: cannot unpack the shipped code in {sys.argv[1]}: {exc}{hint}\n"
        )
        sys.exit(1)
