"""torchrunx's errors as rules: their messages, their pickling, notes, and collective echoes.

- each error's message names what failed, where, and how (docs/failures.md);
- an error pickles with its constructor's arguments, so it crosses the wire whole;
- notes follow the message: Python 3.11+ prints them, on 3.10 the error's text carries them;
- a collective error is recognised in a chain of at most 8 causes, by type (torch's own) or
  by gloo's and NCCL's words in a RuntimeError or OSError.
"""

from __future__ import annotations

import pickle
import signal

import pytest

from torchrunx import errors
from torchrunx.errors import (
    SIGKILL_CAUSES,
    AgentFailedError,
    Preempted,
    RemoteTraceback,
    StallError,
    TorchrunxError,
    WorkerFailedError,
    WorkerTimeoutError,
    add_note,
    describe_exit,
    exception_text,
    is_collective_error,
)


def test_an_agents_failure_names_its_host_and_reason_and_its_stderr_only_if_any():
    error = AgentFailedError("node1", "gone", "line 1\nline 2\n\n")
    assert str(error) == (
        "agent on host 'node1' failed: gone\n--- agent stderr (last lines) ---\nline 1\nline 2"
    )
    assert str(AgentFailedError("node1", "gone", " \n")) == "agent on host 'node1' failed: gone"
    assert (error.hostname, error.reason, error.stderr) == ("node1", "gone", "line 1\nline 2\n\n")
    assert AgentFailedError.restart_category == "hosts"


def test_a_dead_workers_message_says_how_it_ended():
    killed = WorkerFailedError("node2", 1, 3, 4242, None, signal.SIGKILL)
    assert str(killed) == (
        "worker rank 3 (local rank 1 on host 'node2', pid 4242) died with signal 9 (SIGKILL) "
        f"without raising: {SIGKILL_CAUSES}"
    )
    assert killed.signal_name == "SIGKILL"
    segv = WorkerFailedError("node2", 1, 3, 4242, None, signal.SIGSEGV)
    assert str(segv).endswith("died with signal 11 (SIGSEGV) without raising")
    exited = WorkerFailedError("node2", 1, 3, 4242, 0, None)
    assert str(exited) == (
        "worker rank 3 (local rank 1 on host 'node2', pid 4242) exited with code 0 before "
        "returning (sys.exit(0) or os._exit(0)?)"
    )
    assert exited.signal_name is None
    assert (exited.hostname, exited.local_rank, exited.rank, exited.pid) == ("node2", 1, 3, 4242)
    assert (exited.exitcode, exited.signal, killed.exitcode, killed.signal) == (0, None, None, 9)
    assert "died with exit code 2 without raising" in str(WorkerFailedError("h", 0, 0, 1, 2, None))
    assert WorkerFailedError.restart_category == "deaths"


def test_how_a_process_ended_is_described_with_its_signals_name():
    assert describe_exit(3, None) == "exit code 3"
    assert describe_exit(None, None) == "exit code None"
    assert describe_exit(1, 15) == "signal 15 (SIGTERM)"  # a signal wins over a code
    assert describe_exit(None, 200) == "signal 200 (unknown signal)"
    assert WorkerFailedError("h", 0, 0, 1, None, 200).signal_name is None


def test_a_watchdogs_timeout_names_the_scope_and_its_limit():
    error = WorkerTimeoutError("node0", 2, 6, "step", 1.5)
    assert str(error) == (
        "worker rank 6 (local rank 2 on host 'node0') stayed in timer scope 'step' longer than "
        "its limit of 1.5 s; the watchdog stopped it"
    )
    assert (error.hostname, error.local_rank, error.rank, error.scope, error.limit) == (
        "node0",
        2,
        6,
        "step",
        1.5,
    )
    assert isinstance(error, TimeoutError) and WorkerTimeoutError.restart_category == "timeouts"


@pytest.mark.parametrize(
    "error",
    [
        AgentFailedError("node1", "gone", "err"),
        WorkerFailedError("node2", 1, 3, 4242, None, 9),
        WorkerFailedError("node2", 0, 5, 77, None, 9, "most likely the kernel's OOM killer"),
        WorkerTimeoutError("node0", 2, 6, "step", 1.5),
        StallError(300.5, "rank 1 in the user's code\n", {"unanswered": [2]}),
    ],
)
def test_an_error_pickles_with_its_fields_and_message(error):
    back = pickle.loads(pickle.dumps(error))  # noqa: S301 (made here)
    assert type(back) is type(error)
    assert vars(back) == vars(error) and str(back) == str(error)


def test_a_preemption_says_how_many_ranks_returned_and_whether_the_job_was_requeued():
    error = Preempted("the launcher received SIGTERM", {0: 1}, 4)
    assert str(error) == (
        "the launch was preempted (the launcher received SIGTERM): 1 of 4 ranks returned in "
        "the grace period"
    )
    assert error.code == 143 and error.requeued is False
    requeued = Preempted("x", {}, 2, requeued=True)
    assert str(requeued).endswith(
        "0 of 2 ranks returned in the grace period; the SLURM job was requeued"
    )


