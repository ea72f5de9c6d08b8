"""``torchrunx logs``: the rules of which file is whose (pure), and the command on real launches."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx.commands import logs as cli_logs
from torchrunx.commands.logs import RankFile, find_launch, launches, rank_files, select


def _events(*events: dict[str, object]) -> list[dict[str, object]]:
    return list(events)


def _started(index: int, host: str, ranks: list[int], attempt: int = 0) -> dict[str, object]:
    return {
        "event": "WorkersStarted",
        "host_index": index,
        "hostname": host,
        "attempt": attempt,
        "ranks": ranks,
    }


def test_rule_each_file_is_named_by_its_host_and_local_rank_and_mapped_to_its_rank(tmp_path):
    events = _events(
        {"event": "LaunchStarted", "hostnames": ["a", "b"]},
        _started(1, "b", [2, 3]),
        _started(0, "a", [0, 1]),
    )
    files = rank_files(tmp_path, events)
    assert [(f.rank, f.path.name) for f in files] == [
        (0, "a[0].log"),
        (1, "a[1].log"),
        (2, "b[0].log"),
        (3, "b[1].log"),
        (None, "a.log"),
        (None, "b.log"),
    ]
    assert files[3].label == "rank 3 (b[1])"
    assert files[4].label == "agent (a)"


def test_rule_a_host_given_twice_has_its_files_numbered_as_the_router_names_them(tmp_path):
    events = _events(
        {"event": "LaunchStarted", "hostnames": ["a", "a"]},
        _started(0, "a", [0]),
        _started(1, "a", [1]),
    )
    names = [(f.rank, f.path.name) for f in rank_files(tmp_path, events)]
    assert names == [(0, "a[0].log"), (1, "a-1[0].log"), (None, "a.log"), (None, "a-1.log")]


def test_rule_the_last_attempt_and_the_last_world_count(tmp_path):
    # A restart starts the workers again; a changed world (a spare in) names new hosts.
    events = _events(
        {"event": "LaunchStarted", "hostnames": ["a", "b"]},
        _started(0, "a", [0]),
        _started(1, "b", [1]),
        {"event": "HostsChanged", "hostnames": ["a", "spare"]},
        _started(0, "a", [0], attempt=1),
        _started(1, "spare", [1], attempt=1),
    )
    files = rank_files(tmp_path, events)
    assert [(f.rank, f.hostname, f.path.name) for f in files if f.rank is not None] == [
        (0, "a", "a[0].log"),
        (1, "spare", "spare[0].log"),
    ]
    assert [f.path.name for f in files if f.rank is None] == ["a.log", "spare.log"]


def test_rule_files_the_events_do_not_explain_are_listed_without_a_rank(tmp_path):
    (tmp_path / "x[0].log").write_text("")
    (tmp_path / "a[0].log").write_text("")
    files = rank_files(tmp_path, _events(_started(0, "a", [0])))
    assert [(f.rank, f.path.name) for f in files] == [(0, "a[0].log"), (None, "x[0].log")]


def test_rule_half_written_event_lines_are_not_events(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps({"event": "LaunchStarted", "hostnames": ["a"]}) + '\n{"event": "Wor')
    assert cli_logs.read_events(path) == [{"event": "LaunchStarted", "hostnames": ["a"]}]
    assert cli_logs.read_events(tmp_path / "missing") == []


def test_rule_the_newest_launch_is_the_folder_whose_time_sorts_last(tmp_path):
    for name in ("2026-01-02T03:04:05", "2026-01-02T03:04:05.000001", "2026-01-02T03:04:05.1-2"):
        (tmp_path / name).mkdir()
    (tmp_path / "notes").mkdir()  # not a launch's
    (tmp_path / "2026-01-02T03:04:05.events.jsonl").write_text("")
    assert [p.name for p in launches(tmp_path)] == [
        "2026-01-02T03:04:05",
        "2026-01-02T03:04:05.000001",
        "2026-01-02T03:04:05.1-2",
    ]
    assert find_launch(tmp_path, None).name == "2026-01-02T03:04:05.1-2"
    assert find_launch(tmp_path, "2026-01-02T03:04:05") == tmp_path / "2026-01-02T03:04:05"
    with pytest.raises(FileNotFoundError, match=r"no launch 'x': .*torchrunx logs --launches"):
        find_launch(tmp_path, "x")
    with pytest.raises(FileNotFoundError, match=r"no launch has logged in .* set it, or give"):
        find_launch(tmp_path / "empty", None)


def test_rule_a_rank_or_agent_that_is_not_there_is_named_with_those_that_are(tmp_path):
    files = [
        RankFile(0, "a", 0, tmp_path / "a[0].log"),
        RankFile(1, "a", 1, tmp_path / "a[1].log"),
        RankFile(3, "b", 0, tmp_path / "b[0].log"),
        RankFile(None, "a", None, tmp_path / "a.log"),
    ]
    assert select(files, 1, None) == [files[1]]
    assert select(files, None, "a") == [files[3]]
    assert select(files, None, None) == files
    with pytest.raises(LookupError, match=r"no rank 7 in this launch \(its ranks: 0-1,3\)"):
        select(files, 7, None)
    with pytest.raises(LookupError, match=r"no agent on 'c' in this launch \(its hosts: \['a'\]\)"):
        select(files, None, "c")


# -- the command, on real launches ----------------------------------------------------------------


def says(word: str) -> str:
    print(f"{word} from rank {os.environ['RANK']}", flush=True)
    return word


def _logs(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchrunx", "logs", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_logs_shows_the_newest_launch_and_one_ranks_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHRUNX_LOG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    trx.launch(says, ("first",), hostnames=["localhost"], workers_per_host=2, backend=None)
    trx.launch(says, ("second",), hostnames=["localhost"], workers_per_host=2, backend=None)
    newest = launches(tmp_path / "torchrunx_logs")[-1]

    shown = _logs(cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"launch {newest.name}  [localhost]  succeeded in ")
    (mapped,) = [line for line in lines if line.startswith("  rank 1 (localhost[1]) ")]
    assert mapped.split()[-1] == f"torchrunx_logs/{newest.name}/localhost[1].log"
    assert "==> localhost[1].log: rank 1 (localhost[1]) <==" in lines
    assert "second from rank 1" in shown.stdout
    assert "first from rank" not in shown.stdout  # the older launch's

    one = _logs("--rank", "1", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert "second from rank 1" in one.stdout
    assert "from rank 0" not in one.stdout

    older = launches(tmp_path / "torchrunx_logs")[0]
    named = _logs(older.name, "--rank", "0", cwd=tmp_path)
    assert "first from rank 0" in named.stdout, named.stderr

    listed = _logs("--launches", cwd=tmp_path)
    assert [line.split()[0] for line in listed.stdout.splitlines()] == [older.name, newest.name]

    missing = _logs("--rank", "5", cwd=tmp_path)
    assert missing.returncode == 1
    assert missing.stderr == "torchrunx logs: no rank 5 in this launch (its ranks: 0-1)\n"


def slow_lines(count: int) -> None:
    for i in range(count):
        print(f"line {i} of rank {os.environ['RANK']}", flush=True)
        time.sleep(0.2)


def test_logs_follow_prints_lines_as_they_come_and_ends_with_the_launch(tmp_path):
    env = {**os.environ, "TORCHRUNX_LOG_DIR": str(tmp_path / "logs")}
    script = tmp_path / "slow.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torchrunx as trx\n"
        "from test_cli_logs import slow_lines\n"
        "trx.launch(slow_lines, (25,), hostnames=['localhost'], workers_per_host=2, backend=None)\n"
    )
    with subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path) as launch:
        deadline = time.monotonic() + 60
        while not launches(tmp_path / "logs") and time.monotonic() < deadline:
            time.sleep(0.05)  # until the launch has its folder
        follow = subprocess.run(
            [sys.executable, "-m", "torchrunx", "logs", "--follow"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert launch.wait(timeout=60) == 0
    assert follow.returncode == 0, follow.stderr  # it ended by itself, with the launch
    out = follow.stdout
    for rank in (0, 1):  # every line of each rank, in order, whether shown or followed
        lines = [
            line.split("stdout: ")[-1] for line in out.splitlines() if f"of rank {rank}" in line
        ]
        assert lines == [f"line {i} of rank {rank}" for i in range(25)], out
    assert "[rank 1 (localhost[1])] " in out  # followed, with whose it is
    assert out.splitlines()[-1].startswith("[agent (localhost)] ")  # to the agent's last line


def test_logs_main_without_any_launch_says_where_it_looked(tmp_path):
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_:
        cli_logs.main(["--log-dir", str(tmp_path / "none")], out)
    assert exit_.value.code == 1
