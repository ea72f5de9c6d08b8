"""The launcher at scale: 1,000 hosts x 8 workers, with simulated agents and workers.

Usage::

    python benchmarks/many_hosts.py [--hosts 1000] [--workers 8] [--simulators 4] [--floor]

The launcher is the real one (:class:`torchrunx.launcher.launch.orchestrator.Launch`: its listener,
handshakes,
frames, launch state, heartbeats and result collection); only the agents and workers are
simulated. They speak the real protocol (:mod:`torchrunx.wire`) without torch, from a few
processes (``--simulators``, each an asyncio loop holding a share of the hosts), so that this
machine can hold 1,000 connections: per host one agent connection carrying what a real agent
sends, one frame at a time (hello, spec, workers started; for each worker what it forwards from
the worker's channel: its hello and the result of a no-op function, then the channel's end and
the worker's exit; done).

Prints: the time from the call to the result; the launcher's own CPU time, in total and per
host (and that split into user and system time: the system time is the sockets' own work);
its threads at their peak (which must not grow with hosts and workers); its memory growth per
idle connection (RSS over the baseline when every agent has connected, said hello and waits
for its spec, divided by the connections) and per host (peak RSS over the baseline, divided
by the hosts: a host's connection and the state and results of its ranks); and the
simulators' CPU time, with the launch time this machine's cores allow at best
(``cpu_bound_seconds``: the launcher's and the simulators' CPU time over the cores), the floor
under the time from the call to the result. A second,
smaller run (``--hosts / 10``) is printed beside it so the per-host figures can be compared.
With ``--floor``, the same simulators then connect to a bare server doing only the protocol's
own work (:class:`_BareServer`): its time and CPU per host are the floor under the launcher's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import multiprocessing
import os
import pickle
import resource
import select
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import torchrunx as trx
from torchrunx import serialization
from torchrunx.launcher.launch.orchestrator import Launch
from torchrunx.launcher.settings.resolve import HostSlots
from torchrunx.wire import handshake, messages, records

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from wire_helpers import RecordReader  # noqa: E402  (the tests' whole-record reader)

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.connection import Connection

    from torchrunx.events import EventHandler
    from torchrunx.launcher.settings.plan import LaunchPlan

NOOP_RESULT = [bytes(part) for part in serialization.dumps(None)]


# -- the simulated side -----------------------------------------------------------------------


class _Link:
    """A simulated end of one connection: the real handshake and sealed records, on asyncio."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        keys: records.SessionKeys,
    ) -> None:
        self.reader, self.writer = reader, writer
        self.sealer = records.Sealer(keys.send)
        self.opener = RecordReader(keys.receive)
        self.frames: list[tuple[messages.Message, list[bytearray]]] = []

    def send(self, message: messages.Message, payload: list[bytes]) -> None:
        self.send_turn([(message, payload)])

    def send_turn(self, frames: list[tuple[messages.Message, list[bytes]]]) -> None:
        """What a real agent sends in one turn of its loop: small frames share records."""
        pieces: collections.deque[bytes | memoryview] = collections.deque()
        for message, payload in frames:
            pieces.extend(records.frame_pieces(message, payload))
        while pieces:
            self.writer.write(self.sealer.seal(records.take_plaintext(pieces)))

    async def recv(self) -> tuple[messages.Message, list[bytearray]]:
        while not self.frames:
            head = await self.reader.readexactly(4)
            body = await self.reader.readexactly(int.from_bytes(head, "big"))
            self.frames += self.opener.open_record(head + body)
        return self.frames.pop(0)


async def _connect_once(address: tuple[str, int], secret: bytes, role: handshake.Role) -> _Link:
    reader, writer = await asyncio.open_connection(*address)
    try:
        greeting = await reader.readexactly(handshake.GREETING_BYTES)
        reply, expected, keys = handshake.client_reply(secret, greeting, role)
        writer.write(reply)
        proof = await reader.readexactly(handshake.MAC_BYTES)
    except BaseException:
        writer.close()
        raise
    if proof != expected:
        writer.close()
        raise RuntimeError("launcher failed to authenticate")
    return _Link(reader, writer, keys)


