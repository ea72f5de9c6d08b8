"""Agents and workers inside a container on the host: ``Launcher(container=...)``, real podman.

The image is built here, from nothing registry-borne: an empty root (the usual folders, and the
``/bin``, ``/lib`` links of a merged-``/usr`` system) imported with ``podman import``. The
container, started on an isolated SSH test host (``hnode1``, which does not have the checkout),
mounts the host's ``/usr`` and ``/etc`` read-only, the Python that the launcher's virtual
environment uses, and that environment at ``/opt/venv`` (torch, without torchrunx): so its
interpreter is ``/opt/venv/bin/python``, in the container's own mount, PID and UTS namespaces,
on the host's network (``--network host``). The code (and torchrunx) is shipped into the
container's own ``~/.cache``.

podman 4.3 (Debian's) runs here with ``--cgroups disabled`` and limits within the test
machine's own (the test hosts see cgroup v1 only, see ``cluster.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import torchrunx as trx

if TYPE_CHECKING:
    from collections.abc import Iterator

    from cluster import TestCluster

pytestmark = pytest.mark.cluster

IMAGE = "localhost/torchrunx-test-base:1"


def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, check=check, timeout=120
    )


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A base image made here: an empty root with a merged-/usr layout."""
    if shutil.which("podman") is None:
        pytest.fail("podman is needed (scripts/test.sh installs it)")
    root = tmp_path_factory.mktemp("image-root")
    for folder in ("usr", "etc", "tmp", "root", "proc", "sys", "dev", "run", "opt", "work"):
        (root / folder).mkdir()
    for link in ("bin", "lib", "lib64", "sbin"):
        (root / link).symlink_to(f"usr/{link}")
    archive = root.parent / "image.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=".")
    _podman("import", "-q", str(archive), IMAGE)
    yield IMAGE
    _podman("rmi", "-f", IMAGE, check=False)


@pytest.fixture
def container(isolated: TestCluster, image: str) -> Iterator[str]:
    """A running container on hnode1, on its network, with its interpreter at /opt/venv."""
    name = "torchrunx-test-hnode1"
    python_home = Path(os.path.realpath(sys.executable)).parent.parent  # the base interpreter
    run = [
        *isolated.enter_argv("hnode1"),
        "podman", "run", "-d", "--name", name, "--network", "host", "--cgroups", "disabled",
        "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
        "-v", "/usr:/usr:ro", "-v", "/etc:/etc:ro",
        "-v", f"{python_home}:{python_home}:ro", "-v", "/mnt/venv:/opt/venv:ro",
        image, "/usr/bin/sleep", "infinity",
    ]  # fmt: skip
    subprocess.run(run, capture_output=True, text=True, check=True, timeout=120)
    try:
        yield name
    finally:
        subprocess.run(
            [*isolated.enter_argv("hnode1"), "podman", "rm", "-f", "-t", "0", name],
            capture_output=True,
            check=False,
            timeout=120,
        )


INSIDE = """
import os, socket, sys

import torch.distributed as dist

import torchrunx


def inside():
    with open("/proc/1/cmdline", "rb") as f:
        first = f.read().replace(b"\\0", b" ").decode().strip()
    return {
        "rank": dist.get_rank(),
        "host": socket.gethostname(),
        "executable": sys.executable,
        "container": os.path.exists("/run/.containerenv"),
        "pid1": first,
        "cwd": os.getcwd(),
        "torchrunx": torchrunx.__file__,
    }
"""
"""The project's module (the hosts do not have the tests): what a rank sees."""


def test_agent_and_workers_run_in_the_container_with_its_interpreter(
    isolated, container, tmp_path, monkeypatch
):
    project = isolated.launcher_only / tmp_path.name
    project.mkdir(parents=True)
    (project / "seen.py").write_text(INSIDE)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    import seen as project_module

    result = trx.launch(
        project_module.inside,
        hostnames=["hnode1"],
        workers_per_host=2,
        backend="gloo",
        ssh_config_file=isolated.ssh_config,
        container=f"podman exec -i {container}",
        python="/opt/venv/bin/python",
        ship=(".",),
    )
    for rank, seen in enumerate(result.ranks):
        assert seen["rank"] == rank
        assert seen["container"] is True  # podman's marker file
        assert seen["pid1"] == "/usr/bin/sleep infinity"  # the container's own PID namespace
        assert seen["executable"] == "/opt/venv/bin/python"
        assert str(seen["cwd"]).startswith("/root/.cache/torchrunx/code/trees/")
        assert str(seen["torchrunx"]).startswith(str(seen["cwd"]))
    # The copy is in the container's own home, not the host's.
    tree = Path(str(result.ranks[0]["cwd"])).name
    assert not list(isolated.cache_dir("hnode1").glob(f"torchrunx/code/trees/{tree}"))
    # Nothing of the launch stays in the container.
    left = subprocess.run(
        [*isolated.enter_argv("hnode1"), "podman", "exec", container, "/usr/bin/ps", "-eo", "args"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    assert [line for line in left[1:] if "ps -eo" not in line] == ["/usr/bin/sleep infinity"]


def test_a_container_that_is_not_running_fails_the_host_at_once(isolated, image, tmp_path):
    del image
    with pytest.raises(trx.AgentFailedError) as info:
        trx.launch(
            print,
            hostnames=["hnode1"],
            workers_per_host=1,
            backend=None,
            ssh_config_file=isolated.ssh_config,
            container="podman exec -i torchrunx-no-such-container",
            start_timeout=60,
        )
    assert "no such container" in str(info.value).lower(), str(info.value)


def test_container_is_refused_for_this_machines_agents():
    with pytest.raises(ValueError, match="container runs remote hosts' agents in a container"):
        trx.launch(print, hostnames=["localhost"], container="podman exec -i x")
