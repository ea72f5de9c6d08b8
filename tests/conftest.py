"""Shared pytest fixtures."""

from __future__ import annotations

import compileall
import contextlib
import fnmatch
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pure_guard
import pytest
from cluster import cluster_unavailable_reason, start_cluster, xdist_worker
from slurm_cluster import DAEMONS, slurm_processes, slurm_unavailable_reason, start_slurm_cluster

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from cluster import TestCluster
    from slurm_cluster import SlurmCluster


GROUPS_BY_FIXTURE = {"slurm": "slurm", "ray_cluster": "ray"}
"""Tests that use one of these fixtures run on one pytest-xdist worker, in the group named: the
SLURM and Ray test clusters exist once on a machine (one ``slurmctld`` port, one ``munged``)."""
GROUPS_BY_FILE = {
    "test_frameworks.py": "frameworks",  # DeepSpeed's op, compiled once; the heaviest launches
    "test_containers.py": "containers",  # the machine's podman images and containers
    "test_plugins.py": "plugins",  # a package installed into the environment, then removed
}
"""Test files whose tests run on one pytest-xdist worker, in the group named."""
GROUPS_FIRST = ("frameworks", "slurm", "ray", "containers", "plugins")
"""The groups in the order they are handed out, before every other test: the longest first."""
QUICK_FILES = (
    "test_rules_*.py",
    "test_pure.py",
    "test_launch_state.py",
    "test_warm_state.py",
    "test_xdist.py",
    "test_docs_data.py",
)
"""The pure tests (no process, socket or clock): marked ``quick``, with the smoke launches
marked by hand (``scripts/test.sh --quick``, ``pytest -m quick``)."""


BYTECODE_OFF = sys.dont_write_bytecode
"""``PYTHONDONTWRITEBYTECODE`` (set on the machine the tests run on): no import writes a cache."""
# Until the tests are collected (see pytest_collection_finish), imports may write their
# caches: pytest's rewritten test modules then come from tests/__pycache__, not rewritten again
# by each pytest-xdist worker in every run (8 CPU-s each).
sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    """Compile the package and the test modules to bytecode (once, before the workers start).

    Where ``PYTHONDONTWRITEBYTECODE`` is set, no import writes its cache, so every launcher,
    agent and worker the tests start compiled torchrunx from source (and each worker the test
    module its function comes from): 50 ms of CPU per agent, 150 ms per launcher process,
    about 10% of the suite's CPU. Up to date, this costs a look at each file's time.
    """
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller did it
        return
    root = Path(__file__).resolve().parent.parent
    for folder in (root / "torchrunx", root / "tests"):
        compileall.compile_dir(folder, quiet=2)


def pytest_collection_finish(session: pytest.Session) -> None:
    """From here on, imports write no cache where the machine says so (a test that imports a
    module of its own folder leaves no ``__pycache__`` there)."""
    sys.dont_write_bytecode = BYTECODE_OFF


