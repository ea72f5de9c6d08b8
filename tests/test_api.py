"""The public surface: exports, Launcher fields, LaunchResult, validation before any start."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import threading
import typing

import pytest

import torchrunx as trx
from torchrunx.launcher.state.results import LaunchResult


def test_exports_are_sorted_and_complete():
    assert trx.__all__ == sorted(trx.__all__)
    assert set(trx._HOME) == set(trx.__all__)
    for name in trx.__all__:
        assert hasattr(trx, name), name
    assert {"Launcher", "launch", "LaunchResult", "AgentFailedError", "WorkerFailedError"} <= set(
        trx.__all__
    )


def test_agent_side_does_not_import_the_launcher():
    code = "import sys, torchrunx.agent.agent, torchrunx.worker.worker; print(sorted(m for m in sys.modules if m in ('torchrunx.launcher', 'paramiko', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


AGENT_NEVER_IMPORTS = (
    "torchrunx.launcher",
    "torchrunx.engines",
    "torchrunx.hosts",
    "torchrunx.cli",
    "torchrunx.worker.worker",  # with cloudpickle and pdb: the preload thread's, after the hello
    "paramiko",
    "cloudpickle",
    "torch",
    "numpy",
    "tyro",
    "rich",
    "pdb",
    "uuid",
    "subprocess",  # only to run nvidia-smi (torchrunx.devices)
    "platform",  # only for an error message (torchrunx.agent.guardian)
    "datetime",  # only for the store's timeout, in a worker that imported torch
    "importlib.abc",  # it imports importlib.resources (torchrunx.worker.hooks)
)
"""Modules that ``import torchrunx.agent.agent`` must not load: every agent pays for its imports
before its hello, 8 or 1,000 of them at once (issue #48). ``uuid`` and ``pdb`` come with the
worker's module, which the agent imports after its hello (``torchrunx.agent.preload``)."""

AGENT_AFTER_ITS_HELLO = (
    "dataclasses",  # with inspect, ast, dis, tokenize: @frozen classes make their fields on use
    "inspect",
    "selectors",
    "torchrunx.agent.attempt",
    "torchrunx.agent.workergroup",
    "torchrunx.agent.watchdog",
    "torchrunx.agent.outbox",
    "torchrunx.agent.link",
    "torchrunx.agent.usage",
    "torchrunx.agent.preload",
    "torchrunx.agent.workerprocess",
    "torchrunx.worker.stallprobe",
    "torchrunx.preemption",
    "torchrunx.timer",
    "torchrunx.wire.channel",
)
"""Modules that only the running agent uses (its loop, its attempts and workers; issue #48): its
``Agent`` imports them after the hello, so the agent's import (``torchrunx.agent.agent``, what
the launch waits for) loads none of them. ``socket`` (which the handshake needs) imports
``selectors`` itself: each module is checked against what a bare ``import socket`` loads."""

AGENT_RUNNING = (
    "torchrunx.agent.attempt",
    "torchrunx.agent.link",
    "torchrunx.agent.usage",
    "torchrunx.agent.preload",
    "torchrunx.agent.workerprocess",
    "torchrunx.worker.stallprobe",
)
"""What the running agent's ``Agent`` imports after the hello (with what those import)."""

MUTABLE_AGENT_DATACLASSES = {"Output", "Channel", "Worker", "_Hang"}
"""The agent's own state (``torchrunx.agent.workergroup``, ``torchrunx.agent.watchdog``): the only
dataclasses of the running agent whose methods ``dataclasses`` compiled; every other one is
``@frozen`` (``torchrunx.wire.frozen``), which compiles none."""


def test_the_agents_import_stays_lean():
    """A fresh interpreter that imports the agent loads none of the heavy or launcher-side
    modules, nor what the agent uses only after its hello; once it has imported those too,
    ``dataclasses`` compiled methods only for the agent's mutable state."""
    code = (
        "import sys, socket\n"
        "bare = set(sys.modules)\n"
        "import torchrunx.agent.agent\n"
        f"never = {AGENT_NEVER_IMPORTS!r} + {AGENT_AFTER_ITS_HELLO!r}\n"
        "print(sorted(m for m in never if m in sys.modules and m not in bare))\n"
        f"for name in {AGENT_RUNNING!r}:\n"
        "    __import__(name)\n"
        "import dataclasses\n"
        "compiled = set()\n"
        "for name, module in list(sys.modules.items()):\n"
        "    if name.startswith('torchrunx'):\n"
        "        for value in vars(module).values():\n"
        "            init = getattr(value, '__init__', None)\n"
        "            code = getattr(init, '__code__', None)\n"
        "            if dataclasses.is_dataclass(value) and code and code.co_filename == '<string>':\n"
        "                compiled.add(value.__name__)\n"
        "print(sorted(compiled))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded, compiled = done.stdout.splitlines()
    assert loaded == "[]", f"the agent's import loads {loaded}"
    assert compiled == repr(sorted(MUTABLE_AGENT_DATACLASSES)), compiled


def test_the_lean_guard_sees_a_heavy_import():
    """The check above fails when one of those modules is loaded (here by hand)."""
    code = (
        "import sys, subprocess, torchrunx.agent.agent\n"
        f"print(sorted(m for m in {AGENT_NEVER_IMPORTS!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "['subprocess']"


def test_import_torchrunx_loads_no_launcher_until_a_name_is_used():
    """``import torchrunx`` is cheap (the agent runs it first); a public name loads its module."""
    code = (
        "import sys, torchrunx as trx\n"
        "print('torchrunx.launcher.launcher' in sys.modules, 'paramiko' in sys.modules)\n"
        "trx.Launcher, trx.launch, trx.WarmLauncher\n"
        "print('torchrunx.launcher.launcher' in sys.modules)\n"
        "print(all(hasattr(trx, name) for name in trx.__all__), len(trx.__all__))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split("\n")[:3] == ["False False", "True", f"True {len(trx.__all__)}"]


def test_launcher_fields_and_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(trx.Launcher)}
    assert fields["hostnames"] == "auto"
    assert fields["workers_per_host"] == "auto"
    assert fields["ssh_config_file"] is None
    assert fields["backend"] == "auto"
    assert fields["timeout"] == 600
    assert fields["default_env_vars"] == (
        "PATH",
        "LD_LIBRARY_PATH",
        "LIBRARY_PATH",
        "PYTHON*",
        "CUDA*",
        "TORCH*",
        "PYTORCH*",
        "NCCL*",
        "OMP_*",
    )
    assert fields["extra_env_vars"] == ()
    assert fields["agent_start"] == "auto"
    assert fields["max_restarts"] == 0
    assert fields["restart_on"] == ("exceptions", "deaths", "timeouts")
    assert fields["health_check_port"] is None
    assert fields["event_handlers"] == ()
    assert fields["env_file"] is None
    hints = typing.get_type_hints(trx.Launcher)
    assert typing.Literal["nccl", "gloo", "mpi", "ucc", "auto"] in typing.get_args(hints["backend"])


def test_every_launcher_field_has_a_docstring():
    # tyro turns these attribute docstrings into --help text.
    import ast
    import inspect

    source = inspect.getsource(trx.Launcher)
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    documented = set()
    for node, following in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            documented.add(node.target.id)  # type: ignore[union-attr]
    assert documented == {f.name for f in dataclasses.fields(trx.Launcher)}


def _result() -> LaunchResult[str]:
    return LaunchResult(("a", "b", "a"), (("a0", "a1"), ("b0",), ("a2",)))


def test_launch_result_rank_and_results():
    result = _result()
    assert [result.rank(i) for i in range(4)] == ["a0", "a1", "b0", "a2"]
    assert result.ranks == ["a0", "a1", "b0", "a2"]
    # Duplicate hostnames: nothing is lost; the name's list continues in rank order.
    assert result.results == {"a": ["a0", "a1", "a2"], "b": ["b0"]}
    assert list(result.results) == ["a", "b"]
    assert result.index("a", 2) == "a2"
    assert result.index("b", 0) == "b0"
    assert result.per_host[2] == ("a2",)


def test_launch_result_errors_name_what_exists():
    result = _result()
    with pytest.raises(IndexError, match=r"ranks 0\.\.3"):
        result.rank(4)
    with pytest.raises(KeyError, match="was not part of this launch"):
        result.index("c", 0)
    with pytest.raises(IndexError, match="ran 1 workers"):
        result.index("b", 1)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"hostnames": []}, ValueError, "non-empty list"),
        ({"hostnames": "node1"}, ValueError, "for a single host give a list"),
        ({"hostnames": ["a b"]}, ValueError, "invalid host name"),
        ({"workers_per_host": 0}, ValueError, "positive integers"),
        ({"workers_per_host": -2}, ValueError, "positive integers"),
        (
            {"hostnames": ["a", "b"], "workers_per_host": [1]},
            ValueError,
            "1 entries but hostnames has 2",
        ),
        ({"backend": "tcp"}, ValueError, "backend='tcp'"),
        ({"timeout": 0}, ValueError, "timeout must be a positive"),
        ({"agent_timeout": float("inf")}, ValueError, "agent_timeout must be a finite number"),
        ({"agent_timeout": float("nan")}, ValueError, "agent_timeout must be a finite number"),
        ({"timeout": float("inf")}, ValueError, "^timeout must be a finite number"),
        ({"start_timeout": float("-inf")}, ValueError, "start_timeout must be a finite number"),
        ({"launch_timeout": float("inf")}, ValueError, r"finite .*use launch_timeout=None"),
        (
            {"hostnames": ["localhost", "/tmp/x"]},
            ValueError,
            r"invalid host name '/tmp/x': a host name cannot contain '/'",
        ),
        ({"hostnames": ["localhost", "../../x"]}, ValueError, "invalid host name '../../x'"),
        ({"hostnames": ["a", "-oProxyCommand=x"]}, ValueError, "cannot start with '-'"),
        (
            {"env_file": "/nonexistent/env.sh"},
            ValueError,
            "env_file '/nonexistent/env.sh' does not exist",
        ),
        ({"ssh_config_file": "/nonexistent/ssh_config"}, ValueError, "ssh_config_file"),
        ({"extra_env_vars": "FOO*"}, TypeError, "tuple of fnmatch patterns"),
    ],
)
def test_bad_fields_fail_before_any_host_is_touched(fields, error, match):
    # Unreachable hosts prove nothing was started: the error comes from validation alone.
    fields = {"hostnames": ["unreachable.invalid"], "workers_per_host": 1, **fields}
    with pytest.raises(error, match=match):
        trx.Launcher(**fields).run(print)


