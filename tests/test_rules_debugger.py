"""The launcher's side of pdb in a rank, as rules: who has the terminal, what is printed, what
is sent, and how long the launch counts as paused. A pipe stands in for the terminal and a
dict for the I/O loop (the real thing is driven through a pseudo-terminal in test_debugger).
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING

import pytest

from torchrunx.launcher.settings import environ as environ_module
from torchrunx.launcher.view import debugger as debugger_module
from torchrunx.launcher.view.debugger import Debugger
from torchrunx.wire.messages import DebugInput, DebugOutput

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


class _Loop:
    def __init__(self) -> None:
        self.readers: dict[int, Callable[[], None]] = {}

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        self.readers[fd] = callback

    def remove_reader(self, fd: int) -> None:
        self.readers.pop(fd, None)


class _Terminal:
    """A debugger over a pipe (as its stdin), with what it printed and what it sent."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.loop = _Loop()
        self.out = io.StringIO()
        self.sent: list[tuple[int, DebugInput]] = []
        self.debugger = Debugger(
            self.loop,  # type: ignore[arg-type]
            lambda rank, message: self.sent.append((rank, message)),
            lambda rank: f"node{rank // 2 + 1}",
            stdin_fd=self.read_fd,
            out=self.out,
        )
        self.debugger.terminal = True  # a pipe is no TTY: as if it were one

    def type(self, text: str) -> None:
        os.write(self.write_fd, text.encode())
        self.loop.readers[self.read_fd]()

    def printed(self) -> str:
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        return text

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


@pytest.fixture
def term() -> Iterator[_Terminal]:
    terminal = _Terminal()
    yield terminal
    terminal.close()


def _prompt(rank: int, where: str = "train.py:9 in work") -> DebugOutput:
    return DebugOutput(rank, f"> frame\n(Pdb rank {rank}) ", waiting=True, where=where)


def test_rule_the_first_rank_gets_the_terminal_and_lines_go_to_it(term):
    term.debugger.on_output(1, _prompt(1))
    assert term.printed() == (
        "\n--- pdb: rank 1 on node1 at train.py:9 in work ---\n> frame\n(Pdb rank 1) "
    )
    assert term.debugger.current == 1
    assert term.read_fd in term.loop.readers  # the terminal is read only now
    term.type("p x\n")
    assert term.sent == [(1, DebugInput("p x"))]
    term.type("p y\n")  # it has not answered: no prompt, nothing is sent
    assert term.sent == [(1, DebugInput("p x"))]
    assert "no rank waits for a line now" in term.printed()
    term.debugger.on_output(1, DebugOutput(1, "5\n(Pdb rank 1) ", waiting=True))
    assert term.printed() == "5\n(Pdb rank 1) "  # no header again: the same rank
    term.type("c\n")
    term.debugger.on_output(1, DebugOutput(1, "", waiting=False, resumed=True))
    assert term.debugger.stops == {}
    assert term.debugger.current is None
    assert term.read_fd not in term.loop.readers  # nobody in the debugger: stdin left alone


def test_rule_a_second_rank_waits_is_announced_once_and_gets_the_terminal_after_c(term):
    term.debugger.on_output(0, _prompt(0))
    term.printed()
    term.debugger.on_output(3, _prompt(3, "eval.py:4 in step"))
    assert term.printed() == (
        "\ntorchrunx: rank 3 on node2 stopped in the debugger at eval.py:4 in step and waits; "
        "':rank 3' switches to it\n"
    )
    term.debugger.on_output(3, _prompt(3))  # asked again: not announced again
    assert term.printed() == ""
    term.type(":ranks\n")
    assert term.printed() == (
        "* rank 0 on node1: waits, train.py:9 in work\n"
        "  rank 3 on node2: waits, train.py:9 in work\n"
        "(Pdb rank 0) "
    )
    term.type("c\n")
    term.debugger.on_output(0, DebugOutput(0, "", waiting=False, resumed=True))
    shown = term.printed()
    assert shown.startswith("\n--- pdb: rank 3 on node2 at train.py:9 in work ---\n")
    assert "(Pdb rank 3) " in shown  # what it wrote while it waited, its prompt included
    term.type("n\n")
    assert term.sent == [(0, DebugInput("c")), (3, DebugInput("n"))]


