"""Rules of the command line's refusals and of a function's typed arguments (pure).

torchrun's options and earlier releases' keywords are refused with what to write instead
(:mod:`torchrunx.cli_hints`), on a parser made here; a function's arguments are read as its
annotations say (``typed_arguments``). No process starts (tests/test_cli.py runs the command).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import types
import typing
from pathlib import Path

import pytest

from torchrunx.cli_hints import (
    TORCHRUN_OPTIONS,
    add_renamed_options,
    add_torchrun_options,
    hint_lines,
)
from torchrunx.cli_options import typed_arguments


class _Parser(argparse.ArgumentParser):
    """A parser whose errors are raised (as ``ValueError(message)``), not printed."""

    def error(self, message: str) -> typing.NoReturn:
        raise ValueError(message)


def _refusal(parser: argparse.ArgumentParser, *argv: str) -> str:
    with pytest.raises(ValueError, match=r"^argument --") as raised:
        parser.parse_args(list(argv))
    return str(raised.value)


def _torchrun_parser(*own: str) -> argparse.ArgumentParser:
    parser = _Parser()
    for option in own:
        parser.add_argument(option)
    add_torchrun_options(parser)
    return parser


# -- torchrun's options ------------------------------------------------------------------------


def test_rule_a_torchrun_option_is_refused_with_its_counterpart_and_the_value_given():
    parser = _torchrun_parser()
    assert _refusal(parser, "--nproc-per-node=8") == (
        "argument --nproc-per-node/--nproc_per_node: torchrun's option; with torchrunx write "
        "--workers-per-host 8 (one count, or one per host)"
    )
    assert _refusal(parser, "--nproc_per_node", "4").endswith(
        "--workers-per-host 4 (one count, or one per host)"
    )
    # No value given: N stands for it.
    assert _refusal(parser, "--nproc-per-node").endswith(
        "write --workers-per-host N (one count, or one per host)"
    )
    assert _refusal(parser, "--rdzv_endpoint=h:1") == (
        "argument --rdzv-endpoint/--rdzv_endpoint: torchrun's option; with torchrunx write "
        "nothing: there is no rendezvous; the launcher assigns every rank, MASTER_ADDR and "
        "MASTER_PORT"
    )


def test_rule_a_flag_of_torchrun_takes_no_value():
    parser = _torchrun_parser()
    assert _refusal(parser, "--standalone") == (
        "argument --standalone: torchrun's option; with torchrunx write --hostnames localhost"
    )
    assert _refusal(parser, "--no_python").startswith("argument --no-python/--no_python: ")
    # A value given to a flag is argparse's own error, not the hint.
    assert (
        _refusal(parser, "--standalone=1") == "argument --standalone: ignored explicit argument '1'"
    )


def test_rule_an_option_the_parser_has_is_its_own_and_the_other_spelling_is_refused():
    parser = _torchrun_parser("--max-restarts", "--nproc-per-node")
    assert parser.parse_args(["--max-restarts", "3"]).max_restarts == "3"
    assert parser.parse_args(["--nproc-per-node", "2"]).nproc_per_node == "2"
    assert _refusal(parser, "--max_restarts", "3") == (
        "argument --max_restarts: torchrun's option; with torchrunx write --max-restarts 3"
    )
    assert _refusal(parser, "--nproc_per_node=2").startswith(
        "argument --nproc_per_node: torchrun's"
    )
    both = _torchrun_parser("--log-dir", "--log_dir")  # both spellings its own: none added
    assert both.parse_args(["--log_dir", "x"]).log_dir == "x"
    assert _refusal(both, "--redirects", "3").startswith("argument --redirects: torchrun's option")


def test_rule_torchruns_options_are_hidden_and_leave_their_own_names_in_the_namespace():
    parser = _torchrun_parser()
    assert "torchrun" not in parser.format_help() and "nproc" not in parser.format_help()
    names = {name for option in TORCHRUN_OPTIONS for name in option.names}
    assert vars(parser.parse_args([])) == {
        f"torchrun_{name.replace('-', '_')}": None for name in names
    }


def test_rule_the_migration_rows_list_every_spelling_with_n_for_the_value():
    rows = hint_lines()
    assert len(rows) == len(TORCHRUN_OPTIONS)
    assert rows[0] == "| `--nproc-per-node` | --workers-per-host N (one count, or one per host) |"
    assert rows[5] == (
        "| `--tee`, `--local-ranks-filter` | --console-ranks all (every rank's output on the "
        "console; chosen ranks: --console-ranks 0 3) |"
    )
    assert rows[-1] == "| `--max_restarts` | --max-restarts N |"


# -- keywords of earlier releases --------------------------------------------------------------


def _renamed_parser(*own: str) -> argparse.ArgumentParser:
    parser = _Parser()
    group = parser.add_argument_group("launcher")
    for option in own:
        group.add_argument(option)
    add_renamed_options(group)
    return parser


def test_rule_an_earlier_releases_option_names_the_new_option_where_the_command_has_it():
    parser = _renamed_parser("--timeout")
    assert _refusal(parser, "--worker-timeout", "5") == (
        "argument --worker-timeout: renamed in torchrunx 0.5: use timeout=SECONDS (the "
        "process-group timeout); on the command line: --timeout"
    )
    assert _refusal(parser, "--worker-timeout").endswith("; on the command line: --timeout")
    assert _refusal(parser, "--env-vars", "A", "B") == (
        "argument --env-vars: renamed: use default_env_vars=(patterns, ...) (no command-line "
        "option)"
    )
    assert _renamed_parser("--default-env-vars").parse_args([]).default_env_vars is None
    assert _refusal(_renamed_parser("--default-env-vars"), "--env-vars", "A").endswith(
        "; on the command line: --default-env-vars"
    )


def test_rule_a_removed_option_says_so_without_a_command_line_counterpart():
    parser = _renamed_parser()
    assert _refusal(parser, "--log-dir", "x") == (
        "argument --log-dir: removed: set the TORCHRUNX_LOG_DIR environment variable instead"
    )


def test_rule_earlier_releases_options_are_hidden_under_their_field_names():
    parser = _renamed_parser()
    assert "timeout" not in parser.format_help()
    assert vars(parser.parse_args([])) == {
        "worker_timeout": None,
        "handler_factory": None,
        "env_vars": None,
        "log_dir": None,
    }


# -- a function's arguments, read by its annotations -------------------------------------------


def test_rule_a_functions_arguments_are_read_as_its_annotations_say():
    def train(  # noqa: PLR0913, PLR0917 (a function of many parameters is the point)
        steps: int,
        lr: float,
        out: Path,
        mode: typing.Literal["a", "b"],
        raw,
        flag: bool,
        *more: int | None,
    ):
        return None

    words = ["50", "0.5", "/tmp/x", "b", "7", "False", "3", "None"]
    assert typed_arguments(train, words, "jobs:train") == (
        50,
        0.5,
        Path("/tmp/x"),
        "b",
        "7",
        False,
        3,
        None,
    )
    with pytest.raises(
        ValueError,
        match=r"^argument 1 of jobs:train \(steps: int\) cannot be '5o': the function's annotation asks for int$",
    ):
        typed_arguments(train, ["5o"], "jobs:train")
    with pytest.raises(
        ValueError, match=r"argument 4 of jobs:train \(mode: Literal\['a', 'b'\]\) cannot be 'c'"
    ):
        typed_arguments(train, ["1", "1", "x", "c"], "jobs:train")

    def plain(a, b: str, *rest):
        return None

    def unresolved(steps: int, data: NotDefinedAnywhere):  # noqa: F821 (on purpose)
        return None

    assert typed_arguments(plain, ["1", "2", "3"], "m:plain") == ("1", "2", "3")  # as before
    assert typed_arguments(len, ["1"], "len") == ("1",)  # no signature to read
    # One annotation that does not resolve leaves that word a string, not every word.
    assert typed_arguments(unresolved, ["2", "d"], "m:unresolved") == (2, "d")


Count = int
"""An alias only this module knows: annotations are read in the function's own globals."""


