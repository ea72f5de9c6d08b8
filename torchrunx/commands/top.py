"""``torchrunx top``: a live view of your running launches, from another terminal.

It finds the launches itself: each running launch of yours listens on a socket in your
private runtime folder (:mod:`torchrunx.launcher.view.view_server`); no port to type, and no
one else's view.
The screen (rich's live display) shows the launch (pid, age, state, attempt, restarts, log
folder), each host's agent (state, heartbeat age), each rank (state, time in that state, pid,
CPU, resident memory, GPU use and memory where there are figures, collectives completed, last
log line) and the failures and world changes so far; it is redrawn at each snapshot (2 a
second). Keys ask the launcher for every rank's grouped stacks (``s``) or the hang diagnosis
(``d``), shown under the table when its answer comes. With more than 64 ranks the launcher
sends, and the view shows, counts per host and state instead of a row per rank.
``--once`` prints one snapshot as plain text and exits (for scripts). :func:`render_text` is
pure: a snapshot in, the lines out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from torchrunx.launcher.view.view_server import runtime_dir, unix_address

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

CONNECT_TIMEOUT_S = 2.0
"""How long to wait for a launch's first snapshot."""


def find_views(folder: Path | None) -> list[Path]:
    """The sockets of your running launches, oldest first; those that answer no more are removed.

    A launcher killed before it could remove its socket leaves the file behind; nothing
    listens on it, and it is removed here (it is yours: the folder is private).
    """
    if folder is None:
        return []
    found = []
    for path in sorted(folder.glob("*.sock"), key=_age):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(CONNECT_TIMEOUT_S)  # a launch too busy to accept is skipped, not waited
        try:
            with unix_address(path) as address:
                probe.connect(address)
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
            continue
        except OSError:
            continue
        finally:
            probe.close()
        found.append(path)
    return found


def _age(path: Path) -> float:
    """When ``path`` was made (0 if it is gone: a launch that ended since the folder was listed).

    A socket gone by then is skipped by the probe like any dead one.
    """
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def snapshots(path: Path) -> Iterator[dict[str, Any]]:
    """The snapshots a launch's socket sends, until the launch ends (or stops answering)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        with unix_address(path) as address:
            sock.connect(address)
        buffer = b""
        while True:
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                return
            if not data:
                return
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield json.loads(line)


class Ages:
    """How long each rank has been in its state, as far as this view has seen it change."""

    def __init__(self) -> None:
        """No rank seen yet."""
        self.since: dict[object, tuple[str, float]] = {}

    def age(self, key: object, state: str, now: float) -> float:
        """Seconds ``key`` has been in ``state`` (since this view first saw it there)."""
        seen = self.since.get(key)
        if seen is None or seen[0] != state:
            self.since[key] = (state, now)
            return 0.0
        return now - seen[1]


def size(count: int | None) -> str:
    """Bytes as a short size (``512K``, ``3.4G``); ``-`` if unknown."""
    if count is None:
        return "-"
    value, unit = float(count) / 1024, "K"
    for bigger in ("M", "G", "T"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f}{unit}" if value >= 100 or unit == "K" else f"{value:.1f}{unit}"


def _figure(value: object, spec: str = "") -> str:
    """A figure of a row, ``-`` when unknown."""
    return "-" if value is None else format(value, spec)


def rank_rows(
    workers: list[dict[str, Any]], last: dict[str, str], ages: Ages, now: float
) -> list[str]:
    """The table of ranks: a heading, then a row per rank.

    GPU columns only where there are figures; the ``mark`` column only where the launcher
    sends a ``straggler`` field (``slow`` for a straggler).
    """
    gpus = any(w.get("gpu_percent") is not None or w.get("gpu_memory_bytes") for w in workers)
    marks = any("straggler" in w for w in workers)
    head = (
        f"{'rank':>5} {'host':<16} {'state':<10} {'in state':>9} {'pid':>8} {'cpu%':>6} "
        f"{'rss':>6} "
        + (f"{'gpu%':>4} {'gpu mem':>7} " if gpus else "")
        + f"{'coll':>7} "
        + (f"{'mark':<4} " if marks else "")
        + " last line"
    )
    rows = [head]
    for w in workers:
        state = str(w.get("state"))
        key = (w.get("host_index"), w.get("local_rank"))
        line = last.get(f"{w.get('host_index')}:{w.get('local_rank')}", "")
        gpu = (
            f"{_figure(w.get('gpu_percent')):>4} {size(w.get('gpu_memory_bytes')):>7} "
            if gpus
            else ""
        )
        mark = f"{'slow' if w.get('straggler') else '':<4} " if marks else ""
        rows.append(
            f"{_figure(w.get('rank')):>5} {w.get('hostname', '?'):<16} {state:<10} "
            f"{ages.age(key, state, now):>7.1f} s {w.get('pid') or '-':>8} "
            f"{_figure(w.get('cpu_percent'), '.0f'):>6} {size(w.get('rss_bytes')):>6} {gpu}"
            f"{_figure(w.get('collectives')):>7} {mark} {line}"
        )
    return rows


def render_text(snapshot: dict[str, Any], ages: Ages, now: float) -> list[str]:
    """The view of one snapshot as lines of text (what ``--once`` prints, and the screen shows)."""
    report = snapshot.get("report", {})
    lines = [
        (
            f"launch pid {snapshot.get('pid')}  {report.get('launch_state')}  "
            f"attempt {report.get('attempt')}  restarts {report.get('restarts')}/"
            f"{report.get('max_restarts')}  up {report.get('uptime', 0):.0f} s  "
            f"{'healthy' if report.get('healthy') else 'UNHEALTHY'}"
        ),
        f"logs: {snapshot.get('log_dir') or '(none)'}",
        "",
        f"{'host':<24} {'agent':<10} {'heartbeat':>9}  role",
    ]
    for agent in report.get("agents", []):
        age = agent.get("last_heartbeat_age")
        lines.append(
            f"{agent.get('hostname', '?'):<24} {agent.get('state', '?'):<10} "
            f"{'-' if age is None else f'{age:.1f} s':>9}  {agent.get('role', '')}"
        )
    if report.get("agents_running"):
        lines.append(f"(and {report['agents_running']} more hosts whose agents run)")
    lines.append("")
    if "groups" in report:  # the launcher's summary above GROUP_ABOVE ranks
        groups = report["groups"]
        lines.append(f"{'host':<24} {'state':<10} {'ranks':>6}")
        lines += [f"{h!s:<24} {s!s:<10} {n:>6}" for h, s, n in groups]
    else:
        lines += rank_rows(report.get("workers", []), snapshot.get("last_lines", {}), ages, now)
    for title, items in (("failures", "failures"), ("world changes", "world_changes")):
        if report.get(items):
            lines += ["", f"{title}:", *(f"  {item}" for item in report[items])]
    return lines


def main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Run ``torchrunx top`` with ``argv`` (the words after ``top``); its exit status."""
    p = argparse.ArgumentParser(
        prog="torchrunx top",
        description="A live view of a running launch of yours (the newest, or --pid's), "
        "redrawn twice a second until it ends (or Ctrl-C). Only your own launches can "
        "be viewed; there is no network port.",
    )
    p.add_argument("--pid", type=int, help="the launch whose launcher has this pid")
    p.add_argument("--list", action="store_true", help="list your running launches and exit")
    p.add_argument("--once", action="store_true", help="print one snapshot as text and exit")
    args = p.parse_args(argv)
    views = find_views(runtime_dir())
    if args.list:
        out.writelines(f"{v.name.split('-')[0]}  {v}\n" for v in views)
        return 0
    if args.pid is not None:
        views = [v for v in views if v.name.split("-")[0] == str(args.pid)]
    if not views:
        which = f"with launcher pid {args.pid} " if args.pid is not None else ""
        p.exit(1, f"torchrunx top: no running launch of yours {which}to show\n")
    ages = Ages()
    try:
        if args.once or not out.isatty():
            for snapshot in snapshots(views[-1]):
                out.write("\n".join(render_text(snapshot, ages, time.monotonic())) + "\n")
                return 0
            return 1
        return _live(views[-1], ages, out)
    except KeyboardInterrupt:
        return 0


