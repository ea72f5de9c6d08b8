"""Log forwarding: capture at the descriptor level, default files and console, handlers."""

from __future__ import annotations

import argparse
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from typing import TYPE_CHECKING, Literal

import pytest

import torchrunx as trx
from torchrunx.launcher.settings.environ import log_level_from_env
from torchrunx.launcher.view.logrouter import TAIL_BYTES, TAIL_LINES, LogRouter
from torchrunx.wire.lines import (
    TAIL_LINE_BYTES,
    Line,
    cut_line,
)

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path


def chatty() -> int:
    rank = int(os.environ["RANK"])
    print(f"print from rank {rank}")
    os.write(1, f"os.write from rank {rank}\n".encode())
    subprocess.run(["echo", f"subprocess of rank {rank}"], check=True)
    logging.getLogger("mylib").info("logging.info from rank %d", rank)
    logging.getLogger("mylib").debug("debug from rank %d", rank)
    warnings.warn(f"warning from rank {rank}", stacklevel=1)
    print(f"stderr from rank {rank}", file=sys.stderr)
    return rank


def launch_dir(log_dir: Path) -> Path:
    (folder,) = (path for path in log_dir.iterdir() if path.is_dir() and not path.is_symlink())
    return folder


@pytest.fixture
def torchrunx_info() -> Iterator[None]:
    """The launcher's ``torchrunx`` logger at INFO: the console shows the agents' lifecycle."""
    logger = logging.getLogger("torchrunx")
    old = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(old)


@pytest.mark.cluster
def test_two_hosts_files_layout_content_and_console(cluster, log_dir, capsys, torchrunx_info):
    trx.launch(
        chatty,
        hostnames=cluster.names(),
        workers_per_host=2,
        backend=None,
        ssh_config_file=cluster.ssh_config,
    )
    folder = launch_dir(log_dir)
    node1, node2 = cluster.names()
    assert sorted(p.name for p in folder.iterdir()) == [
        f"{node1}.log",
        f"{node1}[0].log",
        f"{node1}[1].log",
        f"{node2}.log",
        f"{node2}[0].log",
        f"{node2}[1].log",
    ]
    assert folder.stat().st_mode & 0o777 == 0o700
    for path in folder.iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    worker = (folder / f"{node2}[1].log").read_text()
    for text in (
        "print from rank 3",
        "os.write from rank 3",
        "subprocess of rank 3",
        "logging.info from rank 3",
        "stderr from rank 3",
    ):
        assert text in worker
    assert "WARNING py.warnings" in worker and "warning from rank 3" in worker
    assert "INFO mylib: logging.info from rank 3" in worker
    assert "debug from rank 3" not in worker  # below the default INFO level
    assert "WARNING worker.1.stderr: stderr from rank 3" in worker
    assert f"agent of host 1 started on {node2}" in (folder / f"{node2}.log").read_text()
    out = capsys.readouterr().out
    assert f"[{node1}:0] print from rank 0" in out
    assert f"[{node1}] agent of host 0 started on {node1}" in out
    assert "rank 1" not in out and node2 not in out  # only the first agent and its first worker


def test_lines_in_order_none_lost_under_load(log_dir):
    def flood() -> None:
        for i in range(100_000):
            print(f"line {i}")

    trx.launch(
        flood, hostnames=["localhost"], workers_per_host=1, backend=None, log_handlers="auto"
    )
    lines = (launch_dir(log_dir) / "localhost[0].log").read_text().splitlines()
    numbers = [int(line.rsplit(" ", 1)[1]) for line in lines if " line " in line]
    assert numbers == list(range(100_000))


def test_log_dir_empty_writes_no_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", "")
    monkeypatch.chdir(tmp_path)
    trx.launch(chatty, hostnames=["localhost"], workers_per_host=1, backend=None)
    assert list(tmp_path.iterdir()) == []
    assert "[localhost:0] print from rank 0" in capsys.readouterr().out


