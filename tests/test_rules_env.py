"""The rules of environment forwarding (torchrunx/env.py), one per variable and per name.

- A variable that describes one process (its rank, its process group's address, torchrun's
  error file, ...) is never copied from the launcher: every worker gets its own. The list is
  written out here, not read from the module, so that a name dropped there is caught.
- Only names that bash can export (letters, digits and ``_``, not starting with a digit) are
  forwarded: the agent's shell exports them.
"""

from __future__ import annotations

import pytest

from torchrunx.env import (
    exported_env,
    flag_from_env,
    forwarded_env,
    local_agent_env,
    split_extra_env_vars,
    worker_env,
)

PER_PROCESS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHRUNX_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
]
"""The per-process variables of torchrunx/env.py's list, never copied."""


def test_every_variable_a_worker_gets_of_its_own_is_in_the_list():
    """What ``worker_env`` sets for each worker must never come from the launcher too."""
    env = worker_env(
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        group_rank=0,
        master_addr="10.0.0.1",
        master_port=29500,
    )
    assert set(env) <= set(PER_PROCESS)


@pytest.mark.parametrize("name", PER_PROCESS)
@pytest.mark.parametrize(
    "patterns", [("*",), ("TORCH*", "MASTER_*", "*RANK*", "*SIZE"), ("{name}",)]
)
def test_rule_a_per_process_variable_is_never_forwarded(name, patterns):
    """Rule: a per-process variable of the launcher (e.g. set because the launcher itself runs
    under torchrun) is not copied, whatever pattern would match it."""
    environ = {name: "launchers-own", "KEEP_ME": "1"}
    patterns = tuple(p.format(name=name) for p in patterns)
    assert name not in forwarded_env(patterns, environ)
    assert name not in exported_env(patterns, {}, environ)
    assert forwarded_env((*patterns, "KEEP_ME"), environ) == {"KEEP_ME": "1"}


@pytest.mark.parametrize("name", PER_PROCESS)
def test_rule_a_local_agent_starts_without_the_launchers_per_process_variables(name):
    """Rule: an agent on the launcher's machine gets the launcher's whole environment, less
    the per-process variables."""
    assert local_agent_env({name: "launchers-own", "KEEP_ME": "1"}) == {"KEEP_ME": "1"}


@pytest.mark.parametrize("name", PER_PROCESS)
@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_rule_a_per_process_variable_cannot_be_given_for_every_worker(name, form):
    """Rule: ``extra_env_vars`` cannot set a per-process variable for all workers at once."""
    extra = {name: "0"} if form == "dict" else (f"{name}=0",)
    with pytest.raises(ValueError, match=f"{name} is set by torchrunx for each worker"):
        split_extra_env_vars(extra)


NOT_SHELL_NAMES = [
    "1ABC",  # starts with a digit
    "A-B",
    "A.B",
    "A B",
    "A:B",
    "BASH_FUNC_f%%",  # how bash exports a function
    "NAÏVE",  # not ASCII
    "A\nB",
    "",
]


@pytest.mark.parametrize("name", NOT_SHELL_NAMES)
def test_rule_a_name_bash_cannot_export_is_not_forwarded(name):
    """Rule: only names bash can export reach the agent's shell, whatever the pattern."""
    environ = {name: "x", "GOOD_NAME": "y"}
    assert forwarded_env(("*",), environ) == {"GOOD_NAME": "y"}
    assert forwarded_env((name,), environ) == {}
    assert exported_env(("*",), {}, environ) == {"GOOD_NAME": "y"}


@pytest.mark.parametrize("name", ["A", "_", "_1", "a_b", "A1_B2", "PATH", "Z9"])
def test_a_name_bash_can_export_is_forwarded(name):
    """The control: valid shell names that match are forwarded."""
    assert forwarded_env(("*",), {name: "x"}) == {name: "x"}
    assert forwarded_env((name,), {name: "x"}) == {name: "x"}


@pytest.mark.parametrize("name", ["1ABC", "A-B", "A B", "BASH_FUNC_f%%"])
def test_rule_extra_env_vars_refuses_a_name_bash_cannot_export(name):
    with pytest.raises(ValueError, match="is not a variable name bash can export"):
        split_extra_env_vars({name: "1"})


