"""Command lines: argparse options for :class:`~torchrunx.Launcher`, and the ``torchrunx`` command.

Three ways to put a launcher on a command line:

* ``tyro.cli(torchrunx.Launcher)``: the ``Launcher`` dataclass as a whole command line.
* :func:`add_launcher_arguments` and :func:`launcher_from_args`: the same options inside your
  own :class:`argparse.ArgumentParser`, next to your script's options.
* The ``torchrunx`` command (:func:`main`), for scripts written for ``torchrun``::

      torchrunx [launcher options] -- train.py --lr 0.1       # a script on every worker
      torchrunx [launcher options] -- -m package.module args   # a module, like python -m
      torchrunx [launcher options] -- package.module:func args # a function; prints rank 0's value

The options are made from ``Launcher``'s fields, their types and their docstrings, so a new
field appears on every command line by itself. Values are read as tyro reads them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import runpy
import shlex
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.launcher import Launcher
    from torchrunx.results import LaunchResult

__all__ = ["add_launcher_arguments", "launcher_from_args", "main"]

_SCALARS: dict[object, str] = {int: "INT", float: "FLOAT", str: "STR", Path: "PATH"}

EXIT_OK = 0
"""The launch succeeded (or ``--dry-run`` printed the plan)."""
EXIT_FAILED = 1
"""The launch failed: a worker raised or died, an agent failed, or a timeout was hit."""
EXIT_USAGE = 2
"""Bad command line: an unknown option, an invalid value, or a missing script or module."""
EXIT_INTERRUPTED = 130
"""Interrupted with Ctrl-C (128 + SIGINT); everything was stopped first."""


# ------------------------------------------------------------------------------------------
# Options from dataclass fields
# ------------------------------------------------------------------------------------------


def add_launcher_arguments(
    parser: argparse.ArgumentParser, *, group_title: str = "torchrunx"
) -> argparse._ArgumentGroup:
    """Add one option per field of :class:`~torchrunx.Launcher` to ``parser``, in a group.

    Options are named as tyro names them (``--hostnames``, ``--workers-per-host``, ...) and
    read values the same way: ``--hostnames node1 node2``, ``--hostnames auto``,
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
    from torchrunx.launcher import Launcher  # noqa: PLC0415 (workers import this module too)

    group = parser.add_argument_group(
        group_title, "Where and how the function runs (the fields of torchrunx.Launcher)."
    )
    _add_dataclass_arguments(group, Launcher)
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
    from torchrunx.launcher import Launcher  # noqa: PLC0415 (workers import this module too)

    launcher: Launcher = _dataclass_from_namespace(Launcher, namespace)
    return launcher


def _add_dataclass_arguments(group: argparse._ArgumentGroup, cls: type[Any]) -> None:
    docs = _field_docs(cls)
    for name, hint in _cli_fields(cls).items():
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        default = _field_default(field)
        base, _ = _unwrap_annotated(hint)
        option = "--" + name.replace("_", "-")
        doc = docs.get(name, "")
        if base is bool:
            group.add_argument(
                option,
                "--no-" + name.replace("_", "-"),
                action=_FieldAction,
                nargs=0,
                dest=name,
                default=default,
                field_type=base,
                doc=doc,
            )
            continue
        _check_supported(base, name)
        group.add_argument(
            option,
            action=_FieldAction,
            nargs="*" if _takes_many(base) else None,
            dest=name,
            default=default,
            metavar=_metavar(base),
            field_type=base,
            doc=doc,
        )


def _dataclass_from_namespace(cls: type[Any], namespace: argparse.Namespace) -> Any:  # noqa: ANN401 (an instance of cls)
    names = [name for name in _cli_fields(cls) if hasattr(namespace, name)]
    values = {name: getattr(namespace, name) for name in names}
    return cls(**values)