def test_rule_rank_switches_and_unknown_ranks_are_refused(term):
    term.debugger.on_output(0, _prompt(0))
    term.debugger.on_output(1, _prompt(1))
    term.printed()
    term.type(":rank 1\n")
    assert term.debugger.current == 1
    shown = term.printed()
    assert "--- pdb: rank 1 on node1" in shown and shown.endswith("(Pdb rank 1) ")
    term.type(":rank 7\n")
    assert term.printed() == (
        "torchrunx: no rank 7 in the debugger; ':ranks' lists them\n(Pdb rank 1) "
    )
    term.type(":rank 0\n")
    assert term.printed().endswith("(Pdb rank 0) ")  # its prompt again, though shown before
    term.type("where\n")
    assert term.sent == [(0, DebugInput("where"))]


def test_rule_a_rank_that_needs_the_terminal_takes_it_from_one_that_runs(term):
    term.debugger.on_output(0, _prompt(0))
    term.type("n\n")  # rank 0 steps: it runs, no prompt
    term.printed()
    term.debugger.on_output(2, _prompt(2))
    assert term.debugger.current == 2
    assert "--- pdb: rank 2 on node2" in term.printed()


def test_rule_lines_split_across_reads_are_joined(term):
    term.debugger.on_output(1, _prompt(1))
    os.write(term.write_fd, b"p lo")
    term.loop.readers[term.read_fd]()
    assert term.sent == []
    term.type("ss\n")
    assert term.sent == [(1, DebugInput("p loss"))]


def test_rule_end_of_input_lets_every_waiting_rank_run_on(term):
    term.debugger.on_output(0, _prompt(0))
    term.debugger.on_output(1, _prompt(1))
    os.close(term.write_fd)
    term.write_fd = os.open(os.devnull, os.O_WRONLY)  # for close()
    term.loop.readers[term.read_fd]()
    assert sorted(term.sent, key=lambda s: s[0]) == [(0, DebugInput(None)), (1, DebugInput(None))]
    assert term.debugger.terminal is False
    assert term.debugger.stops == {}
    term.sent.clear()
    term.debugger.on_output(2, _prompt(2))  # a later breakpoint: answered at once
    assert term.sent == [(2, DebugInput(None))]


def test_rule_a_skipped_breakpoint_is_printed_on_stderr_and_opens_nothing(term, capsys):
    warning = "torchrunx: breakpoint() at t.py:3 in rank 1 skipped: ...\n"
    term.debugger.on_output(1, DebugOutput(1, warning, waiting=False, resumed=True))
    assert capsys.readouterr().err == warning
    assert term.debugger.stops == {}
    assert term.read_fd not in term.loop.readers


