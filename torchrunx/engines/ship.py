"""Code shipped to hosts that do not share the launcher's files (``Launcher(ship=...)``).

:func:`make_bundle` reads what to ship (the working directory, or a list of paths) into a
:class:`Bundle`: every file with its SHA-256, ``.gitignore`` files and ``ship_exclude`` honoured,
and torchrunx itself (so the hosts run the launcher's version). Its digest names the tree on each
host. :meth:`Bundle.exchange` runs the launcher's side of the exchange with
:mod:`torchrunx.agent.unpack` on an agent's stdin and stdout, before the bootstrap line: a host
that has the tree says so and gets nothing more; otherwise it asks for the blobs it lacks.

The tree's root is the launcher's working directory: a shipped path inside it keeps its place
(``src/pkg`` is ``TREE/src/pkg``); one outside it goes to ``.torchrunx-paths/N-NAME``; torchrunx,
if no shipped path holds it, to ``.torchrunx-lib/torchrunx``. :meth:`Bundle.place` maps a path of
the launcher's (a ``sys.path`` entry, ``env_file``) into the tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import select
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pathspec

from torchrunx.errors import ShipError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import IO

PACKAGE = Path(__file__).resolve().parent.parent
"""torchrunx's own package folder."""

ALWAYS_EXCLUDED = (".git/", "__pycache__/", "*.pyc")
"""Never shipped: git's own data and Python's byte-code caches."""
_PREFIX = b"torchrunx-ship "
_CHUNK = 1 << 20
_LIB = ".torchrunx-lib"
_OUTSIDE = ".torchrunx-paths"
_MAX_LINE = 64 << 20
"""The longest line of the exchange the launcher reads (a ``need`` list of every file)."""


@dataclass(frozen=True)
class ShippedFile:
    """One file of a bundle: where it goes in the tree, and what it holds."""

    path: str
    """Its place in the tree (``/``-separated, relative)."""
    source: Path
    """Where the launcher reads it."""
    executable: bool
    size: int
    sha256: str


@dataclass(frozen=True)
class Bundle:
    """What a launch ships: its files, its roots in the tree, and its digest."""

    files: tuple[ShippedFile, ...]
    roots: tuple[tuple[str, str], ...]
    """``(launcher's directory or file, its place in the tree)`` for each shipped path."""
    manifest: bytes = field(repr=False)
    digest: str = ""
    """The tree's name on the hosts: the start of the manifest's SHA-256."""
    timeout: float = 60.0
    """Seconds an exchange with one host may take (the launch's ``start_timeout``)."""
    sent: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _written: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)
    """Bytes written to every host so far, counted as they are written (one mutable cell)."""
    """Bytes written to each host by the exchange (host name to bytes), for logs and tests."""
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def written(self) -> int:
        """Bytes written to every host so far (the progress line reads it while they are)."""
        return self._written[0]

    @property
    def size(self) -> int:
        """The bytes of every file."""
        return sum(f.size for f in self.files)

    def place(self, path: str | os.PathLike[str]) -> str | None:
        """Where ``path`` (absolute, on the launcher) is in the tree; None: it is not shipped.

        ``"."`` is the tree's root (the launcher's working directory).
        """
        resolved = os.path.abspath(path)  # noqa: PTH100 (no symlinks resolved: as given)
        for source, place in self.roots:
            if _within(resolved, source):
                rest = os.path.relpath(resolved, source)
                return os.path.normpath(os.path.join(place, rest))  # noqa: PTH118
        return None

    def exchange(
        self,
        hostname: str,
        read: Callable[[float], bytes | None],
        write: Callable[[bytes, float], None],
    ) -> bytes:
        """The launcher's side of :mod:`torchrunx.agent.unpack` with one host.

        Args:
            hostname: The host (its bytes are counted in :attr:`sent`).
            read: Reads what the host wrote to its stdout, waiting up to the given seconds
                (``b""``: it ended; ``None``: nothing yet).
            write: Writes all of the bytes to the host's stdin within the given seconds
                (else raises :class:`TimeoutError`: a cut link, a host that stopped reading).

        Returns:
            What the host wrote after the exchange (the start of its own output).

        Raises:
            ShipError: The host ended, said something else, or the exchange took longer than
                :attr:`timeout`.
        """
        deadline = time.monotonic() + self.timeout
        lines = _Lines(read, deadline)
        sent = 0

        def write_in_time(data: bytes) -> None:
            try:
                write(data, deadline - time.monotonic())
                with self._lock:
                    self._written[0] += len(data)
            except TimeoutError as exc:
                raise ShipError(
                    f"shipping took longer than {self.timeout:g} s (start_timeout): the host "
                    f"took no more data ({exc})"
                ) from exc

        word = lines.next()
        if word == b"manifest":
            header = b"%016d" % len(self.manifest)
            write_in_time(header + self.manifest)
            sent += len(header) + len(self.manifest)
            word = lines.next()
            if not word.startswith(b"need "):
                raise ShipError(f"expected the list of files the host needs, got {word[:80]!r}")
            for index in json.loads(word[5:]):
                sent += self._send_file(self.files[int(index)], write_in_time)
                if time.monotonic() > deadline:
                    raise ShipError(f"shipping took longer than {self.timeout:g} s")
            word = lines.next()
            if word != b"done":
                raise ShipError(f"expected the host to confirm the tree, got {word[:80]!r}")
        elif word != b"have":
            raise ShipError(f"expected the host's answer to the shipped code, got {word[:80]!r}")
        with self._lock:
            self.sent[hostname] = self.sent.get(hostname, 0) + sent
        return lines.rest()

    @staticmethod
    def _send_file(shipped: ShippedFile, write: Callable[[bytes], None]) -> int:
        left = shipped.size
        with shipped.source.open("rb") as f:
            while left:
                chunk = f.read(min(left, _CHUNK))
                if not chunk:  # shorter now than when it was read: the host refuses its hash
                    chunk = bytes(min(left, _CHUNK))
                write(chunk)
                left -= len(chunk)
        return shipped.size