KEYS = (
    "keys: j/k or arrows select a rank, l its log's last lines, s every rank's stacks, "
    "d the hang diagnosis (again: hide), q quits"
)
"""The key help under the live screen."""
TAIL_LINES = 12
"""Lines of a rank's log shown by ``l``."""
PANEL_LINES = 40
"""Lines of the stacks or the diagnosis shown (the first; the rest is in the launcher's logs)."""
ASKING = {
    "stacks": "asking every rank for its Python stacks...",
    "diagnosis": "asking every rank which collectives it is in...",
}


class Screen:
    """What the live screen shows besides the snapshot: the selected rank, and one panel.

    The panel (under the table) is the selected rank's log tail (``l``), every rank's
    grouped stacks (``s``) or the diagnosis (``d``); the last two are asked of the launcher
    (:attr:`requests`, written on the connection) and shown when its answer comes.
    """

    def __init__(self) -> None:
        """No rank selected, no panel shown."""
        self.selected = 0
        self.panel: str | None = None
        self.requests: list[str] = []
        """What to ask the launcher for (words to write on the connection)."""
        self.looks: dict[str, tuple[int, str]] = {}
        """The launcher's latest answer of each kind: its number and text."""
        self.asked: dict[str, int] = {}
        """The number of each kind's answer when it was last asked for (a newer one answers)."""

    @property
    def tail(self) -> bool:
        """Whether the selected rank's log tail is shown."""
        return self.panel == "tail"

    def key(self, key: str, ranks: int) -> bool:
        """Apply one key press; False for quit."""
        if key in ("q", "\x03"):
            return False
        if key in ("j", "\x1b[B"):
            self.selected = min(self.selected + 1, max(ranks - 1, 0))
        elif key in ("k", "\x1b[A"):
            self.selected = max(self.selected - 1, 0)
        elif key in ("l", "s", "d"):
            panel = {"l": "tail", "s": "stacks", "d": "diagnosis"}[key]
            self.panel = None if self.panel == panel else panel
            if self.panel in ASKING:
                self.asked[panel] = self.looks.get(panel, (0, ""))[0]
                self.requests.append(panel)
        return True

    def take(self, snapshot: dict[str, Any]) -> None:
        """Keep the answers a snapshot brings (their text comes once per connection)."""
        for kind, look in (snapshot.get("looks") or {}).items():
            if "text" in look:
                self.looks[kind] = (int(look["number"]), str(look["text"]))

    def lines(self, snapshot: dict[str, Any], ages: Ages, now: float) -> list[str]:
        """The snapshot's lines, the selected rank marked, then the key help and the panel."""
        self.take(snapshot)
        lines = render_text(snapshot, ages, now)
        workers = snapshot.get("report", {}).get("workers", [])
        rows = [
            i for i, line in enumerate(lines) if line.startswith(" ") and line[:6].strip().isdigit()
        ]
        panel: list[str] = []
        if rows and workers and "groups" not in snapshot.get("report", {}):
            self.selected = min(self.selected, len(rows) - 1)
            row = rows[self.selected]
            lines[row] = ">" + lines[row][1:]
            if self.tail:
                panel = _tail(snapshot, workers[self.selected])
        if self.panel in ASKING:
            number, text = self.looks.get(self.panel, (0, ""))
            if number <= self.asked.get(self.panel, 0):
                panel = [ASKING[self.panel]]
            else:
                shown = text.splitlines()
                panel = shown[:PANEL_LINES]
                if len(shown) > PANEL_LINES:
                    panel.append(f"({len(shown) - PANEL_LINES} more lines)")
        return [*lines, "", KEYS, *([""] if panel else []), *panel]


