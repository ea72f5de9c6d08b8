"""Preemption on the launcher's side: the grace period, SIGTERM, and requeueing the job.

With a grace period (``Launcher.preemption_grace``; inside a SLURM job, by default, what
SLURM leaves between its SIGTERM and its SIGKILL), a SIGTERM to the launcher, or to one host's
agent, preempts the launch::

    SIGTERM ─▶ every agent: Preempt(deadline) ─▶ every worker's page (torchrunx.preemption)
        ─▶ the ranks save and return ... until every rank returned, or the deadline
        ─▶ stop everything as after any launch ─▶ [requeue the SLURM job] ─▶ raise Preempted

A second SIGTERM stops everything at once (``SystemExit(143)``), as without a grace period.
The loop's side is :meth:`torchrunx.launcher.launch.session.LaunchLoop.preempt`; the outcome is
:class:`torchrunx.errors.Preempted`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from typing import TYPE_CHECKING

from torchrunx import serialization
from torchrunx.errors import Preempted, add_note
from torchrunx.launcher.settings.resolve import in_slurm_allocation

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

    from torchrunx.launcher.settings.plan import LaunchPlan
    from torchrunx.launcher.state.state import LaunchState

logger = logging.getLogger("torchrunx.launcher")

SLURM_MARGIN = 2.0
"""Seconds kept back from SLURM's ``KillWait`` for stopping everything after the grace."""

_KILL_WAIT = re.compile(r"^KillWait\s*=\s*(\d+)\s*sec", re.MULTILINE)


def slurm_kill_wait(config: str) -> float | None:
    """``KillWait`` (seconds) in the output of ``scontrol show config``; None if absent."""
    found = _KILL_WAIT.search(config)
    return None if found is None else float(found.group(1))


def default_grace(
    environ: Mapping[str, str] | None = None, read_config: Callable[[], str] | None = None
) -> float:
    """``preemption_grace=None``: inside a SLURM job, its ``KillWait`` less 2 s; else 0.

    SLURM sends SIGKILL ``KillWait`` seconds after the SIGTERM of a preemption, a cancel or
    the time limit; outside SLURM nothing says how long there is, and a SIGTERM stops the
    launch at once, as it always did. ``environ``: the plan's (None: this process's, for a
    call outside a launch).
    """
    env = os.environ if environ is None else environ  # outside a launch only
    if not in_slurm_allocation(env) or (read_config is None and shutil.which("scontrol") is None):
        return 0.0
    try:
        config = (read_config or _scontrol_config)()
    except (OSError, subprocess.SubprocessError):
        return 0.0
    kill_wait = slurm_kill_wait(config)
    return 0.0 if kill_wait is None else max(kill_wait - SLURM_MARGIN, 1.0)


def _scontrol_config() -> str:
    return subprocess.run(
        ["scontrol", "show", "config"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout


def requeue_job(environ: Mapping[str, str] | None = None) -> str | None:
    """``scontrol requeue`` the SLURM job this runs in; None if done, else why not.

    This process ignores SIGTERM from just before the call (SLURM sends it to end the job,
    maybe before scontrol returns); as it was again if the requeue failed.
    ``environ``: the plan's (None: this process's, for a call outside a launch).
    """
    env = os.environ if environ is None else environ  # outside a launch only
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return "not inside a SLURM job (no SLURM_JOB_ID)"
    if shutil.which("scontrol") is None:
        return "scontrol is not installed here"
    # SLURM ends this job (SIGTERM, then SIGKILL after KillWait) to queue it again, and its
    # SIGTERM may come before scontrol has returned: ignored from before the call, so that
    # the caller's code after the launch runs meanwhile (put back only if the requeue failed).
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        why = f"scontrol requeue {job} failed: {exc}"
    else:
        if done.returncode == 0:
            return None
        why = f"scontrol requeue {job} failed: {(done.stderr or done.stdout).strip()}"
    if before is not None:
        signal.signal(signal.SIGTERM, before)
    return why


def end_preemption(
    state: LaunchState,
    plan: LaunchPlan,
    reason: str,
    stop: Callable[[], None],
    finished: Callable[[BaseException | None], None],
) -> Preempted:
    """The end of a preemption: keep what returned, ``stop()`` everything, requeue if asked.

    ``finished(error)`` reports the end (the ``LaunchFinished`` event). Returns the
    :class:`~torchrunx.errors.Preempted` to raise, with a note naming the ranks that did not
    return in time.
    """
    returned: dict[int, object] = {}
    notes: list[str] = []
    for rank in state.ranks:
        if rank.result is not None:
            try:
                returned[rank.rank] = serialization.loads(state.current.take_result(rank))
            except Exception as exc:  # noqa: BLE001 (one rank's value, named in a note)
                notes.append(f"rank {rank.rank}'s return value cannot be unpickled here: {exc}")
    world = len(state.ranks)
    state.begin_failure()
    with contextlib.suppress(KeyboardInterrupt, SystemExit):  # a second signal: stop now
        stop()
    why_not = requeue_job(plan.from_env.environ) if plan.resilience.requeue else None
    if why_not is not None:
        logger.warning("the SLURM job was not requeued: %s", why_not)
        notes.append(f"the SLURM job was not requeued: {why_not}")
    error = Preempted(reason, returned, world, requeued=plan.resilience.requeue and why_not is None)
    missing = [r.rank for r in state.ranks if r.rank not in returned]
    if missing:
        notes.insert(
            0,
            f"ranks {missing} did not return within preemption_grace="
            f"{plan.resilience.preemption_grace:g} s and were stopped",
        )
    for note in notes:
        add_note(error, note)
    state.failed_run()
    finished(error)
    return error


@contextlib.contextmanager
def sigterm_preempts(preempt: Callable[[str], None], grace: float) -> Iterator[None]:
    """During a launch: SIGTERM preempts it (``grace`` > 0), or stops it at once (exit 143).

    Only where SIGTERM still has its default action (which would kill the launcher before it
    could stop its agents) and only in the main thread; the handler is restored afterwards.
    With a grace, the first SIGTERM calls ``preempt(reason)``; a second one stops at once.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    told = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal told
        del signum, frame
        if grace <= 0 or told:
            raise SystemExit(128 + signal.SIGTERM)
        told = True
        preempt("the launcher received SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:  # not after a requeue: ignored then
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