def test_default_log_dir_and_unique_folders(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHRUNX_LOG_DIR")
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        trx.launch(os.getpid, hostnames=["localhost"], workers_per_host=1, backend=None)
    entries = sorted((tmp_path / "torchrunx_logs").iterdir())
    folders = [entry for entry in entries if entry.is_dir() and not entry.is_symlink()]
    assert len(folders) == 2
    for folder in folders:  # ISO 8601 names that sort by time, each with its events beside it
        assert folder.name[:4].isdigit() and "T" in folder.name
        assert (folder.parent / f"{folder.name}.events.jsonl").is_file()
    assert len(entries) == 4  # the folders and their events files: no "latest" link (0.4's)
    assert len(next(os.walk(tmp_path / "torchrunx_logs"))[1]) == 2  # as 0.4's test counts them


def test_log_level_from_environment(log_dir, monkeypatch):
    monkeypatch.setenv("TORCHRUNX_LOG_LEVEL", "DEBUG")
    trx.launch(chatty, hostnames=["localhost"], workers_per_host=1, backend=None)
    assert "debug from rank 0" in (launch_dir(log_dir) / "localhost[0].log").read_text()
    assert log_level_from_env({"TORCHRUNX_LOG_LEVEL": "30"}) == 30
    with pytest.raises(ValueError, match="TORCHRUNX_LOG_LEVEL='LOUD' is not a logging level"):
        log_level_from_env({"TORCHRUNX_LOG_LEVEL": "LOUD"})


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.closed = False

    def close(self) -> None:
        self.closed = True
        super().close()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_custom_handlers_list_factory_and_filter(log_dir, capsys):
    everything, only_rank1 = Collect(), Collect()
    trx.add_filter_to_handler(only_rank1, socket.gethostname(), 1, logging.WARNING)
    host = socket.gethostname()
    trx.launch(
        chatty,
        hostnames=[host],
        workers_per_host=2,
        backend=None,
        log_handlers=[everything, only_rank1],
    )
    assert list(log_dir.iterdir()) == []  # custom handlers replace the defaults
    assert capsys.readouterr().out == ""
    texts = {(r.local_rank, r.getMessage()) for r in everything.records}
    assert (0, "print from rank 0") in texts and (1, "os.write from rank 1") in texts
    assert any(r.local_rank is None and "started" in r.getMessage() for r in everything.records)
    record = next(r for r in everything.records if r.getMessage() == "logging.info from rank 1")
    assert (record.hostname, record.local_rank, record.rank, record.levelno, record.name) == (
        host,
        1,
        1,
        logging.INFO,
        "mylib",
    )
    assert only_rank1.records
    assert {(r.local_rank, r.levelno >= logging.WARNING) for r in only_rank1.records} == {(1, True)}

    made: list[Collect] = []
    trx.launch(
        chatty,
        hostnames=[host],
        workers_per_host=1,
        backend=None,
        log_handlers=lambda: made.append(Collect()) or made,
    )
    assert any(r.getMessage() == "print from rank 0" for r in made[0].records)


def timed_lines() -> list[float]:
    import time

    stamps = []
    for i in range(3):
        stamps.append(time.time())
        print(f"line {i}", flush=True)
        time.sleep(1.1)  # one line per second: each needs its own date and time text
    return stamps


def test_records_are_whole_log_records_with_the_workers_times(log_dir):
    # Every standard LogRecord attribute must be there for a user's formatter, and each record
    # must carry its own line and the time the worker wrote it (file lines show that time too).
    names = ["asctime", "created", "filename", "funcName", "levelname", "levelno", "lineno"]
    names += ["module", "msecs", "name", "pathname", "process", "processName"]
    names += ["relativeCreated", "thread", "threadName", "message"]
    every_field = " ".join(f"%({name})s" for name in names)
    collect = Collect()
    collect.setFormatter(logging.Formatter(every_field))
    path = log_dir / "rank0.log"
    file_handler = trx.file_handler("localhost", 0, path)
    result = trx.launch(
        timed_lines,
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        log_handlers=[collect, file_handler],
    )
    file_handler.close()
    stamps = result.rank(0)
    records = [r for r in collect.records if r.local_rank == 0]
    assert [r.getMessage() for r in records] == ["line 0", "line 1", "line 2"]
    formatted = [collect.format(r) for r in records]
    assert all(f.endswith(f" line {i}") for i, f in enumerate(formatted))  # format() raised not
    assert [r.created for r in records] == pytest.approx(stamps, abs=0.05)
    # relativeCreated counts from when logging was loaded, as in a record made here.
    loaded = logging._startTime  # what LogRecord itself counts from
    for record in records:
        assert record.relativeCreated == pytest.approx((record.created - loaded) * 1000, abs=1)
    file_lines = path.read_text().splitlines()
    assert [line.rsplit(": ", 1)[1] for line in file_lines] == ["line 0", "line 1", "line 2"]
    for stamp, line in zip(stamps, file_lines, strict=True):
        written = (
            time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
        )
        assert abs(written - stamp) < 0.05, (line, stamp)


def test_helpers_file_and_stream_handler(tmp_path, capsys):
    path = tmp_path / "rank0.txt"
    handlers = [trx.file_handler("localhost", 0, path), trx.stream_handler("localhost", None)]
    trx.launch(
        chatty, hostnames=["localhost"], workers_per_host=2, backend=None, log_handlers=handlers
    )
    text = path.read_text()
    assert "print from rank 0" in text and "rank 1" not in text
    assert path.stat().st_mode & 0o777 == 0o600
    for handler in handlers:  # handlers given as a list stay the caller's to close
        handler.close()
    out = capsys.readouterr().out
    assert "[localhost] agent of host 0 started" in out and "print from" not in out


def test_no_handlers_prints_nothing(capsys, log_dir):
    trx.launch(chatty, hostnames=["localhost"], workers_per_host=1, backend=None, log_handlers=None)
    assert capsys.readouterr().out == ""
    assert list(log_dir.iterdir()) == []


def test_failure_includes_output_tail_and_log_path(log_dir):
    def fail() -> None:
        for i in range(30):
            print(f"step {i}")
        raise RuntimeError("diverged")

    with pytest.raises(RuntimeError, match="diverged") as info:
        trx.launch(fail, hostnames=["localhost"], workers_per_host=1, backend=None)
    note = next(n for n in info.value.__notes__ if "lines of its output" in n)
    assert "step 29" in note and "step 10" in note and "step 9\n" not in note  # the last 20
    assert str(launch_dir(log_dir) / "localhost[0].log") in note


def test_console_shows_agent_lifecycle_only_at_torchrunx_info(log_dir, capsys):
    # By default: rank 0's output and what went wrong; the files keep the lifecycle.
    trx.launch(chatty, hostnames=["localhost"], workers_per_host=1, backend=None)
    out = capsys.readouterr().out
    assert "[localhost:0] print from rank 0" in out
    assert "[localhost] " not in out, out
    agent_file = (launch_dir(log_dir) / "localhost.log").read_text()
    assert "INFO torchrunx.agent: started 1 workers: pids [" in agent_file
    assert "INFO torchrunx.agent: worker 0 (pid " in agent_file

    logger = logging.getLogger("torchrunx")
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        trx.launch(chatty, hostnames=["localhost"], workers_per_host=1, backend=None)
    finally:
        logger.setLevel(old)
    out = capsys.readouterr().out
    assert "[localhost] started 1 workers: pids [" in out
    assert "[localhost] worker 0 (pid " in out and ") exited with status 0" in out


def test_console_level_of_agent_records_follows_the_launchers_logger(monkeypatch, capsys):
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", "")
    router = LogRouter("auto", ["node1"])
    router.add_workers(0, 1)
    router.emit(0, None, None, Line(logging.INFO, "torchrunx.agent", "started 1 workers"), 0.0)
    router.emit(0, None, None, Line(logging.WARNING, "agent", "bash: oops"), 0.0)
    router.emit(0, 0, 0, Line(logging.INFO, "worker.0.stdout", "rank 0 says hi"), 0.0)
    logger = logging.getLogger("torchrunx.agent")
    old = logger.level
    logger.setLevel(logging.ERROR)  # per logger, the standard way
    try:
        router.emit(0, None, None, Line(logging.WARNING, "agent", "hidden warning"), 0.0)
    finally:
        logger.setLevel(old)
    router.close()
    assert capsys.readouterr().out.splitlines() == [
        "[node1] bash: oops",  # warnings pass under Python's default WARNING
        "[node1:0] rank 0 says hi",
    ]


def print_then_exit() -> None:
    for i in range(3000):
        print(f"line {i}")


def test_a_workers_output_comes_before_its_exit():
    # The agent's "worker N exited" must not overtake the worker's last lines (it used to travel
    # on the agent's stderr, apart from the workers' lines: out of order in most of these runs).
    for _ in range(4):
        collect = Collect()
        trx.launch(
            print_then_exit,
            hostnames=["localhost"],
            workers_per_host=1,
            backend=None,
            log_handlers=[collect],
        )
        records = collect.records
        exited = next(
            i
            for i, r in enumerate(records)
            if r.local_rank is None and "exited with status" in r.getMessage()
        )
        last_line = max(i for i, r in enumerate(records) if r.local_rank == 0)
        assert records[last_line].getMessage() == "line 2999"
        assert last_line < exited, f"worker's line {last_line} after its exit {exited}"
        assert records[exited].created >= records[last_line].created


def test_failure_tail_is_capped_in_bytes(log_dir):
    def flood_then_fail() -> None:
        os.write(1, b"x" * 10_000_000)  # 10 MB without a newline
        print("\nlast words")
        raise RuntimeError("diverged")

    with pytest.raises(RuntimeError, match="diverged") as info:
        trx.launch(flood_then_fail, hostnames=["localhost"], workers_per_host=1, backend=None)
    note = next(n for n in info.value.__notes__ if "of its output" in n)
    assert len(note.encode()) < 40 * 1024
    assert "more bytes cut]" in note
    assert note.endswith("    last words")
    assert (launch_dir(log_dir) / "localhost[0].log").read_text().count("x") == 10_000_000


def test_cut_line_and_tail_budget(monkeypatch):
    assert cut_line("short") == "short"
    cut = cut_line("é" * 5000, limit=4096)  # 2 bytes each: never half a character
    assert cut == "é" * 2048 + " [... 5904 more bytes cut]"
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", "")
    router = LogRouter(None, ["node1"])
    for i in range(TAIL_LINES):
        router.emit(0, 0, 0, Line(logging.INFO, "w", f"{i:02d}" + "y" * 10_000), 0.0)
    tail = router.tail(0, 0)
    assert all(len(line.encode()) <= TAIL_LINE_BYTES + 40 for line in tail)
    assert sum(len(line.encode()) + 1 for line in tail) <= TAIL_BYTES
    assert tail[-1].startswith(f"{TAIL_LINES - 1:02d}")  # the newest lines are kept


class _Pass(logging.Filter):
    """A filter of the user's own: the handler then gets LogRecords, as ``logging`` makes them."""


BATCH = (
    (0, logging.INFO, "worker.0.stdout", "plain 100% line", 1_700_000_000.25),
    (0, logging.INFO, "worker.0.stdout", "same read, same time", 1_700_000_000.25),
    (0, logging.WARNING, "worker.0.stderr", "a warning", 1_700_000_000.9996),
    (0, logging.ERROR, "mylib", "boom\nTraceback (most recent call last):\n  x", 1_700_000_001.5),
    (0, 25, "mylib", "a level of its own", 1_700_000_001.5),
    (0, logging.DEBUG, "mylib", "below the level", 1_700_000_002.0),
    (None, logging.INFO, "torchrunx.agent", "started 2 workers", 1_700_000_002.0),
    (None, logging.WARNING, "agent", "bash: oops", 1_700_000_002.0),
    (1, logging.INFO, "worker.1.stdout", "rank 1 line\nits second line", 1_700_000_002.0),
    (0, logging.INFO, "worker.0.stdout", "back to rank 0", 1_700_000_003.0),
)


def test_emit_batch_writes_what_logging_would(tmp_path, monkeypatch):
    # The handlers of torchrunx are written to directly (no LogRecord per line): their text
    # must be what the same handlers write through logging, record by record.
    console = io.StringIO()
    monkeypatch.setattr(sys, "stdout", console)
    written = {}
    for way in ("direct", "records"):
        console.seek(0)
        console.truncate()
        handlers = [
            trx.file_handler("node1", 0, tmp_path / f"{way}-0.log", logging.INFO),
            trx.file_handler("node1", 1, tmp_path / f"{way}-1.log"),
            trx.file_handler("node1", None, tmp_path / f"{way}-agent.log"),
            trx.stream_handler("node1", 0),
            trx.stream_handler("node1", None, logging.WARNING),
        ]
        handled: list[logging.LogRecord] = []
        for handler in handlers:
            if way == "records":
                handler.addFilter(_Pass())
            else:
                handler.handle = handled.append  # type: ignore[method-assign]
        router = LogRouter(handlers, ["node1"])
        router.emit_batch(0, 4, BATCH)
        # Flushed after the batch: all there before any close.
        written[way] = [(tmp_path / f"{way}-{n}.log").read_text() for n in ("0", "1", "agent")]
        written[way].append(console.getvalue())
        assert handled == []  # written directly, without a LogRecord
        for handler in handlers:
            handler.close()
    assert written["direct"] == written["records"]
    rank0, rank1, agent, out = written["direct"]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_700_000_000))
    assert rank0.splitlines()[:3] == [
        f"{stamp},250 INFO worker.0.stdout: plain 100% line",
        f"{stamp},250 INFO worker.0.stdout: same read, same time",
        f"{stamp},999 WARNING worker.0.stderr: a warning",
    ]
    assert "ERROR mylib: boom\nTraceback (most recent call last):\n  x\n" in rank0
    assert "Level 25 mylib: a level of its own" in rank0
    assert "below the level" not in rank0
    assert rank0.endswith("INFO worker.0.stdout: back to rank 0\n")
    assert rank1.endswith("INFO worker.1.stdout: rank 1 line\nits second line\n")
    assert agent.count("\n") == 2
    assert out == (
        "[node1:0] plain 100% line\n[node1:0] same read, same time\n[node1:0] a warning\n"
        "[node1:0] boom\n[node1:0] Traceback (most recent call last):\n[node1:0]   x\n"
        "[node1:0] a level of its own\n[node1:0] below the level\n"
        "[node1] bash: oops\n"
        "[node1:0] back to rank 0\n"
    )


