"""The progress line of a launch's long steps: its rules (pure), and real launches' stderr."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from torchrunx.launcher.settings.environ import read_environ
from torchrunx.launcher.view import progress
from torchrunx.launcher.view.progress import (
    BytesProgress,
    ProgressLine,
    progress_enabled,
    progress_text,
)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rule_the_text_counts_hosts_or_mib():
    assert progress_text("agents starting", 3, 8, "hosts up", 2.06) == (
        "torchrunx: agents starting: 3/8 hosts up [2.1 s]"
    )
    assert progress_text("shipping", 3 * 2**20, 40 * 2**20, "bytes", 1.0) == (
        "torchrunx: shipping: 3.0 MiB of 40.0 MiB [1.0 s]"
    )
    assert (
        progress_text("results", 2**19, None, "bytes", 0.0) == "torchrunx: results: 0.5 MiB [0.0 s]"
    )


def _forced(environ: dict[str, str]) -> bool | None:
    """``TORCHRUNX_PROGRESS`` of ``environ`` as the plan reads it."""
    return read_environ(environ).progress


def test_rule_only_a_terminal_outside_a_notebook_unless_asked(monkeypatch):
    assert progress_enabled(_Terminal(), _forced({})) is ("ipykernel" not in sys.modules)
    assert progress_enabled(io.StringIO(), _forced({})) is False  # a pipe, a file, a log
    assert progress_enabled(io.StringIO(), _forced({"TORCHRUNX_PROGRESS": "1"})) is True
    assert progress_enabled(_Terminal(), _forced({"TORCHRUNX_PROGRESS": "0"})) is False
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # in a notebook's kernel
    assert progress_enabled(_Terminal(), _forced({})) is False


def test_rule_nothing_before_the_delay_then_one_line_redrawn_then_erased(monkeypatch):
    monkeypatch.delenv("TORCHRUNX_PROGRESS", raising=False)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)  # another test's notebook
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = _Terminal()
    line = ProgressLine("agents starting", 4, "hosts up", out)
    line.update(1)
    clock[0] += progress.DELAY_S - 0.01
    line.update(1)
    assert out.getvalue() == ""  # a quick step shows nothing
    clock[0] += 0.02
    line.update(2, "; code shipped: 1.0 MiB")
    first = "\rtorchrunx: agents starting: 2/4 hosts up [0.5 s]; code shipped: 1.0 MiB"
    assert out.getvalue() == first
    clock[0] += progress.MIN_INTERVAL_S / 2
    line.update(3)
    assert out.getvalue() == first  # not redrawn more often than MIN_INTERVAL_S
    clock[0] += progress.MIN_INTERVAL_S
    line.update(3)
    second = "torchrunx: agents starting: 3/4 hosts up [0.7 s]"
    assert out.getvalue() == first + "\r" + second.ljust(len(first) - 1)  # the old text covered
    line.close()
    assert out.getvalue().endswith("\r" + " " * len(second) + "\r")  # erased, cursor back
    line.close()  # once


LAUNCH = (
    "import torchrunx as trx; "
    "print(trx.launch(lambda: 1, hostnames=['localhost', 'localhost'], workers_per_host=1,"
    " backend=None).ranks)"
)


@pytest.mark.parametrize("setting", ["1", None])
def test_a_launch_draws_its_agents_start_only_when_asked_off_a_terminal(setting):
    env = {k: v for k, v in os.environ.items() if k != "TORCHRUNX_PROGRESS"}
    if setting is not None:
        env["TORCHRUNX_PROGRESS"] = setting
    done = subprocess.run(  # bytes: text mode would turn each carriage return into a newline
        [sys.executable, "-c", LAUNCH], capture_output=True, env=env, timeout=120, check=True
    )
    stderr = done.stderr.decode()
    assert done.stdout.decode().splitlines()[-1] == "[1, 1]"
    if setting is None:
        assert "torchrunx: agents starting" not in stderr  # stderr is a pipe here
        return
    drawn = [part for part in stderr.split("\r") if part.startswith("torchrunx: agents starting")]
    assert drawn, stderr
    assert drawn[0].startswith("torchrunx: agents starting: 0/2 hosts up [0.0 s]")
    assert "\r" + " " * len(drawn[-1].rstrip()) + "\r" in stderr  # erased at the end


def test_rule_a_bytes_line_appears_once_bytes_come_and_is_timed_from_then(monkeypatch):
    forced = _forced({"TORCHRUNX_PROGRESS": "1"})  # no delay
    clock = [50.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    counted = [7 * 2**20]  # what came before (an earlier run's): not this line's
    out = _Terminal()
    results = BytesProgress("results", lambda: counted[0], out, forced)
    clock[0] += 30  # the function runs: nothing came yet, nothing is drawn
    results.update()
    assert out.getvalue() == ""
    counted[0] += 3 * 2**20
    results.update()
    assert out.getvalue() == "\rtorchrunx: results: 3.0 MiB [0.0 s]"
    clock[0] += 1.5
    counted[0] += 2**20
    results.update()
    assert out.getvalue().endswith("\rtorchrunx: results: 4.0 MiB [1.5 s]")
    results.close()
    assert out.getvalue().endswith("\r" + " " * len("torchrunx: results: 4.0 MiB [1.5 s]") + "\r")
    untouched = BytesProgress("results", lambda: 0, _Terminal())
    untouched.close()  # never drawn: nothing to erase
    assert untouched.line is None


BIG_RESULTS = """
import torchrunx as trx

