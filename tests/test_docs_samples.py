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


def _page_has_line(page: str, line: str) -> None:
    text = (DOCS / page).read_text()
    assert line in text.splitlines(), f"docs/{page} lacks the line the code prints:\n{line}"


def test_the_hint_samples_are_what_the_hints_say():
    from torchrunx.launcher.view.logrouter import auto_cores_text

    _page_has_line("logging.md", (auto_cores_text([("login1", 64)]) or "").rstrip("\n"))


def test_the_progress_sample_is_the_progress_line():
    from torchrunx.launcher.view.progress import mib, progress_text

    line = (
        progress_text("agents starting", 5, 8, "hosts up", 2.3)
        + f"; code shipped: {mib(12 * 2**20)}"
    )
    _page_has_line("logging.md", line)


def test_the_live_views_sample_is_what_top_prints():
    from torchrunx.commands.top import Ages, Screen

    figures = [  # pid, cpu, rss, gpu, collectives, loss
        (5883, 98.4, 2.7, 94, 1532, "2.31"),
        (5884, 97.0, 2.7, 95, 1532, "2.29"),
        (7710, 99.0, 2.7, 93, 1530, "2.30"),
        (7711, 96.2, 2.7, 94, 1532, "2.33"),
    ]
    workers = [
        {
            "rank": r,
            "host_index": r // 2,
            "hostname": f"node{r // 2 + 1}",
            "local_rank": r % 2,
            "pid": pid,
            "state": "HEALTHY",
            "cpu_percent": cpu,
            "rss_bytes": int(rss * (1 << 30)),
            "gpu_percent": gpu,
            "gpu_memory_bytes": 39 << 30,
            "collectives": count,
        }
        for r, (pid, cpu, rss, gpu, count, _) in enumerate(figures)
    ]
    snapshot = {
        "pid": 5872,
        "log_dir": "torchrunx_logs/2026-11-28T10:24:20",
        "report": {
            "healthy": True,
            "launch_state": "running",
            "attempt": 0,
            "restarts": 0,
            "max_restarts": 1,
            "uptime": 41.2,
            "agents": [
                {"hostname": h, "state": "RUNNING", "last_heartbeat_age": age, "role": "host"}
                for h, age in (("node1", 0.4), ("node2", 0.1))
            ],
            "workers": workers,
            "failures": [],
            "world_changes": [],
        },
        "last_lines": {
            f"{r // 2}:{r % 2}": f"step 170 loss {loss}" for r, (*_, loss) in enumerate(figures)
        },
    }
    ages = Ages()
    screen = Screen()
    screen.lines(snapshot, ages, now=0.0)  # first seen in that state 38.5 s before
    assert screen.lines(snapshot, ages, now=38.5) == _top_sample()


def _top_sample() -> list[str]:
    text = (DOCS / "logging.md").read_text()
    start = text.index("```\nlaunch pid 5872") + 4
    return text[start : text.index("```", start)].rstrip("\n").splitlines()