def test_emit_batch_gives_user_handlers_whole_records_in_order():
    collect = Collect()
    collect.setFormatter(logging.Formatter("%(asctime)s %(rank)s %(message)s"))
    router = LogRouter([collect], ["node1", "node2"])
    router.emit_batch(1, 4, BATCH)
    records = collect.records
    assert [r.getMessage() for r in records] == [text for *_, text, _ in BATCH]
    assert [(r.local_rank, r.rank) for r in records] == [
        (local_rank, None if local_rank is None else 4 + local_rank) for local_rank, *_ in BATCH
    ]
    assert {(r.hostname, r.host_index) for r in records} == {("node2", 1)}
    assert [(r.levelno, r.levelname, r.name) for r in records] == [
        (levelno, logging.getLevelName(levelno), name) for _, levelno, name, _, _ in BATCH
    ]
    assert [r.created for r in records] == [created for *_, created in BATCH]
    assert records[0].msecs == 250 and records[2].msecs == 999
    assert all(collect.format(r) for r in records)
    assert router.tail(1, 0)[-1] == "back to rank 0"
    assert router.tail(1, None) == ["started 2 workers", "bash: oops"]


def test_emit_batch_console_follows_the_launchers_logger(monkeypatch):
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", "")
    console = io.StringIO()
    monkeypatch.setattr(sys, "stdout", console)
    router = LogRouter("auto", ["node1"])
    router.add_workers(0, 2)
    router.emit_batch(0, 0, BATCH)
    logger = logging.getLogger("torchrunx.agent")
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        router.emit_batch(0, 0, BATCH[6:8])
    finally:
        logger.setLevel(old)
    router.close()
    lines = console.getvalue().splitlines()
    assert lines.count("[node1] bash: oops") == 2  # a warning: shown under Python's default
    assert lines.count("[node1] started 2 workers") == 1  # INFO: only once the logger says so
    assert "[node1:0] below the level" not in lines  # TORCHRUNX_LOG_LEVEL is INFO
    assert not any("rank 1" in line for line in lines)


