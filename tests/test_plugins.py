"""Plugin points: torchrunx's own providers, and a plugin package installed as a user would."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx import plugins
from torchrunx.launcher.settings.resolve import HostSlots, resolve_hosts

PLUGIN = Path(__file__).resolve().parent.parent / "examples" / "plugin_package"


def test_builtin_providers_are_registered_as_entry_points():
    assert {"slurm", "hostfile", "pbs", "lsf"} <= set(plugins.host_provider_names())
    assert {"local_cpu", "gpu_x8"} <= set(plugins.preset_names())
    assert {"allreduce", "hello"} <= set(plugins.function_names())


def test_imports_go_one_way():
    """hostlists <- plugins <- hosts; agents import hosts without reading entry points."""
    code = (
        "import sys\n"
        "metadata_before = 'importlib.metadata' in sys.modules\n"
        "import torchrunx.plugins\n"
        "assert 'torchrunx.hosts.hostlists' in sys.modules\n"
        "assert 'torchrunx.launcher.settings.resolve' not in sys.modules\n"
        "import torchrunx.launcher.settings.resolve\n"
        "assert metadata_before or 'importlib.metadata' not in sys.modules\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert ran.returncode == 0, ran.stderr


def test_pbs_provider(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("cn1\ncn1\ncn2\ncn1\n")
    env = {"PBS_JOBID": "77.server", "PBS_NODEFILE": str(nodefile)}
    assert resolve_hosts("pbs", "auto", env) == [HostSlots("cn1", 3), HostSlots("cn2", 1)]
    assert resolve_hosts("auto", "auto", env) == [HostSlots("cn1", 3), HostSlots("cn2", 1)]
    assert resolve_hosts("pbs", 2, env) == [HostSlots("cn1", 2), HostSlots("cn2", 2)]
    with pytest.raises(RuntimeError, match="PBS_NODEFILE is not set"):
        resolve_hosts("pbs", "auto", {})


def test_lsf_provider():
    env = {"LSB_JOBID": "5", "LSB_MCPU_HOSTS": "hostA 4 hostB 2"}
    assert resolve_hosts("lsf", "auto", env) == [HostSlots("hostA", 4), HostSlots("hostB", 2)]
    assert resolve_hosts(["lsf"], "auto", env) == resolve_hosts("lsf", "auto", env)
    with pytest.raises(ValueError, match="expected 'host slots' pairs"):
        resolve_hosts("lsf", "auto", {"LSB_MCPU_HOSTS": "hostA four"})


def test_hostfile_provider_with_argument(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\n")
    assert resolve_hosts(f"hostfile:{hostfile}", "auto", {}) == [HostSlots("n1", 2)]
    assert resolve_hosts("hostfile", "auto", {"TORCHRUNX_HOSTFILE": str(hostfile)}) == [
        HostSlots("n1", 2)
    ]


def test_unknown_preset_and_function_are_named():
    with pytest.raises(ValueError, match=r"no preset named 'nope'.*known: .*local_cpu"):
        trx.Launcher.from_preset("nope")
    with pytest.raises(ValueError, match="no function named 'nope'"):
        plugins.registered_function("nope")
    with pytest.raises(TypeError, match=r"unknown fields \['workers'\]"):
        trx.Launcher.from_preset("local_cpu", workers=2)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def plugin_installed(tmp_path_factory):
    """The example plugin package, installed the way a user would, removed afterwards.

    Built from a copy, so that the build leaves nothing in the checkout.
    """
    source = tmp_path_factory.mktemp("plugin") / "plugin_package"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    _pip("install", "--no-deps", "--no-build-isolation", "--no-cache-dir", str(source))
    yield
    _pip("uninstall", "-y", "trx-example-plugin")


def _torchrunx(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchrunx", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def test_plugin_package_registers_each_group(plugin_installed, tmp_path, monkeypatch):
    listing = _torchrunx("builtins", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"rank_sum +Sum rank \+ OFFSET over every worker", listing.stdout)
    assert re.search(
        r"two_local_workers +hostnames=\['localhost'\], workers_per_host=2, backend='gloo'",
        listing.stdout,
    )
    assert "  envhosts" in listing.stdout
    # A preset, from Python; overrides win.
    launcher = trx.Launcher.from_preset("two_local_workers", timeout=30)
    assert (launcher.workers_per_host, launcher.backend, launcher.timeout) == (2, "gloo", 30)
    assert launcher.run(plugins.registered_function("rank_sum"), "10").ranks == [21, 21]
    # A host provider by name, and through "auto" when its environment is detected.
    assert resolve_hosts("envhosts:localhost=3", "auto", {}) == [HostSlots("localhost", 3)]
    monkeypatch.setenv("TRX_HOSTS", "localhost=1")
    result = trx.launch(plugins.registered_function("hello"), hostnames="auto", backend=None)
    assert result.hostnames == ("localhost",) and len(result.ranks) == 1
    # The command: a registered function with a preset, its argument after --.
    ran = _torchrunx("run", "rank_sum", "--preset", "two_local_workers", "--", "5", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.strip().splitlines()[-1]) == 5 + 6


def test_run_needs_the_arguments_after_the_separator(tmp_path):
    ran = _torchrunx("run", "hello", "world", "--hostnames", "localhost", cwd=tmp_path)
    assert ran.returncode == 2
    assert "the function's arguments go after `--`" in ran.stderr
    ran = _torchrunx(
        "run",
        "hello",
        "--hostnames",
        "localhost",
        "--workers-per-host",
        "1",
        "--backend",
        "None",
        "--",
        "world",
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.strip().splitlines()[-1]).endswith(" world")


SCRIPT = """
import torch.distributed as dist
dist.init_process_group("gloo")  # a torchrun script sets up its own group
print("script rank", dist.get_rank(), "of", dist.get_world_size())
dist.barrier()  # else a rank may tear its group down while gloo still connects the other's
dist.destroy_process_group()
"""


def test_a_preset_does_not_give_a_script_a_process_group(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    ran = _torchrunx(
        "--preset", "local_cpu", "--workers-per-host", "2", "--", str(script), cwd=tmp_path
    )
    assert ran.returncode == 0, ran.stderr
    assert "script rank 0 of 2" in ran.stdout


def test_entry_points_are_read_again_after_an_install(tmp_path, monkeypatch):
    """Entry points are cached per process, but a distribution installed later is seen."""
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "late_preset" not in plugins.preset_names()  # read, with the folder on the path
    time.sleep(0.05)  # file times tick with the kernel's coarse clock (a few ms)
    # Installed into a folder already on the path: only that folder's modification time tells.
    dist = tmp_path / "late_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: late-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[torchrunx.presets]\nlate_preset = torchrunx.plugins:LOCAL_CPU\n"
    )
    assert "late_preset" in plugins.preset_names()
    time.sleep(0.05)  # file times tick with the kernel's coarse clock (a few ms)
    shutil.rmtree(dist)  # uninstalled: the folder's modification time changes again
    assert "late_preset" not in plugins.preset_names()
