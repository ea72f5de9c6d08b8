"""Agents and workers in a pyxis container: ``Launcher(container="--container-image=...")``.

pyxis (NVIDIA's SPANK plugin) adds ``--container-image`` and the other ``--container-*``
options to ``srun``; with them a step's task runs in an enroot container made from the image.
Real pyxis 0.24 and enroot 4.1, built from their sources by ``scripts/build_pyxis.sh`` (Debian
packages neither) and loaded by the SLURM test cluster (``slurm_cluster.PYXIS``). Where they
are not built, these tests skip and say why: they are not counted as passed.

The image is a squashfs file made here (``mksquashfs``) of an empty root with a merged-``/usr``
layout and a marker file; ``--container-mounts`` brings in the host's ``/usr`` and ``/etc``, the
Python that the launcher's virtual environment uses, and that environment at ``/opt/venv``.
The launcher runs in the batch step on ``snode1`` and starts ``snode2``'s agent as an ``srun``
step with those options; the code and torchrunx are shipped (``ship=(".",)``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import pyxis_unavailable_reason

import torchrunx as trx

pytestmark = pytest.mark.slurm

MARKER = "torchrunx-test-image"
"""A file at the image's root, and nowhere else."""


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A squashfs image: an empty root with a merged-/usr layout and :data:`MARKER`."""
    reason = pyxis_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("pyxis-root")
    for folder in ("usr", "etc", "tmp", "root", "proc", "sys", "dev", "run", "opt", "var"):
        (root / folder).mkdir()
    for link in ("bin", "lib", "lib64", "sbin"):
        (root / link).symlink_to(f"usr/{link}")
    (root / MARKER).write_text("made by tests/test_pyxis.py\n")
    squashfs = root.parent / "image.sqsh"
    subprocess.run(
        ["mksquashfs", str(root), str(squashfs), "-quiet", "-noappend", "-all-root"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return squashfs


def _mounts() -> str:
    python_home = Path(os.path.realpath(sys.executable)).parent.parent  # the base interpreter
    pairs = [("/usr", "/usr"), ("/etc", "/etc"), (python_home, python_home)]
    pairs.append((sys.prefix, "/opt/venv"))
    return ",".join(f"{src}:{dst}:ro" for src, dst in pairs)


INSIDE = """
import os, socket, sys

import torch.distributed as dist

import torchrunx


def inside():
    return {
        "rank": dist.get_rank(),
        "host": socket.gethostname(),
        "executable": sys.executable,
        "image": os.path.exists("/torchrunx-test-image"),
        "cwd": os.getcwd(),
        "torchrunx": torchrunx.__file__,
        "pid": os.getpid(),
    }
"""

LAUNCH = """
import json, os, sys
sys.path.insert(0, {project!r})
import torchrunx as trx
import seen

os.chdir({project!r})
try:
    result = trx.launch(
        seen.inside, hostnames=["snode2"], workers_per_host=2, backend="gloo",
        agent_start="srun", container={container!r}, python="/opt/venv/bin/python",
        ship=(".",), start_timeout=120,
    )
except trx.AgentFailedError as exc:
    print("FAILED", json.dumps(str(exc)), flush=True)
else:
    print("RESULT", json.dumps(result.ranks), flush=True)
"""


def _launch(slurm, tmp_path: Path, container: str) -> tuple[str, object]:
    project = tmp_path / "project"
    project.mkdir()
    (project / "seen.py").write_text(INSIDE)
    script = tmp_path / "launch.py"
    script.write_text(LAUNCH.format(project=str(project), container=container))
    job = slurm.sbatch(f"{sys.executable} {script}\n", nodes=2, timeout=180)
    assert job.exit_code == 0, (job.stdout, job.stderr)
    for line in job.stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in ("RESULT", "FAILED"):
            return kind, json.loads(rest)
    pytest.fail(f"no result from the job:\n{job.stdout}\n{job.stderr}")


def test_agent_and_workers_run_in_a_pyxis_container(slurm, image, tmp_path):
    # pyxis's root is read-only unless --container-writable: the shipped code's cache is in it.
    container = f"--container-image={image} --container-mounts={_mounts()} --container-writable"
    kind, ranks = _launch(slurm, tmp_path, container)
    assert kind == "RESULT", ranks
    assert isinstance(ranks, list)
    assert [seen["rank"] for seen in ranks] == [0, 1]
    for seen in ranks:
        assert seen["host"] == "snode2"
        assert seen["image"] is True  # the image's root, not the host's
        assert seen["executable"] == "/opt/venv/bin/python"
        assert "/torchrunx/code/trees/" in seen["cwd"]
        assert str(seen["torchrunx"]).startswith(seen["cwd"])
    assert not Path(f"/{MARKER}").exists()  # (the host's root has no marker)
    # Nothing of the launch is left: no worker, and pyxis removed its step's container.
    for seen in ranks:
        assert not Path(f"/proc/{seen['pid']}").exists()
    data = slurm.workdir / "enroot" / "data"
    deadline = time.monotonic() + 10
    while list(data.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(data.iterdir()) == []


def test_a_read_only_container_says_where_the_cache_can_go(slurm, image, tmp_path):
    kind, message = _launch(
        slurm, tmp_path, f"--container-image={image} --container-mounts={_mounts()}"
    )
    assert kind == "FAILED"
    assert "cannot unpack the shipped code in /root/.cache/torchrunx/code" in str(message)
    assert "Read-only file system" in str(message)
    assert "TORCHRUNX_CACHE_DIR" in str(message)
    assert "--container-writable" in str(message)


def test_a_missing_image_fails_the_host_at_once_with_pyxis_message(slurm, image, tmp_path):
    missing = image.parent / "no-such-image.sqsh"
    started = time.monotonic()
    kind, message = _launch(slurm, tmp_path, f"--container-image={missing}")
    assert kind == "FAILED"
    assert "pyxis: failed to create container filesystem" in str(message), message
    assert time.monotonic() - started < 60  # pyxis's error, not the 120 s start timeout


def test_pyxis_options_are_refused_for_ssh_hosts():
    with pytest.raises(ValueError, match=r"options of srun \(pyxis's --container-image\)"):
        trx.launch(
            print,
            hostnames=["node-a"],
            agent_start="ssh",
            container="--container-image=ubuntu.sqsh",
        )
