"""Shipping code to hosts that do not share the launcher's files, against rsync (issue #31).

Usage::

    python benchmarks/ship.py [--hosts 8] [--mb 50] [--files 500] [--runs 3]

Isolated bench test hosts (``bnode1``...: their mount namespace hides the checkout and this
benchmark's project; each has its own ``~/.cache``), reached over real SSH. A project of
``--files`` files, ``--mb`` MB in all (random bytes: nothing compresses), lies in a folder only
the launcher sees. In one run, taking turns, ``--runs`` times each, every figure from a fresh
Python process:

- **cold**: every host's cache emptied, then a launch with ``ship=(".",)`` of a function that
  returns at once: the whole tree (and torchrunx) travels to every host;
- **warm**: the same launch again, the tree cached: what a launch costs without shipping;
- **rsync**: ``rsync -a`` of the same folder to every host at once (one process per host,
  OpenSSH with the same config), into an emptied folder: the tool a user would run instead;
- **scp**: ``scp -O -r`` of it (the classic protocol: the bench hosts run no SFTP server),
  the same way.

Shipping's time is cold less warm (medians). Targets: shipping <= 2 x rsync's time (same run);
the warm launch's bytes on the hosts' links <= 1% of the cold one's (each host's link counters,
``/sys/class/net/VETH/statistics/tx_bytes``). Prints Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cluster import HOST_VENV, cluster_unavailable_reason, start_cluster  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import torchrunx as trx
hosts, ssh_config, python = sys.argv[1].split(","), sys.argv[2], sys.argv[3]

def ready():
    return 1

at = time.monotonic()
result = trx.launch(ready, hostnames=hosts, workers_per_host=1, backend=None,
                    ssh_config_file=ssh_config, python=python, ship=(".",), log_handlers=None)
took = time.monotonic() - at
assert result.ranks == [1] * len(hosts)
print(json.dumps({{"seconds": took}}))
"""


def _launch(project: Path, hosts: list[str], ssh_config: str) -> float:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD.format(repo=str(REPO)),
            ",".join(hosts),
            ssh_config,
            str(HOST_VENV / "bin" / "python"),
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def _copy(tool: str, project: Path, hosts: list[str], ssh_config: str) -> float:
    """``rsync -a`` or ``scp -r`` of ``project`` to every host at once (into ~/.cache)."""
    at = time.monotonic()
    if tool == "rsync":
        argvs = [
            ["rsync", "-a", "-e", f"ssh -F {ssh_config}", f"{project}/", f"{h}:.cache/copy/"]
            for h in hosts
        ]
    else:
        argvs = [
            ["scp", "-O", "-r", "-q", "-F", ssh_config, str(project), f"{h}:.cache/copy"]
            for h in hosts
        ]
    procs = [subprocess.Popen(argv, stdin=subprocess.DEVNULL) for argv in argvs]
    for proc in procs:
        if proc.wait(timeout=900) != 0:
            raise RuntimeError(f"{tool} failed")
    return time.monotonic() - at


def _wire(cluster: object) -> int:
    return sum(
        int(Path(f"/sys/class/net/{h.veth}/statistics/tx_bytes").read_text())
        for h in cluster.hosts  # type: ignore[attr-defined]
    )


def _empty_caches(cluster: object) -> None:
    for host in cluster.hosts:  # type: ignore[attr-defined]
        cache = cluster.cache_dir(host)  # type: ignore[attr-defined]
        for entry in cache.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                for root, dirs, _files in os.walk(entry):  # read-only copies: writable first
                    for name in dirs:
                        os.chmod(os.path.join(root, name), 0o700)  # noqa: PTH101, PTH118
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _make_project(root: Path, megabytes: int, files: int) -> None:
    size = megabytes * 1_000_000 // files
    for index in range(files):
        path = root / f"pkg{index % 20}" / f"module{index}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    (root / ".gitignore").write_text("outputs/\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    reason = cluster_unavailable_reason()
    if reason is not None:
        sys.exit(f"no bench hosts: {reason}")
    figures: dict[str, list[float]] = {"cold": [], "warm": [], "rsync": [], "scp": []}
    wire: dict[str, list[int]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="trx-ship-bench-") as work:
        (Path(work) / "cluster").mkdir()
        cluster = start_cluster(args.hosts, Path(work) / "cluster", "bench", isolated=True)
        try:
            project = cluster.launcher_only / "project"
            _make_project(project, args.mb, args.files)
            config, hosts = str(cluster.ssh_config), cluster.names()
            for run in range(args.runs):
                _empty_caches(cluster)
                for kind in ("cold", "warm"):
                    before = _wire(cluster)
                    figures[kind].append(_launch(project, hosts, config))
                    wire[kind].append(_wire(cluster) - before)
                for tool in ("rsync", "scp"):
                    _empty_caches(cluster)
                    figures[tool].append(_copy(tool, project, hosts, config))
                print(
                    f"run {run + 1}: "
                    + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in figures.items())
                    + f"; bytes cold {wire['cold'][-1]}, warm {wire['warm'][-1]}",
                    file=sys.stderr,
                )
            _empty_caches(cluster)
        finally:
            cluster.stop()
    median = {k: statistics.median(v) for k, v in figures.items()}
    shipping = [c - median["warm"] for c in figures["cold"]]
    print(f"| {args.hosts} hosts, {args.files} files, {args.mb} MB | median s | slowest s |")
    print("|---|---|---|")
    rows = [
        ("launch with the tree shipped (cold caches)", figures["cold"]),
        ("launch with the tree cached (warm)", figures["warm"]),
        ("shipping: cold less warm", shipping),
        ("rsync -a to every host at once", figures["rsync"]),
        ("scp -r to every host at once", figures["scp"]),
    ]
    for label, values in rows:
        print(f"| {label} | {statistics.median(values):.2f} | {max(values):.2f} |")
    print()
    ratio = statistics.median(shipping) / median["rsync"]
    print(f"shipping / rsync time: {ratio:.2f} (target <= 2: {'met' if ratio <= 2 else 'NOT met'})")
    print(f"shipping / scp time: {statistics.median(shipping) / median['scp']:.2f}")
    share = statistics.median(wire["warm"]) / statistics.median(wire["cold"])
    print(
        f"bytes on the hosts' links: cold {statistics.median(wire['cold']) / 1e6:.1f} MB, warm "
        f"{statistics.median(wire['warm']) / 1e6:.3f} MB: {100 * share:.2f}% "
        f"(target <= 1%: {'met' if share <= 0.01 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
