"""The messages: agent -> launcher, launcher -> agent, worker <-> launcher.

A worker's messages travel on its private channel to its agent, which forwards each one to
the launcher inside :class:`FromWorker`, on its own connection; the launcher's messages for a
worker go to its agent inside :class:`ToWorker`. Each message is a frozen dataclass whose
fields are built-ins only (those two also carry the message they wrap). A frame's header is
one of them, pickled; the receiver unpickles it with :class:`_HeaderUnpickler`, which admits
the message classes of this module and nothing else by name (:func:`_load_message`).
"""

from __future__ import annotations

import io
import pickle
import typing
from typing import Any, TypeAlias

from torchrunx.errors import ProtocolError, exception_text
from torchrunx.wire.frozen import frozen

HEARTBEAT_INTERVAL = 1.0
"""Seconds between an agent's heartbeats (the launcher sends its own twice as often)."""


@frozen
class AgentHello:
    """First message of an agent: who it is and what its host offers."""

    host_index: int
    hostname: str
    pid: int
    slots: int
    """Workers this host would run for ``workers_per_host="auto"`` (GPUs, else CPU cores)."""
    free_port: int
    """A port that was free on this host, used as ``MASTER_PORT`` if it runs rank 0."""
    gpus: int = 0
    """GPUs the agent counted on its host (``devices.count_local_gpus``), for ``backend="auto"``."""


@frozen
class WorkerSpec:
    """Blueprint of the worker group an agent starts; its payload is the cloudpickled call."""

    host_index: int
    hostname: str
    num_workers: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str | None
    """The process-group backend, never ``"auto"``: the launcher resolved it for every host."""
    timeout: float
    """The process-group timeout in seconds."""
    isolate_gpus: bool = False
    """Set each worker's CUDA_VISIBLE_DEVICES to its own GPU (unless already set)."""
    log_level: int = 20
    """Level of the workers' root logger (``TORCHRUNX_LOG_LEVEL``)."""
    attempt: int = 0
    """Numbers every worker group of the agents' life: 0 first, then one more for each
    restart and (warm agents) each run. Replies name it, so a late one is told apart."""
    max_restarts: int = 0
    restarts: int = 0
    """Restarts so far in this run (``TORCHELASTIC_RESTART_COUNT``); ``attempt`` in a launch."""
    num_hosts: int = 1
    """Hosts in the launch, one worker group each (torchrun's ``GROUP_WORLD_SIZE``)."""
    keep: bool = False
    """Workers that stay (``Launcher.warm(keep_workers=True)``): after its outcome a worker
    waits on its connection for the next run's :class:`WorkerCall`, in the same process and
    process group."""
    debugger: bool = False
    """The launcher has a terminal (its stdin is a TTY): ``breakpoint()`` in a worker opens pdb
    there. Without one a breakpoint is skipped with a warning naming the rank and line."""
    debugpy: tuple[int, int] | None = None
    """``TORCHRUNX_DEBUGPY``: ``(rank, port)``: that rank listens for an IDE's debugger (debugpy)
    on its host's ``127.0.0.1:port`` and waits for it before it runs the function."""
    post_mortem: bool = False
    """``TORCHRUNX_POST_MORTEM`` at the launcher (with a terminal): a rank that raises opens pdb
    at the raising frame there first, then its exception is sent as usual."""
    preemption_grace: float = 0.0
    """Seconds the ranks get to save and return after a preemption notice; more than 0: a
    SIGTERM that reaches a worker from outside is such a notice (:mod:`torchrunx.preemption`)."""
    progress_every: float | None = None
    """``Launcher.stall_timeout`` is on: each worker says :class:`RankProgress` at most this
    often, and answers a stalled launch's request with its :class:`RankState`."""
    stragglers: bool = False
    """``Launcher.straggler_threshold`` is on: each worker sends its :class:`RankTimings`
    before its outcome (the probe runs then, ``progress_every`` set)."""


@frozen
class WorkersStarted:
    """Agent: the workers were forked; their pids in local-rank order."""

    pids: tuple[int, ...]