def test_a_broken_handler_does_not_stop_the_others(tmp_path, capsys):
    broken = trx.file_handler("node1", 0, tmp_path / "broken.log")
    broken.stream.close()  # writing to it, and flushing it, raise
    kept = trx.file_handler("node1", 0, tmp_path / "kept.log")
    router = LogRouter([broken, kept], ["node1"])
    for text in ("one", "two"):
        router.emit(0, 0, 0, Line(logging.INFO, "w", text), 0.0)  # written, not yet flushed
    router.emit_batch(0, 0, BATCH[:2])  # written and flushed
    assert capsys.readouterr().err.count("--- Logging error ---") == 4  # 3 writes, 1 flush
    assert (tmp_path / "kept.log").read_text().count("\n") == 4
    kept.close()


def test_a_handler_changed_during_a_launch_is_followed(tmp_path):
    handler = trx.file_handler("node1", 0, tmp_path / "rank0.log")
    router = LogRouter([handler], ["node1"])
    line = (0, logging.INFO, "worker.0.stdout", "as made", 1_700_000_000.0)
    router.emit_batch(0, 0, (line,))
    handler.setLevel(logging.WARNING)
    router.emit_batch(0, 0, ((*line[:3], "below its new level", line[4]),))
    handler.setLevel(logging.NOTSET)
    handler.setFormatter(logging.Formatter("%(rank)s %(message)s!"))
    router.emit_batch(0, 3, ((*line[:3], "its new format", line[4]),))
    handler.close()
    text = (tmp_path / "rank0.log").read_text()
    assert text.endswith(" INFO worker.0.stdout: as made\n3 its new format!\n")


