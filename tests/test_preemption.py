"""Preemption (docs/resilience.md#preemption): SIGTERM with a grace period, with real processes.

The launcher runs in a child process (a script), so that the test can send it SIGTERM as SLURM,
a spot notice or ``kill`` would: alone, together with every agent and worker (as SLURM signals
every process of a job step), or to one host's agent only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import torchrunx_processes

import torchrunx as trx

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    r"""
    import json, os, signal, sys, time
    import torchrunx as trx

    def train(folder, steps, save, term_agent_at):
        # Resumes from its checkpoint; saves it (whole: written, then renamed) when told.
        rank = int(os.environ["RANK"])
        path = f"{folder}/ckpt-{rank}"
        step = json.load(open(path))["step"] if os.path.exists(path) else 0
        if step == 0:
            open(f"{folder}/running-{rank}", "w").close()
        told = False
        while step < steps:
            time.sleep(0.02)
            step += 1
            if not told and trx.preemption_requested():  # the test may wait for this
                told = True
                open(f"{folder}/told-{rank}", "w").close()
            if rank == 1 and step == term_agent_at:
                os.kill(os.getppid(), signal.SIGTERM)  # this host's agent only
            if save and trx.preemption_requested():
                with open(f"{path}.tmp", "w") as f:
                    json.dump({"step": step, "deadline": trx.preemption_deadline(),
                               "reason": trx.preemption_reason()}, f)
                os.replace(f"{path}.tmp", path)
                return step
        return step

    folder, hosts, grace, save, term_agent_at = (
        sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "save",
        int(sys.argv[5]))
    print("pid", os.getpid(), flush=True)
    seen = []
    try:
        result = trx.launch(
            train, (folder, 100_000, save, term_agent_at), hostnames=hosts, workers_per_host=1,
            backend="gloo", preemption_grace=grace, log_handlers=None,
            ssh_config_file=os.environ.get("SSH_CONFIG") or None,
            event_handlers=(seen.append,),
        )
        print("result", json.dumps(result.ranks), flush=True)
    except trx.Preempted as preempted:
        events = [type(e).__name__ for e in seen]
        print("preempted", json.dumps({
            "reason": preempted.reason, "returned": preempted.returned,
            "world_size": preempted.world_size, "requeued": preempted.requeued,
            "code": preempted.code, "text": str(preempted),
            "notes": getattr(preempted, "__notes__", []), "events": events,
        }), flush=True)
        raise
    """
)


def _start(tmp_path, hosts, *, grace, save=True, term_agent_at=0, env=None):  # noqa: PLR0913
    script = tmp_path / "preempt.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    process = subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(folder),
            json.dumps(hosts),
            str(grace),
            "save" if save else "no",
            str(term_agent_at),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    return process, folder


def _wait_running(
    folder: Path, ranks: int, process, timeout: float = 60, mark: str = "running"
) -> None:
    """Until every rank wrote ``folder/MARK-RANK`` (``running``: it started; ``told``: it was
    told of a preemption), failing the test if the launcher ends first or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((folder / f"{mark}-{rank}").exists() for rank in range(ranks)):
            return
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    out, err = process.communicate()
    pytest.fail(f"the ranks did not write {mark}-RANK:\n{out}\n{err}")


def _outcome(process, timeout: float = 60) -> tuple[int, dict[str, object]]:
    out, err = process.communicate(timeout=timeout)
    line = next((x for x in out.splitlines() if x.startswith("preempted ")), None)
    assert line is not None, f"{out}\n{err}"
    return process.returncode, json.loads(line.split(" ", 1)[1])


def _checkpoints(folder: Path, ranks: int) -> list[dict[str, object]]:
    return [json.loads((folder / f"ckpt-{rank}").read_text()) for rank in range(ranks)]


