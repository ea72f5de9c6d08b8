"""``torchrunx report``: one self-contained HTML file about a launch, from its events and logs.

The page needs nothing from the network (clusters have no internet): the style is inline and
the timeline is an inline SVG drawing, without scripts. It shows the launch's outcome and
timings, a timeline per host and per rank (agent start, workers, their end; failures, restarts,
changes of hosts, quarantines, preemption and stalls marked), the first failure with the
worker's traceback, and links to every rank's log file. :func:`render` is pure: events and
files in, the page out.
"""

from __future__ import annotations

import argparse
import html
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from torchrunx.commands.logs import RankFile, find_launch, log_root, rank_files, read_events
from torchrunx.launcher.view.logdirs import events_file

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

COLORS = {
    "starting": "#b0b7c3",
    "agent": "#9ecae1",
    "running": "#3182bd",
    "SUCCEEDED": "#2ca02c",
    "FAILED": "#d62728",
    "STOPPED": "#7f7f7f",
}
"""Fill of each kind of bar: an agent starting, an agent up, a rank running, a rank's end."""
MARKS = {
    "Restarting": ("#ff7f0e", "restart"),
    "HostsChanged": ("#1f77b4", "hosts changed"),
    "HostQuarantined": ("#9467bd", "quarantined"),
    "Preempting": ("#8c564b", "preempted"),
    "Stalled": ("#bcbd22", "stalled"),
    "StragglerFound": ("#e377c2", "straggler"),
}
"""Events drawn as a line across the timeline: their color and label."""
WIDTH, LABEL, ROW = 960, 190, 18
"""The drawing's width, its label column and the height of a row (pixels)."""


@dataclass
class _Row:
    label: str
    bars: list[tuple[float, float, str, str]] = field(default_factory=list)
    """(start, end, color, title) of each bar, in seconds from the launch's start."""
    dots: list[tuple[float, str]] = field(default_factory=list)
    """(at, title) of each failure on the row."""


def _f(event: Mapping[str, object], key: str, default: float = 0.0) -> float:
    value = event.get(key)
    return float(value) if isinstance(value, int | float) else default


def _rows(events: Sequence[Mapping[str, object]], t0: float, end: float) -> list[_Row]:
    """A row per agent, then one per rank: the bars and failures of the timeline."""
    agents: dict[int, _Row] = {}
    ranks: dict[int, _Row] = {}
    running: dict[int, tuple[float, int]] = {}  # rank -> (since, attempt)
    for event in events:
        kind, at = event.get("event"), _f(event, "time", t0) - t0
        index = event.get("host_index")
        if kind == "AgentStarted" and isinstance(index, int):
            row = agents.setdefault(index, _Row(f"agent {event.get('hostname')}"))
            began = max(0.0, at - _f(event, "start_seconds"))
            row.bars.append((began, at, COLORS["starting"], "agent starting"))
            row.bars.append((at, end, COLORS["agent"], f"agent up (pid {event.get('pid')})"))
        elif kind == "WorkerStateChanged":
            rank = event.get("rank")
            if not isinstance(rank, int):
                continue
            row = ranks.setdefault(rank, _Row(f"rank {rank} ({event.get('hostname')})"))
            new, attempt = str(event.get("new")), event.get("attempt")
            if new == "HEALTHY":
                running[rank] = (at, attempt if isinstance(attempt, int) else 0)
            elif rank in running:
                since, number = running.pop(rank)
                title = f"attempt {number}: running, then {new.lower()}"
                row.bars.append((since, at, COLORS["running"], title))
                row.bars.append((at, at, COLORS.get(new, COLORS["STOPPED"]), title))
        elif kind == "WorkerFailed":
            rank = event.get("rank")
            if isinstance(rank, int):
                row = ranks.setdefault(rank, _Row(f"rank {rank} ({event.get('hostname')})"))
                row.dots.append((at, f"failed: {event.get('reason')}"))
    for rank, (since, number) in running.items():  # still running when the events end
        ranks[rank].bars.append((since, end, COLORS["running"], f"attempt {number}: running"))
    return [agents[i] for i in sorted(agents)] + [ranks[r] for r in sorted(ranks)]


