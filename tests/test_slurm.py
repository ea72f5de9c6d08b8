"""torchrunx inside real SLURM jobs: no-argument launches over srun and SSH, cleanup, parsing.

Jobs run on the 2-node SLURM test cluster (``slurm`` fixture): the batch script runs on
``snode1``, whose agent is a local process; ``snode2``'s agent starts as an srun step or over SSH.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import sys
from pathlib import Path

import pytest

from torchrunx.hosts.hostlists import expand_nodelist

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "slurm" / "train.sbatch"


def _run_example(slurm, *script_args: str, tasks_per_node: int = 2):
    result = slurm.sbatch(
        EXAMPLE,
        nodes=2,
        env={
            "HOME": str(slurm.home),  # ~/.ssh/config there reaches the nodes
            # The script's `python3` is this interpreter, as in a job sent from an active
            # virtual environment (pytest may run as .venv/bin/python without activating it).
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        },
        extra_args=[f"--chdir={REPO}", f"--ntasks-per-node={tasks_per_node}"],
        script_args=script_args,
    )
    assert (result.state, result.exit_code) == ("COMPLETED", 0), result
    return json.loads(result.stdout.strip().splitlines()[-1]), result


@pytest.mark.parametrize("agent_start", ["auto", "srun", "ssh"])
def test_example_batch_script_uses_every_node_with_no_arguments(slurm, agent_start):
    args = () if agent_start == "auto" else ("--agent-start", agent_start)
    summary, result = _run_example(slurm, *args)
    reports = summary["reports"]
    assert summary["hostnames"] == ["snode1", "snode2"]
    # 2 tasks per node: 2 workers per node, ranks in host order, one process group.
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert [r["hostname"] for r in reports] == ["snode1", "snode1", "snode2", "snode2"]
    assert [r["local_rank"] for r in reports] == [0, 1, 0, 1]
    assert {r["world_size"] for r in reports} == {4}
    assert {r["backend"] for r in reports} == {"gloo"}
    assert {r["rank_sum"] for r in reports} == {0 + 1 + 2 + 3}
    # snode1 is the launcher's node (a local agent); snode2's agent is an srun step unless ssh.
    steps = [r["slurm_step"] for r in reports]
    assert steps[:2] == [None, None]
    if agent_start == "ssh":
        assert steps[2:] == [None, None]
    else:
        assert steps[2] is not None and steps[2] == steps[3]
    assert "rank 3 of 4 on snode2 (local rank 1): all_reduce sum 6" in result.stdout


def test_example_takes_workers_from_tasks_per_node(slurm):
    summary, _ = _run_example(slurm, tasks_per_node=1)
    assert [(r["rank"], r["hostname"]) for r in summary["reports"]] == [
        (0, "snode1"),
        (1, "snode2"),
    ]


CLEANUP_SCRIPT = r"""
import subprocess, sys
import torchrunx as trx

def fail_on_last_rank():
    import os, time, torch.distributed as dist
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("bad batch on " + os.environ["SLURMD_NODENAME"])
    time.sleep(60)

