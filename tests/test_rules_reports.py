"""Rules of the stacks note: ranks with the same stack share a section (pure)."""

from __future__ import annotations

import pytest

from torchrunx.launcher.reports import (
    MAX_STACKS_SHOWN,
    innermost_frame,
    rank_ranges,
    stacks_note,
)


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
