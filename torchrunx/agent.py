"""The agent: one per host; forks the workers, watches them, and obeys the launcher.

Process tree on one host::

    agent  (python -c BOOT, started by bash over SSH or as a local subprocess)
    ├── guardian              (forked first; kills the workers' process groups if the agent dies)
    ├── worker local_rank 0   (forked; own session and process group; PDEATHSIG=SIGKILL)
    ├── worker local_rank 1
    └── ...

Sequence: fork the guardian; connect to the launcher and authenticate; send
:class:`AgentHello` (slots, GPUs, a free port); import torch in a background thread meanwhile
(once per host, never touching CUDA) while heartbeats go on; receive the :class:`WorkerSpec` with
the pickled call as payload; fork the workers; then loop on one selector over the launcher
connection, stdin, one pidfd per worker (so a death is reported the moment it happens), the
worker's stdout and stderr pipes (forwarded as :class:`LogLines`, see :mod:`torchrunx.logs`)
and one stack pipe per worker. The agent's own ``logging`` records go on the launcher
connection too (:class:`_ToLauncher`), so "worker N exited" never overtakes that worker's
output. The agent is single-threaded when it forks (the preload thread has been joined) and
ends when its workers have ended.

Stopping: on :class:`Stop` (or when the launcher connection or stdin closes, or no heartbeat
arrived for ``agent_timeout`` seconds) the agent optionally asks each live worker for its
Python stacks (SIGUSR1, written by ``faulthandler`` into the worker's stack pipe) and sends
them as :class:`WorkerStacks`, then sends SIGTERM to every worker's process group and SIGKILL
after the grace period.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import select
import selectors
import signal
import socket
import struct
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from torchrunx import protocol, timer
from torchrunx.errors import ProtocolError
from torchrunx.hosts import count_local_cpus, count_local_gpus
from torchrunx.logs import LineSplitter, capture_logging, parse_line
from torchrunx.protocol import (
    AgentDone,
    AgentHello,
    Connection,
    Heartbeat,
    LogLines,
    Stop,
    WorkerExited,
    WorkersEnded,
    WorkerSpec,
    WorkersStarted,
    WorkerStacks,
    WorkerTimedOut,
    encode_frame_start,
)

if TYPE_CHECKING:
    import mmap

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_DRAIN_WAIT = 1.0
_SEND_CHUNK = 1 << 20
_OUTBOX_HIGH = 16 << 20  # stop reading workers' output above this much unsent data
_OUTBOX_LOW = 1 << 20  # and resume below this
_STACK_DUMP_WAIT = 0.5
_STACK_SETTLE = 0.05
_STACK_BYTES = 16 * 1024
_DEFAULT_GRACE = 3.0
_PGID = struct.Struct("!i")
_TIMER_POLL = 0.1


@dataclass
class _Output:
    """One of a worker's output pipes (stdout or stderr), read by the agent."""

    fd: int
    is_stderr: bool
    splitter: LineSplitter = field(default_factory=LineSplitter)


@dataclass
class _Worker:
    local_rank: int
    pid: int
    pidfd: int
    stack_fd: int
    outputs: list[_Output]
    page: mmap.mmap
    """Shared with the worker: its watchdog deadline (see :mod:`torchrunx.timer`)."""
    stacks: bytearray = field(default_factory=bytearray)
    ended: bool = False
    hung: tuple[str, float, float] | None = None
    """A watchdog scope that expired: (scope, limit, report its stack by this time)."""
    hang_reported: bool = False
    signalled: bool = False
    """The agent sent it SIGTERM or SIGKILL (a stop): its end is not a failure of its own."""