class _FieldAction(argparse.Action):
    """Stores one dataclass field, converted from its words as tyro would.

    Its help is the field's docstring followed by the current default, so a default changed
    with ``parser.set_defaults`` shows in ``--help`` too.
    """

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        field_type: object,
        doc: str,
        **kwargs: Any,  # noqa: ANN401 (argparse's own keywords: nargs, default, metavar)
    ) -> None:
        self.field_type = field_type
        self.doc = doc
        super().__init__(option_strings, dest, **kwargs)

    @property
    def help(self) -> str:
        """The field's docstring and its default, escaped for argparse's ``%`` formatting."""
        text = f"{self.doc} (default: {_show_default(self.default)})".strip()
        return text.replace("%", "%%")

    @help.setter  # noqa: A003 (argparse reads and writes action.help)
    def help(self, value: str | None) -> None:
        """Ignored: the help is made from the docstring and the default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        """Convert the option's words and store the value."""
        if self.field_type is bool:
            value: object = not (option_string or "").startswith("--no-")
        else:
            words = [values] if isinstance(values, str) else list(values or [])
            try:
                value = _convert(self.field_type, words)
            except ValueError:
                shown = " ".join(shlex.quote(w) for w in words) or "nothing"
                raise argparse.ArgumentError(
                    self, f"invalid value {shown}: expected {self.metavar}"
                ) from None
        setattr(namespace, self.dest, value)
        if isinstance(parser, _Parser):  # the torchrunx command: --preset needs to know
            parser.given.add(self.dest)


def _cli_fields(cls: type[Any]) -> dict[str, object]:
    """The fields that get an option (all but tyro-suppressed ones), with their type hints."""
    import tyro  # noqa: PLC0415 (only the launcher's side needs tyro)

    hints = typing.get_type_hints(cls, include_extras=True)
    fields: dict[str, object] = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        hint = hints[field.name]
        _, extras = _unwrap_annotated(hint)
        if any(extra is tyro.conf.Suppress for extra in extras):
            continue
        fields[field.name] = hint
    return fields


def _field_default(field: dataclasses.Field[Any]) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _field_docs(cls: type[Any]) -> dict[str, str]:
    """Attribute docstrings of a class's fields, as single paragraphs of plain text.

    A docstring is the string literal right after the field's annotated assignment (the
    convention tyro, Sphinx and mkdocstrings read). Lines are joined; blank lines are kept.
    """
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source (a frozen app): no help text, options still work
        return {}
    tree = ast.parse(textwrap.dedent(source))
    body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef)), [])
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            text = inspect.cleandoc(following.value.value)
            docs[node.target.id] = re.sub(r"(?<!\n)\n(?!\n)", " ", text)
    return docs


def _unwrap_annotated(hint: object) -> tuple[object, tuple[object, ...]]:
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        return base, tuple(extras)
    return hint, ()


def _members(tp: object) -> list[object]:
    """Members of a union in the order tyro tries them: ``None``, literals, then the rest.

    ``dict`` members of a union with other members are left out: they are for Python callers
    (``extra_env_vars`` as in torchrunx 0.4); tyro tries the ``tuple`` member before them, so a
    command line never produces one.
    """
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [_unwrap_annotated(m)[0] for m in typing.get_args(tp)]
    else:
        members = [tp]
    members = [m for m in members if typing.get_origin(m) is not dict] or members
    first = [m for m in members if m is type(None)]
    literals = [m for m in members if typing.get_origin(m) is Literal]
    return first + literals + [m for m in members if m not in first and m not in literals]


