"""The worker: runs the user's function in one rank and sends its outcome to the launcher.

A worker is forked by its agent (so torch is already imported) with its channel: a socket pair to
the agent, which forwards what the worker sends to the launcher on the agent's own sealed connection
(:class:`~torchrunx.wire.messages.FromWorker`) and what the launcher sends it back
(:class:`~torchrunx.wire.messages.ToWorker`). It says hello, joins the process group, calls the
function, and sends back exactly one message: :class:`WorkerResult` (the cloudpickled return value
as a raw payload) or :class:`WorkerException`. An outcome of more than
:data:`~torchrunx.wire.messages.DIRECT_OUTCOME_BYTES` goes on a sealed connection of the worker's
own instead (:class:`~torchrunx.wire.messages.DirectOutcome`), so that a large result is not copied
through the agent; if that connection cannot be made, it goes through the agent. ``sys.exit(n)`` in
the function ends the worker with code ``n`` and no message; the agent reports that exit.

A worker that stays (warm agents with ``keep_workers=True``, :attr:`WorkerSpec.keep`) does not
exit after a result: it waits on its connection for the next run's :class:`WorkerCall` and
runs it in the same process, with the same process group; the end of its channel ends it.
After an exception it exits as any worker does: its run failed, and its state with it.
"""

from __future__ import annotations

import bdb
import inspect
import io
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cloudpickle

from torchrunx import serialization
from torchrunx.devices import cuda_device, device_env, process_group_options
from torchrunx.env import worker_env
from torchrunx.errors import ProtocolError, add_note, exception_text, is_collective_error
from torchrunx.wire import handshake
from torchrunx.wire.channel import ChannelConnection
from torchrunx.wire.messages import (
    DIRECT_OUTCOME_BYTES,
    DirectOutcome,
    WorkerCall,
    WorkerException,
    WorkerHello,
    WorkerResult,
    WorkerSpec,
)
from torchrunx.worker import debugger, stallprobe
from torchrunx.worker.capture import capture_logging
from torchrunx.worker.frameworks import framework_env

if TYPE_CHECKING:
    import socket
    from collections.abc import Sequence

    from torchrunx.wire.bootstrap import AgentBootstrap
    from torchrunx.wire.messages import Message

_EXIT_RAISED = 1

worker_cache: dict[str, Any] = {}
"""A dict that lives as long as this worker process (``torchrunx.worker_cache``).

With warm agents whose workers stay (``Launcher.warm(keep_workers=True)``) it carries what a
run loaded to the next run, for code whose own globals do not persist: a function defined in
the launching script or a notebook is pickled by value, with its globals, for every call.
Fresh workers start with it empty.
"""


def _init_process_group(backend: str, spec: WorkerSpec, rank: int, device: int | None) -> None:
    import torch  # noqa: PLC0415 (workers with backend=None never import torch)
    import torch.distributed as dist  # noqa: PLC0415

    options = process_group_options(
        backend, rank=rank, world_size=spec.world_size, timeout=spec.timeout, device=device
    )
    if "device_id" in options:
        # LOCAL_RANK's GPU is current before NCCL creates anything on a device.
        torch.cuda.set_device(options["device_id"])
        if "device_id" not in inspect.signature(dist.init_process_group).parameters:
            del options["device_id"]  # torch < 2.3: set_device alone selects the device
    dist.init_process_group(**options)
    if backend == "gloo":
        # gloo connects its full mesh in init: a fast rank that returned and exited could
        # otherwise close its sockets while a slower peer is still connecting to it.
        dist.barrier()


def _destroy_process_group() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _looks_like_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exception_text(exc)}".lower()
    return "timeout" in text or "timed out" in text


def _echo_or_quit(exc: BaseException) -> bool:
    """Not worth a post-mortem: another rank's failure seen in a collective, a quit debugger."""
    return isinstance(exc, bdb.BdbQuit | KeyboardInterrupt) or is_collective_error(exc)


def _add_hints(exc: BaseException, spec: WorkerSpec) -> None:
    """Notes for failures that come from the process group torchrunx set up."""
    if _looks_like_timeout(exc):
        add_note(exc, f"the process-group timeout is Launcher.timeout={spec.timeout:g} s")
    if "initialize the default process group twice" in exception_text(exc):
        add_note(
            exc,
            f"torchrunx had already initialised the process group (backend={spec.backend!r}); "
            "a function that calls init_process_group itself needs backend=None "
            "(--backend None on the command line)",
        )


def _exception_message(
    rank: int, exc: BaseException, *, unpicklable_result: bool = False
) -> tuple[WorkerException, list[bytes]]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        payload: list[bytes] = [cloudpickle.dumps(exc)]
        pickle.loads(payload[0])  # noqa: S301 (our own bytes: checks the exception can be rebuilt)
    except Exception:  # noqa: BLE001 (any failure means: send the text only)
        payload = []
    message = WorkerException(
        rank=rank,
        type_name=type(exc).__qualname__,
        message=exception_text(exc),  # a broken __str__ must not hide it
        traceback=text,
        unpicklable_result=unpicklable_result,
        collective=is_collective_error(exc),
        at=time.time(),
    )
    return message, payload


