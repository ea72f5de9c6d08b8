"""No process escapes: daemons that workers start end with the launch, and so do temporary files.

Each worker function here starts a daemon of its own (``setsid`` and a double fork: another
session, another process group, and its parent gone, so neither the worker's process group
nor its death can reach it) and writes the daemon's pid to a file. Whatever ends the launch (a
return, an exception, a restart, a SIGKILLed launcher, agent or guardian, here or over SSH),
the daemon must be gone soon after. The test hosts share this machine's pid namespace and
filesystem, so one look at ``/proc`` covers them too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import torchrunx_processes

import torchrunx as trx
from torchrunx.agent import leftovers

ONE_LOCAL = {"hostnames": ["localhost"], "workers_per_host": 1, "backend": None}


def start_daemon(pidfile: str, tag: str, *, ignore_term: bool = False) -> int:
    """Start a daemon (new session, parent gone) that sleeps; write its pid to ``pidfile``.

    With ``ignore_term`` it is a Python double fork that ignores SIGTERM (only SIGKILL ends it);
    else ``setsid sh -c 'sleep TAG &'``, whose ``sleep`` keeps the worker's stdout and stderr.
    """
    if ignore_term:
        code = textwrap.dedent(
            f"""
            import os, signal, time
            if os.fork():
                os._exit(0)
            os.setsid()
            if os.fork():
                os._exit(0)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open({pidfile!r} + ".tmp", "w").write(str(os.getpid()))
            os.rename({pidfile!r} + ".tmp", {pidfile!r})
            time.sleep({tag})
            """
        )
        subprocess.run([sys.executable, "-c", code], check=True)
    else:
        script = f"sleep {tag} & echo $! > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}"
        subprocess.run(["setsid", "sh", "-c", script], check=True)
    deadline = time.monotonic() + 10
    while not os.path.exists(pidfile):
        assert time.monotonic() < deadline, "the daemon did not write its pid"
        time.sleep(0.01)
    pid = int(Path(pidfile).read_text())
    # ``sh`` writes ``$!`` before its child has exec'd ``sleep``: while it execs, the kernel
    # shows an empty ``/proc/PID/cmdline`` for a moment, so look again until it is there.
    while not daemon_alive(pid, tag):
        assert time.monotonic() < deadline, f"the daemon {pid} (sleep {tag}) is not running"
        time.sleep(0.01)
    return pid


def daemon_alive(pid: int, tag: str) -> bool:
    """Whether ``pid`` is a live (non-zombie) process whose command line holds ``tag``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return tag in cmdline and state != "Z"


def assert_gone(pid: int, tag: str, timeout: float = 5.0) -> None:
    """The daemon ends within ``timeout`` s; if not, it is killed here and the test fails."""
    deadline = time.monotonic() + timeout
    while daemon_alive(pid, tag):
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"daemon {pid} (sleep {tag}) outlived the launch")
        time.sleep(0.05)


def pids_in(folder: Path, pattern: str = "pid.*") -> list[int]:
    """The pids the daemons wrote; a file still being written (``.tmp``, renamed once whole)
    is not one yet."""
    paths = sorted(path for path in folder.glob(pattern) if path.suffix != ".tmp")
    return [int(path.read_text()) for path in paths]


# -- (a) a function that returns ------------------------------------------------------------


def daemon_then_return(folder: str, tag: str) -> int:
    return start_daemon(f"{folder}/pid.{os.environ['RANK']}", tag)


def test_a_daemon_of_a_worker_ends_when_the_function_returns(tmp_path):
    tag = "61001"
    result = trx.launch(daemon_then_return, (str(tmp_path), tag), **ONE_LOCAL)
    (pid,) = result.ranks
    assert pids_in(tmp_path) == [pid]
    assert_gone(pid, tag)


# -- (b) the same on remote hosts ------------------------------------------------------------


@pytest.mark.cluster
def test_daemons_of_remote_workers_end_when_the_function_returns(cluster, tmp_path):
    tag = "61002"
    result = trx.launch(
        daemon_then_return,
        (str(tmp_path), tag),
        hostnames=cluster.names(),
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
    )
    assert len(result.ranks) == len(cluster.names())
    for pid in result.ranks:
        assert_gone(pid, tag)


# -- (c) a SIGKILLed launcher ----------------------------------------------------------------

