"""Command lines: argparse options for :class:`~torchrunx.Launcher`, and the ``torchrunx`` command.

Three ways to put a launcher on a command line:

* ``tyro.cli(torchrunx.Launcher)``: the ``Launcher`` dataclass as a whole command line.
* :func:`add_launcher_arguments` and :func:`launcher_from_args`: the same options inside your
  own :class:`argparse.ArgumentParser`, next to your script's options.
* The ``torchrunx`` command (:func:`main`), for scripts written for ``torchrun``::

      torchrunx [launcher options] -- train.py --lr 0.1       # a script on every worker
      torchrunx [launcher options] -- -m package.module args   # a module, like python -m
      torchrunx [launcher options] -- package.module:func args # a function; prints rank 0's value

All three are tyro's: the argparse options are the ones tyro makes from ``Launcher``'s fields
(their names, value forms and docstrings; :mod:`torchrunx.cli_options`), and each option's words
are read by tyro. So a new field appears on every command line by itself, read the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import runpy
import shlex
import sys
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from torchrunx.cli_hints import add_renamed_options, add_torchrun_options
from torchrunx.cli_options import (
    add_dataclass_arguments,
    dataclass_from_namespace,
    options_by_group,
    typed_arguments,
)
from torchrunx.commands import logs as cli_logs
from torchrunx.commands import report as cli_report
from torchrunx.commands import top as cli_top

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.launcher.launcher import Launcher
    from torchrunx.launcher.state.results import LaunchResult

__all__ = ["add_launcher_arguments", "launcher_from_args", "main"]

EXIT_OK = 0
"""The launch succeeded (or ``--dry-run`` printed the plan)."""
EXIT_FAILED = 1
"""The launch failed: a worker raised or died, an agent failed, or a timeout was hit."""
EXIT_USAGE = 2
"""Bad command line: an unknown option, an invalid value, or a missing script or module
(argparse's own status for an error, which :class:`_Parser` keeps)."""
EXIT_INTERRUPTED = 130
"""Interrupted with Ctrl-C (128 + SIGINT); everything was stopped first."""


# ------------------------------------------------------------------------------------------
# Options from dataclass fields
# ------------------------------------------------------------------------------------------


def add_launcher_arguments(
    parser: argparse.ArgumentParser, *, group_title: str = "torchrunx"
) -> argparse._ArgumentGroup:
    """Add one option per field of :class:`~torchrunx.Launcher` to ``parser``, in a group.

    The options are those of ``tyro.cli(Launcher)`` (``--hostnames``, ``--workers-per-host``,
    ...), and tyro reads their values: ``--hostnames node1 node2``, ``--hostnames auto``,
    ``--workers-per-host 4``, ``--workers-per-host 8 4``, ``--backend None``,
    ``--extra-env-vars 'WANDB_*' HF_TOKEN``. Each one's help is the field's docstring and its
    default. Fields that tyro suppresses (``log_handlers``) get no option.

    Each option stores the typed value under the field's name, and its default is the
    field's default; change defaults with ``parser.set_defaults(workers_per_host=2)``. An option
    given with a list of values (``--hostnames a b``) takes every word up to the next option,
    so put your own positional arguments before the launcher's options or after ``--``.

    Example:
        ```python
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, default=100)
        trx.add_launcher_arguments(parser)
        args = parser.parse_args()
        trx.launcher_from_args(args).run(train, args.steps)
        ```

    Args:
        parser: The parser to add the options to.
        group_title: Title of the argument group the options are listed under in ``--help``.

    Returns:
        The argument group holding the options.

    Raises:
        argparse.ArgumentError: An option of the same name is already defined in ``parser``.
    """
    from torchrunx.launcher.launcher import Launcher  # noqa: PLC0415 (workers import this module too)
    from torchrunx.launcher.settings.plan import LAUNCHER_GROUPS  # noqa: PLC0415 (as above)

    group = parser.add_argument_group(group_title)
    offered = add_dataclass_arguments(group, Launcher)
    about = "Where and how the function runs (the fields of torchrunx.Launcher), by group:"
    group.description = options_by_group(about, LAUNCHER_GROUPS, offered)
    return group


def launcher_from_args(namespace: argparse.Namespace) -> Launcher:
    """The :class:`~torchrunx.Launcher` described by the options of :func:`add_launcher_arguments`.

    Fields missing from ``namespace`` keep their defaults. Values are checked when the
    launcher runs (or by ``Launcher.validate()``).

    Args:
        namespace: What ``parser.parse_args()`` returned.

    Returns:
        A launcher with the parsed fields.
    """
    from torchrunx.launcher.launcher import Launcher  # noqa: PLC0415 (workers import this module too)

    launcher: Launcher = dataclass_from_namespace(Launcher, namespace)
    return launcher


# ------------------------------------------------------------------------------------------
# What runs in every worker
# ------------------------------------------------------------------------------------------


def _run_script(path: str, args: Sequence[str]) -> None:
    """In a worker: run a script as ``__main__``, like ``python path args...``.

    ``sys.argv`` is ``[absolute path, *args]`` and the script's folder comes first on
    ``sys.path``. ``sys.exit(0)`` (or ``sys.exit()``) is a normal end; another status ends the
    worker with it.
    """
    script = os.path.abspath(path)  # noqa: PTH100 (a str for runpy and sys.argv)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))  # noqa: PTH120
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as exc:  # re-raised below, minus runpy's frames
        if not _is_clean_exit(exc):
            exc.__traceback__ = _user_frames(exc.__traceback__)
            raise


def _run_module(module: str, args: Sequence[str]) -> None:
    """In a worker: run a module as ``__main__``, like ``python -m module args...``."""
    sys.argv = [module, *args]  # runpy puts the module's file in sys.argv[0]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except BaseException as exc:  # re-raised below, minus runpy's frames
        if not _is_clean_exit(exc):
            exc.__traceback__ = _user_frames(exc.__traceback__)
            raise


def _is_clean_exit(exc: BaseException) -> bool:
    return isinstance(exc, SystemExit) and exc.code in (None, 0)


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without its first frames in this module and in runpy."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return tb


def _call_function(target: str, args: Sequence[str]) -> object:
    """In a worker: import ``module:function`` and return ``function(*args)``.

    The function may be dotted (``module:Class.method``); each argument is read as its
    parameter's annotation says (:func:`~torchrunx.cli_options.typed_arguments`).
    """
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj(*typed_arguments(obj, args, target))


def _call_registered(function: Any, name: str, args: Sequence[str]) -> object:  # noqa: ANN401
    """In a worker: a plugin's function called with its arguments read as annotated."""
    return function(*typed_arguments(function, args, name))


# ------------------------------------------------------------------------------------------
# The torchrunx command
# ------------------------------------------------------------------------------------------

_DESCRIPTION = """\
Run a Python script, module or function on every worker of one or many hosts, with RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set as torchrun sets
them. Put `--` between torchrunx's options and what to run:

  torchrunx [options] -- script.py [args...]
      run a script as __main__, like python script.py args...
  torchrunx [options] -- -m package.module [args...]
      run a module as __main__, like python -m
  torchrunx [options] -- package.module:function [args...]
      call function(*args) (each arg read as its parameter's annotation says: int, float,
      Path, ...; a string where there is none) and print rank 0's return value
  torchrunx run NAME [options] [-- args...]
      call a function registered by a plugin (entry point group torchrunx.functions)
  torchrunx builtins
      list the registered functions, presets and host providers
  torchrunx check [options]
      check every host before a launch (SSH, interpreter, versions, ports, GPUs)
  torchrunx logs [LAUNCH] [--rank N] [--follow]
      show the newest (or a named) launch's log files, which file is whose rank
  torchrunx report [LAUNCH]
      write one HTML page about a launch: timeline, timings, first failure, log links
  torchrunx top [--pid PID]
      a live view of a running launch of yours, from another terminal

A script or module initialises torch.distributed itself (--backend defaults to None), as
under torchrun; a function finds the process group initialised (--backend defaults to auto).
Every worker sees every GPU of its host and LOCAL_RANK picks one (--isolate-gpus: only its own)."""

_EPILOG = """\
examples:
  torchrunx --hostnames localhost --workers-per-host 2 -- train.py --lr 0.1
  torchrunx --hostnames node1 node2 --workers-per-host 8 -- -m my_project.train
  torchrunx --workers-per-host 2 --backend gloo -- my_project.eval:evaluate ckpt.pt
  torchrunx --hostnames ./hostfile --dry-run

exit status: 0 success; 1 the launch failed (the error is printed once, with the remote
traceback); 2 bad command line; 130 Ctrl-C; 143 SIGTERM (everything is stopped first)."""


_RUN_DESCRIPTION = """\
Call the function that a plugin registered as NAME (entry point group torchrunx.functions;
`torchrunx builtins` lists them) on every worker, with the words after `--` as its arguments
(read as the function's annotations say), and print rank 0's return value. --backend
defaults to auto, as for any function."""

_CHECK_DESCRIPTION = """\
Check every host of a launch at once, before launching: each host is reached the way its agent
would be (SSH with your SSH config and known_hosts, srun, or a local process, with the same
forwarded variables, working directory, env_file and interpreter), then connects back to this
machine, reaches host 0 on a free port (as workers reach MASTER_PORT), and reports its Python,
torchrunx and torch versions and its GPUs. One line per host says what is wrong and what to do.
Takes the launcher's options (--hostnames, --ssh-config-file, --launcher-address, ...); exit
status 0 when every host is ready, 1 when one is not, 2 for a bad command line."""

_BUILTINS_DESCRIPTION = """\
List the functions, presets and host providers that installed packages registered (entry point
groups torchrunx.functions, torchrunx.presets and torchrunx.launcher.settings.resolve)."""


@dataclasses.dataclass(frozen=True)
class _BackendDefault:
    """The ``--backend`` default of the command: decided by what is run."""

    function: str | None = "auto"
    """A function's backend: the default of ``trx.launch``, or the one of ``--preset``."""

    def __str__(self) -> str:
        return f"None for a script or module, {self.function} for a function"


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose error messages may end with a hint about the command's layout."""

    hints: typing.Mapping[str, str] = types.MappingProxyType({})
    """Hints to append to an error message, each where its key is part of the message."""
    short_usage: str | None = None
    """The usage line printed with an error (not the list of every option), if set."""

    def error(self, message: str) -> NoReturn:
        """Print the usage and the error (with its hints), and exit with :data:`EXIT_USAGE`."""
        text = "\n".join([message, *(v for k, v in self.hints.items() if k in message)])
        if self.short_usage is None:
            super().error(text)
        self.exit(
            EXIT_USAGE,
            f"usage: {self.short_usage}\n{self.prog}: error: {text}\n"
            f"({self.prog} --help lists every option)\n",
        )


def _command_parser(command: str | None) -> _Parser:
    """The parser of ``torchrunx``, of ``torchrunx run`` or of ``torchrunx builtins``."""
    if command == "builtins":
        return _Parser(prog="torchrunx builtins", description=_BUILTINS_DESCRIPTION)
    if command == "check":
        parser = _Parser(prog="torchrunx check", description=_CHECK_DESCRIPTION)
        parser.add_argument("--preset", metavar="NAME", help="start from a named launcher preset")
        add_renamed_options(add_launcher_arguments(parser))
        return parser
    if command == "run":
        usage = "torchrunx run NAME [options] -- ARGS..."
        parser = _Parser(prog="torchrunx run", usage=usage, description=_RUN_DESCRIPTION)
        parser.hints = {"unrecognized": f"(the function's arguments go after `--`: {usage})"}
        parser.add_argument("name", metavar="NAME", help="the function (see `torchrunx builtins`)")
    else:
        parser = _Parser(
            prog="torchrunx",
            description=_DESCRIPTION,
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.short_usage = (
            "torchrunx [options] -- (script.py | -m module | module:function) [args...]"
        )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved plan (hosts, workers, ranks, forwarded variables, agent "
        "commands) and exit without starting anything",
    )
    parser.add_argument(
        "--preset",
        metavar="NAME",
        help="start from a named launcher preset (entry point group torchrunx.presets); "
        "options given here override it",
    )
    if command is None:
        parser.add_argument(
            "-m",
            "--module",
            action="store_true",
            help="run the target as a module, like python -m (also written `-- -m module`)",
        )
    add_renamed_options(add_launcher_arguments(parser))
    add_torchrun_options(parser)
    parser.set_defaults(backend=_BackendDefault())
    if command is None:
        parser.add_argument(
            "target",
            nargs="?",
            help="what to run: a script (path), a module (with -m) or module:function",
        )
        parser.add_argument(
            "args", nargs=argparse.REMAINDER, help="arguments of the script or function"
        )
    return parser


def _parse_options(parser: _Parser, options: list[str]) -> argparse.Namespace:
    """Parse the options; with ``--preset``, parse again with the preset's fields as defaults.

    So an option given on the command line wins over the preset, even one given with the
    field's default value (``--max-restarts 0``), and a script's backend stays ``None``.
    """
    namespace = parser.parse_args(options)
    if namespace.preset is None:
        return namespace
    from torchrunx.launcher.launcher import Launcher  # noqa: PLC0415 (workers import this module)

    try:
        preset = Launcher.from_preset(namespace.preset)
    except (ValueError, TypeError, RuntimeError) as exc:
        parser.error(str(exc))
    parser.set_defaults(
        **{field.name: getattr(preset, field.name) for field in dataclasses.fields(preset)}
    )
    parser.set_defaults(backend=_BackendDefault(preset.backend))
    return parser.parse_args(options)


def _target(
    parser: _Parser, namespace: argparse.Namespace, rest: list[str] | None
) -> _Target | None:
    """What to run; ``None`` only with ``--dry-run``.

    ``torchrunx run``'s function, or what ``rest`` names: the words after ``--``, or without
    ``--`` (``rest`` is ``None``) argparse's ``target`` and ``args``.
    """
    if "name" in namespace:  # torchrunx run NAME
        from torchrunx import plugins  # noqa: PLC0415 (entry points are read on use)

        try:
            plugins.registered_function(namespace.name)
        except (ValueError, RuntimeError, TypeError) as exc:
            parser.error(str(exc))
        return _Target("registered", namespace.name, tuple(rest or ()))
    if rest is None:
        rest = [namespace.target, *namespace.args] if namespace.target is not None else []
    elif namespace.target is not None:
        parser.error(
            f"unexpected {namespace.target!r} before `--`: options go before `--`, "
            "what to run after it"
        )
    module = namespace.module
    if rest[:1] == ["-m"]:
        module, rest = True, rest[1:]
    if not rest:
        if module:
            parser.error("-m needs a module name")
        if not namespace.dry_run:
            parser.error("nothing to run: give a script, -m module or module:function")
        return None
    name, args = rest[0], tuple(rest[1:])
    function = ":" in name and not name.endswith(".py") and not Path(name).exists()
    target = _Target("module" if module else "function" if function else "script", name, args)
    _search_current_folder(target)
    problem = _target_problem(target)
    if problem is not None:
        parser.error(problem)
    return target


_VIEWS = {"logs": cli_logs.main, "report": cli_report.main, "top": cli_top.main}
"""The commands that look at launches (each parses its own words)."""


def main(argv: Sequence[str] | None = None) -> int:
    """The ``torchrunx`` command (also ``python -m torchrunx``); see ``torchrunx --help``.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success, 1 the launch failed, 2 bad command line, 130 interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv[:1] in [[c] for c in ("run", "builtins", "check", *_VIEWS)] else None
    words = argv[1:] if command else argv
    if command in _VIEWS:
        return _VIEWS[command](words)
    parser = _command_parser(command)
    if command == "builtins":
        parser.parse_args(words)
        from torchrunx import plugins  # noqa: PLC0415 (entry points are read on use)

        print(plugins.builtins_text())  # noqa: T201 (the command's output)
        return EXIT_OK
    if command == "check":
        return _check(parser, _parse_options(parser, words))
    # torchrunx's options, then `--`, then what to run (or a registered function's arguments).
    split = words.index("--") if "--" in words else None
    options, rest = (words, None) if split is None else (words[:split], words[split + 1 :])
    if command is None and split is None:
        hint = "(put `--` between torchrunx's options and the script, module or function)"
        parser.hints = {"invalid value": hint}
    namespace = _parse_options(parser, options)
    target = _target(parser, namespace, rest)
    if isinstance(namespace.backend, _BackendDefault):
        function = target is not None and target.kind in ("function", "registered")
        namespace.backend = namespace.backend.function if function else None
    try:
        launcher = launcher_from_args(namespace)
        launcher.validate()
    except (ValueError, TypeError, RuntimeError) as exc:
        parser.error(str(exc))
    if namespace.dry_run:
        return _dry_run(launcher, target)
    assert target is not None  # noqa: S101 (_target requires one without --dry-run)
    return _launch(launcher, target)


@dataclasses.dataclass(frozen=True)
class _Target:
    kind: Literal["script", "module", "function", "registered"]
    name: str
    args: tuple[str, ...]

    def describe(self) -> str:
        args = shlex.join(self.args)
        if self.kind == "script":
            return f"script: python {shlex.quote(self.name)} {args}".rstrip()
        if self.kind == "module":
            return f"module: python -m {self.name} {args}".rstrip()
        if self.kind == "registered":
            return f"registered function {self.name}({', '.join(map(repr, self.args))})"
        return f"function: {self.name}({', '.join(map(repr, self.args))})"


def _search_current_folder(target: _Target) -> None:
    """For a module or function: the current folder first on ``sys.path``, as ``python -m``.

    Only there, as Python does: workers get the launcher's ``sys.path``, and a script's workers
    put its own folder first instead (``python script.py``); ``torchrunx check`` and a
    registered function need neither, so that nothing is imported from the current folder.
    """
    if target.kind in ("module", "function") and os.getcwd() not in sys.path:  # noqa: PTH109
        sys.path.insert(0, os.getcwd())  # noqa: PTH109


def _target_problem(target: _Target) -> str | None:
    """Why the target cannot run, checked in the launcher before anything starts."""
    if target.kind == "script":
        if not Path(target.name).is_file():
            return f"script {target.name!r} does not exist or is not a file"
        return None
    module, _, function = target.name.partition(":")
    if target.kind == "function" and not (module and re.fullmatch(r"[\w.]+", function)):
        return f"{target.name!r} is not module:function"
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as exc:
        return f"cannot find module {module!r}: {exc}"
    return None if found else f"cannot find module {module!r} in the current folder or sys.path"


def _describe_failure(error: BaseException, headline: str = "the launch failed") -> str:
    """A failed launch, for a terminal: the remote traceback, one headline, and the notes.

    Args:
        error: What ``Launcher.run`` raised.
        headline: What failed.

    Returns:
        The text to print (ends with a newline).
    """
    from torchrunx.errors import RemoteTraceback, exception_text  # noqa: PLC0415 (workers import this module)

    parts: list[str] = []
    if isinstance(error.__cause__, RemoteTraceback):
        parts.append(error.__cause__.text.rstrip())
    message = exception_text(error).strip()
    parts.append(
        f"torchrunx: {headline}: {type(error).__name__}" + (f": {message}" if message else "")
    )
    parts.extend(str(note).rstrip() for note in getattr(error, "__notes__", ()))
    return "\n".join(parts) + "\n"


def _show_result(value: object) -> str | None:
    """Rank 0's value as printed: JSON where it can be, else ``repr``; nothing for ``None``."""
    if value is None:
        return None
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)


def _dry_run(launcher: Launcher, target: _Target | None) -> int:
    try:
        plan = launcher.dry_run()
    except Exception as exc:  # noqa: BLE001 (e.g. "slurm" outside an allocation)
        sys.stderr.write(_describe_failure(exc, "the dry run failed"))
        return EXIT_FAILED
    print(plan)  # noqa: T201 (the command's output)
    if target is not None:
        print(f"every worker runs the {target.describe()}")  # noqa: T201
    return EXIT_OK


def _check(parser: _Parser, namespace: argparse.Namespace) -> int:
    """``torchrunx check``: a line per host, then a summary; 0 if every host is ready."""
    from torchrunx.launcher.preflight import check_command  # noqa: PLC0415 (workers import this module)

    if isinstance(namespace.backend, _BackendDefault):
        namespace.backend = namespace.backend.function
    try:
        launcher = launcher_from_args(namespace)
        launcher.validate()
    except (ValueError, TypeError, RuntimeError) as exc:
        parser.error(str(exc))
    return check_command(launcher, lambda exc: _describe_failure(exc, "the check failed"))


def _launch(launcher: Launcher, target: _Target) -> int:
    result: LaunchResult[Any]
    try:
        if target.kind == "script":
            result = launcher.run(_run_script, target.name, target.args)
        elif target.kind == "module":
            result = launcher.run(_run_module, target.name, target.args)
        elif target.kind == "registered":
            from torchrunx import plugins  # noqa: PLC0415 (entry points are read on use)

            function = plugins.registered_function(target.name)
            result = launcher.run(_call_registered, function, target.name, target.args)
        else:
            result = launcher.run(_call_function, target.name, target.args)
    except KeyboardInterrupt as interrupted:
        sys.stdout.flush()
        notes = [str(note).rstrip() for note in getattr(interrupted, "__notes__", ())]
        sys.stderr.write(
            "\n".join([*notes, "torchrunx: interrupted; every agent and worker was stopped"]) + "\n"
        )
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 (every failure is printed once, concisely)
        sys.stdout.flush()
        sys.stderr.write(_describe_failure(exc))
        return EXIT_FAILED
    shown = _show_result(result.rank(0))
    if shown is not None:
        print(shown)  # noqa: T201 (the command's output)
    return EXIT_OK
