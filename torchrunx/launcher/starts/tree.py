"""Tree start (``Launcher(tree_radix=k)``): who starts whom, and the launcher's side of a child.

The launcher starts hosts ``0`` to ``k-1`` (the interior hosts); host ``j >= k`` is started by
host ``j // k - 1``'s relay, over SSH from that host (:class:`torchrunx.agent.relay.TreeStarts`).
A host started so has no process on the launcher: its place in the agent pool is a
:class:`TreeChildProcess`, fed by the TREE frames of its interior host's relay (its ``ssh``
client's output lines and its exit status), and ended, naming the interior host, if that
host's stream ends first. See docs/how_it_works.md, "Tree start".
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import threading
from typing import TYPE_CHECKING

from torchrunx.errors import AgentFailedError

if TYPE_CHECKING:
    from collections.abc import Collection

    from torchrunx.engines.protocol import OnLine, Reader
    from torchrunx.engines.relay import OnTree

LOST_STATUS = 255
"""The exit status a child is given when its interior host was lost (as ssh's own)."""
_TAIL_LINES = 40


def tree_parent(index: int, radix: int) -> int | None:
    """The host that starts host ``index`` (``None``: the launcher does)."""
    return None if index < radix else index // radix - 1


def tree_children(index: int, radix: int, count: int) -> list[int]:
    """The hosts that host ``index`` starts, of ``count`` hosts in all."""
    first = (index + 1) * radix
    return list(range(first, min(first + radix, count)))


class TreeChildProcess:
    """A host started by an interior host, as the launcher's agent pool sees it.

    Its output lines and its end come from another thread (the interior host's relay reader):
    both are handed to the launch's loop through pipes, read by :meth:`readers` and
    :attr:`exit_fd`, so that the loop calls ``on_line`` itself, as for any agent.
    """

    def __init__(self, hostname: str, index: int) -> None:
        """The stand-in of host ``index``, named ``hostname``; ``on_line`` is set on start."""
        self.hostname = hostname
        self.index = index
        self.on_line: OnLine | None = None
        self._lock = threading.Lock()
        self._lines: collections.deque[tuple[bool, str]] = collections.deque()
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._status: int | None = None
        self.lost = ""
        """Why it ended, when its interior host was lost first (the launch names it so)."""
        self._exit_read, self._exit_write = os.pipe()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._closed = False

    def feed(self, *, is_stderr: bool, text: str) -> None:
        """A line of the child's ``ssh`` client (from any thread)."""
        with self._lock:
            if self._status is not None:
                return
            self._lines.append((is_stderr, text))
            if is_stderr:
                self._tail.append(text)
            self._poke(self._wake_write)

    def end(self, status: int, note: str = "", *, lost: bool = False) -> None:
        """The child ended with ``status`` (from any thread); ``note``: why, if it is known.

        ``lost``: its interior host was lost first; ``note`` is then its error's reason.
        """
        with self._lock:
            if self._status is not None:
                return
            if note:
                self._tail.append(note)
            if lost:
                self.lost = note
            self._status = status
            self._poke(self._exit_write)
            self._poke(self._wake_write)

    def _poke(self, fd: int) -> None:
        if not self._closed:
            with contextlib.suppress(OSError):
                os.write(fd, b"\0")

    @property
    def exit_fd(self) -> int:
        """Readable once the child has ended."""
        return self._exit_read

    def readers(self) -> list[Reader]:
        """One reader: the child's lines, handed to ``on_line`` in the loop."""
        return [(self._wake_read, self._read)]

    def _read(self) -> bool:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(OSError):
                    os.read(self._wake_read, 4096)
            lines, self._lines = list(self._lines), collections.deque()
            ended = self._status is not None
        for is_stderr, text in lines:
            if self.on_line is not None:
                self.on_line(is_stderr, text)
        return not ended

    def stderr_tail(self) -> str:
        """The last lines of the child's ``ssh`` client's stderr, and why it ended if known."""
        with self._lock:
            return "\n".join(self._tail)

    def wait(self, timeout: float | None) -> int | None:
        """Its exit status once it has ended (``None``: not yet, within ``timeout``)."""
        if self._status is None and timeout != 0 and not self._closed:
            with contextlib.suppress(OSError, ValueError):
                select.select([self._exit_read], [], [], timeout)
        return self._status

    def close(self, grace: float = 5.0) -> None:
        """Release the pipes; the child itself ends with its interior host's relay."""
        del grace  # its interior host's relay stops it (its ssh session's stdin closes)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for fd in (self._exit_read, self._exit_write, self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)


class Tree:
    """The tree of one launch: each child's stand-in, and each interior host's events."""

    def __init__(self, radix: int, hostnames: list[str]) -> None:
        """A tree of ``radix`` over ``hostnames`` (the world's hosts, in order; no spare)."""
        self.radix = radix
        self.hostnames = hostnames
        self._lock = threading.Lock()
        self._children: dict[int, TreeChildProcess] = {}

    def is_child(self, index: int) -> bool:
        """Whether host ``index`` is started by another host (not by the launcher).

        The hosts after ``hostnames`` (the spares) are the launcher's to start.
        """
        return index < len(self.hostnames) and tree_parent(index, self.radix) is not None

    def children(self, index: int) -> list[int]:
        """The hosts that host ``index`` starts."""
        return tree_children(index, self.radix, len(self.hostnames))

    def child(self, index: int, on_line: OnLine | None = None) -> TreeChildProcess:
        """The stand-in of host ``index`` (made on first use, by its start or by its parent).

        Raises:
            AgentFailedError: It ended already: a child is not started again (not built yet).
        """
        with self._lock:
            made = self._children.get(index)
            if made is None:
                made = self._children[index] = TreeChildProcess(self.hostnames[index], index)
        if on_line is not None:
            if made.on_line is not None:
                raise AgentFailedError(
                    made.hostname,
                    "its agent cannot be started again: a tree start does not restart the "
                    "hosts an interior host started (not built yet); launch without tree_radix",
                )
            made.on_line = on_line
        return made

    def parent_of(self, index: int) -> int | None:
        """The interior host that started host ``index`` (None: the launcher did)."""
        return tree_parent(index, self.radix) if self.is_child(index) else None

    def silent_through(self, index: int, silent: Collection[int]) -> str | None:
        """Why host ``index`` fell silent, if its interior host fell silent with it, else None.

        A child's connection runs through its interior host's relay: a cut link or a frozen
        interior host silences the whole subtree at once (its SSH session to the launcher does
        not end, so the stand-ins are not told). The children are then named as lost through
        that host, not as unreachable each on its own.
        """
        parent = self.parent_of(index)
        if parent is None or parent not in silent:
            return None
        return (
            f"host {self.hostnames[index]} (host index {index}) was started by interior host "
            f"{self.hostnames[parent]} (host index {parent}), which carries its connection and "
            "fell silent with it: the interior host's link is cut, or it is frozen"
        )

    def silent_subtree(self, index: int, live: Collection[int]) -> str | None:
        """What else an interior host fallen silent takes with it: its ``live`` children.

        Their connections run through it, and the launch's policy drops them with it (named
        here when it is judged, whether or not each child's own silence has been long enough
        yet to be judged too); None for a host that starts none.
        """
        children = [i for i in self.children(index) if i in live]
        if not children:
            return None
        named = ", ".join(f"{self.hostnames[i]} (host index {i})" for i in children)
        return (
            "it is an interior host of the tree: the hosts it started, whose connections run "
            f"through it, are lost with it: {named}"
        )

    def on_tree(self, parent: int) -> OnTree:
        """What the relay of interior host ``parent`` hands its TREE frames to."""
        return lambda data: self._on_event(parent, data)

    def _lost_note(self, index: int, parent: int) -> str:
        return (
            f"host {self.hostnames[index]} (host index {index}) was started by interior host "
            f"{self.hostnames[parent]} (host index {parent}), which was lost: its SSH session "
            "to the launcher ended first"
        )

    def _on_event(self, parent: int, data: bytes | None) -> None:
        mine = self.children(parent)
        if data is None:  # the interior host's stream ended: what is still running is lost
            for index in mine:
                self.child(index).end(LOST_STATUS, self._lost_note(index, parent), lost=True)
            return
        try:
            event = json.loads(data)
            index = int(event["host"])
        except (ValueError, KeyError, TypeError):
            return  # not from the relay of this version: ignored
        if index not in mine:
            return  # another interior host's child: not this relay's to report
        child = self.child(index)
        if "exit" in event:
            status = event["exit"]
            status = status if isinstance(status, int) and not isinstance(status, bool) else 255
            note = (
                f"(host {child.hostname}, host index {index}, was started by interior host "
                f"{self.hostnames[parent]}, host index {parent})"
            )
            child.end(status, note if status else "")
        else:
            child.feed(is_stderr=bool(event.get("err")), text=str(event.get("line", "")))
