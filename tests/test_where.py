"""Where is every rank: SIGQUIT (Ctrl-\\) prints every worker's stacks, and the launch goes on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import os, sys, time
import torchrunx as trx

def wait_in_step(folder):
    while not os.path.exists(f"{folder}/go"):
        time.sleep(0.02)

def work(folder):
    rank = os.environ["RANK"]
    open(f"{folder}/started{rank}", "w").close()
    deadline = time.monotonic() + 60
    if rank == str(int(os.environ["WORLD_SIZE"]) - 1):
        while not os.path.exists(f"{folder}/go") and time.monotonic() < deadline:
            time.sleep(0.02)  # rank 2 waits elsewhere
    else:
        wait_in_step(folder)
    return int(rank)  # the last rank waits in work itself, the others in wait_in_step

hosts = sys.argv[3].split(",") if len(sys.argv) > 3 else ["localhost"]
launcher = trx.Launcher(
    hostnames=hosts, workers_per_host=3 if len(hosts) == 1 else 2, backend=None,
    ssh_config_file=sys.argv[4] if len(sys.argv) > 4 else None,
)
if sys.argv[2] == "warm":
    with launcher.warm() as warm:
        warm.run(os.getpid)  # a first run: the look is in the second
        result = warm.run(work, sys.argv[1])
else:
    result = launcher.run(work, sys.argv[1])
print("results", result.ranks, flush=True)
"""


def launch_and_look(
    tmp_path: Path, args: list[str], workers: int, last: str
) -> tuple[int, str, str]:
    """Run SCRIPT with ``args``; once its ``workers`` have started, SIGQUIT it, wait for the
    section of rank ``last`` on its stderr, let the workers finish. Its status, stdout, stderr.
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"started{rank}").exists() for rank in range(workers)):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.05)
        process.send_signal(signal.SIGQUIT)
        while not any(f"--- rank {last} " in line for line in errors):
            assert process.poll() is None, "".join(errors)
            assert time.monotonic() < deadline + 30, "".join(errors)
            time.sleep(0.02)
        (tmp_path / "go").touch()
        out, _ = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    reader.join(timeout=5)
    return process.returncode, out, "".join(errors)


@pytest.mark.parametrize("how", ["run", "warm"])
def test_sigquit_prints_every_ranks_stack_grouped_and_the_launch_goes_on(how, tmp_path):
    status, out, text = launch_and_look(tmp_path, [how], workers=3, last="2")
    assert status == 0, text  # nothing was stopped
    assert out.splitlines()[-1] == "results [0, 1, 2]"
    lines = text.splitlines()
    start = lines.index(
        "torchrunx: where every rank is (the launch goes on; Ctrl-\\ to look again):"
    )
    # Ranks 0 and 1 wait in the same line: one section; rank 2 elsewhere: its own.
    assert lines[start + 1] == (
        "--- ranks 0-1 on host 'localhost' (the same stack; innermost: <dynamic-code>:7 in wait_in_step) ---"
    ), text
    assert "--- rank 2 (local rank 2 on host 'localhost') ---" in lines, text
    section = lines[lines.index("--- rank 2 (local rank 2 on host 'localhost') ---") + 1 :]
    # Its main thread's innermost frame is in work itself: its loop (lines 14-15), or on a
    # loaded machine the lines between its started file and the loop (11-13): the look may
    # come that soon.
    current = next(i for i, line in enumerate(section) if line.startswith("Current thread"))
    innermost = section[current + 1].strip()
    assert re.fullmatch(r'File "<dynamic-code>", line 1[1-5] in work', innermost), text


def test_rule_sigquit_is_taken_only_where_it_has_its_default_action():
    from torchrunx.launcher.view.where import sigquit_shows_stacks

    asked: list[int] = []
    assert signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL
    with sigquit_shows_stacks(lambda: asked.append(1)):
        os.kill(os.getpid(), signal.SIGQUIT)
        deadline = time.monotonic() + 10
        while not asked and time.monotonic() < deadline:  # Python runs the handler soon
            time.sleep(0.001)
    assert asked == [1]
    assert signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL  # restored
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    try:
        with sigquit_shows_stacks(lambda: asked.append(2)):
            assert signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN  # yours, left alone
    finally:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    assert asked == [1]


@pytest.mark.cluster
def test_sigquit_shows_the_stacks_of_workers_on_ssh_hosts(cluster, tmp_path):
    hosts = ",".join(cluster.names())
    args = ["run", hosts, str(cluster.ssh_config)]
    status, out, text = launch_and_look(tmp_path, args, workers=4, last="3")
    assert status == 0, text
    assert out.splitlines()[-1] == "results [0, 1, 2, 3]"
    node1, node2 = cluster.names()
    assert (
        f"--- ranks 0-2 on hosts '{node1}', '{node2}' "
        "(the same stack; innermost: <dynamic-code>:7 in wait_in_step) ---"
    ) in text.splitlines(), text
    assert f"--- rank 3 (local rank 1 on host '{node2}') ---" in text.splitlines(), text