def _each_worker_says(hostnames: list[str], workers: int) -> list[tuple[int, int, int]]:
    """``(host_index, rank_offset, local_rank)`` of every worker of hosts with ``workers`` each."""
    return [(h, h * workers, w) for h in range(len(hostnames)) for w in range(workers)]


@pytest.mark.parametrize(
    ("console_ranks", "shown"),
    [
        ((0,), {"[node1:0] from rank 0"}),
        ((0, 3), {"[node1:0] from rank 0", "[node2:1] from rank 3"}),
        ((2,), {"[node2:0] from rank 2"}),
        ((), set()),
        ("all", {f"[node{h + 1}:{w}] from rank {2 * h + w}" for h in (0, 1) for w in (0, 1)}),
    ],
)
def test_console_ranks_choose_the_workers_on_the_console(monkeypatch, console_ranks, shown):
    monkeypatch.setenv("TORCHRUNX_LOG_DIR", "")
    console = io.StringIO()
    monkeypatch.setattr(sys, "stdout", console)
    hostnames = ["node1", "node2"]
    router = LogRouter("auto", hostnames, console_ranks=console_ranks)
    for host_index, offset in ((0, 0), (1, 2)):
        router.add_workers(host_index, 2, offset)
    for host_index, offset, local_rank in _each_worker_says(hostnames, 2):
        line = Line(logging.INFO, "worker.0.stdout", f"from rank {offset + local_rank}")
        router.emit(host_index, local_rank, offset + local_rank, line, 0.0)
    for host_index in (0, 1):
        router.emit(host_index, None, None, Line(logging.WARNING, "agent", "agent trouble"), 0.0)
    router.close()
    lines = console.getvalue().splitlines()
    assert {line for line in lines if "from rank" in line} == shown
    assert len(lines) == len(set(lines))  # each shown once, whoever else is shown
    # The first host's agent always; another host's agent with a worker of its own shown.
    agents = {line for line in lines if "agent trouble" in line}
    node2_shown = any(line.startswith("[node2:") for line in shown)
    assert agents == {"[node1] agent trouble"} | (
        {"[node2] agent trouble"} if node2_shown else set()
    )
    missing = router.console_ranks_missing(4)
    assert missing == []
    assert LogRouter("auto", hostnames, console_ranks=(1, 9, 7)).console_ranks_missing(4) == [7, 9]


