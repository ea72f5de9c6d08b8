"""Warm agents: started once, many runs on fresh workers, nothing left afterwards."""

from __future__ import annotations

import _thread
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import alive, parent_pid, torchrunx_processes, touch_then_sleep, when_file_appears

import torchrunx as trx


def who() -> tuple[int, int, int]:
    """(rank, worker pid, agent pid): workers are forked by their agent."""
    return int(os.environ["RANK"]), os.getpid(), os.getppid()


def rank_sum(value: int) -> float:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(value + dist.get_rank())])
    dist.all_reduce(total)
    return total.item()


def fail_on_rank_1() -> None:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("rank 1 fails this run")


def kill_myself_on_rank_1() -> None:
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)  # stopped by the launcher once rank 1 is found dead


def kill_my_agent() -> None:
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(30)


def gone_within(pids: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def test_runs_fork_fresh_workers_on_the_same_agents_and_the_block_ends_them():
    launcher = trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo")
    with launcher.warm() as warm:
        assert not warm.closed
        first, second = warm.run(who), warm.run(who)
        assert [r for r, _, _ in first.ranks] == [0, 1]
        assert {a for _, _, a in first.ranks} == {a for _, _, a in second.ranks}  # one agent
        assert not {w for _, w, _ in first.ranks} & {w for _, w, _ in second.ranks}  # fresh
        assert warm.run(rank_sum, 10).ranks == [21.0, 21.0]  # a new process group each run
        assert warm.runs == 3
        agents = {a for _, _, a in first.ranks}
    assert warm.closed
    assert gone_within(agents, 5)
    with pytest.raises(RuntimeError, match="closed"):
        warm.run(who)


def test_a_failed_run_fails_alone_and_the_next_run_works_on_the_same_agents():
    with trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend=None).warm() as warm:
        agents = {a for _, _, a in warm.run(who).ranks}
        with pytest.raises(ValueError, match="rank 1 fails this run"):
            warm.run(fail_on_rank_1)
        after_exception = warm.run(who)
        with pytest.raises(trx.WorkerFailedError, match="SIGKILL"):
            warm.run(kill_myself_on_rank_1)
        after_death = warm.run(who)
        assert {a for _, _, a in after_exception.ranks} == agents
        assert {a for _, _, a in after_death.ranks} == agents
        assert after_death.restarts == 0


def test_ctrl_c_stops_the_run_and_leaves_the_agents_ready(tmp_path):
    with trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend=None).warm() as warm:
        agents = {a for _, _, a in warm.run(who).ranks}
        started = time.monotonic()
        running = tmp_path / "running"  # Ctrl-C while the function runs
        with when_file_appears(running, _thread.interrupt_main), pytest.raises(KeyboardInterrupt):
            warm.run(touch_then_sleep, str(running), 60)
        assert time.monotonic() - started < 15
        assert {a for _, _, a in warm.run(who).ranks} == agents


def test_a_lost_agent_fails_its_run_then_the_next_run_says_why_or_replaces_it():
    with trx.Launcher(hostnames=["localhost"], workers_per_host=1, backend=None).warm() as warm:
        with pytest.raises(trx.AgentFailedError):
            warm.run(kill_my_agent)
        started = time.monotonic()
        with pytest.raises(trx.AgentFailedError, match="add 'hosts' to restart_on"):
            warm.run(who)
        assert time.monotonic() - started < 5  # at once, not after a timeout
    launcher = trx.Launcher(
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        restart_on=("exceptions", "deaths", "timeouts", "hosts"),
    )
    with launcher.warm() as warm:
        (before,) = {a for _, _, a in warm.run(who).ranks}
        with pytest.raises(trx.AgentFailedError):
            warm.run(kill_my_agent)
        (after,) = {a for _, _, a in warm.run(who).ranks}  # a new agent on that host
        assert after != before
        assert warm.run(who).ranks[0][2] == after