class _Lines:
    """The exchange's lines from a host's stdout; what comes after is kept for the caller."""

    def __init__(self, read: Callable[[float], bytes | None], deadline: float) -> None:
        self._read = read
        self._deadline = deadline
        self._buffer = b""

    def next(self) -> bytes:
        while b"\n" not in self._buffer:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise ShipError("the host did not answer about the shipped code in time")
            if len(self._buffer) > _MAX_LINE:
                raise ShipError("the host's answer about the shipped code is too long")
            chunk = self._read(left)
            if chunk is None:
                continue
            if not chunk:
                shown = self._buffer[-200:].decode(errors="replace")
                raise ShipError(
                    "the host ended before it had the shipped code"
                    + (f" (it wrote {shown!r})" if shown else "")
                )
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        if not line.startswith(_PREFIX):
            raise ShipError(
                f"expected the shipped code's exchange on the host's stdout, got {line[:120]!r} "
                "(does a login script print?)"
            )
        return line[len(_PREFIX) :]

    def rest(self) -> bytes:
        return self._buffer


def read_fd(fd: int) -> Callable[[float], bytes | None]:
    """A reader for :meth:`Bundle.exchange` of a pipe (blocking or not), with a timeout."""

    def read(timeout: float) -> bytes | None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(math.ceil(max(timeout, 0.0) * 1000)):
            return None
        try:
            return os.read(fd, 65536)
        except BlockingIOError:
            return None

    return read


def write_within(stream: IO[bytes], data: bytes, timeout: float) -> None:
    """Write all of ``data`` to the pipe ``stream`` within ``timeout`` seconds.

    Raises:
        TimeoutError: The pipe took no more in time (a host that stopped reading, a cut link
            behind the command that reads it).
        OSError: The pipe is closed (the command ended).
    """
    stream.flush()
    fd = stream.fileno()
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    blocking = os.get_blocking(fd)
    os.set_blocking(fd, False)
    try:
        while view:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(math.ceil(left * 1000)):
                raise TimeoutError(f"{len(view)} bytes not taken in {timeout:.3g} s")
            with contextlib.suppress(BlockingIOError):
                view = view[os.write(fd, view) :]
    finally:
        os.set_blocking(fd, blocking)


