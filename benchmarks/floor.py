"""The floor: a bare Python that imports torch and joins a 2-rank gloo group, then exits.

``python floor.py RANK PORT`` for ranks 0 and 1, started together by ``run.py`` in the run's
scratch directory; each writes ``start-<rank>`` once the group is joined.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist
import workloads


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    os.environ["RANK"] = str(rank)
    workloads.started(str(Path.cwd()))
    dist.destroy_process_group()
    os._exit(0)  # skip torch's interpreter teardown, as the launchers' workers do


if __name__ == "__main__":
    main()
