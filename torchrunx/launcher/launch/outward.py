"""What a launch shows outside its own process: the live view's socket, the debugpy forwards.

Both are parts of the launch's :class:`~torchrunx.launcher.launch.session.LaunchLoop`, which
owns them: :class:`LiveView` serves ``torchrunx top`` (this user's only; its snapshots are read
from the view's threads, changing nothing; a viewer's request for stacks or the diagnosis is
served by the launch's loop), :class:`DebugpyForwards` says where an IDE attaches
to a rank that waits for one, and forwards the port over SSH where it can.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Protocol

from torchrunx.launcher.view.view_server import GROUP_ABOVE, LAST_LINE_CHARS, ViewServer, grouped

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.engines.forward import PortForward
    from torchrunx.launcher.net.ioloop import IOLoop
    from torchrunx.launcher.settings.plan import LaunchPlan
    from torchrunx.launcher.starts.agent_pool import AgentPool
    from torchrunx.launcher.state.hangs import Straggler
    from torchrunx.launcher.state.health import HealthReport
    from torchrunx.launcher.state.state import LaunchState
    from torchrunx.launcher.view.debugger import Debugger
    from torchrunx.launcher.view.logrouter import LogRouter

logger = logging.getLogger("torchrunx.launcher")


class LaunchLoop(Protocol):
    """What these parts read of their launch (its :class:`LaunchLoop`, which imports them)."""

    state: LaunchState
    plan: LaunchPlan
    logs: LogRouter
    debugger: Debugger
    pool: AgentPool
    loop: IOLoop

    def health_report(self, *, rows: bool = True) -> HealthReport:
        """The launch's ``/health`` report (``rows``: with every agent and worker)."""
        ...

    def current_stragglers(self) -> tuple[Straggler, ...]:
        """The stragglers of the newest comparison (any thread may call it)."""
        ...


REQUESTS = ("stacks", "diagnosis")
"""What a viewer may ask for (a word on its connection): every rank's grouped Python stacks
(``s``), the collective view and the latest stall's diagnosis (``d``)."""


class LiveView:
    """The launch's view socket for ``torchrunx top`` (unless ``TORCHRUNX_VIEW=0``).

    A viewer's request (:data:`REQUESTS`) is taken here from the view's thread and served by
    the launch's loop (:meth:`take_request`), which hands the answer back with :meth:`show`;
    the snapshots carry the latest answer of each kind, numbered.
    """

    def __init__(self, session: LaunchLoop) -> None:
        """Nothing is opened before :meth:`start`."""
        self.session = session
        self.server: ViewServer | None = None
        self.looks: dict[str, tuple[int, str]] = {}
        """The latest answer of each kind: its number (1 for the first) and its text."""
        self.stall: str | None = None
        """The latest stall's diagnosis (headline and text), shown under the collective view."""
        self._asked: set[str] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        """Listen on the user's private socket (a failure only means no view)."""
        environ = self.session.plan.from_env
        if environ.view:
            self.server = ViewServer(
                self.snapshot, self.info(), self.request, runtime=environ.environ
            )
            self.server.start()

    def close(self) -> None:
        """Send the last snapshot, remove the socket."""
        if self.server is not None:
            self.server.close()

    def request(self, what: str) -> None:
        """From a view's thread: a viewer asked for ``what`` (one of :data:`REQUESTS`)."""
        if what in REQUESTS:
            with self._lock:
                self._asked.add(what)
            self.session.loop.wake()

    def take_request(self, can: Callable[[str], bool]) -> str | None:
        """From the launch's loop: a request it ``can`` serve now (the others wait), if any."""
        with self._lock:
            what = next((w for w in REQUESTS if w in self._asked and can(w)), None)
            self._asked.discard(what or "")
        return what

    def show(self, what: str, text: str) -> None:
        """The answer to a request of ``what``: sent in the next snapshots."""
        number = self.looks.get(what, (0, ""))[0] + 1
        self.looks = {**self.looks, what: (number, text)}

    def show_diagnosis(self, view: str) -> None:
        """The collective view now (or why there is none), the latest stall's diagnosis under it."""
        stall = "" if self.stall is None else f"\n\nthe latest stall's diagnosis:\n{self.stall}"
        self.show("diagnosis", view + stall)

    def info(self) -> dict[str, object]:
        """What ``torchrunx top`` shows of the launch itself."""
        log_dir = self.session.logs.log_dir
        return {
            "pid": os.getpid(),
            "started": time.time(),
            "log_dir": None if log_dir is None else str(log_dir),
            "hostnames": [a.slots.hostname for a in self.session.state.agents],
        }

    def snapshot(self) -> dict[str, object]:
        """Called from the view's threads: the health report, each source's last line, answers.

        Above ``GROUP_ABOVE`` ranks: the report's own fields, the ranks counted per host and
        state, the agents not running listed (:func:`grouped`), and no last lines.
        """
        looks = {k: {"number": n, "text": t} for k, (n, t) in self.looks.items()}
        session = self.session
        st = session.state
        ranks = list(st.ranks)
        if len(ranks) > GROUP_ABOVE:
            now = time.monotonic()
            agents = [
                (
                    a.slots.hostname,
                    a.state.value,
                    None if a.hello is None else now - a.last_heard,
                    a.role,
                )
                for a in list(st.agents)
            ]
            bare = session.health_report(rows=False)
            table = st.agent_table
            report = grouped(
                bare.to_dict(), ((table.hostname(r), r.state.value) for r in ranks), agents
            )
            return {"report": report, "last_lines": {}, "looks": looks}
        last = {
            f"{host}:{'agent' if local is None else local}": source.tail[-1][:LAST_LINE_CHARS]
            for (host, local), source in list(session.logs.sources.items())
            if source.tail
        }
        report = session.health_report().to_dict()
        if (
            session.plan.observability.straggler_threshold is not None
        ):  # the view's mark column: "slow"
            slow = {s.rank for s in session.current_stragglers()}
            for worker in report.get("workers", []):
                worker["straggler"] = worker.get("rank") in slow
        return {"report": report, "last_lines": last, "looks": looks}


