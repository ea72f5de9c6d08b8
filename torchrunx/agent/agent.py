"""The agent: one per host; forks the workers, watches them, and obeys the launcher.

Process tree on one host::

    guardian  (python -c BOOT, started by bash over SSH or as a local subprocess; subreaper)
    └── agent (forked first; own process group; PDEATHSIG=SIGTERM; subreaper)
        ├── worker local_rank 0   (forked; own session and process group; PDEATHSIG=SIGKILL)
        ├── worker local_rank 1
        ├── ...
        └── (orphans the workers' children left, adopted: daemons too)

The agent's parts, one module each:

- this module: :func:`main` (the entry point: decode the bootstrap, fork off the guardian,
  connect, say hello) and :class:`Agent`: its attempts (wait for a spec, fork, serve, stop,
  close, then restart or end), its one loop over the selector, and what it does with the
  launcher's messages (a spec, a stop);
- :mod:`torchrunx.agent.link`: the connection to the launcher: the socket and stdin, the
  outbox, heartbeats both ways, when the launcher counts as lost, the clean end; the agent's
  own ``logging`` records sent on it;
- :mod:`torchrunx.agent.attempt`: one attempt's workers as the agent reports them: output,
  exits, stacks on a stop; the hang watch and the drain once they all ended;
- :mod:`torchrunx.agent.guardian`: the agent's parent, which ends everything below it once the
  agent has ended, however;
- :mod:`torchrunx.agent.leftovers`: the processes and temporary files the workers leave: found,
  killed, reaped, removed;
- :mod:`torchrunx.agent.preload`: the background import of torch, joined before any fork;
- :mod:`torchrunx.agent.store`: host 0's rendezvous socket, listening before the workers start;
- :mod:`torchrunx.agent.workergroup`: one attempt's workers: fork, read, reap, signal, close;
- :mod:`torchrunx.agent.workerprocess`: what a forked child does to become a worker;
- :mod:`torchrunx.agent.watchdog`: heartbeats, the launcher's silence, workers that overrun a timer;
- :mod:`torchrunx.agent.outbox`: messages to the launcher, never blocking, with backpressure;
- :mod:`torchrunx.agent.usage`: what each worker uses (CPU, memory, GPUs), sent in heartbeats.

Sequence: decode the bootstrap line (:class:`AgentBootstrap`); fork off the agent from its
guardian (:func:`torchrunx.agent.guardian.fork_agent`), with the workers' private ``TMPDIR``;
connect to the launcher and authenticate; send :class:`AgentHello` (slots, GPUs, a free port);
import torch in a background thread while the loop goes on; receive the :class:`WorkerSpec`
with the pickled call as payload; fork the workers; then loop on one selector over the
launcher connection, stdin, one pidfd per worker (so a death is reported the moment it
happens), the workers' stdout and stderr pipes (forwarded as :class:`LogLines`, see
:mod:`torchrunx.wire.lines`), one stack pipe per worker, and one channel per worker (a socket
pair: what the worker sends is forwarded as :class:`FromWorker`, what the launcher sends it
comes as :class:`ToWorker`; workers never connect to the launcher themselves). The agent's
own ``logging`` records go on the launcher connection too (:mod:`torchrunx.agent.link`), so
"worker N exited" never overtakes that worker's output. The agent is single-threaded when it
forks and ends when its workers have ended and no restart can follow.

Stopping: on :class:`Stop` (or when the launcher connection or stdin closes, or no message arrived
for ``agent_timeout`` seconds: the bootstrap's ``timings.launcher_silence``) the agent optionally
asks each live worker for its Python stacks (SIGUSR1, written by ``faulthandler`` into the worker's
stack pipe) and sends them as :class:`WorkerStacks`, then closes the worker group: SIGTERM to every
worker's process group and to every other process below the agent (what the workers left, daemons
included), and SIGKILL after the grace period, forwarding output and reporting exits meanwhile. The
group is closed the same way when its workers all ended by themselves, and the workers' temporary
directory is emptied after each attempt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors  # (socket imports it)
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from torchrunx.agent import leftovers
from torchrunx.agent.guardian import fork_agent, missing_pidfds
from torchrunx.agent.store import StoreSocket, free_port, listen_address
from torchrunx.devices import count_local_cpus, count_local_gpus, count_slots
from torchrunx.errors import ProtocolError
from torchrunx.wire import handshake
from torchrunx.wire.bootstrap import AgentBootstrap
from torchrunx.wire.messages import (
    AgentHello,
    AskTimings,
    Preempt,
    PreemptionNotice,
    ShowStacks,
    Stop,
    ToWorker,
    WorkersEnded,
    WorkerSpec,
    WorkersStarted,
    WorkerStacks,
)
from torchrunx.worker.capture import capture_logging

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.agent.attempt import Attempt
    from torchrunx.agent.workergroup import Fork
    from torchrunx.wire import messages
    from torchrunx.wire.messages import WorkerUsage
    from torchrunx.wire.records import Connection

# What only the running agent uses (its attempts and workers, the link, usage, preload, the
# stall probe) is imported by Agent after the hello: every agent's import comes before
# its hello and is what the launch waits for (issue #48; tests/test_api.py).

logger = logging.getLogger("torchrunx.agent")

_DEFAULT_GRACE = 3.0
_SAME_NOTICE = 1.0
"""Seconds in which a second SIGTERM is the same preemption notice (see ``on_sigterm``)."""


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
        from torchrunx.agent.link import LauncherLink  # noqa: PLC0415 (after the hello: see the imports)
        from torchrunx.agent.usage import UsageSampler  # noqa: PLC0415

        self.boot = boot
        self.store = store
        self.tmpdir = tmpdir
        self.gpus = gpus
        self.cpus = cpus
        self.pid = os.getpid()
        self.selector = selectors.DefaultSelector()
        # One attempt: its workers, and what the agent reports about them.
        self.current: Attempt | None = None
        self.sampler = UsageSampler(gpus)
        self.link = LauncherLink(
            connection,
            self.selector,
            timings=boot.timings,
            on_lost=self._launcher_lost,
            on_backpressure=self._pause_output,
        )
        self.link.usage = self._usage
        # Between attempts: what the launcher sent.
        self.waiting = False
        self.received: tuple[WorkerSpec, list[bytearray]] | None = None
        self.preload_pending = False
        self.preloaded = False
        self.offered_port: int | None = None
        """The ``MASTER_PORT`` of the last ``WorkersEnded`` (None: none sent yet)."""
        # Preemption (see on_sigterm).
        self.grace = 0.0
        """The attempt's preemption grace (``WorkerSpec.preemption_grace``)."""
        self.noticed: float | None = None
        """When SIGTERM brought a preemption notice (monotonic), if it did."""
        self.guardian = os.getppid()
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)  # noqa: FBT003 (socket.setblocking takes a flag)
        self.selector.register(self._wake[0], selectors.EVENT_READ, "sigterm")
        # How the attempt's workers are being stopped.
        self.attempt = -1
        """The attempt of the workers last started."""
        self.stopping = False
        self.dump_on_stop = False
        self.grace_period = _DEFAULT_GRACE
        self.restart_requested = False
        self.final_stop = False
        """Told to stop for good (a Stop without restart)."""

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
        from torchrunx.agent.preload import TorchPreload  # noqa: PLC0415 (after the hello)

        preload = (
            None
            if self.preloaded
            else TorchPreload(enabled=self.boot.preload_torch, modules=self.boot.preload)
        )
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
                for failure in preload.failed:
                    logger.warning(
                        "TORCHRUNX_PRELOAD: cannot import %s; each worker imports it itself",
                        failure,
                    )
            self.preloaded = True
        return None if self.stopping else self.received

    def _ready_to_start(self) -> bool:
        return self.stopping or (self.received is not None and not self.preload_pending)

    def run_workers(self, spec: WorkerSpec, payload: list[bytearray]) -> None:
        """Fork the workers; serve until they end, or stop them; then release the group."""
        from torchrunx.agent.attempt import Attempt  # noqa: PLC0415 (after the hello)
        from torchrunx.agent.workerprocess import become_worker  # noqa: PLC0415

        self.attempt = spec.attempt
        # The agent is a child subreaper, and its only children are workers: the group ends
        # whatever lives below the agent once they are done.
        current = Attempt(self.selector, root=self.pid, send=self.link.send, forward=self.link.send)
        self.current = current
        group = current.group
        self._place_store(spec)
        self.grace = spec.preemption_grace

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
                    self.link.conn.sock,
                    *self._wake,
                    *((store,) if store is not None and not keeps else ()),
                ),
                store_fd=store.fileno() if store is not None and keeps else None,
                tmpdir=self.tmpdir,
            )

        group.start(spec.num_workers, child)
        if self.store is not None:
            self.store.handed_over()
        group.pause_output(self.link.outbox.paused)
        logger.info("started %d workers: pids %s", spec.num_workers, [w.pid for w in group.workers])
        self.link.send(WorkersStarted(tuple(w.pid for w in group.workers)))
        self._serve(lambda: self.stopping or self._group_done())
        if self.stopping and self.dump_on_stop and self.link.alive and group.live():
            current.dump_stacks(self._serve)
        group.close(self.grace_period, self._serve_until_group_done, self._serve_until)
        self.current = None
        leftovers.empty_dir(self.tmpdir)  # the next attempt starts with nothing of this one

    def _place_store(self, spec: WorkerSpec) -> None:
        """The store listens on the host that runs rank 0 (``spec.host_index`` 0), only there.

        A spare host (or a host moved up when the world shrank) that now runs rank 0 opens it
        on ``spec.master_port``, the port it last reported free. If that port was taken
        meanwhile, rank 0 fails to serve it and the attempt fails like any other.
        """
        if spec.host_index == 0 and self.store is None:
            try:
                self.store = StoreSocket(
                    listen_address(local_only=self.boot.local_only), spec.master_port
                )
            except OSError:
                logger.exception("cannot listen on MASTER_PORT %d", spec.master_port)
        elif spec.host_index != 0 and self.store is not None:
            self.store.close()
            self.store = None

    def prepare_restart(self) -> bool:
        """After the workers of an attempt ended: say we are ready for the next one.

        Returns ``False`` if the launcher is gone (then the agent ends instead).
        """
        self.stopping = False
        self.dump_on_stop = False
        self.restart_requested = False
        if not self.link.alive:
            return False
        self.offered_port = self._next_port()
        self.link.send(WorkersEnded(self.offered_port, self.attempt))
        return self.link.alive

    def _next_port(self) -> int:
        """The next attempt's ``MASTER_PORT``: host 0's fresh store, else a free port."""
        return self.store.renew() if self.store is not None else free_port()

    def finish(self) -> None:
        """Tell the launcher, deliver what is queued, and end the connection cleanly.

        Bounded by the bootstrap's ``timings.finish_timeout`` (see :meth:`LauncherLink.finish`).
        """
        self.link.finish(self.boot.timings.finish_timeout)

    def close(self) -> None:
        """Kill any worker and anything else still alive below the agent; release every descriptor.

        The workers' temporary directory goes too: the guardian would remove it after the
        agent's exit, but not if the agent closes because its guardian was killed.
        """
        self.link.closed = True  # records logged from now on go to stderr
        self.sampler.close()
        if self.current is not None:
            self.current.group.close(0.0)
        leftovers.kill_descendants(self.pid)
        leftovers.remove_dir(self.tmpdir)
        if self.store is not None:
            self.store.close()
        for end in self._wake:
            end.close()
        self.selector.close()
        self.link.conn.close()

    # -- the loop ---------------------------------------------------------------------------

    def _serve(self, finished: Callable[[], bool], deadline: float | None = None) -> None:
        """Serve every source until ``finished()`` or ``deadline`` (monotonic) passes."""
        while not finished():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            with self.link.hold():  # what this turn sends goes out together, at its end
                self._on_timers(now)
            wait = self._until_next_timer(time.monotonic())
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            ready = self.selector.select(max(wait, 0.0))
            with self.link.hold():
                for key, events in ready:
                    self._dispatch(key.data, events)

    def _serve_until_group_done(self, deadline: float | None) -> None:
        self._serve(self._group_done, deadline)

    def _serve_until(self, deadline: float) -> None:
        self._serve(lambda: False, deadline)

    def _group_done(self) -> bool:
        """Every worker was reaped and its output read, or the drain after that is over."""
        return self.current is None or self.current.done()

    def _usage(self, now: float) -> tuple[WorkerUsage, ...]:
        """What the running workers use (sent in each heartbeat); none while stopping."""
        if self.current is None or self.stopping:
            self.sampler.close()  # no query of nvidia-smi left for the group's end to find
            return ()
        live = [(w.local_rank, w.pid) for w in self.current.group.live()]
        return self.sampler.sample(live, now)

    def _on_timers(self, now: float) -> None:
        self.link.on_timers(now)
        if self.current is not None:
            self.current.on_timers(now, stopping=self.stopping)

    def _until_next_timer(self, now: float) -> float:
        timers = [self.link.next_deadline()]
        if self.current is not None:
            timers += self.current.deadlines()
        return max(min(timers) - now, 0.0)

    # -- preemption -------------------------------------------------------------------------

    def on_sigterm(self, signum: int, frame: object) -> None:
        """SIGTERM: while workers run with a grace period, a preemption notice; else the end.

        The notice goes to this host's workers and to the launcher, which tells every host
        (:mod:`torchrunx.preemption`). A second SIGTERM (more than a second after the first:
        SLURM signals the agent and its guardian, which passes its own on, at once), one while
        stopping or between attempts, or one sent because the guardian died, ends the agent as
        before.
        """
        del signum, frame
        if self.noticed is not None and time.monotonic() - self.noticed < _SAME_NOTICE:
            return  # the same notice, twice
        if (
            self.noticed is not None
            or self.stopping
            or self.current is None
            or self.grace <= 0
            or os.getppid() != self.guardian
        ):
            sys.exit(143)
        self.noticed = time.monotonic()
        with contextlib.suppress(OSError):
            self._wake[1].send(b"t")  # the loop sends the notice (never from a handler)

    def _on_sigterm_notice(self) -> None:
        with contextlib.suppress(OSError):
            self._wake[0].recv(64)
        reason = f"the agent on {self.boot.hostname} received SIGTERM"
        logger.warning("%s: telling the launcher (preemption)", reason)
        self._tell_workers(time.time() + self.grace, reason)
        self.link.send(PreemptionNotice(reason))

    def _tell_workers(self, deadline: float, reason: str) -> None:
        """Every live worker of this host: save and return by ``deadline``."""
        from torchrunx import preemption  # noqa: PLC0415 (loaded by the worker group's module)

        if self.current is not None:
            for worker in self.current.group.live():
                preemption.request(worker.notice, deadline, reason)

    def _dispatch(self, data: object, events: int) -> None:
        from torchrunx.agent.preload import TorchPreload  # noqa: PLC0415 (loaded: a lookup)
        from torchrunx.agent.workergroup import Ready  # noqa: PLC0415

        if isinstance(data, Ready):
            assert self.current is not None  # noqa: S101 (only while a group runs)
            self.current.on_ready(data, events)
        elif data == "launcher":
            received = self.link.on_ready(events)
            if received is not None:
                self._on_message(*received)
        elif data == "stdin":
            self.link.on_stdin()
        elif data == "sigterm":
            self._on_sigterm_notice()
        elif isinstance(data, TorchPreload):
            self.preload_pending = False
            self.selector.unregister(data.fileno())  # else it stays readable: a spin

    # -- the launcher's messages ------------------------------------------------------------

    def _on_message(self, message: messages.Message, payload: list[bytearray]) -> None:
        if isinstance(message, WorkerSpec):
            if self.waiting:  # else it is late, or for no attempt of ours: ignored
                self.received = (message, payload)
        elif isinstance(message, Stop):
            self._on_stop(message)
        elif isinstance(message, ToWorker):
            if self.current is not None:  # else its worker is gone: dropped
                self.current.to_worker(message, payload)
        elif isinstance(message, Preempt):
            self._tell_workers(message.deadline, message.reason)
        elif isinstance(message, ShowStacks | AskTimings):
            _ask_workers(self, message)

    def _on_stop(self, message: Stop) -> None:
        if message.restart and self.waiting:
            # No workers run here: ready at once. A spec that came before this Stop belongs
            # to the attempt being abandoned, and its ranks may have reached the store's
            # port: a fresh one then. Otherwise the port already offered stays: the launcher
            # may have sent it in specs already (the Stop crossed this agent's WorkersEnded).
            renew = self.received is not None or self.offered_port is None
            self.received = None
            port = self._next_port() if renew else self.offered_port
            assert port is not None  # noqa: S101 (renewed, or offered before)
            self.offered_port = port
            self.link.send(WorkersEnded(port, message.attempt))
            return
        what = "the workers to restart them" if message.restart else "on request"
        logger.info("stopping %s: %s", what, message.reason)
        self.grace_period = message.grace_period
        self.restart_requested = message.restart
        self.final_stop = self.final_stop or not message.restart
        self._begin_stop(dump_stacks=message.dump_stacks)

    def _launcher_lost(self) -> None:
        """Called by the link once the launcher is gone, or unreachable: stop the workers."""
        self._begin_stop(dump_stacks=False)

    def _pause_output(self, paused: bool) -> None:
        """Called by the link after each change of its outbox: backpressure on the workers."""
        if self.current is not None:
            self.current.group.pause_output(paused)

    def _begin_stop(self, *, dump_stacks: bool) -> None:
        """Stop this attempt's workers (see :meth:`run_workers`); a stop under way goes on."""
        if self.stopping:
            return
        self.stopping = True
        self.dump_on_stop = dump_stacks