class _Guardian:
    """A small process that kills the workers' process groups if the agent dies.

    Workers die with their agent by PDEATHSIG, but whatever they started would not: the
    guardian is told each worker's process group and, when the agent's end of its pipe
    closes (however the agent ended), sends SIGKILL to every one of them.
    """

    def __init__(self) -> None:
        read_end, self.fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.fd)
            _guard(read_end)
        os.close(read_end)

    def watch(self, pgid: int) -> None:
        os.write(self.fd, _PGID.pack(pgid))

    def forget(self, pgid: int) -> None:
        """The group's leader was reaped: its id may be reused, never signal it."""
        os.write(self.fd, _PGID.pack(-pgid))

    def close(self) -> None:
        os.close(self.fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _guard(fd: int) -> NoReturn:
    try:
        os.setsid()  # outside the agent's process group: survives a kill of that group
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for std in (0, 1, 2):  # hold none of the agent's pipes open
            os.dup2(devnull, std)
        groups: set[int] = set()
        pending = b""
        while chunk := os.read(fd, 4096):
            pending += chunk
            whole = len(pending) - len(pending) % _PGID.size
            for (pgid,) in _PGID.iter_unpack(pending[:whole]):
                if pgid > 0:
                    groups.add(pgid)
                else:
                    groups.discard(-pgid)
            pending = pending[whole:]
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    finally:
        os._exit(0)


class _ToLauncher(logging.Handler):
    """Sends the agent's own records on its connection, in order with its workers' output.

    On stderr they would travel apart from the workers' lines (a pipe or SSH channel read
    by another thread of the launcher), so "worker 0 exited" could overtake the worker's last
    lines. Records of other threads, of forked children, or after the launcher is gone go
    to ``fallback`` (stderr) instead.
    """

    def __init__(self, agent: Agent, fallback: logging.Handler) -> None:
        super().__init__()
        self.agent = agent
        self.fallback = fallback
        self.pid = os.getpid()
        self.setFormatter(logging.Formatter())

    def emit(self, record: logging.LogRecord) -> None:
        """Queue the record as a :class:`LogLines` entry with no local rank (the agent's)."""
        agent = self.agent
        if (
            os.getpid() != self.pid
            or threading.current_thread() is not threading.main_thread()
            or not agent.launcher_alive
            or agent.closed
        ):
            self.fallback.handle(record)
            return
        try:
            agent.send_record(record.levelno, record.name, self.format(record), record.created)
        except Exception:  # noqa: BLE001 (logging's contract: a handler reports, never raises)
            self.handleError(record)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _preload_torch(enabled: bool, done_fd: int, tid: list[int]) -> None:
    # Importing torch.distributed does not initialise CUDA; forked workers inherit the modules.
    tid.append(threading.get_native_id())
    try:
        if enabled:
            with contextlib.suppress(ImportError), warnings.catch_warnings():
                # torch's import warns where numpy is missing; torchrunx does not need it,
                # and the agent's import is ours, not the user's.
                warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
                import torch.distributed  # noqa: F401, PLC0415
    finally:
        os.write(done_fd, b"1")


def _wait_for_thread_exit(tid: list[int], limit: float = 2.0) -> None:
    """Wait until the preload thread's OS thread is gone, not only its Python side.

    ``Thread.join`` returns before the thread's C-level destructors have run; MKL's run under
    a lock of its own. A worker forked meanwhile inherits that lock held, and its first matrix
    product spins forever in ``mm_account_ptr_by_tid`` (seen with gdb, about once in 20
    launches). No event tells when a thread has left the kernel, so this looks at
    ``/proc/self/task`` every millisecond, for at most ``limit`` seconds.
    """
    if not tid:
        return
    task = f"/proc/self/task/{tid[0]}"
    deadline = time.monotonic() + limit
    while os.path.exists(task) and time.monotonic() < deadline:  # noqa: PTH110 (hot, tiny)
        time.sleep(0.001)


class Agent:
    """The live agent of one host (created by :func:`main`)."""

    def __init__(self, boot: dict[str, Any], connection: Connection, guardian: _Guardian) -> None:
        """Keep the bootstrap settings, the launcher connection and the guardian."""
        self.boot = boot
        self.conn = connection
        self.guardian = guardian
        self.selector = selectors.DefaultSelector()
        self.workers: list[_Worker] = []
        self.heartbeat_interval = float(boot["heartbeat_interval"])
        self.agent_timeout = float(boot["agent_timeout"])
        self.last_heard = time.monotonic()
        self.next_heartbeat = time.monotonic()
        self.dump_deadline: float | None = None
        self.grace_period = _DEFAULT_GRACE
        self.stop_deadline: float | None = None
        self.stopping = False
        self.restart_requested = False
        self.final_stop = False
        """Told to stop for good (a Stop without restart, EOF, or a silent launcher)."""
        self.attempt = -1
        """The attempt of the workers last started."""
        self.preloaded = False
        self.next_timer_poll = 0.0
        self.launcher_alive = True
        self.closed = False
        self.conn.sock.settimeout(self.agent_timeout)
        self.outbox = bytearray()
        self.output_paused = False
        self.selector.register(self.conn.sock, selectors.EVENT_READ, "launcher")
        self.selector.register(0, selectors.EVENT_READ, "stdin")

    def forward_logging(self) -> None:
        """From now on, send this process's ``logging`` records on the launcher connection."""
        root = logging.getLogger()
        fallback = root.handlers[0] if root.handlers else logging.StreamHandler(sys.stderr)
        root.handlers[:] = [_ToLauncher(self, fallback)]

    def send_record(self, levelno: int, name: str, text: str, created: float) -> None:
        """Send one of the agent's own records (no local rank) after what is already queued."""
        self._send(LogLines(((None, levelno, name, text, created),)))

    # -- start ---------------------------------------------------------------------------

    def receive_spec(self) -> tuple[WorkerSpec, list[bytearray]] | None:
        """Wait for the worker spec and the torch preload, heartbeats going on meanwhile.

        Returns ``None`` if told to stop first.
        """
        # The preload thread writes to this pipe when done, so one selector waits for it,
        # the launcher and stdin alike.
        done_read, done_write = os.pipe()
        tid: list[int] = []
        preload = threading.Thread(
            target=_preload_torch,
            args=(bool(self.boot["preload_torch"]) and not self.preloaded, done_write, tid),
            name="torchrunx-preload",
        )
        preload.start()
        self.selector.register(done_read, selectors.EVENT_READ, "preloaded")
        received: tuple[WorkerSpec, list[bytearray]] | None = None
        preloaded = False
        try:
            while not self.stopping and (received is None or not preloaded):
                self._keep_alive(time.monotonic())
                for key, events in self.selector.select(self._until_next_timer(time.monotonic())):
                    if key.data == "launcher" and events & selectors.EVENT_WRITE:
                        self._flush_outbox()
                    if key.data == "launcher" and events & selectors.EVENT_READ:
                        message, payload = self._recv()
                        if isinstance(message, WorkerSpec):
                            received = (message, payload)
                        elif isinstance(message, Stop) and message.restart:
                            # No workers run here: ready at once. A spec that came before
                            # this Stop belongs to the attempt being abandoned.
                            received = None
                            self._send(WorkersEnded(_free_port(), message.attempt))
                        else:
                            self._on_message(message)
                    elif key.data == "stdin":
                        self._on_stdin()
                    elif key.data == "preloaded":
                        preloaded = True
                        self.selector.unregister(done_read)  # else it stays readable: a spin
        finally:
            preload.join()
            _wait_for_thread_exit(tid)
            self.preloaded = True
            with contextlib.suppress(KeyError):
                self.selector.unregister(done_read)
            os.close(done_read)
            os.close(done_write)
        return None if self.stopping else received

    def start_workers(self, spec: WorkerSpec, payload: list[bytearray]) -> None:
        """Fork ``spec.num_workers`` workers and register their pidfds and stack pipes."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.attempt = spec.attempt
        for local_rank in range(spec.num_workers):
            stack_read, stack_write = os.pipe()
            out_read, out_write = os.pipe()
            err_read, err_write = os.pipe()
            page = timer.new_page()
            pid = os.fork()
            if pid == 0:
                for fd in (stack_read, out_read, err_read):
                    os.close(fd)
                os.dup2(out_write, 1)  # descriptor level: C code and child processes too
                os.dup2(err_write, 2)
                os.close(out_write)
                os.close(err_write)
                timer.attach(page)
                self._become_worker(spec, payload, local_rank, stack_write)
            for fd in (stack_write, out_write, err_write):
                os.close(fd)
            self.guardian.watch(pid)  # the worker's process group id is its pid (setsid)
            outputs = [_Output(out_read, is_stderr=False), _Output(err_read, is_stderr=True)]
            worker = _Worker(local_rank, pid, os.pidfd_open(pid), stack_read, outputs, page)
            self.workers.append(worker)
            self.selector.register(worker.pidfd, selectors.EVENT_READ, worker)
            os.set_blocking(stack_read, False)
            self.selector.register(stack_read, selectors.EVENT_READ, ("stacks", worker))
            for output in outputs:
                os.set_blocking(output.fd, False)
                self.selector.register(output.fd, selectors.EVENT_READ, (worker, output))
        logger.info("started %d workers: pids %s", spec.num_workers, [w.pid for w in self.workers])
        self._send(WorkersStarted(tuple(w.pid for w in self.workers)))

    def _become_worker(
        self, spec: WorkerSpec, payload: list[bytearray], local_rank: int, stack_fd: int
    ) -> NoReturn:
        code = 1
        try:
            os.setsid()  # own process group: the agent can stop the worker's whole tree
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_DFL)
            self.selector.close()
            for sibling in self.workers:
                os.close(sibling.pidfd)
                os.close(sibling.stack_fd)
                for output in sibling.outputs:
                    os.close(output.fd)
            os.close(self.guardian.fd)
            self.conn.sock.close()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            if os.getppid() != self.boot["agent_pid"]:
                os._exit(1)  # the agent died before PDEATHSIG was armed
            faulthandler.register(signal.SIGUSR1, file=stack_fd, all_threads=True)
            from torchrunx import worker  # noqa: PLC0415 (only in the worker)

            code = worker.run(self.boot, spec, payload, local_rank)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    # -- monitor -------------------------------------------------------------------------

    def monitor(self) -> None:
        """Loop until every worker has ended and its output is read; then tell the launcher."""
        drain_deadline: float | None = None
        while not self._all_done():
            now = time.monotonic()
            if drain_deadline is None and all(w.ended for w in self.workers):
                # Something the workers started outside their process group may hold the
                # pipes open: read what comes for a moment, then give up on it.
                drain_deadline = now + _DRAIN_WAIT
            if drain_deadline is not None and now >= drain_deadline:
                break
            self._keep_alive(now)
            self._check_timers(now)
            if self.dump_deadline is not None and now >= self.dump_deadline:
                self._send_stacks_and_terminate()
            if self.stop_deadline is not None and now >= self.stop_deadline:
                self._signal_workers(signal.SIGKILL)
                self.stop_deadline = None
            wait = self._until_next_timer(time.monotonic())
            if drain_deadline is not None:
                wait = min(wait, max(drain_deadline - time.monotonic(), 0.0))
            for key, events in self.selector.select(wait):
                if key.data == "launcher" and events & selectors.EVENT_WRITE:
                    self._flush_outbox()
                if key.data != "launcher" or events & selectors.EVENT_READ:
                    self._on_ready(key.data)

    def _all_done(self) -> bool:
        return all(w.ended and not w.outputs for w in self.workers)

    def _keep_alive(self, now: float) -> None:
        if now >= self.next_heartbeat:
            self._send(Heartbeat())
            self.next_heartbeat = now + self.heartbeat_interval
        if self.launcher_alive and now - self.last_heard > self.agent_timeout:
            # After a stall (a long import holding the GIL) heartbeats may be waiting unread.
            ready = select.select([self.conn.sock], [], [], 0)[0]
            if ready:
                return
            logger.warning(
                "no heartbeat from the launcher for %.1f s: stopping", now - self.last_heard
            )
            self.launcher_alive = False
            self._begin_stop(dump_stacks=False)

    def _until_next_timer(self, now: float) -> float:
        timers = [self.next_heartbeat, self.last_heard + self.agent_timeout]
        timers += [t for t in (self.dump_deadline, self.stop_deadline) if t is not None]
        if any(not w.ended and timer.page_used(w.page) for w in self.workers):
            timers.append(self.next_timer_poll)
        timers += [w.hung[2] for w in self.workers if w.hung is not None and not w.hang_reported]
        return max(min(timers) - now, 0.0)

    def _check_timers(self, now: float) -> None:
        """Watchdog: a worker past its scope's deadline has its stack dumped, then reported."""
        if now >= self.next_timer_poll:
            self.next_timer_poll = now + _TIMER_POLL
            for worker in self.workers:
                if worker.ended or worker.hung is not None or self.stopping:
                    continue
                armed = timer.read_page(worker.page)
                if armed is not None and now >= armed[0]:
                    _, limit, scope = armed
                    logger.warning(
                        "worker %d stayed in timer scope %r longer than %g s: dumping its stack",
                        worker.local_rank,
                        scope,
                        limit,
                    )
                    worker.stacks.clear()
                    worker.hung = (scope, limit, now + _STACK_DUMP_WAIT)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(worker.pid, signal.SIGUSR1)
        for worker in self.workers:
            if worker.ended or worker.hung is None or worker.hang_reported:
                continue
            if now >= worker.hung[2]:
                self._report_hang(worker)

    def _report_hang(self, worker: _Worker) -> None:
        assert worker.hung is not None  # noqa: S101 (called for hung workers only)
        if worker.stack_fd >= 0:
            self._read_stacks(worker)
        scope, limit, _ = worker.hung
        worker.hang_reported = True
        stack = worker.stacks.decode(errors="replace")
        worker.stacks.clear()
        self._send(WorkerTimedOut(worker.local_rank, scope, limit, stack))
        if not worker.ended:  # never signal a reaped pid: it may belong to someone else now
            # The launcher decides what happens next (stop, or restart); the worker is no use.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, signal.SIGKILL)

    def _on_ready(self, source: Any) -> None:  # noqa: ANN401 (selector payload)
        if isinstance(source, _Worker):
            self._reap(source)
        elif isinstance(source, tuple) and isinstance(source[1], _Output):
            # Its worker may have been reaped earlier in this round: then the pipe was read
            # to its end and closed.
            if any(output is source[1] for output in source[0].outputs):
                self._read_output(source[0], source[1])
        elif isinstance(source, tuple):
            self._read_stacks(source[1])
        elif source == "launcher":
            self._on_message(self._recv()[0])
            self._update_interest()
        elif source == "stdin":
            self._on_stdin()

    def _recv(self) -> tuple[protocol.Message, list[bytearray]]:
        try:
            message, payload = self.conn.recv()
        except (OSError, ProtocolError):
            self.selector.unregister(self.conn.sock)
            self.launcher_alive = False
            self._begin_stop(dump_stacks=False)
            return Heartbeat(), []
        self.last_heard = time.monotonic()
        return message, payload

    def _on_message(self, message: protocol.Message) -> None:
        if isinstance(message, Stop):
            what = "the workers to restart them" if message.restart else "on request"
            logger.info("stopping %s: %s", what, message.reason)
            self.grace_period = message.grace_period
            self.restart_requested = message.restart
            self.final_stop = self.final_stop or not message.restart
            self._begin_stop(dump_stacks=message.dump_stacks)

    def _on_stdin(self) -> None:
        if not os.read(0, 4096):  # EOF: the launcher (or its SSH connection) is gone
            self.selector.unregister(0)
            self.launcher_alive = False
            self._begin_stop(dump_stacks=False)

    def _read_stacks(self, worker: _Worker) -> None:
        try:
            chunk = os.read(worker.stack_fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.selector.unregister(worker.stack_fd)
            os.close(worker.stack_fd)
            worker.stack_fd = -1
            return
        worker.stacks += chunk
        del worker.stacks[:-_STACK_BYTES]
        if worker.hung is not None and not worker.hang_reported:
            scope, limit, report_by = worker.hung
            worker.hung = (scope, limit, min(report_by, time.monotonic() + _STACK_SETTLE))
        if self.dump_deadline is not None and all(w.stacks for w in self.workers if not w.ended):
            # Every live worker has begun its dump; a dump is written in one go.
            self.dump_deadline = min(self.dump_deadline, time.monotonic() + _STACK_SETTLE)

    def _read_output(self, worker: _Worker, output: _Output, *, until_empty: bool = False) -> None:
        """Forward the whole lines available on one output pipe (all of it at EOF)."""
        lines: list[str] = []
        while True:
            try:
                chunk = os.read(output.fd, 65536)
            except BlockingIOError:
                break
            lines += output.splitter.feed(chunk)
            if not chunk:
                with contextlib.suppress(KeyError):  # not registered while output is paused
                    self.selector.unregister(output.fd)
                os.close(output.fd)
                worker.outputs.remove(output)
                break
            if not until_empty:
                break
        if lines:
            now = time.time()
            name = f"worker.{worker.local_rank}.{'stderr' if output.is_stderr else 'stdout'}"
            records = []
            for raw in lines:
                line = parse_line(raw, is_stderr=output.is_stderr, default_name=name)
                records.append((worker.local_rank, line.levelno, line.name, line.text, now))
            self._send(LogLines(tuple(records)))

    def _reap(self, worker: _Worker) -> None:
        for output in list(worker.outputs):  # its last words go out before its death notice
            self._read_output(worker, output, until_empty=True)
        if worker.hung is not None and not worker.hang_reported:
            self._report_hang(worker)  # it overran its timer, then ended (the dump killed it?)
        _, status = os.waitpid(worker.pid, 0)
        self.selector.unregister(worker.pidfd)
        os.close(worker.pidfd)
        worker.ended = True
        exitcode = os.waitstatus_to_exitcode(status)
        sig = -exitcode if exitcode < 0 else None
        # Whatever the worker started in its own process group goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        self.guardian.forget(worker.pid)
        logger.info(
            "worker %d (pid %d) exited with status %d", worker.local_rank, worker.pid, exitcode
        )
        self._send(
            WorkerExited(
                worker.local_rank,
                worker.pid,
                None if sig else exitcode,
                sig,
                stopped=worker.signalled,
                at=time.time(),
            )
        )

    def _begin_stop(self, *, dump_stacks: bool) -> None:
        if self.stopping:
            return
        self.stopping = True
        live = [w for w in self.workers if not w.ended]
        if dump_stacks and live and self.launcher_alive:
            for worker in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGUSR1)
            self.dump_deadline = time.monotonic() + _STACK_DUMP_WAIT
        else:
            self._terminate()

    def _send_stacks_and_terminate(self) -> None:
        self.dump_deadline = None
        stacks = {}
        for worker in self.workers:
            if worker.stack_fd >= 0:
                self._read_stacks(worker)
            if not worker.ended and worker.stacks:
                stacks[worker.local_rank] = worker.stacks.decode(errors="replace")
        self._send(WorkerStacks(stacks))
        self._terminate()

    def _terminate(self) -> None:
        self._signal_workers(signal.SIGTERM)
        self.stop_deadline = time.monotonic() + self.grace_period

    def _signal_workers(self, signum: int) -> None:
        for worker in self.workers:
            if not worker.ended:
                worker.signalled = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(worker.pid, signum)

    def _send(self, message: protocol.Message) -> None:
        """Queue a message for the launcher; it goes out as the socket accepts it.

        The loop never blocks on a slow launcher: while the outbox is large, the workers'
        output pipes are not read, so chatty workers wait (backpressure) and nothing is lost.
        """
        if not self.launcher_alive:
            return
        self.outbox += encode_frame_start(message)
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        while self.outbox and self.launcher_alive:
            try:
                # The socket has a timeout, so its descriptor is non-blocking; socket.send
                # would wait (up to that timeout) for room, os.write does not.
                sent = os.write(self.conn.sock.fileno(), self.outbox[:_SEND_CHUNK])
            except BlockingIOError:
                break
            except OSError:
                self.launcher_alive = False
                self._begin_stop(dump_stacks=False)
                return
            del self.outbox[:sent]
        self._update_interest()

    def _update_interest(self) -> None:
        if self.conn.sock.fileno() < 0 or not self.launcher_alive:
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.outbox else 0)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.modify(self.conn.sock, events, "launcher")
        paused = len(self.outbox) > _OUTBOX_HIGH
        if paused != self.output_paused and (paused or len(self.outbox) < _OUTBOX_LOW):
            self.output_paused = paused
            for worker in self.workers:
                for output in worker.outputs:
                    if paused:
                        self.selector.unregister(output.fd)
                    else:
                        self.selector.register(output.fd, selectors.EVENT_READ, (worker, output))

    def prepare_restart(self) -> bool:
        """After a ``Stop(restart=True)``: release the old workers and say we are ready.

        Returns ``False`` if the launcher is gone (then the agent ends instead).
        """
        self._release_workers()
        self.workers.clear()
        self.stopping = False
        self.restart_requested = False
        self.dump_deadline = None
        self.stop_deadline = None
        if self.output_paused:  # the new workers' pipes are registered as they are made
            self.output_paused = False
        if not self.launcher_alive:
            return False
        self._send(WorkersEnded(_free_port(), self.attempt))
        return self.launcher_alive

    def finish(self) -> None:
        """Deliver what is still queued (bounded by agent_timeout), then tell the launcher."""
        self._send(AgentDone())
        deadline = time.monotonic() + self.agent_timeout
        while self.outbox and self.launcher_alive and time.monotonic() < deadline:
            # In steps: epoll refuses a timeout of more than about 24 days.
            wait = min(deadline - time.monotonic(), self.heartbeat_interval)
            self.selector.select(max(wait, 0.0))
            self._flush_outbox()

    def close(self) -> None:
        """Kill any worker still alive and release every descriptor."""
        self.closed = True  # records logged from now on go to stderr
        self._release_workers()
        self.selector.close()
        self.conn.close()
        self.guardian.close()

    def _release_workers(self) -> None:
        self._signal_workers(signal.SIGKILL)
        for worker in self.workers:
            if not worker.ended:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(worker.pid, 0)
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(worker.pidfd)
                os.close(worker.pidfd)
                worker.ended = True
            if worker.stack_fd >= 0:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(worker.stack_fd)
                os.close(worker.stack_fd)
                worker.stack_fd = -1
            for output in worker.outputs:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(output.fd)
                os.close(output.fd)
            worker.outputs.clear()
            worker.page.close()


