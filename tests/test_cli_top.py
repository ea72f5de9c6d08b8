"""``torchrunx top``: the view's rules (pure), and real launches seen from another process."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest
from attacker import as_attacker

from torchrunx.commands.top import Ages, find_views, render_text
from torchrunx.launcher.view.view_server import GROUP_ABOVE, runtime_dir

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path


def _snapshot(workers: int, state: str = "HEALTHY") -> dict[str, object]:
    return {
        "pid": 42,
        "log_dir": "logs/L",
        "report": {
            "healthy": True,
            "launch_state": "running",
            "attempt": 0,
            "restarts": 0,
            "max_restarts": 1,
            "uptime": 3.0,
            "agents": [
                {"hostname": "a", "state": "RUNNING", "last_heartbeat_age": 0.25, "role": "host"}
            ],
            "workers": [
                {
                    "rank": r,
                    "host_index": 0,
                    "hostname": "a",
                    "local_rank": r,
                    "pid": 100 + r,
                    "state": state,
                    "cpu_percent": 12.4 if r else None,
                    "rss_bytes": 300 << 20,
                    "gpu_percent": None,
                    "gpu_memory_bytes": None,
                    "collectives": 42 if r else None,
                }
                for r in range(workers)
            ],
            "failures": [],
            "world_changes": [],
        },
        "last_lines": {"0:1": "step 7"},
    }


def test_rule_a_row_per_rank_with_its_state_age_pid_and_last_line():
    ages = Ages()
    lines = render_text(_snapshot(2), ages, now=10.0)
    assert lines[0] == "launch pid 42  running  attempt 0  restarts 0/1  up 3 s  healthy"
    assert "a                        RUNNING        0.2 s  host" in lines
    assert (
        " rank host             state       in state      pid   cpu%    rss    coll  last line"
        in (lines)
    )
    (row,) = [line for line in lines if line.strip().startswith("1 a ")]
    assert row.split() == ["1", "a", "HEALTHY", "0.0", "s", "101", "12", "300M", "42", "step", "7"]
    (first,) = [line for line in lines if line.strip().startswith("0 a ")]
    assert first.split()[6:] == ["-", "300M", "-"]  # no CPU rate yet, no collective count
    later = render_text(_snapshot(2), ages, now=12.5)
    assert next(line for line in later if line.strip().startswith("1 a ")).split()[3] == "2.5"
    changed = render_text(_snapshot(2, "FAILED"), ages, now=13.0)  # a new state starts at 0
    assert next(line for line in changed if line.strip().startswith("1 a ")).split()[2:4] == [
        "FAILED",
        "0.0",
    ]


def test_rule_gpu_columns_only_where_there_are_gpu_figures_and_sizes_are_short():
    from torchrunx.commands.top import size

    snapshot = _snapshot(2)
    workers = snapshot["report"]["workers"]  # type: ignore[index]
    workers[1].update(gpu_percent=88, gpu_memory_bytes=(3 << 30) + (400 << 20))
    lines = render_text(snapshot, Ages(), now=0.0)
    assert any("cpu%    rss gpu% gpu mem    coll" in line for line in lines), lines
    (row,) = [line for line in lines if line.strip().startswith("1 a ")]
    assert row.split()[6:11] == ["12", "300M", "88", "3.4G", "42"]
    (row,) = [line for line in lines if line.strip().startswith("0 a ")]
    assert row.split()[6:11] == ["-", "300M", "-", "-", "-"]
    assert [size(n) for n in (None, 512, 5 << 20, 150 << 20, 3 << 40)] == [
        "-",
        "0K",
        "5.0M",
        "150M",
        "3.0T",
    ]


def test_rule_the_mark_column_shows_a_straggler_where_the_launcher_names_one():
    snapshot = _snapshot(2)
    assert not any("mark" in line for line in render_text(snapshot, Ages(), now=0.0))
    workers = snapshot["report"]["workers"]  # type: ignore[index]
    workers[0]["straggler"], workers[1]["straggler"] = False, True
    lines = render_text(snapshot, Ages(), now=0.0)
    (row,) = [line for line in lines if line.strip().startswith("1 a ")]
    assert row.split()[8:10] == ["42", "slow"]


def test_rule_many_ranks_are_grouped_by_host_and_state():
    from torchrunx.launcher.view.view_server import grouped

    snapshot = _snapshot(GROUP_ABOVE + 1)  # as the launcher sends it at that size: a summary
    report = snapshot["report"]
    assert isinstance(report, dict)
    rows = [(w["hostname"], w["state"]) for w in report["workers"]]
    snapshot["report"] = grouped({**report, "workers": []}, rows, [])
    lines = render_text(snapshot, Ages(), now=0.0)
    assert f"a                        HEALTHY        {GROUP_ABOVE + 1}" in lines
    assert not any(line.strip().startswith("0 a ") for line in lines)


STEPS = """
import os, sys, time
import torchrunx as trx