def _sequence_item(tp: object) -> object | None:
    """The item type of ``list[T]`` or ``tuple[T, ...]``; ``None`` for other types."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    item: object = None
    if (origin is list and len(args) == 1) or (
        origin is tuple and len(args) == 2 and args[1] is Ellipsis
    ):
        item = args[0]
    return item


def _takes_many(tp: object) -> bool:
    return any(_sequence_item(m) is not None for m in _members(tp))


def _check_supported(tp: object, name: str) -> None:
    for member in _members(tp):
        item = _sequence_item(member)
        scalar = member if item is None else _unwrap_annotated(item)[0]
        if scalar is type(None) or typing.get_origin(scalar) is Literal or scalar in _SCALARS:
            continue
        raise TypeError(
            f"field {name!r} has a type the command line cannot read ({member!r}); "
            "mark it with Annotated[..., tyro.conf.Suppress] or use str, int, float, Path, "
            "Literal, None, list or tuple of these"
        )


def _convert(tp: object, words: list[str]) -> object:
    """The first member of ``tp`` (tried as tyro tries them) that reads ``words``.

    Raises:
        ValueError: No member reads them.
    """
    for member in _members(tp):
        item = _sequence_item(member)
        try:
            if item is not None:
                values = [_convert_one(_unwrap_annotated(item)[0], w) for w in words]
                return tuple(values) if typing.get_origin(member) is tuple else values
            if len(words) == 1:
                return _convert_one(member, words[0])
        except ValueError:
            continue
    raise ValueError(f"{words!r} is not a {tp!r}")


def _convert_one(tp: object, word: str) -> object:
    if tp is type(None):
        if word == "None":
            return None
    elif typing.get_origin(tp) is Literal:
        for choice in typing.get_args(tp):
            if str(choice) == word:
                return choice
    elif tp is Path:
        return Path(word)
    elif tp in (int, float, str):
        value: object = typing.cast("type[Any]", tp)(word)
        return value
    raise ValueError(f"{word!r} is not a {tp!r}")


def _metavar(tp: object) -> str:
    """Like tyro's: ``{auto,slurm}|INT`` (the choices first, then each type once)."""
    choices: list[str] = []
    types_: list[str] = []
    for member in _members(tp):
        item = _sequence_item(member)
        scalar = member if item is None else _unwrap_annotated(item)[0]
        if scalar is type(None):
            choices.append("None")
        elif typing.get_origin(scalar) is Literal:
            choices.extend(str(c) for c in typing.get_args(scalar))
        elif _SCALARS.get(scalar, "") not in types_:
            types_.append(_SCALARS[scalar])
    parts = (["{" + ",".join(choices) + "}"] if choices else []) + types_
    return "|".join(parts)


def _show_default(value: object) -> str:
    if isinstance(value, list | tuple):
        return " ".join(shlex.quote(str(v)) for v in value) if value else "empty"
    if isinstance(value, str) and value:
        return shlex.quote(value)
    return str(value)


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

    The function may be dotted (``module:Class.method``); the arguments are strings.
    """
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj(*args)


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
      call function(*args) (the args are strings) and print rank 0's return value
  torchrunx run NAME [options] [-- args...]
      call a function registered by a plugin (entry point group torchrunx.functions)
  torchrunx builtins
      list the registered functions, presets and host providers

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


class _BackendDefault:
    """The ``--backend`` default of the command: decided by what is run."""

    def __str__(self) -> str:
        return "None for a script or module, auto for a function"


_BY_TARGET = _BackendDefault()


class _Parser(argparse.ArgumentParser):
    """Exits with :data:`EXIT_USAGE`; hints at ``--`` when an option swallowed the script."""

    separated = True
    """Whether the command line has ``--`` between torchrunx's options and the target."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401 (argparse's)
        """An argparse parser that also records which launcher fields were given."""
        super().__init__(*args, **kwargs)
        self.given: set[str] = set()
        """The launcher fields whose option appeared on the command line."""

    def error(self, message: str) -> NoReturn:
        """Print the usage and the error, and exit with status 2."""
        hint = ""
        if not self.separated and "invalid value" in message:
            hint = "\n(put `--` between torchrunx's options and the script, module or function)"
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}{hint}\n")


def _command_parser() -> _Parser:
    parser = _Parser(
        prog="torchrunx",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module, like python -m (also written `-- -m module`)",
    )
    add_launcher_arguments(parser)
    parser.set_defaults(backend=_BY_TARGET)
    parser.add_argument(
        "target",
        nargs="?",
        help="what to run: a script (path), a module (with -m) or module:function",
    )
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, help="arguments of the script or function"
    )
    return parser


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