def make_bundle(
    paths: Sequence[str | os.PathLike[str]],
    exclude: Sequence[str] = (),
    *,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 60.0,
) -> Bundle:
    """Read what ``paths`` ship (relative to ``cwd``, default the working directory).

    Args:
        paths: Directories or files; ``"."`` is the working directory.
        exclude: More patterns to leave out, in ``.gitignore``'s syntax, relative to each
            shipped directory (``data/``, ``*.ckpt``).
        cwd: The launcher's working directory (the tree's root).
        timeout: Seconds one host's exchange may take.

    Raises:
        ValueError: A path does not exist.
    """
    root = os.path.abspath(cwd if cwd is not None else os.getcwd())  # noqa: PTH100, PTH109
    roots: list[tuple[str, str]] = []
    outside = 0
    for given in paths:
        source = os.path.abspath(os.path.join(root, given))  # noqa: PTH100, PTH118
        if not os.path.exists(source):  # noqa: PTH110
            raise ValueError(
                f"ship: {str(given)!r} does not exist (relative to the working directory {root})"
            )
        if _within(source, root):
            place = os.path.relpath(source, root)
        else:
            outside += 1
            place = f"{_OUTSIDE}/{outside}-{Path(source).name}"
        roots.append((source, place))
    package = str(PACKAGE)
    if not any(_within(package, source) for source, _ in roots):
        roots.append((package, f"{_LIB}/torchrunx"))
    files: dict[str, ShippedFile] = {}
    for source, place in roots:
        for path, rel in _walk(source, exclude):
            where = os.path.normpath(os.path.join(place, rel)) if rel else place  # noqa: PTH118
            files.setdefault(where, _shipped(path, where))
    ordered = tuple(files[p] for p in sorted(files))
    manifest = json.dumps(
        [[f.path, f.executable, f.size, f.sha256] for f in ordered], separators=(",", ":")
    ).encode()
    return Bundle(
        files=ordered,
        roots=tuple(roots),
        manifest=manifest,
        digest=hashlib.sha256(manifest).hexdigest()[:32],
        timeout=timeout,
    )


def _within(path: str, folder: str) -> bool:
    """Whether the absolute ``path`` is ``folder`` or lies below it."""
    return os.path.commonpath([path, folder]) == folder


def lib_entry(bundle: Bundle) -> str | None:
    """The tree's entry for ``sys.path`` that holds torchrunx when no shipped path does."""
    return _LIB if any(place == f"{_LIB}/torchrunx" for _, place in bundle.roots) else None


_HASHES: dict[tuple[str, int, int, int], str] = {}
"""SHA-256 of files already read by this process, by (path, inode, size, mtime)."""


def _shipped(path: str, where: str) -> ShippedFile:
    info = os.stat(path)  # noqa: PTH116
    key = (path, info.st_ino, info.st_size, info.st_mtime_ns)
    sha = _HASHES.get(key)
    if sha is None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:  # noqa: PTH123
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        sha = _HASHES[key] = digest.hexdigest()
    return ShippedFile(
        path=where,
        source=Path(path),
        executable=bool(info.st_mode & stat.S_IXUSR),
        size=info.st_size,
        sha256=sha,
    )


class _Ignores:
    """The patterns that apply under one shipped folder: each ``.gitignore`` below its own."""

    def __init__(self, exclude: Iterable[str]) -> None:
        self.specs = [("", pathspec.GitIgnoreSpec.from_lines([*ALWAYS_EXCLUDED, *exclude]))]

    def read(self, folder: Path, rel_folder: str) -> None:
        """Take ``folder``'s ``.gitignore``, if it has one (``rel_folder``: ``.`` for the top)."""
        path = folder / ".gitignore"
        if path.is_file():
            lines = path.read_bytes().decode("utf-8", "replace").splitlines()
            where = "" if rel_folder == "." else rel_folder
            self.specs.append((where, pathspec.GitIgnoreSpec.from_lines(lines)))

    def __call__(self, rel: str, *, folder: bool) -> bool:
        """Whether ``rel`` (relative to the shipped folder) is left out."""
        for where, spec in self.specs:
            if where and not rel.startswith(where + "/"):
                continue
            inner = rel[len(where) + 1 :] if where else rel
            if spec.match_file(inner + "/" if folder else inner):
                return True
        return False


def _walk(source: str, exclude: Iterable[str]) -> Iterable[tuple[str, str]]:
    """Each file under ``source`` to ship, with its path relative to ``source``.

    ``.gitignore`` files apply to their own folder and below; ``exclude`` and
    :data:`ALWAYS_EXCLUDED` to all of ``source``. Symbolic links to files are shipped as the
    file; links to folders are not followed.
    """
    if Path(source).is_file():
        yield source, ""
        return
    ignored = _Ignores(exclude)
    for folder, dirs, names in os.walk(source):
        here = Path(folder)
        ignored.read(here, os.path.relpath(folder, source))
        dirs[:] = [
            name
            for name in sorted(dirs)
            if not (here / name).is_symlink()
            and not ignored(os.path.relpath(here / name, source), folder=True)
        ]
        for name in sorted(names):
            rel = os.path.relpath(here / name, source)
            if (here / name).is_file() and not ignored(rel, folder=False):
                yield str(here / name), rel
