"""Rules of the stacks note and of a look at every rank (pure): ranks with the same stack share
a section."""

from __future__ import annotations

import signal

import pytest

from torchrunx import serialization
from torchrunx.errors import RemoteTraceback, WorkerRaisedError, WorkerTimeoutError
from torchrunx.hosts.hostlists import HostSlots
from torchrunx.launcher.state.records import AgentRecord, RankRecord
from torchrunx.launcher.state.reports import (
    MAX_STACKS_SHOWN,
    count_repeats,
    finish_report,
    innermost_frame,
    launch_timeout_error,
    output_tail_note,
    rank_ranges,
    rebuild_exception,
    stacks_note,
    start_timeout_error,
    summary,
    watchdog_error,
    without_probe,
    world_changes_note,
)
from torchrunx.launcher.view.where import ANSWER_WAIT as WHERE_WAIT
from torchrunx.launcher.view.where import StacksLook, sigquit_shows_stacks
from torchrunx.wire.messages import WorkerException, WorkerSpec, WorkerTimedOut


def dump(thread: str, *frames: str) -> str:
    """A stack as ``faulthandler`` writes it (most recent call first)."""
    lines = [f"Current thread {thread} (most recent call first):"]
    lines += [
        f'  File "{frame.split(":")[0]}", line {frame.split(":")[1]} in {frame.split(":")[2]}'
        for frame in frames
    ]
    return "\n".join(lines) + "\n"


STEP = ("/work/train.py:41:step", "/work/train.py:90:<module>")
DATA = ("/work/data.py:12:__next__", "/work/train.py:88:<module>")
WHERE = {rank: (rank % 4, f"node{rank // 4 + 1}") for rank in range(40)}


def test_rule_ranks_with_the_same_stack_share_a_section_whatever_their_thread_ids():
    stacks = {r: dump(f"0x00007f{r:06x}", *STEP) for r in (0, 1, 2, 3, 4, 5, 6, 8)}
    stacks[7] = dump("0x00007fffffff", *DATA)
    note = stacks_note(stacks, WHERE).splitlines()
    assert (
        note[0] == "Python stacks of the workers that were still running when the launch stopped:"
    )
    assert note[1] == (
        "--- ranks 0-6,8 on hosts 'node1', 'node2', 'node3' "
        "(the same stack; innermost: train.py:41 in step) ---"
    )
    assert note[2:5] == stacks[0].splitlines()  # the first rank's own text
    assert note[5] == "--- rank 7 (local rank 3 on host 'node2') ---"
    assert note[6:] == stacks[7].splitlines()


def test_rule_one_host_is_named_once():
    stacks = {0: dump("0x1", *STEP), 1: dump("0x2", *STEP)}
    assert stacks_note(stacks, WHERE).splitlines()[1] == (
        "--- ranks 0-1 on host 'node1' (the same stack; innermost: train.py:41 in step) ---"
    )


def test_rule_at_most_sixteen_sections_then_the_ranks_left_out():
    stacks = {r: dump("0x1", f"/w/f.py:{r + 1}:f{r}") for r in range(MAX_STACKS_SHOWN + 3)}
    stacks[30] = stacks[0]  # the same stack as rank 0: in its section, not left out
    note = stacks_note(stacks, WHERE)
    assert note.count("\n--- ") == MAX_STACKS_SHOWN
    assert note.splitlines()[-1] == "... and 3 more stacks, of ranks 16-18"
    assert (
        "--- ranks 0,30 on hosts 'node1', 'node8' (the same stack; innermost: f.py:1 in f0) ---"
        in note
    )


