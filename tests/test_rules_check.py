"""Rules of ``torchrunx check``'s judgement of one host's answer, and of its wire lines (pure).

What a probe answered (or why it did not) becomes the host's problems, each with what to do;
the launcher's side of the comparison is a :class:`Local`. No process, no socket.
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest

from torchrunx.agent import probe
from torchrunx.agent.probe import ProbeReport, ProbeRequest
from torchrunx.launcher import preflight
from torchrunx.launcher.preflight import Local, format_checks, judge

if TYPE_CHECKING:
    from collections.abc import Callable

LOCAL = Local(
    python_version="3.11.7",
    torchrunx="0.5.0",
    torch="2.13.0",
    backend="auto",
    workers_per_host="auto",
    env_file=None,
)


def report(**changes: object) -> ProbeReport:
    fields: dict[str, object] = {
        "hostname": "node2",
        "python": "/venv/bin/python",
        "python_version": "3.11.9",
        "torchrunx": "0.5.0",
        "torch": "2.13.0",
        "gpus": 4,
        "cpus": 32,
        "cwd": "/work",
        "route_back": "ok",
        "master": "ok",
        "pidfds": None,
        "seconds": 0.2,
    }
    fields.update(changes)
    return ProbeReport(**fields)  # type: ignore[arg-type]


def judged(index: int = 1, local: Local = LOCAL, status: int | None = 0, **answer: object):
    lines = [(False, "some output"), (False, report(**answer).to_line())]
    return judge(
        index,
        "node2",
        "ssh",
        local,
        start_failure=None,
        status=status,
        lines=lines,
        seconds=0.5,
        timeout=60,
    )


def test_a_ready_host_has_its_facts_and_no_problem():
    host = judged()
    assert host.ok
    assert host.facts == (
        "python 3.11.9 (/venv/bin/python)",
        "torchrunx 0.5.0",
        "torch 2.13.0",
        "4 GPUs",
        "32 CPUs",
    )


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (
            {"python_version": "3.10.13"},
            (
                "Python 3.10.13 here, 3.11.7 in the launcher: functions and results are pickled "
                "between them; use the same Python minor version"
            ),
        ),
        (
            {"torchrunx": "0.4.0"},
            "torchrunx 0.4.0 here, 0.5.0 in the launcher: install the same version on every host",
        ),
        (
            {"torch": None},
            (
                "torch is not installed here, 2.13.0 in the launcher: install the same torch on "
                "every host"
            ),
        ),
        (
            {"route_back": "cannot connect to 10.0.0.1:29400: timed out"},
            (
                "the host cannot reach this machine: cannot connect to 10.0.0.1:29400: timed out; "
                "set launcher_address (or TORCHRUNX_LAUNCHER_ADDR) to an address of this machine "
                "that the host can reach, and let it through the firewall (TORCHRUNX_LAUNCHER_PORT "
                "fixes the port); or launch with relay='auto' (--relay auto): its connections "
                "then travel over its agent's channel"
            ),
        ),
        (
            {"master": "cannot connect to 10.0.0.2:41000: [Errno 111] Connection refused"},
            (
                "the host cannot reach host 0: cannot connect to 10.0.0.2:41000: [Errno 111] "
                "Connection refused; workers connect to host 0 on a free port it picks (MASTER_PORT): "
                "open the ports between the hosts"
            ),
        ),
        ({"pidfds": "this kernel has no pidfd_open"}, "this kernel has no pidfd_open"),
    ],
)
def test_each_difference_that_breaks_a_launch_is_a_problem_saying_what_to_do(answer, problem):
    host = judged(**answer)
    assert host.problems == (problem,)
    assert not host.ok


def test_host_0_is_not_blamed_for_the_hosts_that_did_not_reach_it():
    assert judged(index=0, master="0 of the 1 other hosts connected to this host's port 4").ok


def test_gpus_the_launch_asks_for():
    nccl = Local(**{**LOCAL.__dict__, "backend": "nccl"})
    assert judged(local=nccl, gpus=0).problems == (
        "no GPU found, but the launch asks for backend='nccl'",
    )
    gpu = Local(**{**LOCAL.__dict__, "workers_per_host": "gpu"})
    assert judged(local=gpu, gpus=0).problems == (
        "no GPU found, but the launch asks for workers_per_host='gpu'",
    )
    assert judged(local=gpu, gpus=1).ok
    assert judged(gpus=0).facts[3] == "no GPU"


def no_report(status: int | None, *errors: str, local: Local = LOCAL) -> tuple[str, ...]:
    lines = [(True, error) for error in errors]
    return judge(
        1,
        "node2",
        "ssh",
        local,
        start_failure=None,
        status=status,
        lines=lines,
        seconds=1.0,
        timeout=60,
    ).problems


def test_a_probe_that_did_not_answer_says_why():
    python = sys.executable
    assert no_report(None) == ("no answer within start_timeout=60 s",)
    assert no_report(127, f"bash: line 1: {python}: No such file or directory") == (
        (
            f"the interpreter {python} is missing on this host (bash: line 1: {python}: No such file "
            "or directory): install the same environment at the same path on every host, or name "
            "this host's own with Launcher(python=...) (--python PATH)"
        ),
    )
    (problem,) = no_report(1, "ModuleNotFoundError: No module named 'torchrunx'")
    assert problem.startswith(f"{python} on this host cannot import torchrunx (ModuleNotFound")
    assert problem.endswith(
        "install this project in that environment on every host, or send it with "
        "Launcher(ship=('.',)) (--ship .)"
    )
    (problem,) = no_report(1, "bash: line 1: cd: /home/me/proj: No such file or directory")
    assert problem.endswith(
        "workers start there; use a folder that every host has (a shared file system), or send "
        "it with Launcher(ship=('.',)) (--ship .)"
    )
    # The agent's script says what is missing itself: its words, as they are.
    said = "the working directory /p is not on this host: send it with Launcher(ship=('.',))"
    assert no_report(1, "bash: warning", f"torchrunx: {said}") == (said,)
    # The host's own interpreter (python=, a container's python3) is the one named.
    problems = judge(
        1, "node2", "ssh", LOCAL, start_failure=None, status=127,
        lines=[(True, "bash: /opt/py/bin/python: No such file or directory")],
        seconds=1.0, timeout=60, python="/opt/py/bin/python",
    ).problems  # fmt: skip
    assert problems[0].startswith("the interpreter /opt/py/bin/python is missing on this host")
    assert no_report(1, "boom") == ("the probe exited with status 1: boom",)
    with_env = Local(**{**LOCAL.__dict__, "env_file": "/etc/env.sh"})
    assert no_report(1, "boom", local=with_env) == (
        (
            "the probe exited with status 1: boom; it sourced env_file '/etc/env.sh' first: "
            "check that file"
        ),
    )
    start = judge(
        1,
        "node2",
        "ssh",
        LOCAL,
        start_failure="SSH authentication failed",
        status=None,
        lines=[],
        seconds=0.1,
        timeout=60,
    )
    assert start.problems == ("SSH authentication failed",) and start.report is None


def test_the_lines_printed_with_no_trailing_spaces():
    ready, failed = judged(index=0), judged(torch=None)
    text = format_checks([ready, failed], 1.25)
    assert text.splitlines() == [
        (
            "node2  ok    ssh    python 3.11.9 (/venv/bin/python), torchrunx 0.5.0, torch 2.13.0, "
            "4 GPUs, 32 CPUs"
        ),
        "node2  FAIL  ssh",  # no trailing spaces: the docs' samples are this text
        (
            "    - torch is not installed here, 2.13.0 in the launcher: install the same torch on "
            "every host"
        ),
        "2 hosts checked in 1.2 s: 1 not ready",
    ]


def test_rule_a_report_and_a_request_travel_as_one_line_each():
    answer = report(torch=None, master=None, pidfds="no pidfd")
    line = answer.to_line()
    assert "\n" not in line and line.startswith("torchrunx-probe {")
    assert ProbeReport.from_line(line) == answer
    assert ProbeReport.from_line("torchrunx-probe {not json") is None
    assert ProbeReport.from_line('torchrunx-probe {"hostname": "x"}') is None  # fields missing
    assert ProbeReport.from_line(line[1:]) is None  # not the report's line
    request = ProbeRequest(
        sys_path=("/a", "/b"),
        host_index=1,
        address="10.0.0.1",
        port=29400,
        token="t" * 32,
        timeout=5.5,
        master=("10.0.0.2", 41000),
        peers=0,
        local_only=True,
    )
    raw = request.to_json_line()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert ProbeRequest.from_json(raw) == request
    first = ProbeRequest(**{**request.__dict__, "host_index": 0, "master": None, "peers": 3})
    assert ProbeRequest.from_json(first.to_json_line()) == first
    # A host with its own interpreter or shipped code keeps its sys.path (read by the boot
    # code from the same line); a line without the field (an older launcher's) keeps none.
    own = ProbeRequest(**{**request.__dict__, "keep_path": True})
    assert ProbeRequest.from_json(own.to_json_line()).keep_path is True
    # Where the launcher's torchrunx is (the probe keeps that entry of sys.path) travels too.
    rooted = ProbeRequest(**{**request.__dict__, "package_root": "/opt/site"})
    assert ProbeRequest.from_json(rooted.to_json_line()).package_root == "/opt/site"
    assert json.loads(own.to_json_line())["keep_path"] is True
    older = {k: v for k, v in json.loads(raw).items() if k != "keep_path"}
    assert ProbeRequest.from_json(json.dumps(older).encode()).keep_path is False


def test_rule_only_a_stdout_line_is_a_report():
    line = report().to_line()
    stderr = judge(
        1,
        "node2",
        "ssh",
        LOCAL,
        start_failure=None,
        status=0,
        lines=[(True, line)],
        seconds=0.1,
        timeout=60,
    )
    assert stderr.report is None and stderr.problems == ("the probe exited with status 0: " + line,)


def test_rule_a_host_check_keeps_where_and_when_whatever_happened():
    failed = judge(
        2,
        "node3",
        "srun",
        LOCAL,
        start_failure="srun: error",
        status=None,
        lines=[],
        seconds=1.5,
        timeout=60,
    )
    silent = judge(
        2,
        "node3",
        "srun",
        LOCAL,
        start_failure=None,
        status=1,
        lines=[],
        seconds=2.5,
        timeout=60,
    )
    answered = judged(index=2, gpus=1)
    for check, seconds in ((failed, 1.5), (silent, 2.5)):
        assert (check.index, check.hostname, check.method, check.facts, check.seconds) == (
            2,
            "node3",
            "srun",
            (),
            seconds,
        )
        assert check.report is None
    assert (answered.index, answered.hostname, answered.method, answered.seconds) == (
        2,
        "node2",
        "ssh",
        0.5,
    )
    assert answered.report == report(gpus=1)
    assert answered.facts[3] == "1 GPU"
    assert judged(gpus=2).facts[3] == "2 GPUs"


def test_rule_without_torch_on_either_side_there_is_nothing_to_compare():
    no_torch = Local(**{**LOCAL.__dict__, "torch": None})
    host = judged(local=no_torch, torch=None)
    assert host.ok and host.facts[2] == "no torch"
    assert judged(local=no_torch, torch="2.1.0").problems == (
        "torch 2.1.0 here: install the same torch on every host",
    )


def test_rule_only_the_last_five_stderr_lines_of_a_silent_probe_are_quoted():
    lines = [(False, "stdout noise"), *((True, f"line {n}") for n in range(7)), (True, "  ")]
    problem = judge(
        1,
        "node2",
        "ssh",
        LOCAL,
        start_failure=None,
        status=4,
        lines=lines,
        seconds=1.0,
        timeout=60,
    ).problems
    assert problem == ("the probe exited with status 4: line 2; line 3; line 4; line 5; line 6",)
    assert no_report(3) == ("the probe exited with status 3",)
    assert no_report(None, "still importing") == (
        "no answer within start_timeout=60 s (still importing)",
    )


def test_rule_what_bash_and_python_said_tells_which_part_is_missing():
    missing = f"bash: line 1: exec: {sys.executable}: No such file or directory"
    (problem,) = no_report(1, missing)
    assert problem.startswith(f"the interpreter {sys.executable} is missing on this host")
    (problem,) = no_report(1, "bash: line 1: exec: foo: not found")  # no file missing
    assert problem.startswith("the probe exited with status 1")
    (problem,) = no_report(1, "ImportError: cannot import name 'x' from 'torchrunx'")
    assert "cannot import torchrunx" in problem
    (problem,) = no_report(1, "bash: line 1: cd: /gone: No such file or directory")
    assert problem.startswith("the working directory ")


def test_rule_the_summary_counts_the_hosts_not_ready():
    ok, bad = judged(), judged(torch=None)
    assert format_checks([ok, bad, bad], 2.0).splitlines()[-1] == (
        "3 hosts checked in 2.0 s: 2 not ready"
    )
    assert format_checks([ok], 0.25).splitlines() == [
        (
            "node2  ok    ssh    python 3.11.9 (/venv/bin/python), torchrunx 0.5.0, torch 2.13.0, "
            "4 GPUs, 32 CPUs"
        ),
        "1 host checked in 0.2 s: all ready",
    ]


def test_rule_a_host_whose_check_of_host_0_was_not_tried_is_not_blamed_for_it():
    # master None: host 0 did not answer (its own line says why), so nothing was tried here.
    assert judged(index=1, master=None).ok
    assert judged(index=2, master=None).problems == ()


def test_rule_the_last_line_the_agents_script_wrote_itself_is_the_problem():
    said = no_report(1, "torchrunx: first", "bash: noise", "torchrunx: the last word")
    assert said == ("the last word",)


def test_rule_the_report_is_found_among_other_stdout_lines_before_or_after_it():
    lines = [(False, "before"), (False, report().to_line()), (False, "after"), (True, "warn")]
    host = judge(
        1,
        "node2",
        "ssh",
        LOCAL,
        start_failure=None,
        status=0,
        lines=lines,
        seconds=0.1,
        timeout=60,
    )
    assert host.ok and host.report == report()


def test_rule_the_host_names_column_is_as_wide_as_the_longest_name():
    short = judged()
    long = judge(
        1,
        "a-much-longer-name",
        "srun",
        LOCAL,
        start_failure="srun: error",
        status=None,
        lines=[],
        seconds=0.1,
        timeout=60,
    )
    assert format_checks([short, long], 1.0).splitlines()[:2] == [
        (
            "node2               ok    ssh    python 3.11.9 (/venv/bin/python), torchrunx 0.5.0, "
            "torch 2.13.0, 4 GPUs, 32 CPUs"
        ),
        "a-much-longer-name  FAIL  srun",
    ]


def test_rule_one_cpu_or_gpu_is_said_in_the_singular():
    assert judged(gpus=1, cpus=1).facts[3:] == ("1 GPU", "1 CPU")
    assert judged(gpus=0, cpus=2).facts[3:] == ("no GPU", "2 CPUs")


@pytest.mark.parametrize("payload", ["[1, 2]", '"text"', "3", "null"])
def test_rule_a_report_line_whose_json_is_no_object_of_the_fields_is_no_report(payload: str):
    assert ProbeReport.from_line("torchrunx-probe " + payload) is None


def test_rule_a_failed_connection_says_where_and_why_even_without_a_message():
    from torchrunx.agent.probe import _why

    assert (
        _why(("10.0.0.1", 29400), TimeoutError()) == "cannot connect to 10.0.0.1:29400: timed out"
    )
    assert _why(("h", 1), ConnectionRefusedError(111, "Connection refused")) == (
        "cannot connect to h:1: [Errno 111] Connection refused"
    )
    assert _why(("h", 1), ConnectionResetError()) == "cannot connect to h:1: ConnectionResetError"


def test_rule_a_request_line_of_an_older_launcher_without_package_root_is_read():
    request = ProbeRequest(
        sys_path=("/a",),
        host_index=0,
        address="10.0.0.1",
        port=29400,
        token="t" * 32,
        timeout=5.0,
        master=None,
        peers=1,
        local_only=False,
    )
    older = {k: v for k, v in json.loads(request.to_json_line()).items() if k != "package_root"}
    assert ProbeRequest.from_json(json.dumps(older).encode()) == request


# -- the two ports a check listens on: a connection dropped for a new one in the same turn ---


class _ListenerFirst(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """A real selector whose turns hand out the listening socket's event first (an order epoll
    may give), and that runs ``before_second`` as its second turn begins."""

    listener: socket.socket | None = None
    before_second: Callable[[], None] = staticmethod(lambda: None)
    turns = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        type(self).turns += 1
        if type(self).turns == 2:
            type(self).before_second()
        events = super().select(timeout)
        return sorted(events, key=lambda event: event[0].fileobj is not type(self).listener)


def _connect(port: int, data: bytes = b"") -> socket.socket:
    """A loopback connection, in the listener's queue when this returns; ``data`` sent on it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(data)
    return sock


