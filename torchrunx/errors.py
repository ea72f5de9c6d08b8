"""Every error torchrunx raises, in one tree.

::

    Exception
    ├── TorchrunxError                  base of everything below
    │   ├── AgentFailedError            an agent or its host died, or could not be started
    │   ├── WorkerError                 a worker's own failure (one rank):
    │   │   ├── WorkerFailedError       it died without raising (exit code or signal)
    │   │   ├── WorkerRaisedError       it raised an exception that cannot travel back
    │   │   └── WorkerTimeoutError      (also a TimeoutError) it overran a watchdog scope of
    │   │                               torchrunx.timer.expires
    │   ├── LaunchTimeoutError          (also a TimeoutError) launch_timeout was hit
    │   ├── StallError                  (also a TimeoutError) no rank made progress for
    │   │                               stall_timeout (on_stall="fail" or "restart"): the
    │   │                               diagnosis in its message and in .diagnosis
    │   ├── SerializationError          (also a TypeError) the function, an argument or a
    │   │                               return value cannot be pickled
    │   ├── ProtocolError               a peer broke the wire protocol or failed to authenticate
    │   ├── ShipError                   shipping code to a host failed (it ended, answered out
    │   │                               of turn, or took too long): the start's AgentFailedError
    │   │                               names it
    │   └── SlurmError                  (also a RuntimeError) SLURM cannot give what a setting
    │                                   asks for (no allocation, a host outside it, no srun),
    │                                   a SLURM command failed, or a submitted job ended
    │                                   without a result (trx.submit)
    └── <the user's own exception>      re-raised with its own type when a worker raises it;
                                        its remote traceback is attached as ``__cause__``

    SystemExit
    └── Preempted                       the launch was stopped for a preemption (SIGTERM with
                                        ``preemption_grace``): the values of the ranks that
                                        returned in the grace period; exit status 143 if
                                        uncaught, as a SIGTERM without a grace gives

Validation of ``Launcher`` fields raises plain ``ValueError`` / ``TypeError`` before any host is
touched; what SLURM cannot give raises :class:`SlurmError`, a ``RuntimeError`` too (what it was
before it had a class of its own). Third-party errors (paramiko, socket, pickle) are translated
here at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

import signal as _signal
import sys
from typing import ClassVar

NOTES_PRINTED = sys.version_info >= (3, 11)
"""Whether Python prints an exception's ``__notes__`` (3.11+). On 3.10 :func:`add_note` makes
them part of what is printed another way: see there."""


class TorchrunxError(Exception):
    """Base class of every error raised by torchrunx itself."""

    restart_category: ClassVar[str | None] = None
    """The ``restart_on`` category that restarts after this error (None: none does)."""

    def __str__(self) -> str:
        """The message; on Python 3.10, with the notes after it (3.11+ prints them itself)."""
        text = super().__str__()
        notes = [] if NOTES_PRINTED else getattr(self, "__notes__", [])
        return "\n".join([text, *notes])


class AgentFailedError(TorchrunxError):
    """An agent (one per host) died, lost its connection, or could not be started.

    Attributes:
        hostname: The host the agent ran (or should have run) on.
        reason: What happened, in words.
        stderr: The last lines the agent (or ssh) wrote to stderr, if any.
    """

    restart_category = "hosts"

    def __init__(self, hostname: str, reason: str, stderr: str = "") -> None:
        """Describe a failed agent."""
        self.hostname = hostname
        self.reason = reason
        self.stderr = stderr
        message = f"agent on host {hostname!r} failed: {reason}"
        if stderr.strip():
            message += "\n--- agent stderr (last lines) ---\n" + stderr.rstrip()
        super().__init__(message)

    def __reduce__(self) -> tuple[type[AgentFailedError], tuple[str, str, str]]:
        """Pickle with the constructor's arguments."""
        return (type(self), (self.hostname, self.reason, self.stderr))


