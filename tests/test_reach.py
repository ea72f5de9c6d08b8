"""Hosts that do not share the launcher's files: ``Launcher(python=...)`` and ``ship=``.

The isolated test hosts (``start_cluster(..., isolated=True)``) run their ``sshd`` in a mount
namespace where the project's checkout is an empty folder and ``~/.cache`` is their own: the
launcher's script, its project and torchrunx itself are not there; the launcher's virtual
environment is, at another path (``cluster.HOST_VENV``), with torch but without torchrunx (its
editable install points into the hidden checkout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path
from threading import Thread
from typing import TYPE_CHECKING

import pytest
from cluster import CHECKOUT, HOST_VENV
from conftest import session_pids

import torchrunx as trx

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from cluster import TestCluster

pytestmark = pytest.mark.cluster

HOST_PYTHON = str(HOST_VENV / "bin" / "python")


def _where() -> dict[str, str]:
    return {
        "host": socket.gethostname(),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "torchrunx": trx.__file__,
        "cwd": os.getcwd(),
    }


def test_python_names_each_hosts_own_interpreter(cluster, tmp_path):
    other = tmp_path / "other-venv"
    other.symlink_to(sys.prefix)  # the same packages, at a path the launcher does not run
    launcher = trx.Launcher(
        hostnames=cluster.names(),
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
        python={cluster.names()[1]: str(other / "bin" / "python")},
    )
    result = launcher.run(_where)
    first, second = result.ranks
    assert first["executable"] == sys.executable
    assert second["executable"] == str(other / "bin" / "python")
    assert second["prefix"] == str(other)
    # The project's torchrunx (an editable checkout) comes first, before the host's own path.
    assert second["torchrunx"] == trx.__file__
    assert second["cwd"] == os.getcwd()
    # Per provider: "@ssh" gives every SSH host that interpreter; a host's own entry wins.
    per_provider = {"@ssh": str(other / "bin" / "python"), cluster.names()[0]: sys.executable}
    result = dataclasses.replace(launcher, python=per_provider).run(_where)
    assert [r["executable"] for r in result.ranks] == [
        sys.executable,
        str(other / "bin" / "python"),
    ]


def test_a_missing_interpreter_fails_its_host_at_once_naming_the_option(cluster):
    started = time.monotonic()
    with pytest.raises(trx.AgentFailedError) as info:
        trx.launch(
            _where,
            hostnames=cluster.names(),
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
            python="/opt/no-such-python/bin/python3",
            start_timeout=60,
        )
    text = str(info.value)
    assert "no Python interpreter /opt/no-such-python/bin/python3 on this host" in text, text
    assert "Launcher(python=...)" in text, text
    assert "exit status 127" in text, text
    # It says which interpreter ran (python= was given), not "unless python= names one".
    assert (
        "it ran /opt/no-such-python/bin/python3, the interpreter Launcher(python=...) names for "
        "it: check that path on that host"
    ) in text, text
    assert "unless Launcher(python=...)" not in text, text
    assert time.monotonic() - started < 20


def test_python_names_only_hosts_of_the_launch(cluster):
    with pytest.raises(
        ValueError, match=r"python names hosts that are not in the launch: \['nod3'\]"
    ):
        trx.launch(
            _where,
            hostnames=cluster.names(),
            backend=None,
            ssh_config_file=cluster.ssh_config,
            python={"nod3": "/usr/bin/python3"},
        )


def _project_dir(isolated: TestCluster, tmp_path: Path) -> Path:
    """A folder for a test's project that the isolated hosts do not see."""
    return isolated.launcher_only / tmp_path.name


def _make_project(root: Path) -> None:
    (root / "mypkg").mkdir(parents=True)
    (root / "mypkg" / "__init__.py").write_text(
        textwrap.dedent(
            """
            import os, socket, sys

            import torchrunx


            def report(extra, checkout):
                import torch.distributed as dist

                return {
                    "host": socket.gethostname(),
                    "rank": dist.get_rank(),
                    "world": dist.get_world_size(),
                    "cwd": os.getcwd(),
                    "module": __file__,
                    "torchrunx": torchrunx.__file__,
                    "data": open("config/settings.txt").read(),
                    "ignored": os.path.exists("scratch/notes.txt"),
                    "excluded": os.path.exists("model.ckpt"),
                    "executable": sys.executable,
                    "extra": extra,
                    "checkout": os.listdir(checkout),
                }
            """
        )
    )
    (root / "config").mkdir()
    (root / "config" / "settings.txt").write_text("lr=0.1\n")
    (root / "scratch").mkdir()
    (root / "scratch" / "notes.txt").write_text("not shipped\n")
    (root / ".gitignore").write_text("scratch/\n")
    (root / "model.ckpt").write_bytes(b"\0" * 1000)


