"""Agents and workers inside a container on the host: ``Launcher(container=...)``, real runners.

Two real runners, each test run with both:

- **podman** (Debian's 4.3), daemonless, run with ``--cgroups disabled`` and limits within the
  test machine's own (the test hosts see cgroup v1 only, see ``cluster.py``);
- **docker** (Debian's ``docker.io`` 20.10): a ``dockerd`` of the test's own, started in the
  isolated host's namespaces (its own data and exec roots, no bridge, no iptables rules) and
  stopped after; the launch reaches it with ``docker -H unix://SOCKET exec -i NAME``.

The image is built here, from nothing registry-borne: an empty root (the usual folders, and the
``/bin``, ``/lib`` links of a merged-``/usr`` system) imported with ``podman import`` or
``docker import``. The container, started on an isolated SSH test host (``hnode1``, which does
not have the checkout), mounts the host's ``/usr`` and ``/etc`` read-only, the Python that the
launcher's virtual environment uses, and that environment at ``/opt/venv`` (torch, without
torchrunx): so its interpreter is ``/opt/venv/bin/python``, in the container's own mount, PID and
UTS namespaces, on the host's network (``--network host``). The code (and torchrunx) is shipped
into the container's own ``~/.cache``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import torchrunx as trx

if TYPE_CHECKING:
    from collections.abc import Iterator

    from cluster import TestCluster

pytestmark = pytest.mark.cluster

IMAGE = "localhost/torchrunx-test-base:1"


@dataclass(frozen=True)
class Runner:
    """A container runner as the test uses it, on the isolated host ``hnode1``."""

    name: str
    """``podman`` or ``docker``."""
    client: tuple[str, ...]
    """The command that talks to it (for docker: with the test daemon's socket)."""
    run_options: tuple[str, ...]
    """Options of ``run`` this machine needs."""
    marker: str
    """A file the runner puts in every container."""

    def on_host(self, cluster: TestCluster, *args: str) -> list[str]:
        """An argv that runs this runner's client with ``args`` in hnode1's namespaces."""
        return [*cluster.enter_argv(cluster.hosts[0]), *self.client, *args]


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=120)


@contextlib.contextmanager
def _dockerd(cluster: TestCluster) -> Iterator[Runner]:
    """A docker daemon of the test's own in hnode1's namespaces, stopped (and waited for) after."""
    if shutil.which("dockerd") is None:
        pytest.fail("dockerd is needed (scripts/test.sh installs docker.io)")
    # Short paths: containerd's sockets live under the exec root (108 bytes at most).
    state = Path(tempfile.mkdtemp(prefix="trxd-", dir="/tmp"))
    socket = state / "d.sock"
    argv = [
        *cluster.enter_argv(cluster.hosts[0]), "dockerd",
        "--data-root", str(state / "data"), "--exec-root", str(state / "x"),
        "--pidfile", str(state / "d.pid"), "-H", f"unix://{socket}",
        "--bridge=none", "--iptables=false", "--ip6tables=false", "--storage-driver=vfs",
    ]  # fmt: skip
    log = (state / "dockerd.log").open("wb")
    daemon = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    runner = Runner("docker", ("docker", "-H", f"unix://{socket}"), (), "/.dockerenv")
    try:
        deadline = time.monotonic() + 60
        while _run(runner.on_host(cluster, "info"), check=False).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"dockerd did not start:\n{(state / 'dockerd.log').read_text()}")
            time.sleep(0.2)
        yield runner
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=30)
        log.close()
        # The vfs layers hold read-only folders; the daemon is gone, so nothing else needs them.
        _run(["rm", "-rf", str(state)], check=False)


@pytest.fixture(scope="module", params=["podman", "docker"])
def runner(request: pytest.FixtureRequest, isolated_module: TestCluster) -> Iterator[Runner]:
    """Each runner in turn, ready on hnode1."""
    if request.param == "podman":
        if shutil.which("podman") is None:
            pytest.fail("podman is needed (scripts/test.sh installs it)")
        options = ("--cgroups", "disabled", "--ulimit", "nofile=4096:4096")
        yield Runner(
            "podman", ("podman",), (*options, "--ulimit", "nproc=4096:4096"), "/run/.containerenv"
        )
        return
    with _dockerd(isolated_module) as docker:
        yield docker