def split_keys(pressed: str) -> list[str]:
    """The keys in what one read of the terminal returned (an arrow is three characters)."""
    keys, i = [], 0
    while i < len(pressed):
        size = 3 if pressed.startswith("\x1b[", i) else 1
        keys.append(pressed[i : i + size])
        i += size
    return keys


def _tail(snapshot: dict[str, Any], worker: dict[str, Any]) -> list[str]:
    """The last lines of a worker's log file (in the launch's log folder), with a heading."""
    from torchrunx.commands.logs import rank_files, read_events  # noqa: PLC0415
    from torchrunx.launcher.view.logdirs import events_file  # noqa: PLC0415

    folder = snapshot.get("log_dir")
    if not folder:
        return ["(this launch writes no log files)"]
    path = Path(folder)
    files = rank_files(path, read_events(events_file(path)))
    chosen = next((f for f in files if f.rank == worker.get("rank")), None)
    if chosen is None or not chosen.path.is_file():
        return [f"(no log file of rank {worker.get('rank')} yet)"]
    with chosen.path.open("rb") as f:
        f.seek(max(0, chosen.path.stat().st_size - 8192))
        text = f.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
    return [f"--- {chosen.path.name}: {chosen.label}, last lines ---", *text]


def _on_keys(screen: Screen, keys: int, sock: socket.socket, snapshot: dict[str, Any]) -> bool:
    """Read the keys pressed and apply them; send what they ask of the launcher. False: quit."""
    count = len(snapshot.get("report", {}).get("workers", []))
    pressed = os.read(keys, 64).decode(errors="replace")
    if not all(screen.key(key, count) for key in split_keys(pressed)):
        return False
    if screen.requests:  # the stacks, the diagnosis: asked of the launcher
        sock.sendall("".join(f"{r}\n" for r in screen.requests).encode())
        screen.requests.clear()
    return True


def _live(view: Path, ages: Ages, out: TextIO) -> int:
    """The live screen (rich), until the launch ends or the user quits (keys: :data:`KEYS`)."""
    import select  # noqa: PLC0415
    import termios  # noqa: PLC0415
    import tty  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415 (only for the live screen)
    from rich.live import Live  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    console = Console(file=out)
    screen: Screen = Screen()
    snapshot: dict[str, Any] = {}
    keys = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(keys) if keys is not None else None
    if keys is not None:
        tty.setcbreak(keys)
    try:
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
            Live(Text("connecting..."), console=console, auto_refresh=False) as live,
        ):
            sock.settimeout(CONNECT_TIMEOUT_S)
            with unix_address(view) as address:
                sock.connect(address)
            buffer, ended = b"", False
            while not ended:
                ready, _, _ = select.select(
                    [sock, *([keys] if keys is not None else [])], [], [], 5
                )
                if not ready:
                    break  # no snapshot for 5 s: the launcher is gone
                if keys in ready and not _on_keys(screen, keys, sock, snapshot):
                    return 0
                if sock in ready:
                    data = sock.recv(1 << 20)
                    ended = not data
                    buffer += data
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        snapshot = json.loads(line)
                if snapshot:
                    text = "\n".join(screen.lines(snapshot, ages, time.monotonic()))
                    live.update(Text(text), refresh=True)
    finally:
        if keys is not None and saved is not None:
            termios.tcsetattr(keys, termios.TCSADRAIN, saved)
    console.print("the launch ended")
    return 0
