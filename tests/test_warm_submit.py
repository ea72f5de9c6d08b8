"""WarmLauncher.submit: runs in the background, one at a time and in order, cancellable."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import threading
import time
from pathlib import Path

import pytest
from test_warm import alive, fail_on_rank_1, gone_within, who

import torchrunx as trx


def local_warm() -> trx.WarmLauncher:
    return trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo").warm()


def append(log: str, item: str, delay: float = 0.0) -> str:
    """Rank 0 appends ``item`` to ``log`` (after ``delay``); the log keeps the order of runs."""
    time.sleep(delay)
    if int(os.environ["RANK"]) == 0:
        with open(log, "a") as f:
            f.write(item + "\n")
    return item


def wait_for_go(folder: str) -> int:
    """Every rank writes its pid (``started.RANK``), then waits (bounded) for the file ``go``."""
    rank = int(os.environ["RANK"])
    Path(folder, f"started.{rank}.tmp").write_text(str(os.getpid()))
    os.replace(Path(folder, f"started.{rank}.tmp"), Path(folder, f"started.{rank}"))
    deadline = time.monotonic() + 60
    while not Path(folder, "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("nobody said go")
        time.sleep(0.05)
    return rank


def sleep_long(folder: str) -> None:
    """Every rank writes its pid (``started.RANK``), then sleeps far longer than any test."""
    rank = int(os.environ["RANK"])
    Path(folder, f"started.{rank}.tmp").write_text(str(os.getpid()))
    os.replace(Path(folder, f"started.{rank}.tmp"), Path(folder, f"started.{rank}"))
    time.sleep(300)


def touch(path: str) -> None:
    Path(path).touch()


def started_pids(folder: Path, ranks: int = 2, seconds: float = 60) -> set[int]:
    """The worker pids a run wrote into ``folder``, once every rank has (bounded poll)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        files = [folder / f"started.{rank}" for rank in range(ranks)]
        if all(f.exists() for f in files):
            return {int(f.read_text()) for f in files}
        time.sleep(0.05)
    raise AssertionError(f"the run did not start within {seconds} s")


def runner_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torchrunx-warm-submitted"]


def test_submitted_runs_run_one_at_a_time_in_order_with_the_results_run_would_give(tmp_path):
    log = str(tmp_path / "log")
    with local_warm() as warm:
        # The first runs are the slowest: were they run concurrently, later ones would end first.
        futures = [warm.submit(append, log, str(i), delay=0.4 - 0.1 * i) for i in range(5)]
        assert all(isinstance(f, concurrent.futures.Future) for f in futures)
        results = [f.result(timeout=120) for f in futures]
        assert [r.ranks for r in results] == [[str(i), str(i)] for i in range(5)]
        assert all(isinstance(r, trx.LaunchResult) for r in results)
        assert results[0].hostnames == ("localhost",)
        assert Path(log).read_text().split() == ["0", "1", "2", "3", "4"]
        assert not any(f.running() or f.cancelled() for f in futures)
        agents = {a for _, _, a in warm.run(who).ranks}
        assert {a for _, _, a in warm.submit(who).result(timeout=60).ranks} == agents
        assert warm.runs == 7
        assert len(runner_threads()) == 1  # one thread for every submitted run
    assert runner_threads() == []  # ended with the block


def test_a_failed_submitted_run_carries_the_error_run_raises_and_the_next_works():
    with local_warm() as warm:
        agents = {a for _, _, a in warm.run(who).ranks}
        with pytest.raises(ValueError, match="rank 1 fails this run") as direct:
            warm.run(fail_on_rank_1)
        future = warm.submit(fail_on_rank_1)
        error = future.exception(timeout=60)
        assert type(error) is type(direct.value)
        assert "rank 1 fails this run" in str(error)
        with pytest.raises(ValueError, match="rank 1 fails this run"):
            future.result()
        assert not future.cancelled()
        after = warm.submit(who).result(timeout=60)
        assert {a for _, _, a in after.ranks} == agents


def test_submit_checks_its_arguments_at_once_and_refuses_after_close():
    with local_warm() as warm:
        with pytest.raises(TypeError, match="callable"):
            warm.submit(42)  # type: ignore[call-overload]
        with pytest.raises(trx.SerializationError, match="pickle"):
            warm.submit(print, threading.Lock())
        assert runner_threads() == []  # nothing was queued
        assert warm.runs == 0
    with pytest.raises(RuntimeError, match="closed"):
        warm.submit(who)