@frozen
class WorkerExited:
    """Agent: a worker process ended (seen at once through its pidfd)."""

    local_rank: int
    pid: int
    exitcode: int | None
    signal: int | None
    stopped: bool = False
    """The agent had signalled it (a Stop, a restart, the end of the launch): its end is not a
    failure of its own."""
    at: float = 0.0
    """Unix time the agent saw it end."""
    cause: str = ""
    """For a SIGKILL the agent did not send: what the host tells of its likely cause (the OOM
    killer, from the kernel's counts; see :mod:`torchrunx.agent.memory`), "" if nothing."""


@frozen
class LogLines:
    """Agent: whole lines its workers wrote, in order per worker and stream, and its own records.

    Each record is ``(local_rank, levelno, logger name, text, unix time read)``; ``local_rank``
    is ``None`` for a ``logging`` record of the agent itself (sent on the same connection, so
    "worker N exited" never overtakes that worker's last lines).
    """

    records: tuple[tuple[int | None, int, str, str, float], ...]


@frozen
class AgentDone:
    """Agent: every worker ended and was reaped; the agent exits after this."""


@frozen
class Stop:
    """Launcher: stop the workers (SIGTERM, then SIGKILL after the grace period) and exit."""

    reason: str
    grace_period: float = 3.0
    dump_stacks: bool = True
    """Send each live worker's Python stacks (:class:`WorkerStacks`) before stopping."""
    restart: bool = False
    """Stop only the workers: then send :class:`WorkersEnded` and wait for a new spec."""
    attempt: int = 0
    """The launcher's attempt being stopped (echoed in :class:`WorkersEnded`)."""


@frozen
class WorkersEnded:
    """Agent: every worker of ``attempt`` ended, and the agent waits for the launcher.

    Sent after a ``Stop(restart=True)``, and also unasked when restarts are possible
    (``attempt < max_restarts``): then the agent stays until the launcher sends a new
    :class:`WorkerSpec` (a restart) or a :class:`Stop` (the launch is over).
    """

    free_port: int
    """A port free on this host now, for the next group's ``MASTER_PORT``."""
    attempt: int = -1
    """The attempt whose workers ended (-1: none had started)."""


@frozen
class WorkerTimedOut:
    """Agent: a worker stayed in a watchdog scope (``torchrunx.timer``) past its limit."""

    local_rank: int
    scope: str
    limit: float
    stack: str


@frozen
class WorkerStacks:
    """Agent: the Python stacks of its workers that were still running, by local rank."""

    stacks: dict[int, str]
    shown: bool = False
    """An answer to :class:`ShowStacks` (the workers go on), not a dump before a stop."""


@frozen
class Preempt:
    """Launcher: the launch stops at ``deadline`` (``time.time()``); tell your workers now."""

    deadline: float
    reason: str


@frozen
class PreemptionNotice:
    """Agent: this host was told to stop (its agent received SIGTERM): preempt the launch."""

    reason: str


@frozen
class ShowStacks:
    """Launcher: send the stacks of your live workers, and let them go on.

    Someone asked where every rank is (SIGQUIT, Ctrl-Backslash): the answer is a
    :class:`WorkerStacks` with ``shown``.
    """

    states: bool = False
    """Also ask each live worker for its :class:`RankState` (the launch looks stalled)."""


@frozen
class RankProgress:
    """Worker: it made progress (a collective completed, or ``torchrunx.progress()``)."""

    collectives: int = -1
    """Collectives completed so far in all its process groups, as its flight recorder counts
    them (-1: no recorder)."""


@frozen
class RankState:
    """Worker: its state when the launch looked stalled (see :mod:`torchrunx.worker.stallprobe`).

    ``entries``: its flight recorder's recent collectives, oldest first, each ``(group, seq,
    op, sizes, dtypes, done, created_ns, site)``; ``where``: the innermost frame of the user's
    code in its main thread; ``stacks``: the Python stacks of all its threads.
    """

    group_formed: bool
    entries: tuple[tuple[Any, ...], ...] = ()
    where: str = ""
    stacks: str = ""


