"""``torchrunx check``: every host of a launch checked at once, before a launch.

Each host gets a probe (:mod:`torchrunx.agent.probe`) started exactly as its agent would be:
the same transport (SSH with the user's SSH config and ``known_hosts``, ``srun``, or a local
subprocess), the same shell script (forwarded variables, the launcher's working directory,
``env_file``) and the same interpreter path. So whatever would stop an agent stops the probe,
and is reported for that host. The probe then connects back to the launcher (the address and
port an agent would be given: ``launcher_address`` and ``TORCHRUNX_LAUNCHER_PORT`` apply), host
0 listens on a free port as its rendezvous store would and the other hosts connect to it, and
each host reports its Python, torchrunx and torch versions and its GPUs.

:func:`check_hosts` does it all; :func:`judge` (pure) turns what one host answered into its
problems, each with what to do, and :func:`format_checks` into the lines the command prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import platform
import secrets
import select
import selectors
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from torchrunx.errors import AgentFailedError
from torchrunx.launcher.settings.reach import host_sys_path, package_root
from torchrunx.launcher.starts.agent_pool import START_THREADS
from torchrunx.launcher.starts.agent_starts import AgentStarts, listen_socket
from torchrunx.launcher.state.records import AgentRecord
from torchrunx.wire.bootstrap import BOOT_CODE

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Sequence

    from torchrunx.agent.probe import ProbeReport
    from torchrunx.engines.protocol import AgentProcess
    from torchrunx.launcher.launcher import Launcher
    from torchrunx.launcher.settings.plan import LaunchPlan
    from torchrunx.wire.lines import Record

PROBE_CODE = BOOT_CODE.replace(
    "import torchrunx.agent.agent as a;a.main(", "import torchrunx.agent.probe as a;a.main("
)
"""What the probe's interpreter runs: the agent's boot code, calling the probe instead."""

_LINE_LIMIT = 256
"""Bytes a probe's line may have (a token, an index and a port)."""
_PENDING = 1024
"""Connections read at once at most; past it the oldest is dropped (a probe sends its line as
soon as it connects)."""
_READ_TIMEOUT = 5.0
"""Seconds a connection gets to send its line."""


@dataclasses.dataclass
class _Pending:
    """A connection to the check's port whose line is being read."""

    peer: str
    data: bytes = b""
    until: float = dataclasses.field(default_factory=lambda: time.monotonic() + _READ_TIMEOUT)


def _drop(
    selector: selectors.BaseSelector, pending: dict[socket.socket, _Pending], conn: socket.socket
) -> None:
    selector.unregister(conn)
    del pending[conn]
    conn.close()


@dataclasses.dataclass(frozen=True)
class Local:
    """The launcher's side of the comparison: its versions, and what the launch asks for."""

    python_version: str
    torchrunx: str
    torch: str | None
    backend: str | None
    workers_per_host: object
    env_file: str | None

    @classmethod
    def here(cls, plan: LaunchPlan) -> Local:
        """This process's versions, and ``plan``'s backend and workers per host."""
        try:
            torch_version: str | None = metadata.version("torch")
        except metadata.PackageNotFoundError:
            torch_version = None
        return cls(
            python_version=platform.python_version(),
            torchrunx=str(sys.modules["torchrunx"].__version__),
            torch=torch_version,
            backend=plan.backend,
            workers_per_host=plan.hosts.workers_per_host,
            env_file=None if plan.reach.env_file is None else str(plan.reach.env_file),
        )


