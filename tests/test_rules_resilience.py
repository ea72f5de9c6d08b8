"""Rules of spare hosts, a shrinking world and the preemption grace, pure.

- a spare takes a failed host's place: same position, so the same ranks (docs/resilience.md);
- spares are used in the order given, ready ones first (the launch sorts them);
- without a spare, the failed host's place is dropped and the later hosts move up;
- below ``min_hosts`` (or with none given, below the launch's hosts) the world cannot go on;
- a count of spares takes the last hosts; named spares must be other hosts;
- the default preemption grace is SLURM's KillWait less 2 s inside a job, else 0.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
from typing import TYPE_CHECKING

import pytest

import torchrunx as trx
from torchrunx import serialization
from torchrunx.errors import AgentFailedError, Preempted
from torchrunx.events import AgentState
from torchrunx.hosts import HostSlots, hostlists
from torchrunx.launcher.launch.preempt import default_grace, end_preemption, slurm_kill_wait
from torchrunx.launcher.state.records import AgentRecord, Phase
from torchrunx.launcher.state.spares import Reshape, check_resilience, reshape, split_spares
from torchrunx.launcher.state.state import LaunchState
from torchrunx.wire.messages import AgentHello, WorkerResult, WorkersEnded, WorkerSpec

if TYPE_CHECKING:
    from torchrunx.launcher.settings.plan import LaunchPlan


def test_a_spare_takes_the_failed_hosts_position():
    assert reshape([0, 1, 2], [1], [3, 4], None) == Reshape((0, 3, 2), replaced=((1, 3),))


def test_spares_are_taken_in_order_for_failed_hosts_in_rank_order():
    decision = reshape([0, 1, 2], [2, 0], [5, 3], None)
    assert decision == Reshape((5, 1, 3), replaced=((0, 5), (2, 3)))


def test_without_a_spare_the_later_hosts_move_up():
    assert reshape([0, 1, 2, 3], [1], [], 2) == Reshape((0, 2, 3), dropped=(1,))


def test_spares_first_then_dropped_places():
    assert reshape([0, 1, 2], [0, 2], [3], 1) == Reshape((3, 1), replaced=((0, 3),), dropped=(2,))


def test_min_hosts_is_a_floor_the_world_may_reach():
    assert reshape([0, 1, 2], [2], [], 2).short is None
    short = reshape([0, 1, 2], [1, 2], [], 2).short
    assert short is not None
    assert "1 host(s) would be fewer than min_hosts=2" in short


def test_without_min_hosts_the_world_never_shrinks():
    short = reshape([0, 1], [1], [], None).short
    assert short is not None
    assert "set min_hosts to go on with fewer" in short
    assert reshape([0, 1], [1], [2], None).short is None


def test_nothing_failed_nothing_changes():
    assert reshape([4, 2], [], [7], 1) == Reshape((4, 2))


def _hosts(*names: str) -> list[HostSlots]:
    return [HostSlots(name, 2) for name in names]


def test_a_count_of_spares_takes_the_last_hosts():
    world, spares = split_spares(_hosts("a", "b", "c", "d"), 1, None)
    assert [h.hostname for h in world] == ["a", "b", "c"]
    assert [h.hostname for h in spares] == ["d"]
    assert split_spares(_hosts("a", "b"), 0, None) == (_hosts("a", "b"), [])


def test_named_spares_come_beside_the_hosts():
    world, spares = split_spares(_hosts("a", "b"), ("c",), 2, _hosts("c"))
    assert ([h.hostname for h in world], [h.hostname for h in spares]) == (["a", "b"], ["c"])


@pytest.mark.parametrize(
    ("hosts", "spare_hosts", "min_hosts", "named", "message"),
    [
        (("a", "b"), 2, None, (), "takes every one of the 2 hosts"),
        (("a", "b"), ("b",), None, ("b",), r"spare_hosts \['b'\] are also in hostnames"),
        (("a", "b", "c"), 1, 3, (), "min_hosts=3 is more than the 2 hosts that run"),
    ],
)
def test_spares_that_leave_nothing_to_run_are_refused(
    hosts, spare_hosts, min_hosts, named, message
):
    with pytest.raises(ValueError, match=message):
        split_spares(_hosts(*hosts), spare_hosts, min_hosts, _hosts(*named))


def test_spares_or_min_hosts_need_hosts_restarts():
    check_resilience(1, 2, ("hosts",), 1)
    check_resilience(0, None, (), 0)  # nothing asked: nothing needed
    with pytest.raises(ValueError, match="add 'hosts' to restart_on"):
        check_resilience(("node9",), None, ("deaths",), 3)
    with pytest.raises(ValueError, match="min_hosts is used only"):
        check_resilience(0, 1, ("hosts",), 0)


@pytest.mark.parametrize(
    ("spare_hosts", "min_hosts", "error"),
    [
        ("node9", None, TypeError),
        (True, None, TypeError),
        (("",), None, TypeError),
        ((3,), None, TypeError),
        (-1, None, ValueError),
        (0, 0, ValueError),
        (0, 1.5, TypeError),
        (0, False, TypeError),
    ],
)
def test_bad_values_are_named(spare_hosts, min_hosts, error):
    with pytest.raises(error, match=r"spare_hosts|min_hosts"):
        check_resilience(spare_hosts, min_hosts, ("hosts",), 1)


# -- the launch state: spares wait, failed hosts are quarantined, the world is reshaped --------


def _launch_with_spare(hosts: int = 2, spares: int = 1) -> tuple[LaunchState, list[AgentRecord]]:
    """Agents said hello (the spare too) and every host runs its workers."""
    agents = [
        AgentRecord(i, HostSlots(f"node{i}", 1), "ssh", role="host" if i < hosts else "spare")
        for i in range(hosts + spares)
    ]
    state = LaunchState(
        agents, agent_timeout=30.0, started=100.0, world=agents[:hosts], max_restarts=1
    )
    for agent in agents:
        hello = AgentHello(agent.index, agent.slots.hostname, 1000 + agent.index, 1, 29500)
        state.agent_table.agent_hello(agent, conn=agent.index, hello=hello, now=101.0)
    assert state.agent_table.all_hellos
    state.agent_table.agents_ready(102.0)
    for position, agent in enumerate(agents[:hosts]):
        spec = WorkerSpec(position, agent.slots.hostname, 1, position, hosts, "h", 1, "gloo", 9.0)
        state.current.assign(agent, spec)
    return state, agents


def test_the_start_waits_only_for_the_worlds_hosts():
    agents = [AgentRecord(0, HostSlots("a", 1), "ssh"), AgentRecord(1, HostSlots("b", 1), "ssh")]
    agents[1].role = "spare"
    state = LaunchState(agents, agent_timeout=30.0, started=0.0, world=agents[:1])
    state.agent_table.agent_hello(agents[0], 0, AgentHello(0, "a", 1, 1, 2), 1.0)
    assert state.agent_table.all_hellos  # the spare's hello may come later
    state.agent_table.agents_ready(1.0)
    assert (agents[0].ready, agents[1].ready) == (True, False)  # no hello: not ready
    state.progress.move_phase(Phase.STARTING_WORKERS)
    state.agent_table.agent_hello(agents[1], 1, AgentHello(1, "b", 2, 1, 3), 2.0)
    assert agents[1].ready  # a spare that says hello later waits at once


def test_a_spare_that_fails_is_no_fault_of_the_run():
    state, agents = _launch_with_spare()
    assert (
        state.current.agent_failed(agents[2], AgentFailedError("node2", "x"), 1.0, lost=True) == []
    )
    assert (agents[2].state, state.faults, state.progress.degraded) == (AgentState.LOST, [], True)
    # ... and it does not make the launch unhealthy: only the world's hosts do.
    state.progress.degraded = False
    report = state.health(105.0, max_restarts=1, cause=None)
    assert report.healthy
    assert [(a.hostname, a.role, a.state) for a in report.agents] == [
        ("node0", "host", AgentState.RUNNING),
        ("node1", "host", AgentState.RUNNING),
        ("node2", "spare", AgentState.LOST),
    ]


def test_a_hosts_failure_is_a_fault_and_quarantine_says_so():
    state, agents = _launch_with_spare()
    state.current.agent_failed(agents[1], AgentFailedError("node1", "x"), 1.0)
    assert [(f.kind, f.host_index) for f in state.faults] == [("agent", 1)]
    line = state.agent_table.quarantine(agents[1])
    assert line == "attempt 0: node1 (host 1, FAILED) quarantined"
    assert agents[1].role == "quarantined"
    # A quarantined host's later end is no fault either.
    assert state.current.agent_failed(agents[1], AgentFailedError("node1", "y"), 2.0) == []
    assert len(state.faults) == 1


def test_reshaping_puts_the_spare_in_the_failed_hosts_place():
    state, agents = _launch_with_spare()
    state.current.agent_failed(agents[0], AgentFailedError("node0", "x"), 1.0)
    state.agent_table.quarantine(agents[0])
    lines = state.agent_table.reshape_world(Reshape((2, 1), replaced=((0, 2),)))
    assert lines == ["attempt 1: spare node2 replaces node0 (host 0)"]
    assert state.world == [agents[2], agents[1]]
    assert agents[2].role == "host"
    assert state.agent_table.world_changes == [
        "attempt 0: node0 (host 0, FAILED) quarantined",
        *lines,
    ]
    assert state.agent_table.unready_agents() == [agents[1]]  # the survivor still runs its workers
    report = state.health(105.0, max_restarts=1, cause=None)
    assert report.world_changes == tuple(state.agent_table.world_changes)
    assert [a.role for a in report.agents] == ["quarantined", "host", "host"]


def test_reshaping_without_a_spare_drops_the_place():
    state, agents = _launch_with_spare(hosts=3, spares=0)
    lines = state.agent_table.reshape_world(Reshape((0, 2), dropped=(1,)))
    assert lines == ["attempt 1: no spare for node1: 2 hosts go on"]
    assert state.world == [agents[0], agents[2]]


def test_a_new_attempt_leaves_spares_waiting():
    state, agents = _launch_with_spare()
    assert agents[2].ready and not agents[0].ready
    state.next_attempt()
    assert agents[2].ready
    assert state.finished is False


def test_the_stop_and_the_end_are_the_worlds():
    state, agents = _launch_with_spare()
    agents[2].ready = False  # a spare that is busy is not waited for
    for agent in agents[:2]:
        state.agent_table.workers_ended(agent, WorkersEnded(1, attempt=0))
    assert state.agent_table.stopped
    timings = state.timings(connect=(0.0, 0.0))
    assert len(timings.agent_start) == 2


def test_the_default_grace_is_slurms_kill_wait_less_2_s():
    config = (
        "AuthType                = auth/munge\nKillWait                = 30 sec\nMaxJobCount = 10\n"
    )
    assert slurm_kill_wait(config) == 30
    assert slurm_kill_wait("nothing here") is None
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    assert default_grace(job, lambda: config) == 28
    assert default_grace(job, lambda: "KillWait = 2 sec") == 1  # never below 1 s in a job
    assert default_grace({}, lambda: config) == 0  # outside SLURM: at once, as before
    assert default_grace(job, lambda: "") == 0


def test_the_messages_name_the_field_and_the_way_out():
    with pytest.raises(ValueError, match=r"^spare_hosts is used only when a failed host"):
        check_resilience(("node9",), None, ("deaths",), 3)
    with pytest.raises(
        ValueError,
        match=r"another host \(a failed host's spare on the same host would fail with it\)$",
    ):
        split_spares(_hosts("a", "b"), ("b",), None, _hosts("b"))
    short = reshape([0, 1], [1], [], None).short
    assert short == (
        "1 host(s) failed and no spare host was left: 1 host(s) would be fewer than the "
        "launch's hosts (set min_hosts to go on with fewer)"
    )


def test_the_default_grace_reads_this_process_and_scontrol(monkeypatch):
    from torchrunx.launcher.launch import preempt

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    assert default_grace(read_config=lambda: "KillWait = 12 sec") == 10  # os.environ read
    monkeypatch.setattr(preempt, "_scontrol_config", lambda: "KillWait = 9 sec")
    monkeypatch.setattr(
        preempt.shutil, "which", lambda name: "/usr/bin/scontrol" if name == "scontrol" else None
    )
    assert default_grace() == 7  # scontrol found: its config is read
    monkeypatch.setattr(preempt.shutil, "which", lambda _: None)
    assert default_grace() == 0  # no scontrol: no grace, nothing is run

    def broken() -> str:
        raise OSError("no such file")

    assert default_grace(read_config=broken) == 0


def test_a_spare_that_says_hello_during_the_start_waits_like_the_others():
    agents = [AgentRecord(0, HostSlots("a", 1), "ssh"), AgentRecord(1, HostSlots("b", 1), "ssh")]
    agents[1].role = "spare"
    state = LaunchState(agents, agent_timeout=30.0, started=0.0, world=agents[:1])
    state.agent_table.agent_hello(agents[1], 1, AgentHello(1, "b", 2, 1, 3), 1.0)
    assert not agents[1].ready  # the start: agents_ready makes every agent that said hello wait
    agents[0].role = "quarantined"  # a quarantined host's late hello makes it wait for nothing
    state.progress.move_phase(Phase.STARTING_WORKERS)
    state.agent_table.agent_hello(agents[0], 0, AgentHello(0, "a", 1, 1, 2), 2.0)
    assert not agents[0].ready


def test_a_failed_spare_is_judged_no_longer():
    state, agents = _launch_with_spare()
    agents[2].judge_by = 5.0
    state.current.agent_failed(agents[2], None, 1.0)
    assert agents[2].judge_by is None


def test_a_dropped_place_names_every_failed_host_and_the_next_start_is_the_worlds():
    state, _ = _launch_with_spare(hosts=4, spares=0)
    lines = state.agent_table.reshape_world(Reshape((0, 3), dropped=(1, 2)))
    assert lines == ["attempt 1: no spare for node1, node2: 2 hosts go on"]
    assert state.agent_table.all_hellos  # the hosts left all said hello: nothing to wait for


# -- the end of a preemption (end_preemption: what it returns, and whether the job was requeued)


def _preempted_state() -> LaunchState:
    """A launch of two ranks on two hosts, running; rank 0 returned 42 within the grace."""
    state, _ = _launch_with_spare(2, 0)
    state.start_run(102.0, warm=False)
    for rank in state.ranks:
        state.current.worker_hello(rank, conn=100 + rank.rank, pid=2000 + rank.rank)
    payload = [bytearray(part) for part in serialization.dumps(42)]
    state.current.worker_result(state.ranks[0], WorkerResult(0), payload, 103.0)
    return state


def _end(plan: LaunchPlan) -> tuple[Preempted, list[str]]:
    calls: list[str] = []
    error = end_preemption(
        _preempted_state(),
        plan,
        "the launcher received SIGTERM",
        lambda: calls.append("stop"),
        lambda error: calls.append(f"finished {type(error).__name__}"),
    )
    return error, calls


def _plan(**resilience: object) -> LaunchPlan:
    """A plan of hosts a and b (ssh), read from this process's environment, as a launch's."""
    base = trx.Launcher(hostnames=["localhost"], workers_per_host=1, preemption_grace=0).plan()
    hosts = dataclasses.replace(base.hosts, slots=tuple(_hosts("a", "b")), methods=("ssh", "ssh"))
    changed = dataclasses.replace(base.resilience, **resilience)  # type: ignore[arg-type]
    return dataclasses.replace(base, hosts=hosts, resilience=changed)


def _scontrol(
    monkeypatch: pytest.MonkeyPatch, returncode: int, stderr: str = ""
) -> list[list[str]]:
    """``scontrol`` is installed and ``scontrol requeue`` answers ``returncode`` (no process)."""
    from torchrunx.launcher.launch import preempt

    ran: list[list[str]] = []

    def run(command: list[str], **_options: object) -> subprocess.CompletedProcess[str]:
        ran.append(command)
        return subprocess.CompletedProcess(command, returncode, "", stderr)

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setattr(preempt.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(preempt.subprocess, "run", run)
    return ran


def test_when_scontrol_requeue_fails_preempted_requeued_stays_false(monkeypatch):
    ran = _scontrol(monkeypatch, 1, "slurm_requeue error: Access/permission denied\n")
    error, calls = _end(_plan(requeue=True, preemption_grace=5.0))
    assert ran == [["scontrol", "requeue", "77"]]
    assert error.requeued is False
    assert "the SLURM job was requeued" not in str(error)
    assert error.__notes__ == [
        "ranks [1] did not return within preemption_grace=5 s and were stopped",
        (
            "the SLURM job was not requeued: scontrol requeue 77 failed: slurm_requeue error: "
            "Access/permission denied"
        ),
    ]
    assert (error.returned, error.world_size, calls) == ({0: 42}, 2, ["stop", "finished Preempted"])


def test_outside_a_slurm_job_requeue_is_not_done_and_preempted_says_so(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOBID", raising=False)
    error, _ = _end(_plan(requeue=True))
    assert error.requeued is False
    assert error.__notes__[-1] == (
        "the SLURM job was not requeued: not inside a SLURM job (no SLURM_JOB_ID)"
    )


def test_when_scontrol_requeue_succeeds_preempted_says_requeued_and_sigterm_is_ignored(
    monkeypatch,
):
    ran = _scontrol(monkeypatch, 0)
    before = signal.getsignal(signal.SIGTERM)
    try:
        error, _ = _end(_plan(requeue=True))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # SLURM ends the job now
    finally:
        signal.signal(signal.SIGTERM, before)
    assert ran == [["scontrol", "requeue", "77"]]
    assert error.requeued is True
    assert str(error).endswith("; the SLURM job was requeued")
    assert not any("requeued" in note for note in error.__notes__)


def test_without_requeue_no_scontrol_runs(monkeypatch):
    ran = _scontrol(monkeypatch, 0)
    error, _ = _end(_plan())
    assert ran == [] and error.requeued is False


def test_min_hosts_equal_to_the_hosts_that_run_is_allowed_and_no_place_may_be_dropped():
    world, spares = split_spares(_hosts("a", "b", "c"), 1, 2)  # 2 run, min_hosts=2
    assert ([h.hostname for h in world], [h.hostname for h in spares]) == (["a", "b"], ["c"])
    assert split_spares(_hosts("a", "b"), 0, 2)[0] == _hosts("a", "b")
    assert reshape([0, 1], [1], [2], 2) == Reshape((0, 2), replaced=((1, 2),))  # a spare: fine
    short = reshape([0, 1], [1], [], 2).short  # no spare: 1 host would be fewer than 2
    assert short == (
        "1 host(s) failed and no spare host was left: 1 host(s) would be fewer than min_hosts=2"
    )


def test_a_preemption_names_its_reason_logs_a_failed_requeue_and_survives_a_second_signal(
    monkeypatch, caplog
):
    _scontrol(monkeypatch, 1, "denied")
    for interrupt in (KeyboardInterrupt, SystemExit):

        def stop(interrupt: type[BaseException] = interrupt) -> None:
            raise interrupt  # a second signal while everything stops

        state = _preempted_state()
        state.ranks[1].result = [bytearray(b"not a pickle")]  # what rank 1 sent cannot load
        try:
            error = end_preemption(
                state, _plan(requeue=True), "the agent on b got SIGTERM", stop, print
            )
        except (KeyboardInterrupt, SystemExit):  # a test failure, not pytest's own interrupt
            pytest.fail(f"{interrupt.__name__} during the stop escaped end_preemption")
        assert error.reason == "the agent on b got SIGTERM" and error.returned == {0: 42}
        assert error.__notes__[0] == (
            "ranks [1] did not return within preemption_grace=0 s and were stopped"
        )
        assert error.__notes__[1].startswith("rank 1's return value cannot be unpickled here: ")
    assert (
        caplog.messages[-1] == "the SLURM job was not requeued: scontrol requeue 77 failed: denied"
    )


# -- the requeue itself (requeue_job: which job, scontrol's call, what a failure says) ----------


def _requeue_runner(
    monkeypatch: pytest.MonkeyPatch, answer: subprocess.CompletedProcess[str] | Exception
) -> list[tuple[list[str], dict[str, object]]]:
    """``scontrol`` installed; ``subprocess.run`` recorded and answered (no process)."""
    from torchrunx.launcher.launch import preempt

    calls: list[tuple[list[str], dict[str, object]]] = []

    def run(command: list[str], **options: object) -> subprocess.CompletedProcess[str]:
        calls.append((command, options))
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(
        preempt.shutil, "which", lambda name: "/usr/bin/scontrol" if name == "scontrol" else None
    )
    monkeypatch.setattr(preempt.subprocess, "run", run)
    return calls


def test_requeue_runs_scontrol_for_this_job_with_a_time_limit_and_its_output_captured(
    monkeypatch,
):
    from torchrunx.launcher.launch.preempt import requeue_job

    calls = _requeue_runner(monkeypatch, subprocess.CompletedProcess([], 0, "", ""))
    monkeypatch.setenv("SLURM_JOB_ID", "999")  # the environment given wins over this process's
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert requeue_job({"SLURM_JOB_ID": "12", "SLURM_JOBID": "13"}) is None
        assert requeue_job({"SLURM_JOB_ID": "", "SLURM_JOBID": "14"}) is None  # the older name
        assert requeue_job() is None  # this process's environment
    finally:
        signal.signal(signal.SIGTERM, before)
    options = {"capture_output": True, "text": True, "timeout": 30, "check": False}
    assert calls == [
        (["scontrol", "requeue", "12"], options),
        (["scontrol", "requeue", "14"], options),
        (["scontrol", "requeue", "999"], options),
    ]


def test_requeue_says_why_not_without_a_job_without_scontrol_or_when_scontrol_fails(monkeypatch):
    from torchrunx.launcher.launch import preempt
    from torchrunx.launcher.launch.preempt import requeue_job

    job = {"SLURM_JOB_ID": "12"}
    calls = _requeue_runner(monkeypatch, subprocess.CompletedProcess([], 1, " out\n", ""))
    assert requeue_job({"SLURM_JOB_ID": "", "SLURM_JOBID": ""}) == (
        "not inside a SLURM job (no SLURM_JOB_ID)"
    )
    assert calls == []
    assert requeue_job(job) == "scontrol requeue 12 failed: out"  # no stderr: stdout says why
    calls = _requeue_runner(monkeypatch, subprocess.CompletedProcess([], 2, "out", " err \n"))
    assert requeue_job(job) == "scontrol requeue 12 failed: err"
    _requeue_runner(monkeypatch, subprocess.TimeoutExpired(["scontrol"], 30))
    assert requeue_job(job) == (
        "scontrol requeue 12 failed: Command '['scontrol']' timed out after 30 seconds"
    )
    _requeue_runner(monkeypatch, OSError("no such file"))
    assert requeue_job(job) == "scontrol requeue 12 failed: no such file"
    monkeypatch.setattr(preempt.shutil, "which", lambda name: None if name == "scontrol" else name)
    assert requeue_job(job) == "scontrol is not installed here"


def test_requeue_from_another_thread_leaves_sigterm_as_it_is(monkeypatch):
    import threading

    from torchrunx.launcher.launch.preempt import requeue_job

    _requeue_runner(monkeypatch, subprocess.CompletedProcess([], 0, "", ""))
    before = signal.getsignal(signal.SIGTERM)
    done: list[str | None] = []
    thread = threading.Thread(target=lambda: done.append(requeue_job({"SLURM_JOB_ID": "3"})))
    thread.start()
    thread.join()
    assert done == [None]
    assert signal.getsignal(signal.SIGTERM) is before


def test_requeue_ignores_sigterm_from_before_scontrol_runs_and_puts_it_back_if_it_failed(
    monkeypatch,
):
    # SLURM's SIGTERM that ends the requeued job can come while scontrol still runs: a series
    # run saw the launcher end there (its preemption handler: a second SIGTERM stops at once),
    # before the caller's code after the launch printed its line.
    from torchrunx.launcher.launch import preempt

    seen: list[object] = []

    def answer(code: int) -> None:
        def run(command: list[str], **options: object) -> subprocess.CompletedProcess[str]:
            del options
            seen.append(signal.getsignal(signal.SIGTERM))
            return subprocess.CompletedProcess(command, code, "", "no")

        monkeypatch.setattr(preempt.subprocess, "run", run)

    _requeue_runner(monkeypatch, subprocess.CompletedProcess([], 0, "", ""))
    before = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: object) -> None:
        del signum, frame

    signal.signal(signal.SIGTERM, handler)
    try:
        answer(1)
        assert preempt.requeue_job({"SLURM_JOB_ID": "5"}) == "scontrol requeue 5 failed: no"
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGTERM) is handler  # not requeued: as it was
        answer(0)
        assert preempt.requeue_job({"SLURM_JOB_ID": "5"}) is None
        assert seen == [signal.SIG_IGN, signal.SIG_IGN]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # requeued: SLURM ends it
    finally:
        signal.signal(signal.SIGTERM, before)


def test_world_and_spares_resolves_named_spares_by_what_their_check_classified():
    from torchrunx.launcher.settings.resolve import HostsSource
    from torchrunx.launcher.state.spares import check_spare_names, world_and_spares

    names = HostsSource(names=("a", "b"))
    spared = check_spare_names(("c",), 2, requeue=False)
    assert spared == HostsSource(names=("c",))
    assert check_spare_names(1, 2, requeue=False) is None  # a count names no host
    world, spares = world_and_spares(
        ["a", "b"], 2, spare_hosts=("c",), min_hosts=None, sources=(names, spared), environ={}
    )
    assert [(h.hostname, h.workers) for h in world] == [("a", 2), ("b", 2)]
    assert [(h.hostname, h.workers) for h in spares] == [("c", 2)]
    world, spares = world_and_spares(
        ["a", "b"], 1, spare_hosts=1, min_hosts=None, sources=(names, None), environ={}
    )
    assert [h.hostname for h in world] == ["a"]
    assert [h.hostname for h in spares] == ["b"]
    # A name that its check would have refused is refused here too, naming the field.
    with pytest.raises(ValueError, match="spare_hosts"):
        world_and_spares(
            ["a"], 1, spare_hosts=("-c",), min_hosts=None,
            sources=(HostsSource(names=("a",)), HostsSource(names=("-c",))), environ={},
        )  # fmt: skip
    with pytest.raises(TypeError) as raised:
        check_spare_names(0, 1, requeue="yes")
    assert str(raised.value) == "requeue_on_preemption must be True or False, got 'yes'"


def test_rule_a_failed_interior_hosts_children_go_with_it():
    from types import SimpleNamespace

    from torchrunx.launcher.launch.replace import subtree_of
    from torchrunx.launcher.starts.tree import Tree

    tree = Tree(2, ["h0", "h1", "h2", "h3", "h4", "h5"])  # 0 starts 2 and 3; 1 starts 4 and 5
    agents = [SimpleNamespace(index=i) for i in range(7)]  # 6: a spare, started by the launcher
    world = agents[:6]
    assert [a.index for a in subtree_of(tree, world, [agents[0]])] == [2, 3]
    assert [a.index for a in subtree_of(tree, world, [agents[0], agents[3]])] == [2]
    assert subtree_of(tree, world, [agents[4]]) == []  # a leaf starts nobody
    assert subtree_of(tree, [a for a in world if a.index != 3], [agents[0]]) == [agents[2]]
    assert subtree_of(tree, [*world, agents[6]], [agents[6]]) == []  # nor does a spare
    assert subtree_of(None, world, [agents[0]]) == []  # no tree: nobody else goes


# -- held-out mutants (round 55b): the rules they broke ------------------------------------------


def test_rule_with_spares_and_min_hosts_both_given_the_message_names_spare_hosts():
    with pytest.raises(ValueError, match=r"^spare_hosts is used only when a failed host"):
        check_resilience(1, 2, ("deaths",), 3)
    with pytest.raises(ValueError, match=r"^min_hosts is used only when a failed host"):
        check_resilience(0, 2, ("deaths",), 3)


def test_rule_a_spare_name_of_blanks_alone_is_refused():
    with pytest.raises(TypeError, match=r"got '  ' in it"):
        check_resilience(("node9", "  "), None, ("hosts",), 1)


def test_rule_named_spares_refuse_workers_per_host_as_a_tuple_as_well_as_a_list():
    from torchrunx.launcher.state.spares import check_spare_names

    message = (
        "spare_hosts names hosts, but workers_per_host is a list (one count per host of "
        "hostnames): give one count for every host, or make the spares the last hosts of "
        "hostnames and set spare_hosts to their number"
    )
    for counts in ([2, 2], (2, 2)):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            check_spare_names(("c",), counts, requeue=False)


def test_rule_a_given_config_reader_needs_no_scontrol_on_the_path(monkeypatch):
    from torchrunx.launcher.launch import preempt

    monkeypatch.setattr(preempt.shutil, "which", lambda _: None)
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    assert default_grace(job, lambda: "KillWait = 30 sec") == 28


def test_rule_scontrol_failing_or_hanging_means_no_grace():
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    errors: list[subprocess.SubprocessError] = [
        subprocess.CalledProcessError(1, ["scontrol", "show", "config"]),
        subprocess.TimeoutExpired(["scontrol", "show", "config"], 10),
    ]
    for error in errors:

        def fails(error: subprocess.SubprocessError = error) -> str:
            raise error

        assert default_grace(job, fails) == 0


def test_rule_the_end_of_a_preemption_leaves_the_launch_failed():
    state = _preempted_state()
    end_preemption(state, _plan(), "the launcher received SIGTERM", lambda: None, lambda _: None)
    assert state.phase is Phase.FAILED


def test_rule_with_a_grace_the_first_sigterm_preempts_and_the_second_stops_at_once():
    from torchrunx.launcher.launch.preempt import sigterm_preempts

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        reasons: list[str] = []
        with sigterm_preempts(reasons.append, grace=5.0):
            handler = signal.getsignal(signal.SIGTERM)
            assert callable(handler)
            handler(signal.SIGTERM, None)
            assert reasons == ["the launcher received SIGTERM"]
            with pytest.raises(SystemExit) as second:
                handler(signal.SIGTERM, None)
            assert second.value.code == 128 + signal.SIGTERM
            assert reasons == ["the launcher received SIGTERM"]  # not preempted twice
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with sigterm_preempts(reasons.append, grace=0.0):
            handler = signal.getsignal(signal.SIGTERM)
            assert callable(handler)
            with pytest.raises(SystemExit):  # no grace: the first stops at once
                handler(signal.SIGTERM, None)
        assert reasons == ["the launcher received SIGTERM"]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_rule_a_spare_name_that_is_no_host_name_is_refused_naming_spare_hosts():
    from torchrunx.launcher.state.spares import check_spare_names

    message = "spare_hosts contains an invalid host name '-c': a host name cannot start with '-'"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_spare_names(("-c",), 2, requeue=False)


def test_rule_the_first_world_keeps_min_hosts_whether_spares_are_a_count_or_names():
    from torchrunx.launcher.settings.resolve import HostsSource
    from torchrunx.launcher.state.spares import world_and_spares

    message = "min_hosts=2 is more than the 1 hosts that run (['a'])"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        world_and_spares(
            ["a", "b"], 1, spare_hosts=1, min_hosts=2,
            sources=(HostsSource(names=("a", "b")), None), environ={},
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"^min_hosts=2 is more than the 1 hosts that run"):
        world_and_spares(
            ["a"], 1, spare_hosts=("c",), min_hosts=2,
            sources=(HostsSource(names=("a",)), HostsSource(names=("c",))), environ={},
        )  # fmt: skip


def test_rule_the_first_world_and_named_spares_read_slurm_from_the_plans_environment(
    monkeypatch,
):
    from torchrunx.launcher.settings.resolve import HostsSource
    from torchrunx.launcher.state.spares import world_and_spares

    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)  # this process: no allocation
    monkeypatch.setattr(  # pure: our node-list parser, never scontrol
        hostlists, "_expand_hostnames", lambda n: tuple(hostlists.expand_nodelist(n))
    )
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "g[1-3]", "SLURM_TASKS_PER_NODE": "2(x3)"}
    world, spares = world_and_spares(
        "auto", "slurm", spare_hosts=1, min_hosts=None, sources=(HostsSource(), None), environ=job
    )
    assert [(h.hostname, h.workers) for h in world] == [("g1", 2), ("g2", 2)]
    assert [(h.hostname, h.workers) for h in spares] == [("g3", 2)]
    world, spares = world_and_spares(
        ["g1"], "slurm", spare_hosts=("g3",), min_hosts=None,
        sources=(HostsSource(names=("g1",)), HostsSource(names=("g3",))), environ=job,
    )  # fmt: skip
    assert [(h.hostname, h.workers) for h in world] == [("g1", 2)]
    assert [(h.hostname, h.workers) for h in spares] == [("g3", 2)]


def test_rule_the_plan_resolves_hosts_and_spares_as_their_checks_classified_them():
    from torchrunx.launcher.settings.resolve import HostsSource
    from torchrunx.launcher.state.spares import world_and_spares

    # What the fields' checks found is what is resolved: the value is not classified again.
    world, spares = world_and_spares(
        ["x"], 1, spare_hosts=("y",), min_hosts=None,
        sources=(HostsSource(names=("a", "b")), HostsSource(names=("c",))), environ={},
    )  # fmt: skip
    assert [h.hostname for h in world] == ["a", "b"]
    assert [h.hostname for h in spares] == ["c"]
    world, spares = world_and_spares(
        ["x"], 1, spare_hosts=0, min_hosts=None,
        sources=(HostsSource(names=("a", "b")), None), environ={},
    )  # fmt: skip
    assert [h.hostname for h in world] == ["a", "b"]