def _flood_in_the_second_turn(
    monkeypatch: pytest.MonkeyPatch, listener: socket.socket, first: socket.socket, line: bytes
) -> list[socket.socket]:
    """As the second turn begins: ``first`` says half a line, then a stranger and a prober
    (who says ``line``) connect; the connections made, to be closed by the caller."""
    made: list[socket.socket] = []
    port = listener.getsockname()[1]

    def flood() -> None:
        first.sendall(b"ha")
        made.extend([_connect(port), _connect(port, line)])

    monkeypatch.setattr(_ListenerFirst, "listener", listener)
    monkeypatch.setattr(_ListenerFirst, "turns", 0)
    monkeypatch.setattr(_ListenerFirst, "before_second", staticmethod(flood))
    return made


def test_rule_host_0_skips_a_peer_dropped_for_a_new_one_earlier_in_the_same_turn(monkeypatch):
    """Host 0's port at its cap of unread connections: in the turn where the oldest has bytes,
    the listener's event comes first and a new connection drops the oldest; the oldest's own
    event in that turn is then skipped, and the prober's line is heard."""
    listener = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(probe, "_PEERS_AT_ONCE", 2)
    monkeypatch.setattr(probe.selectors, "DefaultSelector", _ListenerFirst)
    port = listener.getsockname()[1]
    first = [_connect(port), _connect(port)]  # accepted in the first turn: the cap
    made = _flood_in_the_second_turn(monkeypatch, listener, first[0], b"t\n")
    try:
        said = probe._await_peers(listener, "t", 1, time.monotonic() + 10, None)
    finally:
        for sock in [*first, *made, listener]:
            sock.close()
    assert said == "ok"
    assert _ListenerFirst.turns >= 3  # the flood came between turns, as meant