@dataclasses.dataclass(frozen=True)
class HostCheck:
    """What the check found on one host.

    Attributes:
        index: The host's index in the launch.
        hostname: The host's name as given.
        method: How its agent would start: ``"local"``, ``"ssh"`` or ``"srun"``.
        report: What its probe answered, if it answered.
        problems: What is wrong, each with what to do; empty if the host is ready.
        facts: What was found (versions, GPUs), for the line of a host that is ready.
        seconds: From the start of the check to the host's answer (or to its failure).
    """

    index: int
    hostname: str
    method: str
    report: ProbeReport | None
    problems: tuple[str, ...]
    facts: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether nothing is wrong on this host."""
        return not self.problems


def check_command(launcher: Launcher, describe: Callable[[BaseException], str]) -> int:
    """``torchrunx check``: print a line per host and a summary; the exit status.

    Args:
        launcher: The launch to check, its fields checked already.
        describe: How the command prints an error that stopped the whole check.

    Returns:
        0 when every host is ready, 1 when one is not (or the check failed), 130 on Ctrl-C.
    """
    started = time.monotonic()
    try:
        checks = check_hosts(launcher)
    except KeyboardInterrupt:
        sys.stderr.write("torchrunx check: interrupted; nothing is left running\n")
        return 130
    except Exception as exc:  # noqa: BLE001 (hosts that cannot be resolved, a port in use)
        sys.stderr.write(describe(exc))
        return 1
    print(format_checks(checks, time.monotonic() - started))  # noqa: T201 (the command's output)

    return 0 if all(check.ok for check in checks) else 1


def check_hosts(launcher: Launcher) -> list[HostCheck]:
    """Check every host of ``launcher`` at once; one :class:`HostCheck` per host, in order.

    Takes at most ``start_timeout`` seconds (plus the time to stop what did not end), however
    many hosts fail. Nothing is left running on any host.

    Raises:
        ValueError: A field of the launcher is invalid, or its hosts cannot be resolved.
        TypeError: A field has the wrong type.
        OSError: The launcher cannot listen (``TORCHRUNX_LAUNCHER_PORT`` in use, say).
    """
    plan = launcher.plan()
    run = _Check(plan)
    try:
        return run.run()
    finally:
        run.close()


class _Check:
    """One run of the check: the listening socket, the acceptor, a thread per host."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.local = Local.here(plan)
        self.timeout = float(plan.timeouts.start)
        self.token = secrets.token_hex(16)
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout
        self.sock = listen_socket(plan)
        self.port = int(self.sock.getsockname()[1])
        self.heard: dict[int, str] = {}
        """Host index -> the address its probe connected back from."""
        self.master_port = 0
        self.master_known = threading.Event()
        self.host0_conn: socket.socket | None = None
        self.others_done = False
        """The other hosts' checks are over: host 0 need not wait for them."""
        hosts = plan.hosts
        self.lines: dict[int, list[tuple[bool, str]]] = {i: [] for i in range(len(hosts.slots))}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.agents = [
            AgentRecord(index, slots, method)
            for index, (slots, method) in enumerate(zip(hosts.slots, hosts.methods, strict=True))
        ]
        self.starts = _ProbeStarts(
            plan=plan,
            agents=self.agents,
            port=self.port,
            secret=b"",
            log_level=logging.INFO,
            emit=self._emit,
            check=self,
        )
        self.starts.prepare()

    def run(self) -> list[HostCheck]:
        acceptor = threading.Thread(target=self._accept, name="torchrunx-check-accept", daemon=True)
        acceptor.start()
        results: list[HostCheck | None] = [None] * len(self.agents)
        # Host 0 in a thread of its own (the others wait for its port); the others as a launch
        # starts its agents: START_THREADS at a time, so the check meets the same limits.
        first = threading.Thread(target=self._host, args=(0, results), name="torchrunx-check-0")
        first.start()
        others = range(1, len(self.agents))
        if others:
            workers = max(1, min(START_THREADS, len(others)))
            with ThreadPoolExecutor(workers, thread_name_prefix="torchrunx-check") as pool:
                list(pool.map(lambda index: self._host(index, results), others))
        self._release_host0()  # the others are over: host 0 stops waiting for them
        first.join()
        self.stopping.set()
        acceptor.join(timeout=2.0)
        return [result for result in results if result is not None]

    def close(self) -> None:
        self.stopping.set()
        self._release_host0()
        self.sock.close()
        self.starts.close()

    def _release_host0(self) -> None:
        with self.lock:
            self.others_done = True
            conn, self.host0_conn = self.host0_conn, None
        if conn is not None:
            conn.close()

    # -- the launcher's port: each probe says who it is -------------------------------------

    def _accept(self) -> None:
        """Accept and read the probes' lines, all in this one thread, until the check ends.

        Connections are read as their bytes come (a selector): one that sends nothing is
        dropped after :data:`_READ_TIMEOUT`, and past :data:`_PENDING` unread connections the
        oldest is dropped, so a flood or a slow stranger never holds up a probe's line.
        """
        pending: dict[socket.socket, _Pending] = {}
        with selectors.DefaultSelector() as selector:
            self.sock.setblocking(False)  # noqa: FBT003 (socket API)
            selector.register(self.sock, selectors.EVENT_READ)
            try:
                while not self.stopping.is_set() and time.monotonic() < self.deadline:
                    for key, _ in selector.select(0.1):
                        if key.fileobj is self.sock:
                            self._take_new(selector, pending)
                        else:
                            self._read_some(selector, pending, key.fileobj)  # type: ignore[arg-type]
                    now = time.monotonic()
                    for conn in [c for c, p in pending.items() if p.until <= now]:
                        _drop(selector, pending, conn)
            finally:
                for conn in list(pending):
                    _drop(selector, pending, conn)

    def _take_new(
        self, selector: selectors.BaseSelector, pending: dict[socket.socket, _Pending]
    ) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:  # none waiting, or out of descriptors: the next turn tries again
                return
            if len(pending) >= _PENDING:
                _drop(selector, pending, next(iter(pending)))  # the oldest
            conn.setblocking(False)  # noqa: FBT003 (socket API)
            pending[conn] = _Pending(str(peer[0]).removeprefix("::ffff:"))
            selector.register(conn, selectors.EVENT_READ)

    def _read_some(
        self,
        selector: selectors.BaseSelector,
        pending: dict[socket.socket, _Pending],
        conn: socket.socket,
    ) -> None:
        entry = pending.get(conn)
        if entry is None:  # dropped for a newer connection earlier in this turn: closed
            return
        try:
            chunk = conn.recv(_LINE_LIMIT - len(entry.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        entry.data += chunk
        if chunk and b"\n" not in entry.data and len(entry.data) < _LINE_LIMIT:
            return  # more to come
        selector.unregister(conn)
        del pending[conn]
        if not self._hear(entry.data.partition(b"\n")[0], entry.peer, conn):
            conn.close()

    def _hear(self, line: bytes, peer: str, conn: socket.socket) -> bool:
        """One probe's line, ``token host_index master_port``; whether ``conn`` is kept.

        A stranger's line is ignored. Host 0's connection is kept open: host 0 waits for the
        other hosts until it closes (:meth:`run`).
        """
        try:
            token, index_word, port_word = line.decode().split()
            index, port = int(index_word), int(port_word)
        except ValueError:
            return False
        if not secrets.compare_digest(token, self.token) or not 0 <= index < len(self.agents):
            return False
        keep = False
        with self.lock:
            self.heard[index] = peer
            if index == 0:
                self.master_port = port
                if not self.others_done:
                    conn.setblocking(True)  # noqa: FBT003 (socket API)
                    self.host0_conn = conn
                    keep = True
        if index == 0:
            self.master_known.set()
        return keep

    def master_for(self, address: str) -> tuple[str, int] | None:
        """Host 0's address and port, as another host reaches it (waits for host 0's answer).

        ``address``: the launcher's address as that host is told it.
        """
        if not self.master_known.wait(max(0.0, self.deadline - time.monotonic())):
            return None
        with self.lock:
            port = self.master_port
            if self.agents[0].remote:
                return (self.heard[0], port) if port else None
            # Host 0 is this machine: the others reach it where they reach the launcher.
            return (address, port) if port else None

    # -- one host ---------------------------------------------------------------------------

    def _emit(self, index: int, record: Record) -> None:
        _, levelno, _, text, _ = record
        with self.lock:
            self.lines[index].append((levelno >= logging.WARNING, text))

    def _host(self, index: int, results: list[HostCheck | None]) -> None:
        agent = self.agents[index]
        failure: str | None = None
        status: int | None = None
        process: AgentProcess | None = None
        try:
            process = self.starts(index)
            status = _read_until_end(process, self.deadline + 1.0)
        except AgentFailedError as exc:
            said = [line.strip() for line in exc.stderr.splitlines() if line.strip()]
            failure = _own_words(said) or exc.reason + (
                f" ({'; '.join(said[-3:])})" if said else ""
            )
        except Exception as exc:  # noqa: BLE001 (one host's surprise must not hide the others)
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            if process is not None:
                with contextlib.suppress(Exception):
                    process.close(grace=1.0)
            if index == 0:
                self.master_known.set()  # the others stop waiting for host 0, answer or not
        with self.lock:
            lines = list(self.lines[index])
        results[index] = judge(
            index,
            agent.slots.hostname,
            agent.method,
            self.local,
            start_failure=failure,
            status=status,
            lines=lines,
            seconds=time.monotonic() - self.started,
            timeout=self.timeout,
            python=self.starts.python_of(agent),
        )


class _ProbeStarts(AgentStarts):
    """:class:`AgentStarts` whose agents are probes: the probe's code and request line."""

    boot_code = PROBE_CODE

    def __init__(self, *, check: _Check, **fields: object) -> None:
        super().__init__(**fields)  # type: ignore[arg-type]  # AgentStarts' own fields
        self.check = check

    def bootstrap(
        self,
        agent: AgentRecord,
        local_address: str,
        *,
        relays: bool = False,  # noqa: ARG002 (checks connect back: they never relay)
    ) -> bytes:
        from torchrunx.agent.probe import ProbeRequest  # noqa: PLC0415 (the probe's module)

        check = self.check
        address = (self.configured_address() or local_address) if agent.remote else local_address
        master = None if agent.index == 0 else check.master_for(address)
        keep_path = self.keeps_path(agent)
        return ProbeRequest(
            sys_path=host_sys_path(self.bundle) if keep_path else tuple(sys.path),
            keep_path=keep_path,
            host_index=agent.index,
            address=address,
            port=self.port,
            token=check.token,
            timeout=max(1.0, check.deadline - time.monotonic()),
            master=master,
            peers=len(self.agents) - 1 if agent.index == 0 else 0,
            local_only=all(not a.remote for a in self.agents),
            package_root=package_root(self.bundle if agent.remote else None),
        ).to_json_line()


def _read_until_end(process: AgentProcess, deadline: float) -> int | None:
    """Read the probe's output until it has ended (its exit status), or ``None`` at ``deadline``."""
    while True:
        readers = process.readers()
        for _, read in readers:
            with contextlib.suppress(BlockingIOError):
                read()
        status = process.wait(0)
        if status is not None and not process.readers():
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            return status
        fds = [fd for fd, _ in process.readers() if fd >= 0]
        if fds:
            select.select(fds, [], [], min(left, 0.05))
        else:
            time.sleep(min(left, 0.02))


# -- judging: pure ----------------------------------------------------------------------------


def judge(  # noqa: PLR0913 (what one host's check found)
    index: int,
    hostname: str,
    method: str,
    local: Local,
    *,
    start_failure: str | None,
    status: int | None,
    lines: Sequence[tuple[bool, str]],
    seconds: float,
    timeout: float,
    python: str | None = None,
) -> HostCheck:
    """What one host's answer means: its problems (each with what to do) and its facts.

    Args:
        index: The host's index.
        hostname: Its name, as given.
        method: How its agent starts.
        local: The launcher's versions and what the launch asks for.
        start_failure: Why the probe could not be started (SSH, ``srun``), if it could not.
        status: The probe's exit status; ``None`` if it did not end in time.
        lines: What it wrote, ``(is_stderr, text)`` in order.
        seconds: When it answered, from the start of the check.
        timeout: The check's time limit (``start_timeout``).
        python: The interpreter the host was asked to run (``python=``, a container's
            ``python3``); ``None``: the launcher's own path.
    """
    from torchrunx.agent.probe import ProbeReport  # noqa: PLC0415 (the probe's module)

    if start_failure is not None:
        return HostCheck(index, hostname, method, None, (start_failure,), (), seconds)
    reports = [ProbeReport.from_line(text) for is_stderr, text in lines if not is_stderr]
    report = next((r for r in reports if r is not None), None)
    if report is None:
        errors = [text for is_stderr, text in lines if is_stderr and text.strip()]
        problem = _no_report(status, errors, timeout, local.env_file, python or sys.executable)
        return HostCheck(index, hostname, method, None, (problem,), (), seconds)
    problems = _compare(report, local)
    if report.route_back != "ok":
        problems.append(
            f"the host cannot reach this machine: {report.route_back}; set launcher_address "
            "(or TORCHRUNX_LAUNCHER_ADDR) to an address of this machine that the host can "
            "reach, and let it through the firewall (TORCHRUNX_LAUNCHER_PORT fixes the port); "
            "or launch with relay='auto' (--relay auto): its connections then travel over "
            "its agent's channel"
        )
    # Host 0's own count is not its problem: each other host says whether it reached host 0.
    if index != 0 and report.master not in (None, "ok"):
        problems.append(
            f"the host cannot reach host 0: {report.master}; workers connect to host 0 on a "
            "free port it picks (MASTER_PORT): open the ports between the hosts"
        )
    if report.pidfds is not None:
        problems.append(report.pidfds)
    facts = [
        f"python {report.python_version} ({report.python})",
        f"torchrunx {report.torchrunx}",
        f"torch {report.torch}" if report.torch else "no torch",
        f"{report.gpus} GPU{'s' * (report.gpus != 1)}" if report.gpus else "no GPU",
        f"{report.cpus} CPU{'s' * (report.cpus != 1)}",
    ]
    return HostCheck(index, hostname, method, report, tuple(problems), tuple(facts), seconds)


def _no_report(
    status: int | None, errors: list[str], timeout: float, env_file: str | None, python: str
) -> str:
    """Why a probe that ran gave no report, with what to do."""
    said = "; ".join(errors[-5:])
    if status is None:
        return f"no answer within start_timeout={timeout:g} s" + (f" ({said})" if said else "")
    own = _own_words(errors)
    if own is not None:
        return own
    if status == 127 or ("No such file or directory" in said and "exec" in said):
        return (
            f"the interpreter {python} is missing on this host ({said}): install the same "
            "environment at the same path on every host, or name this host's own with "
            "Launcher(python=...) (--python PATH)"
        )
    if "ModuleNotFoundError" in said or "ImportError" in said:
        return (
            f"{python} on this host cannot import torchrunx ({said}): install this project in "
            "that environment on every host, or send it with Launcher(ship=('.',)) (--ship .)"
        )
    if "cd:" in said or "is not on this host" in said:
        return (
            f"the working directory {Path.cwd()} is missing on this host ({said}): workers start "
            "there; use a folder that every host has (a shared file system), or send it with "
            "Launcher(ship=('.',)) (--ship .)"
        )
    sourced = f"; it sourced env_file {env_file!r} first: check that file" if env_file else ""
    return f"the probe exited with status {status}" + (f": {said}" if said else "") + sourced


def _own_words(errors: Sequence[str]) -> str | None:
    """The last line the agent's script wrote itself: what is missing, and the option for it."""
    own = [error.removeprefix("torchrunx: ") for error in errors if error.startswith("torchrunx: ")]
    return own[-1] if own else None


def _compare(report: ProbeReport, local: Local) -> list[str]:
    """Differences from the launcher that break a launch, and what the launch needs."""
    problems = []
    if report.python_version.rsplit(".", 1)[0] != local.python_version.rsplit(".", 1)[0]:
        problems.append(
            f"Python {report.python_version} here, {local.python_version} in the launcher: "
            "functions and results are pickled between them; use the same Python minor version"
        )
    if report.torchrunx != local.torchrunx:
        problems.append(
            f"torchrunx {report.torchrunx} here, {local.torchrunx} in the launcher: install the "
            "same version on every host"
        )
    if report.torch != local.torch:
        problems.append(
            f"torch {report.torch or 'is not installed'} here"
            + (f", {local.torch} in the launcher" if local.torch else "")
            + ": install the same torch on every host"
        )
    if report.gpus == 0 and (local.backend == "nccl" or local.workers_per_host == "gpu"):
        asked = "backend='nccl'" if local.backend == "nccl" else "workers_per_host='gpu'"
        problems.append(f"no GPU found, but the launch asks for {asked}")
    return problems


def format_checks(checks: Sequence[HostCheck], seconds: float) -> str:
    """The command's output: a line per host (its problems below it), then a summary."""
    width = max(len(c.hostname) for c in checks)  # a launch has a host at least
    lines = []
    for c in checks:
        head = f"{c.hostname:<{width}}  {'ok  ' if c.ok else 'FAIL'}  {c.method:<5}"
        if c.ok:
            lines.append(f"{head}  {', '.join(c.facts)}")
        else:
            lines.append(head.rstrip())
            lines.extend(f"    - {problem}" for problem in c.problems)
    failed = sum(not c.ok for c in checks)
    hosts = f"{len(checks)} host{'s' * (len(checks) != 1)}"
    verdict = "all ready" if not failed else f"{failed} not ready"
    lines.append(f"{hosts} checked in {seconds:.1f} s: {verdict}")
    return "\n".join(lines)
