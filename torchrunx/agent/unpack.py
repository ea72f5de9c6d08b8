"""Shipped code on a host: fetched once into a per-user cache, by content (``Launcher(ship=)``).

This file runs on the host *before* torchrunx can be imported there (the launch may be what
brings torchrunx), as ``python -c SOURCE CACHE DIGEST``: the agent's script (on its stdin, see
:func:`torchrunx.launcher.transport.agent_script`) runs it before it changes into the copy and
starts the agent. It uses the standard library only.

The cache, ``CACHE`` (``$TORCHRUNX_CACHE_DIR/code``, else ``~/.cache/torchrunx/code``), is
private to the user (mode 0700) and holds:

- ``blobs/SHA256-r`` and ``blobs/SHA256-x``: each file's bytes once, by content (and whether
  it is executable), read-only;
- ``trees/DIGEST``: one launch's tree, its files hard links to the blobs, read-only.

The exchange runs on the agent's stdin and stdout (the launcher's side is
:mod:`torchrunx.launcher.ship`). This side writes one line at a time, ``torchrunx-ship WORD``:

1. ``have``: ``trees/DIGEST`` exists (it was shipped before): nothing more is sent.
2. else ``manifest``; the launcher sends its length (16 ASCII digits) and the manifest (JSON:
   ``[[path, executable, size, sha256], ...]``, whose SHA-256 begins with ``DIGEST``);
3. ``need [i, ...]``: the files whose blob is missing; the launcher sends their bytes, one after
   another; each is checked against its SHA-256 before it is kept;
4. ``done``: the tree is in place (made under a temporary name, then renamed).

stdin is read with ``os.read`` and exact lengths, never more: what follows the exchange on stdin
(the agent's bootstrap line) stays there for the agent.

Cleaning (every run, after the exchange): a tree not used by a launch for
``$TORCHRUNX_CACHE_DAYS`` days (default 14) is removed, then every blob no tree links to any more
and older than that, and leftovers of an unpack that was cut short (after a day).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
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


def _make_tree(blobs: Path, trees: Path, digest: str, files: list[list[Any]]) -> None:
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
        with contextlib.suppress(OSError):  # else another launch made it at the same time
            temporary.rename(trees / digest)
    finally:  # never a half-made tree
        shutil.rmtree(temporary, ignore_errors=True)


def _checked_manifest(digest: str) -> list[list[Any]]:
    raw = _read_exact(int(_read_exact(16)))
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


def unpack(cache: str, digest: str) -> None:
    """Put the tree ``digest`` in ``cache`` (fetching what is missing), then clean the cache."""
    root = Path(cache)
    blobs, trees = root / "blobs", root / "trees"
    for folder in (root.parent, root, blobs, trees):  # root.parent: ~/.cache/torchrunx
        _private_dir(folder)
    tree = trees / digest
    if tree.is_dir():
        os.utime(tree)  # used now: the cleaning rule counts from here
        _say("have")
    else:
        _say("manifest")
        files = _checked_manifest(digest)
        missing: dict[str, int] = {}
        for index, (_path, executable, _size, sha) in enumerate(files):
            name = _blob_name(str(sha), executable=bool(executable))
            if name not in missing and not (blobs / name).exists():
                missing[name] = index
        _say("need " + json.dumps(sorted(missing.values())))
        for index in sorted(missing.values()):
            _path, executable, size, sha = files[index]
            _receive_blob(blobs, int(size), str(sha), executable=bool(executable))
        _make_tree(blobs, trees, digest, files)
        _say("done")
    clean(root, keep=digest)


def clean(cache: Path, *, keep: str, now: float | None = None) -> None:
    """Remove trees unused for the cache's age limit, then blobs no tree links to, and leftovers."""
    limit = float(os.environ.get("TORCHRUNX_CACHE_DAYS", "") or 14) * _DAY
    now = time.time() if now is None else now
    for folder in (cache / "trees", cache / "blobs"):  # trees first: their blobs go after
        with contextlib.suppress(OSError):
            for path in folder.iterdir():
                with contextlib.suppress(OSError):
                    info = path.lstat()
                    age = now - info.st_mtime
                    if path.name.startswith(".tmp-"):
                        if age > _DAY:
                            _remove(path)
                    elif folder.name == "trees" and path.name != keep and age > limit:
                        _remove(path)
                    elif folder.name == "blobs" and info.st_nlink == 1 and age > limit:
                        path.unlink()


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
