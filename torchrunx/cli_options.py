"""Argparse options for the fields of a dataclass, as ``tyro.cli`` offers them.

Each field gets the option that ``tyro.cli(cls)`` has for it: its names (``--workers-per-host``;
a ``bool`` with a default: ``--flag`` and ``--no-flag``), its number of words and its value
forms (``{auto,slurm}|STR|PATH``), from tyro's public constructor registry
(:class:`tyro.constructors.ConstructorRegistry`); its help is the field's docstring and its
default. The option stores the value that tyro reads from its words under the field's name.
:func:`torchrunx.cli.add_launcher_arguments` adds those of :class:`~torchrunx.Launcher`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import io
import itertools
import re
import shlex
import textwrap
import typing
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "add_dataclass_arguments",
    "dataclass_from_namespace",
    "options_by_group",
    "typed_arguments",
]


def add_dataclass_arguments(group: argparse._ArgumentGroup, cls: type[Any]) -> list[str]:
    """Add to ``group`` the options tyro makes for the fields of the dataclass ``cls``.

    Returns the names of the fields that got an option, in order.

    tyro's constructor registry gives each field's ``nargs`` and metavar, and its docstring
    the help; the option is added with :class:`_FieldAction`, which stores the value as tyro
    reads it under the field's name. Fields that tyro suppresses (``tyro.conf.Suppress``) or
    that are not ``__init__`` arguments get no option.

    Raises:
        TypeError: A field that tyro does not read as one option: a dict or a dataclass (tyro
            makes one option per key or field of its default), or a type it cannot read at all.
    """
    import tyro  # noqa: PLC0415 (only the launcher's side needs tyro)
    from tyro.constructors import (  # noqa: PLC0415
        ConstructorRegistry,
        PrimitiveConstructorSpec,
        PrimitiveTypeInfo,
        StructConstructorSpec,
        StructTypeInfo,
    )

    hints = typing.get_type_hints(cls, include_extras=True)
    bases = typing.get_type_hints(cls)  # without Annotated's markers
    docs = _field_docstrings(cls)
    added: list[str] = []
    for field in dataclasses.fields(cls):
        markers = getattr(hints[field.name], "__metadata__", ())
        if not field.init or tyro.conf.Suppress in markers:
            continue
        base = bases[field.name]
        has_default = not (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        default = _field_default(field)
        primitive = PrimitiveTypeInfo.make(hints[field.name], set())
        spec = ConstructorRegistry.get_primitive_spec(primitive)
        struct = StructTypeInfo.make(
            hints[field.name],
            default if has_default else tyro.MISSING_NONPROP,
            in_union_context=False,
        )
        if (
            not isinstance(spec, PrimitiveConstructorSpec)
            or tyro.conf.Fixed in markers
            or dict in (base, typing.get_origin(base))
            or isinstance(ConstructorRegistry.get_struct_spec(struct), StructConstructorSpec)
        ):
            raise TypeError(
                f"field {field.name!r} has a type the command line cannot read ({base!r}) as one "
                "option; mark it with Annotated[..., tyro.conf.Suppress]"
            )
        option = "--" + field.name.replace("_", "-")
        names: list[str] = [option]
        nargs: int | str = "*" if isinstance(spec.nargs, tuple) else spec.nargs
        metavar: str | None = spec.metavar
        if base is bool and has_default:  # tyro's flags: --name and --no-name
            names, nargs, metavar = [option, "--no-" + option[2:]], 0, None
        group.add_argument(
            *names,
            action=_FieldAction,
            nargs=nargs,
            dest=field.name,
            default=default,
            metavar=_word_metavar(metavar, nargs),
            field_type=hints[field.name],
            doc=docs.get(field.name, "").replace("%", "%%"),
        )
        added.append(field.name)
    return added


def options_by_group(
    about: str, groups: Mapping[str, Sequence[str]], offered: Sequence[str]
) -> str:
    """``about``, then a line per group naming its fields that have an option (``offered``).

    Names without ``--``: a wrapped line never starts like an option's own line.
    """
    lines = [about]
    for name, fields in groups.items():
        options = ", ".join(f.replace("_", "-") for f in fields if f in offered)
        first, indent = f"  {name}: ", "      "
        wrap = textwrap.TextWrapper(88, first, indent, break_on_hyphens=False)
        lines.append(wrap.fill(options))
    return "\n".join(lines)


def dataclass_from_namespace(cls: type[Any], namespace: argparse.Namespace) -> Any:  # noqa: ANN401 (an instance of cls)
    """An instance of the dataclass ``cls`` with the fields found in ``namespace``."""
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name in namespace]
    return cls(**{name: getattr(namespace, name) for name in names})


def typed_arguments(func: Any, words: Sequence[str], name: str) -> tuple[object, ...]:  # noqa: ANN401 (any callable)
    """``words`` read as the types of ``func``'s positional parameters, as tyro reads a value.

    ``steps: int`` gets ``50`` for the word ``50``; ``path: Path``, ``x: float | None``
    (``None``), ``mode: Literal["a", "b"]``, ``flag: bool`` (``True``/``False``) likewise; a
    parameter without an annotation, annotated ``str``, or of a type that tyro does not read
    from one word gets the word as it is. Words past the parameters go to ``*args`` (its
    annotation applies), or to the call, which says that there are too many.

    Raises:
        ValueError: A word is not a value of its parameter's type (the message names the
            argument, the parameter, its type and ``name``, the function as the user wrote it).
    """
    import tyro  # noqa: PLC0415 (only where a command's function is called)

    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a builtin: no signature to read
        return tuple(words)
    hints = _annotations(func)
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = next((p for p in parameters if p.kind is p.VAR_POSITIONAL), None)
    values: list[object] = []
    for index, word in enumerate(words):
        parameter = positional[index] if index < len(positional) else rest
        hint = None if parameter is None else hints.get(parameter.name)
        if parameter is None or hint is None or hint is str:
            values.append(word)
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                value = tyro.cli(hint, args=["--", word], console_outputs=False)  # type: ignore[call-overload]
                values.append(value)
        except SystemExit:
            shown = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            raise ValueError(
                f"argument {index + 1} of {name} ({parameter.name}: {shown}) cannot be {word!r}: "
                f"the function's annotation asks for {shown}"
            ) from None
        except Exception:  # noqa: BLE001 (a type tyro cannot read: the word, as before)
            values.append(word)
    return tuple(values)


def _annotations(func: Any) -> dict[str, object]:  # noqa: ANN401 (any callable)
    """``func``'s parameter annotations, each resolved alone (one that does not is left out)."""
    try:
        return typing.get_type_hints(func)
    except Exception:  # noqa: BLE001 (a name that does not resolve: try each one alone)
        hints: dict[str, object] = {}
    namespace = getattr(func, "__globals__", {})
    for name, annotation in getattr(func, "__annotations__", {}).items():
        with contextlib.suppress(Exception):
            hints[name] = (
                eval(annotation, namespace)  # noqa: S307 (as typing.get_type_hints does)
                if isinstance(annotation, str)
                else annotation
            )
    return hints


