"""Drop-in for the original torchrunx 0.4: its field names, values, log folders and environment.

Scripts written for 0.4 (apoorvkh/torchrunx) must run unchanged where they can, and be told what
to write where they cannot. These tests are our own; the original's tests are not copied here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import re
import socket
from importlib import metadata
from pathlib import Path

import pytest
import tyro

import torchrunx as trx
from torchrunx.devices import count_slots
from torchrunx.env import (
    DEFAULT_ENV_VARS,
    exported_env,
    local_agent_env,
    split_extra_env_vars,
)
from torchrunx.launcher.settings.plan import agent_timings
from torchrunx.launcher.settings.resolve import HostSlots, resolve_hosts
from torchrunx.launcher.view import logdirs
from torchrunx.wire.bootstrap import AgentBootstrap

REPO = Path(__file__).resolve().parent.parent


# -- version -----------------------------------------------------------------------------------


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_version_is_the_successor_of_0_4():
    assert _release(trx.__version__) >= (0, 5, 0)
    # The distribution's version is what pip compares with "torchrunx>=0.4".
    assert metadata.version("torchrunx") == trx.__version__
    pyproject = (REPO / "pyproject.toml").read_text()  # one version, kept in torchrunx
    assert re.search(r'(?m)^dynamic = \["version"\]', pyproject)
    assert re.search(r'(?m)^version = \{ attr = "torchrunx.__version__" \}', pyproject)


# -- the log folder ----------------------------------------------------------------------------


class FrozenClock:
    """``datetime.now`` that always says the same time, as two launches in one microsecond."""

    def __init__(self) -> None:
        self.now = dt.datetime(2026, 11, 23, 12, 2, 55, 630355)  # noqa: DTZ001 (naive, as the names)

    def __call__(self) -> dt.datetime:
        return self.now


def test_log_folders_are_named_by_naive_local_time_and_never_shared(tmp_path):
    clock = FrozenClock()
    folders = [logdirs.new_log_dir(tmp_path / "logs", now=clock) for _ in range(3)]
    assert [f.name for f in folders] == [
        "2026-11-23T12:02:55",  # as torchrunx 0.4: isoformat(timespec="seconds")
        "2026-11-23T12:02:55.630355",  # the same second: with microseconds
        "2026-11-23T12:02:55.630355-1",  # the same microsecond too
    ]
    assert dt.datetime.fromisoformat(folders[0].name) == clock.now.replace(microsecond=0)
    assert dt.datetime.fromisoformat(folders[1].name) == clock.now
    assert sorted(folders) == folders
    for folder in folders:
        assert folder.stat().st_mode & 0o777 == 0o700
    # With a real clock, the second folder of a second is read anew: fromisoformat reads it.
    again = logdirs.new_log_dir(tmp_path / "real")
    second = logdirs.new_log_dir(tmp_path / "real")
    for folder in (again, second):
        assert dt.datetime.fromisoformat(folder.name).tzinfo is None
    assert logdirs.events_file(again) == again.parent / f"{again.name}.events.jsonl"


def report_environment() -> dict[str, object]:
    """What a worker sees of the variables the tests below set in the launcher."""
    names = ("TRX_SHELL_ONLY", "TRX_GIVEN", "TRX_PATTERN_VAR", "TORCHELASTIC_RUN_ID")
    names += ("TORCHELASTIC_USE_AGENT_STORE",)
    report: dict[str, object] = {name: os.environ.get(name) for name in names}
    report["host"] = socket.gethostname()
    report["rank"] = os.environ["RANK"]
    given = os.environ.get("TRX_GIVEN", "").encode()
    leaks = []  # the given value on any command line of this machine (test hosts share /proc)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if given and given in cmdline:
            leaks.append(cmdline.decode(errors="replace"))
    report["leaks"] = leaks
    print(f"worker rank: {report['rank']}")
    return report


def test_launch_like_0_4_log_folder_events_beside_it_and_local_environment(log_dir, monkeypatch):
    monkeypatch.setenv("TRX_SHELL_ONLY", "hf_secret")  # like HF_TOKEN: matches no pattern
    monkeypatch.setenv("TRX_GIVEN", "the launcher's")  # extra_env_vars' value wins
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "the launcher's own")  # per process: never passed
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a torchrun agent's, not ours
    before = dt.datetime.now()  # noqa: DTZ005 (naive local time, as 0.4's test compares)
    result = trx.Launcher(
        hostnames=["localhost"],
        workers_per_host=2,
        backend=None,
        extra_env_vars={"TRX_GIVEN": "a b; $(c) 'd'"},  # torchrunx 0.4's dict of values
    ).run(report_environment)
    after = dt.datetime.now()  # noqa: DTZ005

    entries = sorted(log_dir.iterdir())
    (folder,) = [entry for entry in entries if entry.is_dir() and not entry.is_symlink()]
    stamp = dt.datetime.fromisoformat(folder.name)
    assert stamp.tzinfo is None
    assert before.replace(microsecond=0) <= stamp <= after
    # The folder holds one file per agent and per worker, nothing else.
    assert sorted(p.name for p in folder.iterdir()) == [
        "localhost.log",
        "localhost[0].log",
        "localhost[1].log",
    ]
    for rank in (0, 1):
        assert f"worker rank: {rank}\n" in (folder / f"localhost[{rank}].log").read_text()
    # The events are beside it.
    events = log_dir / f"{folder.name}.events.jsonl"
    assert entries == sorted([folder, events])  # 0.4's layout: no link, no other folder
    # 0.4's own test counts the launches by the folders os.walk finds in the root: one.
    assert len(next(os.walk(log_dir))[1]) == 1
    assert events.stat().st_mode & 0o777 == 0o600
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert kinds[0] == "LaunchStarted"
    assert kinds[-1] == "LaunchFinished"

    # Workers on the launcher's machine see its whole environment, and the given values.
    for report in result.ranks:
        assert report["TRX_SHELL_ONLY"] == "hf_secret"
        assert report["TRX_GIVEN"] == "a b; $(c) 'd'"
        assert report["TORCHELASTIC_RUN_ID"] == "torchrunx"  # its own, not the launcher's
        # Its own: host 0's agent keeps the store (torchrunx.agent.store), not the launcher's.
        assert report["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert report["leaks"] == []


def test_a_0_4_call_with_only_workers_and_backend_given(log_dir, monkeypatch):
    # 0.4's own CI launches `Launcher(workers_per_host=N, backend="gloo").run(f)`, f defined
    # inside the test, TORCHRUNX_LOG_DIR set after the import, outside any allocation: the
    # default hosts are then this machine alone, named "localhost" in results and file names.
    for name in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        monkeypatch.delenv(name, raising=False)

    def same_sum_on_every_rank():  # rank 0's weights, each rank's own input, summed
        import torch
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        weights = torch.rand(8, 8) if rank == 0 else torch.zeros(8, 8)
        dist.broadcast(weights, 0)
        product = torch.rand(4, 8) @ weights
        dist.all_reduce(product)
        print(f"worker rank: {rank}")
        return product

    before = dt.datetime.now()  # noqa: DTZ005 (naive local time, as the folder names)
    result = trx.Launcher(workers_per_host=2, backend="gloo").run(same_sum_on_every_rank)
    after = dt.datetime.now()  # noqa: DTZ005
    assert list(result.results) == ["localhost"]
    assert bool((result.rank(0) == result.rank(1)).all())
    assert float(result.rank(0).abs().sum()) > 0  # rank 0's weights reached rank 1
    # One launch, one folder among the sub-folders os.walk finds, named by its start time.
    (name,) = next(os.walk(log_dir))[1]
    assert before.replace(microsecond=0) <= dt.datetime.fromisoformat(name) <= after
    assert sorted(next(os.walk(log_dir / name))[2]) == [
        "localhost.log",
        "localhost[0].log",
        "localhost[1].log",
    ]
    for rank in (0, 1):
        assert f"worker rank: {rank}\n" in (log_dir / name / f"localhost[{rank}].log").read_text()

    def fails() -> None:
        raise ValueError("in the worker's own words")

    with pytest.raises(ValueError, match="in the worker's own words"):
        trx.Launcher(workers_per_host=1, backend="gloo").run(fails)
    assert len(next(os.walk(log_dir))[1]) == 2  # the failed launch has a folder of its own


@pytest.mark.cluster
def test_values_reach_every_host_and_only_this_machine_sees_the_whole_environment(
    cluster, monkeypatch
):
    monkeypatch.setenv("TRX_SHELL_ONLY", "hf_secret")
    monkeypatch.setenv("TRX_PATTERN_VAR", "by pattern")
    remote = cluster.names()[0]
    result = trx.launch(
        report_environment,
        hostnames=["localhost", remote],
        workers_per_host=1,
        backend=None,
        ssh_config_file=cluster.ssh_config,
        # 0.4's names and forms: a tuple built from its exported defaults, and a dict of values.
        copy_env_vars=(*trx.DEFAULT_ENV_VARS_FOR_COPY, "TRX_PATTERN_*"),
        extra_env_vars={"TRX_GIVEN": "value-given-7f3c; $(touch /tmp/pwned)"},
    )
    here, there = result.ranks
    assert there["host"] == remote
    assert here["host"] != remote
    for report in (here, there):
        assert report["TRX_GIVEN"] == "value-given-7f3c; $(touch /tmp/pwned)"
        assert report["TRX_PATTERN_VAR"] == "by pattern"
        assert report["leaks"] == []  # values travel on stdin, never on a command line
    assert here["TRX_SHELL_ONLY"] == "hf_secret"
    assert there["TRX_SHELL_ONLY"] is None  # other hosts get the patterns and values only


# -- environment fields ------------------------------------------------------------------------


def test_extra_env_vars_forms():
    assert split_extra_env_vars(None) == ((), {})
    assert split_extra_env_vars({"FOO": "bar", "EMPTY": ""}) == ((), {"FOO": "bar", "EMPTY": ""})
    assert split_extra_env_vars(("WANDB_*", "HF_HOME", "FOO=a=b c")) == (
        ("WANDB_*", "HF_HOME"),
        {"FOO": "a=b c"},
    )
    assert split_extra_env_vars(["X=1"]) == ((), {"X": "1"})
    environ = {"WANDB_KEY": "k", "FOO": "launcher", "OTHER": "o"}
    assert exported_env(("WANDB_*", "FOO"), {"FOO": "given"}, environ) == {
        "WANDB_KEY": "k",
        "FOO": "given",
    }


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ("WANDB_*", TypeError, "tuple of fnmatch patterns and NAME=VALUE entries, or a dict"),
        ({"FOO": 1}, TypeError, "names and values must be strings, got 'FOO': 1"),
        ({1: "x"}, TypeError, "names and values must be strings"),
        (["A", 2], TypeError, "tuple of fnmatch patterns"),
        ({"1X": "a"}, ValueError, "'1X' is not a variable name bash can export"),
        (("A-B=1",), ValueError, "'A-B' is not a variable name"),
        (("=1",), ValueError, "'' is not a variable name"),
        ({"RANK": "3"}, ValueError, "RANK is set by torchrunx for each worker"),
        ({"MASTER_PORT": "1"}, ValueError, "MASTER_PORT is set by torchrunx"),
        ({"X": "a\0b"}, ValueError, "the value of X contains a NUL byte"),
    ],
)
def test_bad_extra_env_vars_are_refused_before_anything_starts(extra, error, match):
    launcher = trx.Launcher(hostnames=["unreachable.invalid"], extra_env_vars=extra)
    with pytest.raises(error, match=re.escape(match)):
        launcher.run(print)


def test_copy_env_vars_is_0_4s_name_for_default_env_vars():
    environ_patterns = (*trx.DEFAULT_ENV_VARS_FOR_COPY, "HF_HOME", "WANDB_*")
    assert trx.DEFAULT_ENV_VARS_FOR_COPY == DEFAULT_ENV_VARS
    launcher = trx.Launcher(copy_env_vars=environ_patterns, extra_env_vars=None)
    launcher.validate()
    os.environ["WANDB_TRX_TEST"] = "w"
    try:
        assert launcher.exported_env()["WANDB_TRX_TEST"] == "w"
        assert "WANDB_TRX_TEST" not in trx.Launcher().exported_env()
        assert "WANDB_TRX_TEST" not in trx.Launcher(copy_env_vars=("PATH",)).exported_env()
    finally:
        del os.environ["WANDB_TRX_TEST"]
    with pytest.raises(ValueError, match="same setting: give only one of them"):
        trx.Launcher(copy_env_vars=("PATH",), default_env_vars=("HOME",)).validate()
    with pytest.raises(TypeError, match="copy_env_vars must be a tuple of fnmatch patterns"):
        trx.Launcher(copy_env_vars="PATH").validate()  # type: ignore[arg-type]


def test_local_agents_start_from_the_launchers_environment_less_per_process_variables():
    environ = {
        "HF_TOKEN": "t",
        "PATH": "/bin",
        "RANK": "3",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RUN_ID": "r",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "odd.name": "kept",
    }
    assert local_agent_env(environ) == {"HF_TOKEN": "t", "PATH": "/bin", "odd.name": "kept"}


# -- workers_per_host "gpu" and "cpu" ----------------------------------------------------------


def test_gpu_and_cpu_are_counted_by_each_agent():
    for value in ("gpu", "cpu"):
        trx.Launcher(hostnames=["a", "b"], workers_per_host=value).validate()
        assert resolve_hosts(["a", "b"], value, environ={}) == [
            HostSlots("a", None),
            HostSlots("b", None),
        ]
    with pytest.raises(ValueError, match="'auto', 'slurm', 'gpu' or 'cpu', got 'gpus'"):
        trx.Launcher(workers_per_host="gpus").validate()  # type: ignore[arg-type]
    # What the agent reports for each count (pure: torchrunx.devices.count_slots).
    assert count_slots(None, "gpu", gpus=4, cpus=64) == 4
    assert count_slots(None, "gpu", gpus=0, cpus=64) == 0  # the launcher refuses that host
    assert count_slots(None, "cpu", gpus=4, cpus=64) == 64
    assert count_slots(None, "auto", gpus=0, cpus=64) == 64
    assert count_slots(3, "gpu", gpus=0, cpus=64) == 3
    bootstrap = AgentBootstrap(
        host_index=0,
        hostname="h",
        launcher_address="127.0.0.1",
        launcher_port=1,
        secret=b"s",
        workers=None,
        preload_torch=False,
        timings=agent_timings(5.0),
        log_level=20,
        sys_path=(),
        count="cpu",
    )
    assert json.loads(bootstrap.to_json_line())["count"] == "cpu"


def test_gpu_and_cpu_in_dry_run_and_on_command_lines():
    text = trx.Launcher(hostnames=["localhost"], workers_per_host="cpu", backend=None).dry_run()
    assert re.search(r"0\s+localhost\s+cpu\s+-\s+local", text), text
    assert "(cpu: the agent counts its CPU cores" in text
    for value in ("gpu", "cpu"):
        launcher = tyro.cli(trx.Launcher, args=["--workers-per-host", value])
        assert launcher.workers_per_host == value
    parsed = tyro.cli(
        trx.Launcher,
        args=["--copy-env-vars", "PATH", "HF_*", "--extra-env-vars", "WANDB_*", "FOO=a b"],
    )
    assert parsed.copy_env_vars == ("PATH", "HF_*")
    assert parsed.extra_env_vars == ("WANDB_*", "FOO=a b")
    assert split_extra_env_vars(parsed.extra_env_vars) == (("WANDB_*",), {"FOO": "a b"})
    import argparse

    parser = argparse.ArgumentParser()
    trx.add_launcher_arguments(parser)
    namespace = parser.parse_args(["--workers-per-host", "gpu", "--extra-env-vars", "FOO=1"])
    launcher = trx.launcher_from_args(namespace)
    assert (launcher.workers_per_host, launcher.extra_env_vars) == ("gpu", ("FOO=1",))


def test_gpu_and_cpu_launches(monkeypatch):
    # CUDA_VISIBLE_DEVICES is what the agent counts first: two "GPUs" without any hardware.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    result = trx.launch(os.getpid, hostnames=["localhost"], workers_per_host="gpu", backend=None)
    assert result.world_size == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(
        trx.AgentFailedError, match="workers_per_host='gpu' but this host has no GPU"
    ) as info:
        trx.launch(os.getpid, hostnames=["localhost"], workers_per_host="gpu", backend=None)
    assert info.value.hostname == "localhost"
    # "cpu": the cores the agent may run on (its affinity, inherited from this thread).
    allowed = os.sched_getaffinity(0)
    cores = set(sorted(allowed)[:3])
    os.sched_setaffinity(0, cores)
    try:
        result = trx.launch(
            os.getpid, hostnames=["localhost"], workers_per_host="cpu", backend=None
        )
    finally:
        os.sched_setaffinity(0, allowed)
    assert result.world_size == len(cores)


# -- keywords that were renamed ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("keyword", "replacement"),
    [
        ("worker_timeout", "use timeout=SECONDS"),
        ("handler_factory", "use log_handlers=... (or launcher.set_logging_handlers(...))"),
        ("env_vars", "use default_env_vars="),
        ("log_dir", "set the TORCHRUNX_LOG_DIR environment variable"),
    ],
)
def test_a_keyword_of_an_earlier_release_names_its_replacement(keyword, replacement):
    with pytest.raises(
        TypeError, match=re.escape(f"Launcher() got {keyword}=..., which was")
    ) as info:
        trx.Launcher(hostnames=["unreachable.invalid"], **{keyword: 60})
    assert replacement in str(info.value)
    with pytest.raises(
        TypeError, match=re.escape(f"launch() got {keyword}=..., which was")
    ) as info:
        trx.launch(print, hostnames=["unreachable.invalid"], **{keyword: 60})
    assert replacement in str(info.value)


def test_the_launcher_keeps_its_signature_for_tools():
    import inspect

    parameters = inspect.signature(trx.Launcher).parameters
    assert list(parameters)[:2] == ["hostnames", "workers_per_host"]
    assert "copy_env_vars" in parameters
    assert "worker_timeout" not in parameters


def test_set_logging_handlers_works_as_in_0_4():
    def handlers() -> list:
        return []

    launcher = trx.Launcher(hostnames=["localhost"])
    assert launcher.set_logging_handlers(handlers) is launcher  # chained, as in 0.4's docs
    assert launcher.log_handlers is handlers  # or called alone before run, as 0.4 allowed
    launcher.set_logging_handlers(None)
    assert launcher.log_handlers is None
    with pytest.raises(TypeError, match="log_handlers must be"):
        launcher.set_logging_handlers(42)  # type: ignore[arg-type]


# -- inside a SLURM allocation -----------------------------------------------------------------

SLURM_SCRIPT = r"""
import json, os, socket
import torch
import torch.distributed as dist
import torchrunx as trx