def test_console_ranks_of_a_real_launch_and_on_the_command_line(log_dir, capsys, caplog):
    host = socket.gethostname()
    trx.launch(chatty, hostnames=[host], workers_per_host=2, backend=None, console_ranks="all")
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"[{host}:{rank}] print from rank {rank}" in out
        assert f"[{host}:{rank}] subprocess of rank {rank}" in out
    trx.launch(chatty, hostnames=[host], workers_per_host=2, backend=None, console_ranks=(1, 5))
    out = capsys.readouterr().out
    assert f"[{host}:1] print from rank 1" in out
    assert "from rank 0" not in out
    warned = [r.getMessage() for r in caplog.records if r.name == "torchrunx.launcher"]
    assert any("console_ranks names rank 5, but the launch has 2 workers" in m for m in warned)
    # Every worker is in its file whatever the console shows.
    files = [p for p in log_dir.iterdir() if p.is_dir() and not p.is_symlink()]
    assert len(files) == 2
    for folder in files:
        for rank in (0, 1):
            assert f"print from rank {rank}" in (folder / f"{host}[{rank}].log").read_text()

    parser = argparse.ArgumentParser()
    trx.add_launcher_arguments(parser)
    for argv, value in (([], (0,)), (["0", "3"], (0, 3)), (["all"], "all"), ([], ())):
        words = ["--console-ranks", *argv] if value != (0,) else []
        assert trx.launcher_from_args(parser.parse_args(words)).console_ranks == value


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"console_ranks": (-1,)}, ValueError, "(integers >= 0), got (-1,)"),
        ({"console_ranks": "every"}, ValueError, 'console_ranks must be "all" or global ranks'),
        ({"console_ranks": (True,)}, ValueError, "got (True,)"),
        (
            {"console_ranks": (1,), "log_handlers": None},
            ValueError,
            'no default handlers: put "auto" in the list',
        ),
        (
            {"console_ranks": "all", "log_handlers": [logging.NullHandler()]},
            ValueError,
            "trx.stream_handler(hostname, local_rank)",
        ),
        ({"log_handlers": ["auto", "files"]}, TypeError, 'with "auto" among them'),
    ],
)
def test_console_ranks_and_log_handlers_refused_before_anything_starts(fields, error, words):
    with pytest.raises(error) as caught:
        trx.Launcher(hostnames=["localhost"], **fields).validate()
    assert words in str(caught.value)