def test_idle_agents_outlive_agent_timeout_on_heartbeats():
    launcher = trx.Launcher(
        hostnames=["localhost"], workers_per_host=1, backend=None, agent_timeout=2
    )
    with launcher.warm() as warm:
        (agent,) = {a for _, _, a in warm.run(who).ranks}
        time.sleep(5)  # more than agent_timeout without a run
        assert warm.run(who).ranks[0][2] == agent


def test_garbage_collection_ends_the_agents():
    warm = trx.Launcher(hostnames=["localhost"], workers_per_host=1, backend=None).warm()
    agents = {a for _, _, a in warm.run(who).ranks}
    del warm
    gc.collect()
    assert gone_within(agents, 10)


SCRIPT = """
import os, sys, time
import torchrunx as trx

def agent_pid():
    return os.getppid()

warm = trx.Launcher(hostnames=["localhost"], workers_per_host=1, backend=None,
                    agent_timeout=3).warm()
print(warm.run(agent_pid).rank(0), flush=True)
sys.stdin.readline()  # the test looks at the agent while this launcher surely runs
if sys.argv[1] == "hang":
    time.sleep(600)
# "exit": the interpreter ends without close()
"""


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_agents_end_when_the_launcher_process_ends_or_is_killed(tmp_path, how):
    script = tmp_path / "warm_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    with subprocess.Popen(
        [sys.executable, str(script), "exit" if how == "exit" else "hang"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    ) as process:
        assert process.stdin is not None and process.stdout is not None
        agent = int(process.stdout.readline())
        # The launcher waits on its stdin until told to go on: no race decides these checks.
        assert process.poll() is None
        assert alive(agent)
        guardian = parent_pid(agent)  # ends after the agent, once everything below it is gone
        assert guardian != process.pid and alive(guardian)
        process.stdin.close()  # "exit": the launcher's interpreter ends now, without close()
        if how == "sigkill":
            process.kill()
        process.wait(60)
    # agent_timeout, and the workers' grace; then the guardian, which ends last
    assert gone_within({agent, guardian}, 3 + 10)
    assert torchrunx_processes() == []


@pytest.mark.cluster
def test_warm_agents_on_two_hosts_over_ssh(cluster):
    launcher = trx.Launcher(
        hostnames=cluster.names(),
        workers_per_host=2,
        backend="gloo",
        ssh_config_file=cluster.ssh_config,
    )
    with launcher.warm() as warm:
        first = warm.run(rank_sum, 1)
        assert first.ranks == [10.0] * 4
        agents = {a for _, _, a in warm.run(who).ranks}
        assert len(agents) == 2
        assert warm.run(rank_sum, 2).ranks == [14.0] * 4
        assert {a for _, _, a in warm.run(who).ranks} == agents


def die_once(marker: str) -> int:
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)  # a death: restarted (restart_on's default has "deaths")
    return 7


def test_each_warm_run_reports_its_own_restarts_and_duration_in_its_result_and_events(tmp_path):
    events: list[trx.events.Event] = []
    launcher = trx.Launcher(
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        max_restarts=1,
        event_handlers=(events.append,),
    )
    with launcher.warm() as warm:
        time.sleep(1.0)  # idle time before the first run: not part of any run's duration
        first = warm.run(die_once, str(tmp_path / "first"))
        second = warm.run(die_once, str(tmp_path / "second"))
    assert first.rank(0) == second.rank(0) == 7
    assert first.restarts == second.restarts == 1  # not 1, then 2 and 3 as attempts go on
    finished = [e for e in events if isinstance(e, trx.events.LaunchFinished)]
    assert [(f.succeeded, f.attempts) for f in finished] == [(True, 2), (True, 2)]
    for event, result in zip(finished, (first, second), strict=True):
        # one start for both: the run's, not the agents' (1 s and the first run earlier)
        assert abs(event.duration - result.timings.total) < 0.5
