"""The guardian: the agent's parent, which ends whatever the agent leaves, however the agent ends.

The process the launcher starts (bash, then ``exec python``: the pid the launcher knows) does
not run the agent itself. Once it has read its bootstrap line, :func:`fork_agent` makes the
workers' private temporary directory (see :mod:`torchrunx.agent.leftovers`), makes this process a
child subreaper and forks: the child returns and goes on as the agent, this process stays as
its guardian and only waits for it. Every process below the agent is below the guardian too,
and an orphan there is adopted by the agent (itself a subreaper) or, once the agent is gone,
by the guardian: nothing a worker starts can leave the tree, daemons included.

While the agent runs, the guardian passes SIGTERM on to it (SIGINT stays ignored), and watches
the launcher's end of the agent's stdin (the SSH session, the ``srun`` step's or the local
pipe): once it is closed, the agent has ``grace`` seconds to end by itself (it stops on that
EOF), then the guardian sends it SIGKILL. So an agent that cannot act (``SIGSTOP``, a hung
interpreter) does not outlive its launcher. When the agent has ended, however (its own exit,
SIGKILL, a crash), the guardian sends SIGKILL to every process still below it and reaps them,
removes the private temporary directory (the agent removes it itself when it can), and ends
the way the agent ended: the same exit status, or the same signal. So the launcher sees the
agent's end as before, only after everything below it is gone.

The agent leaves the guardian's process group right after the fork (``setpgid``), and gets
SIGTERM when the guardian dies (``PR_SET_PDEATHSIG``): a SIGKILL to the launcher's process
group of a local agent then ends the guardian only, and the agent, told by that SIGTERM, kills
its workers and everything below it at once, and exits.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import sys
import time
from typing import NoReturn

from torchrunx.agent import leftovers


def missing_pidfds() -> str | None:
    """Why this host cannot run an agent, or ``None``: the agent needs pidfds (Linux 5.3+).

    The guardian signals the agent, and the agent watches and signals its workers, through
    pidfds, so that no signal ever reaches a process that reused a pid. Checked before anything
    is forked, so the launcher's ``AgentFailedError`` says this instead of a traceback.
    """
    import platform  # noqa: PLC0415 (only for the message: 2 ms of every agent's start)

    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return (
            f"this Python ({platform.python_version()}, {sys.platform}) has no os.pidfd_open: "
            "torchrunx agents need Linux 5.3 or later"
        )
    try:
        os.close(opener(os.getpid()))
    except OSError as exc:
        return (
            f"the kernel refuses pidfd_open ({exc}; kernel {platform.release()}): torchrunx "
            "agents need Linux 5.3 or later, to watch and signal processes without pid reuse"
        )
    return None


def fork_agent(*, grace: float) -> str | None:
    """Fork the agent; only the agent returns, this process becomes its guardian.

    ``grace``: seconds the agent has to end once its stdin is closed (see the module): the
    bootstrap's ``timings.guardian_grace``.

    Returns the workers' private temporary directory (one for all the agent's workers), or
    ``None`` if none could be made: :func:`torchrunx.agent.leftovers.make_private_dir` has then
    written a warning to stderr, which the launcher logs as the agent's.
    """
    tmpdir = leftovers.make_private_dir()
    leftovers.set_child_subreaper()
    guardian = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    agent = os.fork()
    if agent != 0:
        _guard(agent, tmpdir, grace)  # never returns
    os.setpgid(0, 0)  # out of the group the launcher may SIGKILL: see the module
    leftovers.set_parent_death_signal(signal.SIGTERM)
    leftovers.set_child_subreaper()  # not inherited
    if os.getppid() != guardian:
        os._exit(1)  # the guardian died before the death signal was armed
    return tmpdir


def _guard(agent: int, tmpdir: str | None, grace: float) -> NoReturn:
    status = 1 << 8  # exit status 1, if anything below fails
    try:
        pidfd = os.pidfd_open(agent)  # signals reach the agent, never a reuser of its pid

        def forward(signum: int, _frame: object) -> None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signum)

        signal.signal(signal.SIGTERM, forward)
        stdin = os.dup(0)  # watched for its end only: the agent alone reads it
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        _wait_for(pidfd, stdin, grace)
        os.close(stdin)
        while True:
            pid, status = os.waitpid(-1, 0)  # only the agent: orphans go to it while it lives
            if pid == agent:
                break
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing to pass on: finish first
        os.close(pidfd)
        left = leftovers.kill_descendants(os.getpid())
        if left:
            pids = ", ".join(str(proc.pid) for proc in left)
            sys.stderr.write(f"torchrunx agent: could not end processes {pids}\n")
        leftovers.remove_dir(tmpdir)
    finally:
        _end_like(status)


def _wait_for(pidfd: int, stdin: int, grace: float) -> None:
    """Wait until the agent ends; SIGKILL it ``grace`` s after its stdin's other end closed."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(stdin, select.POLLRDHUP)  # and POLLHUP, POLLERR: always reported
    kill_at: float | None = None
    while True:
        wait = None if kill_at is None else max(0, round((kill_at - time.monotonic()) * 1000))
        ready = dict(poller.poll(wait))
        if pidfd in ready:
            return
        if stdin in ready:  # the launcher's end is gone: the agent should end now
            poller.unregister(stdin)
            kill_at = time.monotonic() + grace
        if kill_at is not None and time.monotonic() >= kill_at:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            kill_at = None  # its end wakes the poll


def _end_like(status: int) -> NoReturn:
    """Exit with the agent's exit status, or die of the signal that ended it."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        os._exit(code)
    signum = -code
    with contextlib.suppress(Exception):  # no core dump of the guardian: the agent crashed
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.suppress(Exception):
        if signum not in {signal.SIGKILL, signal.SIGSTOP}:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default action is not to end a process