def test_rule_the_innermost_frame_is_the_current_threads_first():
    other_first = (
        "Thread 0x0002 (most recent call first):\n"
        '  File "/usr/lib/threading.py", line 320 in wait\n'
        "\n" + dump("0x0001", *DATA)
    )
    assert innermost_frame(other_first) == "data.py:12 in __next__"
    assert innermost_frame('Thread 0x1:\n  File "/a/b.py", line 7 in run\n') == "b.py:7 in run"
    assert innermost_frame('  File "<string>", line 3 in <module>') == "<string>:3 in <module>"
    assert innermost_frame("Stack (most recent call first):\n  <no Python frame>\n") is None
    same = {0: "no frame at all", 1: "no frame at all"}
    assert (
        stacks_note(same, WHERE).splitlines()[1]
        == "--- ranks 0-1 on host 'node1' (the same stack) ---"
    )


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([0], "0"),
        ([0, 1], "0-1"),
        ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"),
        ([3, 5, 7], "3,5,7"),
        ([9, 10, 11, 12], "9-12"),
    ],
)
def test_rule_ranks_are_written_as_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_rule_a_look_waits_for_every_asked_agent_or_its_deadline_and_says_who_did_not_answer():
    from torchrunx.hosts.hostlists import HostSlots
    from torchrunx.launcher.state.records import AgentRecord, RankRecord
    from torchrunx.launcher.view.where import ANSWER_WAIT, StacksLook
    from torchrunx.wire.messages import WorkerSpec

    agents = [AgentRecord(i, HostSlots(f"node{i + 1}", 2), "ssh") for i in range(3)]
    for agent in agents[:2]:
        agent.spec = WorkerSpec(
            host_index=agent.index,
            hostname=agent.slots.hostname,
            num_workers=2,
            rank_offset=2 * agent.index,
            world_size=4,
            master_addr="a",
            master_port=1,
            backend=None,
            timeout=1.0,
        )
    look = StacksLook(agents, now=100.0)
    assert not look.due(100.0)
    look.answer(agents[0], {0: "stack A\n", 1: "stack A\n"})
    look.answer(agents[1], {1: "stack B\n"})  # its local rank 0 had ended
    assert not look.due(101.0) and look.due(100.0 + ANSWER_WAIT)
    ranks = [RankRecord(r, r // 2, r % 2) for r in range(4)]
    text = look.text(ranks, lambda r: agents[r.host_index].slots.hostname)
    assert text.splitlines() == [
        "torchrunx: where every rank is (the launch goes on; Ctrl-\\ to look again):",
        "--- ranks 0-1 on host 'node1' (the same stack) ---",
        "stack A",
        "--- rank 3 (local rank 1 on host 'node2') ---",
        "stack B",
        f"no answer in {ANSWER_WAIT:g} s from host index [2]",
    ]
    look.answer(agents[2], {})
    assert look.due(101.0)  # every agent answered
    empty = StacksLook([], now=0.0)
    assert empty.due(0.0)
    assert empty.text([], str).splitlines()[1] == "no worker is running"


def test_rule_exactly_sixteen_sections_leave_nothing_out():
    stacks = {r: dump("0x1", f"/w/f.py:{r + 1}:f{r}") for r in range(MAX_STACKS_SHOWN)}
    note = stacks_note(stacks, WHERE)
    assert note.count("\n--- ") == MAX_STACKS_SHOWN
    assert "more stacks" not in note


def test_rule_stacks_are_the_same_by_their_frames_only():
    a = dump("0x00007FAB12", *STEP)  # ids in any case, any length
    b = dump("0x0000000001", *STEP)
    c = dump("0x00007FAB12", *DATA)
    note = stacks_note({0: a, 1: b, 2: c}, WHERE)
    assert (
        "--- ranks 0-1 on host 'node1' (the same stack; innermost: train.py:41 in step) ---" in note
    )
    assert "--- rank 2 (local rank 2 on host 'node1') ---" in note
    frameless = stacks_note({0: "odd text", 1: "other text"}, WHERE)
    assert frameless.count("\n--- rank ") == 2  # different texts without frames: apart


def test_rule_an_agent_without_workers_places_no_stack():
    from torchrunx.hosts.hostlists import HostSlots
    from torchrunx.launcher.state.records import AgentRecord
    from torchrunx.launcher.view.where import StacksLook

    agent = AgentRecord(0, HostSlots("node1", None), "ssh")  # no spec: no workers given yet
    look = StacksLook([agent], now=0.0)
    look.answer(agent, {0: "stack"})
    assert look.stacks == {} and look.due(0.0)


def test_rule_the_heading_names_the_dumping_threads_frame_even_after_another_thread():
    def two_threads(thread_id: str) -> str:
        return (
            f"Thread 0x{thread_id}1 (most recent call first):\n"
            '  File "/usr/lib/threading.py", line 320 in wait\n'
            "\n" + dump(f"0x{thread_id}2", *DATA)
        )

    note = stacks_note({0: two_threads("aa"), 1: two_threads("bb")}, WHERE)
    assert note.splitlines()[1] == (
        "--- ranks 0-1 on host 'node1' (the same stack; innermost: data.py:12 in __next__) ---"
    )
    one_thread = stacks_note({0: two_threads("aa"), 1: dump("0x1", *DATA)}, WHERE)
    assert one_thread.count("\n--- rank ") == 2  # one more thread: not the same stack


def test_rule_where_a_thread_begins_is_part_of_the_stack():
    two = 'Current thread 0x1 (most recent call first):\n  File "/a.py", line 1 in f\n\nThread 0x2 (most recent call first):\n  File "/b.py", line 2 in g\n'
    one = 'Current thread 0x3 (most recent call first):\n  File "/a.py", line 1 in f\n  File "/b.py", line 2 in g\n'
    assert stacks_note({0: two, 1: one}, WHERE).count("\n--- rank ") == 2


def test_rule_a_look_at_the_stacks_is_for_the_terminal_unless_told_otherwise():
    from torchrunx.launcher.view.where import StacksLook

    plain = StacksLook([], 0.0)
    assert plain.to_terminal is True and plain.to_view is False
    for_view = StacksLook([], 0.0, to_terminal=False, to_view=True)
    assert for_view.to_terminal is False and for_view.to_view is True


def test_rule_the_probes_own_thread_is_left_out_of_the_stacks():
    stacks = (
        'Thread 0x1 (most recent call first):\n  File "/x/torchrunx/worker/stallprobe.py", line 3'
        '\n\nCurrent thread 0x2 (most recent call first):\n  File "t.py", line 1 in f\n'
    )
    assert without_probe(stacks) == (
        'Current thread 0x2 (most recent call first):\n  File "t.py", line 1 in f\n'
    )


def test_rule_ranks_caught_with_their_probe_in_different_places_share_a_section():
    """The probe thread asleep in one rank and sampling in another: the user's threads are in
    the same place, so the ranks share one section, and the probe is not shown."""
    user = (
        'Current thread 0x2 (most recent call first):\n  File "/w/waits.py", line 2 in <module>\n'
    )
    asleep = 'Thread 0x1 (most recent call first):\n  File "/t/torchrunx/worker/stallprobe.py", line 230 in run\n'
    sampling = (
        'Thread 0x7 (most recent call first):\n  File "/t/torchrunx/stall.py", line 141 in calls\n'
        '  File "/t/torchrunx/worker/stallprobe.py", line 240 in run\n'
    )
    note = stacks_note({0: asleep + "\n" + user, 1: sampling + "\n" + user}, WHERE)
    assert note.splitlines()[1] == (
        "--- ranks 0-1 on host 'node1' (the same stack; innermost: waits.py:2 in <module>) ---"
    ), note
    assert "stallprobe" not in note and "stall.py" not in note, note


# -- held-out mutants (round 55b): the other notes and errors of a report -----------------------


def test_rule_a_summary_is_the_type_and_the_first_line_of_the_message():
    assert summary(ValueError("bad batch\nin step 3")) == "ValueError: bad batch"
    assert summary(ValueError()) == "ValueError"


def test_rule_repeated_lines_are_counted_in_first_seen_order():
    assert count_repeats(["b", "a", "b", "c", "b"]) == ["b (x3)", "a", "c"]


def test_rule_a_worker_exception_comes_back_with_its_type_its_traceback_and_where():
    message = WorkerException(3, "ValueError", "bad batch", "Traceback (most recent call last):")
    payload = [bytearray(part) for part in serialization.dumps(ValueError("bad batch"))]
    error = rebuild_exception(message, payload, "worker rank 3")
    assert type(error) is ValueError
    assert isinstance(error.__cause__, RemoteTraceback)
    assert error.__suppress_context__ is True  # the launcher's own context is not the story
    assert error.__notes__ == ["raised in worker rank 3"]


def test_rule_a_payload_that_is_no_exception_comes_back_as_worker_raised_error():
    message = WorkerException(0, "mypkg.Odd", "odd", "tb")
    payload = [bytearray(part) for part in serialization.dumps(42)]
    error = rebuild_exception(message, payload, "worker rank 0")
    assert isinstance(error, WorkerRaisedError)
    assert error.type_name == "mypkg.Odd"
    assert str(error).startswith("mypkg.Odd: odd (raised in worker rank 0; ")


def test_rule_a_watchdog_report_without_a_stack_adds_no_note():
    blank = watchdog_error("node1", 2, WorkerTimedOut(0, "step", 1.0, "  \n"))
    assert isinstance(blank, WorkerTimeoutError)
    assert getattr(blank, "__notes__", []) == []
    shown = watchdog_error("node1", 2, WorkerTimedOut(0, "step", 1.0, "  File x\n"))
    assert shown.__notes__ == ["Python stack of rank 2 when its limit passed:\n  File x"]


def test_rule_a_silent_workers_note_says_so_and_where_its_log_is():
    assert output_tail_note((), "/logs/r0.log") == "it wrote no output (full log: /logs/r0.log)"
    assert output_tail_note((), None) is None
    assert (
        output_tail_note(["a", "b\nc"], None) == "last 2 lines of its output:\n    a\n    b\n    c"
    )


def test_rule_the_other_failures_leave_out_the_raised_one_and_the_history_counts_restarts():
    error = ValueError("bad batch")
    finish_report(
        error,
        others=["ValueError: bad batch", "OSError: gone", "OSError: gone"],
        history=["attempt 0: RuntimeError: x", "attempt 1: RuntimeError: y"],
        max_restarts=3,
    )
    assert error.__notes__ == [
        "other failures seen while stopping: OSError: gone (x2)",
        (
            "the workers were restarted 2 time(s) (max_restarts=3); earlier failures:\n"
            "  attempt 0: RuntimeError: x\n  attempt 1: RuntimeError: y"
        ),
    ]
    alone = finish_report(ValueError("x"), others=["ValueError: x"], history=[], max_restarts=0)
    assert getattr(alone, "__notes__", []) == []


def test_rule_no_change_of_hosts_makes_no_note():
    assert world_changes_note(()) is None
    assert world_changes_note(["a", "b"]) == "hosts changed during the launch:\n  a\n  b"


def test_rule_a_start_timeout_says_whether_the_agent_had_been_started():
    started = start_timeout_error("node1", 30.0, 29400, "10.0.0.1", "")
    assert "did not connect back within start_timeout=30 s" in started.reason
    assert "on port 29400 at 10.0.0.1?" in started.reason
    starting = start_timeout_error("node1", 30.0, 29400, None, "", started=False)
    assert starting.reason.startswith("the agent's start did not finish within start_timeout=30 s")


def test_rule_a_launch_timeout_before_any_rank_started_says_so():
    assert "with ranks not yet started still running" in str(launch_timeout_error(60, 61.2, []))
    assert "after 61.2 s with ranks [0, 2] still running" in str(
        launch_timeout_error(60, 61.2, [0, 2])
    )


def test_rule_only_torchrunxs_own_probe_is_left_out_not_a_users_file_of_that_name():
    stacks = (
        'Thread 0x1 (most recent call first):\n  File "/home/me/stallprobe.py", line 3 in f'
        '\n\nCurrent thread 0x2 (most recent call first):\n  File "t.py", line 1 in f\n'
    )
    assert without_probe(stacks) == stacks


def _look_of_two_agents() -> tuple[StacksLook, list[AgentRecord]]:
    agents = [AgentRecord(i, HostSlots(f"node{i + 1}", 1), "ssh") for i in range(2)]
    for agent in agents:
        agent.spec = WorkerSpec(
            agent.index, agent.slots.hostname, 1, agent.index, 2, "a", 1, None, 1.0
        )
    return StacksLook(agents, now=0.0), agents


def test_rule_a_look_shows_only_the_ranks_of_the_current_attempt():
    look, agents = _look_of_two_agents()
    look.answer(agents[0], {0: "stack A\n"})
    look.answer(agents[1], {0: "stack B\n"})
    ranks = [RankRecord(0, 0, 0)]  # the world shrank to host 0 since the look was asked
    assert look.text(ranks, lambda _: "node1").splitlines()[1:] == [
        "--- rank 0 (local rank 0 on host 'node1') ---",
        "stack A",
    ]


def test_rule_a_look_no_agent_answered_says_who_and_that_no_worker_shows():
    look, _ = _look_of_two_agents()
    assert look.text([], str).splitlines()[1:] == [
        "no worker is running",
        f"no answer in {WHERE_WAIT:g} s from host index [0, 1]",
    ]


def test_rule_sigquit_asks_for_a_look_during_the_launch_only():
    before = signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    try:
        asked: list[str] = []
        with sigquit_shows_stacks(lambda: asked.append("look")):
            handler = signal.getsignal(signal.SIGQUIT)
            assert callable(handler)
            handler(signal.SIGQUIT, None)
            assert asked == ["look"]
        assert signal.getsignal(signal.SIGQUIT) is signal.SIG_DFL  # afterwards: as it was
    finally:
        signal.signal(signal.SIGQUIT, before)