def describe_exit(exitcode: int | None, signal_number: int | None) -> str:
    """Describe how a process ended, e.g. ``exit code 3`` or ``signal 9 (SIGKILL)``."""
    if signal_number is not None:
        return f"signal {signal_number} ({_signal_name(signal_number) or 'unknown signal'})"
    return f"exit code {exitcode}"


def _signal_name(number: int) -> str | None:
    try:
        return _signal.Signals(number).name
    except ValueError:
        return None


SIGKILL_CAUSES = (
    "sent by the kernel or another process; the usual causes: the kernel's OOM killer (see "
    "`dmesg` or `journalctl -k` on that host, or the job's memory limit), a scheduler's limit "
    "(SLURM's memory or time limit), or someone's `kill -9`"
)
"""What a worker's SIGKILL says when its host cannot tell the cause (docs/errors.md)."""


class WorkerError(TorchrunxError):
    """Base class of one worker's own failures: it died, overran a watchdog, or raised."""


class WorkerFailedError(WorkerError):
    """A worker process died without raising a Python exception.

    Typical causes: a signal (SIGKILL from the OOM killer, SIGSEGV from a crash in a C
    extension), ``sys.exit(n)`` or ``os._exit(n)``.

    Attributes:
        hostname: Host of the worker.
        local_rank: Rank of the worker on its host.
        rank: Global rank of the worker.
        pid: Process id of the worker on its host.
        exitcode: Exit code, or ``None`` when a signal ended it.
        signal: Signal number, or ``None`` when it exited.
        cause: For a SIGKILL: its likely cause as its host tells it (the kernel's OOM killer,
            with the memory cgroup's limit and highest use), or "" when the host cannot tell
            (the message then lists the usual causes).
    """

    restart_category = "deaths"

    def __init__(  # noqa: PLR0913, PLR0917 (each field is part of the error's contract)
        self,
        hostname: str,
        local_rank: int,
        rank: int,
        pid: int,
        exitcode: int | None,
        signal: int | None,
        cause: str = "",
    ) -> None:
        """Describe a dead worker."""
        self.hostname = hostname
        self.local_rank = local_rank
        self.rank = rank
        self.pid = pid
        self.exitcode = exitcode
        self.signal = signal
        self.cause = cause
        where = f"worker rank {rank} (local rank {local_rank} on host {hostname!r}, pid {pid})"
        if exitcode == 0:
            message = f"{where} exited with code 0 before returning (sys.exit(0) or os._exit(0)?)"
        else:
            message = f"{where} died with {describe_exit(exitcode, signal)} without raising"
            if signal == _signal.SIGKILL:
                message += f": {cause or SIGKILL_CAUSES}"
        super().__init__(message)

    @property
    def signal_name(self) -> str | None:
        """Name of the signal that ended the worker (``"SIGKILL"``), or ``None``."""
        return None if self.signal is None else _signal_name(self.signal)

    def __reduce__(
        self,
    ) -> tuple[type[WorkerFailedError], tuple[str, int, int, int, int | None, int | None, str]]:
        """Pickle with the constructor's arguments."""
        return (
            type(self),
            (
                self.hostname,
                self.local_rank,
                self.rank,
                self.pid,
                self.exitcode,
                self.signal,
                self.cause,
            ),
        )


