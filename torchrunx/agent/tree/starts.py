"""An interior host's children (tree start): where they reach it, and their starts over SSH.

The relay of an interior host (:mod:`torchrunx.agent.relay`) makes, before it starts anything:

- each child's **route**: this host's address on its route to the child (:func:`child_routes`,
  from the child's ``HostName`` as ``ssh -G`` reads the launch's config);
- one **listening socket per route address** (:func:`child_listeners`), bound to that address
  only (never to every interface): the children's agents and workers connect there, and the
  relay carries each connection to the launcher as a channel. Its own agent connects on
  ``127.0.0.1``, on a socket of its own;

then a :class:`TreeStarts`, which starts each child with OpenSSH's ``ssh`` client, told to
connect back to its route's socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shutil
import socket
import subprocess
import threading
import time
from typing import TYPE_CHECKING

from torchrunx.wire.bootstrap import AGENT_COMMAND, AgentBootstrap, TreeChild

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

TREE_CONNECT_TIMEOUT = 30
"""``ConnectTimeout`` of the ``ssh`` clients that start a tree start's children."""
RESOLVE_TIMEOUT = 10.0
"""Seconds ``ssh -G`` gets to print a child's configuration."""
RESOLVE_AT_ONCE = 16
"""The most ``ssh -G`` an interior relay runs at once."""
LOOPBACK = "127.0.0.1"


def ssh_argv(config: str, hostname: str, *, resolve: bool = False) -> list[str]:
    """The ``ssh`` command line that starts ``hostname``'s agent (``resolve``: ``ssh -G``).

    ``config``: the ``ssh -F`` file (``""``: ssh's own default).
    """
    ssh = shutil.which("ssh") or "ssh"
    chosen = ["-F", config] if config else []
    if resolve:
        return [ssh, "-G", *chosen, "--", hostname]
    options = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={TREE_CONNECT_TIMEOUT}"]
    return [ssh, "-T", *chosen, *options, "--", hostname, AGENT_COMMAND]


