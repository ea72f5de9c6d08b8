"""The notes torchrunx adds to an error (the output tail, other failures, where it was raised)
are printed on every supported Python: 3.11+ prints ``__notes__`` itself, 3.10 does not."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
import traceback
from pathlib import Path

import pytest

from torchrunx import errors
from torchrunx.errors import RemoteTraceback, WorkerFailedError, add_note

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("errors", sys.argv[1])
errors = importlib.util.module_from_spec(spec)
spec.loader.exec_module(errors)  # errors.py needs nothing but the standard library

own = errors.LaunchTimeoutError("the launch ran past its launch_timeout")
errors.add_note(own, "last output of rank 1: step 41")
user = ValueError("bad batch")
user.__cause__ = errors.RemoteTraceback("Traceback (most recent call last):\\n  ...")
errors.add_note(user, "raised in worker rank 1 (local rank 1 on host 'node2', pid 7)")
for error in (own, user):
    try:
        raise error
    except Exception:
        sys.excepthook(*sys.exc_info())
"""


def formatted(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def test_notes_are_printed_here(monkeypatch):
    error = WorkerFailedError("node2", 1, 3, 77, 1, None)
    add_note(error, "its last lines: step 41")
    assert "its last lines: step 41" in formatted(error)


def test_without_printed_notes_an_own_error_carries_them_in_its_message(monkeypatch):
    monkeypatch.setattr(errors, "NOTES_PRINTED", False)
    error = errors.LaunchTimeoutError("past launch_timeout")
    add_note(error, "first note")
    add_note(error, "second note")
    assert str(error) == "past launch_timeout\nfirst note\nsecond note"
    assert error.__notes__ == ["first note", "second note"]


def test_without_printed_notes_a_workers_exception_shows_them_under_its_traceback(monkeypatch):
    monkeypatch.setattr(errors, "NOTES_PRINTED", False)
    error = ValueError("bad batch")
    error.__cause__ = RemoteTraceback("Traceback (most recent call last):\n  ...")
    add_note(error, "raised in worker rank 1")
    assert str(error) == "bad batch"  # the user's message is left as it was
    assert str(error.__cause__).endswith("...\nraised in worker rank 1")


def python_3_10() -> str | None:
    """A real Python 3.10 binary: on PATH (not a pyenv shim, which may refuse), or pyenv's."""
    found = [shutil.which("python3.10")]
    found += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))
    for python in found:
        if python is None or "/shims/" in python:
            continue
        return python
    return None


def test_python_3_10_prints_the_notes():
    python = python_3_10()
    if python is None:
        pytest.skip("no Python 3.10 interpreter on this machine (on PATH or under ~/.pyenv)")
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert version.stdout.strip() == "(3, 10)"
    done = subprocess.run(
        [python, "-c", textwrap.dedent(SCRIPT), str(ROOT / "torchrunx" / "errors.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "LaunchTimeoutError: the launch ran past its launch_timeout" in done.stderr, done.stderr
    assert "last output of rank 1: step 41" in done.stderr, done.stderr
    assert "raised in worker rank 1 (local rank 1 on host 'node2', pid 7)" in done.stderr