async def _connect(address: tuple[str, int], secret: bytes, role: handshake.Role) -> _Link:
    """As :func:`torchrunx.wire.handshake.connect`: a handshake the launcher sheds is tried again.

    The launcher sheds the oldest handshake when more than its cap are pending; a real agent or
    worker then tries again with a short growing pause, and so does the simulator (whose loop,
    holding thousands of connections on a shared core, may answer a greeting late).
    """
    pause = 0.05
    deadline = time.monotonic() + 60.0
    while True:
        try:
            return await _connect_once(address, secret, role)
        except (ConnectionRefusedError, RuntimeError):
            raise
        except (ConnectionError, asyncio.IncompleteReadError):
            if time.monotonic() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, 1.0)


async def _half_close_and_drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """As a real agent or worker after its close record: half-close, then read until the server
    closes (a socket closed with unread data is reset, and a reset may drop what was still being
    sent). A server that closed first (it had the close record: everything came) is no error.
    """
    with contextlib.suppress(OSError):
        writer.write_eof()
        await writer.drain()
        while await reader.read(65536):
            pass


def _worker(link: _Link, spec: messages.WorkerSpec, local: int) -> None:
    """What a real agent forwards for one worker of a no-op function, in order, in the most
    turns of its loop it may take for it (its hello; its result and its channel's end; its
    exit): the most records a real agent makes for it."""
    rank = spec.rank_offset + local
    pid = 100000 + rank
    hello = messages.WorkerHello(rank, local, pid, spec.attempt)
    link.send_turn([(messages.FromWorker(local, hello), [])])
    result = messages.WorkerResult(rank, sent_at=time.time())
    link.send_turn(
        [
            (messages.FromWorker(local, result), NOOP_RESULT),
            (messages.WorkerChannelClosed(local, clean=True), []),
        ]
    )
    link.send_turn([(messages.WorkerExited(local, pid, 0, None, at=time.time()), [])])


async def _agent(boot: dict[str, Any]) -> None:
    start_at = float(boot.get("start_at", 0.0))  # a simulated start's latency (tree_sim.py)
    await asyncio.sleep(max(start_at - time.time(), 0.0))
    address = (boot["launcher"][0], int(boot["launcher"][1]))
    secret = bytes.fromhex(boot["secret"])
    link = await _connect(address, secret, "agent")
    reader, writer = link.reader, link.writer
    index = int(boot["host_index"])
    workers = int(boot["workers"] or 1)
    link.send(messages.AgentHello(index, boot["hostname"], 50000 + index, workers, 0), [])

    async def heartbeats() -> None:
        while True:
            await asyncio.sleep(1.0)
            link.send(messages.Heartbeat(), [])

    beating = asyncio.create_task(heartbeats())
    try:
        while True:
            message, _payload = await link.recv()
            if isinstance(message, messages.WorkerSpec):
                spec = message
                break
        await asyncio.sleep(float(boot.get("workers_after", 0.0)))  # the workers' own start
        pids = tuple(100000 + spec.rank_offset + i for i in range(spec.num_workers))
        link.send(messages.WorkersStarted(pids), [])
        for local in range(spec.num_workers):
            _worker(link, spec, local)
            await writer.drain()
    except BaseException:
        writer.close()  # as a real agent that fails: its connection ends, the launcher sees it
        raise
    finally:
        beating.cancel()
    link.send(messages.AgentDone(), [])
    writer.write(link.sealer.seal_close())
    await _half_close_and_drain(reader, writer)
    writer.close()


def _report_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:  # say why, at once
        print(f"simulated agent failed: {task.exception()!r}", file=sys.stderr)