def _wait_for_no_processes(timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while torchrunx_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    return torchrunx_processes()


LOCAL = ["localhost", "127.0.0.1"]


def test_sigterm_to_the_launcher_gives_every_rank_the_grace_to_save(tmp_path):
    process, folder = _start(tmp_path, LOCAL, grace=30)
    _wait_running(folder, 2, process)
    told = time.time()
    process.send_signal(signal.SIGTERM)
    code, outcome = _outcome(process)
    ended = time.time()
    assert code == 143  # uncaught Preempted: the exit status of a SIGTERM, as before
    assert outcome["reason"] == "the launcher received SIGTERM"
    checkpoints = _checkpoints(folder, 2)  # each one whole (written, then renamed)
    assert outcome["returned"] == {str(r): checkpoints[r]["step"] for r in range(2)}
    assert (outcome["world_size"], outcome["requeued"], outcome["code"]) == (2, False, 143)
    assert outcome["text"] == (
        "the launch was preempted (the launcher received SIGTERM): 2 of 2 ranks returned in "
        "the grace period"
    )
    for checkpoint in checkpoints:
        assert checkpoint["reason"] == "the launcher received SIGTERM"
        assert told + 29 < checkpoint["deadline"] < told + 31
    assert ended - told < 10  # the ranks returned early: no wait for the whole grace
    assert "Preempting" in outcome["events"] and "LaunchFinished" in outcome["events"]
    assert _wait_for_no_processes(10) == []


def test_sigterm_to_every_process_of_the_job_is_one_notice(tmp_path):
    # SLURM signals every process of a step: launcher, agents, guardians and workers at once.
    process, folder = _start(tmp_path, LOCAL, grace=30)
    try:
        _wait_running(folder, 2, process)
        pids = [process.pid, *(int(line.split(":")[0]) for line in torchrunx_processes())]
        for pid in pids:
            # One may end between the look and its signal (the launcher, signalled first, may
            # already have stopped it): SLURM skips a process that has ended, as this does.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        code, outcome = _outcome(process)
    finally:  # however it ends: no launcher left, its pipes closed (not in a later test's GC)
        if process.poll() is None:
            process.kill()
        process.communicate()
    assert code == 143
    assert sorted(outcome["returned"]) == ["0", "1"]
    assert [c["step"] for c in _checkpoints(folder, 2)] == [
        outcome["returned"]["0"],
        outcome["returned"]["1"],
    ]
    assert _wait_for_no_processes(10) == []


def test_sigterm_to_one_hosts_agent_preempts_the_whole_launch(tmp_path):
    process, folder = _start(tmp_path, LOCAL, grace=30, term_agent_at=25)
    code, outcome = _outcome(process)
    assert code == 143
    assert outcome["reason"] == "the agent on 127.0.0.1 received SIGTERM"
    assert sorted(outcome["returned"]) == ["0", "1"]
    assert all(c["reason"] == outcome["reason"] for c in _checkpoints(folder, 2))
    assert _wait_for_no_processes(10) == []


def test_ranks_that_do_not_return_in_the_grace_are_stopped(tmp_path):
    process, folder = _start(tmp_path, LOCAL, grace=2, save=False)
    _wait_running(folder, 2, process)
    told = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code, outcome = _outcome(process)
    assert code == 143
    assert outcome["returned"] == {}
    assert outcome["notes"] == [
        "ranks [0, 1] did not return within preemption_grace=2 s and were stopped"
    ]
    assert 2 <= time.monotonic() - told < 2 + 8  # the grace, then the stop (3 s at most)
    assert _wait_for_no_processes(10) == []


def test_a_second_sigterm_stops_at_once(tmp_path):
    process, folder = _start(tmp_path, LOCAL, grace=60, save=False)
    _wait_running(folder, 2, process)
    process.send_signal(signal.SIGTERM)
    _wait_running(folder, 2, process, mark="told")  # the first one was taken: a preemption
    told = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 143
    assert time.monotonic() - told < 10
    assert "preempted" not in out  # a plain SystemExit(143): no Preempted
    assert _wait_for_no_processes(10) == []


def test_without_a_grace_sigterm_stops_at_once_as_before(tmp_path):
    process, folder = _start(tmp_path, LOCAL, grace=0, save=True)
    _wait_running(folder, 2, process)
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 143
    assert "preempted" not in out
    assert not list(folder.glob("ckpt-*"))  # never told: nothing saved
    assert _wait_for_no_processes(10) == []


def test_preemption_is_false_outside_workers_and_callbacks_wait():
    assert trx.preemption_requested() is False
    assert trx.preemption_deadline() is None
    assert trx.preemption_reason() is None
    called: list[float] = []
    trx.on_preemption(called.append)  # in the launcher: never called
    assert called == []


def callback_sees_the_notice(folder: str) -> float:
    import threading

    told = threading.Event()
    deadlines: list[float] = []

    def note(deadline: float) -> None:
        deadlines.append(deadline)
        told.set()

    trx.on_preemption(note)
    open(f"{folder}/running-{os.environ['RANK']}", "w").close()
    assert told.wait(60)
    return deadlines[0]


def test_on_preemption_calls_back_in_the_worker(tmp_path):
    import threading

    folder = tmp_path / "ckpt"
    folder.mkdir()

    # A SIGTERM to this process that the launch did not take would end the test's process
    # (a pytest-xdist worker, with every test it still had): say so instead.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.getsignal(signal.SIGTERM)
    sent: list[object] = []

    def preempt_when_running() -> None:
        deadline = time.monotonic() + 60
        while not (folder / "running-0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        handler = signal.getsignal(signal.SIGTERM)
        sent.append(handler)
        if handler is not signal.SIG_DFL:  # the launch's own: SIGTERM preempts it
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=preempt_when_running)
    thread.start()
    told = time.time()
    with pytest.raises(trx.Preempted) as info:
        trx.launch(
            callback_sees_the_notice,
            (str(folder),),
            hostnames=["localhost"],
            workers_per_host=1,
            backend=None,
            preemption_grace=20,
            log_handlers=None,
        )
    thread.join()
    assert sent and sent[0] is not signal.SIG_DFL, "the launch did not handle SIGTERM"
    (deadline,) = info.value.returned.values()
    assert told < deadline < time.time() + 20


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (float("inf"), ValueError), ("30", ValueError)]
)
def test_a_bad_grace_is_refused(value, error):
    with pytest.raises(error, match="preemption_grace"):
        trx.Launcher(hostnames=["localhost"], preemption_grace=value).validate()
    with pytest.raises(TypeError, match="requeue_on_preemption"):
        trx.Launcher(hostnames=["localhost"], requeue_on_preemption="yes").validate()  # type: ignore[arg-type]


