"""Frozen dataclasses that cost little to define: :func:`frozen`, for the host side's classes.

``dataclass(frozen=True)`` writes six methods as source for every class and compiles each
(``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``): about
0.7 ms per class here, and the agent's import defined 35 such classes (27 of them the wire's
messages), a fifth of its import time. :func:`frozen` makes the same class without
``dataclasses`` and gives it six methods written once here that read the class's fields: the
same positional and keyword arguments and defaults, repr, equality, hash and
:class:`dataclasses.FrozenInstanceError` as ``dataclass(frozen=True)``. The class is a
dataclass still (``dataclasses.fields``, ``replace``, ``asdict`` and ``is_dataclass`` work), and
type checkers read it as a frozen one (``dataclass_transform``): its ``__dataclass_fields__``
are made by ``dataclasses`` the first time something reads them. Until then nothing imports
``dataclasses`` (with ``inspect``, ``ast``, ``dis`` and ``tokenize``: about a fifth of the
agent's import, which reads no class's fields before its hello, issue #48). A field's options
are given with :func:`field` (or ``dataclasses.field``).
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, overload

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:

    def dataclass_transform(**_: object) -> Any:  # noqa: ANN401 (a no-op at run time)
        """Only type checkers read it (``typing`` has it from Python 3.11 on)."""
        return lambda decorated: decorated


_T = TypeVar("_T")

_FIELDS = "__frozen_fields__"
"""A class's field names, in order."""
_TEMPLATE = "__frozen_template__"
"""A class's fields in order, each with its default or :data:`_MISSING`: a new instance's
``__dict__`` starts as a copy of it."""
_SHOWN = "__frozen_shown__"
"""The fields that the repr shows (not those of ``field(repr=False)``)."""
_MISSING: Any = object()
_MADE = threading.Lock()
"""Held while ``dataclasses`` makes a class's fields (:class:`_DataclassFields`)."""


class _Field:
    """What :func:`field` returns: a field's default and whether its repr shows it."""

    __slots__ = ("default", "repr")

    def __init__(self, default: object, *, repr: bool) -> None:  # noqa: A002 (field's own name)
        self.default = default
        self.repr = repr


