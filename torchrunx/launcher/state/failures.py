"""Failure analysis: which failure is the cause, and whether a restart answers it.

Decided once the launch has stopped and every fact is in, from what happened, never from which
message happened to arrive first:

1. the launcher's own reasons (Ctrl-C, SIGTERM, ``launch_timeout``) come first: they are what
   the user did or asked for;
2. then root failures: a worker's exception, a worker that died without an outcome, a watchdog,
   an agent that failed or was lost, the earliest by when it happened;
3. then collective errors (a peer's echo of a failure, such as gloo's "Connection closed by
   peer"), which are only the cause when nothing else failed.

A rank that raised and then exited non-zero failed once: its exception, not its exit status.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrunx.errors import (
    TorchrunxError,
    WorkerRaisedError,
)
from torchrunx.launcher.state.reports import summary

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.launcher.state.records import Fault

RESTART_CATEGORIES = ("exceptions", "deaths", "timeouts")
ALL_RESTART_CATEGORIES = (*RESTART_CATEGORIES, "hosts")

_RANK = {"launch": 0, "exception": 1, "death": 1, "hang": 1, "agent": 1, "lost": 1}


def _order(fault: Fault) -> tuple[int, float, int]:
    return (_RANK.get(fault.kind, 2), fault.at, fault.seq)


def relevant(faults: Sequence[Fault]) -> list[Fault]:
    """The faults that count: a rank's death is dropped when the same rank raised."""
    raised = {f.rank for f in faults if f.rank is not None and f.kind != "death"}
    return [f for f in faults if not (f.kind == "death" and f.rank in raised)]


def choose_cause(faults: Sequence[Fault]) -> Fault:
    """The failure to raise, out of everything that failed (see the module docstring).

    Raises:
        ValueError: ``faults`` is empty.
    """
    candidates = relevant(faults)
    if not candidates:
        raise ValueError("no failure to choose from")
    return min(candidates, key=_order)


def others(faults: Sequence[Fault], cause: Fault) -> list[str]:
    """One-line summaries of every other failure, in the order they were learnt."""
    return [
        summary(f.error) for f in sorted(relevant(faults), key=lambda f: f.seq) if f is not cause
    ]


def type_names(error: BaseException) -> set[str]:
    """Names an exception answers to in ``restart_on``: bare and qualified, for its whole MRO."""
    names: set[str] = set()
    for cls in type(error).__mro__:
        names.update({cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"})
    return names


def restarts_for(error: BaseException, wanted: set[str], *, from_worker: bool) -> bool:
    """Whether ``restart_on`` (``wanted``) covers ``error``.

    ``from_worker``: the error is a worker's own (raised, died, hung), not the launcher's.
    """
    if isinstance(error, WorkerRaisedError) and from_worker:  # its type could not travel back
        type_name = error.type_name
        return "exceptions" in wanted or bool({type_name, type_name.rsplit(".", 1)[-1]} & wanted)
    if isinstance(error, TorchrunxError):  # deaths, watchdogs, hosts; never the launch's own
        return error.restart_category in wanted  # timeouts, pickling or protocol errors
    if not from_worker or isinstance(error, KeyboardInterrupt | SystemExit):
        return False
    if "exceptions" in wanted:
        return True
    return bool(type_names(error) & (wanted - set(ALL_RESTART_CATEGORIES)))


def restartable(
    cause: Fault, restart_on: Sequence[str], *, attempt: int, max_restarts: int
) -> bool:
    """Whether the launch restarts its workers after ``cause``."""
    if attempt >= max_restarts:
        return False
    return restarts_for(cause.error, set(restart_on), from_worker=cause.rank is not None)


def check_restarts(max_restarts: object, restart_on: object) -> None:
    """Refuse a ``max_restarts`` below 0, or a ``restart_on`` that names no category or type.

    Raises:
        ValueError: A value out of range.
        TypeError: ``restart_on`` is not a tuple.
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
    if isinstance(restart_on, str) or not isinstance(restart_on, list | tuple):
        raise TypeError(
            f"restart_on must be a tuple of categories {list(ALL_RESTART_CATEGORIES)} and/or "
            f"exception type names, got {restart_on!r}"
        )
    for entry in restart_on:
        if not isinstance(entry, str) or not entry.replace(".", "").replace("_", "").isalnum():
            raise ValueError(
                f"restart_on entry {entry!r} is neither one of {list(ALL_RESTART_CATEGORIES)} "
                "nor an exception type name"
            )