@pytest.mark.cluster
def test_preemption_over_ssh_writes_every_checkpoint_and_leaves_nothing(cluster, tmp_path):
    # Ranks on this machine and on both SSH test hosts; 30 s of grace.
    hosts = ["localhost", *cluster.names()]
    process, folder = _start(tmp_path, hosts, grace=30, env={"SSH_CONFIG": str(cluster.ssh_config)})
    _wait_running(folder, 3, process)
    process.send_signal(signal.SIGTERM)
    code, outcome = _outcome(process)
    assert code == 143
    checkpoints = _checkpoints(folder, 3)
    assert outcome["returned"] == {str(r): checkpoints[r]["step"] for r in range(3)}
    assert _wait_for_no_processes(10) == []


REQUEUE_SCRIPT = textwrap.dedent(
    r"""
    import json, os, sys, time
    import torchrunx as trx

    def train(folder):
        # 60 steps of 0.1 s; resumes from its checkpoint; saves it when preempted.
        rank = int(os.environ["RANK"])
        path = f"{folder}/ckpt-{rank}"
        step = json.load(open(path))["step"] if os.path.exists(path) else 0
        first = step
        open(f"{folder}/running-{os.environ.get('SLURM_RESTART_COUNT', '0')}-{rank}", "w").close()
        while step < 60:
            time.sleep(0.1)
            step += 1
            if trx.preemption_requested():
                with open(f"{path}.tmp", "w") as f:
                    json.dump({"step": step}, f)
                os.replace(f"{path}.tmp", path)
                return {"first": first, "saved": step}
        return {"first": first, "done": step}

    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    try:
        result = trx.Launcher(
            workers_per_host=1, backend="gloo", requeue_on_preemption=True, agent_start="srun"
        ).run(train, sys.argv[1])
        print("run", restarts, "done", json.dumps(result.ranks), flush=True)
    except trx.Preempted as preempted:
        print("run", restarts, "preempted", preempted.requeued, json.dumps(preempted.returned),
              flush=True)
        raise
    """
)


