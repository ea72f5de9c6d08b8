"""pdb in a rank, timed as a user at a terminal sees it; and the stacks of every rank (Ctrl-\\).

Usage::

    python benchmarks/debugger.py [--local] [--commands 50] [--pause 300] [--stack-ranks 16]
                                  [--stops 10] [--looks 10]

On 2 bench test hosts x 2 workers (gloo; ``--local``: this machine, 2 workers), driven through
a pseudo-terminal with pexpect, the launching script's ``breakpoint()`` in the last rank while
the others wait in an all-reduce:

- **prompt**: from the rank's ``time.time()`` just before ``breakpoint()`` to the prompt read
  in the launcher's terminal, for each of ``--stops`` breakpoints (target <= 0.3 s);
- **round trip**: ``p 1`` typed to the next prompt read, ``--commands`` times (target: median
  <= 30 ms);
- **pause**: the rank stays in the debugger ``--pause`` seconds (target: 300 s trips no timeout,
  with ``timeout`` and ``launch_timeout`` left at their defaults), then ``c``: the launch must
  end normally;
- **stacks**: ``--stack-ranks`` ranks (8 per host) wait; SIGQUIT to the launcher; from the
  signal to the grouped stacks printed, ``--looks`` times (target <= 1 s).

The floors, in the same run: a bare Python that calls ``breakpoint()`` in a pseudo-terminal on
this machine (prompt, and the same ``p 1`` round trip), as fast as pdb itself can answer here.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pexpect

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cluster import TestCluster, cluster_unavailable_reason, start_cluster  # noqa: E402

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
import torchrunx as trx

def work(folder, stops):
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(stops):
        if rank == world - 1:
            with open(f"{folder}/break", "w") as f:
                f.write(repr(time.time()))
            breakpoint()
        dist.all_reduce(torch.ones(1))  # the others wait here for the paused rank
    return rank

hosts = sys.argv[2].split(",")
result = trx.Launcher(
    hostnames=hosts, workers_per_host=2, backend="gloo",
    ssh_config_file=sys.argv[3] or None,
).run(work, sys.argv[1], int(sys.argv[4]))
print("RESULTS", result.ranks, flush=True)
"""

STACKS_SCRIPT = """
import os, sys, time
import torchrunx as trx

def wait(folder):
    open(f"{folder}/started{os.environ['RANK']}", "w").close()
    while not os.path.exists(f"{folder}/go"):
        time.sleep(0.05)
    return 0

hosts = sys.argv[2].split(",")
trx.Launcher(
    hostnames=hosts, workers_per_host=int(sys.argv[4]), backend=None,
    ssh_config_file=sys.argv[3] or None,
).run(wait, sys.argv[1])
print("DONE", flush=True)
"""

BARE = "import time\nvalue = 1\nopen('break', 'w').write(repr(time.time()))\nbreakpoint()\n"


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "TERM": "dumb",
    }


def _round_trips(child: pexpect.spawn, prompt: str, count: int) -> list[float]:
    child.delaybeforesend = None  # pexpect waits 50 ms before each send by default
    times = []
    for _ in range(count):
        started = time.perf_counter()
        child.sendline("p 1")
        child.expect(prompt)
        times.append(time.perf_counter() - started)
    return times


def bare(folder: Path, count: int) -> tuple[float, list[float]]:
    """The floor: pdb in a bare Python in a pseudo-terminal on this machine."""
    (folder / "bare.py").write_text(BARE)
    child = pexpect.spawn(
        sys.executable, [str(folder / "bare.py")], cwd=str(folder), encoding="utf-8", timeout=60
    )
    try:
        child.expect(r"\(Pdb\) ")
        prompt = time.time() - float((folder / "break").read_text())
        trips = _round_trips(child, r"\(Pdb\) ", count)
        child.sendline("c")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    return prompt, trips


def ours(  # noqa: PLR0913 (what one measured launch needs)
    folder: Path, hosts: list[str], ssh_config: str, *, count: int, pause: float, stops: int
) -> tuple[list[float], list[float], bool, str]:
    """One launch whose last rank stops ``stops`` times: prompts, round trips, the pause."""
    (folder / "launch.py").write_text(SCRIPT)
    child = pexpect.spawn(
        sys.executable,
        [str(folder / "launch.py"), str(folder), ",".join(hosts), ssh_config, str(stops)],
        cwd=str(folder),
        env=_env(),
        encoding="utf-8",
        timeout=120,
    )
    last = 2 * len(hosts) - 1
    prompt_re = rf"\(Pdb rank {last} on [^)]+\) "
    prompts: list[float] = []
    trips: list[float] = []
    try:
        for stop in range(stops):
            child.expect(prompt_re)
            prompts.append(time.time() - float((folder / "break").read_text()))
            if stop == 0:
                trips = _round_trips(child, prompt_re, count)
            if stop == stops - 1:
                time.sleep(pause)
            child.sendline("c")
        index = child.expect([r"RESULTS \[[\d, ]+\]", pexpect.EOF, pexpect.TIMEOUT])
        finished = index == 0
        tail = str(child.before)[-400:] + (str(child.after) if finished else "")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    return prompts, trips, finished and child.exitstatus == 0, tail