@overload
def field(*, default: _T, repr: bool = True) -> _T: ...
@overload
def field(*, repr: bool = True) -> Any: ...  # noqa: ANN401
def field(*, default: object = _MISSING, repr: bool = True) -> Any:  # noqa: A002
    """A field of a :func:`frozen` class with options: ``default``, ``repr=False``.

    As ``dataclasses.field`` with those two (which :func:`frozen` takes too), without importing
    ``dataclasses``.
    """
    return _Field(default, repr=repr)


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def frozen(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a frozen dataclass, as ``@dataclass(frozen=True)`` does, compiling nothing.

    Fields may have a default and ``repr=False`` (:func:`field`); not a ``default_factory``, nor
    ``init=False``, nor ``compare=False`` (refused here with ``TypeError``), and the class may
    not define ``__post_init__`` nor inherit from a dataclass.
    """
    if any("__dataclass_fields__" in vars(base) for base in cls.__mro__[1:]):
        raise TypeError(f"{cls.__qualname__}: frozen takes no dataclass base")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__qualname__}: frozen has no __post_init__")
    template: dict[str, object] = {}
    shown = []
    hidden: dict[str, object] = {}
    for name in cls.__annotations__:  # its own (Python 3.10 on), as dataclasses reads them
        default, show = _options(cls, name, vars(cls).get(name, _MISSING))
        template[name] = default
        if show:
            shown.append(name)
        else:
            hidden[name] = default
        if default is _MISSING:  # as dataclasses leaves it: no class attribute
            if name in vars(cls):
                delattr(cls, name)
        else:
            setattr(cls, name, default)
    setattr(cls, _FIELDS, tuple(template))
    setattr(cls, _TEMPLATE, template)
    setattr(cls, _SHOWN, tuple(shown))
    for method in (_init, _repr, _eq, _hash, _setattr, _delattr):
        setattr(cls, method.__name__, method)
    if "__match_args__" not in vars(cls):
        setattr(cls, "__match_args__", tuple(template))  # noqa: B010 (typed classes refuse it)
    for name in ("__dataclass_fields__", "__dataclass_params__"):
        setattr(cls, name, _DataclassFields(name, hidden))
    return cls


def _options(cls: type, name: str, value: object) -> tuple[object, bool]:
    """A field's default (or :data:`_MISSING`) and whether the repr shows it.

    From its value in the class body: a plain default, :func:`field`'s, or
    ``dataclasses.field``'s.
    """
    made = sys.modules.get("dataclasses")
    if isinstance(value, _Field):
        default, shown = value.default, value.repr
    elif made is None or not isinstance(value, made.Field):  # (none made without the module)
        default, shown = value, True
    else:
        if value.default_factory is not made.MISSING or not value.init:
            raise TypeError(f"{cls.__qualname__}.{name}: frozen takes plain defaults only")
        if not value.compare or value.hash is not None:
            raise TypeError(f"{cls.__qualname__}.{name}: frozen compares every field")
        default = _MISSING if value.default is made.MISSING else value.default
        shown = bool(value.repr)
    if default is not _MISSING and type(default).__hash__ is None:  # as dataclasses refuses
        raise ValueError(
            f"mutable default {type(default)} for field {name} is not allowed: use default_factory"
        )
    return default, shown


class _DataclassFields:
    """A :func:`frozen` class's ``__dataclass_fields__`` or ``__dataclass_params__`` until read.

    Once read, ``dataclasses`` makes both, as ``dataclass(init=False, repr=False, eq=False)``
    makes them, in place of the two descriptors (the class's methods stay :func:`frozen`'s).
    """

    def __init__(self, name: str, hidden: dict[str, object]) -> None:
        self.name = name
        """Which of the two this one stands for."""
        self.hidden = hidden
        """The fields of ``repr=False``, with their defaults (:data:`_MISSING`: none)."""

    def __get__(self, instance: object, owner: type) -> Any:  # noqa: ANN401 (what dataclasses makes)
        import dataclasses  # noqa: PLC0415 (the reason for this class)

        with _MADE:
            if isinstance(vars(owner).get("__dataclass_fields__"), _DataclassFields):
                del owner.__dataclass_fields__  # type: ignore[attr-defined]
                del owner.__dataclass_params__  # type: ignore[attr-defined]
                for name, default in self.hidden.items():
                    shown_as = (
                        dataclasses.field(repr=False)
                        if default is _MISSING
                        else dataclasses.field(default=default, repr=False)
                    )
                    setattr(owner, name, shown_as)  # dataclasses sets the default back
                dataclasses.dataclass(init=False, repr=False, eq=False)(owner)
        return getattr(owner if instance is None else instance, self.name)


def _init(self: object, *args: object, **kwargs: object) -> None:
    names: tuple[str, ...] = getattr(type(self), _FIELDS)
    if kwargs or len(args) != len(names):
        self.__dict__.update(_bind(type(self), names, args, kwargs))
    else:  # every field, in order
        self.__dict__.update(zip(names, args, strict=True))


_init.__name__ = "__init__"


def _bind(
    cls: type, names: tuple[str, ...], args: tuple[object, ...], kwargs: dict[str, object]
) -> dict[str, object]:
    """The fields' values, in order, from ``__init__``'s arguments and the defaults."""
    values: dict[str, object] = dict(getattr(cls, _TEMPLATE))
    values.update(zip(names, args, strict=False))  # too many: refused below
    values.update(kwargs)
    if (
        len(values) != len(names)
        or len(args) > len(names)
        or (args and not kwargs.keys().isdisjoint(names[: len(args)]))
        or any(value is _MISSING for value in values.values())  # (no field's __eq__ called)
    ):
        _refuse(cls, names, args, kwargs)
    return values


def _refuse(
    cls: type, names: tuple[str, ...], args: tuple[object, ...], kwargs: dict[str, object]
) -> NoReturn:
    """Raise the ``TypeError`` that Python raises for such arguments to such a signature."""
    where = f"{cls.__qualname__}.__init__()"
    if len(args) > len(names):
        raise TypeError(
            f"{where} takes {len(names) + 1} positional arguments but {len(args) + 1} were given"
        )
    for name in kwargs:
        if name not in names:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
        if name in names[: len(args)]:
            raise TypeError(f"{where} got multiple values for argument {name!r}")
    template: dict[str, object] = getattr(cls, _TEMPLATE)
    missing = [
        repr(name)
        for i, name in enumerate(names)
        if i >= len(args) and name not in kwargs and template[name] is _MISSING
    ]
    listed = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
    plural = "s" if len(missing) > 1 else ""
    raise TypeError(f"{where} missing {len(missing)} required argument{plural}: {listed}")


def _repr(self: object) -> str:
    shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in getattr(type(self), _SHOWN))
    return f"{type(self).__qualname__}({shown})"


_repr.__name__ = "__repr__"


def _values(self: object) -> tuple[object, ...]:
    return tuple([getattr(self, name) for name in getattr(type(self), _FIELDS)])


def _eq(self: object, other: object) -> object:
    if other.__class__ is self.__class__:
        return _values(self) == _values(other)
    return NotImplemented


_eq.__name__ = "__eq__"


def _hash(self: object) -> int:
    return hash(_values(self))


_hash.__name__ = "__hash__"


def _setattr(self: object, name: str, value: object) -> None:  # noqa: ARG001
    import dataclasses  # noqa: PLC0415 (only to raise its error)

    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


_setattr.__name__ = "__setattr__"


def _delattr(self: object, name: str) -> None:  # noqa: ARG001
    import dataclasses  # noqa: PLC0415 (only to raise its error)

    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


_delattr.__name__ = "__delattr__"