def _field_docstrings(cls: type[Any]) -> dict[str, str]:
    """The docstring of each field of ``cls`` (and of its dataclass bases), as tyro shows it.

    Lines are joined (a blank line stays), common indentation is removed. A class whose source
    cannot be read has none.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef))
        for node, following in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                doc = inspect.cleandoc(following.value.value)
                docs[node.target.id] = re.sub(r"(?<!\n)\n(?!\n)", " ", doc).strip()
    return docs


def _field_default(field: dataclasses.Field[Any]) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _word_metavar(metavar: str | None, nargs: int | str) -> str | None:
    """The metavar tyro gives an option; for a list option, the forms of one word.

    argparse writes a ``nargs="*"`` option as ``[METAVAR ...]``, so tyro's list forms
    (``{[STR [STR ...]]}``) become their item and each form is listed once:
    ``{auto,slurm}|{[STR [STR ...]]}|PATH`` becomes ``{auto,slurm}|STR|PATH``.
    """
    if metavar is None or nargs not in ("*", "+"):
        return metavar
    items = re.sub(r"\{?\[(.+?) \[\1 \.\.\.\]\]\}?", r"\1", metavar)
    return "|".join(dict.fromkeys(items.replace(" ", "|").split("|")))


class _FieldAction(argparse.Action):
    """Stores one dataclass field: a flag's ``True``/``False``, or the value tyro reads.

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
        """The field's docstring (escaped for argparse) and the current default."""
        return f"{self.doc} (default: {_show_default(self.default).replace('%', '%%')})".strip()

    @help.setter  # noqa: A003 (argparse reads and writes action.help)
    def help(self, value: str | None) -> None:
        """Ignored: the help is made from the docstring and the default."""

    def __call__(
        self,
        _parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        """Store the flag's value, or the value tyro reads from the option's words."""
        import tyro  # noqa: PLC0415 (only the launcher's side needs tyro)

        value: object = not (option_string or "").startswith("--no-")
        if self.nargs != 0:
            words = [values] if isinstance(values, str) else list(values or [])
            try:  # "--": every word is a value, even "-1"; tyro prints some errors regardless
                with contextlib.redirect_stderr(io.StringIO()):
                    value = tyro.cli(self.field_type, args=["--", *words], console_outputs=False)  # type: ignore[call-overload]
            except SystemExit:
                shown = " ".join(shlex.quote(w) for w in words) or "nothing"
                message = f"invalid value {shown}: expected {self.metavar}"
                raise argparse.ArgumentError(self, message) from None
        setattr(namespace, self.dest, value)


def _show_default(value: object) -> str:
    if isinstance(value, list | tuple):
        return " ".join(shlex.quote(str(v)) for v in value) if value else "empty"
    if isinstance(value, str) and value:
        return shlex.quote(value)
    return str(value)
