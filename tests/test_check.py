"""``torchrunx check``: every host checked at once, a line per host saying what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchrunx.agent.probe import ProbeReport
from torchrunx.launcher.preflight import Local, format_checks, judge

ROOT = Path(__file__).resolve().parent.parent


def check(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``torchrunx check ARGS`` as a user runs it, in ``cwd``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "torchrunx", "check", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_local_hosts_are_ready(tmp_path):
    done = check("--hostnames", "localhost", "localhost", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    import torchrunx

    for line in lines[:2]:
        assert line.startswith("localhost  ok    local  python "), line
        assert f"({sys.executable})" in line
        assert f"torchrunx {torchrunx.__version__}" in line
    assert lines[2].startswith("2 hosts checked in ") and lines[2].endswith(": all ready")


def test_a_failing_env_file_and_an_unknown_host_each_get_their_line(tmp_path):
    env_file = tmp_path / "env.sh"
    env_file.write_text("echo 'module: command not found' >&2\nfalse\n")
    started = time.monotonic()
    done = check(
        "--hostnames", "localhost", "nosuchhost.invalid", "--env-file", str(env_file), cwd=tmp_path
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("localhost           FAIL  local"), done.stdout
    assert lines[1] == (
        "    - the probe exited with status 1: module: command not found; it sourced "
        f"env_file {str(env_file)!r} first: check that file"
    )
    assert lines[2].startswith("nosuchhost.invalid  FAIL  ssh")
    assert (
        lines[3].startswith("    - cannot connect to ")
        and "is the host up and reachable?" in lines[3]
    )
    assert lines[-1].endswith(": 2 not ready")
    assert took < 30  # both answered at once: no host waited for its start_timeout (60 s)


def test_bad_options_are_a_usage_error(tmp_path):
    done = check("--hostnames", "localhost", "--workers-per-host", "-3", cwd=tmp_path)
    assert done.returncode == 2
    assert "workers_per_host" in done.stderr
    done = check("--help", cwd=tmp_path)
    assert done.returncode == 0 and "--ssh-config-file" in done.stdout
    assert done.stdout.startswith("usage: torchrunx check")


# -- the judgement of one host's answer (pure) ------------------------------------------------

LOCAL = Local(
    python_version="3.11.7",
    torchrunx="0.5.0",
    torch="2.13.0",
    backend="auto",
    workers_per_host="auto",
    env_file=None,
)


def report(**changes: object) -> ProbeReport:
    fields: dict[str, object] = {
        "hostname": "node2",
        "python": "/venv/bin/python",
        "python_version": "3.11.9",
        "torchrunx": "0.5.0",
        "torch": "2.13.0",
        "gpus": 4,
        "cpus": 32,
        "cwd": "/work",
        "route_back": "ok",
        "master": "ok",
        "pidfds": None,
        "seconds": 0.2,
    }
    fields.update(changes)
    return ProbeReport(**fields)  # type: ignore[arg-type]


def judged(index: int = 1, local: Local = LOCAL, status: int | None = 0, **answer: object):
    lines = [(False, "some output"), (False, report(**answer).to_line())]
    return judge(
        index,
        "node2",
        "ssh",
        local,
        start_failure=None,
        status=status,
        lines=lines,
        seconds=0.5,
        timeout=60,
    )


def test_a_ready_host_has_its_facts_and_no_problem():
    host = judged()
    assert host.ok
    assert host.facts == (
        "python 3.11.9 (/venv/bin/python)",
        "torchrunx 0.5.0",
        "torch 2.13.0",
        "4 GPUs",
        "32 CPUs",
    )


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (
            {"python_version": "3.10.13"},
            (
                "Python 3.10.13 here, 3.11.7 in the launcher: functions and results are pickled "
                "between them; use the same Python minor version"
            ),
        ),
        (
            {"torchrunx": "0.4.0"},
            "torchrunx 0.4.0 here, 0.5.0 in the launcher: install the same version on every host",
        ),
        (
            {"torch": None},
            (
                "torch is not installed here, 2.13.0 in the launcher: install the same torch on "
                "every host"
            ),
        ),
        (
            {"route_back": "cannot connect to 10.0.0.1:29400: timed out"},
            (
                "the host cannot reach this machine: cannot connect to 10.0.0.1:29400: timed out; "
                "set launcher_address (or TORCHRUNX_LAUNCHER_ADDR) to an address of this machine "
                "that the host can reach, and let it through the firewall (TORCHRUNX_LAUNCHER_PORT "
                "fixes the port)"
            ),
        ),
        (
            {"master": "cannot connect to 10.0.0.2:41000: [Errno 111] Connection refused"},
            (
                "the host cannot reach host 0: cannot connect to 10.0.0.2:41000: [Errno 111] "
                "Connection refused; workers connect to host 0 on a free port it picks (MASTER_PORT): "
                "open the ports between the hosts"
            ),
        ),
        ({"pidfds": "this kernel has no pidfd_open"}, "this kernel has no pidfd_open"),
    ],
)
def test_each_difference_that_breaks_a_launch_is_a_problem_saying_what_to_do(answer, problem):
    host = judged(**answer)
    assert host.problems == (problem,)
    assert not host.ok


def test_host_0_is_not_blamed_for_the_hosts_that_did_not_reach_it():
    assert judged(index=0, master="0 of the 1 other hosts connected to this host's port 4").ok


def test_gpus_the_launch_asks_for():
    nccl = Local(**{**LOCAL.__dict__, "backend": "nccl"})
    assert judged(local=nccl, gpus=0).problems == (
        "no GPU found, but the launch asks for backend='nccl'",
    )
    gpu = Local(**{**LOCAL.__dict__, "workers_per_host": "gpu"})
    assert judged(local=gpu, gpus=0).problems == (
        "no GPU found, but the launch asks for workers_per_host='gpu'",
    )
    assert judged(local=gpu, gpus=1).ok
    assert judged(gpus=0).facts[3] == "no GPU"


def no_report(status: int | None, *errors: str, local: Local = LOCAL) -> tuple[str, ...]:
    lines = [(True, error) for error in errors]
    return judge(
        1,
        "node2",
        "ssh",
        local,
        start_failure=None,
        status=status,
        lines=lines,
        seconds=1.0,
        timeout=60,
    ).problems


def test_a_probe_that_did_not_answer_says_why():
    python = sys.executable
    assert no_report(None) == ("no answer within start_timeout=60 s",)
    assert no_report(127, f"bash: line 1: {python}: No such file or directory") == (
        (
            f"the interpreter {python} is missing on this host (bash: line 1: {python}: No such file "
            "or directory): install the same environment at the same path on every host"
        ),
    )
    (problem,) = no_report(1, "ModuleNotFoundError: No module named 'torchrunx'")
    assert problem.startswith(f"{python} on this host cannot import torchrunx (ModuleNotFound")
    assert problem.endswith("install this project in that environment on every host")
    (problem,) = no_report(1, "bash: line 1: cd: /home/me/proj: No such file or directory")
    assert problem.endswith(
        "workers start there; use a folder that every host has (a shared file system)"
    )
    assert no_report(1, "boom") == ("the probe exited with status 1: boom",)
    with_env = Local(**{**LOCAL.__dict__, "env_file": "/etc/env.sh"})
    assert no_report(1, "boom", local=with_env) == (
        (
            "the probe exited with status 1: boom; it sourced env_file '/etc/env.sh' first: "
            "check that file"
        ),
    )
    start = judge(
        1,
        "node2",
        "ssh",
        LOCAL,
        start_failure="SSH authentication failed",
        status=None,
        lines=[],
        seconds=0.1,
        timeout=60,
    )
    assert start.problems == ("SSH authentication failed",) and start.report is None


def test_the_lines_printed():
    ready, failed = judged(index=0), judged(torch=None)
    text = format_checks([ready, failed], 1.25)
    assert text.splitlines() == [
        (
            "node2  ok    ssh    python 3.11.9 (/venv/bin/python), torchrunx 0.5.0, torch 2.13.0, "
            "4 GPUs, 32 CPUs"
        ),
        "node2  FAIL  ssh  ",
        (
            "    - torch is not installed here, 2.13.0 in the launcher: install the same torch on "
            "every host"
        ),
        "2 hosts checked in 1.2 s: 1 not ready",
    ]


# -- real SSH hosts ---------------------------------------------------------------------------


@pytest.mark.cluster
def test_ssh_hosts_ready_then_an_unknown_key_and_no_route_back(cluster, tmp_path):
    config = str(cluster.ssh_config)
    done = check("--hostnames", *cluster.names(), "--ssh-config-file", config, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for name, line in zip(cluster.names(), lines, strict=False):
        assert line.startswith(f"{name}  ok    ssh    python "), done.stdout
    assert lines[-1].endswith("2 hosts checked in " + lines[-1].split(" in ")[1])

    # node2's key unknown (a config whose known_hosts file is empty)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    text = cluster.ssh_config.read_text()
    strange = tmp_path / "ssh_config"
    strange.write_text(
        text.replace(f"UserKnownHostsFile {cluster.known_hosts}", f"UserKnownHostsFile {empty}")
    )
    done = check("--hostnames", *cluster.names(), "--ssh-config-file", str(strange), cwd=tmp_path)
    assert done.returncode == 1
    assert (
        "known_hosts" in done.stdout and "connect once with `ssh` to record its key" in done.stdout
    )

    # the hosts are told an address of this machine that they cannot reach
    done = check(
        "--hostnames",
        *cluster.names(),
        "--ssh-config-file",
        config,
        "--launcher-address",
        cluster.profile.unreachable_address,
        "--start-timeout",
        "4",
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout
    assert done.stdout.count("- the host cannot reach this machine: cannot connect to ") == 2
    assert "the host cannot reach host 0" not in done.stdout  # node2 still reached node1