def pytest_itemcollected(item: pytest.Item) -> None:
    """Put the tests of :data:`GROUPS_BY_FIXTURE` and :data:`GROUPS_BY_FILE` in their groups,
    and mark those of :data:`QUICK_FILES` ``quick``.

    ``--dist loadgroup`` (``scripts/test.sh``) runs a group's tests on one worker, one after the
    other; every other test goes to whichever worker is free. Without xdist, nothing changes.
    Marked as each test is collected: pytest-xdist reads the groups in its own
    ``pytest_collection_modifyitems``, which may run before this file's.
    """
    if any(fnmatch.fnmatch(item.path.name, pattern) for pattern in QUICK_FILES):
        item.add_marker(pytest.mark.quick)
    group = GROUPS_BY_FILE.get(item.path.name)
    for fixture, name in GROUPS_BY_FIXTURE.items():
        if fixture in getattr(item, "fixturenames", ()):
            group = name
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup``, each grouped test's id ends with ``@GROUP``, as xdist means.

    pytest-xdist 3.8 sets ``item._nodeid``, which pytest 9 no longer reads (its ``nodeid`` comes
    from ``item._id``): the groups would be silently ignored, and two workers would each start
    a SLURM cluster. Done here where xdist's did not; checked either way.
    """
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers only
        return
    from _pytest.nodeid import NodeId

    # The groups first, longest first: xdist hands out work in collection order, and a long
    # group handed out last would run alone at the end (each worker collects the same order).
    first = {name: place for place, name in enumerate(GROUPS_FIRST)}
    items.sort(
        key=lambda item: min(
            (first.get(str(mark.args[0]), len(first)) for mark in item.iter_markers("xdist_group")),
            default=len(first) + 1,
        )
    )

    for item in items:
        names = sorted({str(mark.args[0]) for mark in item.iter_markers("xdist_group")})
        if not names:
            continue
        suffix = "@" + "_".join(names)
        if not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)  # type: ignore[attr-defined]
        if not item.nodeid.endswith(suffix):
            msg = f"cannot put {item.nodeid} in its xdist group {suffix[1:]}"
            raise RuntimeError(msg)


@pytest.fixture(scope="session", autouse=True)
def worker_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, each worker's own ``TMPDIR`` (in its base folder), for what it starts.

    Tests that count what launches leave in the temporary folder then see their own worker's
    launches only, not those of the workers beside them. Without xdist, nothing changes.
    """
    if xdist_worker() is None:
        yield
        return
    path = tmp_path_factory.getbasetemp() / "tmp"
    path.mkdir(exist_ok=True)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # read TMPDIR again
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_reaches_started_commands() -> None:
    """Commands the tests start get SIGINT's default action, as in a terminal.

    A suite started as a background job (``cmd &`` in a script) inherits SIGINT ignored, and so
    would every launcher it starts: Python then never raises KeyboardInterrupt, rightly, and the
    Ctrl-C tests would wait for nothing. A handled signal is reset to its default at exec.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The same for SIGQUIT (Ctrl-\, tests/test_where.py): its default action, as in a terminal.
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    """A running 2-host SSH test cluster (``node1``, ``node2``), shared by the whole session.

    Under pytest-xdist each worker has its own (worker 1: ``w1node1``, ``w1node2`` on
    ``10.211.0``, see ``cluster.worker_profile``): tests name the hosts ``cluster.names()``.
    Skipped where no cluster can be made, except on CI (``CI`` set), where that is a failure.
    """
    reason = cluster_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"test cluster required on CI: {reason}")
        pytest.skip(reason)
    test_cluster = start_cluster(2, tmp_path_factory.mktemp("cluster"))
    yield test_cluster
    test_cluster.stop()


@pytest.fixture(scope="session")
def _isolated_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TestCluster]]:
    """The session's isolated cluster, in a list: :func:`isolated` may replace it."""
    reason = cluster_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"test cluster required on CI: {reason}")
        pytest.skip(reason)
    made = [start_cluster(2, tmp_path_factory.mktemp("isolated"), "reach", isolated=True)]
    _ISOLATED_NOW[:] = [made]
    yield made
    _ISOLATED_NOW.clear()
    made[0].stop()


_ISOLATED_NOW: list[list[TestCluster]] = []
"""This worker's isolated cluster holder, once made: watched after every test."""