def _simulator(inbox: Connection) -> None:
    """One simulator process: an asyncio loop running the agents handed to it."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        while True:
            line = await loop.run_in_executor(None, inbox.recv)
            if line is None:
                break
            task = asyncio.create_task(_agent(json.loads(line)))
            task.add_done_callback(_report_failure)
            tasks.append(task)
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


class _SimulatedAgent:
    """What the launcher holds for a simulated agent: no process, so nothing to wait for."""

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        self.exit_fd = -1

    def stderr_tail(self) -> str:
        return ""

    def readers(self) -> list[tuple[int, Any]]:
        return []

    def wait(self, timeout: float | None) -> int | None:
        del timeout
        return None

    def close(self, grace: float = 5.0) -> None:
        del grace


# -- the measurement --------------------------------------------------------------------------


def _raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _rss_kib() -> int:
    with open("/proc/self/status") as status:  # noqa: PTH123
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _start_simulators(count: int) -> tuple[list[Connection], list[multiprocessing.Process]]:
    """``count`` simulator processes, started; the pipes that hand each its agents."""
    pipes = [multiprocessing.Pipe(duplex=False) for _ in range(count)]
    processes = [
        multiprocessing.Process(target=_simulator, args=(receiver,), daemon=True)
        for receiver, _ in pipes
    ]
    for process in processes:
        process.start()
    return [sender for _, sender in pipes], processes


def _stop_simulators(senders: list[Connection], processes: list[multiprocessing.Process]) -> None:
    """Tell the simulators no agent is coming; wait for them (30 s each at most)."""
    for sender in senders:
        sender.send(None)
    for process in processes:
        process.join(30)


def _cpu_per_host(
    cpu: float, before: resource.struct_rusage, after: resource.struct_rusage, hosts: int
) -> dict[str, float]:
    """This process's CPU time per host in ms: in total, and its user and system parts."""
    return {
        "cpu_ms_per_host": cpu / hosts * 1000,
        "user_ms_per_host": (after.ru_utime - before.ru_utime) / hosts * 1000,
        "system_ms_per_host": (after.ru_stime - before.ru_stime) / hosts * 1000,
    }


def _simulated_plan(launcher: trx.Launcher, slots: list[HostSlots]) -> LaunchPlan:
    """The plan ``launcher.plan()`` would make, without resolving the fake names: ssh to each."""
    local = dataclasses.replace(launcher, hostnames=["localhost"]).plan()
    simulated = dataclasses.replace(local.hosts, slots=tuple(slots), methods=("ssh",) * len(slots))
    return dataclasses.replace(local, hosts=simulated)