class WorkerRaisedError(WorkerError):
    """A worker raised an exception that could not be sent back with its own type.

    This happens when the exception object cannot be pickled or unpickled (for example a
    custom exception whose ``__init__`` takes different arguments than it passes to
    ``Exception.__init__``). The message keeps the original type name and message, and the
    remote traceback is attached as ``__cause__``.

    Attributes:
        type_name: The qualified name of the original exception's type, as raised.
    """

    type_name: str = ""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A worker stayed in a ``torchrunx.timer.expires`` block longer than its limit.

    Its agent dumped the worker's Python stack (attached as a note) and killed it.

    Attributes:
        hostname: Host of the worker.
        local_rank: Rank of the worker on its host.
        rank: Global rank of the worker.
        scope: The ``scope`` name of the block.
        limit: The block's limit in seconds.
    """

    restart_category = "timeouts"

    def __init__(self, hostname: str, local_rank: int, rank: int, scope: str, limit: float) -> None:
        """Describe a worker that overran its watchdog."""
        self.hostname = hostname
        self.local_rank = local_rank
        self.rank = rank
        self.scope = scope
        self.limit = limit
        super().__init__(
            f"worker rank {rank} (local rank {local_rank} on host {hostname!r}) stayed in "
            f"timer scope {scope!r} longer than its limit of {limit:g} s; the watchdog "
            "stopped it"
        )

    def __reduce__(self) -> tuple[type[WorkerTimeoutError], tuple[str, int, int, str, float]]:
        """Pickle with the constructor's arguments."""
        return (type(self), (self.hostname, self.local_rank, self.rank, self.scope, self.limit))


class LaunchTimeoutError(TorchrunxError, TimeoutError):
    """The launch ran longer than ``Launcher.launch_timeout``; its workers were stopped.

    The message names the limit and the ranks still running; the Python stacks of those
    workers are attached as a note.
    """


class StallError(TorchrunxError, TimeoutError):
    """No rank made progress for ``Launcher.stall_timeout`` seconds (``on_stall`` ``"fail"``).

    With ``on_stall="restart"`` it is the failure that restarts the workers (``restart_on``:
    ``"timeouts"`` or ``"StallError"``), and raised once no restart is left.

    Attributes:
        seconds: Seconds without progress when it was raised.
        diagnosis: What the ranks waited for, as JSON-ready values
            (``torchrunx.launcher.state.hangs.Diagnosis.to_json``).
    """

    restart_category = "timeouts"

    def __init__(self, seconds: float, text: str, diagnosis: dict[str, object]) -> None:
        """A stall: its duration, the diagnosis's text and its values."""
        self.seconds = seconds
        self.text = text
        self.diagnosis = diagnosis
        super().__init__(f"no rank made progress for {seconds:.3g} s (stall_timeout):\n{text}")

    def __reduce__(self) -> tuple[type[StallError], tuple[float, str, dict[str, object]]]:
        """Pickle with the constructor's arguments."""
        return (type(self), (self.seconds, self.text, self.diagnosis))


class SerializationError(TorchrunxError, TypeError):
    """The function, an argument, or a return value cannot be pickled with cloudpickle."""


class ProtocolError(TorchrunxError):
    """A peer sent something that is not torchrunx's wire protocol, or failed to authenticate."""


class ShipError(TorchrunxError):
    """Shipping code to a host failed: it ended, answered out of turn, or took too long.

    Raised by the launcher's side of the exchange (:mod:`torchrunx.engines.ship`); the start
    of the host's agent turns it into an :class:`AgentFailedError` that names it.
    """


class SlurmError(TorchrunxError, RuntimeError):
    """SLURM cannot give what a setting asks for.

    ``hostnames="slurm"``, ``workers_per_host="slurm"`` or ``agent_start="srun"`` outside an
    allocation, a host that is not a node of the job, or no ``srun`` on this machine. Also a
    ``RuntimeError``, as these were before. Also a failed SLURM command (``sbatch``,
    ``scancel``) and a job of :func:`torchrunx.submit` that ended without a result.
    """


class Preempted(SystemExit):
    """The launch was preempted: its ranks were told, had the grace period, then were stopped.

    A ``SystemExit`` (code 143, as after SIGTERM), so a script that does not catch it exits
    as it did before, and ``except Exception`` does not swallow it. Catch it to see what was
    saved, or to requeue the job yourself.

    Attributes:
        reason: Why (``"the launcher received SIGTERM"``, ``"the agent on node3 received
            SIGTERM"``).
        returned: The value of each rank that returned within the grace period, by rank.
        world_size: The ranks of the attempt that was preempted (0 if none had started).
        requeued: Whether the SLURM job was requeued (``requeue_on_preemption``).
    """

    def __init__(
        self,
        reason: str,
        returned: dict[int, object],
        world_size: int,
        *,
        requeued: bool = False,
    ) -> None:
        """A preemption: ``returned`` maps ranks to the values they returned in time."""
        super().__init__(128 + _signal.SIGTERM)
        self.reason = reason
        self.returned = returned
        self.world_size = world_size
        self.requeued = requeued

    def __str__(self) -> str:
        """``the launch was preempted (reason): N of M ranks returned[; the job was requeued]``."""
        text = (
            f"the launch was preempted ({self.reason}): {len(self.returned)} of "
            f"{self.world_size} ranks returned in the grace period"
        )
        return text + ("; the SLURM job was requeued" if self.requeued else "")