def _sshd_gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (gone, or a zombie not yet reaped); reaps nothing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.fixture(autouse=True)
def _watch_isolated_sshd(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: if this worker's isolated hosts' ``sshd`` died during it, note the test.

    Their ``sshd`` were found dead a few times in the full suite (see :func:`isolated`); this
    names the test during which it happened (two reads of ``/proc``).
    """
    yield
    if not _ISOLATED_NOW or getattr(made := _ISOLATED_NOW[0][0], "death_noted", False):
        return
    gone = [name for name, daemon in made._daemons.items() if _sshd_gone(daemon.pid)]
    if gone:
        made.death_noted = True  # type: ignore[attr-defined]  (once per cluster)
        with ISOLATED_DEATHS.open("a") as notes:
            notes.write(f"{time.ctime()} during {request.node.nodeid}: sshd of {gone} gone\n")


ISOLATED_DEATHS = Path(tempfile.gettempdir()) / "torchrunx-isolated-sshd-deaths.txt"
"""Where :func:`isolated` notes an isolated host's ``sshd`` found dead between tests."""


@pytest.fixture
def isolated(
    _isolated_hosts: list[TestCluster],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> TestCluster:
    """Two SSH test hosts (``hnode1``, ``hnode2``; each xdist worker's own, like ``cluster``)
    that do not share the launcher's files.

    In their mount namespace the checkout and ``launcher_only`` are empty folders and
    ``~/.cache`` is their own (see ``start_cluster(..., isolated=True)`` in ``cluster.py``).

    A few times in the full parallel suite (never alone) both hosts' ``sshd`` were gone when a
    test of tests/test_reach.py came to use them: :func:`_watch_isolated_sshd` named the test
    during which they died, a test of the agent's worker group that gave it this process's pid
    as the group's root, whose close SIGKILLs every process below the root (fixed). An ``sshd``
    found dead is still noted in :data:`ISOLATED_DEATHS` (its exit status, the test about to
    run, the test during which it died) and the hosts are made again, so that one test's damage
    does not fail the others.
    """
    return _alive(_isolated_hosts, tmp_path_factory, request.node.nodeid)


@pytest.fixture(scope="module")
def isolated_module(
    _isolated_hosts: list[TestCluster],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> TestCluster:
    """:func:`isolated` for a module's fixtures and tests (tests/test_containers.py)."""
    return _alive(_isolated_hosts, tmp_path_factory, request.node.nodeid)


def _alive(holder: list[TestCluster], factory: pytest.TempPathFactory, where: str) -> TestCluster:
    """``holder``'s cluster, made again if a host's ``sshd`` died (noted; see :func:`isolated`)."""
    made = holder[0]
    dead = {n: d.returncode for n, d in made._daemons.items() if d.poll() is not None}
    if dead:
        with ISOLATED_DEATHS.open("a") as notes:
            # Popen reports 0 also when another waitpid reaped it (ECHILD): say if it runs.
            running = {n: os.path.exists(f"/proc/{d.pid}") for n, d in made._daemons.items()}
            notes.write(f"{time.ctime()} before {where}: sshd exit {dead}, pid alive {running}\n")
            for name in dead:  # what sshd said last (-e: its log), to find the cause
                log = made.workdir / name / "sshd.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
                notes.write(f"--- {log}:\n{tail}\n")
        made.stop()
        made = start_cluster(2, factory.mktemp("isolated"), "reach", isolated=True)
        holder[0] = made
    return made


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running 2-node SLURM cluster (``snode1``, ``snode2``, also SSH hosts), for the session.

    Skipped where it cannot be made (no root, no ``slurm-wlm`` or ``munge``...), except on CI
    (``CI`` set), where that is a failure. After the session, no SLURM daemon may be left.
    """
    reason = slurm_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"SLURM test cluster required on CI: {reason}")
        pytest.skip(reason)
    slurm_cluster = start_slurm_cluster(2, tmp_path_factory.mktemp("slurm"))
    yield slurm_cluster
    slurm_cluster.stop()
    assert slurm_processes() == {}


# Every launch of this test session carries this variable (it matches the default TORCH*
# pattern), so leftovers are told apart from other launches running on the same machine.
SESSION_MARKER = f"TORCHRUNX_TEST_SESSION={uuid.uuid4().hex}"
os.environ.update([SESSION_MARKER.split("=", 1)])
# The once-per-user hint of a first launch on a terminal would show in whichever terminal test
# runs first: off for the suite (tests/test_logs.py turns it on where it is the subject).
os.environ["TORCHRUNX_HINTS"] = "0"
# A worker loads its function from the test module, which imports pytest (0.2 s of CPU in each
# worker): the agents import it once before they fork (docs/environment.md), a seventh of the
# launch tests' CPU. tests/test_preload.py sets or clears it where it is the subject.
os.environ.setdefault("TORCHRUNX_PRELOAD", "pytest")


def torchrunx_processes() -> list[str]:
    """Live (non-zombie) agents and workers of this test session, test hosts included.

    The test hosts share this machine's pid namespace, so one look covers every host. Agents
    run ``python -c BOOT`` whose code names ``torchrunx.agent.agent``; workers and guardians are
    forks of agents and keep that command line.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{entry}/environ", "rb") as f:
                ours = SESSION_MARKER.encode() in f.read().split(b"\0")
        except OSError:
            continue
        if "torchrunx.agent" in cmdline and state != "Z" and ours:
            found.append(f"{entry}: {cmdline[:120]}")
    return found


def session_pids() -> set[int]:
    """Pids of the live processes below this test session's process (this pytest worker).

    What the session starts stays below it (see :func:`escaped_processes`): its launches, the
    test hosts' ``sshd`` and what they start. A look at this machine's processes that must not
    see another session's (another pytest-xdist worker's) looks at these.
    """
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    me = os.getpid()
    found = set()
    for pid, parent in parents.items():
        above = parent
        while above > 1 and above != me:
            above = parents.get(above, 0)
        if above == me:
            found.add(pid)
    return found


CPU_LOG = os.environ.get("TORCHRUNX_TEST_CPU")
"""A file to which each test's CPU seconds are appended (``TORCHRUNX_TEST_CPU``; CONTRIBUTING)."""


def tree_cpu() -> float:
    """CPU seconds used so far by this process and every live process below it, each with the
    CPU of the children it has reaped (so what ended meanwhile is counted by its parent)."""
    total = 0
    for pid in (os.getpid(), *session_pids()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(field) for field in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``TORCHRUNX_TEST_CPU=FILE``: each test's CPU (its set-up and tear-down too, with
    every process below this pytest process: its launches, the test hosts' sshd and what they
    start), its wall time and id, a line each, appended to FILE.

    Which tests cost the suite's time: on 2 cores the suite is bound by CPU, not by waits, and
    ``--durations`` counts a test that sleeps as much as one that computes. A process that
    leaves the tree (a daemon) is not counted; one alive before the test and ended in it is
    counted whole by its parent.
    """
    if CPU_LOG is None:
        yield
        return
    began, cpu = time.monotonic(), tree_cpu()
    yield
    cpu, wall = tree_cpu() - cpu, time.monotonic() - began
    with open(CPU_LOG, "a") as f:  # one short line: the workers' appends do not mix
        f.write(f"{cpu:.2f}\t{wall:.2f}\t{item.nodeid}\n")


def escaped_processes() -> list[str]:
    """Live processes of this test session that left the test session's process tree.

    Whatever a test starts stays below pytest while it runs: launchers, the test hosts'
    ``sshd`` and what it starts (agents, workers), and what workers start, daemons included
    (the agent and its guardian adopt orphans). A process that carries the session's marker
    but has neither pytest nor a SLURM daemon (which runs its job steps' processes itself)
    above it escaped: it outlived the launch that started it.
    """
    me = os.getpid()
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    ours: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        parents[pid] = int(fields[1])
        names[pid] = os.path.basename(cmdline.split(" ", 1)[0])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if SESSION_MARKER.encode() in f.read().split(b"\0"):
                    ours[pid] = cmdline
        except OSError:
            continue
    escaped = []
    for pid, cmdline in ours.items():
        above = pid
        while above > 1 and above != me and names.get(above) not in DAEMONS:
            above = parents.get(above, 0)
        if above != me and names.get(above) not in DAEMONS:
            escaped.append(f"{pid}: {cmdline[:120]}")
    return escaped


def listening_addresses(port: int | None, pid: int | None = None) -> set[str]:
    """The addresses a TCP socket listens on at ``port`` (None: any), from ``/proc/net/tcp{,6}``.

    With ``pid``, only sockets that process holds (its ``/proc/PID/fd`` links), read in its own
    network namespace (``/proc/PID/net``). ``0.0.0.0`` and ``::`` mean every interface.
    """
    inodes = None
    if pid is not None:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{'net' if pid is None else f'{pid}/net'}/{table}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        for row in rows:
            local, state, inode = row[1], row[3], row[9]
            address, _, hex_port = local.partition(":")
            if state != "0A" or port not in (None, int(hex_port, 16)):  # 0A: LISTEN
                continue
            if inodes is not None and inode not in inodes:
                continue
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(socket.inet_ntop(family, raw))
    return found


@pytest.fixture(autouse=True)
def pure_tests_start_no_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that guards a module in scripts/mutation.py may start no process (as there)."""
    if pure_guard.is_guarded(request.node):
        pure_guard.forbid_processes(monkeypatch)


@pytest.fixture(autouse=True)
def log_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Default log files of each test go to a temporary folder, not into the checkout."""
    path = tmp_path_factory.mktemp("torchrunx_logs")
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", str(path))
    return path


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test: no agent or worker may be left on any host, nor what they started.

    Not after the pure tests (:data:`QUICK_FILES`), which start nothing: two looks at every
    process of the machine after each of them cost the suite about a minute of CPU. A process
    one of them left would be found after the next test of that worker that starts any.
    """
    yield
    if any(fnmatch.fnmatch(request.path.name, pattern) for pattern in QUICK_FILES):
        return
    assert torchrunx_processes() == []
    assert escaped_processes() == []


@pytest.fixture
def listen_sockets(monkeypatch: pytest.MonkeyPatch) -> list[socket.socket]:
    """Every listening socket the launches of this test open, in order (a spy on
    ``torchrunx.launcher.net.listener.listen_socket``)."""
    from torchrunx.launcher.net import listener as listener_module

    made: list[socket.socket] = []
    real_listen = listener_module.listen_socket

    def spy(host: str | None = None, ports: tuple[int, ...] = (0,)) -> socket.socket:
        made.append(real_listen(host, ports))
        return made[-1]

    monkeypatch.setattr(listener_module, "listen_socket", spy)
    return made


def listened_during_launch(
    listen_sockets: list[socket.socket], func: Callable[[], object], **fields: object
) -> tuple[set[str], Any]:
    """Launch ``func``; where the port listened (this process's sockets) as it started, and
    the launch's result."""
    import torchrunx as trx
    from torchrunx import events as ev

    bound: list[set[str]] = []

    def on_event(event: ev.Event) -> None:
        if isinstance(event, ev.LaunchStarted):
            port = listen_sockets[-1].getsockname()[1]
            bound.append(listening_addresses(port, os.getpid()))

    result = trx.launch(func, event_handlers=(on_event,), **fields)  # type: ignore[arg-type]
    return bound[0], result


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parent_pid(pid: int) -> int:
    """The parent of ``pid`` (an agent's guardian, a worker's agent)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def wait_gone(pid: int, seconds: float = 10) -> None:
    """Wait (bounded) until ``pid`` has ended; fail the test if it does not."""
    deadline = time.monotonic() + seconds
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.01)


def worker_spec(index: int, hosts: int, workers: int, attempt: int = 0, *, keep: bool = False):
    """The WorkerSpec of host ``index`` in a launch of ``hosts`` x ``workers`` (pure tests)."""
    from torchrunx.wire.messages import WorkerSpec

    return WorkerSpec(
        index,
        f"node{index}",
        workers,
        index * workers,
        hosts * workers,
        "10.0.0.1",
        29500,
        "gloo",
        60.0,
        attempt=attempt,
        keep=keep,
    )


def touch_then_sleep(path: str, seconds: float) -> None:
    """A worker's function: say that it runs (create ``path``), then sleep ``seconds``.

    With :func:`when_file_appears`, a test acts on a launch *while its function runs*, not after
    a guessed delay (which, on a loaded machine, may still be while the launch starts).
    """
    from pathlib import Path

    Path(path).touch()
    time.sleep(seconds)


@contextlib.contextmanager
def when_file_appears(
    path: Path, action: Callable[[], object], timeout: float = 60
) -> Iterator[None]:
    """Run ``action`` in a thread as soon as ``path`` exists (a rank made it), within ``timeout``.

    On leaving, the thread is waited for; a file that never appeared fails the test, after the
    body has raised what it raises.
    """
    import threading

    appeared = threading.Event()
    gone = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while not gone.is_set() and time.monotonic() < deadline:
            if path.exists():
                appeared.set()
                action()
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        gone.set()
        thread.join(timeout=timeout)
    assert appeared.is_set(), f"{path} never appeared: the launch's function did not start"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """At the end of the whole run (not of each pytest-xdist worker): what tests made is gone.

    Tests SIGKILL launchers on purpose; their view sockets (which a launcher removes when it
    ends) are removed here, as the next launch would. The second user that the security tests
    made (``tests/attacker.py``) is removed once none of its processes is left and no other
    test session uses it.
    """
    if hasattr(session.config, "workerinput"):
        return

    from attacker import remove_if_unused

    from torchrunx.launcher.view.view_server import prune_dead, runtime_dir

    folder = runtime_dir()
    if folder is not None:
        prune_dead(folder)
    remove_if_unused()