def ssh_target(hostname: str, config: str) -> str:
    """The address ``ssh`` connects to for ``hostname``: its ``HostName`` (else the name)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        shown = subprocess.run(
            ssh_argv(config, hostname, resolve=True),
            capture_output=True,
            timeout=RESOLVE_TIMEOUT,
            check=False,
        ).stdout.decode(errors="replace")
        for line in shown.splitlines():
            key, _, value = line.partition(" ")
            if key == "hostname" and value:
                return value
    return hostname


def child_routes(
    children: Iterable[TreeChild], config: str, route: Callable[[tuple[str, int]], str]
) -> dict[int, str]:
    """Each child's host index, and this host's address on its route to that child.

    ``route``: this host's address on its route to an address and port (the relay's
    ``own_address``), asked of the child's ``ssh`` target at port 22. The children's ``ssh -G``
    run at once (up to :data:`RESOLVE_AT_ONCE`), not one after the other: the last child's
    start waits for every resolve before it.
    """
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 (interior relays only)

    chosen = list(children)
    if not chosen:
        return {}
    with ThreadPoolExecutor(min(RESOLVE_AT_ONCE, len(chosen))) as pool:
        targets = list(pool.map(lambda c: ssh_target(c.hostname, config), chosen))
    return {c.host_index: route((t, 22)) for c, t in zip(chosen, targets, strict=True)}


def child_listeners(addresses: Iterable[str]) -> dict[str, socket.socket]:
    """A listening socket (ephemeral port) on each address, and on ``127.0.0.1`` in any case.

    Each is bound to its address only: a child reaches this host on its route's address, and
    nothing listens on the other interfaces.

    Raises:
        OSError: An address cannot be listened on.
    """
    listeners: dict[str, socket.socket] = {}
    try:
        for address in [LOOPBACK, *addresses]:
            if address not in listeners:
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                listeners[address] = socket.create_server((address, 0), family=family, backlog=4096)
    except OSError:
        for made in listeners.values():
            made.close()
        raise
    return listeners


class TreeStarts:
    """The hosts a relay starts in a tree start, each with OpenSSH's ``ssh`` client.

    One thread per child starts its client, writes the child's script and bootstrap line to
    its stdin (kept open: the child's agent stops when it closes), and reads its output. Its
    lines and its end are written as JSON lines to a pipe (:attr:`read_fd`) that the relay
    sends on as TREE frames; the pipe ends once every child has ended.
    """

    def __init__(
        self, boot: AgentBootstrap, routes: Mapping[int, tuple[str, int]], grace: float
    ) -> None:
        """Start the children of ``boot`` (its ``tree``).

        ``routes``: each child's host index, and the address and port it connects to here;
        ``grace``: the seconds the ``ssh`` clients get after :meth:`stop`, then SIGKILL.
        """
        self.children: tuple[TreeChild, ...] = boot.tree
        self._routes = dict(routes)
        self._grace = grace
        self._script = boot.tree_script.encode(errors="surrogateescape") + b"\0"
        self._config = boot.tree_ssh_config
        self._base = dataclasses.replace(
            boot, relay="", tree=(), tree_script="", tree_ssh_config=""
        )
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self._lock = threading.Lock()
        self._left = len(self.children)
        self._clients: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping_since: float | None = None
        if not self.children:
            os.close(self._write_fd)
        for child in self.children:
            threading.Thread(
                target=self._run, args=(child,), name=f"tree-{child.host_index}", daemon=True
            ).start()

    def _emit(self, event: dict[str, object]) -> None:
        data = json.dumps(event).encode() + b"\n"
        with self._lock, contextlib.suppress(OSError):
            view = memoryview(data)
            while view:
                view = view[os.write(self._write_fd, view) :]

    def _run(self, child: TreeChild) -> None:
        index = child.host_index
        status = 255
        try:
            status = self._start_and_read(child)
        except Exception as exc:  # noqa: BLE001 (any failure is this child's, and said)
            self._emit({"host": index, "err": True, "line": f"torchrunx tree: {exc!r}"})
        finally:
            self._emit({"host": index, "exit": status})
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    os.close(self._write_fd)

    def _start_and_read(self, child: TreeChild) -> int:
        address, port = self._routes[child.host_index]
        line = dataclasses.replace(
            self._base,
            host_index=child.host_index,
            hostname=child.hostname,
            workers=child.workers,
            launcher_address=address,
            launcher_port=port,
        ).to_json_line()
        with self._lock:
            if self.stopping_since is not None:
                return 143  # stopped before it started
            client = subprocess.Popen(
                ssh_argv(self._config, child.hostname),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            self._clients[child.host_index] = client
        assert client.stdin is not None  # noqa: S101 (started with pipes)
        with contextlib.suppress(OSError):
            client.stdin.write(self._script + line)
            client.stdin.flush()
        del line
        self._read(child.host_index, client)
        code = client.wait()
        return code if code >= 0 else 128 - code

    def _read(self, index: int, client: subprocess.Popen[bytes]) -> None:
        """Pass on the client's stdout and stderr, line by line, until both end."""
        assert client.stdout is not None  # noqa: S101 (started with pipes)
        assert client.stderr is not None  # noqa: S101
        streams = {client.stdout.fileno(): False, client.stderr.fileno(): True}
        partial = dict.fromkeys(streams, b"")
        while streams:
            for fd in select.select(list(streams), [], [])[0]:
                chunk = os.read(fd, 65536)
                *lines, partial[fd] = (partial[fd] + chunk).split(b"\n")
                lines += [partial[fd]] if not chunk and partial[fd] else []
                for text in lines:
                    line = text.decode(errors="replace")
                    self._emit({"host": index, "err": streams[fd], "line": line})
                if not chunk:
                    del streams[fd]

    def stop(self) -> None:
        """Close every child's stdin: their agents stop, as at the end of an SSH session."""
        with self._lock:
            if self.stopping_since is None:
                self.stopping_since = time.monotonic()
            clients = list(self._clients.values())
        for client in clients:
            if client.stdin is not None:
                with contextlib.suppress(OSError):
                    client.stdin.close()

    def check_deadline(self) -> None:
        """SIGKILL the ``ssh`` clients still running ``grace`` seconds after :meth:`stop`."""
        since = self.stopping_since
        if since is None or time.monotonic() - since <= self._grace:
            return
        with self._lock:
            clients = list(self._clients.values())
        for client in clients:
            with contextlib.suppress(ProcessLookupError):
                client.kill()