@pytest.fixture(scope="module")
def image(
    runner: Runner, isolated_module: TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A base image made here: an empty root with a merged-/usr layout."""
    root = tmp_path_factory.mktemp("image-root")
    for folder in ("usr", "etc", "tmp", "root", "proc", "sys", "dev", "run", "opt", "work"):
        (root / folder).mkdir()
    for link in ("bin", "lib", "lib64", "sbin"):
        (root / link).symlink_to(f"usr/{link}")
    archive = root.parent / f"image-{runner.name}.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=".")
    _run(runner.on_host(isolated_module, "import", str(archive), IMAGE))
    yield IMAGE
    _run(runner.on_host(isolated_module, "rmi", "-f", IMAGE), check=False)


@pytest.fixture
def container(runner: Runner, isolated_module: TestCluster, image: str) -> Iterator[str]:
    """A running container on hnode1, on its network, with its interpreter at /opt/venv."""
    name = f"torchrunx-test-{runner.name}-{isolated_module.names()[0]}"
    python_home = Path(os.path.realpath(sys.executable)).parent.parent  # the base interpreter
    run = runner.on_host(
        isolated_module,
        "run", "-d", "--name", name, "--network", "host", *runner.run_options,
        "-v", "/usr:/usr:ro", "-v", "/etc:/etc:ro",
        "-v", f"{python_home}:{python_home}:ro", "-v", "/mnt/venv:/opt/venv:ro",
        image, "/usr/bin/sleep", "infinity",
    )  # fmt: skip
    _run(run)
    try:
        yield name
    finally:
        _run(runner.on_host(isolated_module, "rm", "-f", name), check=False)


INSIDE = """
import os, socket, sys

import torch.distributed as dist

import torchrunx


def inside(marker):
    with open("/proc/1/cmdline", "rb") as f:
        first = f.read().replace(b"\\0", b" ").decode().strip()
    return {
        "rank": dist.get_rank(),
        "host": socket.gethostname(),
        "executable": sys.executable,
        "container": os.path.exists(marker),
        "pid1": first,
        "cwd": os.getcwd(),
        "torchrunx": torchrunx.__file__,
    }
"""
"""The project's module (the hosts do not have the tests): what a rank sees."""


def test_agent_and_workers_run_in_the_container_with_its_interpreter(
    isolated_module, runner, container, tmp_path, monkeypatch
):
    project = isolated_module.launcher_only / f"{tmp_path.name}-{runner.name}"
    project.mkdir(parents=True)
    (project / f"seen_{runner.name}.py").write_text(INSIDE)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    project_module = __import__(f"seen_{runner.name}")

    result = trx.launch(
        project_module.inside,
        func_args=(runner.marker,),
        hostnames=isolated_module.names()[:1],
        workers_per_host=2,
        backend="gloo",
        ssh_config_file=isolated_module.ssh_config,
        container=" ".join([*runner.client, "exec", "-i", container]),
        python="/opt/venv/bin/python",
        ship=(".",),
    )
    for rank, seen in enumerate(result.ranks):
        assert seen["rank"] == rank
        assert seen["container"] is True  # the runner's marker file
        assert seen["pid1"] == "/usr/bin/sleep infinity"  # the container's own PID namespace
        assert seen["executable"] == "/opt/venv/bin/python"
        assert str(seen["cwd"]).startswith("/root/.cache/torchrunx/code/trees/")
        assert str(seen["torchrunx"]).startswith(str(seen["cwd"]))
    # The copy is in the container's own home, not the host's.
    tree = Path(str(result.ranks[0]["cwd"])).name
    assert not list(
        isolated_module.cache_dir(isolated_module.hosts[0]).glob(f"torchrunx/code/trees/{tree}")
    )
    # Nothing of the launch stays in the container.
    left = _run(runner.on_host(isolated_module, "exec", container, "/usr/bin/ps", "-eo", "args"))
    lines = left.stdout.splitlines()
    assert [line for line in lines[1:] if "ps -eo" not in line] == ["/usr/bin/sleep infinity"]


def test_a_container_that_is_not_running_fails_the_host_at_once(isolated_module, runner, image):
    del image
    started = time.monotonic()
    with pytest.raises(trx.AgentFailedError) as info:
        trx.launch(
            print,
            hostnames=isolated_module.names()[:1],
            workers_per_host=1,
            backend=None,
            ssh_config_file=isolated_module.ssh_config,
            container=" ".join([*runner.client, "exec", "-i", "torchrunx-no-such-container"]),
            start_timeout=60,
        )
    assert "no such container" in str(info.value).lower(), str(info.value)
    assert time.monotonic() - started < 30  # the runner's error, not the start timeout


def test_container_is_refused_for_this_machines_agents():
    with pytest.raises(ValueError, match="container runs remote hosts' agents in a container"):
        trx.launch(print, hostnames=["localhost"], container="podman exec -i x")


def test_check_runs_its_probe_in_the_container(
    isolated_module, runner, container, tmp_path, monkeypatch
):
    from torchrunx.launcher.preflight import check_hosts, format_checks

    project = isolated_module.launcher_only / f"{tmp_path.name}-{runner.name}"
    project.mkdir(parents=True)
    monkeypatch.chdir(project)
    launcher = trx.Launcher(
        hostnames=isolated_module.names()[:1],
        ssh_config_file=isolated_module.ssh_config,
        container=" ".join([*runner.client, "exec", "-i", container]),
        python="/opt/venv/bin/python",
        ship=(".",),
        start_timeout=60,
    )
    (check,) = check_hosts(launcher)
    assert check.ok, format_checks([check], 0.0)
    assert check.report is not None
    assert check.report.python == "/opt/venv/bin/python"  # the container's interpreter
