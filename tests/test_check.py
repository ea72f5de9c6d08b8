"""``torchrunx check`` as a user runs it: local hosts, a failing env_file, SSH hosts.

The judgement of each host's answer is tested without processes in tests/test_rules_check.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    assert lines[3].startswith("    - the host name 'nosuchhost.invalid' does not resolve (")
    assert lines[3].endswith(
        "check its spelling, or give its address with a Host entry and HostName in your SSH config"
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


def test_a_flood_of_idle_connections_and_a_strangers_line_do_not_stop_the_check(monkeypatch):
    import socket
    import threading

    import torchrunx as trx
    from torchrunx.launcher.preflight import check_hosts

    with socket.socket() as probe:  # a free port, named so that the flood knows where to go
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("TORCHRUNX_LAUNCHER_PORT", str(port))
    flood: list[socket.socket] = []
    threads: list[int] = []
    stop = threading.Event()

    def fill() -> None:
        # Before the probes connect back: idle connections, more than the check reads at once,
        # and a stranger's line with a wrong token.
        while not stop.is_set() and len(flood) < 1100:
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:  # noqa: PERF203 (not listening yet: try again)
                time.sleep(0.001)
        if flood:
            flood[0].sendall(b"0123456789abcdef 0 1234\n")
            time.sleep(0.2)
            threads.append(threading.active_count())

    filler = threading.Thread(target=fill)
    filler.start()
    try:
        checks = check_hosts(trx.Launcher(hostnames=["localhost", "localhost"], start_timeout=20))
    finally:
        stop.set()
        filler.join()
        for conn in flood:
            conn.close()
    assert len(flood) >= 1024, len(flood)  # the flood reached the port during the check
    assert threads[0] < 20, threads  # read in one thread, not one per connection
    assert [check.ok for check in checks] == [True, True], [c.problems for c in checks]


HOLD = """
import socket, sys
address, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = [socket.create_connection((address, port), timeout=10) for _ in range(count)]
print("held", len(held), flush=True)
sys.stdin.read()  # say nothing, hold them until the test closes our stdin
"""


def test_idle_connections_of_another_user_to_host_0s_port_do_not_hide_a_host(monkeypatch):
    # Issue #42: host 0's probe read one connection at a time, up to 2 s each, so a few idle
    # strangers at its port kept it from hearing the other hosts before start_timeout. Here
    # another user of this machine holds 8 connections to that port, made before the other
    # host's probe is even given the port.
    import select

    from attacker import as_attacker, attacker_env

    import torchrunx as trx
    from torchrunx.launcher import preflight

    holders: list[subprocess.Popen[bytes]] = []
    said: list[bytes] = []
    original = preflight._Check.master_for

    def master_for(self: preflight._Check, address: str) -> tuple[str, int] | None:
        master = original(self, address)
        if master is not None:  # the other user's own interpreter: the system's python3
            holder = subprocess.Popen(
                as_attacker(["python3", "-c", HOLD, master[0], str(master[1]), "8"]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=attacker_env(),
            )
            holders.append(holder)
            assert holder.stdout is not None
            if select.select([holder.stdout], [], [], 30)[0]:  # the rest waits until it is in
                said.append(holder.stdout.readline())
        return master

    monkeypatch.setattr(preflight._Check, "master_for", master_for)
    started = time.monotonic()
    try:
        checks = preflight.check_hosts(
            trx.Launcher(hostnames=["localhost", "localhost"], start_timeout=12)
        )
    finally:
        for holder in holders:
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.close()
            holder.wait(30)
            holder.stdout.close()
    assert said == [b"held 8\n"]  # one other host: it was given host 0's port once
    assert [check.ok for check in checks] == [True, True], [c.problems for c in checks]
    report = checks[0].report
    assert report is not None and report.master == "ok"  # host 0 heard host 1
    assert time.monotonic() - started < 10  # not the 8 x 2 s of reading strangers in turn
