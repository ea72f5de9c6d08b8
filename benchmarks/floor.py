"""The floor: a bare Python that joins a process group (if any) and records its start, then exits.

``python floor.py RANK PORT [WORLD_SIZE [ADDRESS [BACKEND]]]``, run in the measurement's scratch
directory. Each process writes ``start-<rank>`` once it has joined the group, as a launched
function would when it begins. Defaults: a 2-rank gloo group at ``127.0.0.1`` (the local floor,
two processes started together by ``harness.run_floor``). ``ssh_floor.py`` starts one per test
host over SSH, with the first host's address; with ``BACKEND`` ``none`` the process does not
import torch at all, like a ``backend=None`` launch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import workloads


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    world_size = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    address = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
    backend = sys.argv[5] if len(sys.argv) > 5 else "gloo"
    os.environ["RANK"] = str(rank)
    if backend == "none":
        workloads.started(str(Path.cwd()))
        os._exit(0)
    import torch.distributed as dist  # noqa: PLC0415 (only where there is a group)

    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
    )
    workloads.started(str(Path.cwd()))
    dist.destroy_process_group()
    os._exit(0)  # skip torch's interpreter teardown, as the launchers' workers do


if __name__ == "__main__":
    main()