def _set_devices(spec: WorkerSpec, local_rank: int, *, gpus: int, cpus: int) -> int | None:
    """Set the worker's GPU and CPU variables (:func:`device_env`); return its CUDA device."""
    settings = device_env(
        os.environ,
        local_rank=local_rank,
        local_world_size=spec.num_workers,
        gpus=gpus,
        cpus=cpus,
        isolate_gpus=spec.isolate_gpus,
    )
    os.environ.update(settings)  # before anything initialises CUDA in this process
    torch = sys.modules.get("torch")
    if "OMP_NUM_THREADS" in settings and torch is not None:
        # torch was imported by the agent before the fork: its thread pool is already sized.
        torch.set_num_threads(int(settings["OMP_NUM_THREADS"]))
    isolated = "CUDA_VISIBLE_DEVICES" in settings
    os.environ.update(framework_env(os.environ, gpus=gpus))  # e.g. Accelerate on CPU hosts
    return cuda_device(local_rank=local_rank, gpus=gpus, isolated=isolated)


def run(  # noqa: PLR0913 (what one rank needs)
    boot: AgentBootstrap,
    channel: socket.socket,
    spec: WorkerSpec,
    payload: list[bytearray],
    local_rank: int,
    *,
    gpus: int,
    cpus: int,
) -> int:
    """Run one rank; returns the process exit code.

    Args:
        boot: The agent's bootstrap: where the launcher listens, for a large outcome.
        channel: Its end of the socket pair to its agent.
        spec: The worker group this rank belongs to.
        payload: The pickled call (``func, args, kwargs``); released once loaded.
        local_rank: This worker's index on its host.
        gpus: GPUs the agent counted on this host.
        cpus: CPU cores the agent may use on this host.
    """
    rank = spec.rank_offset + local_rank
    for stream in (sys.stdout, sys.stderr):
        # Whole lines per write: the agent splits the pipe's bytes into lines as they come.
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)
    # Forwarded variables and env_file's exports are already in the agent's (inherited) env.
    capture_logging(spec.log_level)
    os.environ.update(
        worker_env(
            rank=rank,
            local_rank=local_rank,
            world_size=spec.world_size,
            local_world_size=spec.num_workers,
            group_rank=spec.host_index,
            group_world_size=spec.num_hosts,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            attempt=spec.restarts,
            max_restarts=spec.max_restarts,
        )
    )
    device = _set_devices(spec, local_rank, gpus=gpus, cpus=cpus)
    conn = ChannelConnection(channel)
    hello = WorkerHello(rank=rank, local_rank=local_rank, pid=os.getpid(), attempt=spec.attempt)
    conn.send(hello)
    debugger.install(conn, rank, spec.hostname, terminal=spec.debugger)
    if spec.progress_every is not None:  # stall detection: the recorder on, the probe started
        os.environ.update(stallprobe.recorder_env(os.environ, stallprobe.loaded_c10d()))
        stallprobe.StallProbe(conn, spec.progress_every).start()
    outcomes = _Outcomes(conn, boot, hello)
    call: list[bytearray] | None = payload
    first = True
    while call is not None:
        join_group = first and spec.backend is not None
        code = _call(outcomes, spec, call, rank, device, join_group=join_group, first=first)
        del call
        first = False
        if code is not None:
            return code
        call = _next_call(conn)  # a worker that stays: the next run's call, or the end
    _destroy_process_group()
    return 0