LAUNCHER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, sys.argv[4])
    import torchrunx as trx
    from test_escape import start_daemon

    def work(folder, tag):
        start_daemon(f"{folder}/pid.{os.environ['RANK']}", tag)
        time.sleep(300)

    trx.launch(work, (sys.argv[1], sys.argv[2]), hostnames=json.loads(sys.argv[3]),
               workers_per_host=1, backend=None, agent_timeout=5,
               ssh_config_file=sys.argv[5] or None)
    """
)


@pytest.mark.parametrize("where", ["localhost", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_daemons_end_when_the_launcher_is_sigkilled(where, tmp_path, request):
    tag = "61003"
    hosts, config = ["localhost"], ""
    if where == "cluster":
        cluster = request.getfixturevalue("cluster")
        hosts, config = cluster.names(), str(cluster.ssh_config)
    argv = [sys.executable, "-c", LAUNCHER, str(tmp_path), tag, json.dumps(hosts)]
    argv += [str(Path(__file__).parent), config]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(pids_in(tmp_path)) < len(hosts):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the daemons did not start"
            time.sleep(0.1)
    finally:
        launcher.kill()
        launcher.communicate()
    for pid in pids_in(tmp_path):
        # The agents see their stdin and connection close at once (agent_timeout at worst).
        assert_gone(pid, tag, timeout=10)
    deadline = time.monotonic() + 10
    while torchrunx_processes() and time.monotonic() < deadline:  # the agents end, too
        time.sleep(0.1)


# -- (d) a function that raises, its daemon ignoring SIGTERM --------------------------------


def daemon_then_raise(folder: str, tag: str) -> None:
    start_daemon(f"{folder}/pid.{os.environ['RANK']}", tag, ignore_term=True)
    raise ValueError("failed after starting a daemon")


def test_a_daemon_ignoring_sigterm_ends_when_the_function_raises(tmp_path):
    tag = "61004"
    with pytest.raises(ValueError, match="failed after starting a daemon"):
        trx.launch(daemon_then_raise, (str(tmp_path), tag), **ONE_LOCAL)
    (pid,) = pids_in(tmp_path)
    assert_gone(pid, tag)


# -- a SIGKILLed agent -----------------------------------------------------------------------


def daemon_then_kill_agent(folder: str, tag: str) -> None:
    start_daemon(f"{folder}/pid.{os.environ['RANK']}", tag)
    Path(folder, f"tmpdir.{os.environ['RANK']}").write_text(os.environ["TMPDIR"])
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(300)


def test_daemons_and_the_private_tmpdir_end_when_the_agent_is_sigkilled(tmp_path):
    tag = "61005"
    with pytest.raises(trx.AgentFailedError, match="agent on host 'localhost' failed"):
        trx.launch(daemon_then_kill_agent, (str(tmp_path), tag), **ONE_LOCAL)
    (pid,) = pids_in(tmp_path)
    assert_gone(pid, tag)
    assert not Path(Path(tmp_path, "tmpdir.0").read_text()).exists()


def daemon_then_signal_guardian(folder: str, tag: str, signum: int) -> None:
    start_daemon(f"{folder}/pid.{os.environ['RANK']}", tag)
    Path(folder, f"tmpdir.{os.environ['RANK']}").write_text(os.environ["TMPDIR"])
    agent = os.getppid()
    guardian = int(Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(guardian, signum)  # SIGKILL: as the launcher's kill of a local agent's group
    time.sleep(300)


@pytest.mark.parametrize(
    ("signum", "reason"), [(signal.SIGKILL, "signal 9|closed"), (signal.SIGTERM, "143|closed")]
)
def test_daemons_end_when_the_guardian_is_signalled(signum, reason, tmp_path):
    """The agent hears of its guardian's death (PDEATHSIG) or gets its SIGTERM passed on."""
    tag = "61008"
    with pytest.raises(trx.AgentFailedError, match=reason):
        trx.launch(daemon_then_signal_guardian, (str(tmp_path), tag, signum), **ONE_LOCAL)
    (pid,) = pids_in(tmp_path)
    assert_gone(pid, tag)
    deadline = time.monotonic() + 5
    while torchrunx_processes() and time.monotonic() < deadline:  # the agent ends, too
        time.sleep(0.1)
    assert not Path(Path(tmp_path, "tmpdir.0").read_text()).exists()


# -- restarts: what an attempt left is gone before the next one starts ----------------------


def daemon_in_first_attempt(folder: str, tag: str) -> bool:
    attempt = os.environ["TORCHRUNX_RESTART_COUNT"]
    Path(folder, f"tmpdir.{attempt}").write_text(os.environ["TMPDIR"])
    if attempt == "0":
        Path(os.environ["TMPDIR"], "from-attempt-0").touch()
        start_daemon(f"{folder}/pid.0", tag)
        raise RuntimeError("first attempt fails")
    (pid,) = pids_in(Path(folder))
    return not daemon_alive(pid, tag) and not Path(os.environ["TMPDIR"], "from-attempt-0").exists()


def test_leftovers_of_an_attempt_are_gone_before_the_next_starts(tmp_path):
    tag = "61006"
    result = trx.launch(daemon_in_first_attempt, (str(tmp_path), tag), **ONE_LOCAL, max_restarts=1)
    assert result.restarts == 1
    assert result.ranks == [True]