WorkerUsage: TypeAlias = tuple[int, int, float | None, int, int | None, int | None]
"""One worker's use of its host: ``(local_rank, pid, cpu_percent, rss_bytes, gpu_percent,
gpu_memory_bytes)``; None where not known (see :mod:`torchrunx.agent.usage`)."""


@frozen
class AskTimings:
    """Launcher: have each live worker send its :class:`RankTimings` (straggler detection)."""


@frozen
class RankTimings:
    """Worker: when it entered its recent collectives (see :mod:`torchrunx.worker.stallprobe`).

    ``entries``: the newest of its flight recorder, oldest first, each ``(group, seq,
    created_ns)`` (its wall clock); ``sent_ns``: its wall clock when it sent them, from which
    the launcher estimates the offset of the worker's clock from its own.
    """

    entries: tuple[tuple[str, int, int], ...]
    sent_ns: int


@frozen
class Heartbeat:
    """Either direction: I am alive."""

    usage: tuple[WorkerUsage, ...] = ()
    """An agent's: what each of its running workers uses now (the launcher's: none)."""


@frozen
class FromWorker:
    """Agent: a message its worker ``local_rank`` sent on its channel; the payload is its.

    Forwarded in the order the worker sent them, in order with the agent's own messages, so
    a worker's outcome never overtakes its log lines nor follows the news of its exit.
    """

    local_rank: int
    message: WorkerMessage


@frozen
class ToWorker:
    """Launcher: a message for the agent's worker ``pid`` (``None``: end its channel).

    The agent writes it (and the payload) to that worker's channel; the end of its channel
    tells a worker that stays to exit. A message for a worker that is gone is dropped.
    """

    pid: int
    message: WorkerCall | DebugInput | None


@frozen
class WorkerChannelClosed:
    """Agent: the channel of its worker ``local_rank`` ended; nothing more comes from it."""

    local_rank: int
    clean: bool
    """The worker ended its stream itself (its close record came): nothing was cut."""


@frozen
class WorkerHello:
    """Worker: first message on its channel."""

    rank: int
    local_rank: int
    pid: int
    attempt: int = 0


@frozen
class DirectOutcome:
    """Worker, on its channel: its outcome is large, and comes on a connection of its own.

    A result or exception of more than :data:`DIRECT_OUTCOME_BYTES` goes straight to the
    launcher, sealed by the worker (its connection's first message is its :class:`WorkerHello`
    again, with the pid its channel's hello gave), so that it is not copied through the agent;
    the launcher waits for that connection before it judges the rank's exit.
    """

    rank: int


DIRECT_OUTCOME_BYTES = 1 << 20
"""Payload bytes of an outcome above which a worker sends it on a connection of its own."""


@frozen
class WorkerCall:
    """Launcher, to a worker that stays: run this call next; the payload is the pickled call.

    The worker answers with :class:`WorkerResult` or :class:`WorkerException`, as for the call
    of its spec. Its connection's end tells it to exit.
    """

    run: int
    """The warm run this call belongs to (1 for the first run)."""


@frozen
class WorkerResult:
    """Worker: the function returned; the payload is the cloudpickled return value."""

    rank: int
    init_seconds: float = 0.0
    """Time in ``init_process_group`` (and its barrier)."""
    function_seconds: float = 0.0
    """Time in the function."""
    pickle_seconds: float = 0.0
    """Time to pickle the return value."""
    sent_at: float = 0.0
    """Wall-clock time the worker began sending the value."""


@frozen
class DebugOutput:
    """Worker: what its debugger wrote, and whether it now waits for a line.

    ``breakpoint()`` in a worker runs pdb with its input and output on the worker's channel;
    the launcher prints this in its terminal and answers a prompt with :class:`DebugInput`.
    """

    rank: int
    text: str
    waiting: bool
    """The text ends with pdb's prompt: the worker waits for a :class:`DebugInput`."""
    where: str = ""
    """``file:line in function`` of the frame the debugger stopped in."""
    resumed: bool = False
    """The rank left the debugger (``c``, or quit): it runs on."""