class _Unreadable:
    """A type tyro fails on (its own annotation names nothing): the word is passed as it is."""

    def __init__(self, a: NotDefinedAnywhere) -> None:  # noqa: F821 (on purpose)
        self.a = a


class _Callable:
    """A callable object: a signature, but no globals and no annotations of its own."""

    def __call__(self, a, b):
        return a, b


def test_rule_annotations_are_read_in_the_functions_globals_and_unresolved_ones_left_out():
    def mixed(a, b, c):
        return None

    mixed.__annotations__ = {"a": "Count", "b": float, "c": "NotDefinedAnywhere"}
    assert typed_arguments(mixed, ["1", "2", "3"], "m:mixed") == (1, 2.0, "3")
    assert typed_arguments(_Callable(), ["1", "2"], "m:obj") == ("1", "2")


def test_rule_words_past_the_parameters_are_passed_on_as_they_are_for_the_call_to_refuse():
    def one(steps: int):
        return None

    assert typed_arguments(one, ["1", "2", "x"], "m:one") == (1, "2", "x")
    assert typed_arguments(max, ["1", "2"], "max") == ("1", "2")  # a builtin without a signature


def test_rule_a_type_tyro_cannot_read_leaves_the_word_and_a_bad_word_prints_nothing(capfd):
    def custom(config: _Unreadable):
        return None

    assert typed_arguments(custom, ["x"], "m:custom") == ("x",)

    def steps(n: int):
        return None

    with pytest.raises(ValueError, match=r"^argument 1 of m:steps \(n: int\) cannot be 'x'"):
        typed_arguments(steps, ["x"], "m:steps")
    assert capfd.readouterr() == ("", "")  # the error is ours: tyro's own says nothing


def test_rule_a_keyword_of_an_earlier_release_is_refused_by_name_and_others_pass():
    from torchrunx.launcher.settings.renamed import refuse_renamed

    refuse_renamed("f()", ["timeout", "hostnames"])  # today's keywords: nothing to say
    with pytest.raises(TypeError) as raised:
        refuse_renamed("Launcher()", ["timeout", "log_dir", "env_vars"])
    assert str(raised.value) == (
        "Launcher() got log_dir=..., which was removed: set the TORCHRUNX_LOG_DIR environment "
        "variable instead"
    )


def test_rule_a_wrapped_functions_annotations_are_read_where_it_was_written():
    def steps(n: Count):
        return n

    bare = types.FunctionType(steps.__code__, {"__builtins__": __builtins__})  # no globals
    functools.update_wrapper(bare, steps)  # as a decorator's wrapper: __wrapped__ is steps
    assert typed_arguments(bare, ["3"], "m:bare") == (3,)


def test_rule_a_class_refusing_earlier_keywords_names_them_and_is_made_as_before():
    from torchrunx.launcher.settings.renamed import refuses_renamed_keywords

    @refuses_renamed_keywords
    @dataclasses.dataclass
    class Settings:
        timeout: float = 1.0
        name: str = "x"

    assert Settings(2.0, name="y") == Settings(timeout=2.0, name="y")
    assert Settings(2.0, name="y").timeout == 2.0
    with pytest.raises(TypeError, match=r"^Settings\(\) got worker_timeout=\.\.\., which was "):
        Settings(worker_timeout=3)
    assert list(inspect.signature(Settings).parameters) == ["timeout", "name"]