def _parse(parser: _Parser, argv: list[str]) -> tuple[argparse.Namespace, _Target | None]:
    """The launcher options and what to run (``None`` only with ``--dry-run``)."""
    namespace, rest = _split(parser, argv)
    backend_given = namespace.backend is not _BY_TARGET
    _target_defaults(namespace, function=False)
    module = namespace.module
    if rest[:1] == ["-m"]:
        module, rest = True, rest[1:]
    if not rest:
        if module:
            parser.error("-m needs a module name")
        if not namespace.dry_run:
            parser.error("nothing to run: give a script, -m module or module:function")
        return namespace, None
    name, args = rest[0], tuple(rest[1:])
    if module:
        target = _Target("module", name, args)
    elif ":" in name and not name.endswith(".py") and not Path(name).exists():
        target = _Target("function", name, args)
    else:
        target = _Target("script", name, args)
    problem = _target_problem(target)
    if problem is not None:
        parser.error(problem)
    if target.kind == "function":
        namespace.backend = _BY_TARGET if not backend_given else namespace.backend
        _target_defaults(namespace, function=True)
    return namespace, target


def _target_defaults(namespace: argparse.Namespace, *, function: bool) -> None:
    """Fill ``--backend`` where it was not given.

    A function gets the default of ``trx.launch``; a script or module gets torchrun's (it sets
    up torch.distributed itself).
    """
    # A script's backend=None is part of running a script: a --preset does not change it.
    namespace.backend_given = namespace.backend is not _BY_TARGET or not function
    if namespace.backend is _BY_TARGET:
        namespace.backend = "auto" if function else None


