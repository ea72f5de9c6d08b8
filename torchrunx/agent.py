"""The agent: one per host; forks the workers, watches them, and obeys the launcher.

Process tree on one host::

    agent  (python -c BOOT, started by bash over SSH or as a local subprocess)
    ├── worker local_rank 0   (forked; own session and process group; PDEATHSIG=SIGKILL)
    ├── worker local_rank 1
    └── ...

Sequence: connect to the launcher and authenticate; send :class:`AgentHello` (slots, a free
port); import torch in a background thread meanwhile (once per host, never touching CUDA);
receive the :class:`WorkerSpec` with the cloudpickled call as payload; fork the workers;
then loop on one selector over the launcher connection, stdin and one pidfd per worker, so
a worker's death is reported the moment it happens. The agent is single-threaded when it
forks (the preload thread has been joined) and ends when its workers have ended.

The agent stops its workers (SIGTERM to each worker's process group, SIGKILL after the
grace period) when the launcher says :class:`Stop`, when the launcher connection or stdin
closes (the launcher died), or when no heartbeat arrived for ``agent_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from torchrunx import protocol
from torchrunx.errors import ProtocolError
from torchrunx.hosts import count_local_slots
from torchrunx.protocol import (
    AgentDone,
    AgentHello,
    Connection,
    Heartbeat,
    Stop,
    WorkerExited,
    WorkerSpec,
    WorkersStarted,
)

_PR_SET_PDEATHSIG = 1


@dataclass
class _Worker:
    local_rank: int
    pid: int
    pidfd: int
    ended: bool = False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _preload_torch() -> None:
    # Importing torch.distributed does not initialise CUDA; forked workers inherit the modules.
    with contextlib.suppress(ImportError):
        import torch.distributed  # noqa: F401, PLC0415


class Agent:
    """The live agent of one host (created by :func:`main`)."""

    def __init__(self, boot: dict[str, Any], connection: Connection) -> None:
        """Keep the bootstrap settings and the authenticated launcher connection."""
        self.boot = boot
        self.conn = connection
        self.selector = selectors.DefaultSelector()
        self.workers: list[_Worker] = []
        self.heartbeat_interval = float(boot["heartbeat_interval"])
        self.agent_timeout = float(boot["agent_timeout"])
        self.last_heard = time.monotonic()
        self.stop_deadline: float | None = None
        self.launcher_alive = True

    # -- start ---------------------------------------------------------------------------

    def receive_spec(self) -> tuple[WorkerSpec, list[bytearray]]:
        """Wait for the worker spec, answering heartbeats meanwhile."""
        preload: threading.Thread | None = None
        if self.boot["preload_torch"]:
            preload = threading.Thread(target=_preload_torch, name="torchrunx-preload")
            preload.start()
        self.conn.sock.settimeout(self.agent_timeout)
        try:
            while True:
                message, payload = self.conn.recv()
                if isinstance(message, WorkerSpec):
                    break
                if isinstance(message, Stop):
                    raise SystemExit(0)
        finally:
            if preload is not None:
                preload.join()
        return message, payload

    def start_workers(self, spec: WorkerSpec, payload: list[bytearray]) -> None:
        """Fork ``spec.num_workers`` workers and register their pidfds."""
        sys.stdout.flush()
        sys.stderr.flush()
        for local_rank in range(spec.num_workers):
            pid = os.fork()
            if pid == 0:
                self._become_worker(spec, payload, local_rank)
            pidfd = os.pidfd_open(pid)
            worker = _Worker(local_rank, pid, pidfd)
            self.workers.append(worker)
            self.selector.register(pidfd, selectors.EVENT_READ, worker)
        self.conn.send(WorkersStarted(tuple(w.pid for w in self.workers)))

    def _become_worker(
        self, spec: WorkerSpec, payload: list[bytearray], local_rank: int
    ) -> NoReturn:
        code = 1
        try:
            os.setsid()  # own process group: the agent can stop the worker's whole tree
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
                signal.signal(signum, signal.SIG_DFL)
            self.selector.close()
            for sibling in self.workers:
                os.close(sibling.pidfd)
            self.conn.sock.close()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            if os.getppid() != self.boot["agent_pid"]:
                os._exit(1)  # the agent died before PDEATHSIG was armed
            from torchrunx import worker  # noqa: PLC0415 (only in the worker)

            code = worker.run(self.boot, spec, payload, local_rank)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    # -- monitor -------------------------------------------------------------------------

    def monitor(self) -> None:
        """Loop until every worker has ended; then tell the launcher."""
        self.conn.sock.settimeout(self.agent_timeout)
        self.selector.register(self.conn.sock, selectors.EVENT_READ, "launcher")
        self.selector.register(0, selectors.EVENT_READ, "stdin")
        next_heartbeat = time.monotonic()
        while not all(w.ended for w in self.workers):
            now = time.monotonic()
            if now >= next_heartbeat:
                self._send(Heartbeat())
                next_heartbeat = now + self.heartbeat_interval
            if self.launcher_alive and now - self.last_heard > self.agent_timeout:
                self._begin_stop("no heartbeat from the launcher", 3.0)
                self.launcher_alive = False
            if self.stop_deadline is not None and now >= self.stop_deadline:
                self._signal_workers(signal.SIGKILL)
                self.stop_deadline = None
            timeout = next_heartbeat - now
            if self.stop_deadline is not None:
                timeout = min(timeout, self.stop_deadline - now)
            for key, _ in self.selector.select(max(timeout, 0.0)):
                self._on_ready(key.data)
        self._send(AgentDone())

    def _on_ready(self, source: Any) -> None:  # noqa: ANN401 (selector payload)
        if isinstance(source, _Worker):
            self._reap(source)
        elif source == "launcher":
            self._on_launcher_message()
        elif source == "stdin" and not os.read(0, 4096):
            self.selector.unregister(0)
            self._begin_stop("the launcher's stdin closed", 3.0)

    def _on_launcher_message(self) -> None:
        try:
            message, _ = self.conn.recv()
        except (OSError, ProtocolError):
            self.selector.unregister(self.conn.sock)
            self.launcher_alive = False
            self._begin_stop("the connection to the launcher closed", 3.0)
            return
        self.last_heard = time.monotonic()
        if isinstance(message, Stop):
            self._begin_stop(message.reason, message.grace_period)

    def _reap(self, worker: _Worker) -> None:
        _, status = os.waitpid(worker.pid, 0)
        self.selector.unregister(worker.pidfd)
        os.close(worker.pidfd)
        worker.ended = True
        exitcode = os.waitstatus_to_exitcode(status)
        sig = -exitcode if exitcode < 0 else None
        # Whatever the worker started in its own process group goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        self._send(WorkerExited(worker.local_rank, worker.pid, None if sig else exitcode, sig))

    def _begin_stop(self, reason: str, grace_period: float) -> None:
        if self.stop_deadline is not None or all(w.ended for w in self.workers):
            return
        del reason  # the launcher knows why; the agent only obeys
        self._signal_workers(signal.SIGTERM)
        self.stop_deadline = time.monotonic() + grace_period

    def _signal_workers(self, signum: int) -> None:
        for worker in self.workers:
            if not worker.ended:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(worker.pid, signum)

    def _send(self, message: protocol.Message) -> None:
        if not self.launcher_alive:
            return
        try:
            self.conn.send(message)
        except OSError:
            self.launcher_alive = False
            self._begin_stop("the connection to the launcher broke", 3.0)

    def close(self) -> None:
        """Kill any worker still alive and release every descriptor."""
        self._signal_workers(signal.SIGKILL)
        for worker in self.workers:
            if not worker.ended:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(worker.pid, 0)
                os.close(worker.pidfd)
                worker.ended = True
        self.selector.close()
        self.conn.close()


def main(boot: dict[str, Any]) -> None:
    """Entry point of the agent process (called by the boot code with the bootstrap line)."""
    boot["agent_pid"] = os.getpid()
    # A Ctrl-C meant for the launcher must not kill the agent before it cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    secret = bytes.fromhex(boot["secret"])
    address = (boot["launcher"][0], int(boot["launcher"][1]))
    try:
        conn = protocol.connect(address, secret, "agent", timeout=float(boot["agent_timeout"]) * 2)
    except (OSError, ProtocolError) as exc:
        sys.stderr.write(f"torchrunx agent: cannot reach the launcher at {address}: {exc}\n")
        sys.exit(2)
    slots = boot["workers"] if boot["workers"] is not None else count_local_slots()
    conn.send(
        AgentHello(
            host_index=int(boot["host_index"]),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            slots=int(slots),
            free_port=_free_port(),
        )
    )
    agent = Agent(boot, conn)
    try:
        spec, payload = agent.receive_spec()
        agent.start_workers(spec, payload)
        agent.monitor()
    except (OSError, ProtocolError) as exc:
        sys.stderr.write(f"torchrunx agent: lost the launcher: {exc}\n")
    finally:
        agent.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown (torch's takes ~0.5 s): the launcher waits for this exit.
        os._exit(0)