def work(folder):
    # Rank 1 fails once, when the test says so (then the launch restarts); both ranks wait for
    # the test to end the launch.
    def wait_for(name):
        while not os.path.exists(os.path.join(folder, name)):
            print("waiting rank", os.environ["RANK"], "for", name, flush=True)
            time.sleep(0.1)
    wait_for("go")
    failed = os.path.join(folder, "failed")
    if os.environ["RANK"] == "1" and not os.path.exists(failed):
        open(failed, "w").close()
        raise ValueError("told to fail")
    wait_for("end")
    return 1

result = trx.launch(
    work, (sys.argv[1],), hostnames=["localhost"], workers_per_host=2, backend=None, max_restarts=1
)
print("restarts", result.restarts)
"""


def _start(tmp_path: Path, runtime: Path | None = None) -> subprocess.Popen[str]:
    """The steps launch; ``runtime``: its own XDG_RUNTIME_DIR (its view socket's folder)."""
    (tmp_path / "steps.py").write_text(STEPS)
    env = {**os.environ, "TORCHRUNX_LOG_DIR": str(tmp_path / "logs")}
    if runtime is not None:
        env["XDG_RUNTIME_DIR"] = str(runtime)
    return subprocess.Popen(
        [sys.executable, "steps.py", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def _end(folder: Path) -> None:
    for name in ("failed", "go", "end"):  # rank 1 does not fail (again): the launch returns
        (folder / name).touch()


def _its_view(pid: int, folder: Path | None = None) -> Path:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for view in find_views(folder or runtime_dir()):
            if view.name.startswith(f"{pid}-"):
                return view
        time.sleep(0.05)
    raise AssertionError(f"launch {pid} has no view socket")


@contextlib.contextmanager
def _tmux_server(name: str) -> Iterator[str]:
    """A tmux server of this test's own (``-L``), killed and its socket removed at the end.

    The default server is one per user: tests on other xdist workers would put their sessions
    in it, and the server, a daemon with this suite's marker, would outlive the test that
    started it while another's session runs (seen on CI as an escaped process).
    """
    server = f"trx-test-{os.getpid()}-{name}"
    try:
        yield server
    finally:
        _tmux(server, "kill-server", check=False)
        folder = os.environ.get("TMUX_TMPDIR") or "/tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, f"tmux-{os.getuid()}", server))


def _quit_view(server: str, session: str) -> None:
    """Press q in the view's pane; its session must end (the view quit) within 30 s."""
    _tmux(server, "send-keys", "-t", session, "q")
    deadline = time.monotonic() + 30
    while _tmux(server, "has-session", "-t", session, check=False).returncode == 0:
        assert time.monotonic() < deadline, "q did not end the view"
        time.sleep(0.05)


def _tmux(server: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run tmux against the server ``server`` (see :func:`_tmux_server`)."""
    return subprocess.run(
        ["tmux", "-L", server, *args], capture_output=True, text=True, check=check, timeout=30
    )


def _top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchrunx", "top", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_top_shows_a_running_launch_and_its_socket_goes_with_it(tmp_path):
    launch = _start(tmp_path)
    try:
        view = _its_view(launch.pid)
        assert view.stat().st_mode & 0o777 == 0o600
        assert view.parent.stat().st_mode & 0o777 == 0o700
        deadline = time.monotonic() + 60
        while True:  # until both ranks have said something
            shown = _top("--pid", str(launch.pid), "--once")
            assert shown.returncode == 0, shown.stderr
            if shown.stdout.count("waiting rank") == 2 or time.monotonic() > deadline:
                break
        assert shown.stdout.startswith(f"launch pid {launch.pid}  running  attempt 0"), shown.stdout
        for rank in (0, 1):
            assert "HEALTHY" in shown.stdout and f"waiting rank {rank}" in shown.stdout, (
                shown.stdout
            )
        assert f"{launch.pid}  {view}" in _top("--list").stdout
    finally:
        _end(tmp_path)
        out, _ = launch.communicate(timeout=120)
    assert "restarts 0" in out
    assert not view.exists()  # nothing left behind
    assert _top("--pid", str(launch.pid), "--once").returncode == 1


def test_a_viewer_asks_for_the_stacks_and_the_diagnosis_on_its_connection(tmp_path):
    import json
    import socket

    from torchrunx.launcher.launch.session import VIEW_HEADLINE

    launch = _start(tmp_path)
    try:
        view = _its_view(launch.pid)
        with contextlib.ExitStack() as stack, socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(str(view))
            reader = stack.enter_context(sock.makefile("rb"))  # closed even on a failure
            deadline = time.monotonic() + 60
            while len(json.loads(reader.readline())["last_lines"]) < 2:  # both ranks wait
                assert time.monotonic() < deadline
            sock.sendall(b"stacks\ndiagnosis\n")
            asked = time.monotonic()
            looks: dict[str, str] = {}
            while len(looks) < 2:
                assert time.monotonic() - asked < 10, looks
                for kind, look in json.loads(reader.readline()).get("looks", {}).items():
                    if "text" in look:
                        looks[kind] = look["text"]
        assert "where every rank is" in looks["stacks"], looks
        assert "in wait_for" in looks["stacks"], looks  # both ranks sleep in it
        assert looks["diagnosis"].startswith(VIEW_HEADLINE), looks
        # backend=None, no torch.distributed: the ranks still answer, and say where they are.
        assert "did not answer" not in looks["diagnosis"], looks
        assert "no rank waits in a collective; where they are:" in looks["diagnosis"], looks
        assert "in wait_for" in looks["diagnosis"], looks
    finally:
        _end(tmp_path)
        launch.communicate(timeout=120)


def test_another_user_cannot_reach_a_launchs_view(tmp_path):
    launch = _start(tmp_path)
    try:
        view = _its_view(launch.pid)
        probe = (
            "import socket,sys\n"
            "s=socket.socket(socket.AF_UNIX)\n"
            "try:\n s.connect(sys.argv[1]); print('DATA', s.recv(100))\n"
            "except OSError as e: print('REFUSED', type(e).__name__)\n"
        )
        done = subprocess.run(
            as_attacker(["python3", "-c", probe, str(view)]),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.stdout.startswith("REFUSED PermissionError"), (done.stdout, done.stderr)
    finally:
        _end(tmp_path)
        launch.communicate(timeout=120)


@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (scripts/test.sh installs it)"
)
def test_the_live_view_in_a_terminal_shows_a_failure_within_a_second(tmp_path):
    launch = _start(tmp_path)
    session = "trx-top"
    try:
        with _tmux_server("top") as server:
            _its_view(launch.pid)
            # The pane's own size: a COLUMNS or LINES that the suite's environment may carry
            # (the tmux server passes on its first client's; under pytest COLUMNS=80 was seen) would
            # make rich draw 80 columns in a 160-column pane.
            command = (
                f"env -u COLUMNS -u LINES {sys.executable} -m torchrunx top --pid {launch.pid}"
            )
            _tmux(server, "new-session", "-d", "-s", session, "-x", "160", "-y", "40", command)

            def pane() -> str:
                return _tmux(server, "capture-pane", "-p", "-t", session).stdout

            deadline = time.monotonic() + 60
            while "waiting rank 1" not in pane():
                assert time.monotonic() < deadline, pane()
                time.sleep(0.05)
            (tmp_path / "go").touch()
            told = time.monotonic()
            while "attempt 0: ValueError: told to fail" not in pane():
                assert time.monotonic() - told < 30, pane()
                time.sleep(0.05)
            seen = time.monotonic() - told
            # Within a second of the failure reaching the launcher (the rank's own start of
            # failing counted in: it polls its file every 0.1 s).
            assert seen < 2.0, (seen, pane())
            # Keys: select rank 1, show its log's last lines, quit.
            _tmux(server, "send-keys", "-t", session, "j", "l")
            deadline = time.monotonic() + 30
            while "--- localhost[1].log: rank 1 (localhost[1]), last lines ---" not in pane():
                assert time.monotonic() < deadline, pane()
                time.sleep(0.05)
            assert "> " in next(line for line in pane().splitlines() if " 1 localhost" in line)[:3]
            _quit_view(server, session)
    finally:
        _end(tmp_path)
        launch.communicate(timeout=120)


def test_rule_at_scale_a_snapshot_counts_ranks_per_host_and_state_and_lists_agents_not_running():
    from torchrunx.launcher.view.view_server import grouped

    report = grouped(
        {"healthy": False, "agents": [], "workers": []},
        [("a", "HEALTHY"), ("b", "FAILED"), ("a", "HEALTHY"), ("b", "HEALTHY")],
        [("a", "RUNNING", 0.5, "host"), ("b", "LOST", 9.0, "host"), ("c", "RUNNING", 0.1, "spare")],
    )
    assert report["groups"] == [["a", "HEALTHY", 2], ["b", "FAILED", 1], ["b", "HEALTHY", 1]]
    assert report["agents_running"] == 1
    assert [a["hostname"] for a in report["agents"]] == ["b", "c"]  # lost, and a spare
    assert report["workers"] == []
    lines = render_text({"report": report}, Ages(), now=0.0)
    assert "(and 1 more hosts whose agents run)" in lines
    assert "b                        FAILED          1" in lines


def test_rule_keys_select_a_rank_show_its_tail_and_quit():
    from torchrunx.commands.top import Screen, split_keys

    assert split_keys("jl\x1b[Aq") == ["j", "l", "\x1b[A", "q"]
    screen = Screen()
    assert all(screen.key(k, 3) for k in split_keys("jjj"))
    assert screen.selected == 2  # not past the last rank
    assert all(screen.key(k, 3) for k in split_keys("\x1b[A\x1b[A\x1b[Ak"))
    assert screen.selected == 0
    assert screen.key("l", 3) and screen.tail
    assert screen.key("l", 3) and not screen.tail
    assert not screen.key("q", 3)
    assert screen.requests == []  # l needs nothing from the launcher
    lines = screen.lines(_snapshot(2), Ages(), now=0.0)
    assert [line[:5] for line in lines if "a  " in line and line[1:6].strip().isdigit()] == [
        ">   0",
        "    1",
    ]


def test_rule_s_and_d_ask_the_launcher_and_show_its_next_answer():
    from torchrunx.commands.top import ASKING, Screen

    screen = Screen()
    old = {**_snapshot(2), "looks": {"stacks": {"number": 1, "text": "old stacks"}}}
    screen.lines(old, Ages(), now=0.0)  # the answer of an earlier request: not this one's
    assert screen.key("s", 2) and screen.requests == ["stacks"]
    assert screen.lines(old, Ages(), now=0.0)[-1] == ASKING["stacks"]
    again = {**_snapshot(2), "looks": {"stacks": {"number": 1}}}  # its text came once
    assert screen.lines(again, Ages(), now=0.0)[-1] == ASKING["stacks"]
    text = "\n".join(f"line {i}" for i in range(100))
    new = {**_snapshot(2), "looks": {"stacks": {"number": 2, "text": text}}}
    lines = screen.lines(new, Ages(), now=0.0)
    assert lines[-2:] == ["line 39", "(60 more lines)"]
    assert screen.lines(again, Ages(), now=0.0)[-1] == "(60 more lines)"  # kept
    assert screen.key("s", 2) and screen.panel is None  # again: hidden, nothing asked
    assert screen.requests == ["stacks"]
    assert screen.key("d", 2) and screen.panel == "diagnosis"
    assert screen.requests == ["stacks", "diagnosis"]
    assert screen.lines(new, Ages(), now=0.0)[-1] == ASKING["diagnosis"]


def test_rule_an_answers_text_is_sent_once_on_each_connection():
    from torchrunx.launcher.view.view_server import unsent

    sent: dict[str, int] = {}
    snapshot = {"report": {}, "looks": {"stacks": {"number": 3, "text": "T"}}}
    assert unsent(snapshot, sent)["looks"] == {"stacks": {"number": 3, "text": "T"}}
    assert unsent(snapshot, sent)["looks"] == {"stacks": {"number": 3}}
    assert snapshot["looks"]["stacks"]["text"] == "T"  # the launcher's own copy: unchanged
    newer = {"looks": {"stacks": {"number": 4, "text": "U"}}}
    assert unsent(newer, sent)["looks"]["stacks"]["text"] == "U"
    assert unsent(newer, {})["looks"]["stacks"]["text"] == "U"  # another connection: sent


def test_a_killed_launchers_socket_is_removed_by_the_next_launch(tmp_path):
    import signal

    from conftest import torchrunx_processes

    from torchrunx.launcher.view.view_server import prune_dead

    # Its own socket folder: another test's launch (the suite runs in parallel) would prune
    # the dead launcher's socket first.
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    launch = _start(tmp_path, runtime)
    try:
        view = _its_view(launch.pid, runtime / "torchrunx")
    finally:  # and if the view never came (a failure), the launch is not left running
        launch.send_signal(signal.SIGKILL)  # no chance to remove its socket
        launch.communicate(timeout=30)
    assert view.exists()
    half_made = view.with_name(f"{launch.pid}-00000000.new")  # killed before it listened
    half_made.touch()
    assert sorted(prune_dead(view.parent)) == sorted([view, half_made])  # every launch does it
    assert not view.exists() and not half_made.exists()
    deadline = time.monotonic() + 30  # its agent sees the launcher gone and ends its workers
    while torchrunx_processes() and time.monotonic() < deadline:
        time.sleep(0.1)


CLUSTER_STEPS = """
import os, sys, time
import torch
import torch.distributed as dist
import torchrunx as trx

def work(folder):
    # Every rank: an all_reduce each 0.2 s, and one more that says whether to end (so all
    # end at the same step). Rank 3 (on the second host) fails once, when the test says so.
    failed = os.path.join(folder, "failed")
    step = 0
    while True:
        end = torch.tensor([float(os.path.exists(os.path.join(folder, "end")))])
        dist.all_reduce(end)
        if end.item() > 0:
            return step
        step += 1
        print("step", step, "rank", os.environ["RANK"], flush=True)
        if os.environ["RANK"] == "3" and os.path.exists(os.path.join(folder, "go")):
            if not os.path.exists(failed):
                with open(failed + ".tmp", "w") as f:
                    f.write(repr(time.time()))
                os.rename(failed + ".tmp", failed)
                raise ValueError("told to fail")
        time.sleep(0.2)

folder, config, *hosts = sys.argv[1:]
result = trx.launch(
    work, (folder,), hostnames=hosts, workers_per_host=2, backend="gloo", max_restarts=1,
    ssh_config_file=config, stall_timeout=10,  # progress (and its count) every 2 s
)
print("restarts", result.restarts)
"""
ROW = re.compile(
    r"^[> ]\s*(\d+) (\S+)\s+(\S+)\s+[\d.]+ s\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)"
)  # rank, host, state, pid, cpu%, rss, collectives


@pytest.mark.cluster
@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (scripts/test.sh installs it)"
)
def test_the_live_view_of_two_ssh_hosts_shows_use_keys_and_a_failure_within_a_second(
    cluster, tmp_path
):
    node1, node2 = cluster.names()
    (tmp_path / "steps.py").write_text(CLUSTER_STEPS)
    launch = subprocess.Popen(
        [sys.executable, "steps.py", str(tmp_path), str(cluster.ssh_config), node1, node2],
        cwd=tmp_path,
        env={**os.environ, "TORCHRUNX_LOG_DIR": str(tmp_path / "logs")},
        stdout=subprocess.PIPE,
        text=True,
    )
    session = "trx-top-cluster"
    with _tmux_server("top-cluster") as server:

        def pane() -> str:
            return _tmux(server, "capture-pane", "-p", "-t", session).stdout

        def wait_for(seen: Callable[[str], bool], what: str, limit: float = 60) -> str:
            deadline = time.monotonic() + limit
            while not seen(shown := pane()):
                assert time.monotonic() < deadline, f"{what} not shown:\n{shown}"
                time.sleep(0.05)
            return shown

        def rows(shown: str) -> dict[int, tuple[str, ...]]:
            return {int(m[1]): m.groups()[1:] for m in map(ROW.match, shown.splitlines()) if m}

        def measured(shown: str) -> bool:  # every rank on its host, with CPU, memory, collectives
            found = rows(shown)
            return sorted(found) == [0, 1, 2, 3] and all(
                host == (node1 if rank < 2 else node2)
                and state == "HEALTHY"
                and cpu.isdigit()
                and rss.endswith("M")
                and collectives.isdigit()
                for rank, (host, state, _, cpu, rss, collectives) in found.items()
            )

        try:
            _its_view(launch.pid)
            # The pane's own size: a COLUMNS or LINES that the suite's environment may carry
            # (the tmux server passes on its first client's; under pytest COLUMNS=80 was seen) would
            # make rich draw 80 columns in a 160-column pane.
            command = (
                f"env -u COLUMNS -u LINES {sys.executable} -m torchrunx top --pid {launch.pid}"
            )
            _tmux(server, "new-session", "-d", "-s", session, "-x", "160", "-y", "50", command)
            shown = wait_for(measured, "each rank's CPU, memory and collectives")
            for host in (node1, node2):  # each host's agent and its heartbeat's age
                assert re.search(rf"^{host}\s+RUNNING\s+\d\.\d s  host\s*$", shown, re.MULTILINE), (
                    shown
                )
            _tmux(server, "send-keys", "-t", session, "s")
            wait_for(lambda p: "where every rank is" in p and "--- rank" in p, "the stacks")
            _tmux(server, "send-keys", "-t", session, "d")
            wait_for(lambda p: "the collectives every rank is in now" in p, "the diagnosis")
            (tmp_path / "go").touch()
            shown = wait_for(lambda p: "attempt 0: ValueError: told to fail" in p, "the failure")
            seen = time.time()
            raised = float((tmp_path / "failed").read_text())
            assert seen - raised < 1.0, (seen - raised, shown)
            print(f"a rank's failure to the view on the SSH test hosts: {seen - raised:.2f} s")
            _quit_view(server, session)
        finally:
            (tmp_path / "failed").touch()
            (tmp_path / "end").touch()
            out, _ = launch.communicate(timeout=120)
        assert "restarts 1" in out, out


def test_a_viewer_looking_while_a_launch_binds_its_socket_never_removes_it(tmp_path, monkeypatch):
    """``torchrunx top`` (``find_views``) removes a socket that refuses a connection: a dead
    launch's. A socket bound but not yet listening refuses too, so a look at that moment (here
    made right after each ``bind``) removed a starting launch's socket: its view never came (a
    suite run's failure). The socket gets its name once it listens."""
    import socket

    from torchrunx.launcher.view.view_server import ViewServer

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    folder = runtime / "torchrunx"
    looked: list[list[str]] = []
    bind = socket.socket.bind

    def bind_then_look(self: socket.socket, address: object) -> None:
        bind(self, address)
        looked.append([view.name for view in find_views(folder)])

    monkeypatch.setattr(socket.socket, "bind", bind_then_look)
    server = ViewServer(dict, {"pid": os.getpid()}, runtime={"XDG_RUNTIME_DIR": str(runtime)})
    server.start()
    try:
        assert looked == [[]]  # the look happened, and saw no socket that was not listening
        assert server.path is not None and server.path.exists(), sorted(folder.iterdir())
        assert [view.name for view in find_views(folder)] == [server.path.name]
        assert [path.name for path in folder.iterdir()] == [server.path.name]
    finally:
        server.close()
    assert list(folder.iterdir()) == []


def test_an_idle_view_socket_costs_no_wakeups_and_closes_at_once(tmp_path):
    """With no viewer, the view's thread sleeps in ``accept`` (it did wake 5 times a second,
    a polling timeout, most of a warm launcher's idle CPU); ``close`` still ends it at once."""
    import threading
    from pathlib import Path

    from torchrunx.launcher.view.view_server import ViewServer

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    server = ViewServer(dict, {"pid": os.getpid()}, runtime={"XDG_RUNTIME_DIR": str(runtime)})
    server.start()
    assert server.path is not None and server.path.exists()
    thread = next(t for t in threading.enumerate() if t.name == "torchrunx-view")
    status = Path(f"/proc/self/task/{thread.native_id}/status")

    def switches() -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith("voluntary_"))
        return int(line.split()[1])

    before = switches()
    time.sleep(1.5)
    assert switches() - before <= 1  # a 0.2 s poll: 7
    started = time.monotonic()
    server.close()
    thread.join(2.0)
    assert not thread.is_alive()
    assert time.monotonic() - started < 1.0
    assert not server.path.exists()


@pytest.mark.parametrize("extra", [0, 1, 60])
def test_a_view_in_a_runtime_folder_too_deep_for_a_socket_address_is_served_and_found(
    tmp_path, extra
):
    """A socket's address holds 107 bytes. CI's temporary folder once made the final name
    ``PID-TOKEN.sock`` 108 bytes long (the ``.new`` it was bound as, 107): the launch had no view
    that anyone could reach. The name's length is set here to the limit, one over, and far over."""
    from torchrunx.commands.top import find_views, snapshots
    from torchrunx.launcher.view.view_server import UNIX_PATH_BYTES, ViewServer

    final = len(f"{os.getpid()}-00000000.sock")
    depth = UNIX_PATH_BYTES + extra - len(str(tmp_path)) - len("/torchrunx/") - final - 1
    runtime = tmp_path / ("r" * max(depth, 1))
    runtime.mkdir(mode=0o700)
    server = ViewServer(
        lambda: {"report": {"state": "running"}},
        {"pid": os.getpid()},
        runtime={"XDG_RUNTIME_DIR": str(runtime)},
    )
    server.start()
    try:
        assert server.path is not None
        assert len(os.fsencode(server.path)) == UNIX_PATH_BYTES + extra
        assert find_views(server.path.parent) == [server.path]
        first = next(snapshots(server.path))
        assert first["pid"] == os.getpid() and first["report"] == {"state": "running"}
    finally:
        server.close()
    assert list(server.path.parent.iterdir()) == []