def test_cancel_of_a_queued_run_means_it_never_starts(tmp_path):
    marker = tmp_path / "marker"
    with local_warm() as warm:
        blocker = warm.submit(wait_for_go, str(tmp_path))
        queued = warm.submit(touch, str(marker))
        after = warm.submit(who)
        started_pids(tmp_path)  # the blocker is under way, so the others are queued
        assert blocker.running()
        assert not queued.running()
        assert queued.cancel()
        assert queued.cancelled()
        assert queued.cancel()  # again: still cancelled
        done, _ = concurrent.futures.wait([queued], timeout=0)
        assert done == {queued}
        with pytest.raises(concurrent.futures.CancelledError):
            queued.result(timeout=0)
        (tmp_path / "go").touch()
        assert blocker.result(timeout=60).ranks == [0, 1]
        assert after.result(timeout=60).ranks[0][0] == 0  # the run after it went on
        assert not blocker.cancel()  # too late: the result stands
        assert not blocker.cancelled()
        assert warm.runs == 2
    assert not marker.exists()


def test_cancel_of_a_run_under_way_stops_its_workers_and_keeps_the_agents(tmp_path):
    with local_warm() as warm:
        agents = {a for _, _, a in warm.run(who).ranks}
        future = warm.submit(sleep_long, str(tmp_path))
        workers = started_pids(tmp_path)
        assert all(alive(pid) for pid in workers)
        assert future.running()
        started = time.monotonic()
        assert future.cancel()
        assert time.monotonic() - started < 15
        assert future.cancelled()
        assert not future.running()
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=0)
        assert gone_within(workers, 5)
        assert {a for _, _, a in warm.run(who).ranks} == agents  # the agents stayed
        assert {a for _, _, a in warm.submit(who).result(timeout=60).ranks} == agents


def test_cancel_from_another_thread_while_the_owner_waits_for_the_result(tmp_path):
    with local_warm() as warm:
        future = warm.submit(sleep_long, str(tmp_path))
        workers = started_pids(tmp_path)
        outcome: list[bool] = []
        canceller = threading.Thread(target=lambda: outcome.append(future.cancel()))
        canceller.start()
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=30)
        canceller.join(30)
        assert outcome == [True]
        assert gone_within(workers, 5)


def test_close_cancels_the_queued_runs_and_the_run_under_way(tmp_path):
    marker = tmp_path / "marker"
    warm = local_warm()
    with warm:
        running = warm.submit(sleep_long, str(tmp_path))
        queued = [warm.submit(touch, str(marker)) for _ in range(3)]
        workers = started_pids(tmp_path)
        started = time.monotonic()
    assert time.monotonic() - started < 20
    assert warm.closed
    assert running.cancelled()
    assert all(f.cancelled() for f in queued)
    assert not marker.exists()
    assert gone_within(workers, 5)
    assert runner_threads() == []


def test_run_waits_for_the_submitted_runs_then_runs_in_the_calling_thread(tmp_path):
    log = str(tmp_path / "log")
    with local_warm() as warm:
        # Slow queued runs: a run() that did not wait would go first, or find the lock taken.
        first = warm.submit(append, log, "first", delay=1.0)
        second = warm.submit(append, log, "second", delay=0.5)
        result = warm.run(append, log, "direct")
        assert first.done()
        assert second.done()
        assert result.ranks == ["direct", "direct"]
        assert Path(log).read_text().split() == ["first", "second", "direct"]


def test_garbage_collection_cancels_submitted_runs_and_ends_the_agents(tmp_path):
    warm = local_warm()
    agents = {a for _, _, a in warm.run(who).ranks}
    future = warm.submit(sleep_long, str(tmp_path))
    queued = warm.submit(touch, str(tmp_path / "marker"))
    workers = started_pids(tmp_path)
    del warm  # the runner thread must not keep the WarmLauncher alive
    gc.collect()
    assert future.cancelled()
    assert queued.cancelled()
    assert gone_within(workers | agents, 10)
    assert runner_threads() == []
    assert not (tmp_path / "marker").exists()