def test_console_ranks_with_auto_in_a_list_is_accepted():
    collect = Collect()
    trx.Launcher(
        hostnames=["localhost"], console_ranks=(1,), log_handlers=["auto", collect]
    ).validate()
    trx.Launcher(hostnames=["localhost"], console_ranks=(0,), log_handlers=[collect]).validate()


def test_defaults_kept_beside_a_handler_and_a_factory_given_the_resolved_hosts(log_dir, capsys):
    host = socket.gethostname()
    collect = Collect()
    trx.launch(
        chatty, hostnames=[host], workers_per_host=2, backend=None, log_handlers=["auto", collect]
    )
    assert f"[{host}:0] print from rank 0" in capsys.readouterr().out  # the default console
    folder = launch_dir(log_dir)
    assert "print from rank 1" in (folder / f"{host}[1].log").read_text()  # the default files
    assert {"print from rank 0", "print from rank 1"} <= {r.getMessage() for r in collect.records}
    assert collect.closed is False  # a list's handlers stay the caller's

    setups: list[trx.LogSetup] = []
    made: list[Collect] = []

    def factory(setup: trx.LogSetup) -> list[logging.Handler | Literal["auto"]]:
        setups.append(setup)
        made.append(Collect())
        return ["auto", made[-1]]

    hostfile = log_dir.parent / "hostfile"
    hostfile.write_text(f"{host} slots=2\n")
    trx.launch(
        chatty,
        hostnames=f"hostfile:{hostfile}",
        workers_per_host="auto",
        backend=None,
        log_handlers=factory,
    )
    assert setups == [
        trx.LogSetup(hostnames=(host,), workers_per_host=(2,), log_level=logging.INFO)
    ]
    assert any(r.getMessage() == "print from rank 1" for r in made[0].records)
    assert made[0].closed is True  # made for the launch: closed with it
    assert len([p for p in log_dir.iterdir() if p.is_dir() and not p.is_symlink()]) == 2

    with pytest.raises(
        TypeError, match=r"returned 'oops'; it must return a list of logging.Handler"
    ):
        trx.launch(chatty, hostnames=[host], backend=None, log_handlers=lambda: "oops")


USR1_SCRIPT = """
import os, sys, time
import torchrunx as trx

def wait_for(folder):
    rank = os.environ["RANK"]
    with open(f"{folder}/pid{rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{folder}/pid{rank}.tmp", f"{folder}/pid{rank}")
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{folder}/go") and time.monotonic() < deadline:
        time.sleep(0.05)
    return rank

result = trx.launch(wait_for, (sys.argv[1],), hostnames=["localhost"], workers_per_host=2,
                    backend=None)
print("results", result.rank(0), result.rank(1), flush=True)
"""


