"""The rules of failure analysis (torchrunx/launcher/state/failures.py), one test per rule, on made-up facts.

The documented rules (docs/failures.md "Which failure is raised", docs/restarts.md):

- the launcher's own reasons come first; then root failures, the earliest by when they
  happened (never by the order the launcher learnt them); collective errors (a peer's echo)
  only when nothing else failed, then the earliest of them;
- a rank that raised and then died failed once, by its exception;
- ``restart_on`` categories are kept apart: "exceptions", "deaths", "timeouts", "hosts";
- launch_timeout, an unpicklable value, Ctrl-C and SIGTERM never restart.

Every sequence here varies *when* a failure happened apart from *when the launcher learnt of
it*, so that a rule that reads the wrong one is caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from torchrunx.errors import (
    AgentFailedError,
    LaunchTimeoutError,
    SerializationError,
    WorkerFailedError,
    WorkerRaisedError,
    WorkerTimeoutError,
)
from torchrunx.hosts.hostlists import HostSlots
from torchrunx.launcher.state.failures import (
    choose_cause,
    others,
    relevant,
    restartable,
    restarts_for,
)
from torchrunx.launcher.state.records import OUTCOME_WAIT, AgentRecord, Fault, FaultKind, RankRecord
from torchrunx.launcher.state.state import LaunchState
from torchrunx.wire.messages import AgentHello, WorkerExited, WorkerSpec

ECHO = "[gloo/transport/tcp/pair.cc] Connection closed by peer [10.0.0.2]:1234"


def running_launch(hosts: int = 2, workers: int = 2) -> LaunchState:
    """A launch whose agents said hello and whose workers all connected."""
    agents = [AgentRecord(i, HostSlots(f"node{i}", workers), "ssh") for i in range(hosts)]
    state = LaunchState(agents, agent_timeout=30.0, started=100.0)
    for agent in agents:
        hello = AgentHello(agent.index, agent.slots.hostname, 1000 + agent.index, workers, 29500)
        state.agent_table.agent_hello(agent, conn=agent.index, hello=hello, now=101.0)
        spec = WorkerSpec(
            agent.index,
            agent.slots.hostname,
            workers,
            agent.index * workers,
            hosts * workers,
            "10.0.0.1",
            29500,
            "gloo",
            600.0,
        )
        state.current.assign(agent, spec)
    for rank in state.ranks:
        state.current.worker_hello(rank, conn=100 + rank.rank, pid=2000 + rank.rank)
    return state


@dataclass(frozen=True)
class Failure:
    """A failure to feed to a launch: what, when it happened, and whose."""

    kind: FaultKind
    error: BaseException
    at: float
    rank: int | None = None
    host: int | None = None


def learn(state: LaunchState, failures: list[Failure]) -> None:
    """Record ``failures`` in this order (the order the launcher learnt them).

    The launch begins to stop on the first, as a real launch does, so the others are learnt
    while it stops.
    """
    for failure in failures:
        rank = None if failure.rank is None else state.ranks[failure.rank]
        state.current.add_fault(
            failure.kind, failure.error, failure.at, rank=rank, host_index=failure.host
        )
        state.begin_stop(restart=False)


def echo(at: float, rank: int = 0) -> Failure:
    return Failure("collective", RuntimeError(ECHO), at, rank=rank)


def root(kind: str, at: float, *, rank: int = 3, host: int = 1) -> Failure:
    """A root failure of ``kind`` (of ``rank``, or of ``host``), as the launch records it."""
    name = f"node{host}"
    if kind == "exception":
        return Failure("exception", ValueError(f"bad batch in rank {rank}"), at, rank=rank)
    if kind == "death":
        error = WorkerFailedError(name, rank % 2, rank, 2000 + rank, None, 9)
        return Failure("death", error, at, rank=rank)
    if kind == "hang":
        return Failure("hang", WorkerTimeoutError(name, rank % 2, rank, "step", 1.0), at, rank=rank)
    if kind == "agent":
        return Failure("agent", AgentFailedError(name, "connection closed"), at, host=host)
    assert kind == "lost"
    return Failure("lost", AgentFailedError(name, "no heartbeat"), at, host=host)


ROOT_KINDS = ["exception", "death", "hang", "agent", "lost"]

# (the echo arrives first?, the echo happened first?): all four, so that neither the arrival
# order nor the timestamps alone can pick the root failure.
ECHO_ORDERS = [
    pytest.param(True, True, id="echo-learnt-first-and-happened-first"),
    pytest.param(True, False, id="echo-learnt-first-happened-later"),
    pytest.param(False, True, id="echo-learnt-last-but-happened-first"),
    pytest.param(False, False, id="echo-learnt-last-and-happened-later"),
]


# -- which failure is the cause ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ROOT_KINDS)
@pytest.mark.parametrize(("echo_learnt_first", "echo_happened_first"), ECHO_ORDERS)
def test_rule_a_collective_echo_is_never_the_cause_when_a_root_failure_happened(
    kind, echo_learnt_first, echo_happened_first
):
    """Rule: collective errors are the cause only when nothing else failed, whatever their
    time and whatever their order of arrival."""
    state = running_launch()
    real = root(kind, at=10.5)
    peer = echo(at=10.0 if echo_happened_first else 11.0)
    learn(state, [peer, real] if echo_learnt_first else [real, peer])
    cause = choose_cause(state.faults)
    assert cause.error is real.error
    assert others(state.faults, cause) == [f"RuntimeError: {ECHO}"]


@pytest.mark.parametrize(
    ("arrival", "expected"),
    [
        pytest.param((0, 1, 2), 1, id="learnt-in-rank-order"),
        pytest.param((2, 1, 0), 1, id="learnt-in-reverse"),
        pytest.param((1, 0, 2), 1, id="earliest-learnt-first"),
        pytest.param((0, 2, 1), 1, id="earliest-learnt-last"),
    ],
)
def test_rule_echoes_alone_the_earliest_by_time_is_the_cause_not_the_first_learnt(
    arrival, expected
):
    """Rule: when only collective errors happened, the earliest of them (by time) is raised."""
    state = running_launch()
    times = {0: 10.2, 1: 10.0, 2: 10.1}  # rank 1's echo happened first
    learn(state, [echo(times[rank], rank) for rank in arrival])
    assert choose_cause(state.faults).rank == expected


@pytest.mark.parametrize("first", ROOT_KINDS)
@pytest.mark.parametrize("second", ROOT_KINDS)
def test_rule_among_root_failures_the_earliest_by_time_wins_not_the_first_learnt(first, second):
    """Rule: root failures are ranked by when they happened; the launcher learns the earlier
    one last here, and it must still be the cause."""
    state = running_launch()
    late = root(first, at=20.0, rank=3, host=1)
    early = root(second, at=10.0, rank=0, host=0)  # another rank, another host
    learn(state, [late, early])
    assert choose_cause(state.faults).error is early.error


@pytest.mark.parametrize(
    "reason",
    [
        pytest.param(KeyboardInterrupt(), id="ctrl-c"),
        pytest.param(SystemExit(143), id="sigterm"),
        pytest.param(LaunchTimeoutError("launch_timeout=5 s was hit"), id="launch-timeout"),
        pytest.param(SerializationError("cannot unpickle the return value"), id="unpickle"),
    ],
)
@pytest.mark.parametrize("kind", ROOT_KINDS)
def test_rule_the_launchers_own_reason_comes_first_even_learnt_last_and_latest(reason, kind):
    """Rule: the launcher's own reasons (Ctrl-C, SIGTERM, launch_timeout, its own errors) come
    before every root failure and echo, even when they happened last."""
    state = running_launch()
    learn(state, [echo(9.0), root(kind, 9.5), Failure("launch", reason, 30.0)])
    assert choose_cause(state.faults).error is reason


def test_rule_a_rank_that_raised_and_then_died_failed_once_by_its_exception():
    """Rule: a rank that raised and then exited non-zero failed once, by its exception: its
    death is neither the cause nor among the others, even when it is learnt first and dated
    earlier (the exception travels on its own connection and is dated by the worker)."""
    state = running_launch(1, 2)
    rank = state.ranks[1]
    # Its exit is reported, and its outcome does not come within OUTCOME_WAIT: a death.
    exit_report = WorkerExited(1, 2001, 1, None, at=10.0)
    assert not state.current.worker_exited(rank, exit_report, now=11.0)
    assert state.due(11.0 + OUTCOME_WAIT) == ([], [rank])
    state.current.settle(rank)
    assert [f.kind for f in state.faults] == ["death"]
    state.begin_stop(restart=False)
    # ... then its exception arrives after all, dated later than the death.
    error = ValueError("x")
    state.current.add_fault("exception", error, at=10.5, rank=rank)
    cause = choose_cause(state.faults)
    assert cause.error is error
    assert others(state.faults, cause) == []
    assert [f.kind for f in relevant(state.faults)] == ["exception"]


def test_rule_the_death_of_a_rank_that_raised_is_dropped_only_for_that_rank():
    """Rule: only the same rank's death is dropped; another rank's death still counts, and
    the earliest root failure is chosen among what is left."""
    death_of_1 = WorkerFailedError("node0", 1, 1, 2001, 1, None)
    death_of_0 = WorkerFailedError("node0", 0, 0, 2000, None, 9)
    raised_by_1 = ValueError("rank 1 raised")
    faults = [
        Fault("death", death_of_1, at=9.0, seq=0, rank=1, host_index=0),
        Fault("exception", raised_by_1, at=10.0, seq=1, rank=1, host_index=0),
        Fault("death", death_of_0, at=9.5, seq=2, rank=0, host_index=0),
    ]
    assert [f.error for f in relevant(faults)] == [raised_by_1, death_of_0]
    cause = choose_cause(faults)
    assert cause.error is death_of_0  # 9.5: rank 1's death at 9.0 does not count
    assert others(faults, cause) == ["ValueError: rank 1 raised"]


def test_rule_a_rank_its_watchdog_killed_failed_once_by_its_watchdog():
    """Rule: a rank whose watchdog fired and that was then killed failed once, by its
    ``WorkerTimeoutError`` (docs/watchdog.md), not by the death that followed."""
    hang = WorkerTimeoutError("node0", 0, 0, "step", 1.0)
    death = WorkerFailedError("node0", 0, 0, 2000, None, 9)
    faults = [
        Fault("death", death, at=9.0, seq=0, rank=0, host_index=0),
        Fault("hang", hang, at=10.0, seq=1, rank=0, host_index=0),
    ]
    assert choose_cause(faults).error is hang
    assert others(faults, choose_cause(faults)) == []


def test_rule_nothing_failed_is_a_bug_not_a_cause():
    with pytest.raises(ValueError, match="no failure"):
        choose_cause([])


# -- which failures restart -------------------------------------------------------------------


def _fault(kind: FaultKind, error: BaseException, *, rank: int | None) -> Fault:
    return Fault(kind, error, at=10.0, seq=0, rank=rank, host_index=0 if rank is not None else 1)


def _raised_without_type() -> WorkerRaisedError:
    error = WorkerRaisedError("mypkg.TransientError: flaky (raised in worker rank 0 ...)")
    error.type_name = "mypkg.TransientError"
    return error


# Every fault as the launch records it: its kind, its error, and whether it is a rank's.
FAULTS: dict[str, Fault] = {
    "exception": _fault("exception", ValueError("bad batch"), rank=0),
    "exception-without-its-type": _fault("exception", _raised_without_type(), rank=0),
    "collective": _fault("collective", RuntimeError(ECHO), rank=0),
    "death": _fault("death", WorkerFailedError("node0", 0, 0, 2000, None, 9), rank=0),
    "hang": _fault("hang", WorkerTimeoutError("node0", 0, 0, "step", 1.0), rank=0),
    "agent": _fault("agent", AgentFailedError("node1", "connection closed"), rank=None),
    "lost": _fault("lost", AgentFailedError("node1", "no heartbeat"), rank=None),
    "unpicklable-return-value": _fault(
        "exception", SerializationError("the return value cannot be pickled"), rank=0
    ),
    "launch_timeout": _fault("launch", LaunchTimeoutError("launch_timeout"), rank=None),
    "ctrl-c": _fault("launch", KeyboardInterrupt(), rank=None),
    "sigterm": _fault("launch", SystemExit(143), rank=None),
    "launcher-cannot-unpickle": _fault("launch", SerializationError("unpickle"), rank=None),
}

# The expected table, written out from docs/restarts.md: which one category restarts which.
RESTARTED_BY: dict[str, set[str]] = {
    "exception": {"exceptions"},
    "exception-without-its-type": {"exceptions"},
    "collective": {"exceptions"},
    "death": {"deaths"},
    "hang": {"timeouts"},
    "agent": {"hosts"},
    "lost": {"hosts"},
    "unpicklable-return-value": set(),
    "launch_timeout": set(),
    "ctrl-c": set(),
    "sigterm": set(),
    "launcher-cannot-unpickle": set(),
}
CATEGORIES = ["exceptions", "deaths", "timeouts", "hosts"]


def test_the_table_covers_every_fault_kind():
    assert {f.kind for f in FAULTS.values()} == {
        "exception",
        "collective",
        "death",
        "hang",
        "agent",
        "lost",
        "launch",
    }
    assert set(FAULTS) == set(RESTARTED_BY)


@pytest.mark.parametrize("category", CATEGORIES)
@pytest.mark.parametrize("name", list(FAULTS))
def test_rule_each_restart_category_restarts_its_own_faults_and_no_other(category, name):
    """Rule: "exceptions", "deaths", "timeouts" and "hosts" are kept apart (a watchdog is not
    a death, a death is not an exception, ...), and some faults restart under none."""
    fault = FAULTS[name]
    expected = category in RESTARTED_BY[name]
    from_worker = fault.rank is not None
    assert restarts_for(fault.error, {category}, from_worker=from_worker) is expected
    assert restartable(fault, (category,), attempt=0, max_restarts=1) is expected


@pytest.mark.parametrize("name", list(FAULTS))
def test_rule_the_default_restart_on_restarts_every_worker_failure_only(name):
    """Rule: the default ``("exceptions", "deaths", "timeouts")`` restarts every worker
    failure, and neither a host's nor the launcher's own."""
    default = ("exceptions", "deaths", "timeouts")
    expected = bool(RESTARTED_BY[name] & set(default))
    assert restartable(FAULTS[name], default, attempt=0, max_restarts=1) is expected


@pytest.mark.parametrize("name", list(FAULTS))
def test_rule_nothing_restarts_once_the_restarts_are_used_up(name):
    every = ("exceptions", "deaths", "timeouts", "hosts")
    assert not restartable(FAULTS[name], every, attempt=1, max_restarts=1)
    assert not restartable(FAULTS[name], every, attempt=0, max_restarts=0)


# docs/restarts.md, "These never restart": each entry, as the launch records it.
NEVER_RESTART = [
    pytest.param(FAULTS["launch_timeout"], id="launch_timeout"),
    pytest.param(FAULTS["unpicklable-return-value"], id="unpicklable-return-value"),
    pytest.param(FAULTS["launcher-cannot-unpickle"], id="launcher-cannot-unpickle"),
    pytest.param(FAULTS["ctrl-c"], id="ctrl-c"),
    pytest.param(FAULTS["sigterm"], id="sigterm"),
]

# Whatever restart_on holds: every category, and every name these errors answer to.
EVERYTHING = (
    "exceptions",
    "deaths",
    "timeouts",
    "hosts",
    "Exception",
    "BaseException",
    "TypeError",
    "TimeoutError",
    "OSError",
    "KeyboardInterrupt",
    "SystemExit",
    "TorchrunxError",
    "SerializationError",
    "LaunchTimeoutError",
    "torchrunx.errors.SerializationError",
    "torchrunx.errors.LaunchTimeoutError",
)


@pytest.mark.parametrize("fault", NEVER_RESTART)
def test_rule_these_never_restart_whatever_restart_on_holds(fault):
    """Rule (docs/restarts.md): launch_timeout, a value that cannot be pickled, Ctrl-C and
    SIGTERM never restart, even with every category and their own type names in restart_on."""
    assert not restartable(fault, EVERYTHING, attempt=0, max_restarts=1)
    for entry in EVERYTHING:
        assert not restartable(fault, (entry,), attempt=0, max_restarts=1), entry


def test_rule_an_agent_that_fails_to_start_does_not_restart_under_the_default():
    """Rule (docs/restarts.md): an agent's failure is no worker failure: without "hosts"
    nothing restarts it (that an agent which fails to start never restarts, even with
    "hosts", is the orchestrator's: it raises before any worker runs)."""
    fault = Fault("agent", AgentFailedError("nohost", "cannot connect"), 1.0, 0, host_index=0)
    names = tuple(entry for entry in EVERYTHING if entry != "hosts")
    assert not restartable(fault, names, attempt=0, max_restarts=1)
    assert restartable(fault, ("hosts",), attempt=0, max_restarts=1)


@pytest.mark.parametrize(
    ("restart_on", "restarts"),
    [
        (("ValueError",), True),
        (("builtins.ValueError",), True),
        (("Exception",), True),
        (("OSError",), False),
        (("deaths", "timeouts", "hosts"), False),
    ],
)
def test_rule_type_names_restart_exceptions_of_that_type_only(restart_on, restarts):
    assert restartable(FAULTS["exception"], restart_on, attempt=0, max_restarts=1) is restarts


@pytest.mark.parametrize(
    ("restart_on", "restarts"),
    [
        (("mypkg.TransientError",), True),
        (("TransientError",), True),
        (("OtherError",), False),
        (("WorkerRaisedError",), False),  # its own type is not the user's
    ],
)
def test_rule_an_exception_without_its_type_restarts_by_the_type_name_it_had(restart_on, restarts):
    fault = FAULTS["exception-without-its-type"]
    assert restartable(fault, restart_on, attempt=0, max_restarts=1) is restarts


@pytest.mark.parametrize("name", ["death", "hang", "agent", "lost"])
def test_rule_type_names_of_torchrunx_errors_are_not_categories(name):
    """Rule: deaths, watchdogs and hosts restart by their category only, not by the type name
    of the error torchrunx made for them."""
    names = (
        "WorkerFailedError",
        "WorkerTimeoutError",
        "TimeoutError",
        "AgentFailedError",
        "TorchrunxError",
        "Exception",
    )
    assert not restartable(FAULTS[name], names, attempt=0, max_restarts=1)


def test_the_rank_record_is_what_makes_a_fault_a_workers():
    """A fault recorded for a rank is a worker's (``from_worker``), one for a host is not."""
    state = running_launch(1, 1)
    rank: RankRecord = state.ranks[0]
    state.current.add_fault("exception", ValueError("x"), 1.0, rank=rank)
    state.current.add_fault("lost", AgentFailedError("node0", "silent"), 1.0, host_index=0)
    assert [(f.rank, f.host_index) for f in state.faults] == [(0, 0), (None, 0)]
    assert restartable(state.faults[0], ("exceptions",), attempt=0, max_restarts=1)
    assert not restartable(state.faults[1], ("exceptions",), attempt=0, max_restarts=1)


# -- held-out mutants (round 55b): the rules they broke ------------------------------------------


class Outer:
    """A user's namespace for an exception type (its qualified name is ``Outer.Transient``)."""

    class Transient(Exception):  # noqa: N818 (a user's name)
        pass


def test_rule_a_nested_exception_type_restarts_by_its_qualified_name():
    fault = _fault("exception", Outer.Transient("flaky"), rank=0)
    assert restartable(fault, ("Outer.Transient",), attempt=0, max_restarts=1)
    assert restartable(fault, (f"{__name__}.Outer.Transient",), attempt=0, max_restarts=1)
    assert restartable(fault, ("Transient",), attempt=0, max_restarts=1)


def test_rule_the_launchers_own_plain_error_never_restarts_whatever_restart_on_holds():
    fault = _fault("launch", OSError("the launcher's listener failed"), rank=None)
    assert not restartable(fault, EVERYTHING, attempt=0, max_restarts=1)


def test_rule_an_exception_without_its_type_restarts_only_as_a_workers():
    error = _raised_without_type()
    assert restarts_for(error, {"exceptions"}, from_worker=True)
    assert not restarts_for(error, {"exceptions", "mypkg.TransientError"}, from_worker=False)


def test_rule_the_other_failures_are_listed_in_the_order_they_were_learnt():
    cause = Fault("exception", ValueError("cause"), at=1.0, seq=0, rank=0)
    late = Fault("exception", OSError("learnt last"), at=2.0, seq=2, rank=1)
    early = Fault("exception", KeyError("learnt first"), at=3.0, seq=1, rank=2)
    assert others([cause, late, early], cause) == [
        "KeyError: 'learnt first'",
        "OSError: learnt last",
    ]