def _timeline(events: Sequence[Mapping[str, object]], t0: float, end: float) -> str:
    """The timeline as an inline SVG drawing."""
    rows = _rows(events, t0, end)
    span = max(end, 1e-3)
    plot = WIDTH - LABEL - 10

    def x(seconds: float) -> float:
        return LABEL + plot * min(max(seconds, 0.0), span) / span

    height = ROW * (len(rows) + 2)
    parts = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'class="timeline" role="img" aria-label="timeline">'
        )
    ]
    for i, row in enumerate(rows):
        y = ROW * (i + 1)
        parts.append(
            f'<text x="4" y="{y + 13}" class="label">{html.escape(row.label)}</text>'
            f'<line x1="{LABEL}" x2="{WIDTH - 10}" y1="{y + 9}" y2="{y + 9}" class="lane"/>'
        )
        for start, stop, color, title in row.bars:
            w = max(x(stop) - x(start), 3.0)
            parts.append(
                f'<rect x="{x(start):.1f}" y="{y + 2}" width="{w:.1f}" height="{ROW - 4}" '
                f'fill="{color}" data-row="{html.escape(row.label)}">'
                f"<title>{html.escape(title)}</title></rect>"
            )
        for at, title in row.dots:
            parts.append(
                f'<circle cx="{x(at):.1f}" cy="{y + 9}" r="6" fill="{COLORS["FAILED"]}" '
                f'class="failure"><title>{html.escape(title)}</title></circle>'
            )
    bottom = ROW * (len(rows) + 1)
    for event in events:
        mark = MARKS.get(str(event.get("event")))
        if mark is None:
            continue
        at = x(_f(event, "time", t0) - t0)
        color, label = mark
        parts.append(
            f'<line x1="{at:.1f}" x2="{at:.1f}" y1="{ROW - 4}" y2="{bottom}" stroke="{color}" '
            f'stroke-width="2" stroke-dasharray="4 3" class="mark"><title>{label}</title></line>'
            f'<text x="{at + 3:.1f}" y="{ROW - 6}" class="mark-label" fill="{color}">{label}</text>'
        )
    parts.append(
        f'<text x="{LABEL}" y="{bottom + 14}" class="axis">0 s</text>'
        f'<text x="{WIDTH - 10}" y="{bottom + 14}" class="axis" text-anchor="end">'
        f"{span:.1f} s</text></svg>"
    )
    return "".join(parts)


def _listed(event: Mapping[str, object] | None, key: str) -> list[object]:
    """An event's list-valued field (empty if the event or the list is missing)."""
    value = None if event is None else event.get(key)
    return value if isinstance(value, list) else []