def _open_project(
    isolated: TestCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, ModuleType]:
    """A new project (see :func:`_make_project`) as the working directory; its ``mypkg``."""
    project = _project_dir(isolated, tmp_path)
    _make_project(project)
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    monkeypatch.delitem(sys.modules, "mypkg", raising=False)  # not an earlier test's project
    return project, importlib.import_module("mypkg")


def _wire_bytes(cluster: TestCluster) -> int:
    """Bytes sent from the launcher's namespace to every host so far (their links' counters)."""
    return sum(
        int(Path(f"/sys/class/net/{host.veth}/statistics/tx_bytes").read_text())
        for host in cluster.hosts
    )


def test_shipped_code_runs_on_hosts_that_never_saw_it(isolated, tmp_path, monkeypatch):
    project, mypkg = _open_project(isolated, tmp_path, monkeypatch)
    (project / "weights.bin").write_bytes(os.urandom(4 << 20))

    launcher = trx.Launcher(
        hostnames=isolated.names(),
        workers_per_host=1,
        backend="gloo",
        ssh_config_file=isolated.ssh_config,
        python=HOST_PYTHON,
        ship=(".",),
        ship_exclude=("*.ckpt",),
    )
    before = _wire_bytes(isolated)
    first = launcher.run(mypkg.report, 1, str(CHECKOUT))
    sent_first = _wire_bytes(isolated) - before
    for rank, result in enumerate(first.ranks):
        assert result["host"] == isolated.names()[rank]
        assert result["world"] == 2
        tree = Path(result["cwd"])
        assert tree.parent == Path.home() / ".cache" / "torchrunx" / "code" / "trees"
        assert result["module"] == str(tree / "mypkg" / "__init__.py")
        assert result["torchrunx"] == str(tree / ".torchrunx-lib" / "torchrunx" / "__init__.py")
        assert result["data"] == "lr=0.1\n"
        assert result["ignored"] is False  # .gitignore
        assert result["excluded"] is False  # ship_exclude
        assert result["executable"] == HOST_PYTHON
        assert result["extra"] == 1
        assert result["checkout"] == []  # the launcher's checkout is not on the hosts
    # Each host's copy is its own, private to its user.
    for host in isolated.hosts:
        cache = isolated.cache_dir(host) / "torchrunx"
        assert (cache / "code" / "trees" / tree.name).is_dir()
        assert os.stat(cache).st_mode & 0o777 == 0o700
        assert not (cache / "code" / "trees" / tree.name / "scratch").exists()
    assert sent_first > 2 * (4 << 20)  # the 4 MiB file reached both hosts

    before = _wire_bytes(isolated)
    second = launcher.run(mypkg.report, 2, str(CHECKOUT))
    sent_second = _wire_bytes(isolated) - before
    assert [r["cwd"] for r in second.ranks] == [r["cwd"] for r in first.ranks]
    assert sent_second < sent_first / 20, (sent_first, sent_second)

    (project / "config" / "settings.txt").write_text("lr=0.2\n")  # one small file changes
    before = _wire_bytes(isolated)
    third = launcher.run(mypkg.report, 3, str(CHECKOUT))
    sent_third = _wire_bytes(isolated) - before
    assert [r["data"] for r in third.ranks] == ["lr=0.2\n", "lr=0.2\n"]
    assert third.ranks[0]["cwd"] != first.ranks[0]["cwd"]  # a new tree, from the blobs kept
    assert sent_third < sent_first / 20, (sent_first, sent_third)


