"""Starting an agent: the agent command, its script, and agent processes behind a local command.

A local subprocess (:class:`LocalAgent`), or a local command that relays the agent to its host
(:class:`CommandAgent`: ``srun``, ``kubectl exec -i``, OpenSSH's ``ssh``); over paramiko's SSH
it is :mod:`torchrunx.engines.ssh`. Also why an agent ended (:func:`agent_exit_error`), for
every transport. All start the same constant command, which reads everything else from its stdin::

    bash --noprofile --norc -c 'IFS= read -r -d "" s && eval "$s"'
        stdin: export VAR=value ...; cd CWD && source ENV_FILE && { PYTHONPATH less CWD } &&
                   PYTHONSAFEPATH=... PYTHONPATH=... exec PYTHON -u -c BOOT <NUL>
               {"secret": ..., "launcher": [...], ...}<newline>       (read by BOOT)

so environment values and the launch secret never appear on a command line (``ps`` shows
only the constant command and the boot code). The script is built by a pure function in
which every value is ``shlex.quote``-d; nothing is imported from the working folder before
the boot code runs (:data:`torchrunx.wire.bootstrap.SAFE_START`). stdin then stays open: the
agent treats its EOF as "the launcher is gone".
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import logging
import math
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torchrunx.engines.relay import Adopt, LauncherRelay, OnTree
from torchrunx.engines.ship import read_fd, write_within
from torchrunx.errors import AgentFailedError, ShipError, describe_exit
from torchrunx.wire.bootstrap import AGENT_COMMAND, BOOT_CODE, PYTHONPATH_WITHOUT_CWD, SAFE_START
from torchrunx.wire.lines import LineSplitter, cut_line, parse_line
from torchrunx.wire.relay import MAX_DATA, PIPE_SIZE

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from torchrunx.engines.protocol import OnLine, Reader
    from torchrunx.engines.ship import Bundle

logger = logging.getLogger("torchrunx.transport")


def remote_command(container: Sequence[str] = ()) -> str:
    """:data:`AGENT_COMMAND`, run by ``container`` (``podman exec -i NAME``...) if given."""
    return f"{shlex.join(container)} {AGENT_COMMAND}" if container else AGENT_COMMAND


_STDERR_TAIL_LINES = 40


def agent_script(  # noqa: PLR0913 (what the script holds)
    *,
    env: dict[str, str],
    cwd: str,
    python: str,
    env_file: str | None,
    code: str = BOOT_CODE,
    ship: str | None = None,
) -> bytes:
    """The shell script (one NUL-terminated string) that the agent command evaluates.

    Forwarded variables are exported first; then the interpreter is checked (a missing one
    ends the script with status 127 and says which option names another); then, with ``ship``
    (a shipped tree's digest, :mod:`torchrunx.engines.ship`), the code is fetched into the
    host's cache by :mod:`torchrunx.agent.unpack` and its copy is the working directory instead
    of ``cwd``; then ``env_file`` is sourced (so it can extend or override the variables); then
    the interpreter replaces the shell, running ``code`` (the agent's boot code; ``torchrunx
    check`` gives its probe's), started so that it imports nothing from the working folder.
    """
    parts: list[str] = []
    if env:
        exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in sorted(env.items()))
        parts.append(f"export {exports}")
    py = shlex.quote(python)
    missing = shlex.quote(MISSING_PYTHON.format(python=python))
    parts.append(f"command -v {py} >/dev/null || {{ echo {missing} >&2; exit 127; }}")
    if ship is None:
        where = shlex.quote(MISSING_CWD.format(cwd=cwd))
        parts.append(f"cd {shlex.quote(cwd)} || {{ echo {where} >&2; exit 1; }}")
        steps = []
    else:
        parts.append(f"{_CACHE_VARIABLE}={_CACHE_DIR}")
        # The source in a variable: were the step killed, bash would print its command line.
        parts.append(f"_torchrunx_unpack={shlex.quote(unpack_source())}")
        killed = shlex.quote(UNPACK_KILLED)
        unpack = f'{py} -I -S -c "$_torchrunx_unpack" "${_CACHE_VARIABLE}" {ship}'
        on_signal = f"[ $s -gt 128 ] && echo {killed}$((s - 128)) >&2"
        steps = [
            f"{{ {unpack} || {{ s=$?; {on_signal}; exit $s; }}; }}",
            f'cd "${_CACHE_VARIABLE}/trees/{ship}"',
        ]
    if env_file is not None:
        steps.append(f"source {shlex.quote(env_file)}")
    steps.append(PYTHONPATH_WITHOUT_CWD)
    steps.append(f"{SAFE_START} exec {py} -u -c {shlex.quote(code)}")
    parts.append(" && ".join(steps))
    return ("; ".join(parts)).encode() + b"\0"


MISSING_PYTHON = (
    "torchrunx: no Python interpreter {python} on this host: install it there, or name this "
    "host's own with Launcher(python=...) (--python PATH)"
)
"""What a host without the agent's interpreter says (its script then exits with 127)."""
MISSING_CWD = (
    "torchrunx: the working directory {cwd} is not on this host: launch from a folder it "
    "shares, or send the code with Launcher(ship=('.',)) (--ship .)"
)
"""What a host without the launcher's working directory says (its script then exits with 1)."""
UNPACK_KILLED = "torchrunx: the step that unpacks the shipped code was killed by signal "
"""What a host says when its unpack step is killed (the signal's number follows)."""
_CACHE_VARIABLE = "_torchrunx_code"
_CACHE_DIR = '"${TORCHRUNX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/torchrunx}/code"'
"""Where a host keeps shipped code: private to its user (see :mod:`torchrunx.agent.unpack`)."""


@functools.cache
def unpack_source() -> str:
    """The source of :mod:`torchrunx.agent.unpack`, which a host runs before it has torchrunx."""
    return (Path(__file__).parent.parent / "agent" / "unpack.py").read_text()


def agent_exit_error(  # noqa: PLR0913 (what is known about the end)
    hostname: str,
    status: int | None,
    *,
    remote: bool,
    connected: bool,
    env_file: str | None,
    stderr_tail: str,
    python: str | None = None,
) -> AgentFailedError:
    """An agent that ended without saying it was done; ``python``: what python= named for it."""
    if status == 127 and python is not None and remote:
        reason = (
            "the agent could not start (exit status 127): a command it needs is missing on "
            f"that host (its message is below); it ran {python}, the interpreter "
            "Launcher(python=...) names for it: check that path on that host"
        )
    elif status == 127:
        reason = (
            "the agent could not start (exit status 127): a command it needs is missing on "
            f"that host (its message is below); it ran the launcher's interpreter "
            f"({sys.executable}): name that host's own with Launcher(python=...), and send the "
            "project's code with Launcher(ship=...) if the host does not share your files"
        )
    elif "No module named 'torchrunx'" in stderr_tail:
        reason = (
            f"the agent could not start (exit status {status}): torchrunx is not importable on "
            "that host; send it with Launcher(ship=...) (torchrunx travels with shipped code), "
            "install it in the host's interpreter (Launcher(python=...)), or launch from a "
            "filesystem the host shares"
        )
    elif status is not None and status < 0 and remote:
        reason = "the agent ended without an exit status (killed by a signal, or SSH dropped)"
    elif status is not None and status < 0:
        reason = f"the agent process ended with {describe_exit(None, -status)}"
    else:
        reason = f"the agent process ended unexpectedly (exit status {status})"
        if not connected and env_file is not None:
            reason += (
                f" before it connected; env_file {env_file!r} is sourced first: did it fail? "
                "(its output, if any, is below)"
            )
    return AgentFailedError(hostname, reason, stderr_tail)


READS_PER_CALL = 16
"""Reads one reader call does at most, so that one chatty agent cannot hold up the loop."""


class AgentOutput:
    """An agent's stdout and stderr as whole lines, handed on; keeps the stderr tail."""

    def __init__(self, on_line: OnLine) -> None:
        """Hand each whole line to ``on_line``."""
        self.on_line = on_line
        self.splitters = {False: LineSplitter(), True: LineSplitter()}
        self.tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self.ended = {False: False, True: False}

    def feed(self, chunk: bytes, *, is_stderr: bool) -> None:
        """Hand on the whole lines in ``chunk``; ``b""`` ends the stream (and its last line)."""
        if self.ended[is_stderr]:
            return
        for line in self.splitters[is_stderr].feed(chunk):
            if is_stderr:
                text = parse_line(line, is_stderr=True, default_name="agent").text
                self.tail.append(cut_line(text))  # the error keeps a bounded tail
            self.on_line(is_stderr, line)
        if not chunk:
            self.ended[is_stderr] = True

    @property
    def done(self) -> bool:
        """Whether both streams have ended."""
        return self.ended[False] and self.ended[True]


def drain(readers: list[Reader], timeout: float) -> None:
    """Read ``readers`` until each has ended, or for ``timeout`` seconds at most."""
    deadline = time.monotonic() + timeout
    live = dict(readers)
    while live:
        for fd in [fd for fd, read in live.items() if not read()]:
            del live[fd]
        left = deadline - time.monotonic()
        if not live or left <= 0:
            return
        poller = select.poll()
        for fd in live:
            poller.register(fd, select.POLLIN)
        poller.poll(math.ceil(min(left, 0.05) * 1000))


_TERM_GRACE = 3.0
"""Seconds a relaying command gets after SIGTERM before SIGKILL."""


AGENT_ARGV = ("bash", "--noprofile", "--norc", "-c", 'IFS= read -r -d "" s && eval "$s"')
""":data:`AGENT_COMMAND` as an argument vector."""


class PipeReaders:
    """An agent's stdout and stderr read from two non-blocking pipes, as whole lines.

    Its owner sets ``_output`` and ``_streams`` (``False``: stdout's read end, ``True``:
    stderr's): a local child's pipes, or those a relay thread writes (Ray).
    """

    _output: AgentOutput
    _streams: dict[bool, int]
    _relay: LauncherRelay | None = None

    def readers(self) -> list[Reader]:
        """The agent's stdout and stderr pipes, while they are open."""
        return [
            (fd, functools.partial(self._read, fd, is_stderr=is_stderr))
            for is_stderr, fd in self._streams.items()
            if not self._output.ended[is_stderr]
        ]

    def _read(self, fd: int, *, is_stderr: bool) -> bool:
        for _ in range(READS_PER_CALL):
            try:
                chunk = os.read(fd, 65536)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                chunk = b""
            self._output.feed(chunk, is_stderr=is_stderr)
            if not chunk:
                return False
        return True

    def stderr_tail(self) -> str:
        """The last lines the agent wrote to stderr (read for up to 0.5 s more).

        A relaying host whose stream was broken ends with why (what its stdout began with).
        """
        drain(self.readers(), 0.5)
        tail = list(self._output.tail)
        if self._relay is not None and self._relay.broken is not None:
            tail.append(f"torchrunx: {self._relay.broken}")
        return "\n".join(tail)


class CommandAgent(PipeReaders):
    """An agent behind a local child process: the agent itself, or a command that relays it.

    ``srun``, ``kubectl exec -i`` and ``docker exec -i`` relay their stdin, stdout and stderr to
    a process elsewhere: started with :data:`AGENT_ARGV` at the end of their command line, the
    agent behaves as over SSH. :meth:`close` closes stdin (the agent stops), then SIGTERMs and
    SIGKILLs the command (not its process group) if it has not ended.
    """

    def __init__(  # noqa: PLR0913, PLR0917 (what a start needs)
        self,
        hostname: str,
        argv: list[str],
        env: dict[str, str],
        script: bytes,
        bootstrap: Callable[[], bytes],
        on_line: OnLine,
        relay: Adopt | None = None,
        ship: Bundle | None = None,
        on_tree: OnTree | None = None,
    ) -> None:
        """Start ``argv``; write ``script`` and then what ``bootstrap()`` makes to its stdin.

        The bootstrap line (it holds the secret) is made only once the child has started, as
        it is written, and never held in a variable: no frame of a traceback shows it.
        ``relay``: the host relays (:mod:`torchrunx.engines.relay`); its channels go to it.
        ``ship``: the code shipped to the host, exchanged between the script and the bootstrap.
        ``on_tree``: an interior host of a tree start: its relay's TREE frames go to it.

        Raises:
            AgentFailedError: The command cannot be started, or the code not shipped.
        """
        self.hostname = hostname
        self._output = AgentOutput(on_line)
        try:
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C in the terminal reaches the launcher only
                env=env,
            )
        except OSError as exc:
            raise AgentFailedError(hostname, f"cannot start the agent ({argv[0]}): {exc}") from exc
        # Readable once the child has ended: waits wake at its exit, not at the next poll
        # (Popen.wait with a timeout polls, up to 50 ms late).
        try:
            self._pidfd = os.pidfd_open(self._process.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3, or out of descriptors: wait polls
            self._pidfd = -1
        self._pidfd_lock = threading.Lock()
        assert self._process.stdin is not None  # noqa: S101 (Popen with PIPE)
        assert self._process.stdout is not None  # noqa: S101
        assert self._process.stderr is not None  # noqa: S101
        self._streams = {False: self._process.stdout.fileno(), True: self._process.stderr.fileno()}
        for fd in self._streams.values():
            os.set_blocking(fd, False)
        stdin = self._process.stdin
        leftover = b""
        try:
            stdin.write(script)
            stdin.flush()
            if ship is not None:
                leftover = ship.exchange(
                    hostname, read_fd(self._streams[False]), functools.partial(write_within, stdin)
                )
            stdin.write(bootstrap())
            stdin.flush()
        except OSError:
            pass  # it died at once; wait() and stderr_tail() tell why
        except ShipError as exc:
            self._fail_start(f"the shipped code did not reach the host: {exc}")
        self._relay = None
        if relay is not None:
            # The relay's frames come on stdout: a thread of the relay reads it (blocking), and
            # the loop reads the agent's own stdout from the relay's pipe instead.
            stdout, stdin_fd = self._streams[False], self._process.stdin.fileno()
            os.set_blocking(stdout, True)
            for fd in (stdout, stdin_fd):
                with contextlib.suppress(OSError):  # fewer, larger reads and writes
                    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            self._relay = LauncherRelay(
                hostname,
                read_out=lambda: os.read(stdout, MAX_DATA),
                write_in=functools.partial(write_all, stdin_fd),
                close_in=self._process.stdin.close,
                adopt=relay,
                initial=leftover,
                on_tree=on_tree,
            )
            self._streams = {False: self._relay.out_read, True: self._streams[True]}
        elif leftover:
            self._output.feed(leftover, is_stderr=False)

    def _fail_start(self, reason: str) -> None:
        """End the command (it has not started the agent) and raise ``reason`` with its stderr.

        Raises:
            AgentFailedError: Always.
        """
        tail = self.stderr_tail()
        self.close(grace=1.0)
        raise AgentFailedError(self.hostname, reason, tail)

    @property
    def pid(self) -> int:
        """Pid of the child process (the agent, or srun)."""
        return self._process.pid

    @property
    def exit_fd(self) -> int:
        """The child's pidfd (readable once it has ended), or -1 without one."""
        return self._pidfd

    def wait(self, timeout: float | None) -> int | None:
        """Wait for the child to end; its exit status, or ``None`` if still running."""
        with self._pidfd_lock:  # a waiter polls its own copy: _release may close the original
            pidfd = os.dup(self._pidfd) if self._pidfd >= 0 else -1
        if pidfd < 0:
            try:
                return self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        try:
            if self._process.returncode is None and not _readable(pidfd, timeout):
                return None
        finally:
            os.close(pidfd)
        return self._process.wait()  # it has ended: returns at once

    def close(self, grace: float = 5.0) -> None:
        """Close stdin (the agent stops on EOF); then SIGTERM the command, then SIGKILL it.

        SIGTERM (``srun`` passes it on to the step's task) and SIGKILL come only if the agent
        has not ended. A lost agent (``grace=0``) is not waited for: it stops its workers by
        itself once ``agent_timeout`` passes without a heartbeat.
        """
        self._close_stdin()
        if grace > 0 and self.wait(grace) is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signal.SIGTERM)
            self.wait(_TERM_GRACE)
        if self.wait(0) is None:
            # The command alone, not its process group: srun's helper child then cancels
            # the step (killing the whole group would leave it running until the job ends).
            self._kill(group=False)
        self._release()

    def _close_stdin(self) -> None:
        if self._relay is not None:
            self._relay.stop()
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()

    def _kill(self, *, group: bool = True) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self._process.pid, signal.SIGKILL)
            else:
                os.kill(self._process.pid, signal.SIGKILL)
        self._process.wait()

    def _release(self) -> None:
        if self._relay is not None:
            self._relay.join(2.0)
        drain(self.readers(), 2.0)  # its last lines (a child it left may keep a pipe open)
        if self._relay is not None:
            self._relay.close_output()
        for stream in (self._process.stdout, self._process.stderr):
            if stream is not None:
                stream.close()
        with self._pidfd_lock:
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the blocking descriptor ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` becomes readable within ``timeout`` seconds (``None``: no limit)."""
    poller = select.poll()  # not select(): the launcher may hold more than 1024 descriptors
    poller.register(fd, select.POLLIN)
    # Python retries a poll interrupted by a signal with the time left (PEP 475).
    return bool(poller.poll(None if timeout is None else math.ceil(max(timeout, 0.0) * 1000)))


class LocalAgent(CommandAgent):
    """An agent on this machine: a plain subprocess in its own session (no SSH)."""

    def __init__(
        self,
        hostname: str,
        script: bytes,
        bootstrap: Callable[[], bytes],
        on_line: OnLine,
        *,
        environ: dict[str, str],
    ) -> None:
        """Start the agent and hand it its script and bootstrap (made by ``bootstrap()``) on stdin.

        ``environ`` is the agent's environment before its script runs (the launcher's own,
        see :func:`torchrunx.env.local_agent_env`).

        Raises:
            AgentFailedError: bash cannot be started.
        """
        super().__init__(hostname, list(AGENT_ARGV), environ, script, bootstrap, on_line)

    def close(self, grace: float = 5.0) -> None:
        """Close stdin (the agent stops on EOF), then SIGKILL it if it has not ended in time."""
        self._close_stdin()
        if self.wait(grace) is None:
            self._kill()
        self._release()


def route_address(hostname: str) -> str:
    """This machine's address on the route to ``hostname`` (no packet is sent).

    Raises:
        OSError: ``hostname`` cannot be resolved or there is no route to it.
    """
    infos = socket.getaddrinfo(hostname, 9, proto=socket.IPPROTO_UDP)
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0]).removeprefix("::ffff:")
