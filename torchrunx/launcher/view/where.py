"""Where is every rank: the stacks of every worker on demand, while the launch goes on.

SIGQUIT to the launcher (Ctrl-Backslash in its terminal), during ``run`` or a warm run in the
main thread, asks every connected agent for its live workers' Python stacks
(:class:`~torchrunx.wire.messages.ShowStacks`). The agents answer within about 0.5 s
(:class:`~torchrunx.wire.messages.WorkerStacks` with ``shown``); once all have answered, or
after :data:`ANSWER_WAIT`, the stacks are printed on the launcher's stderr, ranks with the same
stack in one section (:func:`~torchrunx.launcher.state.reports.stacks_note`). Nothing is stopped.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import TYPE_CHECKING

from torchrunx.launcher.state.reports import stacks_note

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from torchrunx.launcher.state.records import AgentRecord, RankRecord

ANSWER_WAIT = 2.0
"""Seconds the launcher waits for the agents' answers before printing what came."""

HEADLINE = "torchrunx: where every rank is (the launch goes on; Ctrl-\\ to look again):"


class StacksLook:
    """One request for every rank's stacks: the agents asked, what they answered, by when."""

    def __init__(
        self,
        agents: list[AgentRecord],
        now: float,
        *,
        to_terminal: bool = True,
        to_view: bool = False,
    ) -> None:
        """Asked of ``agents`` at ``now`` (monotonic): for the terminal, ``torchrunx top``, both."""
        self.to_terminal = to_terminal
        self.to_view = to_view
        self.pending = {agent.index for agent in agents}
        self.deadline = now + ANSWER_WAIT
        self.stacks: dict[int, str] = {}

    def answer(self, agent: AgentRecord, stacks: dict[int, str]) -> None:
        """An agent's answer: its workers' stacks by local rank."""
        self.pending.discard(agent.index)
        if agent.spec is None:  # no workers were given to it: nothing to place
            return
        for local_rank, text in stacks.items():
            self.stacks[agent.spec.rank_offset + local_rank] = text

    def due(self, now: float) -> bool:
        """Whether to print now: every agent answered, or the wait is over."""
        return not self.pending or now >= self.deadline

    def text(self, ranks: list[RankRecord], hostname: Callable[[RankRecord], str]) -> str:
        """What is printed: the grouped stacks, and the hosts that did not answer."""
        where = {r.rank: (r.local_rank, hostname(r)) for r in ranks}
        shown = {rank: text for rank, text in self.stacks.items() if rank in where}
        lines = [HEADLINE]
        if shown:
            lines.extend(stacks_note(shown, where).splitlines()[1:])
        else:
            lines.append("no worker is running")
        if self.pending:
            lines.append(f"no answer in {ANSWER_WAIT:g} s from host index {sorted(self.pending)}")
        return "\n".join(lines) + "\n"


def print_look(text: str) -> None:
    """Print a look on the launcher's stderr."""
    sys.stderr.write(text)
    sys.stderr.flush()


@contextlib.contextmanager
def sigquit_shows_stacks(ask: Callable[[], None]) -> Iterator[None]:
    """During a launch, SIGQUIT calls ``ask`` (the launch's own loop then asks the agents).

    Only where SIGQUIT still has its default action (which would kill the launcher with a core
    dump and leave its agents to notice) and only in the main thread; restored afterwards.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGQUIT) is not signal.SIG_DFL
    ):
        yield
        return

    def on_sigquit(signum: int, frame: object) -> None:
        del signum, frame
        ask()

    signal.signal(signal.SIGQUIT, on_sigquit)
    try:
        yield
    finally:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
