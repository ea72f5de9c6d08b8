"""The agent: one per host; forks the workers, watches them, and obeys the launcher.

Process tree on one host::

    guardian  (python -c BOOT, started by bash over SSH or as a local subprocess; subreaper)
    └── agent (forked first; own process group; PDEATHSIG=SIGTERM; subreaper)
        ├── worker local_rank 0   (forked; own session and process group; PDEATHSIG=SIGKILL)
        ├── worker local_rank 1
        ├── ...
        └── (orphans the workers' children left, adopted: daemons too)

The agent's parts, one module each:

- this module: :func:`main` (the entry point) and :class:`Agent`, its loop and what it does
  with each message and event;
- :mod:`torchrunx.agent.guardian`: the agent's parent, which ends everything below it once the
  agent has ended, however;
- :mod:`torchrunx.agent.leftovers`: the processes and temporary files the workers leave: found,
  killed, reaped, removed;
- :mod:`torchrunx.agent.preload`: the background import of torch, joined before any fork;
- :mod:`torchrunx.agent.workergroup`: one attempt's workers: fork, read, reap, signal, close;
- :mod:`torchrunx.agent.workerprocess`: what a forked child does to become a worker;
- :mod:`torchrunx.agent.watchdog`: heartbeats, the launcher's silence, workers that overrun a timer;
- :mod:`torchrunx.agent.outbox`: messages to the launcher, never blocking, with backpressure.

Sequence: decode the bootstrap line (:class:`AgentBootstrap`); fork off the agent from its
guardian (:func:`torchrunx.agent.guardian.fork_agent`), with the workers' private ``TMPDIR``;
connect to
the launcher and authenticate; send :class:`AgentHello` (slots, GPUs, a free port); import
torch in a background thread while the loop goes on; receive the :class:`WorkerSpec` with the
pickled call as payload; fork the workers; then loop on one selector over the
launcher connection, stdin, one pidfd per worker (so a death is reported the moment it
happens), the workers' stdout and stderr pipes (forwarded as :class:`LogLines`, see
:mod:`torchrunx.wire.lines`) and one stack pipe per worker. The agent's own ``logging``
records go on the launcher connection too (:class:`_ToLauncher`), so "worker N exited" never
overtakes that worker's output. The agent is single-threaded when it forks and ends when its workers
have ended and no restart can follow.

Stopping: on :class:`Stop` (or when the launcher connection or stdin closes, or no message
arrived for ``agent_timeout`` seconds) the agent optionally asks each live worker for its
Python stacks (SIGUSR1, written by ``faulthandler`` into the worker's stack pipe) and sends
them as :class:`WorkerStacks`, then closes the worker group: SIGTERM to every worker's process
group and to every other process below the agent (what the workers left, daemons included),
and SIGKILL after the grace period, forwarding output and reporting exits meanwhile. The group
is closed the same way when its workers all ended by themselves, and the workers' temporary
directory is emptied after each attempt.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import selectors
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, NoReturn

from torchrunx.agent import leftovers
from torchrunx.agent.capture import capture_logging
from torchrunx.agent.guardian import fork_agent
from torchrunx.agent.outbox import Outbox
from torchrunx.agent.preload import TorchPreload
from torchrunx.agent.store import StoreSocket, listen_address
from torchrunx.agent.watchdog import HangWatch, Heartbeats
from torchrunx.agent.workergroup import STACK_DUMP_WAIT, STACK_SETTLE, Ready, WorkerGroup
from torchrunx.agent.workerprocess import become_worker
from torchrunx.devices import count_local_cpus, count_local_gpus
from torchrunx.errors import ProtocolError
from torchrunx.wire import handshake
from torchrunx.wire.bootstrap import AgentBootstrap
from torchrunx.wire.lines import line_records
from torchrunx.wire.messages import (
    AgentDone,
    AgentHello,
    Heartbeat,
    LogLines,
    Stop,
    WorkerExited,
    WorkersEnded,
    WorkerSpec,
    WorkersStarted,
    WorkerStacks,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.agent.workergroup import Fork, Output, Worker
    from torchrunx.wire.messages import Message
    from torchrunx.wire.records import Connection

logger = logging.getLogger("torchrunx.agent")

_DRAIN_WAIT = 1.0
_DEFAULT_GRACE = 3.0


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


class Agent:
    """The live agent of one host (created by :func:`main`)."""

    def __init__(  # noqa: PLR0913 (the host's facts and what main made)
        self,
        boot: AgentBootstrap,
        connection: Connection,
        *,
        gpus: int,
        cpus: int,
        tmpdir: str | None = None,
        store: StoreSocket | None = None,
    ) -> None:
        """Keep the bootstrap, the launcher connection, the host's counts, the workers' TMPDIR.

        ``store``: host 0's rendezvous socket (:mod:`torchrunx.agent.store`), listening.
        """
        self.boot = boot
        self.store = store
        self.conn = connection
        self.tmpdir = tmpdir
        self.gpus = gpus
        self.cpus = cpus
        self.pid = os.getpid()
        self.selector = selectors.DefaultSelector()
        # A timeout also makes the socket's descriptor non-blocking, which the outbox needs.
        self.conn.sock.settimeout(boot.agent_timeout)
        self.outbox = Outbox(self.conn.sock, self.conn.sealer)
        self.heartbeats = Heartbeats(boot.heartbeat_interval, boot.agent_timeout)
        self.launcher_events = selectors.EVENT_READ
        self.selector.register(self.conn.sock, self.launcher_events, "launcher")
        self.selector.register(0, selectors.EVENT_READ, "stdin")
        self.closed = False
        # Between attempts: what the launcher sent.
        self.waiting = False
        self.received: tuple[WorkerSpec, list[bytearray]] | None = None
        self.preload_pending = False
        self.preloaded = False
        # One attempt: its workers, and how they are being stopped.
        self.group: WorkerGroup | None = None
        self.hangs: HangWatch | None = None
        self.attempt = -1
        """The attempt of the workers last started."""
        self.stopping = False
        self.dump_on_stop = False
        self.grace_period = _DEFAULT_GRACE
        self.restart_requested = False
        self.final_stop = False
        """Told to stop for good (a Stop without restart)."""
        self.dump_deadline: float | None = None
        self.drain_deadline: float | None = None

    @property
    def launcher_alive(self) -> bool:
        """Whether the launcher still listens (no EOF, no broken connection, not silent)."""
        return self.outbox.alive

    def forward_logging(self) -> None:
        """From now on, send this process's ``logging`` records on the launcher connection."""
        root = logging.getLogger()
        fallback = root.handlers[0] if root.handlers else logging.StreamHandler(sys.stderr)
        root.handlers[:] = [_ToLauncher(self, fallback)]

    def send_record(self, levelno: int, name: str, text: str, created: float) -> None:
        """Send one of the agent's own records (no local rank) after what is already queued."""
        self._send(LogLines(((None, levelno, name, text, created),)))

    # -- the attempts -----------------------------------------------------------------------

    def run(self) -> None:
        """Run the worker group of each attempt until no restart can follow; then finish."""
        received = self.receive_spec()
        while received is not None:
            spec, payload = received
            self.run_workers(spec, payload)
            # With restarts left, the agent stays: another host's worker may still fail. Warm
            # agents stay for the next run until told to stop for good.
            may_restart = (
                self.boot.warm or self.restart_requested or spec.attempt < spec.max_restarts
            )
            if self.final_stop or not may_restart or not self.prepare_restart():
                break
            received = self.receive_spec()
        self.finish()

    def receive_spec(self) -> tuple[WorkerSpec, list[bytearray]] | None:
        """Wait for the worker spec and the torch import, heartbeats going on meanwhile.

        Returns ``None`` if told to stop first.
        """
        # The import thread writes to a pipe when done, so one selector waits for it, the
        # launcher and stdin alike. Once done, later attempts wait for the spec alone.
        preload = None if self.preloaded else TorchPreload(enabled=self.boot.preload_torch)
        if preload is not None:
            self.selector.register(preload.fileno(), selectors.EVENT_READ, preload)
        self.waiting = True
        self.received = None
        self.preload_pending = preload is not None
        try:
            self._serve(self._ready_to_start)
        finally:
            self.waiting = False
            if preload is not None:
                with contextlib.suppress(KeyError):
                    self.selector.unregister(preload.fileno())
                preload.join()  # and the thread has left the kernel: now the agent may fork
            self.preloaded = True
        return None if self.stopping else self.received

    def _ready_to_start(self) -> bool:
        return self.stopping or (self.received is not None and not self.preload_pending)

    def run_workers(self, spec: WorkerSpec, payload: list[bytearray]) -> None:
        """Fork the workers; serve until they end, or stop them; then release the group."""
        self.attempt = spec.attempt
        # The agent is a child subreaper, and its only children are workers: the group ends
        # whatever lives below the agent once they are done.
        group = WorkerGroup(self.selector, root=self.pid)
        self.group = group
        self.hangs = HangWatch(group, self._send)

        store = None if self.store is None else self.store.sock

        def child(fork: Fork) -> NoReturn:
            # Rank 0 keeps the store's socket and serves it; the others close it.
            keeps = store is not None and fork.local_rank == 0
            become_worker(
                fork,
                boot=self.boot,
                spec=spec,
                payload=payload,
                agent_pid=self.pid,
                gpus=self.gpus,
                cpus=self.cpus,
                agent_objects=(
                    self.selector,
                    self.conn.sock,
                    *((store,) if store is not None and not keeps else ()),
                ),
                store_fd=store.fileno() if store is not None and keeps else None,
                tmpdir=self.tmpdir,
            )

        group.start(spec.num_workers, child)
        if self.store is not None:
            self.store.handed_over()
        group.pause_output(self.outbox.paused)
        logger.info("started %d workers: pids %s", spec.num_workers, [w.pid for w in group.workers])
        self._send(WorkersStarted(tuple(w.pid for w in group.workers)))
        self._serve(lambda: self.stopping or self._group_done())
        if self.stopping and self.dump_on_stop and self.launcher_alive and group.live():
            self._dump_stacks(group)
        group.close(self.grace_period, self._serve_until_group_done, self._serve_until)
        self.group = None
        leftovers.empty_dir(self.tmpdir)  # the next attempt starts with nothing of this one

    def prepare_restart(self) -> bool:
        """After the workers of an attempt ended: say we are ready for the next one.

        Returns ``False`` if the launcher is gone (then the agent ends instead).
        """
        self.hangs = None
        self.stopping = False
        self.dump_on_stop = False
        self.restart_requested = False
        self.dump_deadline = None
        self.drain_deadline = None
        if not self.launcher_alive:
            return False
        self._send(WorkersEnded(self._next_port(), self.attempt))
        return self.launcher_alive

    def _next_port(self) -> int:
        """The next attempt's ``MASTER_PORT``: host 0's fresh store, else a free port."""
        return self.store.renew() if self.store is not None else _free_port()

    def finish(self) -> None:
        """Tell the launcher, deliver what is queued, and end the connection cleanly.

        Bounded by agent_timeout. The agent half-closes its side and reads (heartbeats) until
        the launcher, having read everything, closes its own: a socket closed with unread data
        is reset, and a reset can drop what was still on its way, ``AgentDone`` included.
        """
        self._send(AgentDone())
        deadline = time.monotonic() + self.boot.agent_timeout
        self.outbox.drain(deadline)
        if self.outbox.alive and not len(self.outbox):
            self.conn.send_close()  # everything went: end the stream with its close record
            _half_close_and_drain(self.conn.sock, deadline)

    def close(self) -> None:
        """Kill any worker and anything else still alive below the agent; release every descriptor.

        The workers' temporary directory goes too: the guardian would remove it after the
        agent's exit, but not if the agent closes because its guardian was killed.
        """
        self.closed = True  # records logged from now on go to stderr
        if self.group is not None:
            self.group.close(0.0)
        leftovers.kill_descendants(self.pid)
        leftovers.remove_dir(self.tmpdir)
        if self.store is not None:
            self.store.close()
        self.selector.close()
        self.conn.close()

    # -- the loop ---------------------------------------------------------------------------

    def _serve(self, finished: Callable[[], bool], deadline: float | None = None) -> None:
        """Serve every source until ``finished()`` or ``deadline`` (monotonic) passes."""
        while not finished():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            self._on_timers(now)
            wait = self._until_next_timer(time.monotonic())
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            for key, events in self.selector.select(max(wait, 0.0)):
                self._dispatch(key.data, events)

    def _serve_until_group_done(self, deadline: float | None) -> None:
        self._serve(self._group_done, deadline)

    def _serve_until(self, deadline: float) -> None:
        self._serve(lambda: False, deadline)

    def _group_done(self) -> bool:
        """Every worker was reaped and its output read, or the drain after that is over."""
        group = self.group
        if group is None or group.done():
            return True
        return self.drain_deadline is not None and time.monotonic() >= self.drain_deadline

    def _on_timers(self, now: float) -> None:
        if self.heartbeats.due(now):
            self._send(Heartbeat())
        if self.launcher_alive:
            silent = self.heartbeats.silent_for(now, self.conn.sock)
            if silent is not None:
                logger.warning("no heartbeat from the launcher for %.1f s: stopping", silent)
                self._launcher_lost()
        if self.hangs is not None:
            self.hangs.check(now, stopping=self.stopping)
        if self.group is not None:
            self.group.reap_adopted()
            if self.drain_deadline is None and self.group.all_ended():
                # Something the workers started outside their process group may hold the
                # pipes open: it is told to end now; read what comes for a moment, then give
                # up on it (the group's close kills it).
                self.group.term_strays()
                self.drain_deadline = now + _DRAIN_WAIT

    def _until_next_timer(self, now: float) -> float:
        timers = [self.heartbeats.next_deadline(launcher_alive=self.launcher_alive)]
        timers += [t for t in (self.dump_deadline, self.drain_deadline) if t is not None]
        if self.hangs is not None and (hang_deadline := self.hangs.next_deadline()) is not None:
            timers.append(hang_deadline)
        return max(min(timers) - now, 0.0)

    def _dispatch(self, data: object, events: int) -> None:
        if isinstance(data, Ready):
            self._on_worker_ready(data)
        elif data == "launcher":
            if events & selectors.EVENT_WRITE:
                self.outbox.flush()
                self._after_send()
            if events & selectors.EVENT_READ and self.launcher_alive:
                self._on_launcher()
        elif data == "stdin":
            self._on_stdin()
        elif isinstance(data, TorchPreload):
            self.preload_pending = False
            self.selector.unregister(data.fileno())  # else it stays readable: a spin

    # -- the launcher -----------------------------------------------------------------------

    def _on_launcher(self) -> None:
        try:
            message, payload = self.conn.recv()
        except Exception as exc:  # noqa: BLE001 (a bad record or frame, a cut stream: all lost)
            if not isinstance(exc, OSError | ProtocolError):
                logger.warning("dropping the launcher's connection: %r", exc)
            self._launcher_lost()
            return
        self.heartbeats.heard()
        if isinstance(message, WorkerSpec):
            if self.waiting:  # else it is late, or for no attempt of ours: ignored
                self.received = (message, payload)
        elif isinstance(message, Stop):
            self._on_stop(message)

    def _on_stop(self, message: Stop) -> None:
        if message.restart and self.waiting:
            # No workers run here: ready at once. A spec that came before this Stop belongs
            # to the attempt being abandoned.
            self.received = None
            self._send(WorkersEnded(self._next_port(), message.attempt))
            return
        what = "the workers to restart them" if message.restart else "on request"
        logger.info("stopping %s: %s", what, message.reason)
        self.grace_period = message.grace_period
        self.restart_requested = message.restart
        self.final_stop = self.final_stop or not message.restart
        self._begin_stop(dump_stacks=message.dump_stacks)

    def _on_stdin(self) -> None:
        if not os.read(0, 4096):  # EOF: the launcher (or its SSH connection) is gone
            self.selector.unregister(0)
            self._launcher_lost()

    def _launcher_lost(self) -> None:
        """The launcher is gone, or unreachable: send nothing more, and stop the workers."""
        self.outbox.lose()
        if self.launcher_events:
            self.launcher_events = 0
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.conn.sock)
        self._begin_stop(dump_stacks=False)

    def _begin_stop(self, *, dump_stacks: bool) -> None:
        """Stop this attempt's workers (see :meth:`run_workers`); a stop under way goes on."""
        if self.stopping:
            return
        self.stopping = True
        self.dump_on_stop = dump_stacks

    def _send(self, message: Message) -> None:
        """Queue a message for the launcher; it goes out as the socket accepts it."""
        self.outbox.put(message)
        self._after_send()

    def _after_send(self) -> None:
        """Follow the outbox: watch the socket for room while it holds data; backpressure."""
        if not self.outbox.alive:
            if self.launcher_events:
                self._launcher_lost()
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if len(self.outbox) else 0)
        if events != self.launcher_events:
            self.selector.modify(self.conn.sock, events, "launcher")
            self.launcher_events = events
        if self.group is not None:
            self.group.pause_output(self.outbox.paused)

    # -- the workers ------------------------------------------------------------------------

    def _on_worker_ready(self, ready: Ready) -> None:
        if ready.kind == "exited":
            self._on_exited(ready.worker)
        elif ready.kind == "output" and ready.output is not None:
            self._forward_output(ready.worker, ready.output)
        elif ready.kind == "stacks":
            self._on_stacks(ready.worker)

    def _forward_output(self, worker: Worker, output: Output, *, until_empty: bool = False) -> None:
        """Send the whole lines available on one output pipe as :class:`LogLines`."""
        assert self.group is not None  # noqa: S101 (only while a group runs)
        lines = self.group.read_output(worker, output, until_empty=until_empty)
        if lines:
            name = f"worker.{worker.local_rank}.{'stderr' if output.is_stderr else 'stdout'}"
            records = line_records(
                lines,
                is_stderr=output.is_stderr,
                default_name=name,
                local_rank=worker.local_rank,
                created=time.time(),
            )
            self._send(LogLines(tuple(records)))

    def _on_exited(self, worker: Worker) -> None:
        assert self.group is not None  # noqa: S101 (only while a group runs)
        assert self.hangs is not None  # noqa: S101
        for output in list(worker.outputs):  # its last words go out before its death notice
            self._forward_output(worker, output, until_empty=True)
        self.hangs.before_reap(worker)
        exitcode = self.group.reap(worker)
        sig = -exitcode if exitcode < 0 else None
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

    def _on_stacks(self, worker: Worker) -> None:
        assert self.group is not None  # noqa: S101 (only while a group runs)
        assert self.hangs is not None  # noqa: S101
        if not self.group.read_stacks(worker):
            return
        now = time.monotonic()
        self.hangs.stacks_arrived(worker, now)
        if self.dump_deadline is not None and all(w.stacks for w in self.group.live()):
            # Every live worker has begun its dump; a dump is written in one go.
            self.dump_deadline = min(self.dump_deadline, now + STACK_SETTLE)

    def _dump_over(self) -> bool:
        # _on_stacks brings the deadline forward once every live worker has begun its dump.
        deadline = self.dump_deadline
        return self._group_done() or deadline is None or time.monotonic() >= deadline

    def _dump_stacks(self, group: WorkerGroup) -> None:
        """Ask every live worker for its stacks; send them, unless all workers ended first."""
        for worker in group.live():
            group.dump_stacks(worker)
        self.dump_deadline = time.monotonic() + STACK_DUMP_WAIT
        self._serve(self._dump_over)
        self.dump_deadline = None
        if self._group_done():
            return
        stacks = {}
        for worker in group.workers:
            group.read_stacks(worker)
            if not worker.ended and worker.stacks:
                stacks[worker.local_rank] = worker.stacks.decode(errors="replace")
        self._send(WorkerStacks(stacks))