def stacks(
    folder: Path, hosts: list[str], ssh_config: str, per_host: int, looks: int
) -> list[float]:
    """Seconds from SIGQUIT to the grouped stacks printed, ``looks`` times in one launch."""
    (folder / "stacks.py").write_text(STACKS_SCRIPT)
    ranks = per_host * len(hosts)
    child = pexpect.spawn(
        sys.executable,
        [str(folder / "stacks.py"), str(folder), ",".join(hosts), ssh_config, str(per_host)],
        cwd=str(folder),
        env=_env(),
        encoding="utf-8",
        timeout=600,
    )
    try:
        deadline = time.monotonic() + 600  # 16 ranks on a loaded 2-core machine start slowly
        while not all((folder / f"started{rank}").exists() for rank in range(ranks)):
            if time.monotonic() > deadline:
                raise TimeoutError("the ranks did not start")
            time.sleep(0.05)
        seconds = []
        for _ in range(looks):
            started = time.perf_counter()
            child.kill(signal.SIGQUIT)
            child.expect("where every rank is")
            child.expect(r"--- ranks? [^\n]*---")  # the look is printed in one write
            seconds.append(time.perf_counter() - started)
            time.sleep(0.3)
        (folder / "go").touch()
        child.expect("DONE")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    return seconds


def main() -> None:
    """Measure and print the figures against their targets and floors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local", action="store_true", help="this machine, not test hosts")
    parser.add_argument("--commands", type=int, default=50)
    parser.add_argument("--pause", type=float, default=300.0)
    parser.add_argument("--stack-ranks", type=int, default=16)
    parser.add_argument("--stops", type=int, default=10, help="breakpoints timed in one launch")
    parser.add_argument("--looks", type=int, default=10, help="SIGQUITs timed in one launch")
    args = parser.parse_args()
    cluster: TestCluster | None = None
    with tempfile.TemporaryDirectory(prefix="trx-bench-debugger-") as scratch:
        work = Path(scratch)
        if args.local:
            hosts, config = ["localhost"], ""
        else:
            reason = cluster_unavailable_reason()
            if reason is not None:
                sys.exit(f"no test hosts ({reason}); use --local")
            (work / "cluster").mkdir()
            cluster = start_cluster(2, work / "cluster", profile="bench")
            hosts, config = cluster.names(), str(cluster.ssh_config)
        try:
            (work / "bare").mkdir()
            floor_prompt, floor_trips = bare(work / "bare", args.commands)
            (work / "ours").mkdir()
            prompts, trips, finished, tail = ours(
                work / "ours",
                hosts,
                config,
                count=args.commands,
                pause=args.pause,
                stops=args.stops,
            )
            (work / "stacks").mkdir()
            per_host = max(args.stack_ranks // len(hosts), 1)
            looks = stacks(work / "stacks", hosts, config, per_host, args.looks)
        finally:
            if cluster is not None:
                cluster.stop()
    where = "this machine" if args.local else f"{len(hosts)} test hosts over SSH"
    print(f"pdb in a rank, {where} x 2 workers (gloo); floors: a bare Python's pdb here")
    print(f"{'figure':44}{'ours':>12}{'floor':>12}{'target':>14}")
    print(
        f"{'prompt after breakpoint(), median':44}{statistics.median(prompts):11.3f}s"
        f"{floor_prompt:11.3f}s{'<= 0.3 s':>14}"
    )
    print(f"{'prompt after breakpoint(), slowest':44}{max(prompts):11.3f}s")
    print(
        f"{'round trip of p 1, median':44}{statistics.median(trips) * 1e3:10.1f}ms"
        f"{statistics.median(floor_trips) * 1e3:10.1f}ms{'<= 30 ms':>14}"
    )
    print(
        f"{'round trip of p 1, slowest':44}{max(trips) * 1e3:10.1f}ms"
        f"{max(floor_trips) * 1e3:10.1f}ms{'':>14}"
    )
    verdict = "finished normally" if finished else f"did NOT finish normally: {tail!r}"
    print(f"{f'a {args.pause:g} s pause, then c':44}{verdict}")
    ranks = per_host * len(hosts)
    print(
        f"{f'stacks of {ranks} ranks after SIGQUIT, median':44}{statistics.median(looks):11.3f}s"
        f"{'':>12}{'<= 1 s':>14}"
    )
    print(f"{f'stacks of {ranks} ranks after SIGQUIT, slowest':44}{max(looks):11.3f}s")


if __name__ == "__main__":
    main()
