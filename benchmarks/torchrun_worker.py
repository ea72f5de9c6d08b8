"""One rank under ``torchrun``: join the process group if asked, then run a workload.

``python -m torch.distributed.run --standalone --nproc-per-node N torchrun_worker.py SPEC_JSON``,
with the run's scratch directory as the working directory (see ``run.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import workloads


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["backend"] is not None:
        import torch  # noqa: PLC0415 (a backend=None run never imports torch)
        import torch.distributed as dist  # noqa: PLC0415

        if spec["backend"] == "nccl":  # what a torchrun script does, as torchrunx does for us
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(spec["backend"])
    getattr(workloads, spec["workload"])(str(Path.cwd()), *spec["args"])
    if spec["backend"] is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
