"""``trx.submit``: a launch sent to SLURM from a login node, its result read back (real SLURM).

The "login node" is this machine's root namespace, which runs ``sbatch`` against the test
cluster's ``slurmctld``; the jobs run on ``snode1`` and ``snode2`` and share this filesystem.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx.launcher.submit import job_script, job_state, sbatch_argv

# -- pure --------------------------------------------------------------------------------------


def test_rule_the_job_script_quotes_every_value_and_keeps_the_working_folder_off_sys_path():
    script = job_script("/opt/my env/bin/python", Path("/shared/j o b"), "/home/me/it's")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert lines[1] == "cd '/home/me/it'\"'\"'s' || exit 1"
    words = shlex.split(lines[2])
    assert words[:3] == ["exec", "/opt/my env/bin/python", "-c"]
    assert words[3].startswith(
        "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')];"
    )
    assert words[4] == "/shared/j o b"


def test_rule_sbatch_gets_the_users_options_before_the_script():
    argv = sbatch_argv(Path("/j"), ["--nodes=2", "--gres=gpu:8"])
    assert argv == [
        "sbatch",
        "--parsable",
        "--job-name=torchrunx",
        "--output=/j/stdout",
        "--error=/j/stderr",
        "--nodes=2",
        "--gres=gpu:8",
        "/j/job.sh",
    ]


def test_rule_the_job_state_is_read_from_scontrols_line():
    line = (
        "JobId=12 JobName=torchrunx UserId=root(0) JobState=RUNNING Reason=None Dependency=(null)"
    )
    assert job_state(line) == "RUNNING"
    assert job_state("slurm_load_jobs error: Invalid job id specified") is None


def test_attaching_a_folder_that_is_not_a_job_says_so(tmp_path):
    with pytest.raises(ValueError, match="is not a torchrunx job folder"):
        trx.SlurmJob.attach(tmp_path)


def test_submit_without_sbatch_says_where_to_submit_from(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    monkeypatch.chdir(tmp_path)
    with pytest.raises(trx.SlurmError, match="sbatch is not installed here: submit from a machine"):
        trx.submit(print, launcher=trx.Launcher(backend=None), folder=tmp_path / "jobs")


# -- on the SLURM test cluster -----------------------------------------------------------------


def where(tag: str) -> tuple[str, int, str]:
    return os.uname().nodename, int(os.environ["RANK"]), tag


def fails() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("rank one's key")


def sleeps() -> None:
    time.sleep(300)


@pytest.fixture
def login(slurm, tmp_path, monkeypatch):
    """This process as a login node of the test cluster (sbatch reaches its slurmctld)."""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("HOME", str(slurm.home))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    yield tmp_path / "jobs"
    slurm.scancel_all()


@pytest.mark.slurm
def test_a_submitted_launch_runs_on_the_allocation_and_its_result_comes_back(login):
    job = trx.submit(
        where,
        func_args=("x",),
        launcher=trx.Launcher(workers_per_host=1, backend="gloo"),
        sbatch=("--nodes=2", "--ntasks-per-node=1"),
        folder=login,
    )
    assert job.job_id.isdigit()
    assert job.folder.parent == login and oct(job.folder.stat().st_mode & 0o777) == "0o700"
    result = job.result(timeout=120)
    assert result.ranks == [("snode1", 0, "x"), ("snode2", 1, "x")]
    assert job.done()
    # Read again later, from another SlurmJob (another process would do the same).
    assert trx.SlurmJob.attach(job.folder).result(timeout=30).ranks == result.ranks


@pytest.mark.slurm
def test_a_failed_launch_raises_its_exception_from_result(login):
    job = trx.submit(
        fails,
        launcher=trx.Launcher(workers_per_host=1, backend=None),
        sbatch=("--nodes=2", "--ntasks-per-node=1"),
        folder=login,
    )
    with pytest.raises(KeyError, match="rank one's key") as info:
        job.result(timeout=120)
    assert any("rank 1" in note for note in getattr(info.value, "__notes__", []))


@pytest.mark.slurm
def test_a_cancelled_job_ends_and_its_result_says_it_has_none(login):
    job = trx.submit(
        sleeps,
        launcher=trx.Launcher(workers_per_host=1, backend=None),
        sbatch=("--nodes=1", "--ntasks-per-node=1"),
        folder=login,
    )
    with pytest.raises(TimeoutError, match=f"SLURM job {job.job_id} has not ended in 1 s"):
        job.wait(timeout=1)
    job.cancel()
    assert job.state() in {"CANCELLED", "DONE", "UNKNOWN"}
    with pytest.raises(
        trx.SlurmError, match=rf"SLURM job {job.job_id} ended \(\w+\) without a result"
    ):
        job.result(timeout=30)