def test_a_file_edited_in_a_hosts_cache_never_changes_what_the_next_launch_runs(
    isolated, tmp_path, monkeypatch
):
    # Issue #42: the cache kept a tree by its name, and a rank running as root can write its
    # read-only files (mode 0444 does not stop root). Edited between two launches, on host 0
    # only: the next launch finds it out, fetches the file again, and runs the shipped code.
    _project, mypkg = _open_project(isolated, tmp_path, monkeypatch)
    launcher = trx.Launcher(
        hostnames=isolated.names(),
        workers_per_host=1,
        backend="gloo",
        ssh_config_file=isolated.ssh_config,
        python=HOST_PYTHON,
        ship=(".",),
    )
    first = launcher.run(mypkg.report, 1, str(CHECKOUT))
    digest = Path(first.ranks[0]["cwd"]).name
    caches = [isolated.cache_dir(host) / "torchrunx" / "code" for host in isolated.hosts]
    kept = caches[0] / "trees" / digest
    shipped = {
        name: (kept / name).read_bytes() for name in ("mypkg/__init__.py", "config/settings.txt")
    }
    code = shipped["mypkg/__init__.py"].replace(b"socket.gethostname()", b"'edited'")
    assert code != shipped["mypkg/__init__.py"]
    for name, data in (("mypkg/__init__.py", code), ("config/settings.txt", b"lr=9\n")):
        with (kept / name).open("r+b") as f:  # as root: read-only files, written all the same
            f.write(data)
            f.truncate()

    before = _wire_bytes(isolated)
    second = launcher.run(mypkg.report, 2, str(CHECKOUT))
    sent = _wire_bytes(isolated) - before
    assert [r["host"] for r in second.ranks] == isolated.names()  # not "edited"
    assert [r["data"] for r in second.ranks] == ["lr=0.1\n", "lr=0.1\n"]
    assert [r["cwd"] for r in second.ranks] == [r["cwd"] for r in first.ranks]
    for name, data in shipped.items():
        assert (kept / name).read_bytes() == data  # fetched again, in a tree made again
    # Host 0's edited tree is set aside (removed after a day); host 1's was whole.
    assert len(list((caches[0] / "trees").glob(".tmp-stale-*"))) == 1
    assert list((caches[1] / "trees").glob(".tmp-stale-*")) == []
    assert sent < 200_000, sent  # the manifest and the two files, not the whole tree


def test_shipping_over_relayed_hosts(isolated, tmp_path, monkeypatch):
    """relay="on" starts the agents with OpenSSH (not paramiko): the same exchange first."""
    from test_relay import connections_back_dropped

    _project, mypkg = _open_project(isolated, tmp_path, monkeypatch)

    with connections_back_dropped(isolated):
        result = trx.launch(
            mypkg.report,
            func_args=(7, str(CHECKOUT)),
            hostnames=isolated.names(),
            workers_per_host=1,
            backend="gloo",
            ssh_config_file=isolated.ssh_config,
            python=HOST_PYTHON,
            ship=(".",),
            relay="on",
        )
    assert [r["host"] for r in result.ranks] == isolated.names()
    assert all(r["data"] == "lr=0.1\n" and r["checkout"] == [] for r in result.ranks)
    assert all(Path(r["module"]).is_relative_to(r["cwd"]) for r in result.ranks)


def test_a_cache_that_cannot_be_written_fails_the_host_at_once(isolated, tmp_path, monkeypatch):
    from conftest import torchrunx_processes

    project = _project_dir(isolated, tmp_path)
    _make_project(project)
    monkeypatch.chdir(project)
    started = time.monotonic()
    with pytest.raises(trx.AgentFailedError) as info:
        trx.launch(
            _where,
            hostnames=isolated.names()[:1],
            workers_per_host=1,
            backend=None,
            ssh_config_file=isolated.ssh_config,
            python=HOST_PYTHON,
            ship=(".",),
            extra_env_vars=("TORCHRUNX_CACHE_DIR=/proc/torchrunx-cannot-be-here",),
            start_timeout=60,
        )
    text = str(info.value)
    assert info.value.hostname == isolated.names()[0]
    assert "the shipped code did not reach the host" in text, text
    assert "cannot unpack the shipped code in /proc/torchrunx-cannot-be-here/code" in text, text
    assert time.monotonic() - started < 20
    assert not torchrunx_processes()


