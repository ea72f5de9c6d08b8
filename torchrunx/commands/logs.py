"""``torchrunx logs``: a launch's log files, found, mapped to ranks, shown or followed.

Each launch logs into a new folder of the log root (``TORCHRUNX_LOG_DIR``, else
``./torchrunx_logs``), named by its start time, with its events file beside it
(``<folder>.events.jsonl``). The newest launch is the folder whose name sorts last: no link or
pointer is kept in the root, whose layout stays torchrunx 0.4's (only the dated folders, and
the events files beside them). The events say which host and local rank each rank ran as, so
the rank of each file is known (:func:`rank_files`, pure); the last attempt's ranks count.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from torchrunx.launcher.state.reports import rank_ranges
from torchrunx.launcher.view.logdirs import events_file, log_file_name

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

DESCRIPTION = """\
Show a launch's log files: every rank's (one after the other, each under its heading), one
rank's (--rank), or one host's agent (--agent); --follow prints what they get next until the
launch ends (or Ctrl-C). LAUNCH is a launch's folder name (as --launches lists them) or path;
the default is the newest launch in the log root (TORCHRUNX_LOG_DIR, else ./torchrunx_logs).
"""
POLL_S = 0.25
"""How often ``--follow`` looks for new lines and for the launch's end."""


@dataclass(frozen=True)
class RankFile:
    """One log file of a launch and whose it is.

    Attributes:
        rank: The global rank, or None for a host's agent.
        hostname: The host.
        local_rank: The worker's local rank, or None for the agent.
        path: The file.
    """

    rank: int | None
    hostname: str
    local_rank: int | None
    path: Path

    @property
    def label(self) -> str:
        """``rank 3 (node1[1])`` or ``agent (node1)``."""
        if self.rank is None:
            return f"agent ({self.hostname})"
        return f"rank {self.rank} ({self.hostname}[{self.local_rank}])"


def read_events(path: Path) -> list[dict[str, object]]:
    """The events of a launch's events file; a last line still being written is left out."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # half-written (the launch runs) or not ours: not an event
        if isinstance(event, dict):
            events.append(event)
    return events


def rank_files(folder: Path, events: Sequence[Mapping[str, object]]) -> list[RankFile]:
    """Every log file of the launch in ``folder``, with its rank: ranks in order, then agents.

    The hosts are the launch's (``LaunchStarted``), then each change of its world
    (``HostsChanged``); each host's ranks are those of its last ``WorkersStarted``. Files that
    the events do not explain (a launch whose events file is missing) are listed as they are,
    without a rank.
    """
    hostnames: list[str] = []
    ranks: dict[int, tuple[str, list[int]]] = {}  # host index -> (hostname, ranks)
    for event in events:
        kind = event.get("event")
        if kind in ("LaunchStarted", "HostsChanged"):
            hostnames = [str(h) for h in _items(event.get("hostnames"))]
            if kind == "HostsChanged":
                ranks = {}
        elif kind == "WorkersStarted":
            index = event.get("host_index")
            if isinstance(index, int):
                host = str(event.get("hostname"))
                ranks[index] = (host, [r for r in _items(event.get("ranks")) if isinstance(r, int)])
    found: list[RankFile] = []
    named: set[Path] = set()
    for index, (host, host_ranks) in sorted(ranks.items()):
        names = hostnames if index < len(hostnames) and hostnames[index] == host else [host]
        where = index if names is hostnames else 0
        for local_rank, rank in enumerate(host_ranks):
            path = folder / log_file_name(names, where, local_rank)
            found.append(RankFile(rank, host, local_rank, path))
            named.add(path)
    found.sort(key=lambda f: f.rank if f.rank is not None else -1)
    for index, host in enumerate(hostnames):
        path = folder / log_file_name(hostnames, index, None)
        found.append(RankFile(None, host, None, path))
        named.add(path)
    others = sorted(p for p in folder.glob("*.log") if p not in named) if folder.is_dir() else []
    found += [RankFile(None, p.stem, None, p) for p in others]
    return found


def _items(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def log_root(given: Path | None) -> Path:
    """The log root: ``given`` (``--log-dir``), else ``TORCHRUNX_LOG_DIR``, else the default."""
    return given or Path(os.environ.get("TORCHRUNX_LOG_DIR") or "./torchrunx_logs")


def launches(root: Path) -> list[Path]:
    """The launch folders in ``root``, oldest first (their names are their start times)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _is_launch_name(p.name))


def _is_launch_name(name: str) -> bool:
    try:
        dt.datetime.fromisoformat(name.rsplit("-", 1)[0] if name.count("-") > 2 else name)
    except ValueError:
        return False
    return True


def find_launch(root: Path, name: str | None) -> Path:
    """The launch folder named ``name`` (a folder name in ``root``, or a path), else the newest.

    Raises:
        FileNotFoundError: No such launch, or none at all in ``root``; the message says where
            it looked and what to do.
    """
    if name is not None:
        for candidate in (Path(name), root / name):
            if candidate.is_dir():
                return candidate
        raise FileNotFoundError(
            f"no launch {name!r}: neither a folder nor a launch in {root} "
            "(torchrunx logs --launches lists them)"
        )
    found = launches(root)
    if not found:
        raise FileNotFoundError(
            f"no launch has logged in {root} yet; launches log under TORCHRUNX_LOG_DIR (else "
            "./torchrunx_logs, relative to where they ran): set it, or give --log-dir"
        )
    return found[-1]