# -- (e) the workers' private temporary directory --------------------------------------------


def look_at_tmpdir() -> dict[str, object]:
    import multiprocessing.util

    tmpdir = os.environ["TMPDIR"]
    Path(tmpdir, "scratch").write_text("x")
    return {
        "TMPDIR": tmpdir,
        "gettempdir": tempfile.gettempdir(),
        "mkdtemp": tempfile.mkdtemp(),
        "pymp": multiprocessing.util.get_temp_dir(),  # left behind: workers end with os._exit
        "mode": os.stat(tmpdir).st_mode & 0o777,
    }


def test_workers_get_a_private_tmpdir_under_the_users_which_is_removed_after(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the local agent gets the launcher's environment
    result = trx.launch(look_at_tmpdir, hostnames=["localhost"], workers_per_host=2, backend=None)
    first, second = result.ranks
    tmpdir = Path(first["TMPDIR"])
    assert second["TMPDIR"] == first["TMPDIR"]  # one per agent and attempt
    assert tmpdir.parent == tmp_path
    assert first["gettempdir"] == str(tmpdir)
    assert Path(first["mkdtemp"]).parent == tmpdir
    assert Path(first["pymp"]).parent == tmpdir
    assert first["mode"] == 0o700
    assert not tmpdir.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_private_dir_whose_tree_was_sigkilled_goes_at_the_next_agents_start(
    tmp_path, monkeypatch
):
    # An agent, its guardian and its workers SIGKILLed together (a Ray actor killed takes its
    # whole process tree) cannot remove their folder: the next agent on the host does, once
    # no process holds its lock. A folder in use, one without a lock, and what is not a
    # folder stay.
    import fcntl

    from torchrunx.agent.leftovers import LOCK_NAME

    stale, live, unlocked = (tmp_path / f"torchrunx-{name}" for name in ("stale", "live", "nolock"))
    for folder in (stale, live, unlocked):
        folder.mkdir(mode=0o700)
        (folder / "scratch").write_text("x")
    (stale / LOCK_NAME).touch()
    (live / LOCK_NAME).touch()
    holder = os.open(live / LOCK_NAME, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # as a live agent's tree holds it
    (tmp_path / "torchrunx-file").write_text("not a folder")
    try:
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        result = trx.launch(
            look_at_tmpdir, hostnames=["localhost"], workers_per_host=1, backend=None
        )
        assert Path(result.rank(0)["TMPDIR"]).parent == tmp_path
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "torchrunx-file",
            "torchrunx-live",
            "torchrunx-nolock",
        ]
        assert (live / "scratch").exists()
    finally:
        os.close(holder)


# -- the pure parts ----------------------------------------------------------------------------


def test_a_stat_line_is_parsed_whatever_the_command_name_holds():
    line = "4242 (a) b (c)) S 17 4242 4242 0 -1 4194560" + " 0" * 12 + " 987654 0 0\n"
    proc = leftovers.parse_stat(line)
    assert proc == leftovers.Proc(pid=4242, ppid=17, pgid=4242, state="S", start=987654)
    assert leftovers.parse_stat("garbage") is None


def test_descendants_in_a_table_follow_parent_links_only_below_the_root():
    def proc(pid: int, ppid: int) -> leftovers.Proc:
        return leftovers.Proc(pid=pid, ppid=ppid, pgid=pid, state="S", start=pid)

    table = {p.pid: p for p in (proc(1, 0), proc(10, 1), proc(11, 10), proc(12, 11), proc(20, 1))}
    table[13] = proc(13, 10)
    assert sorted(p.pid for p in leftovers.tree(10, table)) == [11, 12, 13]
    assert leftovers.tree(20, table) == []
    assert leftovers.tree(99, table) == []


def test_a_child_subreaper_adopts_orphans_and_kills_every_descendant(tmp_path):
    """In a fresh process: a daemon reparents to it; then everything below it ends."""
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        from torchrunx.agent import leftovers
        assert leftovers.set_child_subreaper()
        subprocess.run(["setsid", "sh", "-c", "sleep 61007 & echo $! > {tmp_path}/pid"])
        daemon = int(open("{tmp_path}/pid").read())
        subprocess.Popen(["sleep", "61007"])
        found = {{p.pid: p for p in leftovers.descendants(os.getpid())}}
        assert found[daemon].ppid == os.getpid(), found  # adopted
        assert len(found) == 2, found
        assert leftovers.kill_descendants(os.getpid()) == []
        assert leftovers.descendants(os.getpid()) == []
        assert not os.path.exists(f"/proc/{{daemon}}")  # killed and reaped
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