def test_rule_paused_counts_while_any_rank_is_in_the_debugger(term, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(debugger_module.time, "monotonic", lambda: now[0])
    assert term.debugger.paused(now[0]) == 0.0
    term.debugger.on_output(0, _prompt(0))
    now[0] = 103.0
    term.debugger.on_output(1, _prompt(1))  # overlapping stops count once
    now[0] = 110.0
    assert term.debugger.paused(now[0]) == 10.0
    term.debugger.on_output(0, DebugOutput(0, "", waiting=False, resumed=True))
    now[0] = 112.0
    term.debugger.forget(1)  # its worker ended
    now[0] = 150.0
    assert term.debugger.paused(now[0]) == 12.0  # from 100 to 112, not after


def test_rule_close_answers_the_waiting_ranks(term):
    term.debugger.on_output(0, _prompt(0))
    term.debugger.on_output(1, DebugOutput(1, "x\n", waiting=False))  # in, but running
    term.debugger.close()
    assert term.sent == [(0, DebugInput(None))]
    assert term.read_fd not in term.loop.readers


def _drop(rank: int, message: DebugInput) -> None:
    del rank, message


def _debugger(environ: dict[str, str], stdin_fd: int) -> Debugger:
    """A debugger with the plan's settings of ``environ`` (as a launch makes it)."""
    settings = environ_module.read_environ(environ)
    return Debugger(_Loop(), _drop, str, stdin_fd=stdin_fd, settings=settings)  # type: ignore[arg-type]


def test_rule_only_a_tty_is_a_terminal_and_post_mortem_needs_one():
    environ = {"TORCHRUNX_POST_MORTEM": "1", "TORCHRUNX_DEBUGPY": "2:6000"}
    main, other = os.openpty()
    read_fd, write_fd = os.pipe()
    try:
        with_tty = _debugger(environ, other)
        with_pipe = _debugger(environ, read_fd)
        assert (with_tty.terminal, with_tty.post_mortem) == (True, True)
        assert (with_pipe.terminal, with_pipe.post_mortem) == (False, False)
        assert with_tty.debugpy == with_pipe.debugpy == (2, 6000)  # with or without a terminal
        again = _debugger({**environ, "TORCHRUNX_POST_MORTEM": "0"}, other)
        assert (again.terminal, again.post_mortem) == (True, False)
        assert again.current is None
        assert again.stops == {}
    finally:
        for fd in (main, other, read_fd, write_fd):
            os.close(fd)


def test_rule_without_a_place_a_stop_is_announced_as_a_breakpoint_and_headed_plainly(term):
    term.debugger.on_output(0, DebugOutput(0, "(Pdb rank 0) ", waiting=True))  # no where
    assert term.printed() == "\n--- pdb: rank 0 on node1 ---\n(Pdb rank 0) "
    term.debugger.on_output(1, DebugOutput(1, "(Pdb rank 1) ", waiting=True))
    assert "rank 1 on node1 stopped in the debugger at a breakpoint and waits" in term.printed()
    term.type(":rank 1\n")
    shown = term.printed()
    assert shown.startswith("\n--- pdb: rank 1 on node1 ---\n")
    assert debugger_module.HELP in shown  # two ranks in the debugger: how to switch
    assert shown.endswith("(Pdb rank 1) ")
    term.type(":rank 0\n")
    assert term.printed().endswith("---\n" + debugger_module.HELP + "(Pdb rank 0) ")


def test_rule_output_of_a_rank_without_the_terminal_is_kept_in_order_until_it_gets_it(term):
    term.debugger.on_output(0, _prompt(0))
    term.debugger.on_output(1, DebugOutput(1, "one\n", waiting=False, where="a.py:1 in f"))
    term.debugger.on_output(1, DebugOutput(1, "two\n(Pdb rank 1) ", waiting=True))
    term.printed()
    term.type(":rank 1\n")
    assert term.printed().endswith("one\ntwo\n(Pdb rank 1) ")
    term.type("value = 3\n")  # pdb answers an assignment with its prompt alone
    term.debugger.on_output(1, DebugOutput(1, "(Pdb rank 1) ", waiting=True))
    assert term.printed() == "(Pdb rank 1) "
    term.type(":rank 0\n")
    term.type(":rank 1\n")
    assert term.printed().endswith("---\n" + debugger_module.HELP + "(Pdb rank 1) ")


def test_rule_when_the_terminals_rank_runs_on_a_running_rank_in_the_debugger_keeps_it(term):
    term.debugger.on_output(0, _prompt(0))
    term.debugger.on_output(1, DebugOutput(1, "stepping\n", waiting=False))  # in, running
    term.type(":ranks\n")
    assert "  rank 1 on node1: runs, \n" in term.printed()
    term.type("c\n")
    term.debugger.on_output(0, DebugOutput(0, "", waiting=False, resumed=True))
    assert term.debugger.current == 1
    assert term.printed() == "\n--- pdb: rank 1 on node1 ---\nstepping\n"
    term.debugger.on_output(1, DebugOutput(1, "more\n", waiting=False))
    assert term.printed() == "more\n"  # printed at once: it has the terminal


def test_rule_invalid_bytes_are_replaced_and_a_broken_terminal_is_an_end(term):
    term.debugger.on_output(0, _prompt(0))
    term.type("p '\xff'\n".encode("latin-1").decode("latin-1"))  # a valid line first
    term.sent.clear()
    term.debugger.on_output(0, _prompt(0))
    os.write(term.write_fd, b"p \xff\n")
    term.loop.readers[term.read_fd]()
    assert term.sent == [(0, DebugInput("p \ufffd"))]
    term.debugger.on_output(0, _prompt(0))
    term.printed()
    folder = os.open(os.path.dirname(__file__), os.O_RDONLY)
    os.dup2(folder, term.read_fd)  # reading it fails now (a folder): as the end of input
    os.close(folder)
    term.loop.readers[term.read_fd]()
    assert term.debugger.terminal is False
    assert term.sent[-1] == (0, DebugInput(None))
    assert term.printed() == "\ntorchrunx: end of input: every rank in the debugger runs on\n"


def test_rule_close_with_no_rank_in_the_debugger_reads_nothing(term):
    term.debugger.close()
    assert term.loop.readers == {}
    assert term.debugger.current is None
    term.debugger.on_output(0, _prompt(0))
    term.debugger.close()
    assert term.debugger.current is None
    assert term.loop.readers == {}


def test_rule_separate_pauses_add_up(term, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(debugger_module.time, "monotonic", lambda: now[0])
    term.debugger.on_output(0, _prompt(0))
    now[0] = 4.0
    term.debugger.on_output(0, DebugOutput(0, "", waiting=False, resumed=True))
    now[0] = 10.0
    term.debugger.on_output(0, _prompt(0))
    now[0] = 13.0
    term.debugger.forget(0)
    assert term.debugger.paused(100.0) == 7.0


def test_rule_the_next_rank_to_get_the_terminal_is_one_that_waits(term):
    term.debugger.on_output(0, _prompt(0))
    term.debugger.on_output(1, DebugOutput(1, "running\n", waiting=False))
    term.debugger.on_output(2, _prompt(2))
    term.printed()
    term.debugger.on_output(0, DebugOutput(0, "", waiting=False, resumed=True))
    assert term.debugger.current == 2  # not rank 1, the first left, which runs
    assert term.printed().endswith("(Pdb rank 2) ")


def test_rule_the_launchers_own_lines_say_what_is_wrong(term):
    term.debugger.on_output(0, _prompt(0))
    term.printed()
    term.type(":rank\n")
    assert term.printed() == (
        "torchrunx: no rank ? in the debugger; ':ranks' lists them\n(Pdb rank 0) "
    )
    term.type("n\n")
    term.printed()
    term.type(":ranks\n")  # the rank runs: the list, and no prompt after it
    assert term.printed() == "* rank 0 on node1: runs, train.py:9 in work\n"
    term.type("p 1\n")
    assert term.printed() == (
        "torchrunx: no rank waits for a line now (the rank in the debugger runs); "
        "':ranks' lists them\n"
    )


def test_rule_a_rank_whose_connection_broke_is_not_an_error(term):
    def broken(rank: int, message: DebugInput) -> None:
        raise ConnectionResetError

    term.debugger._send = broken
    term.debugger.on_output(0, _prompt(0))
    term.type("c\n")  # no exception
    assert term.debugger.stops[0].waiting is False


def test_rule_without_an_output_stream_it_prints_on_stdout(capsys):
    read_fd, write_fd = os.pipe()
    try:
        debugger = Debugger(_Loop(), _drop, str, stdin_fd=read_fd)  # type: ignore[arg-type]
        debugger.terminal = True
        debugger.on_output(0, _prompt(0))
        assert (
            capsys.readouterr().out
            == "\n--- pdb: rank 0 on 0 at train.py:9 in work ---\n> frame\n(Pdb rank 0) "
        )
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_rule_the_prompt_shown_again_is_the_last_line_alone(term):
    text = "> /w/train.py(9)work()\n-> return value + 1\n(Pdb rank 0) "
    term.debugger.on_output(0, DebugOutput(0, text, waiting=True))
    term.printed()
    term.type(":ranks\n")
    assert term.printed() == "* rank 0 on node1: waits, \n(Pdb rank 0) "


@pytest.mark.parametrize(
    ("value", "chosen"),
    [
        ("", None),
        ("0", (0, 5678)),
        (" 2 ", (2, 5678)),
        ("3:5690", (3, 5690)),
        ("1:1", (1, 1)),
        ("7:65535", (7, 65535)),
        ("4:", (4, 5678)),
    ],
)
def test_rule_debugpy_names_a_rank_and_maybe_a_port(value, chosen, monkeypatch):
    assert environ_module.debugpy_from_env({"TORCHRUNX_DEBUGPY": value}) == chosen
    assert environ_module.debugpy_from_env({}) is None
    monkeypatch.setenv("TORCHRUNX_DEBUGPY", value)
    assert environ_module.read_environ().debugpy == chosen  # the plan reads os.environ


@pytest.mark.parametrize("value", ["one", "-1", "1:0", "1:65536", "1:x", ":5678", "1.5", "1:2:3"])
def test_rule_any_other_debugpy_value_is_an_error(value):
    with pytest.raises(ValueError, match=r"^TORCHRUNX_DEBUGPY=") as raised:
        environ_module.debugpy_from_env({"TORCHRUNX_DEBUGPY": value})
    assert str(raised.value) == (
        f"TORCHRUNX_DEBUGPY={value.strip()!r} is not RANK or RANK:PORT (a rank from 0, a port "
        "from 1 to 65535), for example 0 or 1:5678"
    )


def test_rule_a_debugpy_rank_outside_the_launch_is_a_warning(term, caplog):
    term.debugger.debugpy = (4, 5678)
    with caplog.at_level("WARNING", logger="torchrunx.launcher"):
        term.debugger.warn_missing_rank(5)  # ranks 0 to 4: there
        assert caplog.messages == []
        term.debugger.warn_missing_rank(4)
    assert caplog.messages == [
        "TORCHRUNX_DEBUGPY chose rank 4, but the launch has ranks 0 to 3: no rank waits for an IDE"
    ]
    term.debugger.debugpy = None
    term.debugger.warn_missing_rank(1)
    assert len(caplog.messages) == 1


def test_rule_only_a_function_of_the_launching_script_carries_its_text(monkeypatch, tmp_path):
    import linecache
    import pickle
    import types

    from torchrunx import serialization

    script = tmp_path / "train.py"
    script.write_text("def work():\n    return 1\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    exec(compile(script.read_text(), str(script), "exec"), main.__dict__)  # noqa: S102
    monkeypatch.setitem(__import__("sys").modules, "__main__", main)
    work = main.__dict__["work"]

    parts = [bytearray(p) for p in serialization.dumps_call(work, (), {})]
    assert pickle.loads(parts[0])[3] == (str(script), script.read_text())  # noqa: S301
    linecache.cache.pop(str(script), None)
    script.unlink()  # as on a host without the file
    func, _, _ = serialization.load_call(parts)
    assert func.__code__.co_filename == str(script)  # not cloudpickle's <dynamic-code>
    assert linecache.getline(str(script), 2) == "    return 1\n"

    parts = [bytearray(p) for p in serialization.dumps_call(os.getpid, (), {})]
    assert pickle.loads(parts[0])[3] is None  # importable: nothing more travels  # noqa: S301


def test_rule_the_debugger_announces_only_ranks_that_wait(term):
    term.debugger.on_output(0, _prompt(0))
    term.printed()
    term.debugger.on_output(3, DebugOutput(3, "rank 3 prints\n", waiting=False, where="a.py:1"))
    assert term.printed() == ""  # in the debugger, but running: nothing to switch to
    term.debugger.on_output(3, _prompt(3, "eval.py:4 in step"))  # now it waits: announced
    assert term.printed() == (
        "\ntorchrunx: rank 3 on node2 stopped in the debugger at eval.py:4 in step and waits; "
        "':rank 3' switches to it\n"
    )


# -- held-out mutants (round 55b): the rules they broke ------------------------------------------


def test_rule_a_ranks_place_stays_until_it_says_another(term):
    term.debugger.on_output(0, _prompt(0))
    term.debugger.on_output(3, DebugOutput(3, "one\n", waiting=False, where="eval.py:4 in step"))
    term.printed()
    term.debugger.on_output(3, DebugOutput(3, "(Pdb rank 3) ", waiting=True))  # no place given
    assert "rank 3 on node2 stopped in the debugger at eval.py:4 in step" in term.printed()
    term.type(":ranks\n")
    assert "  rank 3 on node2: waits, eval.py:4 in step\n" in term.printed()


def test_rule_switching_to_a_rank_that_runs_shows_no_old_prompt(term):
    term.debugger.on_output(0, _prompt(0))
    term.type("n\n")  # rank 0 steps: it runs, its prompt is gone
    term.debugger.on_output(1, _prompt(1))  # rank 1 takes the terminal
    term.printed()
    term.type(":rank 0\n")
    assert term.printed() == (
        "\n--- pdb: rank 0 on node1 at train.py:9 in work ---\n" + debugger_module.HELP
    )
    term.type("p x\n")  # still running: nothing goes to it
    assert term.sent == [(0, DebugInput("n"))]


def test_rule_the_first_of_the_waiting_ranks_gets_the_terminal_next(term):
    term.debugger.on_output(0, _prompt(0))
    term.debugger.on_output(1, _prompt(1))
    term.debugger.on_output(2, _prompt(2))
    term.printed()
    term.debugger.on_output(0, DebugOutput(0, "", waiting=False, resumed=True))
    assert term.debugger.current == 1
    assert term.printed().startswith("\n--- pdb: rank 1 on node1")


def test_rule_without_a_terminal_a_ranks_output_is_shown_and_only_its_prompts_are_answered(term):
    term.debugger.terminal = False  # the end of input came: no terminal any more
    term.debugger.on_output(0, DebugOutput(0, "the rest of 'where'\n", waiting=False))
    assert term.sent == []  # it waits for nothing: nothing is sent to it
    assert term.printed().endswith("the rest of 'where'\n")
    term.debugger.on_output(0, _prompt(0))
    assert term.sent == [(0, DebugInput(None))]  # its prompt: answered at once, it runs on


def test_rule_once_the_last_ranks_worker_is_gone_the_terminal_is_left_alone(term):
    term.debugger.on_output(0, _prompt(0))
    assert term.read_fd in term.loop.readers
    term.debugger.forget(0)  # its worker ended (or its connection did)
    assert term.debugger.stops == {} and term.debugger.current is None
    assert term.read_fd not in term.loop.readers