def same_product_on_every_rank():
    weights = torch.rand(50, 50) if dist.get_rank() == 0 else torch.zeros(50, 50)
    dist.broadcast(weights, 0)
    product = torch.ones(20, 50) @ weights
    dist.all_reduce(product)
    return product, socket.gethostname(), os.environ.get("TRX_GIVEN")

# As a torchrunx 0.4 script would write it: every other field at its default.
launcher = trx.Launcher(
    hostnames="slurm",
    copy_env_vars=trx.DEFAULT_ENV_VARS_FOR_COPY,
    extra_env_vars={"TRX_GIVEN": "given to every node"},
)
result = launcher.run(same_product_on_every_rank)
values = [value for per_host in result.results.values() for value in per_host]
first = values[0][0]
print(json.dumps({
    "hosts": list(result.results),
    "equal": all(torch.equal(value[0], first) for value in values),
    "nonzero": bool(first.abs().sum() > 0),
    "nodes": [value[1] for value in values],
    "given": [value[2] for value in values],
}))
"""


@pytest.mark.slurm
def test_a_0_4_script_uses_every_node_of_its_allocation(slurm, tmp_path):
    result = slurm.python_job(SLURM_SCRIPT, tmp_path)
    assert (result.state, result.exit_code) == ("COMPLETED", 0), result
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["hosts"] == ["snode1", "snode2"]
    assert summary["nodes"] == ["snode1", "snode2"]  # one worker per task, in node order
    assert summary["equal"] is True
    assert summary["nonzero"] is True
    assert summary["given"] == ["given to every node"] * 2


@pytest.mark.parametrize("module", ["torchrunx.integrations.cli", "torchrunx.integrations.parsing"])
def test_a_0_4_argparse_script_imports_and_parses_with_a_warning_naming_the_new_names(module):
    # 0.4's `from torchrunx.integrations.cli import add_torchrunx_argument_group,
    # launcher_from_args` (its docs also say `.parsing`) must not fail at import.
    import argparse
    import importlib

    old = importlib.import_module(module)
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1)
    with pytest.warns(DeprecationWarning, match=r"torchrunx\.add_launcher_arguments\(parser\)"):
        old.add_torchrunx_argument_group(parser)
    args = parser.parse_args(
        [
            *("--steps", "3", "--hostnames", "node1", "node2", "--workers-per-host", "2"),
            *("--backend", "gloo", "--copy-env-vars", "PATH", "HF_*"),
        ]
    )
    with pytest.warns(DeprecationWarning, match=r"torchrunx\.launcher_from_args\(args\)"):
        launcher = old.launcher_from_args(args)
    assert args.steps == 3
    assert launcher == trx.Launcher(
        hostnames=["node1", "node2"],
        workers_per_host=2,
        backend="gloo",
        copy_env_vars=("PATH", "HF_*"),
    )
    # 0.4's --worker-timeout is refused with the option that replaced it, not "unrecognized".
    with pytest.raises(SystemExit) as info, contextlib.redirect_stderr(io.StringIO()) as err:
        parser.parse_args(["--worker-timeout", "60"])
    assert info.value.code == 2
    assert "--timeout" in err.getvalue()