def _timings(events: Sequence[Mapping[str, object]], t0: float) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for event in events:
        kind = event.get("event")
        if kind == "AgentStarted":
            rows.append(
                (
                    f"agent on {event.get('hostname')} up",
                    (
                        f"{_f(event, 'time') - t0:.2f} s "
                        f"(its start: {_f(event, 'start_seconds'):.2f} s)"
                    ),
                )
            )
        elif kind == "WorkersStarted":
            rows.append(
                (
                    f"workers of {event.get('hostname')} forked (attempt {event.get('attempt')})",
                    f"{_f(event, 'time') - t0:.2f} s",
                )
            )
    finished = next((e for e in events if e.get("event") == "LaunchFinished"), None)
    if finished is not None:
        rows.append(("launch finished", f"{_f(finished, 'duration'):.2f} s"))
    return rows


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.ok { color: #2ca02c; } .failed { color: #d62728; } .running { color: #3182bd; }
table { border-collapse: collapse; } td, th { padding: 2px 12px 2px 0; text-align: left; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; }
.timeline .label { font-size: 12px; } .timeline .lane { stroke: #eee; }
.timeline .axis, .timeline .mark-label { font-size: 11px; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; }
"""


def render(
    folder: Path,
    events: Sequence[Mapping[str, object]],
    files: Sequence[RankFile],
    links_from: Path,
) -> str:
    """The report's page.

    Args:
        folder: The launch's log folder.
        events: Its events (:func:`torchrunx.commands.logs.read_events`).
        files: Its log files (:func:`torchrunx.commands.logs.rank_files`).
        links_from: The folder the page is written in: links to the logs are relative to it.
    """
    started = next((e for e in events if e.get("event") == "LaunchStarted"), {})
    finished = next((e for e in events if e.get("event") == "LaunchFinished"), None)
    t0 = _f(started, "time", _f(events[0], "time") if events else 0.0)
    end = max((_f(e, "time", t0) for e in events), default=t0) - t0
    named = started.get("hostnames")
    hosts = ", ".join(str(h) for h in named) if isinstance(named, list) else ""
    if finished is None:
        outcome = '<span class="running">no end recorded (running, or killed)</span>'
    elif finished.get("succeeded"):
        outcome = '<span class="ok">succeeded</span>'
    else:
        outcome = f'<span class="failed">failed: {html.escape(str(finished.get("error")))}</span>'
    attempts = finished.get("attempts") if finished else "?"
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>torchrunx launch {html.escape(folder.name)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Launch {html.escape(folder.name)}</h1>",
        f'<p id="outcome">{outcome}; hosts: {html.escape(hosts)}; attempts: {attempts}</p>',
        *(
            f'<p class="straggler">straggler: {html.escape(str(text))}</p>'
            for text in _listed(finished, "stragglers")
        ),
        "<h2>Timeline</h2>",
        '<p class="legend">'
        + "".join(
            f'<span><i style="background:{c}"></i>{html.escape(n)}</span>'
            for n, c in [
                ("agent starting", COLORS["starting"]),
                ("agent up", COLORS["agent"]),
                ("rank running", COLORS["running"]),
                ("succeeded", COLORS["SUCCEEDED"]),
                ("failed", COLORS["FAILED"]),
                ("stopped", COLORS["STOPPED"]),
            ]
        )
        + "</p>",
        _timeline(events, t0, end),
        '<h2>Timings</h2><table id="timings">',
        *(
            f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td></tr>"
            for a, b in _timings(events, t0)
        ),
        "</table>",
    ]
    failure = next((e for e in events if e.get("event") == "WorkerFailed"), None)
    if failure is not None:
        out.append(
            '<h2>First failure</h2><p id="first-failure">'
            f"rank {failure.get('rank')} on {html.escape(str(failure.get('hostname')))} "
            f"(local rank {failure.get('local_rank')}, attempt {failure.get('attempt')}): "
            f"{html.escape(str(failure.get('reason')))}</p>"
        )
        if failure.get("traceback"):
            out.append(f'<pre id="traceback">{html.escape(str(failure.get("traceback")))}</pre>')
    elif finished is not None and not finished.get("succeeded"):
        out.append(
            f'<h2>Failure</h2><pre id="traceback">{html.escape(str(finished.get("error")))}</pre>'
        )
    out.append('<h2>Log files</h2><table id="logs">')
    for f in files:
        href = os.path.relpath(f.path, links_from)
        size = f.path.stat().st_size if f.path.is_file() else 0
        out.append(
            f'<tr><td>{html.escape(f.label)}</td><td><a href="{html.escape(href)}">'
            f"{html.escape(f.path.name)}</a></td><td>{size} bytes</td></tr>"
        )
    out += ["</table>", "</body></html>", ""]
    return "\n".join(out)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        Path(temporary).replace(path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Run ``torchrunx report`` with ``argv`` (the words after ``report``); its exit status."""
    p = argparse.ArgumentParser(
        prog="torchrunx report",
        description="Write one self-contained HTML page about a launch (default: the newest): "
        "its timeline per host and rank, timings, first failure with its traceback, and links "
        "to its log files. Nothing on the page is fetched from the network.",
    )
    p.add_argument("launch", nargs="?", metavar="LAUNCH", help="a launch (default: the newest)")
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="default: LAUNCH.report.html")
    p.add_argument("--log-dir", type=Path, metavar="DIR", help="the log root (TORCHRUNX_LOG_DIR)")
    args = p.parse_args(argv)
    root = log_root(args.log_dir)
    try:
        folder = find_launch(root, args.launch)
    except FileNotFoundError as exc:
        p.exit(1, f"torchrunx report: {exc}\n")
    target = args.output or folder.with_name(f"{folder.name}.report.html")
    events = read_events(events_file(folder))
    page = render(folder, events, rank_files(folder, events), target.resolve().parent)
    try:
        write_atomically(target, page)
    except OSError as exc:
        p.exit(1, f"torchrunx report: cannot write {target}: {exc.strerror or exc}\n")
    out.write(f"{target}\n")
    return 0
