"""The documentation site builds with no warning, and its API page covers every public name."""

import os
import subprocess
import sys
from pathlib import Path

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
    # other entry lives in one of the four public modules it names, and imports from there.
    import importlib
    import re

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    entries = re.findall(r"^::: torchrunx\.([\w.]+)", text, flags=re.MULTILINE)
    top = {entry for entry in entries if "." not in entry}
    inner = [entry for entry in entries if "." in entry]
    assert top - {"events"} == set(torchrunx.__all__)
    public_modules = {"timer", "events", "hosts", "plugins"}
    for entry in inner:
        module, _, name = entry.rpartition(".")
        assert module in public_modules, entry
        assert hasattr(importlib.import_module(f"torchrunx.{module}"), name), entry