def test_patterns_are_case_sensitive():
    assert forwarded_env(("path",), {"PATH": "/bin"}) == {}
    assert forwarded_env(("PATH",), {"PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "TRUE", " Yes ", "On"])
def test_rule_a_flag_is_on_for_1_true_yes_on_in_any_case(value, monkeypatch):
    assert flag_from_env("X_FLAG", {"X_FLAG": value}) is True
    monkeypatch.setenv("X_FLAG", value)
    assert flag_from_env("X_FLAG") is True  # the process's environment by default


@pytest.mark.parametrize("value", ["", "0", "false", "no", "off", "FALSE", " No ", "OFF"])
def test_rule_a_flag_is_off_for_0_false_no_off_empty_or_unset(value, monkeypatch):
    assert flag_from_env("X_FLAG", {"X_FLAG": value}) is False
    assert flag_from_env("X_FLAG", {}) is False
    monkeypatch.setenv("X_FLAG", "1")
    assert flag_from_env("X_FLAG", {"X_FLAG": value}) is False  # the mapping given, not os.environ


@pytest.mark.parametrize("value", ["2", "y", "enable", "of", "truee"])
def test_rule_any_other_flag_value_is_an_error_that_names_the_variable(value):
    with pytest.raises(ValueError, match=r"^X_FLAG=") as raised:
        flag_from_env("X_FLAG", {"X_FLAG": value})
    assert str(raised.value) == (
        f"X_FLAG={value!r} is not one of 1, true, yes, on, 0, false, no, off"
    )


def test_rule_a_pattern_that_matches_no_launcher_variable_is_named_once():
    from torchrunx.env import unmatched_patterns

    environ = {"WANDB_PROJECT": "p", "HF_HOME": "/h"}
    assert unmatched_patterns(["WANDB_PROJCT", "HF_*", "WANDB_PROJCT", "X?"], environ) == (
        "WANDB_PROJCT",
        "X?",
    )
    assert unmatched_patterns(["wandb_project"], environ) == ("wandb_project",)  # case counts


def test_rule_only_the_users_own_patterns_are_checked_not_torchrunxs_defaults(monkeypatch, caplog):
    import logging
    import os

    import torchrunx as trx
    from torchrunx.env import unmatched_env_vars

    for name in [n for n in os.environ if n.startswith(("NCCL", "CUDA"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MY_SET", "1")
    launcher = trx.Launcher(
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,  # no GPU count (no nvidia-smi): a pure test
        extra_env_vars=("WANDB_PROJCT", "MY_*", "A=1"),
        default_env_vars=("PATH", "NCCL*", "MINE_*"),
    )
    assert unmatched_env_vars(
        launcher.default_env_vars, launcher.copy_env_vars, launcher.extra_env_vars
    ) == ("MINE_*", "WANDB_PROJCT")
    with caplog.at_level(logging.WARNING, logger="torchrunx"):
        launcher.plan()
    warned = [
        r.getMessage() for r in caplog.records if "no variable of the launcher" in r.getMessage()
    ]
    assert warned == [
        f"no variable of the launcher matches {p!r}, so no worker gets it: a typo, or a variable "
        "set on the hosts but not here? (extra_env_vars, default_env_vars)"
        for p in ("MINE_*", "WANDB_PROJCT")
    ]
    assert "matching no variable here, so forwarding nothing (a typo?): MINE_* WANDB_PROJCT" in (
        launcher.dry_run()
    )


@pytest.mark.parametrize(
    ("environ", "refused"),
    [
        ({"TORCHELASTIC_RUN_ID": "torchrunx", "RANK": "1", "WORLD_SIZE": "2"}, True),
        ({"TORCHELASTIC_RUN_ID": "none", "RANK": "1"}, False),  # under torchrun: not ours
        ({"TORCHELASTIC_RUN_ID": "torchrunx"}, False),  # no rank: not a worker
        ({}, False),
    ],
)
def test_rule_a_launch_inside_a_torchrunx_worker_is_refused(environ, refused):
    from torchrunx.env import refuse_nested_launch

    if not refused:
        refuse_nested_launch(environ)
        return
    with pytest.raises(
        RuntimeError, match=r"^a launch was started inside a torchrunx worker \(rank 1 of 2\)"
    ):
        refuse_nested_launch(environ)


def test_rule_the_nested_launch_refusal_says_what_to_run_instead():
    from torchrunx.env import refuse_nested_launch

    with pytest.raises(RuntimeError) as raised:
        refuse_nested_launch({"TORCHELASTIC_RUN_ID": "torchrunx", "RANK": "0", "WORLD_SIZE": "4"})
    assert str(raised.value).endswith(
        "runs with python, not with the torchrunx command: `python script.py`; inside a worker, "
        "call the function directly"
    )


def test_rule_copy_env_vars_replaces_the_defaults_in_the_check_for_patterns_matching_nothing():
    from torchrunx.env import DEFAULT_ENV_VARS, unmatched_env_vars

    environ = {"PATH": "/bin", "MINE_A": "1"}
    # torchrunx 0.4's name, given: its patterns are the ones checked, not default_env_vars'.
    assert unmatched_env_vars(DEFAULT_ENV_VARS, ("MINE_*", "THEIRS_*"), None, environ) == (
        "THEIRS_*",
    )
    assert unmatched_env_vars(("OTHER_*",), None, None, environ) == ("OTHER_*",)


def test_rule_an_extra_value_is_everything_after_the_first_equals_sign():
    assert split_extra_env_vars(("OPTS=--a=1 --b=2", "X==", "MY_*")) == (
        ("MY_*",),
        {"OPTS": "--a=1 --b=2", "X": "="},
    )


def test_rule_a_given_value_wins_over_the_launchers_variable_of_the_same_name():
    environ = {"WANDB_MODE": "online", "WANDB_DIR": "/w"}
    assert exported_env(("WANDB_*",), {"WANDB_MODE": "offline"}, environ) == {
        "WANDB_MODE": "offline",
        "WANDB_DIR": "/w",
    }


@pytest.mark.parametrize("default", [None, "PATH", ("PATH", 1)])
def test_rule_default_env_vars_must_be_patterns_even_when_copy_env_vars_is_not_given(default):
    from torchrunx.env import check_env_fields

    with pytest.raises(TypeError, match=r"^default_env_vars must be a tuple of fnmatch patterns"):
        check_env_fields(default, None, None)
    check_env_fields(("PATH",), None, None)