def _half_close_and_drain(sock: socket.socket, deadline: float) -> None:
    """Shut our side of ``sock`` for writing, then read until the peer closes or ``deadline``."""
    try:
        sock.shutdown(socket.SHUT_WR)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            if not poller.poll(math.ceil(min(left, 1.0) * 1000)):
                continue
            with contextlib.suppress(BlockingIOError, InterruptedError):
                if not sock.recv(65536, socket.MSG_DONTWAIT):
                    return
    except OSError:  # reset or gone: nothing more to wait for
        return


def _slots(workers: int | None, count: str, gpus: int, cpus: int) -> int:
    """Workers this host runs: the given number, else what ``count`` counts (0: no GPU)."""
    if workers is not None:
        return int(workers)
    if count == "gpu":
        return gpus  # 0 tells the launcher that workers_per_host="gpu" found none here
    if count == "cpu":
        return cpus
    return gpus or cpus


def main(line: bytes) -> None:
    """Entry point of the agent process, called by the boot code with the bootstrap line."""
    try:
        boot = AgentBootstrap.from_json_line(line)
    except ProtocolError as exc:
        sys.stderr.write(f"torchrunx agent: {exc}\n")
        sys.exit(2)
    finally:
        del line  # the raw line holds the secret: no frame of the agent or its workers keeps it
    # A Ctrl-C meant for the launcher must not kill the agent before it cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmpdir = fork_agent()  # from here on, this process is the agent, below its guardian
    capture_logging(boot.log_level)
    address = (boot.launcher_address, boot.launcher_port)
    try:
        conn = handshake.connect(address, boot.secret, "agent", timeout=boot.agent_timeout * 2)
    except (OSError, ProtocolError) as exc:
        sys.stderr.write(f"torchrunx agent: cannot reach the launcher at {address}: {exc}\n")
        sys.exit(2)
    gpus = count_local_gpus()
    cpus = count_local_cpus()
    # Host 0 runs rank 0: its agent hosts the rendezvous store, listening from now on.
    store = (
        StoreSocket(listen_address(local_only=boot.local_only)) if boot.host_index == 0 else None
    )
    conn.send(
        AgentHello(
            host_index=boot.host_index,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            slots=_slots(boot.workers, boot.count, gpus, cpus),
            free_port=_free_port() if store is None else store.port,
            gpus=gpus,
        )
    )
    agent = Agent(boot, conn, gpus=gpus, cpus=cpus, tmpdir=tmpdir, store=store)
    agent.forward_logging()
    logger.info(
        "agent of host %d started on %s (pid %d)",
        boot.host_index,
        socket.gethostname(),
        os.getpid(),
    )
    code = 0
    try:
        agent.run()
    except (OSError, ProtocolError) as exc:
        sys.stderr.write(f"torchrunx agent: lost the launcher: {exc}\n")
    except SystemExit as exc:  # SIGTERM
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # closing is what SIGTERM would ask for
        agent.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown (torch's takes ~0.5 s): the launcher waits for this exit.
        os._exit(code)