def test_unparsable_ssh_config_fails_before_start(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host node1\n    Port\n")
    with pytest.raises(ValueError, match=r"cannot read SSH config file .*Unparsable line Port"):
        trx.Launcher(hostnames=["unreachable.invalid"], ssh_config_file=config).run(print)


def test_func_must_be_callable():
    with pytest.raises(TypeError, match="func must be callable"):
        trx.Launcher(hostnames=["unreachable.invalid"]).run(42)  # type: ignore[arg-type]


def test_unpicklable_argument_is_a_clear_error_before_start():
    lock = threading.Lock()
    with pytest.raises(
        trx.SerializationError, match=r"cannot pickle the function .* or its arguments"
    ):
        trx.launch(print, (lock,), hostnames=["unreachable.invalid"], workers_per_host=1)


def test_unpicklable_function_is_a_clear_error_before_start():
    lock = threading.Lock()

    def uses_lock() -> bool:
        return lock.locked()

    with pytest.raises(trx.SerializationError, match=r"cannot pickle the function .*uses_lock"):
        trx.launch(uses_lock, hostnames=["unreachable.invalid"], workers_per_host=1)


def test_unknown_launch_field():
    with pytest.raises(TypeError, match="unexpected keyword argument 'hostname'"):
        trx.launch(print, hostname=["localhost"])


def test_dry_run_describes_the_plan_and_starts_nothing(monkeypatch, tmp_path):
    from conftest import torchrunx_processes

    monkeypatch.setenv("TORCHRUNX_DRY_SECRET", "s3cr3t-value")
    config = tmp_path / "ssh_config"
    config.write_text("Host far\n  HostName 192.0.2.7\n  User alice\n  Port 2222\n")
    launcher = trx.Launcher(
        hostnames=["localhost", "far"],
        workers_per_host=[2, 3],
        ssh_config_file=config,
        extra_env_vars=("TORCHRUNX_DRY_*",),
        agent_start="ssh",
    )
    text = launcher.dry_run()
    assert torchrunx_processes() == []
    assert "world size: 5" in text
    assert "0     localhost            2        0-1        local" in text
    assert "1     far                  3        2-4        ssh" in text
    assert "TORCHRUNX_DRY_SECRET" in text
    assert "s3cr3t-value" not in text
    assert "ssh alice@192.0.2.7 -p 2222" in text
    assert "IFS= read -r -d" in text  # the constant agent command


def test_dry_run_with_counted_workers_and_bad_fields():
    text = trx.Launcher(hostnames=["localhost"]).dry_run()
    assert "auto" in text
    assert "known once every agent has counted" in text
    with pytest.raises(
        ValueError,
        match=r"agent_start='rsh': no transport named 'rsh' \(known: auto, kubectl, local, ray, srun, ssh",
    ):
        trx.Launcher(agent_start="rsh").dry_run()  # type: ignore[arg-type]


def test_a_workers_own_failures_share_one_base_and_the_restart_category_they_answer_to():
    for error, category in (
        (trx.WorkerFailedError, "deaths"),
        (trx.WorkerTimeoutError, "timeouts"),
        (trx.WorkerRaisedError, None),  # its type name decides (restart_on's "exceptions")
    ):
        assert issubclass(error, trx.WorkerError) and issubclass(error, trx.TorchrunxError)
        assert error.restart_category == category
    assert not issubclass(trx.AgentFailedError, trx.WorkerError)
    assert trx.AgentFailedError.restart_category == "hosts"
    assert trx.LaunchTimeoutError.restart_category is None  # the launch's own: never restarts
