"""The documentation site builds with no warning, covers every public name, and its runnable snippets run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchrunx

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strict(tmp_path):
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict"]
    command += ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner, not a problem
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, (
        f"mkdocs build --strict failed (exit {done.returncode}):\n"
        f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    )
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert "Launcher" in api
    assert "LaunchResult" in api
    # Every exported name has its own entry (mkdocstrings gives it the id "torchrunx.NAME").
    missing = [name for name in torchrunx.__all__ if f'id="torchrunx.{name}"' not in api]
    assert not missing, f"docs/api.md does not document {missing}"


def test_the_api_page_documents_all_of_dunder_all_and_public_modules_only():
    # What docs/api.md says of itself: top-level entries are exactly torchrunx.__all__; every
    # other entry lives in one of the five public modules it names, and imports from there.
    import importlib
    import re

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    entries = re.findall(r"^::: torchrunx\.([\w.]+)", text, flags=re.MULTILINE)
    top = {entry for entry in entries if "." not in entry}
    inner = [entry for entry in entries if "." in entry]
    assert top - {"events"} == set(torchrunx.__all__)
    public_modules = {"timer", "events", "hosts", "plugins", "engines"}
    for entry in inner:
        module, _, name = entry.rpartition(".")
        assert module in public_modules, entry
        assert hasattr(importlib.import_module(f"torchrunx.{module}"), name), entry


def test_every_test_the_docs_name_exists():
    # docs/security.md (and any page) backs its claims with tests named `file.py::test_name`;
    # on the same line `..._rest_of_a_name` names another test of that file (`...` stands for
    # a shared part). A renamed or removed test must not leave a claim pointing at nothing.
    import fnmatch
    import re

    missing, seen = [], 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        for line in page.read_text().splitlines():
            named = re.findall(r"`(?:tests/)?(test_\w+\.py)::([\w.]+)`", line)
            if not named:
                continue
            file_name = named[0][0]
            source = ROOT / "tests" / file_name
            assert source.is_file(), f"{page.name} names {file_name}, which does not exist"
            defined = re.findall(r"^def (test_\w+)", source.read_text(), flags=re.MULTILINE)
            tests = [test for _, test in named] + re.findall(r"`(\.\.\.[\w.]+)`", line)
            for test in tests:
                seen += 1
                if not fnmatch.filter(defined, test.replace("...", "*")):
                    missing.append(f"{page.name}: {file_name}::{test}")
    assert seen > 10  # the docs do name tests: the pattern above still finds them
    assert not missing, "tests named in the docs but not found:\n" + "\n".join(missing)


RUNNABLE = "<!-- runnable -->"


def runnable_snippets() -> list[tuple[str, str, str, str]]:
    """``(where, language, file name, code)`` of each block marked runnable in the docs."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() != RUNNABLE:
                continue
            fence = lines[number + 1]
            assert fence.startswith("```"), f"{page.name}:{number + 2}: a fence must follow"
            match = re.match(r"```(\w+)(?:\s+title=\"([^\"]+)\")?", fence)
            assert match, f"{page.name}:{number + 2}: {fence!r}"
            language, title = match.group(1), match.group(2)
            end = lines.index("```", number + 2)
            code = "\n".join(lines[number + 2 : end]) + "\n"
            where = f"{page.relative_to(ROOT)}:{number + 2}"
            found.append(
                (
                    where,
                    language,
                    title or f"snippet.{'py' if language == 'python' else 'sh'}",
                    code,
                )
            )
    return found


SNIPPETS = runnable_snippets()


def test_the_docs_mark_their_first_steps_runnable():
    places = {where.split(":")[0] for where, *_ in SNIPPETS}
    assert {"README.md", "docs/index.md"} <= places
    assert all(language in {"bash", "python"} for _, language, _, _ in SNIPPETS)


@pytest.mark.parametrize(
    ("where", "language", "name", "code"), SNIPPETS, ids=[s[0] for s in SNIPPETS]
)
def test_every_runnable_snippet_runs(where, language, name, code, tmp_path):
    # In a fresh folder, as a reader would run it: the checkout importable, its examples at
    # hand, `python` and `torchrunx` those of this environment.
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / name).write_text(code)
    bin_dir = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "TORCHRUNX_LOG_DIR": str(tmp_path / "logs"),
    }
    argv = [sys.executable, name] if language == "python" else ["bash", "-euo", "pipefail", name]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (
        f"{where}\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