def _ask_workers(agent: Agent, message: ShowStacks | AskTimings) -> None:
    """The launcher asks for the live workers' stacks (and states), or their timings."""
    from torchrunx import timer  # noqa: PLC0415 (after the hello, as the agent's loop)
    from torchrunx.worker import stallprobe  # noqa: PLC0415

    current = agent.current
    live = [] if current is None or agent.stopping else current.group.live()
    if isinstance(message, AskTimings):
        for worker in live:
            stallprobe.ask(worker.page, timer.TIMINGS_OFFSET)  # RankTimings, on its channel
    elif current is None or not live:
        agent.link.send(WorkerStacks({}, shown=True))  # no worker runs here now
    else:
        current.show_stacks()
        for worker in live if message.states else ():
            stallprobe.ask(worker.page)  # and its RankState, on its channel


def main(line: bytes) -> None:
    """Entry point of the agent process, called by the boot code with the bootstrap line."""
    try:
        boot = AgentBootstrap.from_json_line(line)
    except ProtocolError as exc:
        sys.stderr.write(f"torchrunx agent: {exc}\n")
        sys.exit(2)
    finally:
        del line  # the raw line holds the secret: no frame of the agent or its workers keeps it
    unsupported = missing_pidfds()
    if unsupported is not None:
        sys.stderr.write(f"torchrunx agent: {unsupported}\n")
        sys.exit(2)
    # A Ctrl-C meant for the launcher must not kill the agent before it cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # From here on, this process is the agent, below its guardian.
    tmpdir = fork_agent(grace=boot.timings.guardian_grace)
    capture_logging(boot.log_level)
    address = (boot.launcher_address, boot.launcher_port)
    try:
        conn = handshake.connect(
            address, boot.secret, "agent", timeout=boot.timings.connect_timeout
        )
    except (OSError, ProtocolError) as exc:
        sys.stderr.write(
            f"torchrunx agent: cannot reach the launcher at {address}: {exc} (if this host "
            "cannot open connections to the launcher, give Launcher(relay='auto'), or --relay "
            "auto: the connections then travel over the agent's own channel)\n"
        )
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
            slots=count_slots(boot.workers, boot.count, gpus, cpus),
            free_port=free_port() if store is None else store.port,
            gpus=gpus,
        )
    )
    agent = Agent(boot, conn, gpus=gpus, cpus=cpus, tmpdir=tmpdir, store=store)
    signal.signal(signal.SIGTERM, agent.on_sigterm)  # a preemption notice, while workers run
    agent.link.forward_logging()
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