@dataclass(frozen=True)
class _Outcomes:
    """Where a rank's outcomes go: its channel, or a connection of its own for a large one."""

    conn: ChannelConnection
    boot: AgentBootstrap
    """Where the launcher listens, and the secret (which its repr does not show)."""
    hello: WorkerHello

    def send(self, message: Message, parts: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send an outcome: straight to the launcher if large (and it can), else on the channel."""
        size = sum(memoryview(part).nbytes for part in parts)
        if size <= DIRECT_OUTCOME_BYTES or not self._send_direct(message, parts):
            self.conn.send(message, parts)

    def _send_direct(
        self, message: Message, parts: Sequence[bytes | bytearray | memoryview]
    ) -> bool:
        """Send it on a connection of its own; ``False`` if none could be made."""
        boot = self.boot
        address = (boot.launcher_address, boot.launcher_port)
        try:
            direct = handshake.connect(address, boot.secret, "worker", boot.timings.connect_timeout)
        except (OSError, ProtocolError) as exc:
            sys.stderr.write(no_direct_text(address, exc))
            return False
        try:
            self.conn.send(DirectOutcome(self.hello.rank))  # the launcher waits for it
            direct.send(self.hello)
            direct.send(message, parts)
        finally:
            direct.close()
        return True


def users_path(launchers: Sequence[str], current: Sequence[str]) -> list[str]:
    """The ``sys.path`` a worker loads the user's call with: the launcher's, then the rest.

    The agent's boot code left the working folder off ``sys.path`` (see
    :data:`torchrunx.wire.bootstrap.BOOT_CODE`), so that torchrunx imports nothing from it;
    the user's code gets the launcher's entries back as the launcher had them (the working
    folder too, where ``python -m`` or a notebook put it there), then the entries the host's
    interpreter and the imports so far added (``current``'s others, in their order).
    """
    entries = [os.path.abspath(entry) for entry in launchers]  # noqa: PTH100 ("": the folder)
    return list(dict.fromkeys([*entries, *current]))


def _before_users_code(spec: WorkerSpec, boot: AgentBootstrap, *, first: bool) -> None:
    """Wait for the IDE (``debugpy=``); at the first call, the launcher's ``sys.path`` back.

    From there on the user's code runs: loading the call imports the modules it names.
    """
    debugger.wait_for_ide(spec.debugpy)
    if first:
        sys.path[:] = users_path(boot.sys_path, sys.path)


def _missing_module_note(exc: ModuleNotFoundError, hostname: str, rank: int) -> str:
    """Where the module that the call names by reference is missing, and what brings it."""
    return (
        f"module {exc.name!r}, which the function, its arguments or its results name, is not "
        f"importable on host {hostname} (rank {rank}): install it there, send the project "
        "with Launcher(ship=('.',)) (--ship .), or launch from a folder that host shares"
    )


def _call(  # noqa: PLR0913 (what one call needs)
    outcomes: _Outcomes,
    spec: WorkerSpec,
    payload: list[bytearray],
    rank: int,
    device: int | None,
    *,
    join_group: bool,
    first: bool,
) -> int | None:
    """Run one call and send its outcome; the exit code, or ``None`` if the worker stays.

    ``payload`` is emptied once loaded (its memory released). ``join_group``: initialise
    the process group first (the first call of a worker with a backend). ``first``: the
    worker's first call, which gives the user's code the launcher's ``sys.path``
    (:func:`users_path`; a worker that stays keeps what the user's code made of it).
    """
    try:
        _before_users_code(spec, outcomes.boot, first=first)
        try:
            func, args, kwargs = serialization.load_call(payload)
        except ModuleNotFoundError as exc:
            add_note(exc, _missing_module_note(exc, spec.hostname, rank))
            raise
        payload.clear()
        init_started = time.perf_counter()
        if join_group:
            assert spec.backend is not None  # noqa: S101 (only with a backend)
            _init_process_group(spec.backend, spec, rank, device)
        function_started = time.perf_counter()
        result = func(*args, **kwargs)
        function_ended = time.perf_counter()
    except SystemExit as exc:  # like the interpreter: a non-int code is printed, status 1
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return 1
    except BaseException as exc:  # noqa: BLE001 (every failure goes back to the launcher)
        if spec.post_mortem and not _echo_or_quit(exc):
            debugger.post_mortem(exc)
        if spec.backend is not None:
            _add_hints(exc, spec)
        outcomes.send(*_exception_message(rank, exc))
        return _EXIT_RAISED
    try:
        parts = serialization.dumps(result)
        pickled = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 (reported as a SerializationError)
        error = TypeError(
            f"the return value of rank {rank} ({type(result).__qualname__}) cannot be pickled: "
            f"{exception_text(exc)}"
        )
        message, blob = _exception_message(rank, error, unpicklable_result=True)
        outcomes.send(message, blob)
        return _EXIT_RAISED
    del result
    timings = WorkerResult(
        rank=rank,
        init_seconds=function_started - init_started,
        function_seconds=function_ended - function_started,
        pickle_seconds=pickled - function_ended,
        sent_at=time.time(),
    )
    _timings_first(outcomes, spec)
    outcomes.send(timings, parts)
    if spec.keep:
        return None
    outcomes.conn.close()
    _destroy_process_group()
    return 0


def _timings_first(outcomes: _Outcomes, spec: WorkerSpec) -> None:
    """Before a result: the rank's collective timings, for the straggler summary, if it is on."""
    if spec.stragglers and spec.progress_every is not None:  # the probe runs: the recorder too
        outcomes.conn.send(stallprobe.timings())


def _next_call(conn: ChannelConnection) -> list[bytearray] | None:
    """A worker that stays: wait for the next :class:`WorkerCall`; ``None`` at the end.

    The launcher ends the connection when the warm agents close (their Stop ends the worker
    too) or when it gives up on this worker; anything else it might send is not for us.
    """
    while True:
        try:
            message, payload = conn.recv()
        except (OSError, ProtocolError):
            conn.close()
            return None
        if isinstance(message, WorkerCall):
            return payload


def no_direct_text(address: tuple[str, int], error: BaseException) -> str:
    """The line a worker writes when its large outcome cannot go straight to the launcher."""
    return (
        f"torchrunx worker: cannot connect to the launcher at {address} ({error}): its outcome "
        "goes through the agent\n"
    )
