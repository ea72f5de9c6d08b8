"""The scale floor: one bare Python started over SSH on every test host, all hosts at once.

Run by ``run.py`` in a fresh process in the measurement's scratch directory, like ``driver.py``::

    python ssh_floor.py SPEC_JSON

This is the least that any launcher which starts Python processes on each host over SSH has to
do: open an SSH connection to every host, all at once, start one ``floor.py`` per worker there
(with gloo: import torch and join one group of all ranks, rank 0 on the first host; with
``backend=None``: start and record the start), and wait until every command has exited. No
agent, no function to send, no results. The last line printed is the same ``BENCH-RESULT
{json}`` report as ``driver.py``'s.

The SSH clients (``BENCH_FLOOR_CLIENT``): ``openssh`` (the default) runs one OpenSSH ``ssh``
process per host (``-F`` the bench cluster's config, ``BatchMode``), as issue #48 defines the
floor; ``paramiko`` opens the connections from this process, one thread per host, with
torchrunx's own paramiko connect (the floor of the figures recorded before 2026-11-29).
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paramiko  # imported before the timer, as 0.4 does (ours imports it in the call)
from driver import cpu_seconds, finish_report

from torchrunx.engines.ssh import resolve_ssh_target, ssh_connect

HERE = Path(__file__).resolve().parent


def run_on(host: str, command: str, config_file: str, errors: list[str]) -> None:
    """Connect to ``host`` as the SSH config says, run ``command``, wait for it to exit."""
    clients: list[paramiko.SSHClient] = []
    try:
        clients = ssh_connect(resolve_ssh_target(host, config_file, 10.0), config_file)
        _, stdout, stderr = clients[-1].exec_command(command)
        status = stdout.channel.recv_exit_status()
        if status != 0:
            errors.append(f"{host}: exit status {status}: {stderr.read().decode()[-300:]}")
    except Exception as exc:  # noqa: BLE001 (reported as the measurement's error)
        errors.append(f"{host}: {type(exc).__name__}: {exc}")
    finally:
        for client in reversed(clients):
            client.close()


def run_with_openssh(host: str, command: str, config_file: str, errors: list[str]) -> None:
    """As :func:`run_on`, with an OpenSSH ``ssh`` client process."""
    argv = ["ssh", "-T", "-F", config_file, "-o", "BatchMode=yes", "--", host, command]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        errors.append(f"{host}: {type(exc).__name__}: {exc}")
        return
    if done.returncode != 0:
        errors.append(f"{host}: exit status {done.returncode}: {done.stderr.decode()[-300:]}")


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    config_file: str = spec["ssh_config"]
    config = paramiko.SSHConfig.from_path(config_file)
    hosts: list[str] = spec["hosts"]
    backend = spec["backend"] or "none"
    address = config.lookup(hosts[0])["hostname"]
    port = random.randint(20000, 60000)  # in the first host's own network namespace
    workers: int = spec["workers"]
    world_size = len(hosts) * workers
    floor = f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'floor.py'))}"
    commands = []
    for host_index in range(len(hosts)):
        # All of a host's processes at once, then wait for each (any failure fails the host).
        ranks = range(host_index * workers, (host_index + 1) * workers)
        starts = "".join(
            f"{floor} {rank} {port} {world_size} {address} {backend} & p{rank}=$!; "
            for rank in ranks
        )
        waits = " && ".join(f"wait $p{rank}" for rank in ranks)
        commands.append(f"cd {shlex.quote(str(Path.cwd()))} || exit 1; {starts}{waits}")
    errors: list[str] = []
    cpu_before = cpu_seconds()
    called = time.time()
    client = os.environ.get("BENCH_FLOOR_CLIENT", "openssh")
    if client not in ("openssh", "paramiko"):
        sys.exit(f"BENCH_FLOOR_CLIENT={client!r}: expected openssh or paramiko")
    target = run_with_openssh if client == "openssh" else run_on
    threads = [
        threading.Thread(target=target, args=(host, command, config_file, errors))
        for host, command in zip(hosts, commands, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = time.time()
    report: dict[str, Any] = {
        "calls": [] if errors else [called],
        "results": [] if errors else [done],
        "error": "; ".join(errors) or None,
        "error_at": done if errors else None,
        "value": None,
    }
    finish_report(report, cpu_before)


if __name__ == "__main__":
    main()
