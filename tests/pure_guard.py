"""Which tests guard a module in ``scripts/mutation.py``, and a guard that they start no process.

``scripts/mutation.py`` runs its guarding tests (``TARGETS``, less ``IMPURE`` and
``SOURCE_READERS``) in a copy of the tree whose ``conftest.py`` refuses to start a process:
a guarding test that starts one breaks the mutation run. That run comes last in CI, after the
whole suite; the same guard here, on the same tests, in every pytest run (the quick tier too),
names such a test at once instead (tests/conftest.py, ``pure_tests_start_no_process``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import pytest

ROOT = Path(__file__).resolve().parent.parent
HOST_FIXTURES = frozenset({"cluster", "slurm", "isolated", "isolated_module"})
"""Tests that use these run on test hosts: scripts/mutation.py never runs them."""
STARTERS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")


class ProcessStartedError(BaseException):
    """A test that guards a module of scripts/mutation.py started a process.

    A :class:`BaseException`: the code under test, catching ``OSError`` or ``Exception`` where a
    process fails to start, must not take it for a failed start and go on.
    """


@functools.cache
def guarded() -> tuple[frozenset[str], tuple[str, ...]]:
    """The guarding test files (relative to the checkout) and the node ids left out of them.

    None in scripts/mutation.py's own copy of the tree, which has no ``scripts`` folder: the
    copy's ``conftest.py`` has the script's guard instead.
    """
    script = ROOT / "scripts/mutation.py"
    if not script.is_file() and not (ROOT / ".git").exists():
        return frozenset(), ()
    spec = importlib.util.spec_from_file_location("_trx_mutation", script)
    if spec is None or spec.loader is None:
        raise ImportError("scripts/mutation.py cannot be loaded")
    mutation: Any = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mutation  # its dataclasses look their module up there
    spec.loader.exec_module(mutation)
    files = frozenset(test.split("::")[0] for t in mutation.TARGETS.values() for test in t.tests)
    return files, (*mutation.IMPURE, *mutation.SOURCE_READERS)


def is_guarded(item: pytest.Item) -> bool:
    """Whether scripts/mutation.py runs ``item`` under its no-process guard."""
    files, left_out = guarded()
    nodeid = item.nodeid
    if nodeid.split("::")[0] not in files or nodeid.startswith(left_out):
        return False
    return not HOST_FIXTURES & set(getattr(item, "fixturenames", ()))


def refuse(*_args: object, **_kwargs: object) -> NoReturn:
    """What starting a process does in a guarded test."""
    raise ProcessStartedError(
        "this test guards a module of scripts/mutation.py, whose run refuses to start any "
        "process: make it pure (a fake of the process's answer) or list it in IMPURE there"
    )


def forbid_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every way of starting a process raise :class:`ProcessStartedError`."""
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    for name in STARTERS:
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
