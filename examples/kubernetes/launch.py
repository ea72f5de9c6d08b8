"""Launch on the pods of a JobSet, from a pod of the same cluster (see ``jobset.yaml``).

Usage::

    python examples/kubernetes/launch.py          # the JobSet "train", in this namespace
    python examples/kubernetes/launch.py --selector app=trainer --namespace ml --container trainer

The pods are taken by label selector, in the JobSet's order, each with one worker per GPU its
container requests (``nvidia.com/gpu``), or one per CPU core without GPUs. Their agents start
with ``kubectl exec -i``; the launch needs ``get pods`` and ``pods/exec`` in the namespace (the
manifest's Role). See docs/engines.md.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist

import torchrunx as trx


def allreduce() -> dict[str, object]:
    total = torch.ones(1)
    dist.all_reduce(total)
    return {
        "pod": socket.gethostname(),
        "rank": dist.get_rank(),
        "world": int(total.item()),
        "local_rank": int(os.environ["LOCAL_RANK"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--selector", default="jobset.sigs.k8s.io/jobset-name=train")
    parser.add_argument("--namespace", default=None, help="default: the current context's")
    parser.add_argument("--context", default=None, help="default: the current context")
    parser.add_argument("--container", default="trainer")
    parser.add_argument(
        "--workers", type=int, default=None, help="per pod (default: its GPUs, else CPU cores)"
    )
    args = parser.parse_args()
    options = "&".join(
        f"{key}={value}"
        for key, value in [
            ("namespace", args.namespace),
            ("context", args.context),
            ("container", args.container),
        ]
        if value
    )
    hostnames = f"kubernetes:{args.selector}" + (f"?{options}" if options else "")
    print(trx.Launcher(hostnames=hostnames, workers_per_host=args.workers or "auto").dry_run())
    result = trx.launch(
        allreduce, hostnames=hostnames, workers_per_host=args.workers or "auto", backend="auto"
    )
    for pod, ranks in result.results.items():
        seen = [r["rank"] for r in ranks]
        print(f"pod {pod}: ranks {seen}, each saw a world of {ranks[0]['world']}")


if __name__ == "__main__":
    main()