def steps():
    out = subprocess.run(["squeue", "-h", "-s", "-j", sys.argv[1], "-o", "%i %j"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[1] for line in out.splitlines())

launcher = trx.Launcher(agent_start="srun")
print("ok", launcher.run(lambda: 7).ranks)
try:
    launcher.run(fail_on_last_rank)
except ValueError as exc:
    print("raised", exc, "|", " ".join(getattr(exc, "__notes__", [])).replace("\n", " "))
print("steps", steps())
"""


def test_srun_steps_end_with_the_launch_even_when_a_worker_fails(slurm, tmp_path):
    result = slurm.python_job(CLEANUP_SCRIPT, tmp_path, job_id_argument=True)
    assert result.exit_code == 0, result
    lines = result.stdout.splitlines()
    assert "ok [7, 7]" in lines
    raised = next(line for line in lines if line.startswith("raised"))
    assert "bad batch on snode2" in raised
    assert "rank 1" in raised and "snode2" in raised
    # Only the batch step is left: every agent step ended with its launch.
    assert "steps ['batch']" in lines, result


def test_slurm_outside_an_allocation_raises_before_starting_anything(monkeypatch):
    import torchrunx as trx

    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="hostnames='slurm' but no SLURM allocation"):
        trx.Launcher(hostnames="slurm").run(print)
    with pytest.raises(RuntimeError, match="agent_start='srun' but no SLURM allocation"):
        trx.Launcher(hostnames=["localhost"], agent_start="srun").run(print)


def _random_nodelist(rng: random.Random) -> str:
    """A random list in the syntax scontrol accepts: literal text, then bracket groups each
    after its own literal, with nothing after the last bracket."""
    groups = []
    for _ in range(rng.randint(1, 3)):
        group = rng.choice(["node", "gpu-", "a", "rack", "x-y", "c"])
        if rng.random() < 0.25:
            groups.append(group + str(rng.randint(0, 120)))
            continue
        for dimension in range(rng.randint(1, 3)):
            if dimension:
                group += rng.choice(["n", "-", "s", "x1y"])
            width = rng.choice([0, 2, 3])
            ranges = []
            for _ in range(rng.randint(1, 3)):
                first = rng.randint(0, 30)
                last = first + rng.randint(0, 5)
                low, high = str(first).zfill(width), str(last).zfill(width)
                ranges.append(low if first == last else f"{low}-{high}")
            group += f"[{','.join(ranges)}]"
        groups.append(group)
    return ",".join(groups)


def test_nodelist_parser_agrees_with_scontrol(slurm):
    rng = random.Random(20261121)  # noqa: S311 (test data, not secrets)
    forms = [
        "node[1-3,7]",
        "gpu-[01-04]",
        "a[1-2]-b[3-4]",
        "cpu7,gpu[1-2],login",
        "n[098-101]",
        "r[1-2]n[01-02]s[5,7]",
        "a[1-2]b[1-3]c[1-2]d[1-2]",
    ] + [_random_nodelist(rng) for _ in range(200)]
    # One scontrol call per form (it expands one list per call).
    for form in forms:
        completed = slurm.run(["scontrol", "show", "hostnames", form])
        assert completed.returncode == 0, completed.stderr
        assert expand_nodelist(form) == completed.stdout.split(), form


WARM_SCRIPT = r"""
import os, subprocess, sys, time
import torchrunx as trx

def where():
    return os.environ["SLURMD_NODENAME"], os.getppid()

def steps():
    out = subprocess.run(["squeue", "-h", "-s", "-j", sys.argv[1], "-o", "%i %j"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[1] for line in out.splitlines())

with trx.Launcher(agent_start="srun").warm() as warm:
    first, second = warm.run(where).ranks, warm.run(where).ranks
    print("nodes", [node for node, _ in first])
    print("same agents", first == second)
    print("steps during", len(steps()))
# The agent's srun has exited when the block ends; slurmctld drops the step once slurmd tells
# it, a moment later (under load, after the first look: a suite run's failure).
deadline = time.monotonic() + 10
while (after := steps()) != ["batch"] and time.monotonic() < deadline:
    time.sleep(0.1)
print("steps after", after)
"""


def test_warm_agents_in_an_allocation_are_srun_steps_that_end_with_the_block(slurm, tmp_path):
    result = slurm.python_job(WARM_SCRIPT, tmp_path, job_id_argument=True)
    assert result.exit_code == 0, result
    lines = result.stdout.splitlines()
    assert "nodes ['snode1', 'snode2']" in lines, result
    assert "same agents True" in lines, result
    assert "steps during 2" in lines, result  # the batch step and snode2's agent step
    assert "steps after ['batch']" in lines, result


def test_check_in_an_allocation_starts_its_probes_as_srun_steps(slurm):
    # Inside the job, hostnames="auto" is the allocation; host 0 is this node (local), the
    # other one is probed through an srun step, which ends with the check.
    python = shlex.quote(sys.executable)
    squeue = 'squeue -h -s -j "$SLURM_JOB_ID" -o "%j" | sort | tr "\\n" " "'
    result = slurm.sbatch(
        f"{python} -m torchrunx check --agent-start srun --start-timeout 30; echo status $?\n"
        f'echo "steps $({squeue})"\n',
        nodes=2,
        extra_args=["--ntasks-per-node=1"],
    )
    assert result.exit_code == 0, result
    lines = result.stdout.splitlines()
    assert lines[0].startswith("snode1  ok    local  python "), result
    assert lines[1].startswith("snode2  ok    srun   python "), result
    assert lines[2].startswith("2 hosts checked in ") and lines[2].endswith(": all ready")
    assert "status 0" in lines
    assert "steps batch " in lines, result  # no probe step left
