"""Ray against SSH on the same hosts: call to function start, cold and warm (issue #30).

Usage::

    python benchmarks/engines.py [--runs 5] [--warm-runs 10]

A 3-node Ray cluster is started on the bench test hosts (``bnode1``-``bnode3``: ``ray start
--head`` on the first, ``ray start --address`` on the others); its start-up is not counted,
as a user's cluster is up already. Then, alternating, ``--runs`` times each, a fresh Python
process launches one function on 3 hosts x 2 gloo workers:

- **ssh**: ``hostnames=["bnode1", "bnode2", "bnode3"]`` over SSH;
- **ray**: ``hostnames="ray:HEAD:6379"``: torchrunx connects to Ray (``ray.init``), reserves a
  placement group and starts one actor per node, which starts the agent;
- **ray, connected**: the same, in a script that called ``ray.init`` before (as a Ray
  program would have): the connection is not counted;
- **Ray's own floor**: a bare driver that connects, reserves the same placement group and
  starts one actor per node that answers a call, then removes them: what any launch through
  Ray pays on this machine before our agent can start.

The figure is from just before the call to the latest rank's first line (every rank runs).
Then warm agents: ``Launcher.warm()`` once per transport, and ``--warm-runs`` runs of a
function with fresh workers and with workers that stay. Target: Ray cold <= 1.2 x SSH cold
(medians, same run); warm runs as warm agents' targets (fresh workers median <= 0.1 s, max
<= 0.25 s; workers that stay median <= 0.02 s). Prints Markdown on stdout.
"""

# ruff: noqa: E501 (the children's code is kept as it runs, one statement a line)

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from ray_cluster import RayCluster, start_ray_cluster  # noqa: E402

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
mode, folder, address, ssh_config = sys.argv[1:5]
if mode == "ray-connected":
    import ray
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
import torchrunx as trx

def started(folder):
    import os, time
    path = os.path.join(folder, os.environ["RANK"])
    with open(path, "w") as f:
        f.write(repr(time.time()))
    return os.environ["RANK"]

hosts = ["bnode1", "bnode2", "bnode3"] if mode == "ssh" else "ray:" + address
kwargs = {{"ssh_config_file": ssh_config}} if mode == "ssh" else {{}}
at = time.time()
trx.launch(started, func_args=(folder,), hostnames=hosts, workers_per_host=2, backend="gloo", **kwargs)
end = time.time()
starts = [float(open(os.path.join(folder, r)).read()) for r in sorted(os.listdir(folder))]
print(json.dumps({{"call": at, "starts": starts, "end": end}}))
"""

RAY_FLOOR = r"""
import json, os, sys, time
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
at = time.time()
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
group = placement_group([{"CPU": 1.0, "node:" + n["NodeManagerAddress"]: 0.001} for n in nodes], strategy="STRICT_SPREAD")
ray.get(group.ready(), timeout=60)

@ray.remote
class Bare:
    def ping(self):
        return os.getpid()

actors = [Bare.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)).remote() for i in range(len(nodes))]
ray.get([a.ping.remote() for a in actors])
ready = time.time()
for a in actors:
    ray.kill(a)
remove_placement_group(group)
ray.shutdown()
print(json.dumps({"call": at, "starts": [ready], "end": time.time()}))
"""


def run_child(code: str, args: list[str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def cold(mode: str, ray: RayCluster) -> float:
    with tempfile.TemporaryDirectory() as folder:
        if mode == "floor":
            report = run_child(RAY_FLOOR, [ray.address])
        else:
            args = [mode, folder, ray.address, str(ray.hosts.ssh_config)]
            report = run_child(CHILD.format(repo=str(REPO)), args)
    return max(report["starts"]) - report["call"]  # type: ignore[arg-type, operator]


def warm(spec: str, ray: RayCluster, runs: int, *, keep: bool) -> tuple[float, list[float]]:
    import torchrunx as trx  # noqa: PLC0415 (after the cluster is up)

    def now() -> float:
        import time as clock  # noqa: PLC0415 (in the workers)

        return clock.time()

    hosts: object = ["bnode1", "bnode2", "bnode3"] if spec == "ssh" else f"ray:{ray.address}"
    extra = {"ssh_config_file": ray.hosts.ssh_config} if spec == "ssh" else {}
    launcher = trx.Launcher(hostnames=hosts, workers_per_host=2, backend="gloo", **extra)  # type: ignore[arg-type]
    began = time.time()
    with launcher.warm(keep_workers=keep) as agents:
        opened = time.time() - began
        times = []
        for _ in range(1 + runs):
            at = time.time()
            starts = agents.run(now).ranks
            times.append(max(starts) - at)
    return opened, times[1:]


def row(name: str, values: list[float]) -> str:
    return f"| {name} | {statistics.median(values):.2f} s | {min(values):.2f} s | {max(values):.2f} s |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warm-runs", type=int, default=10)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="trx-engines-"))
    print("starting a 3-node Ray cluster on the bench hosts...", file=sys.stderr)
    try:
        ray = start_ray_cluster(3, workdir, profile="bench")
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    try:
        modes = ["ssh", "ray", "ray-connected", "floor"]
        figures: dict[str, list[float]] = {m: [] for m in modes}
        for index in range(args.runs):
            for mode in modes if index % 2 == 0 else reversed(modes):
                figures[mode].append(cold(mode, ray))
                print(f"run {index + 1} {mode}: {figures[mode][-1]:.2f} s", file=sys.stderr)
        warm_rows = []
        for spec in ("ssh", "ray"):
            for keep in (False, True):
                opened, times = warm(spec, ray, args.warm_runs, keep=keep)
                warm_rows.append((spec, keep, opened, times))
    finally:
        ray.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # the hosts' keys and SSH configs
    ssh = statistics.median(figures["ssh"])
    print("| 3 hosts x 2 workers, gloo: call to every rank's start | median | min | max |")
    print("|---|---|---|---|")
    print(row("ssh (cold)", figures["ssh"]))
    print(row("ray (cold; torchrunx connects)", figures["ray"]))
    print(row("ray (cold; the script had called ray.init)", figures["ray-connected"]))
    print(row("Ray's own floor: connect, placement group, 3 bare actors answer", figures["floor"]))
    ray_ratio = statistics.median(figures["ray"]) / ssh
    connected_ratio = statistics.median(figures["ray-connected"]) / ssh
    above_floor = statistics.median(figures["ray"]) - statistics.median(figures["floor"])
    print()
    print(
        f"ray / ssh (medians): {ray_ratio:.2f}; connected ray / ssh: {connected_ratio:.2f} (target <= 1.2)"
    )
    print(f"ray less Ray's own floor: {above_floor:.2f} s, / ssh: {above_floor / ssh:.2f}")
    print()
    print("| warm agents, 3 hosts x 2 workers | `warm()` took | median | min | max |")
    print("|---|---|---|---|---|")
    for spec, keep, opened, times in warm_rows:
        kind = "workers that stay" if keep else "fresh workers"
        print(
            f"| {spec}, {kind} | {opened:.2f} s | {statistics.median(times):.3f} s | "
            f"{min(times):.3f} s | {max(times):.3f} s |"
        )


if __name__ == "__main__":
    main()