def big():
    import torch
    return torch.ones(16 * 2**20 // 4)  # 16 MiB: a large outcome, on a connection of its own

launcher = trx.Launcher(**HOSTS, backend=None)
print("cold", [t.numel() for t in launcher.run(big).ranks], flush=True)
with launcher.warm() as warm:
    for run in range(2):
        print("warm", [t.numel() for t in warm.run(big).ranks], flush=True)
"""


@pytest.mark.parametrize("where", ["localhost", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_large_results_draw_their_bytes_in_cold_and_warm_runs(where, request):
    """Two ranks' 16 MiB results, on one host (2 workers) or two SSH test hosts (1 each)."""
    names: list[str] = ["localhost"]
    hosts: dict[str, object] = {"hostnames": names, "workers_per_host": 2}
    if where == "cluster":
        cluster = request.getfixturevalue("cluster")
        names = cluster.names()[:2]
        hosts = {
            "hostnames": names,
            "workers_per_host": 1,
            "ssh_config_file": str(cluster.ssh_config),
        }
    env = {**os.environ, "TORCHRUNX_PROGRESS": "1"}
    script = f"HOSTS = {hosts!r}\n{BIG_RESULTS}"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, env=env, timeout=120, check=True
    )
    stderr = done.stderr.decode()
    # The script's own lines (rank 0's output comes too, prefixed: gloo's warnings on hosts).
    out = [line for line in done.stdout.decode().splitlines() if not line.startswith("[")]
    assert out == [f"{kind} [{4 * 2**20}, {4 * 2**20}]" for kind in ("cold", "warm", "warm")]
    # Each run's line counts its own bytes: the two results' 32 MiB (and the frames around
    # them), never a sum over runs (48 MiB and more by the second); three runs, three lines,
    # each erased at its run's end (a blank redraw), its last figure drawn just before (the
    # redraws come at most every 0.1 s: 32 MiB often all come within one).
    runs: list[list[float]] = []
    current: list[float] = []
    for part in stderr.split("\r"):
        if part.startswith("torchrunx: results: "):
            current.append(float(part.split()[2]))
        elif part and not part.strip() and current:  # the line erased: its run is over
            runs.append(current)
            current = []
    assert not current, stderr  # every results line was erased
    assert len(runs) == 3, runs
    assert all(32.0 <= run[-1] < 33.0 for run in runs), runs
    first = f"torchrunx: agents starting: 0/{len(names)}"
    starts = [p for p in stderr.split("\r") if p.startswith(first)]
    assert len(starts) >= 2, stderr  # the cold launch's agents, then the warm block's
