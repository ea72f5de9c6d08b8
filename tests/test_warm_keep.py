"""Warm agents whose workers stay: one process and process group per rank, run after run."""

from __future__ import annotations

import _thread
import os
import signal
import threading

import pytest
from conftest import parent_pid, touch_then_sleep, wait_gone, when_file_appears

import torchrunx as trx

LOADED: list[int] = []
"""A module global of the worker: this module is imported once by a worker that stays."""


def state(_run: int) -> tuple[int, int, int, int, float]:
    """(rank, pid, module global's length, worker_cache count, all_reduce of ones)."""
    import torch
    import torch.distributed as dist

    LOADED.append(_run)
    trx.worker_cache["calls"] = trx.worker_cache.get("calls", 0) + 1
    total = torch.ones(1)
    dist.all_reduce(total)  # the process group of the first run, still working
    return (
        int(os.environ["RANK"]),
        os.getpid(),
        len(LOADED),
        trx.worker_cache["calls"],
        total.item(),
    )


def fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails this run")


def fail_first_attempt() -> str:
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        raise ValueError("attempt 0 fails")
    return os.environ["TORCHELASTIC_RESTART_COUNT"]


def pids(result: trx.LaunchResult[tuple[int, int, int, int, float]]) -> list[int]:
    return [pid for _, pid, _, _, _ in result.ranks]


def launcher(**fields: object) -> trx.Launcher:
    return trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo", **fields)  # type: ignore[arg-type]


def test_kept_workers_take_every_call_with_what_they_loaded():
    with launcher().warm(keep_workers=True) as warm:
        assert warm.keep_workers
        results = [warm.run(state, run) for run in range(1, 5)]
        workers = pids(results[0])
    assert [r.fresh_workers for r in results] == [True, False, False, False]
    assert all(pids(r) == workers for r in results)  # the same processes
    for run, result in enumerate(results, start=1):
        assert [(rank, n, calls, total) for rank, _, n, calls, total in result.ranks] == [
            (0, run, run, 2.0),
            (1, run, run, 2.0),
        ]
    for pid in workers:
        wait_gone(pid)  # the block ended them


def test_without_keep_workers_every_run_has_new_processes_and_an_empty_cache():
    with launcher().warm() as warm:
        first, second = warm.run(state, 1), warm.run(state, 2)
    assert not set(pids(first)) & set(pids(second))
    assert [calls for _, _, _, calls, _ in second.ranks] == [1, 1]
    assert first.fresh_workers and second.fresh_workers


def test_a_failed_run_replaces_the_kept_workers_and_the_next_result_says_so():
    with launcher().warm(keep_workers=True) as warm:
        before = warm.run(state, 1)
        with pytest.raises(ValueError, match="rank 1 fails this run"):
            warm.run(fail_on_rank_1)
        after = warm.run(state, 2)
        again = warm.run(state, 3)
    assert after.fresh_workers
    assert not set(pids(before)) & set(pids(after))
    assert [calls for _, _, _, calls, _ in after.ranks] == [1, 1]  # nothing of earlier runs
    assert not again.fresh_workers
    assert pids(again) == pids(after)


def test_a_kept_worker_killed_between_runs_is_replaced_before_the_next_run(caplog):
    died = threading.Event()

    def on_event(event: trx.events.Event) -> None:
        if isinstance(event, trx.events.WorkerFailed) and event.rank == 1:
            died.set()

    with launcher(event_handlers=[on_event]).warm(keep_workers=True) as warm:
        before = warm.run(state, 1)
        os.kill(pids(before)[1], signal.SIGKILL)
        assert died.wait(10)  # the launcher learnt it while idle (a WorkerFailed event)
        with caplog.at_level("WARNING", logger="torchrunx.launcher"):
            after = warm.run(state, 2)
    assert after.fresh_workers
    assert not set(pids(before)) & set(pids(after))
    assert [(rank, calls, total) for rank, _, _, calls, total in after.ranks] == [
        (0, 1, 2.0),
        (1, 1, 2.0),
    ]
    assert any("not all well" in r.getMessage() for r in caplog.records)


def test_a_restart_within_a_run_of_kept_workers_starts_fresh_ones():
    with launcher(max_restarts=1).warm(keep_workers=True) as warm:
        first = warm.run(state, 1)
        result = warm.run(fail_first_attempt)
        after = warm.run(state, 2)
    assert first.fresh_workers
    assert result.restarts == 1
    assert result.ranks == ["1", "1"]
    assert not set(pids(first)) & set(pids(after))
    assert not after.fresh_workers  # the restarted workers stayed for this run


def test_ctrl_c_in_a_run_of_kept_workers_stops_them_and_the_next_run_is_fresh(tmp_path):
    with launcher().warm(keep_workers=True) as warm:
        before = warm.run(state, 1)
        running = tmp_path / "running"  # Ctrl-C while the function runs
        with when_file_appears(running, _thread.interrupt_main), pytest.raises(KeyboardInterrupt):
            warm.run(touch_then_sleep, str(running), 60)
        for pid in pids(before):
            wait_gone(pid)
        after = warm.run(state, 2)
    assert after.fresh_workers


def test_an_agent_killed_between_runs_of_kept_workers_fails_the_next_run():
    with launcher().warm(keep_workers=True) as warm:
        before = warm.run(state, 1)
        agent = parent_pid(pids(before)[0])
        os.kill(agent, signal.SIGKILL)
        wait_gone(agent)
        with pytest.raises(trx.AgentFailedError, match="localhost"):
            warm.run(state, 2)


def test_keep_workers_must_be_a_bool():
    with pytest.raises(TypeError, match="keep_workers"):
        launcher().warm(keep_workers="yes")  # type: ignore[arg-type]


@pytest.mark.cluster
def test_kept_workers_on_two_hosts_over_ssh(cluster):
    launch = trx.Launcher(
        hostnames=cluster.names()[:2],
        workers_per_host=1,
        backend="gloo",
        ssh_config_file=cluster.ssh_config,
    )
    with launch.warm(keep_workers=True) as warm:
        results = [warm.run(state, run) for run in range(1, 4)]
    assert all(pids(r) == pids(results[0]) for r in results)
    assert [r.fresh_workers for r in results] == [True, False, False]
    assert [total for _, _, _, _, total in results[-1].ranks] == [2.0, 2.0]
    assert [calls for _, _, _, calls, _ in results[-1].ranks] == [3, 3]