def measure(  # noqa: PLR0913, PLR0915 (one measured launch, step by step, and its knobs)
    hosts: int,
    workers: int,
    simulators: int,
    *,
    start_after: Callable[[int], float] | None = None,
    workers_after: float = 0.0,
    event_handlers: tuple[EventHandler, ...] = (),
) -> dict[str, float]:
    """One launch of ``hosts`` x ``workers`` simulated ranks; the launcher's figures.

    ``start_after``: each host index's simulated start latency (its agent connects that many
    seconds after the call; none: at once); ``workers_after``: the seconds each agent takes
    between its spec and its workers' hellos; ``event_handlers``: the launcher's.
    """
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    senders, processes = _start_simulators(simulators)
    launcher = trx.Launcher(
        hostnames=[f"sim{i}" for i in range(hosts)],
        workers_per_host=workers,
        backend=None,
        log_handlers=[],
        start_timeout=300,
        agent_timeout=120,
        event_handlers=event_handlers,
    )
    plan = _simulated_plan(launcher, [HostSlots(f"sim{i}", workers) for i in range(hosts)])
    call = serialization.dumps((print, (), {}))
    peak_threads = threading.active_count()
    baseline = _rss_kib()
    peak_rss = baseline
    launch: Launch

    def start(index: int) -> _SimulatedAgent:
        agent = launch.state.agents[index]
        line = launch.session.starts.bootstrap(agent, "127.0.0.1")  # what a real start sends
        if start_after is not None or workers_after:
            boot = json.loads(line)
            boot["start_at"] = called_at + (start_after(index) if start_after else 0.0)
            boot["workers_after"] = workers_after
            line = json.dumps(boot).encode()
        senders[index % simulators].send(line.decode())
        return _SimulatedAgent(agent.slots.hostname)

    cpu_before = time.process_time()
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    called_at = time.time()
    launch = Launch(plan, call, starter=start)
    idle_rss = 0
    send_specs = launch.dispatch.send_specs  # measured here, not changed

    def send_specs_measured(call: list[memoryview]) -> None:  # every agent waits: idle links
        nonlocal idle_rss
        idle_rss = idle_rss or _rss_kib()
        send_specs(call)

    launch.dispatch.send_specs = send_specs_measured  # type: ignore[method-assign]
    sampler_stop = threading.Event()

    def sample() -> None:  # the measuring thread itself is not counted
        nonlocal peak_threads, peak_rss
        while not sampler_stop.wait(0.05):
            peak_threads = max(peak_threads, threading.active_count() - 1)
            peak_rss = max(peak_rss, _rss_kib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        results = launch.execute()
    finally:
        elapsed = time.perf_counter() - started
        launch.close()
        sampler_stop.set()
        sampler.join()
    cpu = time.process_time() - cpu_before
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _stop_simulators(senders, processes)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the simulators, once joined
    simulators_cpu = (children.ru_utime + children.ru_stime) - (
        children_before.ru_utime + children_before.ru_stime
    )
    ranks = sum(len(per_host) for per_host in results)
    assert ranks == hosts * workers, ranks
    return {
        "hosts": hosts,
        "ranks": ranks,
        "seconds": elapsed,
        "cpu_seconds": cpu,
        **_cpu_per_host(cpu, usage_before, usage, hosts),
        "peak_threads": peak_threads,
        "kib_per_idle_connection": max(idle_rss - baseline, 0) / hosts,
        "kib_per_host": max(peak_rss - baseline, 0) / hosts,
        "simulators_cpu_seconds": simulators_cpu,
        "cpu_bound_seconds": (cpu + simulators_cpu) / (os.cpu_count() or 1),
    }


# -- the floor: a bare server doing the same protocol work ------------------------------------


class _BareConnection:
    """One connection of the bare server: the handshake, then records opened and frames cut.

    No launch state, no events, no buffers reused: the least a Python process does for this
    protocol (a greeting, the client's proof checked, its keys, each record decrypted and
    each frame's header unpickled, a spec sent to each agent, the close record read).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.nonce = os.urandom(handshake.NONCE_BYTES)
        self.reply = b""
        self.opener: AESGCM | None = None
        self.sealer: records.Sealer | None = None
        self.received = 0
        self.data = bytearray()
        self.plain = bytearray()
        self.closed = False


def _bare_frames(conn: _BareConnection) -> list[messages.Message]:
    """Open every whole record that came; return the messages of the frames they complete."""
    assert conn.opener is not None
    out: list[messages.Message] = []
    data = conn.data
    start = 0
    while len(data) - start >= 4:
        size = int.from_bytes(data[start : start + 4], "big")
        end = start + 4 + size
        if end > len(data):
            break
        nonce = (conn.received).to_bytes(12, "big")
        conn.received += 1
        plain = conn.opener.decrypt(
            nonce, bytes(data[start + 4 : end]), bytes(data[start : start + 4])
        )
        start = end
        if not plain:
            conn.closed = True
            continue
        conn.plain += plain
        while len(conn.plain) >= 12:
            header, parts = struct.unpack_from("!QI", conn.plain)
            sizes = struct.unpack_from(f"!{parts}Q", conn.plain, 12)
            begin = 12 + 8 * parts
            total = begin + header + sum(sizes)
            if len(conn.plain) < total:
                break
            out.append(pickle.loads(conn.plain[begin : begin + header]))
            del conn.plain[:total]
    del data[:start]
    return out


class _BareServer:
    """The floor's server: one epoll loop, no launch state, no events, nothing reused."""

    def __init__(self, hosts: int, workers: int) -> None:
        self.hosts, self.workers = hosts, workers
        self.secret = handshake.new_secret()
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=4096)
        self.sock.settimeout(0.0)
        self.port = int(self.sock.getsockname()[1])
        self.epoll = select.epoll()
        self.epoll.register(self.sock.fileno(), select.EPOLLIN)
        self.conns: dict[int, _BareConnection] = {}
        self.results = 0
        self.agents_done = 0

    def serve(self, timeout: float = 300.0) -> None:
        """Until every agent said it is done, every result came and every connection ended.

        Raises:
            TimeoutError: Not within ``timeout`` seconds (a simulated agent failed, say).
        """
        deadline = time.monotonic() + timeout
        try:
            while (
                self.agents_done < self.hosts or self.results < self.hosts * self.workers
            ) or self.conns:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the floor's launch did not end within {timeout:g} s: "
                        f"{self.agents_done} of {self.hosts} agents done, "
                        f"{self.results} results, {len(self.conns)} connections open"
                    )
                for fd, _events in self.epoll.poll(1.0):
                    if fd == self.sock.fileno():
                        self._accept()
                    else:
                        self._readable(self.conns[fd])
        finally:
            for conn in self.conns.values():
                conn.sock.close()
            self.epoll.close()
            self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except BlockingIOError:
                return
            sock.settimeout(0.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _BareConnection(sock)
            sock.send(handshake.server_greeting(conn.nonce))
            self.conns[sock.fileno()] = conn
            self.epoll.register(sock.fileno(), select.EPOLLIN)

    def _readable(self, conn: _BareConnection) -> None:
        try:
            chunk = conn.sock.recv(1 << 16)
        except BlockingIOError:
            return
        ended = not chunk
        if conn.opener is None:
            need = handshake.CLIENT_REPLY_BYTES - len(conn.reply)
            conn.reply += chunk[:need]
            if len(conn.reply) < handshake.CLIENT_REPLY_BYTES:
                return
            _role, proof, keys = handshake.check_client_reply(self.secret, conn.nonce, conn.reply)
            conn.sock.send(proof)
            conn.opener, conn.sealer = AESGCM(keys.receive), records.Sealer(keys.send)
            chunk = chunk[need:]
        conn.data += chunk
        for message in _bare_frames(conn):
            self._on_message(conn, message)
        if ended and not conn.closed:  # as the launcher would: that peer failed
            raise RuntimeError("a simulated peer's connection ended without its close record")
        if conn.closed:
            self.epoll.unregister(conn.sock.fileno())
            del self.conns[conn.sock.fileno()]
            conn.sock.close()

    def _on_message(self, conn: _BareConnection, message: messages.Message) -> None:
        if isinstance(message, messages.AgentHello):
            spec = messages.WorkerSpec(
                host_index=message.host_index,
                hostname=message.hostname,
                num_workers=self.workers,
                rank_offset=message.host_index * self.workers,
                world_size=self.hosts * self.workers,
                master_addr="127.0.0.1",
                master_port=1,
                backend=None,
                timeout=60.0,
                num_hosts=self.hosts,
            )
            assert conn.sealer is not None
            for record in conn.sealer.seal_frame(spec):
                conn.sock.send(record)
        elif isinstance(message, messages.FromWorker):
            self.results += isinstance(message.message, messages.WorkerResult)
        elif isinstance(message, messages.AgentDone):
            self.agents_done += 1


def measure_floor(hosts: int, workers: int, simulators: int) -> dict[str, float]:
    """The same simulated agents and workers against :class:`_BareServer`: its CPU per host."""
    senders, processes = _start_simulators(simulators)
    server = _BareServer(hosts, workers)
    cpu_before = time.process_time()
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    for index in range(hosts):
        boot = {
            "host_index": index,
            "hostname": f"sim{index}",
            "launcher": ["127.0.0.1", server.port],
            "secret": server.secret.hex(),
            "workers": workers,
        }
        senders[index % simulators].send(json.dumps(boot))
    server.serve()
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _stop_simulators(senders, processes)
    return {"hosts": hosts, "seconds": elapsed, **_cpu_per_host(cpu, usage_before, usage, hosts)}


def main() -> None:
    """Run the small and the large launch and print their figures side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--simulators", type=int, default=4)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run the same simulators against a bare server (the floor), after the launches",
    )
    args = parser.parse_args()
    _raise_fd_limit()
    os.environ.setdefault("TORCHRUNX_LOG_LEVEL", "WARNING")
    small = measure(max(args.hosts // 10, 1), args.workers, args.simulators)
    large = measure(args.hosts, args.workers, args.simulators)
    print(f"{'':24}{'small':>12}{'large':>12}")
    for key in small:
        print(f"{key:24}{small[key]:12.3f}{large[key]:12.3f}")
    print(
        f"launcher threads: {small['peak_threads']:.0f} at {small['hosts']:.0f} hosts, "
        f"{large['peak_threads']:.0f} at {large['hosts']:.0f} hosts"
    )
    print(
        f"launcher CPU per host: {large['cpu_ms_per_host']:.2f} ms "
        f"({large['cpu_ms_per_host'] / small['cpu_ms_per_host']:.2f}x the small launch's)"
    )
    if args.floor:
        floor = measure_floor(args.hosts, args.workers, args.simulators)
        for key in ("seconds", "cpu_ms_per_host", "user_ms_per_host", "system_ms_per_host"):
            print(f"floor {key:18}{floor[key]:12.3f}")
        print(
            f"launcher CPU per host over the floor's: "
            f"{large['cpu_ms_per_host'] / floor['cpu_ms_per_host']:.2f}x"
        )


if __name__ == "__main__":
    main()
