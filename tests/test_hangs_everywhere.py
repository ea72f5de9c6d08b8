"""Stall detection wherever a launch runs (issue #45, item 5): warm runs, kept workers, the relay,
srun-started agents; and a rank paused in pdb is not stalled.

Each launch does one all_reduce (the group formed: progress), then rank 1 waits in its own code
while the others enter the next all_reduce; ``on_stall="fail"`` raises the diagnosis.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path

import pexpect
import pytest

import torchrunx as trx
from torchrunx.errors import StallError

ROOT = Path(__file__).resolve().parent.parent
STALL = 4.0
"""Seconds: the clock runs from the attempt's start, so the group must form within it (with
room for a loaded machine); the checks below do not depend on it."""


def rank_1_waits_in_its_code() -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(3)
    dist.all_reduce(t)  # all_reduce #2 (torchrunx's barrier is #1)
    if dist.get_rank() == 1:
        threading.Event().wait(60)
    dist.all_reduce(t)
    return dist.get_rank()


def total() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _named(values: dict, world: int, seq: int = 3) -> None:
    """The diagnosis: every rank but 1 waits in all_reduce ``seq``; rank 1 is in its own code."""
    assert values["unanswered"] == []
    [waiting] = values["waiting"]
    others = [r for r in range(world) if r != 1]
    assert (waiting["op"], waiting["seq"], waiting["ranks"]) == ("all_reduce", seq, others)
    [(where, ranks)] = values["absent"].items()
    assert ranks == [1] and "in rank_1_waits_in_its_code" in where


@pytest.mark.parametrize("keep_workers", [False, True], ids=["fresh", "kept"])
def test_a_stall_in_a_warm_run_is_named_and_the_next_run_works(keep_workers):
    launcher = trx.Launcher(
        hostnames=["localhost"],
        workers_per_host=3,
        backend="gloo",
        stall_timeout=STALL,
        on_stall="fail",
    )
    with launcher.warm(keep_workers=keep_workers) as warm:
        assert warm.run(total).ranks == [3.0] * 3
        with pytest.raises(StallError) as caught:
            warm.run(rank_1_waits_in_its_code)
        # Kept workers keep their group: the first run's all_reduce was #2 of it, this one's #3.
        _named(caught.value.diagnosis, 3, seq=4 if keep_workers else 3)
        assert warm.run(total).ranks == [3.0] * 3  # the agents stayed; the ranks are new


@pytest.mark.cluster
def test_a_stall_behind_the_relay_is_named(cluster):
    with pytest.raises(StallError) as caught:
        trx.launch(
            rank_1_waits_in_its_code,
            hostnames=cluster.names(),
            workers_per_host=2,
            backend="gloo",
            ssh_config_file=cluster.ssh_config,
            relay="on",
            stall_timeout=STALL,
            on_stall="fail",
        )
    _named(caught.value.diagnosis, 2 * len(cluster.names()))


SRUN_SCRIPT = f"""
import json, sys, threading
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torchrunx as trx
from test_hangs_everywhere import rank_1_waits_in_its_code

try:
    trx.Launcher(agent_start="srun", workers_per_host=2, backend="gloo",
                 stall_timeout={STALL}, on_stall="fail").run(rank_1_waits_in_its_code)
except trx.StallError as error:
    print("DIAGNOSIS", json.dumps(error.diagnosis), flush=True)
"""


@pytest.mark.slurm
def test_a_stall_of_srun_started_ranks_is_named(slurm, tmp_path):
    result = slurm.python_job(SRUN_SCRIPT, tmp_path, nodes=2)
    assert result.exit_code == 0, result
    line = next((x for x in result.stdout.splitlines() if x.startswith("DIAGNOSIS ")), None)
    assert line is not None, result
    _named(json.loads(line.split(" ", 1)[1]), 4)


PDB_SCRIPT = f"""
import os
import torch
import torch.distributed as dist
import torchrunx as trx

def work():
    t = torch.ones(2)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        breakpoint()  # the others wait in the next all_reduce meanwhile
    dist.all_reduce(t)
    return t.tolist()

result = trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo",
                      stall_timeout={STALL}, on_stall="fail").run(work)
print("RESULTS", result.ranks, flush=True)
"""


def test_a_rank_paused_in_pdb_past_stall_timeout_is_not_stalled(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(PDB_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TERM": "dumb",
    }
    child = pexpect.spawn(
        sys.executable, [str(script)], cwd=str(tmp_path), env=env, encoding="utf-8", timeout=120
    )
    try:
        child.expect(re.escape("(Pdb rank 1 on localhost) "))
        # Twice stall_timeout in pdb, rank 0 waiting in the all_reduce: no report may come.
        assert child.expect([re.escape("no rank made progress"), pexpect.TIMEOUT], STALL * 2) == 1
        child.sendline("c")
        child.expect(re.escape("RESULTS [[4.0, 4.0], [4.0, 4.0]]"))
        child.expect(pexpect.EOF)
        assert "no rank made progress" not in str(child.before)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
