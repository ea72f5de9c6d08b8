"""Frozen dataclasses that cost little to define: :func:`frozen`, for the host side's classes.

``dataclass(frozen=True)`` writes six methods as source for every class and compiles each
(``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``): about
0.7 ms per class here, and the agent's import defined 35 such classes (27 of them the wire's
messages), a fifth of its import time. :func:`frozen` makes the same class with
``dataclass(init=False, repr=False, eq=False)``, which compiles nothing, and gives it six
methods written once here that read the class's fields: the same positional and keyword
arguments and defaults, repr, equality, hash and :class:`dataclasses.FrozenInstanceError` as
``dataclass(frozen=True)``. The class is a dataclass still (``dataclasses.fields``,
``replace``, ``asdict`` and ``is_dataclass`` work), and type checkers read it as a frozen one
(``dataclass_transform``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

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


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def frozen(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a frozen dataclass, as ``@dataclass(frozen=True)`` does, compiling nothing.

    Fields may have a default and ``field(repr=False)``; not a ``default_factory``, nor
    ``init=False``, nor ``compare=False`` (refused here with ``TypeError``), and the class may
    not define ``__post_init__``.
    """
    made = dataclasses.dataclass(init=False, repr=False, eq=False)(cls)
    fields = dataclasses.fields(cast("Any", made))
    for field in fields:
        if field.default_factory is not dataclasses.MISSING or not field.init:
            raise TypeError(f"{cls.__qualname__}.{field.name}: frozen takes plain defaults only")
        if not field.compare or field.hash is not None:
            raise TypeError(f"{cls.__qualname__}.{field.name}: frozen compares every field")
    if hasattr(made, "__post_init__"):
        raise TypeError(f"{cls.__qualname__}: frozen has no __post_init__")
    setattr(made, _FIELDS, tuple(field.name for field in fields))
    template = {f.name: _MISSING if f.default is dataclasses.MISSING else f.default for f in fields}
    setattr(made, _TEMPLATE, template)
    setattr(made, _SHOWN, tuple(field.name for field in fields if field.repr))
    for method in (_init, _repr, _eq, _hash, _setattr, _delattr):
        setattr(made, method.__name__, method)
    return made


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
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


_setattr.__name__ = "__setattr__"


def _delattr(self: object, name: str) -> None:  # noqa: ARG001
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


_delattr.__name__ = "__delattr__"