@pytest.mark.slurm
@pytest.mark.parametrize("whom", ["--batch", "--full"])
def test_an_sbatch_job_preempted_once_requeues_and_finishes_from_its_checkpoint(
    slurm, tmp_path, whom
):
    # --batch: the batch shell only (the launcher, by exec), as --signal=B:TERM@... does;
    # --full: every process of every step (launcher, agents, guardians, workers), as a
    # preemption or a cancel does.
    import shlex
    import threading

    script = tmp_path / "requeue.py"
    script.write_text(REQUEUE_SCRIPT)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    job_file = tmp_path / "job"

    def preempt_once() -> None:
        # Once both ranks of the first run run: SIGTERM.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if job_file.exists() and all((folder / f"running-0-{r}").exists() for r in range(2)):
                job = job_file.read_text().strip()
                slurm.run(["scancel", whom, "--signal=TERM", job])
                break
            time.sleep(0.1)
        # SLURM holds a requeued job back for a while (its BeginTime); the test does not wait
        # that long, until the requeued run runs (a BeginTime set again after an update is moved
        # again). Not at once, though: slurmd refuses a job credential made in the second its
        # last one was revoked ("Job credential revoked", and the job fails), so the test waits
        # 2 s from the requeue, as SLURM's own delay does for longer.
        pending_since = None
        while time.monotonic() < deadline:
            state = slurm.run(["scontrol", "show", "job", job]).stdout
            if "Restarts=1" in state and re.search(r"JobState=(RUNNING|COMPLETED)", state):
                return
            if "JobState=PENDING" in state and "Reason=BeginTime" in state:
                pending_since = pending_since or time.monotonic()
                if time.monotonic() - pending_since >= 2:
                    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            time.sleep(0.2)

    thread = threading.Thread(target=preempt_once)
    thread.start()
    slurm.sbatch(
        f'echo "$SLURM_JOB_ID" > {shlex.quote(str(job_file))}\n'
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(script))} {shlex.quote(str(folder))}\n",
        nodes=2,
        extra_args=["--ntasks-per-node=1", "--requeue", "--open-mode=append"],
        timeout=240,
    )
    thread.join()
    # sbatch() may return in the moment between the first run's end and the requeue (a state
    # it does not wait for): wait here for the requeued run's end, and read its output then.
    job = job_file.read_text().strip()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        fields = slurm.run(["scontrol", "show", "job", job]).stdout
        # The first run's end may show as CANCELLED a moment before the job is pending again:
        # only the requeued run's own end counts (its output has its line by then).
        stdout = (slurm.jobs_dir / f"{job}.out").read_text()
        ended = re.search(r"JobState=(COMPLETED|FAILED|CANCELLED)", fields) is not None
        if "Restarts=1" in fields and ended and "run 1 " in stdout:
            break
        time.sleep(0.2)
    stdout = (slurm.jobs_dir / f"{job}.out").read_text()
    lines = [line for line in stdout.splitlines() if line.startswith("run ")]
    stderr = (slurm.jobs_dir / f"{job}.err").read_text()
    assert len(lines) == 2, f"{stdout}\n{fields}\n--- stderr ---\n{stderr}"
    first, second = lines
    assert first.startswith("run 0 preempted True "), stdout
    saved = json.loads(first.split(" ", 4)[4])
    assert sorted(saved) == ["0", "1"]
    assert second.startswith("run 1 done "), stdout
    finished = json.loads(second.split(" ", 3)[3])
    assert [r["done"] for r in finished] == [60, 60]
    # The requeued run resumed from each rank's checkpoint.
    assert [r["first"] for r in finished] == [saved["0"]["saved"], saved["1"]["saved"]]
    assert "JobState=COMPLETED" in fields and "ExitCode=0:0" in fields, fields


def test_the_default_grace_runs_scontrol_show_config(monkeypatch, tmp_path):
    # SLURM's own tool, found on PATH: a stand-in that prints a config, then one that fails.
    from torchrunx.launcher.launch.preempt import default_grace

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'KillWait                = 9 sec'\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert default_grace() == 7
    scontrol.write_text("#!/bin/sh\nexit 1\n")
    assert default_grace() == 0