def _split(parser: _Parser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Parse torchrunx's options; the rest is what to run and its arguments."""
    parser.separated = "--" in argv
    if not parser.separated:
        namespace = parser.parse_args(argv)
        rest = [namespace.target, *namespace.args] if namespace.target is not None else []
        return namespace, rest
    split = argv.index("--")
    namespace = parser.parse_args(argv[:split])
    if namespace.target is not None:
        parser.error(
            f"unexpected {namespace.target!r} before `--`: options go before `--`, "
            "what to run after it"
        )
    return namespace, argv[split + 1 :]


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


def main(argv: Sequence[str] | None = None) -> int:
    """The ``torchrunx`` command (also ``python -m torchrunx``); see ``torchrunx --help``.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success, 1 the launch failed, 2 bad command line, 130 interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.getcwd() not in sys.path:  # noqa: PTH109
        # As with python -m, modules in the current folder can be imported; workers get the
        # launcher's sys.path, so this reaches them too.
        sys.path.insert(0, os.getcwd())  # noqa: PTH109
    if argv[:1] == ["builtins"]:
        if {"-h", "--help"} & set(argv[1:]):
            text = (
                "usage: torchrunx builtins\n\nList the functions, presets and host providers "
                "that installed packages registered (entry point groups torchrunx.functions, "
                "torchrunx.presets and torchrunx.hosts)."
            )
            print(text)  # noqa: T201 (the command's output)
            return EXIT_OK
        return _builtins()
    parser = _command_parser()
    registered: str | None = None
    if argv[:1] == ["run"]:
        if argv[1:2] in (["-h"], ["--help"]):
            parser.prog = "torchrunx run NAME"
            parser.epilog = (
                "Runs the function registered as NAME: torchrunx run NAME [options] -- ARGS..."
            )
            parser.print_help()
            return EXIT_OK
        if len(argv) < 2 or argv[1].startswith("-"):
            parser.error("run needs the name of a registered function (see `torchrunx builtins`)")
        registered = argv[1]
        rest = argv[2:]
        options, args = (
            (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
        )
        argv = [*options, "--", f"{registered}:registered", *args]
        parser.prog = f"torchrunx run {registered}"
    namespace, target = _parse_any(parser, argv, registered)
    try:
        launcher = _with_preset(launcher_from_args(namespace), namespace, parser.given)
        launcher.validate()
    except (ValueError, TypeError, RuntimeError) as exc:
        parser.error(str(exc))
    if namespace.dry_run:
        return _dry_run(launcher, target)
    assert target is not None  # noqa: S101 (_parse requires one without --dry-run)
    return _launch(launcher, target)


def _parse_any(
    parser: _Parser, argv: list[str], registered: str | None
) -> tuple[argparse.Namespace, _Target | None]:
    """:func:`_parse`, or for ``run NAME`` the registered function as the target."""
    if registered is None:
        return _parse(parser, argv)
    split = argv.index("--")
    namespace = parser.parse_args(argv[:split])
    if namespace.target is not None:
        parser.error(
            f"unexpected {shlex.join([namespace.target, *namespace.args])!r}: the function's "
            f"arguments go after `--` (torchrunx run {registered} [options] -- ARGS...)"
        )
    _target_defaults(namespace, function=True)
    from torchrunx import plugins  # noqa: PLC0415 (entry points are read on use)

    try:
        plugins.registered_function(registered)
    except (ValueError, RuntimeError, TypeError) as exc:
        parser.error(str(exc))
    return namespace, _Target("registered", registered, tuple(argv[split + 2 :]))


def _with_preset(launcher: Launcher, namespace: argparse.Namespace, given: set[str]) -> Launcher:
    """Apply ``--preset``: its values, except where an option was given on the command line.

    An option given with the field's default value (``--max-restarts 0``) still wins. A
    script's ``backend`` (see :func:`_target_defaults`) counts as given.
    """
    from torchrunx.launcher import Launcher  # noqa: PLC0415 (workers import this module)

    if namespace.preset is None:
        return launcher
    names = set(given)
    if namespace.backend_given:
        names.add("backend")
    overrides = {name: getattr(launcher, name) for name in names & set(_cli_fields(Launcher))}
    return Launcher.from_preset(namespace.preset, **overrides)


def _builtins() -> int:
    """``torchrunx builtins``: what plugins (and torchrunx itself) registered."""
    from torchrunx import plugins  # noqa: PLC0415 (entry points are read on use)

    lines = ["functions (torchrunx run NAME -- args):"]
    functions = plugins.function_names()
    width = max((len(name) for name in functions), default=0)
    lines += [f"  {name:<{width}}  {doc}".rstrip() for name, doc in functions.items()]
    lines.append("presets (--preset NAME, Launcher.from_preset(NAME)):")
    for name in plugins.preset_names():
        try:
            values = plugins.preset(name)
        except (ValueError, RuntimeError) as exc:
            lines.append(f"  {name}  (cannot be loaded: {exc})")
            continue
        settings = ", ".join(f"{key}={value!r}" for key, value in values.items())
        lines.append(f"  {name}  {settings}")
    lines.append("host providers (--hostnames NAME[:ARGUMENT]):")
    lines += [f"  {name}" for name in plugins.host_provider_names()]
    print("\n".join(lines))  # noqa: T201 (the command's output)
    return EXIT_OK


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


def _launch(launcher: Launcher, target: _Target) -> int:
    result: LaunchResult[Any]
    try:
        if target.kind == "script":
            result = launcher.run(_run_script, target.name, target.args)
        elif target.kind == "module":
            result = launcher.run(_run_module, target.name, target.args)
        elif target.kind == "registered":
            from torchrunx import plugins  # noqa: PLC0415 (entry points are read on use)

            result = launcher.run(plugins.registered_function(target.name), *target.args)
        else:
            result = launcher.run(_call_function, target.name, target.args)
    except KeyboardInterrupt:
        sys.stderr.write("torchrunx: interrupted; every agent and worker was stopped\n")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 (every failure is printed once, concisely)
        sys.stdout.flush()
        sys.stderr.write(_describe_failure(exc))
        return EXIT_FAILED
    shown = _show_result(result.rank(0))
    if shown is not None:
        print(shown)  # noqa: T201 (the command's output)
    return EXIT_OK