def test_a_module_missing_on_the_hosts_is_named_with_the_option_that_sends_it(
    isolated, tmp_path, monkeypatch
):
    project, mypkg = _open_project(isolated, tmp_path, monkeypatch)

    common = {
        "hostnames": isolated.names(),
        "workers_per_host": 1,
        "backend": None,
        "ssh_config_file": isolated.ssh_config,
        "python": HOST_PYTHON,
        "start_timeout": 60,
    }
    # Only the settings travel (and torchrunx with them): mypkg is not on the hosts.
    with pytest.raises(ModuleNotFoundError) as info:
        trx.launch(mypkg.report, func_args=(0, "/"), ship=("config",), **common)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "module 'mypkg'" in notes, notes
    hosts = "|".join(
        rf"{re.escape(name)} \(rank {rank}\)" for rank, name in enumerate(isolated.names())
    )
    assert re.search(rf"is not importable on host ({hosts})", notes), notes
    assert "Launcher(ship=('.',))" in notes, notes
    # Nothing shipped: the working directory is not there, and the agent's script says so.
    started = time.monotonic()
    with pytest.raises(trx.AgentFailedError) as failed:
        trx.launch(mypkg.report, func_args=(0, "/"), **common)
    assert f"the working directory {project} is not on this host" in str(failed.value)
    assert "Launcher(ship=('.',)) (--ship .)" in str(failed.value)
    # From a folder the hosts share, nothing shipped: torchrunx is not there.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(trx.AgentFailedError) as failed:
        trx.launch(mypkg.report, func_args=(0, "/"), **common)
    assert "torchrunx is not importable on that host" in str(failed.value)
    assert "Launcher(ship=...)" in str(failed.value)
    assert time.monotonic() - started < 30


SRUN_SHIP_SCRIPT = """
import os, sys
sys.path.insert(0, {project!r})
import torchrunx as trx
import mypkg

os.chdir({project!r})
launcher = trx.Launcher(
    agent_start="srun", workers_per_host=1, backend="gloo", ship=(".",),
    extra_env_vars=("TORCHRUNX_CACHE_DIR",),
)
for result in launcher.run(mypkg.report, 5, "/").ranks:
    print("rank", result["rank"], result["host"], result["cwd"], result["module"], flush=True)
"""


@pytest.mark.slurm
def test_code_ships_to_srun_steps(slurm, tmp_path):
    # The same exchange on each srun step's stdio; the SLURM hosts share this machine's
    # files, so the cache is the test's own folder (TORCHRUNX_CACHE_DIR, forwarded).
    project = tmp_path / "project"
    _make_project(project)
    script = tmp_path / "ship.py"
    script.write_text(SRUN_SHIP_SCRIPT.format(project=str(project)))
    result = slurm.sbatch(
        f"{sys.executable} {script}\n",
        nodes=2,
        env={"TORCHRUNX_CACHE_DIR": str(tmp_path / "cache")},
        extra_args=["--ntasks-per-node=1"],
    )
    assert result.exit_code == 0, result.stderr
    trees = tmp_path / "cache" / "code" / "trees"
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert [(line[1], line[2]) for line in lines] == [("0", "snode1"), ("1", "snode2")], result
    # snode1 runs the launcher (the batch step): its agent runs in place, as on any host
    # that is the launcher's machine; snode2's srun step runs in its copy.
    assert lines[0][3:] == [str(project), f"{project}/mypkg/__init__.py"]
    cwd, module = lines[1][3:]
    assert cwd.startswith(f"{trees}/"), cwd
    assert module == f"{cwd}/mypkg/__init__.py"


def test_check_tries_the_interpreter_and_the_shipped_code(isolated, tmp_path, monkeypatch):
    """``torchrunx check`` starts what a launch would: the named interpreter, the shipped copy."""
    from conftest import torchrunx_processes

    from torchrunx.launcher.preflight import check_hosts, format_checks

    _open_project(isolated, tmp_path, monkeypatch)
    common = {"hostnames": isolated.names(), "ssh_config_file": isolated.ssh_config}
    checks = check_hosts(trx.Launcher(**common, python=HOST_PYTHON, ship=(".",), start_timeout=60))
    text = format_checks(checks, 0.0)
    assert [check.ok for check in checks] == [True, True], text
    for check in checks:
        assert check.report is not None
        assert check.report.python == HOST_PYTHON, text
    # Without the options: each host's missing piece, named with the option. Host 2's
    # bootstrap line waits for host 0's answer, so its command has often ended by then: what
    # it said is the reason, not the closed SSH channel. A race: tried 3 times.
    said = (
        f"no Python interpreter {sys.executable} on this host: install it there, or name "
        "this host's own with Launcher(python=...) (--python PATH)"
    )
    for _ in range(3):
        checks = check_hosts(trx.Launcher(**common, start_timeout=60))
        text = format_checks(checks, 0.0)
        assert [check.ok for check in checks] == [False, False], text
        for check in checks:
            assert check.problems == (said,), text
    assert not torchrunx_processes()