def _slots(workers: int | None, count: str, gpus: int, cpus: int) -> int:
    """Workers this host runs: the given number, else what ``count`` counts (0: no GPU)."""
    if workers is not None:
        return int(workers)
    if count == "gpu":
        return gpus  # 0 tells the launcher that workers_per_host="gpu" found none here
    if count == "cpu":
        return cpus
    return gpus or cpus


def main(boot: dict[str, Any]) -> None:
    """Entry point of the agent process (called by the boot code with the bootstrap line)."""
    boot["agent_pid"] = os.getpid()
    # A Ctrl-C meant for the launcher must not kill the agent before it cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    capture_logging(int(boot["log_level"]))
    guardian = _Guardian()
    secret = bytes.fromhex(boot["secret"])
    address = (boot["launcher"][0], int(boot["launcher"][1]))
    try:
        conn = protocol.connect(address, secret, "agent", timeout=float(boot["agent_timeout"]) * 2)
    except (OSError, ProtocolError) as exc:
        sys.stderr.write(f"torchrunx agent: cannot reach the launcher at {address}: {exc}\n")
        guardian.close()
        sys.exit(2)
    boot["gpus"] = count_local_gpus()
    boot["cpus"] = count_local_cpus()
    slots = _slots(boot["workers"], boot.get("count", "auto"), boot["gpus"], boot["cpus"])
    conn.send(
        AgentHello(
            host_index=int(boot["host_index"]),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            slots=int(slots),
            free_port=_free_port(),
            gpus=int(boot["gpus"]),
        )
    )
    agent = Agent(boot, conn, guardian)
    agent.forward_logging()
    logger.info(
        "agent of host %d started on %s (pid %d)",
        boot["host_index"],
        socket.gethostname(),
        os.getpid(),
    )
    code = 0
    try:
        received = agent.receive_spec()
        while received is not None:
            spec = received[0]
            agent.start_workers(*received)
            agent.monitor()
            # With restarts left, the agent stays: another host's worker may still fail.
            may_restart = agent.restart_requested or spec.attempt < spec.max_restarts
            if agent.final_stop or not may_restart or not agent.prepare_restart():
                break
            received = agent.receive_spec()
        agent.finish()
    except (OSError, ProtocolError) as exc:
        sys.stderr.write(f"torchrunx agent: lost the launcher: {exc}\n")
    except SystemExit as exc:  # SIGTERM
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        agent.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown (torch's takes ~0.5 s): the launcher waits for this exit.
        os._exit(code)
