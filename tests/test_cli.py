"""Command lines: tyro.cli(Launcher), the argparse helpers, and the torchrunx command."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import tyro

import torchrunx as trx
from torchrunx.cli import add_launcher_arguments, launcher_from_args
from torchrunx.launcher.settings.renamed import RENAMED_FIELDS

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    """This environment, with the checkout importable (as an installed torchrunx would be)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def _cli_fields() -> list[dataclasses.Field[object]]:
    """Launcher's fields that a command line offers: all but those tyro suppresses."""
    hints = typing.get_type_hints(trx.Launcher, include_extras=True)
    return [
        f
        for f in dataclasses.fields(trx.Launcher)
        if tyro.conf.Suppress not in getattr(hints[f.name], "__metadata__", ())
    ]


def _docstrings() -> dict[str, str]:
    """Each field's docstring, whitespace collapsed (as help text shows it, wrapped anywhere)."""
    source = Path(sys.modules[trx.Launcher.__module__].__file__ or "").read_text()
    cls = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Launcher"
    )
    docs = {}
    for node, following in zip(cls.body, cls.body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            docs[node.target.id] = " ".join(following.value.value.split())  # type: ignore[union-attr, attr-defined]
    return docs


def _tyro_default(value: object) -> str:
    """A default as tyro shows it: sequences as shell words, everything else with str()."""
    if isinstance(value, list | tuple):
        return " ".join(shlex.quote(str(v)) for v in value)
    return str(value)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _help_blocks(text: str, names: list[str]) -> dict[str, str]:
    """The help of each option: from its option line to the next option, whitespace collapsed."""
    text = re.sub(r"[│╭╮╰╯─]", " ", text)
    starts = {name: re.search(rf"(?m)^\s*{_option(name)}\b", text) for name in names}
    missing = [name for name, match in starts.items() if match is None]
    assert not missing, f"options missing from --help: {missing}\n{text}"
    ordered = sorted((m.start(), name) for name, m in starts.items() if m is not None)
    ends = [start for start, _ in ordered[1:]] + [len(text)]
    return {
        name: " ".join(text[start:end].split())
        for (start, name), end in zip(ordered, ends, strict=True)
    }


# ------------------------------------------------------------------------------------------
# The Launcher through tyro
# ------------------------------------------------------------------------------------------

TYRO_SCRIPT = """\
import tyro
import torchrunx as trx

launcher = tyro.cli(trx.Launcher)
print(repr(launcher))
"""


@pytest.fixture(scope="module")
def tyro_help(tmp_path_factory):
    script = tmp_path_factory.mktemp("tyro") / "launch.py"
    script.write_text(TYRO_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        env=_env(COLUMNS="100"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_tyro_help_lists_every_field_with_its_docstring_and_default(tyro_help):
    fields = _cli_fields()
    docs = _docstrings()
    blocks = _help_blocks(tyro_help, [f.name for f in fields])
    for field in fields:
        block = blocks[field.name]
        assert docs[field.name] in block, f"{field.name}: docstring not in help: {block}"
        assert f"(default: {_tyro_default(field.default)})".replace("  ", " ") in block, block
    assert "--log-handlers" not in tyro_help  # suppressed: handlers are Python objects


def test_tyro_help_shows_the_forms_of_each_value(tyro_help):
    blocks = _help_blocks(tyro_help, [f.name for f in _cli_fields()])
    assert blocks["hostnames"].startswith("--hostnames {auto,slurm}|{[STR [STR ...]]}|PATH")
    assert blocks["workers_per_host"].startswith(
        "--workers-per-host {auto,slurm,gpu,cpu}|INT|{[INT [INT ...]]}"
    )
    assert blocks["agent_start"].startswith("--agent-start STR")  # a transport, maybe NAME:ARG
    assert blocks["backend"].startswith("--backend {None,nccl,gloo,mpi,ucc,auto}")


def test_tyro_help_reads_as_plain_text(tmp_path):
    # Wide enough that no help line needs wrapping: every field's help is one line.
    script = tmp_path / "launch.py"
    script.write_text(TYRO_SCRIPT)
    wide = subprocess.run(
        [sys.executable, str(script), "--help"],
        env=_env(COLUMNS="400"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert ":meth:" not in wide and "``" not in wide, wide
    lines = [line.strip("│ ").rstrip() for line in wide.splitlines()]
    for field in _cli_fields():
        at = next(i for i, line in enumerate(lines) if line.startswith(_option(field.name)))
        help_line = lines[at + 1]
        assert help_line.endswith(")"), f"{field.name}'s help is broken after {help_line!r}"


PARSE_FORMS = [
    (["--hostnames", "node1", "node2"], {"hostnames": ["node1", "node2"]}),
    (["--hostnames", "node1"], {"hostnames": ["node1"]}),
    (["--hostnames", "auto"], {"hostnames": "auto"}),
    (["--hostnames", "slurm"], {"hostnames": "slurm"}),
    # A hostfile arrives as a one-entry list; a name with "/" is read as a path by the launcher.
    (["--hostnames", "./hostfile"], {"hostnames": ["./hostfile"]}),
    (["--workers-per-host", "4"], {"workers_per_host": 4}),
    (["--workers-per-host", "8", "4"], {"workers_per_host": [8, 4]}),
    (["--workers-per-host", "auto"], {"workers_per_host": "auto"}),
    (["--workers-per-host", "slurm"], {"workers_per_host": "slurm"}),
    (["--workers-per-host", "gpu"], {"workers_per_host": "gpu"}),
    (["--workers-per-host", "cpu"], {"workers_per_host": "cpu"}),
    (["--agent-start", "srun"], {"agent_start": "srun"}),
    (["--backend", "None"], {"backend": None}),
    (["--backend", "gloo"], {"backend": "gloo"}),
    (["--timeout", "30"], {"timeout": 30.0}),
    (["--timeout", "1.5"], {"timeout": 1.5}),
    (["--extra-env-vars", "WANDB_*", "HF_TOKEN"], {"extra_env_vars": ("WANDB_*", "HF_TOKEN")}),
    (["--default-env-vars", "PATH"], {"default_env_vars": ("PATH",)}),
    (["--default-env-vars"], {"default_env_vars": ()}),
    (["--copy-env-vars", "PATH", "HF_*"], {"copy_env_vars": ("PATH", "HF_*")}),
    (["--extra-env-vars", "A_*", "B=x y"], {"extra_env_vars": ("A_*", "B=x y")}),
    (["--ssh-config-file", "None"], {"ssh_config_file": None}),
    (["--ssh-config-file", "cfg"], {"ssh_config_file": "cfg"}),
    (["--env-file", "env.sh"], {"env_file": "env.sh"}),
    (["--launch-timeout", "2.5"], {"launch_timeout": 2.5}),
    (["--launch-timeout", "None"], {"launch_timeout": None}),
    (["--stall-timeout", "60"], {"stall_timeout": 60.0}),
    (["--stall-timeout", "None"], {"stall_timeout": None}),
    (["--on-stall", "fail"], {"on_stall": "fail"}),
    (["--straggler-threshold", "0.5"], {"straggler_threshold": 0.5}),
    (["--straggler-threshold", "None"], {"straggler_threshold": None}),
    (["--start-timeout", "9"], {"start_timeout": 9.0}),
    (["--launcher-address", "10.1.2.3"], {"launcher_address": "10.1.2.3"}),
]


@pytest.mark.parametrize(("argv", "expected"), PARSE_FORMS)
def test_tyro_parses_each_form(argv, expected):
    launcher = tyro.cli(trx.Launcher, args=argv)
    for name, value in expected.items():
        assert getattr(launcher, name) == value
        assert type(getattr(launcher, name)) is type(value)


def test_tyro_launcher_runs_from_a_command_line(tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os
            import tyro
            import torchrunx as trx

            def where() -> str:
                return os.environ["RANK"] + "/" + os.environ["WORLD_SIZE"]

            if __name__ == "__main__":
                print(tyro.cli(trx.Launcher).run(where).ranks)
            """
        )
    )
    argv = ["--hostnames", "localhost", "--workers-per-host", "2", "--backend", "None"]
    done = _run([sys.executable, str(script), *argv], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "['0/2', '1/2']"


# ------------------------------------------------------------------------------------------
# add_launcher_arguments / launcher_from_args
# ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--steps", type=int, default=10)
    add_launcher_arguments(parser)
    return parser


@pytest.mark.parametrize(
    "argv",
    [
        [],
        *(argv for argv, _ in PARSE_FORMS),
        ["--hostnames", "a", "b", "--workers-per-host", "1", "2"],
    ],
)
def test_argparse_helpers_read_values_as_tyro_does(argv):
    parsed = launcher_from_args(_parser().parse_args(argv))
    # repr tells list from tuple, 2 from 2.0 and "None" from None.
    assert repr(parsed) == repr(tyro.cli(trx.Launcher, args=argv))


def test_argparse_help_lists_every_field_with_its_docstring_and_default():
    text = _parser().format_help()
    docs = _docstrings()
    fields = _cli_fields()
    blocks = _help_blocks(text, [f.name for f in fields])
    for field in fields:
        assert docs[field.name] in blocks[field.name], blocks[field.name]
        shown = _tyro_default(field.default) or "empty"
        assert blocks[field.name].endswith(f"(default: {shown})"), blocks[field.name]
    assert "--log-handlers" not in text
    assert "\n  --hostnames [{auto,slurm}|STR|PATH ...]\n" in text
    assert "\n  --backend {None,nccl,gloo,mpi,ucc,auto}\n" in text


def test_argparse_defaults_can_be_changed_and_show_in_help():
    parser = _parser()
    parser.set_defaults(hostnames=["localhost"], workers_per_host=2, backend="gloo")
    launcher = launcher_from_args(parser.parse_args(["--steps", "3"]))
    assert launcher == trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo")
    blocks = _help_blocks(parser.format_help(), [f.name for f in _cli_fields()])
    assert blocks["hostnames"].endswith("(default: localhost)")
    assert blocks["workers_per_host"].endswith("(default: 2)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers-per-host", "two"], "argument --workers-per-host: invalid value two"),
        (["--backend", "tcp"], "argument --backend: invalid value tcp: expected {None,nccl"),
        (["--timeout", "soon"], "argument --timeout: invalid value soon: expected FLOAT"),
    ],
)
def test_argparse_rejects_bad_values_like_argparse_does(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_argparse_options_clash_with_existing_ones():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=int)
    with pytest.raises(argparse.ArgumentError, match="conflicting option string: --timeout"):
        add_launcher_arguments(parser)


@dataclasses.dataclass(frozen=True)
class _Fields:
    """Field types Launcher may grow: the options must follow tyro for them too."""

    flag: bool = False
    """A switch."""

    sizes: tuple[int, ...] = (1, 2)
    """Some sizes."""

    mode: typing.Literal["fast", "slow"] | float = "fast"
    """A mode or a number."""


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--flag"],
        ["--no-flag"],
        ["--sizes", "3"],
        ["--sizes"],
        ["--mode", "slow"],
        ["--mode", "0.5"],
        ["--flag", "--sizes", "4", "5", "--mode", "2"],
    ],
)
def test_options_follow_tyro_for_other_field_types(argv):
    from torchrunx.cli_options import add_dataclass_arguments, dataclass_from_namespace

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser.add_argument_group("fields"), _Fields)
    parsed = dataclass_from_namespace(_Fields, parser.parse_args(argv))
    assert repr(parsed) == repr(tyro.cli(_Fields, args=argv))
    help_text = " ".join(parser.format_help().split())
    assert "--flag, --no-flag A switch. (default: False)" in help_text
    assert "--sizes [INT ...] Some sizes. (default: 1 2)" in help_text
    assert "--mode {fast,slow}|FLOAT A mode or a number. (default: fast)" in help_text


def test_a_field_type_without_a_command_line_form_is_named():
    @dataclasses.dataclass
    class Unreadable:
        table: dict[str, int] = dataclasses.field(default_factory=dict)

    from torchrunx.cli_options import add_dataclass_arguments

    parser = argparse.ArgumentParser()
    with pytest.raises(TypeError, match="field 'table' has a type the command line cannot read"):
        add_dataclass_arguments(parser.add_argument_group("fields"), Unreadable)


def test_exports():
    assert trx.add_launcher_arguments is add_launcher_arguments
    assert trx.launcher_from_args is launcher_from_args


def test_argparse_reports_a_bad_value_once_without_tyros_own_message(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--workers-per-host", "two"])
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "train.py: error: argument --workers-per-host: invalid value two: "
        "expected {auto,slurm,gpu,cpu}|INT"
    )
    assert err.startswith("usage: train.py") and "Value error" not in err, err


@pytest.mark.parametrize("argv", [["--max-restarts", "-1"], ["--timeout", "-1.5"]])
def test_argparse_negative_numbers_are_read_as_tyro_reads_them(argv):
    parsed = launcher_from_args(_parser().parse_args(argv))
    assert repr(parsed) == repr(tyro.cli(trx.Launcher, args=argv))


def test_a_dict_field_with_a_non_empty_default_is_refused_too():
    @dataclasses.dataclass
    class Table:
        table: dict[str, int] = dataclasses.field(default_factory=lambda: {"a": 1})

    from torchrunx.cli_options import add_dataclass_arguments

    parser = argparse.ArgumentParser()
    with pytest.raises(TypeError, match="field 'table' has a type the command line cannot read"):
        add_dataclass_arguments(parser.add_argument_group("fields"), Table)


# ------------------------------------------------------------------------------------------
# The torchrunx command
# ------------------------------------------------------------------------------------------

LOCAL = ["--hostnames", "localhost", "--workers-per-host", "2"]

# What pip writes for [project.scripts]: run from its own folder, so the current folder is
# not on sys.path (unlike python -m torchrunx).
CONSOLE_SCRIPT = """\
import sys
from torchrunx.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def torchrunx_command(tmp_path_factory):
    script = tmp_path_factory.mktemp("bin") / "torchrunx"
    script.write_text(CONSOLE_SCRIPT)
    return [sys.executable, str(script)]


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["torchrunx"] == "torchrunx.cli:main"


def test_command_help_lists_the_forms_and_every_field(tmp_path):
    done = _run([sys.executable, "-m", "torchrunx", "--help"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: torchrunx ")
    for form in ("-- script.py [args...]", "-- -m package.module", "-- package.module:function"):
        assert form in done.stdout
    _help_blocks(done.stdout, [f.name for f in _cli_fields()])  # every option is there
    assert "exit status: 0 success; 1 the launch failed" in done.stdout


def test_command_runs_a_torchrun_script_that_initialises_its_own_group(torchrunx_command, tmp_path):
    (tmp_path / "train.py").write_text(
        textwrap.dedent(
            """\
            import os
            import sys

            import torch
            import torch.distributed as dist

            if __name__ == "__main__":
                dist.init_process_group("gloo")  # as under torchrun: from the environment
                total = torch.tensor([float(dist.get_rank() + 1)])
                dist.all_reduce(total)
                print(f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} "
                      f"argv={sys.argv[1:]} total={total.item()}")
                dist.destroy_process_group()
                sys.exit(0)
            """
        )
    )
    done = _run([*torchrunx_command, *LOCAL, "--", "train.py", "--lr", "0.1"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[localhost:0] rank 0/2 argv=['--lr', '0.1'] total=3.0" in done.stdout
    assert done.stderr == ""


def test_command_runs_a_module_like_python_m(torchrunx_command, tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hello.py").write_text(
        "import os, sys\n"
        "if __name__ == '__main__':\n"
        "    print('hello from', os.environ['RANK'], sys.argv[1:], sys.argv[0].endswith('hello.py'))\n"
    )
    done = _run([*torchrunx_command, *LOCAL, "--", "-m", "pkg.hello", "x", "--y"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[localhost:0] hello from 0 ['x', '--y'] True" in done.stdout


@pytest.mark.parametrize(
    ("target", "searched"),
    [(["ok.py"], False), (["-m", "ok"], True), (["ok:f"], True)],
)
def test_only_a_module_or_a_function_puts_the_current_folder_on_sys_path(
    target, searched, tmp_path, monkeypatch, capsys
):
    """As python: ``-m`` searches the current folder, ``python script.py`` the script's own
    folder (its workers put it first), so a script launched from a folder that others can
    write in imports nothing from there (nor does ``torchrunx check``:
    tests/test_security_planted.py)."""
    from torchrunx.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [e for e in sys.path if e not in ("", str(tmp_path))])
    (tmp_path / "ok.py").write_text("def f():\n    return 1\n")
    assert main(["--hostnames", "localhost", "--dry-run", "--", *target]) == 0
    assert (str(tmp_path) in sys.path) is searched
    assert "every worker" in capsys.readouterr().out


def test_command_calls_a_function_and_prints_rank_0s_value_as_json(torchrunx_command, tmp_path):
    (tmp_path / "jobs.py").write_text(
        textwrap.dedent(
            """\
            import torch.distributed as dist

            def describe(a, b):
                return {"rank": dist.get_rank(), "world": dist.get_world_size(), "args": [a, b]}
            """
        )
    )
    done = _run(
        [*torchrunx_command, *LOCAL, "--backend", "gloo", "--", "jobs:describe", "1", "x"], tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == '{"rank": 0, "world": 2, "args": ["1", "x"]}'


def test_a_failing_script_exits_1_with_the_remote_traceback_once(torchrunx_command, tmp_path):
    (tmp_path / "fails.py").write_text(
        textwrap.dedent(
            """\
            import os

            def check(rank):
                if rank == "1":
                    raise ValueError(f"bad batch on rank {rank}")

            check(os.environ["RANK"])
            """
        )
    )
    done = _run([*torchrunx_command, *LOCAL, "--", "fails.py"], tmp_path)
    err = done.stderr
    assert done.returncode == 1, err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert 'fails.py", line 5, in check' in err, err
    assert "ValueError: bad batch on rank 1\n" in err, err
    assert "torchrunx: the launch failed: ValueError: bad batch on rank 1\n" in err, err
    assert "raised in worker rank 1 (local rank 1 on host 'localhost'" in err, err
    # The user's frames only: neither runpy's nor the launcher's.
    assert "runpy" not in err and "launcher.py" not in err and "cli.py" not in err, err


def test_a_script_exiting_non_zero_fails_the_command(torchrunx_command, tmp_path):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    done = _run(
        [
            *torchrunx_command,
            "--hostnames",
            "localhost",
            "--workers-per-host",
            "1",
            "--",
            "exits.py",
        ],
        tmp_path,
    )
    assert done.returncode == 1
    assert "torchrunx: the launch failed: WorkerFailedError:" in done.stderr
    assert "exit code 3" in done.stderr
    assert "Traceback" not in done.stderr


def test_dry_run_prints_the_plan_and_starts_nothing(torchrunx_command, tmp_path):
    (tmp_path / "train.py").write_text("raise SystemExit('must not run')\n")
    argv = ["--hostnames", "node-a.invalid", "node-b.invalid", "--workers-per-host", "3", "2"]
    done = _run([*torchrunx_command, *argv, "--dry-run", "--", "train.py", "--lr", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "node-a.invalid" in done.stdout and "node-b.invalid" in done.stdout
    assert done.stdout.splitlines()[-1] == "every worker runs the script: python train.py --lr 1"


def test_dry_run_without_a_target_reads_a_hostfile(torchrunx_command, tmp_path):
    (tmp_path / "hostfile").write_text("node7.invalid slots=3\n")
    done = _run([*torchrunx_command, "--hostnames", "./hostfile", "--dry-run"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert re.search(r"(?m)^\d+\s+node7\.invalid\s+3\s+0-2\b", done.stdout), done.stdout
    # No target: the plan shows the default of a script, which initialises its own group.
    assert re.search(r"(?m)^backend: None\b", done.stdout), done.stdout


def test_options_given_on_the_command_line_beat_the_preset(torchrunx_command, tmp_path):
    """Even an option given with the field's default value: the user typed it."""
    base = [*torchrunx_command, "--preset", "gpu_x8", "--hostnames", "node1.invalid"]
    target = ["--dry-run", "--", "json:dumps", "1"]
    preset = _run([*base, *target], tmp_path)
    assert preset.returncode == 0, preset.stderr
    assert re.search(r"(?m)^backend: nccl\b", preset.stdout), preset.stdout
    assert re.search(r"(?m)^0\s+node1\.invalid\s+8\s+0-7\b", preset.stdout), preset.stdout
    given = _run([*base, "--workers-per-host", "auto", "--backend", "auto", *target], tmp_path)
    assert given.returncode == 0, given.stderr
    assert re.search(r"(?m)^backend: auto\b", given.stdout), given.stdout
    assert re.search(r"(?m)^0\s+node1\.invalid\s+auto\s+-", given.stdout), given.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--", "missing.py"], "script 'missing.py' does not exist"),
        (["--", "no_such_module:main"], "cannot find module 'no_such_module'"),
        (["--", "-m"], "-m needs a module name"),
        ([], "nothing to run"),
        (["--workers-per-host", "0", "--", "ok.py"], "workers_per_host must be positive"),
        (["--workers-per-host", "2", "ok.py"], "put `--` between torchrunx's options"),
    ],
)
def test_bad_command_lines_exit_2_before_anything_starts(
    torchrunx_command, tmp_path, argv, message
):
    (tmp_path / "ok.py").write_text("")
    done = _run([*torchrunx_command, "--hostnames", "unreachable.invalid", *argv], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: torchrunx")
    assert message in done.stderr


def _main(argv: list[str], tmp_path: Path, monkeypatch) -> SystemExit:
    """Run the command in this process, in ``tmp_path``; what it exited with."""
    from torchrunx.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the current folder on it
    (tmp_path / "ok.py").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value


@pytest.mark.parametrize("name", sorted(RENAMED_FIELDS))
def test_an_option_of_an_earlier_release_is_named_with_its_replacement(
    name, tmp_path, monkeypatch, capsys
):
    option = "--" + name.replace("_", "-")
    assert _main([*LOCAL, option, "x", "--", "ok.py"], tmp_path, monkeypatch).code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: torchrunx")
    assert f"torchrunx: error: argument {option}: {RENAMED_FIELDS[name]}" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--worker-timeout", "60", "--", "ok.py"],
        ["--worker-timeout", "60", "ok.py"],
        ["run", "hello", "--worker-timeout", "60", "--", "x"],
    ],
)
def test_worker_timeout_points_to_timeout(argv, tmp_path, monkeypatch, capsys):
    assert _main(argv, tmp_path, monkeypatch).code == 2
    err = capsys.readouterr().err
    assert "argument --worker-timeout: renamed in torchrunx 0.5" in err, err
    assert "on the command line: --timeout" in err, err


def test_renamed_options_without_a_command_line_replacement_say_so(tmp_path, monkeypatch, capsys):
    assert _main(["--handler-factory", "f", "--", "ok.py"], tmp_path, monkeypatch).code == 2
    assert "(no command-line option)" in capsys.readouterr().err


def test_sub_commands_have_argparse_help_and_errors(tmp_path, monkeypatch, capsys):
    assert _main(["run", "--help"], tmp_path, monkeypatch).code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: torchrunx run NAME [options] -- ARGS...\n"), out
    _help_blocks(out, [f.name for f in _cli_fields()])  # every launcher option is there
    assert _main(["builtins", "--help"], tmp_path, monkeypatch).code == 0
    assert capsys.readouterr().out.startswith("usage: torchrunx builtins")
    assert _main(["run"], tmp_path, monkeypatch).code == 2
    assert "the following arguments are required: NAME" in capsys.readouterr().err
    assert _main(["run", "hello", "world"], tmp_path, monkeypatch).code == 2
    assert "the function's arguments go after `--`" in capsys.readouterr().err


def test_ctrl_c_stops_everything_and_exits_130(torchrunx_command, tmp_path):
    # Said and waited on one line: a rank that has said it may still be in print() (seen under
    # load), and is on the same line either way.
    (tmp_path / "waits.py").write_text(
        "import time\nprint('waiting', flush=True); time.sleep(60)\n"
    )
    command = [*torchrunx_command, *LOCAL, "--console-ranks", "all", "--", "waits.py"]
    with subprocess.Popen(
        command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None
        waiting = set()
        for line in process.stdout:  # both ranks run the script
            if "waiting" in line:
                waiting.add(line.split()[0])
            if waiting == {"[localhost:0]", "[localhost:1]"}:
                break
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 130
    # Where each worker was when the launch was interrupted, then the one line of the end.
    stacks, _, last = err.rpartition("torchrunx: interrupted;")
    assert last == " every agent and worker was stopped\n"
    assert stacks.startswith("Python stacks of the workers that were still running"), err
    # Both ranks wait in the same line: one section for both, headed by where they are.
    assert (
        "--- ranks 0-1 on host 'localhost' (the same stack; innermost: waits.py:2 in <module>) ---"
        in stacks
    ), err
    assert stacks.count(f'File "{tmp_path / "waits.py"}", line 2 in <module>') == 1, err


# -- torchrun's options, and a function's arguments read by its annotations ----------------------


def _torchrun_spellings() -> list[tuple[str, str]]:
    from torchrunx.cli_hints import TORCHRUN_OPTIONS

    found = {
        (spelling, option.instead)
        for option in TORCHRUN_OPTIONS
        for name in option.names
        for spelling in (f"--{name}", f"--{name.replace('-', '_')}")
    }
    ours = {"--max-restarts"} | {"--" + name.replace("_", "-") for name in RENAMED_FIELDS}
    return sorted(f for f in found if f[0] not in ours)  # ours (or 0.4's) say their own


@pytest.mark.parametrize(("option", "instead"), _torchrun_spellings())
def test_torchruns_options_are_refused_with_what_to_write_instead(
    option, instead, tmp_path, monkeypatch, capsys
):
    argv = [option, "--", "ok.py"] if "{value}" not in instead else [f"{option}=8", "--", "ok.py"]
    assert _main(["--hostnames", "localhost", *argv], tmp_path, monkeypatch).code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: torchrunx [options] -- (script.py | -m module | module:function)")
    assert "torchrun's option; with torchrunx write " + instead.format(value="8") in err, err
    assert "(torchrunx --help lists every option)" in err
    assert len(err.splitlines()) == 3, err  # not a screen of usage


def test_nproc_per_node_without_dashes_in_front_of_the_script_is_refused_too(
    tmp_path, monkeypatch, capsys
):
    # torchrun's own layout: options, then the script, no `--`.
    assert _main(["--nproc_per_node=2", "ok.py"], tmp_path, monkeypatch).code == 2
    assert "with torchrunx write --workers-per-host 2" in capsys.readouterr().err


def test_the_migration_page_lists_every_torchrun_option_the_command_knows():
    from torchrunx.cli_hints import TORCHRUN_OPTIONS

    page = (Path(__file__).parent.parent / "docs" / "migrating.md").read_text()
    table = page[page.index("## torchrun options and their counterparts") :]
    table = table[: table.index("\n## ")]
    for option in TORCHRUN_OPTIONS:
        for name in option.names:
            if name != "max_restarts":
                assert f"`--{name}" in table, name


def test_command_reads_a_functions_arguments_by_its_annotations(torchrunx_command, tmp_path):
    (tmp_path / "typed.py").write_text(
        textwrap.dedent(
            """\
            from pathlib import Path

            def train(steps: int, lr: float, out: Path, tag="x"):
                return [steps * 2, lr / 2, type(out).__name__, tag]
            """
        )
    )
    ok = _run([*torchrunx_command, *LOCAL, "--", "typed:train", "50", "0.5", "o.pt", "7"], tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == '[100, 0.25, "PosixPath", "7"]'
    bad = _run([*torchrunx_command, *LOCAL, "--", "typed:train", "5o", "0.5", "o.pt"], tmp_path)
    assert bad.returncode == 1
    assert (
        "ValueError: argument 1 of typed:train (steps: int) cannot be '5o': the function's "
        "annotation asks for int"
    ) in bad.stderr, bad.stderr


def test_a_script_that_launches_itself_run_by_the_command_is_refused_in_every_worker(
    torchrunx_command, tmp_path
):
    (tmp_path / "self_launching.py").write_text(
        textwrap.dedent(
            """\
            import torchrunx as trx

            def work():
                return 1

            print("RESULT", trx.launch(work, hostnames=["localhost"], workers_per_host=2).ranks)
            """
        )
    )
    done = _run([*torchrunx_command, *LOCAL, "--", "self_launching.py"], tmp_path)
    assert done.returncode == 1, done.stderr
    assert "RESULT" not in done.stdout  # no worker launched again
    assert "RuntimeError: a launch was started inside a torchrunx worker (rank" in done.stderr
    assert "runs with python, not with the torchrunx command" in done.stderr
