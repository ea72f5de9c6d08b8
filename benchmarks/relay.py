"""Results over the relay against ``scp`` of the same bytes, on the same link (issue #31).

Usage::

    python benchmarks/relay.py [--runs 3] [--mb 400]

Two bench test hosts (``bnode1``, ``bnode2``, namespaces reached over real SSH). In one run,
alternating, ``--runs`` times each:

- **relay**: a fresh Python process launches one worker per host with ``relay="on"``; each
  rank returns ``--mb`` MB (``bytes``), which travel worker -> relay -> SSH channel -> launcher;
- **relay, empty**: the same launch returning ``b""``: what the launch costs without the bytes;
- **direct**: ``relay="off"`` returning the same bytes (TCP straight to the launcher);
- **scp**: OpenSSH's ``scp`` of a file of ``--mb`` MB from each host at once (two processes),
  written to ``/dev/null``: the same bytes over the same link, with OpenSSH's own ciphers;
- **floor**: the direct launch and the scp at the same time. A relayed result pays both: SSH's
  ciphers (as scp) and the sealed records (as the direct launch), on the same CPUs; the time
  both take together, less the empty launch, is the fastest this machine allows a relay.

The results figure is the launch's time less the empty launch's median; the target is
relay >= 0.5 x scp's speed (MB/s, medians, same run), and the relay is also given against the
floor. Prints Markdown on stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cluster import cluster_unavailable_reason, start_cluster  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import torchrunx as trx
relay, size, ssh_config = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def payload(size):
    return b"x" * size

at = time.monotonic()
result = trx.launch(payload, func_args=(size,), hostnames=["bnode1", "bnode2"], workers_per_host=1,
                    backend=None, ssh_config_file=ssh_config, relay=relay, log_handlers=None)
took = time.monotonic() - at
assert [len(r) for r in result.ranks] == [size, size]
print(json.dumps({{"seconds": took}}))
"""


def _launch(relay: str, size: int, ssh_config: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(repo=str(REPO)), relay, str(size), ssh_config],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


def _scp(paths: list[str], ssh_config: str) -> float:
    at = time.monotonic()
    procs = [
        subprocess.Popen(
            ["scp", "-O", "-q", "-F", ssh_config, f"{host}:{path}", "/dev/null"],
            stdin=subprocess.DEVNULL,
        )
        for host, path in zip(["bnode1", "bnode2"], paths, strict=True)
    ]
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise RuntimeError("scp failed")
    return time.monotonic() - at


def _together(size: int, paths: list[str], ssh_config: str) -> float:
    """The direct launch and the scp at once: the wall time of both."""
    at = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(_launch, "off", size, ssh_config), pool.submit(_scp, paths, ssh_config)]
        for job in jobs:
            job.result()
    return time.monotonic() - at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mb", type=int, default=400)
    args = parser.parse_args()
    reason = cluster_unavailable_reason()
    if reason is not None:
        sys.exit(f"no bench hosts: {reason}")
    size = args.mb * 1_000_000
    figures: dict[str, list[float]] = {
        "relay": [],
        "empty": [],
        "direct": [],
        "scp": [],
        "floor": [],
    }
    with tempfile.TemporaryDirectory(prefix="trx-relay-bench-") as work:
        (Path(work) / "cluster").mkdir()
        cluster = start_cluster(2, Path(work) / "cluster", profile="bench")
        try:
            config = str(cluster.ssh_config)
            files = []
            for index in range(2):  # the hosts share this machine's files
                path = Path(work) / f"blob{index}"
                with path.open("wb") as f:
                    f.write(b"x" * size)
                files.append(str(path))
            for run in range(args.runs):
                figures["empty"].append(_launch("on", 0, config))
                figures["relay"].append(_launch("on", size, config))
                figures["direct"].append(_launch("off", size, config))
                figures["scp"].append(_scp(files, config))
                figures["floor"].append(_together(size, files, config))
                print(
                    f"run {run + 1}: "
                    + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in figures.items()),
                    file=sys.stderr,
                )
        finally:
            cluster.stop()
    empty = statistics.median(figures["empty"])
    total_mb = 2 * args.mb

    def speed(seconds: float, *, launch: bool) -> float:
        return total_mb / max(seconds - (empty if launch else 0.0), 1e-6)

    print(f"| 2 hosts x {args.mb} MB | median s | slowest s | MB/s (median) |")
    print("|---|---|---|---|")
    rows = {
        "relay: launch returning the bytes": ("relay", True),
        "direct: the same without the relay": ("direct", True),
        "scp of the same bytes, both hosts at once": ("scp", False),
        "floor: the direct launch and the scp at once": ("floor", True),
    }
    speeds = {}
    for label, (key, launch) in rows.items():
        median = statistics.median(figures[key])
        speeds[key] = speed(median, launch=launch)
        print(f"| {label} | {median:.2f} | {max(figures[key]):.2f} | {speeds[key]:.0f} |")
    print(
        f"| relay: empty launch (subtracted above) | {empty:.2f} | {max(figures['empty']):.2f} | |"
    )
    print()
    ratio = speeds["relay"] / speeds["scp"]
    verdict = "met" if ratio >= 0.5 else "NOT met"
    print(f"relay / scp speed: {ratio:.2f} (target >= 0.5: {verdict})")
    floor = speeds["floor"] / speeds["scp"]
    print(
        f"the floor / scp speed: {floor:.2f} (the most this machine allows); "
        f"relay / floor: {speeds['relay'] / speeds['floor']:.2f}"
    )


if __name__ == "__main__":
    main()
