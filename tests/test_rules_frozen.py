"""``@frozen`` (torchrunx/wire/frozen.py) behaves as ``@dataclass(frozen=True)`` does."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from torchrunx.wire.frozen import frozen
from torchrunx.wire.messages import LogLines, WorkerSpec, _load_message


@dataclass(frozen=True)
class Made:
    a: int
    b: str
    c: float = 0.5
    d: tuple[int, ...] = ()
    secret: bytes = field(default=b"", repr=False)


@frozen
class Cheap:
    a: int
    b: str
    c: float = 0.5
    d: tuple[int, ...] = ()
    secret: bytes = field(default=b"", repr=False)


CALLS: list[tuple[tuple[object, ...], dict[str, object]]] = [
    ((1, "x"), {}),
    ((1, "x", 2.0, (3,), b"k"), {}),
    ((1,), {"b": "x", "d": (1, 2)}),
    ((), {"b": "y", "a": 2}),
    ((1, "x"), {"secret": b"s"}),
]
BAD_CALLS: list[tuple[tuple[object, ...], dict[str, object]]] = [
    ((), {}),
    ((1,), {}),
    ((1, "x", 2.0, (), b"", 9), {}),
    ((1, "x"), {"z": 1}),
    ((1, "x"), {"a": 2}),
    ((), {"a": 1, "c": 2.0}),
]


@pytest.mark.parametrize(("args", "kwargs"), CALLS)
def test_frozen_makes_what_a_frozen_dataclass_makes(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    made, cheap = Made(*args, **kwargs), Cheap(*args, **kwargs)  # type: ignore[arg-type]
    assert repr(cheap) == repr(made).replace("Made(", "Cheap(")
    assert vars(cheap) == vars(made)
    assert list(vars(cheap)) == [f.name for f in dataclasses.fields(Cheap)]  # the fields' order
    assert dataclasses.astuple(cheap) == dataclasses.astuple(made)
    assert hash(cheap) == hash(made)
    assert cheap == Cheap(*args, **kwargs)  # type: ignore[arg-type]
    assert cheap != Cheap(a=cheap.a + 1, b=cheap.b)
    assert cheap != made  # another class: not equal, as between two dataclasses
    assert pickle.loads(pickle.dumps(cheap)) == cheap  # noqa: S301 (its own bytes)
    assert copy.deepcopy(cheap) == cheap
    assert dataclasses.replace(cheap, c=9.0) == Cheap(cheap.a, cheap.b, 9.0, cheap.d, cheap.secret)


@pytest.mark.parametrize(("args", "kwargs"), BAD_CALLS)
def test_frozen_refuses_the_arguments_a_dataclass_refuses(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    with pytest.raises(TypeError) as made:
        Made(*args, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError) as cheap:
        Cheap(*args, **kwargs)  # type: ignore[arg-type]
    # The same complaint, in Python's words (a dataclass says "positional" where it is one).
    expected = str(made.value).replace("Made.", "Cheap.").replace(" positional", "")
    expected = expected.replace("from 3 to 6", "6")
    assert str(cheap.value).replace(" positional", "") == expected


def test_frozen_instances_cannot_change():
    cheap = Cheap(1, "x")
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'a'"):
        cheap.a = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'z'"):
        cheap.z = 2  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'a'"):
        del cheap.a  # type: ignore[misc]
    assert cheap == Cheap(1, "x")
    assert dataclasses.is_dataclass(cheap)


def test_frozen_refuses_what_it_cannot_do():
    with pytest.raises(TypeError, match="plain defaults only"):

        @frozen
        class Factory:
            items: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match="compares every field"):

        @frozen
        class Uncompared:
            a: int = field(default=0, compare=False)

    with pytest.raises(TypeError, match="no __post_init__"):

        @frozen
        class Checked:
            a: int

            def __post_init__(self) -> None:
                pass


def test_messages_are_frozen_and_travel_as_before():
    spec = WorkerSpec(
        host_index=0,
        hostname="h",
        num_workers=2,
        rank_offset=0,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=1,
        backend=None,
        timeout=5.0,
    )
    assert spec.attempt == 0
    assert spec.keep is False
    assert _load_message(pickle.dumps(spec)) == spec
    lines = LogLines(records=((0, 20, "x", "text", 1.0),))
    assert repr(lines) == "LogLines(records=((0, 20, 'x', 'text', 1.0),))"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.attempt = 1  # type: ignore[misc]


def test_frozen_classes_are_made_without_dataclasses_and_read_as_dataclasses():
    """``@frozen`` imports no ``dataclasses`` (issue #48: the agent's import); the fields that
    ``dataclasses`` makes when first read are those of ``dataclass(frozen=True)``'s twin."""
    code = (
        "import sys\n"
        "from torchrunx.wire.frozen import field, frozen\n"
        "from torchrunx.wire.messages import WorkerSpec\n"
        "@frozen\n"
        "class Lazy:\n"
        "    a: int\n"
        "    key: bytes = field(repr=False)\n"
        "    c: float = 0.5\n"
        "    secret: bytes = field(default=b'', repr=False)\n"
        "print('dataclasses' in sys.modules, 'inspect' in sys.modules)\n"
        "import dataclasses\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class Twin:\n"
        "    a: int\n"
        "    key: bytes = dataclasses.field(repr=False)\n"
        "    c: float = 0.5\n"
        "    secret: bytes = dataclasses.field(default=b'', repr=False)\n"
        "def shown(cls):\n"
        "    return [(f.name, f.type, f.default, f.repr, f.init) for f in dataclasses.fields(cls)]\n"
        "print(shown(Lazy) == shown(Twin), Lazy.__match_args__ == Twin.__match_args__)\n"
        "lazy = Lazy(1, b'k')\n"
        "print(repr(dataclasses.replace(lazy, c=2.0)), dataclasses.astuple(lazy) == (1, b'k', 0.5, b''))\n"
        "print(dataclasses.is_dataclass(WorkerSpec), len(dataclasses.fields(WorkerSpec)) > 5)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.splitlines() == [
        "False False",
        "True True",
        "Lazy(a=1, c=2.0) True",
        "True True",
    ]


def test_frozen_refuses_a_mutable_default_as_dataclasses_does():
    with pytest.raises(ValueError, match="mutable default"):

        @frozen
        class Listed:
            items: list[int] = []  # noqa: RUF012 (the mistake refused)