class RemoteTraceback(Exception):  # noqa: N818 (mirrors concurrent.futures' name; not an error)
    """The formatted traceback of an exception raised in a worker.

    Attached as ``__cause__`` of the re-raised exception, so Python prints it above the
    launcher's own traceback.
    """

    def __init__(self, text: str) -> None:
        """Keep the formatted remote traceback."""
        self.text = text
        super().__init__(text)

    def __str__(self) -> str:
        """Show the traceback as it was printed in the worker."""
        return "\n\n" + self.text.rstrip()


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error``'s notes, which Python prints after its message.

    ``BaseException.add_note`` on Python 3.11+. Python 3.10 keeps notes in ``__notes__`` all
    the same but does not print them, so there a torchrunx error shows them after its message
    (:meth:`TorchrunxError.__str__`), and a worker's exception of another type after its remote
    traceback (its ``__cause__``, which Python prints just above it).
    """
    if NOTES_PRINTED:
        error.add_note(note)  # type: ignore[attr-defined]  # (3.11+; mypy checks for 3.10)
        return
    error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]
    cause = error.__cause__
    if not isinstance(error, TorchrunxError) and isinstance(cause, RemoteTraceback):
        cause.text = f"{cause.text.rstrip()}\n{note}"


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or Python's own placeholder when the exception's ``__str__`` raises.

    A user's exception with a broken ``__str__`` must still be reported with its type and
    traceback, not replaced by the error its ``__str__`` raised.
    """
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 (whatever a broken __str__ raises)
        return "<exception str() failed>"


_COLLECTIVE_ERROR_TYPES = frozenset(
    {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}
)
_COLLECTIVE_ERROR_MARKERS = (
    "third_party/gloo/",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "NCCL error",
)
_PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer")
"""Also collective errors in a ``RuntimeError`` (gloo raises those), not in a plain ``OSError``,
where they are the usual text of a user's own failed connection."""
_MAX_CHAIN = 8


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like the echo of another process's failure in ``torch.distributed``.

    When one rank dies, its peers that wait in a collective (or on the store) raise an error of
    their own, such as gloo's "Connection closed by peer". Such an error names a symptom, not
    the cause, so the launcher waits a moment for the cause before reporting it (see
    ``docs/failures.md``). Recognised: ``torch.distributed``'s ``DistError`` family, and a
    ``RuntimeError`` or ``OSError`` whose message comes from gloo or NCCL (for a
    ``RuntimeError`` also "Connection closed/reset by peer"), anywhere in the chain of
    ``__cause__`` / ``__context__``. Pure: it reads names and messages, and never
    imports torch.
    """
    current: BaseException | None = exc
    for _ in range(_MAX_CHAIN):
        if current is None:
            return False
        for cls in type(current).__mro__:
            if cls.__module__.startswith("torch") and cls.__name__ in _COLLECTIVE_ERROR_TYPES:
                return True
        if isinstance(current, RuntimeError | OSError):
            text = exception_text(current)  # a broken __str__: not recognisable, not fatal
            markers: tuple[str, ...] = _COLLECTIVE_ERROR_MARKERS
            if isinstance(current, RuntimeError):
                markers += _PEER_GONE_MARKERS
            if any(marker in text for marker in markers):
                return True
        current = current.__cause__ or current.__context__
    return False