def test_a_remote_traceback_is_shown_as_the_worker_printed_it():
    remote = RemoteTraceback("Traceback (most recent call last):\n  boom\n\n")
    assert str(remote) == "\n\nTraceback (most recent call last):\n  boom"
    assert remote.text == "Traceback (most recent call last):\n  boom\n\n"
    assert remote.args == (remote.text,)


def test_notes_are_printed_by_python_from_3_11_and_carried_by_the_text_on_3_10(monkeypatch):
    printed = AgentFailedError("h", "r")
    add_note(printed, "first")
    add_note(printed, "second")
    assert printed.__notes__ == ["first", "second"]
    assert str(printed) == "agent on host 'h' failed: r"  # Python prints the notes itself
    monkeypatch.setattr(errors, "NOTES_PRINTED", False)
    assert str(printed) == "agent on host 'h' failed: r\nfirst\nsecond"
    assert str(TorchrunxError("plain")) == "plain"
    error = AgentFailedError("h", "r")
    add_note(error, "one")
    add_note(error, "two")
    assert error.__notes__ == ["one", "two"]
    assert str(error) == "agent on host 'h' failed: r\none\ntwo"


def test_on_3_10_a_users_exceptions_note_follows_its_remote_traceback(monkeypatch):
    monkeypatch.setattr(errors, "NOTES_PRINTED", False)
    users = ValueError("bad")
    users.__cause__ = RemoteTraceback("Traceback:\n  line\n")
    add_note(users, "ranks 1-3 failed the same way")
    assert users.__notes__ == ["ranks 1-3 failed the same way"]
    assert users.__cause__.text == "Traceback:\n  line\nranks 1-3 failed the same way"
    ours = AgentFailedError("h", "r")  # a torchrunx error shows its notes in its own text
    ours.__cause__ = RemoteTraceback("Traceback:\n")
    add_note(ours, "note")
    assert ours.__cause__.text == "Traceback:\n"
    plain = ValueError("no traceback")
    plain.__cause__ = ValueError("a cause of another kind")
    add_note(plain, "kept")
    assert plain.__notes__ == ["kept"] and str(plain.__cause__) == "a cause of another kind"


def test_an_exception_whose_str_raises_is_still_told():
    class BrokenError(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert exception_text(BrokenError()) == "<exception str() failed>"
    assert exception_text(ValueError("fine")) == "fine"


class _DistError(RuntimeError):
    """Stands for torch.distributed's DistError: a type named so, defined in a torch module."""


_DistError.__module__ = "torch.distributed"
_DistError.__name__ = "DistBackendError"


def _chain(depth: int, last: BaseException) -> BaseException:
    """``last`` at the end of a chain of ``depth`` exceptions (``depth`` - 1 before it)."""
    error = last
    for index in range(depth - 1):
        outer = KeyError(index)
        outer.__cause__ = error
        error = outer
    return error


@pytest.mark.parametrize(
    "error",
    [
        _DistError("anything"),
        RuntimeError("in third_party/gloo/transport"),
        RuntimeError("ProcessGroupGloo failed"),
        RuntimeError("ProcessGroupNCCL watchdog"),
        OSError("NCCL error: unhandled system error"),
        RuntimeError("Connection closed by peer [10.0.0.1]:5"),
        RuntimeError("Connection reset by peer"),
    ],
)
def test_a_collective_error_is_told_by_torchs_type_or_gloos_and_ncclss_words(error):
    assert is_collective_error(error)


@pytest.mark.parametrize(
    "error",
    [
        OSError("Connection reset by peer"),  # a user's own connection
        ValueError("NCCL error"),  # neither a RuntimeError nor an OSError
        type("DistBackendError", (RuntimeError,), {})("mine"),  # the name, not torch's module
    ],
)
def test_what_is_not_a_collective_error(error):
    assert not is_collective_error(error)


def test_a_collective_error_is_found_within_8_links_of_the_chain_by_cause_or_context():
    assert is_collective_error(_chain(8, RuntimeError("NCCL error")))
    assert not is_collective_error(_chain(9, RuntimeError("NCCL error")))
    handling = KeyError("x")
    handling.__context__ = RuntimeError("NCCL error")
    assert is_collective_error(handling)
    both = KeyError("x")
    both.__cause__ = ValueError("the cause is followed, not the context")
    both.__context__ = RuntimeError("NCCL error")
    assert not is_collective_error(both)


def test_a_stall_says_how_long_and_carries_its_diagnosis():
    error = StallError(302.25, "ranks 0-1 wait in all_reduce #41\n", {"mismatch": False})
    assert str(error) == (
        "no rank made progress for 302 s (stall_timeout):\nranks 0-1 wait in all_reduce #41\n"
    )
    assert (error.seconds, error.text, error.diagnosis) == (
        302.25,
        "ranks 0-1 wait in all_reduce #41\n",
        {"mismatch": False},
    )
    assert isinstance(error, TimeoutError) and isinstance(error, TorchrunxError)
    assert StallError.restart_category == "timeouts"
