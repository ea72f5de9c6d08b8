"""The forked child: from a copy of the agent to a worker process, then :func:`worker.run`.

Right after ``fork`` the child is a copy of the agent, threads aside. :func:`become_worker`
makes it a worker process, in this order:

1. its stdout and stderr pipes become descriptors 1 and 2 (so C code and child processes
   write there too), and it attaches its watchdog page (:mod:`torchrunx.timer`);
2. its own session and process group (``setsid``), so that the agent can stop the worker's
   whole tree, and ``PR_SET_PDEATHSIG`` = SIGKILL, so that it dies with the agent;
3. SIGTERM and SIGINT back to their default actions (the agent handles or ignores them);
4. every descriptor of the agent closed (its selector, its launcher socket, the other
   workers' pipes, the store's socket but in rank 0), and stdin from ``/dev/null``;
5. a check that its parent is still the agent (else the agent died before step 2: exit 1);
6. ``TMPDIR`` and ``tempfile.tempdir``: the agent's private temporary directory
   (:mod:`torchrunx.agent.leftovers`), if it could make one;
7. ``faulthandler`` on SIGUSR1, writing its Python stacks into its stack pipe;
   rank 0 serves the rendezvous store's socket (:mod:`torchrunx.agent.store`);
8. :func:`torchrunx.worker.worker.run` (imported only here), whose return value is the exit code.

The child never returns into the agent's code: it ends with ``os._exit``, exit code 1 if
anything above raised.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import tempfile
from typing import TYPE_CHECKING, NoReturn, Protocol

from torchrunx import preemption, timer
from torchrunx.agent import leftovers
from torchrunx.agent.store import serve_when_torch_imported

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torchrunx.agent.workergroup import Fork
    from torchrunx.wire.bootstrap import AgentBootstrap
    from torchrunx.wire.messages import WorkerSpec


class Closable(Protocol):
    """An object of the agent that holds a descriptor: its selector, its launcher socket."""

    def close(self) -> None:
        """Close the descriptor (in this process only)."""


def become_worker(  # noqa: PLR0913 (what a worker needs from its agent)
    fork: Fork,
    *,
    boot: AgentBootstrap,
    spec: WorkerSpec,
    payload: list[bytearray],
    agent_pid: int,
    gpus: int,
    cpus: int,
    agent_objects: Sequence[Closable],
    tmpdir: str | None = None,
    store_fd: int | None = None,
) -> NoReturn:
    """Turn the forked child into a worker, run its rank, and exit (see the module).

    Args:
        fork: The descriptors and page the worker group made for this child.
        boot: The agent's bootstrap: where a large outcome goes on a connection of its own.
        spec: The worker group's spec.
        payload: The pickled call.
        agent_pid: The agent's pid, to check that the agent still lives once PDEATHSIG is set.
        gpus: GPUs the agent counted on this host.
        cpus: CPU cores the agent may use.
        agent_objects: The agent's selector and launcher socket, closed here. A plain
            ``close``, never a ``shutdown``: that would cut the agent's own connection.
        tmpdir: The agent's private temporary directory, the worker's ``TMPDIR``.
        store_fd: Rank 0 only: the listening socket of the rendezvous store, which it
            serves (:mod:`torchrunx.agent.store`).
    """
    code = 1
    try:
        os.dup2(fork.stdout, 1)  # descriptor level: C code and child processes too
        os.dup2(fork.stderr, 2)
        os.close(fork.stdout)
        os.close(fork.stderr)
        timer.attach(fork.page)
        os.setsid()  # own process group: the agent can stop the worker's whole tree
        leftovers.set_parent_death_signal(signal.SIGKILL)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        preemption.attach(fork.notice, spec.preemption_grace)  # an outside SIGTERM: a notice
        for agent_object in agent_objects:
            agent_object.close()
        for fd in fork.inherited:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if os.getppid() != agent_pid:
            os._exit(1)  # the agent died before PDEATHSIG was armed
        if tmpdir is not None:
            os.environ["TMPDIR"] = tmpdir  # for the processes it starts
            tempfile.tempdir = tmpdir  # the agent's gettempdir() may have cached another
        faulthandler.register(signal.SIGUSR1, file=fork.stack, all_threads=True)
        if store_fd is not None:  # the other ranks may be waiting in its backlog already
            serve_when_torch_imported(store_fd, spec.master_port, spec.timeout)
        from torchrunx.worker import worker  # noqa: PLC0415 (only in the worker)

        code = worker.run(boot, fork.channel, spec, payload, fork.local_rank, gpus=gpus, cpus=cpus)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