def test_kill_usr1_shows_a_workers_stacks_at_once_and_it_goes_on(tmp_path, log_dir):
    process = subprocess.Popen(
        [sys.executable, "-c", USR1_SCRIPT, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pid1").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "rank 1 did not start"
            time.sleep(0.05)
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGUSR1)  # rank 1: not on the console
        assert process.stdout is not None
        seen = []
        for line in process.stdout:  # shown while the launch runs, not at its end
            seen.append(line)
            if "in wait_for" in line:
                break
        (tmp_path / "go").touch()
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    shown = "".join(seen)
    assert "[localhost:1] Python stacks of worker 1 (pid " in shown, shown
    assert "), on SIGUSR1:" in shown
    assert process.returncode == 0, err
    assert out.splitlines()[-1] == "results 0 1"  # the worker went on and returned
    rank1 = (launch_dir(log_dir) / "localhost[1].log").read_text()
    assert "WARNING torchrunx.stacks: Python stacks of worker 1" in rank1
    assert " in wait_for\n" in rank1  # its own file has them too: where it was
    assert "Python stacks" not in (launch_dir(log_dir) / "localhost[0].log").read_text()


HINTED = """
import torchrunx as trx

def hello():
    return 1

print("RESULT", trx.launch(hello, hostnames=["localhost"], workers_per_host=2, backend=None).ranks)
"""


def _launch_in_a_terminal(tmp_path, cache) -> str:
    """The hint script run in a pseudo-terminal in ``tmp_path``; what the terminal showed."""
    import pexpect

    (tmp_path / "hinted.py").write_text(HINTED)
    env = {**os.environ, "TORCHRUNX_HINTS": "1", "TORCHRUNX_CACHE_DIR": str(cache)}
    env.pop("TORCHRUNX_LOG_DIR", None)  # the default: ./torchrunx_logs
    child = pexpect.spawn(
        sys.executable, ["hinted.py"], cwd=str(tmp_path), env=env, encoding="utf-8", timeout=120
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    return child.before


def test_the_first_launch_on_a_terminal_says_once_where_every_ranks_output_is(tmp_path):
    cache = tmp_path / "cache"
    shown = _launch_in_a_terminal(tmp_path, cache)
    folders = [
        p for p in (tmp_path / "torchrunx_logs").iterdir() if p.is_dir() and not p.is_symlink()
    ]
    assert len(folders) == 1, folders
    hint = (
        f"torchrunx: the console shows rank 0; every rank's output is in torchrunx_logs/"
        f"{folders[0].name}/ (a file per worker, HOST[LOCAL_RANK].log); console_ranks='all' "
        "(--console-ranks all) shows every rank here. (Said once.)"
    )
    assert hint in shown.replace("\r\n", "\n"), shown
    assert "found no GPU" not in shown  # workers_per_host=2: nothing of "auto"'s cores
    assert (cache / "hints" / "logs").exists()
    assert not (cache / "hints" / "auto-cores").exists()
    again = _launch_in_a_terminal(tmp_path, cache)
    assert "RESULT [1, 1]" in again
    assert "(Said once.)" not in again


def test_without_a_terminal_there_is_no_hint_and_nothing_is_remembered(tmp_path):
    (tmp_path / "hinted.py").write_text(HINTED)
    env = {**os.environ, "TORCHRUNX_HINTS": "1", "TORCHRUNX_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "hinted.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "(Said once.)" not in done.stderr + done.stdout
    assert not (tmp_path / "cache" / "hints").exists()


def test_auto_on_a_machine_without_gpus_says_once_that_it_started_a_worker_per_core(tmp_path):
    # workers_per_host="auto" (the default) on this machine, which has no GPU.
    cache = tmp_path / "cache"
    (tmp_path / "auto.py").write_text(
        HINTED.replace("workers_per_host=2", 'workers_per_host="auto"')
    )
    env = {**os.environ, "TORCHRUNX_HINTS": "1", "TORCHRUNX_CACHE_DIR": str(cache)}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, wherever the test runs

    def in_a_terminal() -> str:
        import pexpect

        child = pexpect.spawn(
            sys.executable, ["auto.py"], cwd=str(tmp_path), env=env, encoding="utf-8", timeout=120
        )
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0, child.before
        return child.before.replace("\r\n", "\n")

    cores = len(os.sched_getaffinity(0))
    shown = in_a_terminal()
    assert f"RESULT {[1] * cores}" in shown, shown
    assert (
        f"torchrunx: workers_per_host='auto' found no GPU on localhost ({cores}), so it started "
        "one worker per CPU core there; give workers_per_host=N (--workers-per-host N) for fewer. "
        "(Said once.)"
    ) in shown, shown
    assert "found no GPU" not in in_a_terminal()  # once


def test_rule_the_auto_cores_hint_names_at_most_four_hosts():
    from torchrunx.launcher.view.logrouter import auto_cores_text

    assert auto_cores_text([]) is None
    hosts = [(f"n{i}", 64) for i in range(6)]
    text = auto_cores_text(hosts)
    assert text is not None
    assert text.startswith("torchrunx: workers_per_host='auto' found no GPU on n0 (64), n1 (64), ")
    assert "n3 (64) and 2 more, so it started one worker per CPU core there" in text
    assert "n4" not in text
    assert auto_cores_text(hosts[:4]) is not None
    assert "more" not in (auto_cores_text(hosts[:4]) or "")


def test_rule_the_auto_cores_hint_names_only_hosts_where_auto_found_no_gpu():
    from torchrunx.launcher.view.logrouter import auto_cores_hosts

    world = [
        ("login1", None, 64, 0),  # "auto", no GPU: a worker per core
        ("gpu1", None, 8, 8),  # "auto" found GPUs: a worker per GPU, nothing to say
        ("cpu2", 4, 4, 0),  # a number given (a list or a host file): nothing to say
    ]
    assert auto_cores_hosts(world) == [("login1", 64)]
    assert auto_cores_hosts(world[1:]) == []


def test_rule_a_hint_is_said_once_on_a_terminal_and_never_with_hints_off(tmp_path, monkeypatch):
    from torchrunx.launcher.view.logrouter import say_once

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert not say_once("auto-cores", "hint\n", None)  # TORCHRUNX_HINTS=0: the folder is None
    assert err.getvalue() == ""
    assert say_once("auto-cores", "hint\n", tmp_path / "hints")
    assert not say_once("auto-cores", "hint\n", tmp_path / "hints")  # remembered
    assert err.getvalue() == "hint\n"
