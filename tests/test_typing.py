"""What a user's type checker says of the documented ways to call torchrunx (mypy, strict)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DOCUMENTED = """
import logging
from pathlib import Path
from typing import Literal

import torchrunx as trx

trx.Launcher(hostnames="auto")
trx.Launcher(hostnames="slurm")
trx.Launcher(hostnames="pbs")
trx.Launcher(hostnames="lsf")
trx.Launcher(hostnames="hostfile:hosts.txt")
trx.Launcher(hostnames=["node1", "node2"])
trx.Launcher(hostnames=("node1", "node2"))
trx.Launcher(hostnames=Path("hostfile"))
trx.Launcher(workers_per_host=[8, 4], backend="nccl")
trx.Launcher(console_ranks="all")
trx.Launcher(console_ranks=(0, 3))
trx.Launcher(log_handlers=["auto", logging.FileHandler("errors.log")])
handlers: list[logging.Handler] = [trx.stream_handler("node1", 0)]
trx.Launcher(log_handlers=handlers)


def old_factory() -> list[logging.Handler]:
    return [trx.stream_handler("node1", 0)]


def factory(setup: trx.LogSetup) -> list[logging.Handler | Literal["auto"]]:
    return ["auto", trx.stream_handler(setup.hostnames[-1], 0)]


trx.Launcher(log_handlers=old_factory)
trx.Launcher(log_handlers=factory)
"""

WRONG = """
import torchrunx as trx

trx.Launcher(hostnames=3)
"""


def test_documented_hostnames_pass_a_strict_type_check_and_a_wrong_one_does_not(tmp_path):
    good, bad = tmp_path / "documented.py", tmp_path / "wrong.py"
    good.write_text(textwrap.dedent(DOCUMENTED))
    bad.write_text(textwrap.dedent(WRONG))
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", str(good), str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if "documented.py" in e], done.stdout
    assert [e.split(":")[1] for e in errors if "wrong.py" in e] == ["4"], done.stdout
