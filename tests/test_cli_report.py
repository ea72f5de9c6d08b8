"""``torchrunx report``: the page's rules (pure), and a real launch's page in headless Chromium."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx.commands.logs import launch_summary, launches, rank_files
from torchrunx.commands.report import COLORS, render

T0 = 1_000.0


def _events() -> list[dict[str, object]]:
    return [
        {"event": "LaunchStarted", "hostnames": ["a"], "time": T0},
        {
            "event": "AgentStarted",
            "host_index": 0,
            "hostname": "a",
            "pid": 7,
            "start_seconds": 0.5,
            "time": T0 + 0.5,
        },
        {
            "event": "WorkersStarted",
            "host_index": 0,
            "hostname": "a",
            "attempt": 0,
            "ranks": [0, 1],
            "time": T0 + 1,
        },
        *(
            {
                "event": "WorkerStateChanged",
                "rank": r,
                "hostname": "a",
                "attempt": 0,
                "new": "HEALTHY",
                "time": T0 + 1,
            }
            for r in (0, 1)
        ),
        {
            "event": "WorkerStateChanged",
            "rank": 1,
            "hostname": "a",
            "attempt": 0,
            "new": "FAILED",
            "time": T0 + 2,
        },
        {
            "event": "WorkerFailed",
            "rank": 1,
            "hostname": "a",
            "local_rank": 1,
            "attempt": 0,
            "reason": "ValueError: <script>alert(1)</script>",
            "traceback": 'Traceback (most recent call last):\n  File "t.py", line 3\nValueError: <b>',
            "time": T0 + 2,
        },
        {"event": "Restarting", "attempt": 1, "time": T0 + 2.1},
        {"event": "Stalled", "time": T0 + 2.5},
        {
            "event": "LaunchFinished",
            "succeeded": False,
            "attempts": 2,
            "duration": 3.0,
            "error": "ValueError: x",
            "time": T0 + 3,
        },
    ]


def test_rule_the_page_shows_the_outcome_timeline_marks_and_first_failure_escaped(tmp_path):
    page = render(tmp_path / "L", _events(), [], tmp_path)
    assert page.startswith("<!DOCTYPE html>")
    assert (
        '<p id="outcome"><span class="failed">failed: ValueError: x</span>; hosts: a; attempts: 2</p>'
        in page
    )
    assert "<script>" not in page and "&lt;script&gt;" in page  # the user's text is text
    assert "ValueError: &lt;b&gt;</pre>" in page
    assert "rank 1 on a (local rank 1, attempt 0)" in page
    for label in ("agent a", "rank 0 (a)", "rank 1 (a)"):
        assert f'class="label">{label}</text>' in page
    assert page.count('class="mark"') == 2  # the restart and the stall
    assert ">restart</text>" in page and ">stalled</text>" in page
    assert 'class="failure"' in page
    assert "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )  # nothing fetched
    assert "<script" not in page.lower()


def test_rule_a_rank_still_running_when_the_events_end_is_drawn_to_the_end(tmp_path):
    events = _events()[:4]  # rank 0 became healthy; nothing after
    page = render(tmp_path / "L", events, [], tmp_path)
    assert "attempt 0: running</title>" in page
    assert "no end recorded (running, or killed)" in page


def test_rule_a_straggler_is_a_mark_and_the_run_ends_naming_it(tmp_path):
    events = _events()
    named = "rank 1 enters collectives 0.3 s after the median, over the last 50 <i>"
    events.insert(-1, {"event": "StragglerFound", "rank": 1, "text": named, "time": T0 + 1.5})
    events[-1] = {**events[-1], "stragglers": [named]}
    page = render(tmp_path / "L", events, [], tmp_path)
    assert page.count('class="mark"') == 3 and ">straggler</text>" in page
    assert (
        '<p class="straggler">straggler: rank 1 enters collectives 0.3 s after the median, over '
        "the last 50 &lt;i&gt;</p>" in page
    )
    events[-1] = {**events[-1], "stragglers": "not a list"}  # a damaged file: nothing named
    assert 'class="straggler"' not in render(tmp_path / "L", events, [], tmp_path)
    assert launch_summary(tmp_path / "L", [{**events[-1], "stragglers": [named]}]).endswith(
        f"failed: ValueError: x; stragglers: {named}"
    )


def _png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and rows of RGB(A) pixels of an 8-bit PNG (Chromium's screenshots)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    step = 3 if color == 2 else 4
    raw, stride, rows, previous = zlib.decompress(idat), width * step, [], bytearray(width * step)
    for y in range(height):
        kind, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            left = line[i - step] if i >= step else 0
            up, corner = previous[i], previous[i - step] if i >= step else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (
                    line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)
                ) & 255
        rows.append(
            bytes(line) if step == 3 else bytes(b for i, b in enumerate(line) if i % 4 != 3)
        )
        previous = line
    return width, height, rows


def _count(rows: list[bytes], color: str) -> int:
    rgb = bytes.fromhex(color[1:])
    return sum(sum(1 for i in range(0, len(row), 3) if row[i : i + 3] == rgb) for row in rows)


def fails_first_attempt_on_rank_1(folder: str) -> int:
    rank = int(os.environ["RANK"])
    marker = Path(folder) / "failed-once"
    if rank == 1 and not marker.exists():
        marker.touch()
        raise ValueError("rank 1 fails its first attempt")
    return rank


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="Debian's chromium is not installed (scripts/test.sh installs it)",
)
def test_a_real_launchs_report_renders_in_headless_chromium(tmp_path):
    logs = tmp_path / "logs"
    os.environ["TORCHRUNX_LOG_DIR"] = str(logs)
    try:
        result = trx.launch(
            fails_first_attempt_on_rank_1,
            (str(tmp_path),),
            hostnames=["localhost"],
            workers_per_host=2,
            backend=None,
            max_restarts=1,
        )
    finally:
        del os.environ["TORCHRUNX_LOG_DIR"]
    assert result.ranks == [0, 1]
    made = subprocess.run(
        [sys.executable, "-m", "torchrunx", "report", "--log-dir", str(logs)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    (folder,) = launches(logs)
    page = Path(made.stdout.strip())
    assert page == folder.with_name(f"{folder.name}.report.html")
    assert [p.name for p in logs.iterdir() if p.name.startswith(".")] == []  # no temporary left

    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(
        [*browser, "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert '<span class="ok">succeeded</span>' in dom  # as the browser parsed it
    assert (
        "rank 1 on localhost (local rank 1, attempt 0): ValueError: rank 1 fails its first attempt"
        in dom
    )
    assert 'raise ValueError("rank 1 fails its first attempt")' in dom  # the worker's traceback
    for f in rank_files(folder, []):  # every link leads to a log file
        assert f'href="{os.path.relpath(f.path, page.parent)}"' in dom.replace("%5B", "[").replace(
            "%5D", "]"
        )
    shot = tmp_path / "shot.png"
    subprocess.run(
        [*browser, f"--screenshot={shot}", "--window-size=1000,700", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    _, _, rows = _png_pixels(shot)
    # What a reader sees: the failure's red dot, ranks running, the succeeded ends, the restart.
    assert _count(rows, COLORS["FAILED"]) > 50
    assert _count(rows, COLORS["running"]) > 50
    assert _count(rows, COLORS["SUCCEEDED"]) > 20
    assert _count(rows, "#ff7f0e") > 10