class DebugpyForwards:
    """Where an IDE attaches to a rank's debugpy, and the SSH forwards made for it."""

    def __init__(self, session: LaunchLoop) -> None:
        """No forward yet."""
        self.session = session
        self.forwards: dict[tuple[int, int], PortForward] = {}

    def announce(self, rank: int, port: int) -> None:
        """Rank ``rank``'s debugpy listens on its host's ``127.0.0.1:port``: say where to attach.

        Over SSH the port is forwarded to this machine's own ``127.0.0.1:port`` through the
        agent's SSH connection; an agent on this machine needs nothing; an ``srun`` step's host
        is named, with the ``ssh -L`` that reaches it. Only the rank and port that
        ``TORCHRUNX_DEBUGPY`` named are forwarded: a worker cannot open a forward to another port.
        """
        session = self.session
        if (rank, port) != session.debugger.debugpy:
            logger.warning(
                "rank %d asked for an IDE's debugger on port %d, which TORCHRUNX_DEBUGPY did "
                "not name: nothing forwarded",
                rank,
                port,
            )
            return
        record = session.state.ranks[rank]
        host = session.state.agent_table.hostname(record)
        process = session.pool.processes.get(record.host_index)
        forward = getattr(process, "forward", None)
        key = (rank, record.host_index)
        failure: OSError | None = None
        if key in self.forwards:  # a restarted or kept worker: the same forward
            how = "forwarded"
        elif forward is not None:
            try:
                self.forwards[key] = forward(port, port)
                how = "forwarded"
            except OSError as exc:
                how, failure = "remote", exc
        else:
            how = "local" if session.plan.hosts.methods[record.host_index] == "local" else "remote"
        sys.stderr.write(debugpy_text(rank, port, host, how, failure))
        sys.stderr.flush()

    def close(self) -> None:
        """Close every forward."""
        for forward in self.forwards.values():
            forward.close()


def debugpy_text(rank: int, port: int, host: str, how: str, failure: OSError | None = None) -> str:
    """The launcher's line for a rank that waits for an IDE's debugger on its host's ``port``.

    ``how`` the port is reached from here: ``"forwarded"`` (over the agent's SSH connection),
    ``"local"`` (the rank runs on this machine) or ``"remote"`` (with ``ssh -L``; ``failure``:
    why the forward could not be made).
    """
    if how == "forwarded":
        where = f"127.0.0.1:{port} on this machine (forwarded to {host} over SSH)"
    elif how == "local":
        where = f"127.0.0.1:{port} on this machine"
    elif failure is not None:
        where = (
            f"127.0.0.1:{port} on {host} (not forwarded: {failure}; choose another port "
            f"with TORCHRUNX_DEBUGPY={rank}:PORT, or run ssh -L {port}:127.0.0.1:{port} {host})"
        )
    else:
        where = f"127.0.0.1:{port} on {host} (reach it with ssh -L {port}:127.0.0.1:{port} {host})"
    head = f"torchrunx: rank {rank} on {host} waits for an IDE's debugger (debugpy)"
    return f"{head}: attach to {where}\n"
