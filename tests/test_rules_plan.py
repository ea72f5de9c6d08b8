"""Rules of how each host's agent starts (``start_methods``), on made-up machine facts (pure),
and of the environment the plan reads once (``Launcher.plan(environ=...)``).

The facts that ``start_methods`` reads from the machine are given here: the SLURM variables
(through the environment), whether ``srun`` is installed (``shutil.which``) and which names are
this machine (``local_hosts``). No process starts and no name is resolved.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import logging
import re
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx.errors import SlurmError
from torchrunx.launcher.settings import plan
from torchrunx.launcher.settings.plan import start_methods
from torchrunx.launcher.starts.agent_starts import configured_address, listen_hosts

HERE = "localhost"


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):
    """This machine: ``localhost`` is it, every other name is remote; no SLURM job, no srun."""
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(plan, "local_hosts", lambda hosts: [host == HERE for host in hosts])
    installed: set[str] = set()
    monkeypatch.setattr(
        plan.shutil, "which", lambda name: f"/usr/bin/{name}" if name in installed else None
    )

    class Machine:
        @staticmethod
        def allocation(nodes: str, job: str = "42", variable: str = "SLURM_JOB_ID") -> None:
            monkeypatch.setenv(variable, job)
            monkeypatch.setenv("SLURM_JOB_NODELIST", nodes)

        @staticmethod
        def install(name: str) -> None:
            installed.add(name)

    return Machine


def test_rule_srun_starts_the_remote_nodes_of_the_allocation_and_this_machine_locally(machine):
    machine.allocation("n[1-3]")
    machine.install("srun")
    assert start_methods("srun", [HERE, "n1", "n3"]) == (["local", "srun", "srun"], None)
    assert start_methods("srun", ["n2"]) == (["srun"], None)


def test_rule_srun_outside_an_allocation_is_a_slurm_error_naming_agent_start(machine):
    machine.install("srun")
    with pytest.raises(
        SlurmError,
        match=r"^agent_start='srun' but no SLURM allocation was detected \(SLURM_JOB_ID and ",
    ):
        start_methods("srun", ["n1"])


def test_rule_srun_not_installed_is_a_slurm_error(machine):
    machine.allocation("n[1-2]")
    with pytest.raises(SlurmError) as raised:
        start_methods("srun", ["n1"])
    assert str(raised.value) == "agent_start='srun' but srun is not installed on this machine"


def test_rule_srun_for_a_host_outside_the_allocation_names_it_the_job_and_its_nodes(machine):
    machine.allocation("n[1-2]", job="77")
    machine.install("srun")
    with pytest.raises(SlurmError) as raised:
        start_methods("srun", [HERE, "n1", "m9", "n2", "m8"])
    assert str(raised.value) == (
        "agent_start='srun' but ['m9', 'm8'] are not nodes of SLURM job 77 (['n1', 'n2']); "
        "use agent_start='ssh'"
    )


def test_rule_srun_on_this_machine_alone_still_needs_an_allocation_and_srun(machine):
    with pytest.raises(SlurmError, match="no SLURM allocation was detected"):
        start_methods("srun", [HERE])
    machine.allocation("n1")
    with pytest.raises(SlurmError, match="srun is not installed"):
        start_methods("srun", [HERE])
    machine.install("srun")
    assert start_methods("srun", [HERE]) == (["local"], None)  # this machine is never srun's


def test_rule_auto_in_an_allocation_with_srun_starts_its_nodes_through_srun(machine):
    machine.allocation("n[1-4]", variable="SLURM_JOBID")  # the older name of the job's id
    machine.install("srun")
    assert start_methods("auto", [HERE, "n4", "n2"]) == (["local", "srun", "srun"], None)
    assert start_methods("auto", ["n1"], paired=None) == (["srun"], None)
    assert start_methods("auto", ["n1"], paired="") == (["srun"], None)  # no provider's pair


def test_rule_auto_with_one_remote_host_outside_the_allocation_is_ssh_for_every_remote(machine):
    machine.allocation("n[1-2]")
    machine.install("srun")
    assert start_methods("auto", [HERE, "n1", "m1"]) == (["local", "ssh", "ssh"], None)
    assert start_methods("auto", ["m1", "n2"]) == (["ssh", "ssh"], None)


def test_rule_auto_without_srun_or_outside_an_allocation_is_ssh(machine):
    machine.allocation("n[1-2]")
    assert start_methods("auto", [HERE, "n1"]) == (["local", "ssh"], None)  # no srun
    machine.install("scontrol")  # another SLURM command is no srun
    assert start_methods("auto", ["n1", "n2"]) == (["ssh", "ssh"], None)


def test_rule_auto_outside_an_allocation_is_ssh_even_with_srun_installed(machine, monkeypatch):
    machine.install("srun")
    assert start_methods("auto", [HERE, "n1"]) == (["local", "ssh"], None)
    monkeypatch.setenv("SLURM_JOB_ID", "5")  # a job id without a node list: no allocation
    assert start_methods("auto", ["n1"]) == (["ssh"], None)


def test_rule_auto_on_this_machine_alone_never_reads_the_allocation(machine):
    machine.allocation("not a host name!")  # would be refused if it were read
    machine.install("srun")
    assert start_methods("auto", [HERE, HERE]) == (["local", "local"], None)
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        start_methods("auto", [HERE, "n1"])  # a remote host: the node list is read


def test_rule_ssh_is_ssh_inside_an_allocation_too(machine):
    machine.allocation("n[1-2]")
    machine.install("srun")
    assert start_methods("ssh", [HERE, "n1", "n2"]) == (["local", "ssh", "ssh"], None)
    assert start_methods("ssh", [], None) == ([], None)


def test_rule_a_transport_with_an_argument_keeps_it_and_an_empty_one_is_given_as_empty(machine):
    assert start_methods("ray:", ["n1"]) == (["ray"], "")
    assert start_methods("kubectl:a:b", ["n1", HERE]) == (["kubectl", "kubectl"], "a:b")
    assert start_methods("auto", ["n1"], "kubectl:namespace=ml") == (["kubectl"], "namespace=ml")
    assert start_methods("ssh", ["n1"], "kubectl:namespace=ml") == (["ssh"], None)


def test_rule_a_relay_other_than_off_auto_on_is_refused_with_what_auto_means():
    with pytest.raises(ValueError, match=r"^relay=") as raised:
        plan.check_relay("always")
    assert str(raised.value) == (
        "relay='always': expected one of 'off', 'auto', 'on' (\"auto\" relays only for hosts "
        "that cannot open a connection to the launcher)"
    )


# -- the environment, read once by plan() ----------------------------------------------------

LAUNCHER_SIDE = Path(plan.__file__).parents[1]
"""``torchrunx/launcher``: its modules take the environment's values from the plan."""
ENGINES = LAUNCHER_SIDE.parent / "engines"
"""``torchrunx/engines``: the transports a launch starts agents with (given the plan's values
in :class:`~torchrunx.engines.protocol.AgentStart`)."""