def launch_summary(folder: Path, events: Sequence[Mapping[str, object]]) -> str:
    """One line about a launch: its folder, hosts, and how it ended (or that it has not)."""
    hosts = next((e.get("hostnames") for e in events if e.get("event") == "LaunchStarted"), None)
    finished = next((e for e in events if e.get("event") == "LaunchFinished"), None)
    if finished is None:
        state = "running, or ended without a word (no LaunchFinished event)"
    elif finished.get("succeeded"):
        state = f"succeeded in {finished.get('duration', 0):.1f} s"
    else:
        state = f"failed: {finished.get('error')}"
    stragglers = _items(finished.get("stragglers") if finished else None)
    if stragglers:
        state += "; stragglers: " + "; ".join(str(s) for s in stragglers)
    shown = ", ".join(str(h) for h in _items(hosts)) or "hosts unknown"
    return f"{folder.name}  [{shown}]  {state}"


def select(files: Sequence[RankFile], rank: int | None, agent: str | None) -> list[RankFile]:
    """The files ``--rank`` or ``--agent`` pick (all without either).

    Raises:
        LookupError: No file is that rank's or that host's agent's; the message lists those
            there are.
    """
    if rank is not None:
        chosen = [f for f in files if f.rank == rank]
        if not chosen:
            known = sorted(f.rank for f in files if f.rank is not None)
            shown = rank_ranges(known) if known else "none"
            raise LookupError(f"no rank {rank} in this launch (its ranks: {shown})")
        return chosen
    if agent is not None:
        chosen = [f for f in files if f.rank is None and f.hostname == agent]
        if not chosen:
            hosts = sorted({f.hostname for f in files if f.rank is None})
            raise LookupError(f"no agent on {agent!r} in this launch (its hosts: {hosts})")
        return chosen
    return list(files)


def _show(files: Sequence[RankFile], out: TextIO) -> dict[Path, int]:
    """Print each file under a heading; where each one ended (for ``--follow``)."""
    ends: dict[Path, int] = {}
    for f in files:
        out.write(f"==> {f.path.name}: {f.label} <==\n")
        data = _read_from(f.path, 0)
        out.write(data.decode(errors="replace"))
        ends[f.path] = len(data)
    out.flush()
    return ends


def _read_from(path: Path, offset: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""


def _follow(
    files: Sequence[RankFile], ends: dict[Path, int], folder: Path, out: TextIO, *, every: bool
) -> None:
    """Print lines as the files get them, each prefixed by whose it is, until the launch ends.

    With ``every``, the files are looked for again at each round: the workers' files of a
    launch followed from its start appear once they start.
    """
    pending: dict[Path, bytes] = {}
    finished = False
    while not finished:
        events = read_events(events_file(folder))
        finished = any(e.get("event") == "LaunchFinished" for e in events)
        if every:
            files = rank_files(folder, events)
        for f in files:
            data = _read_from(f.path, ends.get(f.path, 0))
            ends[f.path] = ends.get(f.path, 0) + len(data)
            *lines, rest = (pending.pop(f.path, b"") + data).split(b"\n")
            if rest:
                pending[f.path] = rest
            out.writelines(f"[{f.label}] {line.decode(errors='replace')}\n" for line in lines)
        out.flush()
        if not finished:
            time.sleep(POLL_S)


def parser() -> argparse.ArgumentParser:
    """The parser of ``torchrunx logs``."""
    p = argparse.ArgumentParser(prog="torchrunx logs", description=DESCRIPTION)
    p.add_argument("launch", nargs="?", metavar="LAUNCH", help="a launch (default: the newest)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="N", help="only rank N's file")
    which.add_argument("--agent", metavar="HOST", help="only the agent's file of HOST")
    which.add_argument("--list", action="store_true", help="only which file is whose")
    which.add_argument("--launches", action="store_true", help="the launches in the log root")
    p.add_argument("-f", "--follow", action="store_true", help="then print what comes next")
    p.add_argument("--log-dir", type=Path, metavar="DIR", help="the log root (TORCHRUNX_LOG_DIR)")
    return p


def main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Run ``torchrunx logs`` with ``argv`` (the words after ``logs``); its exit status."""
    p = parser()
    args = p.parse_args(argv)
    root = log_root(args.log_dir)
    if args.launches:
        out.writelines(
            launch_summary(folder, read_events(events_file(folder))) + "\n"
            for folder in launches(root)
        )
        return 0
    try:
        folder = find_launch(root, args.launch)
        events = read_events(events_file(folder))
        files = rank_files(folder, events)
        chosen = select(files, args.rank, args.agent)
    except (FileNotFoundError, LookupError) as exc:
        p.exit(1, f"torchrunx logs: {exc}\n")
    out.write(f"launch {launch_summary(folder, events)}\n")
    if args.list or (args.rank is None and args.agent is None and not args.follow):
        out.writelines(f"  {f.label:<28} {f.path}\n" for f in files)
        if args.list:
            return 0
    try:
        ends = _show(chosen, out)
        if args.follow:
            every = args.rank is None and args.agent is None
            _follow(chosen, ends, folder, out, every=every)
    except KeyboardInterrupt:
        return 130
    return 0
