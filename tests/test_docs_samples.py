"""The sample outputs in the docs are what the code prints today, so that they cannot drift.

Each sample is made again here, in an environment made to match the one the page shows (its
forwarded variables), and compared line by line with the page's block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from torchrunx.cli import add_launcher_arguments

DOCS = Path(__file__).resolve().parent.parent / "docs"
ROOT = DOCS.parent


def _block_after(page: str, first_line: str) -> list[str]:
    """The lines of the fenced block that holds ``first_line``, from the line after it."""
    text = (DOCS / page).read_text()
    start = text.index(first_line + "\n") + len(first_line) + 1
    return text[start : text.index("```", start)].rstrip("\n").splitlines()


def _bare_env(**extra: str) -> dict[str, str]:
    """Only ``PATH`` and ``extra``: the forwarded variables a sample shows are exactly these."""
    return {"PATH": os.environ["PATH"], **extra}


def test_the_commands_dry_run_sample_is_what_the_command_prints(tmp_path):
    (tmp_path / "train.py").write_text("")
    command = "torchrunx --hostnames localhost --workers-per-host 2 --dry-run -- train.py --lr 0.1"
    shown = _block_after("cli.md", f"$ {command}")
    printed = subprocess.run(
        [sys.executable, "-m", "torchrunx", *command.split()[1:]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_bare_env(PYTHONPATH=str(ROOT), TORCHRUNX_LOG_DIR=str(tmp_path / "logs")),
        timeout=60,
        check=True,
    ).stdout
    assert printed.rstrip("\n").splitlines() == shown


def test_the_dry_run_sample_of_getting_started_is_what_dry_run_returns(tmp_path):
    call = (
        'print(trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo").dry_run())'
    )
    shown = _block_after("index.md", f">>> {call}")
    printed = subprocess.run(
        [sys.executable, "-c", f"import torchrunx as trx; {call}"],
        capture_output=True,
        text=True,
        cwd=ROOT,  # torchrunx importable as in a checkout; PYTHONPATH would be forwarded
        env=_bare_env(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1"),
        timeout=60,
        check=True,
    ).stdout
    assert printed.rstrip("\n").splitlines() == shown


def test_the_command_pages_option_list_names_every_option():
    import argparse

    parser = argparse.ArgumentParser()
    add_launcher_arguments(parser)
    options = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    options -= {"--help"}
    text = (DOCS / "cli.md").read_text()
    paragraph = text[text.index("The options are the `Launcher` fields") :]
    paragraph = paragraph[: paragraph.index("\n\n")]
    named = set(re.findall(r"`(--[a-z-]+)`", paragraph))
    named |= {n for pair in re.findall(r"`(--[a-z-]+)`/`(--[a-z-]+)`", paragraph) for n in pair}
    assert options - named == set()