def test_rule_the_launchers_port_skips_a_probe_dropped_for_a_new_one_in_the_same_turn(
    monkeypatch,
):
    """The launcher's port (``torchrunx check``) at its cap, as on host 0's: the dropped
    connection's event is skipped and the probe's line after it is heard."""
    listener = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setattr(preflight, "_PENDING", 2)
    monkeypatch.setattr(preflight.selectors, "DefaultSelector", _ListenerFirst)
    check = object.__new__(preflight._Check)
    check.sock, check.token, check.agents = listener, "t", [None]
    check.deadline, check.stopping = time.monotonic() + 10, threading.Event()
    check.lock, check.heard, check.master_known = threading.Lock(), {}, threading.Event()
    check.others_done, check.host0_conn = True, None
    port = listener.getsockname()[1]
    first = [_connect(port), _connect(port)]
    made = _flood_in_the_second_turn(monkeypatch, listener, first[0], b"t 0 29500\n")
    acceptor = threading.Thread(target=check._accept, daemon=True)
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    acceptor.start()
    try:
        assert check.master_known.wait(10), f"the probe's line was not heard: {errors}"
    finally:
        check.stopping.set()
        acceptor.join(10)
        for sock in [*first, *made, listener]:
            sock.close()
    assert check.master_port == 29500
    assert errors == []