READS_OS_ENVIRON = {
    ("settings/environ.py", "read_environ"),  # the plan's one read
    ("settings/resolve.py", "resolve_hosts"),  # a call outside a launch; the plan passes its own
    ("launch/preempt.py", "default_grace"),  # the same
    ("launch/preempt.py", "requeue_job"),  # the same
    ("view/view_server.py", "runtime_dir"),  # torchrunx top, outside a launch
    ("engines/builtin.py", "__init__"),  # SrunAgent: srun runs with the start's env, if given
    ("engines/ray.py", "connect"),  # ray.init's PYTHONBREAKPOINT, put back (no setting read)
    ("engines/ray_actor.py", "start"),  # inside the Ray actor: the host's environment
}
"""Where a module under ``torchrunx/launcher`` may read ``os.environ``, and why."""


def _environ_reads() -> set[tuple[str, str]]:
    """``(module, function)`` of every ``os.environ`` / ``os.getenv`` under torchrunx/launcher
    and torchrunx/engines (``engines/`` named so)."""
    found: set[tuple[str, str]] = set()
    for path in sorted([*LAUNCHER_SIDE.rglob("*.py"), *ENGINES.rglob("*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in ("environ", "getenv", "environb")
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "os"
                ):
                    found.add((_where(path), function.name))
        for node in ast.walk(tree):  # a module-level read, or ``from os import environ``
            if isinstance(node, ast.ImportFrom) and node.module == "os":
                names = {alias.name for alias in node.names}
                assert not names & {"environ", "getenv", "environb"}, path
    return found


def _where(path: Path) -> str:
    """``path`` relative to torchrunx/launcher, or ``engines/...``."""
    if path.is_relative_to(ENGINES):
        return f"engines/{path.relative_to(ENGINES).as_posix()}"
    return path.relative_to(LAUNCHER_SIDE).as_posix()


def test_rule_nothing_under_the_launcher_reads_os_environ_but_the_plan():
    reads = _environ_reads()
    assert ("settings/environ.py", "read_environ") in reads  # the scan sees a read
    assert reads <= READS_OS_ENVIRON, sorted(reads - READS_OS_ENVIRON)


def test_rule_the_plan_reads_the_environment_it_is_given(tmp_path: Path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    environ = {
        "PATH": "/bin",
        "WANDB_KEY": "w",
        "TORCHRUNX_HOSTFILE": str(hostfile),
        "TORCHRUNX_LOG_LEVEL": "WARNING",
        "TORCHRUNX_LOG_DIR": str(tmp_path / "logs"),
        "TORCHRUNX_CACHE_DIR": str(tmp_path / "cache"),
        "TORCHRUNX_PROGRESS": "0",
        "TORCHRUNX_VIEW": "0",
        "TORCHRUNX_PRELOAD": "numpy, json",
        "TORCHRUNX_LAUNCHER_ADDR": "10.1.2.3",
        "TORCHRUNX_LISTEN_ADDR": "*",
        "TORCHRUNX_LAUNCHER_PORT": "29400-29401",
        "TORCHRUNX_HEALTH_CHECK_PORT": "8123",
        "TORCHRUNX_HEALTH_CHECK_HOST": "*",
        "TORCHRUNX_HEALTH_CHECK_TOKEN": "t0k",
        "TORCHRUNX_HEALTH_CHECK_DETAILS": "yes",
        "TORCHRUNX_POST_MORTEM": "on",
        "TORCHRUNX_DEBUGPY": "1",
        "SLURM_JOB_ID": "77",
    }
    launcher = trx.Launcher(hostnames="hostfile", extra_env_vars=("WANDB_*",))
    made = launcher.plan(environ=environ)
    got = made.from_env
    assert [(h.hostname, h.workers) for h in made.hosts.slots] == [
        ("localhost", 2)
    ]  # the provider's
    assert (made.reach.env["PATH"], made.reach.env["WANDB_KEY"]) == (
        "/bin",
        "w",
    )  # from the given mapping
    assert "SLURM_JOB_ID" not in made.reach.env  # matching no pattern (TORCH* forwards TORCHRUNX_*)
    assert made.observability.health_port == 8123
    assert (got.log_level, got.log_dir) == (logging.WARNING, tmp_path / "logs")
    assert got.hints == tmp_path / "cache" / "hints"
    assert (got.progress, got.view, got.preload) == (False, False, ("numpy", "json"))
    assert got.launcher_ports == (29400, 29401)
    assert (got.health_host, got.health_token, got.health_details) == ("", "t0k", True)
    assert (got.post_mortem, got.debugpy) == (True, (1, 5678))
    assert got.environ == environ  # a copy: what a local agent starts with, SLURM's job
    assert configured_address(made.reach.launcher_address, got.environ) == "10.1.2.3"
    assert listen_hosts(made.reach.launcher_address, made.hosts.methods, got.environ) == [None]
    assert "t0k" not in repr(made)  # a token or a value is never in a repr


def test_rule_the_defaults_of_an_empty_environment():
    got = trx.Launcher(hostnames=["localhost"]).plan(environ={}).from_env
    assert (got.log_level, got.log_dir) == (logging.INFO, Path("./torchrunx_logs"))
    assert got.hints is not None and got.hints.parts[-2:] == ("torchrunx", "hints")
    assert (got.progress, got.view, got.preload, got.launcher_ports) == (None, True, (), (0,))
    assert (got.health_host, got.health_token, got.health_details) == ("127.0.0.1", None, False)
    assert (got.post_mortem, got.debugpy) == (False, None)
    off = trx.Launcher(hostnames=["localhost"]).plan(
        environ={"TORCHRUNX_LOG_DIR": "", "TORCHRUNX_HINTS": "0"}
    )
    assert (off.from_env.log_dir, off.from_env.hints, off.observability.health_port) == (
        None,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TORCHRUNX_LOG_LEVEL", "LOUD"),
        ("TORCHRUNX_PRELOAD", "a b"),
        ("TORCHRUNX_LAUNCHER_PORT", "0"),
        ("TORCHRUNX_HEALTH_CHECK_PORT", "http"),
        ("TORCHRUNX_HEALTH_CHECK_DETAILS", "maybe"),
        ("TORCHRUNX_POST_MORTEM", "maybe"),
        ("TORCHRUNX_DEBUGPY", "one"),
    ],
)
def test_rule_a_bad_variable_fails_the_plan_naming_it(name, value, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    launcher = trx.Launcher(hostnames=["localhost"])
    with pytest.raises(ValueError, match=f"{name}="):
        launcher.plan(environ={name: value})
    launcher.plan()  # os.environ is not the given mapping: it has no such value
    monkeypatch.setenv(name, value)
    launcher.plan(environ={})  # and the given mapping is all that is read
    with pytest.raises(ValueError, match=f"{name}="):
        launcher.validate()  # validate() checks this process's environment


# -- Launcher's fields by group: its docstring, --help, the plan --------------------------------


def test_rule_every_launcher_field_is_in_one_group_and_the_docs_say_which():
    from torchrunx.launcher.settings.plan import LAUNCHER_GROUPS

    named = [name for fields in LAUNCHER_GROUPS.values() for name in fields]
    assert sorted(named) == sorted(f.name for f in dataclasses.fields(trx.Launcher))
    assert len(named) == len(set(named))  # one group each
    doc = " ".join((trx.Launcher.__doc__ or "").split())
    for group, fields in LAUNCHER_GROUPS.items():
        assert f"{group} ({', '.join(fields)})" in doc, group
    plan_groups = {f.name for f in dataclasses.fields(plan.LaunchPlan)}
    assert set(LAUNCHER_GROUPS) - {"workers"} <= plan_groups  # the plan's groups, by name


def test_rule_the_options_help_lists_them_by_group():
    parser = argparse.ArgumentParser()
    trx.add_launcher_arguments(parser)
    text = re.sub(r"-\s+", "-", " ".join(parser.format_help().split()))  # argparse wraps at -
    assert "by group: hosts: hostnames, workers-per-host, agent-start, spare-hosts" in text
    assert "observability: stall-timeout, on-stall, straggler-threshold" in text
    assert "log-handlers" not in text  # no option, so not listed


# -- the tree start's checks (tree_radix) --------------------------------------------------------


@pytest.mark.parametrize("radix", [0, -1, True, False, 2.0, "2"])
def test_rule_a_tree_radix_is_none_or_a_positive_integer_and_never_a_bool(radix: object):
    with pytest.raises(ValueError, match=rf"^tree_radix={re.escape(repr(radix))}: expected None"):
        plan.check_tree_radix(radix)


@pytest.mark.parametrize("radix", [None, 1, 2, 64])
def test_rule_a_tree_radix_of_none_or_from_1_is_taken(radix: int | None):
    plan.check_tree_radix(radix)


def test_rule_a_tree_of_depth_2_holds_radix_plus_radix_squared_hosts_spares_left_out():
    plan.check_tree(2, ["ssh"] * 6, 0)  # 2 started by the launcher, 4 by them: full
    plan.check_tree(1, ["ssh"] * 2, 0)
    with pytest.raises(ValueError, match=r"^tree_radix=2: 7 hosts need a tree of depth 3 or"):
        plan.check_tree(2, ["ssh"] * 7, 0)
    plan.check_tree(2, ["ssh"] * 9, 3)  # the spares are started by the launcher itself
    with pytest.raises(ValueError, match=r"at most 6 hosts\); give a larger radix$"):
        plan.check_tree(2, ["ssh"] * 9, 2)
    plan.check_tree(None, ["local", "ray"] * 9, 0)  # no tree: nothing to check


def test_rule_a_tree_starts_every_host_over_ssh_this_machine_included():
    with pytest.raises(ValueError, match=r"^tree_radix=2: every host") as raised:
        plan.check_tree(2, ["local", "ssh", "ssh"], 0)
    assert str(raised.value) == (
        "tree_radix=2: every host must be started over SSH (agent_start='ssh'), got "
        "['local', 'ssh']; launch without tree_radix"
    )
    with pytest.raises(ValueError, match=r"got \['srun', 'ssh'\]"):
        plan.check_tree(2, ["ssh", "srun"], 0)