@frozen
class DebugpyListening:
    """Worker: debugpy listens on this host's ``127.0.0.1:port``; the rank waits for an IDE."""

    rank: int
    port: int


@frozen
class DebugInput:
    """Launcher: the line typed at a worker's pdb prompt (``None``: no terminal, go on)."""

    line: str | None


@frozen
class WorkerException:
    """Worker: the function raised.

    The payload is the cloudpickled exception, or empty when it could not be pickled and
    restored; the type name, message and formatted traceback always travel as text.
    """

    rank: int
    type_name: str
    message: str
    traceback: str
    unpicklable_result: bool = False
    """True when the function returned but its value could not be pickled."""
    collective: bool = False
    """True when the exception looks like the echo of another rank's failure in a collective
    (:func:`torchrunx.errors.is_collective_error`)."""
    at: float = 0.0
    """Unix time the worker caught it."""


Message = (
    AgentHello
    | WorkerSpec
    | WorkersStarted
    | WorkerExited
    | LogLines
    | AgentDone
    | Stop
    | WorkerStacks
    | ShowStacks
    | Preempt
    | PreemptionNotice
    | WorkersEnded
    | WorkerTimedOut
    | Heartbeat
    | FromWorker
    | ToWorker
    | WorkerChannelClosed
    | WorkerHello
    | WorkerCall
    | DirectOutcome
    | WorkerResult
    | WorkerException
    | DebugOutput
    | DebugInput
    | DebugpyListening
    | RankProgress
    | RankState
    | AskTimings
    | RankTimings
)
"""Every message; a frame's header is one of these, and nothing else."""
_MESSAGE_TYPES: tuple[type[Message], ...] = typing.get_args(Message)

WorkerMessage = (
    WorkerHello
    | WorkerResult
    | WorkerException
    | DebugOutput
    | DebugpyListening
    | DirectOutcome
    | RankProgress
    | RankState
    | RankTimings
)
"""What a worker may send on its channel (forwarded by its agent inside :class:`FromWorker`)."""
WORKER_MESSAGE_TYPES: tuple[type[WorkerMessage], ...] = typing.get_args(WorkerMessage)
"""The classes of :data:`WorkerMessage`."""
"""The classes of :data:`Message`, read from it (the union is the one list of them)."""
_MESSAGE_CLASSES: dict[str, type[Message]] = {cls.__name__: cls for cls in _MESSAGE_TYPES}


class _HeaderUnpickler(pickle.Unpickler):
    """Unpickles a frame's header: the protocol's message classes, and nothing else by name.

    Every field of every message is a built-in (int, float, str, bool, None, bytes, tuple,
    dict) or, in :class:`FromWorker` and :class:`ToWorker`, a message, which pickle writes with
    opcodes of its own; the only globals a header may name are the message classes of this
    module.
    """

    def find_class(self, module: str, name: str) -> Any:  # noqa: ANN401 (pickle's signature)
        """The message class ``module.name``; ``UnpicklingError`` for anything else."""
        cls = _MESSAGE_CLASSES.get(name) if module == __name__ else None
        if cls is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a torchrunx message class")
        return cls


def _load_message(header: memoryview | bytes | bytearray) -> Message:
    """Unpickle a header with :class:`_HeaderUnpickler` and check that it is a message.

    Raises:
        ProtocolError: Anything else (a malformed pickle, a foreign class, another type).
    """
    try:
        message = _HeaderUnpickler(io.BytesIO(header)).load()
    except Exception as exc:  # noqa: BLE001 (whatever a malformed header raises)
        raise ProtocolError(
            f"malformed message header ({type(exc).__name__}: {exception_text(exc)})"
        ) from None
    if not isinstance(message, _MESSAGE_TYPES):
        raise ProtocolError(f"unexpected message type {type(message).__name__}")
    return message