def _unpackers() -> list[int]:
    """Pids of hosts' unpack steps (``python -I -S -c SOURCE CACHE DIGEST``), any host of this
    test session (not another pytest-xdist worker's)."""
    found = []
    for entry in session_pids():
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args[1:4] == [b"-I", b"-S", b"-c"] and b"/torchrunx/code" in b" ".join(args[4:]):
            found.append(int(entry))
    return found


def _when(condition: Callable[[], bool], then: Callable[[], None], done: list[float]) -> Thread:
    """A thread that runs ``then`` once ``condition`` holds (within 60 s); its time in ``done``."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if condition():
                then()
                done.append(time.monotonic())
                return
            time.sleep(0.005)

    thread = Thread(target=watch)
    thread.start()
    return thread


@pytest.mark.parametrize("fault", ["unpack killed", "link cut"])
def test_a_fault_while_code_ships_fails_the_host_and_the_next_launch_ships_it(
    isolated, tmp_path, monkeypatch, fault
):
    """SIGKILL of the host's unpack step, or its link cut, in the middle of a 256 MiB transfer.

    The launch fails that host (at once when killed; within start_timeout when cut), nothing is
    left running, and the next launch completes the tree from what reached the host.
    """
    from conftest import torchrunx_processes

    project, mypkg = _open_project(isolated, tmp_path, monkeypatch)
    (project / "weights.bin").write_bytes(os.urandom(256 << 20))
    host = isolated.hosts[0]
    counter = Path(f"/sys/class/net/{host.veth}/statistics/tx_bytes")
    start_bytes = int(counter.read_text())

    def midway() -> bool:  # 64 MiB of the 256 on the wire
        return int(counter.read_text()) - start_bytes > 64 << 20

    def kill() -> None:
        for pid in _unpackers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    faulted: list[float] = []
    then = kill if fault == "unpack killed" else lambda: isolated.cut_link(host)
    watcher = _when(midway, then, faulted)
    common = {
        "hostnames": [host.name],
        "workers_per_host": 1,
        "backend": "gloo",
        "ssh_config_file": isolated.ssh_config,
        "python": HOST_PYTHON,
        "ship": (".",),
        "agent_timeout": 2.0,
    }
    try:
        with pytest.raises(trx.AgentFailedError) as info:
            trx.launch(mypkg.report, func_args=(0, "/"), start_timeout=10, **common)
        failed_at = time.monotonic()
    finally:
        watcher.join()
        if fault == "link cut":
            isolated.restore_link(host)
    assert faulted, "the transfer ended before the fault"
    assert info.value.hostname == host.name
    text = str(info.value)
    if fault == "unpack killed":
        assert "the shipped code did not reach the host: it ended (exit status 137)" in text, text
        assert "the step that unpacks the shipped code was killed by signal 9" in text, text
        assert len(text) < 2000, text  # not the unpack step's whole source
        assert failed_at - faulted[0] < 5, text
    else:
        assert "start did not finish within start_timeout=10 s" in text or (
            "is the link to the host cut?" in text
        ), text
        assert failed_at - faulted[0] < 10 + 5, text  # start_timeout, and closing
    deadline = time.monotonic() + 10
    while (torchrunx_processes() or _unpackers()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not torchrunx_processes()
    assert not _unpackers()
    # The next launch ships what is missing and runs in a whole tree.
    (result,) = trx.launch(mypkg.report, func_args=(1, "/"), start_timeout=60, **common).ranks
    tree = isolated.cache_dir(host) / "torchrunx" / "code" / "trees" / Path(result["cwd"]).name
    assert (tree / "weights.bin").read_bytes() == (project / "weights.bin").read_bytes()
    assert result["data"] == "lr=0.1\n"
