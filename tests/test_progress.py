"""The progress line of a launch's long steps: its rules (pure), and real launches' stderr."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from torchrunx.launcher.view import progress
from torchrunx.launcher.view.progress import ProgressLine, progress_enabled, progress_text


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


def test_rule_only_a_terminal_outside_a_notebook_unless_asked(monkeypatch):
    assert progress_enabled(_Terminal(), {}) is ("ipykernel" not in sys.modules)
    assert progress_enabled(io.StringIO(), {}) is False  # a pipe, a file, a log
    assert progress_enabled(io.StringIO(), {"TORCHRUNX_PROGRESS": "1"}) is True
    assert progress_enabled(_Terminal(), {"TORCHRUNX_PROGRESS": "0"}) is False
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # in a notebook's kernel
    assert progress_enabled(_Terminal(), {}) is False


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
