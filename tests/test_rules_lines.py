"""Rules of the line format shared by agents, workers and the launcher (pure).

Marked lines keep their level and logger name; plain lines take their stream's level; a
stream is cut into whole lines (a carriage return ends one too, a record after an unfinished
line starts its own, a line without an end is passed on in pieces); a kept line is cut to a
number of UTF-8 bytes, never inside a character.
"""

from __future__ import annotations

import logging
import random
import sys

from torchrunx.wire.lines import (
    MAX_LINE_BYTES,
    LineSplitter,
    MarkedLineFormatter,
    cut_line,
    line_records,
    parse_line,
)


def test_line_splitter_and_parser():
    splitter = LineSplitter()
    assert splitter.feed(b"ab") == []
    assert splitter.feed(b"c\nde\n\nf") == ["abc", "de", ""]
    assert splitter.feed(b"") == ["f"]
    marked = parse_line("\x1e40\x1fpkg.mod\x1fboom\x1dtraceback", is_stderr=True, default_name="x")
    assert (marked.levelno, marked.name, marked.text) == (40, "pkg.mod", "boom\ntraceback")
    plain = parse_line("hello", is_stderr=False, default_name="worker.0.stdout")
    assert (plain.levelno, plain.name) == (logging.INFO, "worker.0.stdout")
    assert parse_line("oops", is_stderr=True, default_name="e").levelno == logging.WARNING


def test_line_splitter_decodes_whole_lines_as_each_alone():
    # Many lines are decoded at once: invalid UTF-8 must come out as if each line were decoded
    # on its own, whatever the chunks.
    rng = random.Random(16)  # noqa: S311 (test data)
    alphabet = [b"a", b"\n", b"\xc3\xa9", b"\xe2\x82\xac", b"\xe2\x82", b"\xff", b"\xc3", b" "]
    for _ in range(200):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(200))) + b"\n"
        splitter = LineSplitter()
        lines: list[str] = []
        position = 0
        while position < len(data):
            step = rng.randrange(1, 20)
            lines += splitter.feed(data[position : position + step])
            position += step
        lines += splitter.feed(b"")
        assert lines == [line.decode(errors="replace") for line in data.split(b"\n")[:-1]]


def test_line_splitter_carriage_return_ends_a_line():
    splitter = LineSplitter()
    assert splitter.feed(b" 10%\r 20%\r") == [" 10%", " 20%"]
    assert splitter.feed(b"\r\n") == []  # a bar clearing itself, then its end: nothing blank
    assert splitter.feed(b"done\r\nnext\n") == ["done", "next"]
    assert splitter.feed(b"bar\r\x1e30\x1fmylib\x1fhello\n") == ["bar", "\x1e30\x1fmylib\x1fhello"]


def test_line_records_parse_as_parse_line():
    lines = ["plain", "\x1e40\x1fpkg.mod\x1fboom\x1dtraceback", "\x1enot a record", ""]
    for is_stderr in (False, True):
        records = line_records(
            lines, is_stderr=is_stderr, default_name="worker.2.x", local_rank=2, created=5.0
        )
        expected = []
        for raw in lines:
            line = parse_line(raw, is_stderr=is_stderr, default_name="worker.2.x")
            expected.append((2, line.levelno, line.name, line.text, 5.0))
        assert records == expected


def test_rule_a_record_is_one_marked_line_its_newlines_and_last_newline_folded():
    record = logging.LogRecord("pkg.mod", logging.ERROR, __file__, 1, "a\nb\n\n", (), None)
    assert MarkedLineFormatter().format(record) == "\x1e40\x1fpkg.mod\x1fa\x1db"
    try:
        raise ValueError("boom")  # noqa: TRY301 (a traceback to format)
    except ValueError:
        failed = logging.LogRecord("w", logging.WARNING, __file__, 1, "x", (), sys.exc_info())
    line = MarkedLineFormatter().format(failed)
    assert line.startswith("\x1e30\x1fw\x1fx\x1dTraceback (most recent call last):\x1d")
    assert line.endswith("ValueError: boom") and "\n" not in line


def test_rule_only_a_whole_record_is_marked_else_the_line_is_plain():
    parse = parse_line
    assert parse("\x1e40\x1fn\x1fa\x1fb", is_stderr=False, default_name="d").text == "a\x1fb"
    for raw in ("\x1e40\x1fonly a name", "\x1eX\x1fn\x1ft", "\x1e\x1fn\x1ft", "40\x1fn\x1ft"):
        line = parse(raw, is_stderr=False, default_name="d")
        assert (line.levelno, line.name, line.text) == (logging.INFO, "d", raw)


def test_rule_records_of_a_stream_take_its_level_unless_marked():
    lines = ["out", "\x1e10\x1flib\x1fdebug\x1dmore", "\x1ebroken"]
    assert line_records(
        lines, is_stderr=True, default_name="worker.1.err", local_rank=None, created=7.5
    ) == [
        (None, logging.WARNING, "worker.1.err", "out", 7.5),
        (None, logging.DEBUG, "lib", "debug\nmore", 7.5),
        (None, logging.WARNING, "worker.1.err", "\x1ebroken", 7.5),
    ]
    assert line_records(["x"], is_stderr=False, default_name="o", local_rank=3, created=1.0) == [
        (3, logging.INFO, "o", "x", 1.0)
    ]


def test_rule_a_record_after_an_unfinished_line_starts_a_line_of_its_own():
    splitter = LineSplitter()
    assert splitter.feed(b"50%\x1e20\x1fa\x1fb\nnext\n") == ["50%", "\x1e20\x1fa\x1fb", "next"]
    assert splitter.feed(b"x\x1e20\x1fa\x1fb") == []  # the record has no end yet
    assert splitter.feed(b"\n") == ["x", "\x1e20\x1fa\x1fb"]
    assert splitter.feed(b"\x1e20\x1fa\x1fb\r\n") == ["\x1e20\x1fa\x1fb\r"]  # a record is whole


def test_rule_blank_lines_stay_but_blank_redraws_go():
    splitter = LineSplitter()
    assert splitter.feed(b"\n\na\rb\n\n") == ["", "", "a", "b", ""]
    assert splitter.feed(b"\r \r\n") == []
    assert splitter.feed(b"c\r") == ["c"]
    assert splitter.feed(b"\n") == []  # the bar's end: no empty line
    assert splitter.feed(b"d\re") == ["d"]
    assert splitter.feed(b"") == ["e"]
    assert splitter.feed(b"") == []
    ended = LineSplitter()
    assert ended.feed(b"p\rq\r") == ["p", "q"]
    assert ended.feed(b"") == []


def test_rule_a_line_without_an_end_is_passed_on_in_pieces_past_the_limit():
    for redraw in (b"", b"\r"):  # either way a chunk is cut
        splitter = LineSplitter()
        assert splitter.feed(redraw + b"y" * MAX_LINE_BYTES) == []  # the limit: kept
        assert splitter.feed(b"y") == ["y" * (MAX_LINE_BYTES + 1)]
        assert splitter.feed(b"z\n") == ["z"]
    marked = LineSplitter()  # a record's carriage return is its own: it waits for its end
    assert marked.feed(b"x\n\x1e20\x1fn\x1fa\rb") == ["x"]
    assert marked.feed(b"\n") == ["\x1e20\x1fn\x1fa\rb"]


def test_rule_a_line_is_cut_to_its_bytes_never_inside_a_character():
    assert cut_line("abcd", limit=4) == "abcd"
    assert cut_line("abcde", limit=4) == "abcd [... 1 more bytes cut]"
    assert cut_line("ééé", limit=6) == "ééé"  # 6 bytes: not cut
    assert cut_line("éééé", limit=7) == "ééé [... 2 more bytes cut]"
    assert cut_line("a" * 8, limit=2) == "aa [... 6 more bytes cut]"
    assert cut_line("€\udcff", limit=3) == "€ [... 1 more bytes cut]"  # a lone surrogate: "?"


def test_rule_only_a_records_last_newlines_go_not_its_other_trailing_characters():
    record = logging.LogRecord("n", logging.INFO, __file__, 1, "a X \n\n", (), None)
    assert MarkedLineFormatter().format(record) == "\x1e20\x1fn\x1fa X "
    record = logging.LogRecord("n", logging.INFO, __file__, 1, "aX\n", (), None)
    assert MarkedLineFormatter().format(record) == "\x1e20\x1fn\x1faX"


def test_rule_invalid_utf8_is_replaced_on_every_way_out_of_the_splitter():
    bad = b"\xff"
    assert LineSplitter().feed(b"a" + bad + b"\rb" + bad + b"\n") == ["a\ufffd", "b\ufffd"]
    ended = LineSplitter()
    assert ended.feed(b"c" + bad) == []
    assert ended.feed(b"") == ["c\ufffd"]
    long = LineSplitter()
    assert long.feed(bad * (MAX_LINE_BYTES + 1)) == ["\ufffd" * (MAX_LINE_BYTES + 1)]
    redrawn = LineSplitter()
    assert redrawn.feed(b"\r" + bad * (MAX_LINE_BYTES + 1)) == ["\ufffd" * (MAX_LINE_BYTES + 1)]
    assert redrawn.feed(b"d\n") == ["d"]  # nothing of the long line is left before it


def test_rule_lines_ended_before_a_redraw_in_one_chunk_all_come():
    assert LineSplitter().feed(b"a\nb\rc") == ["a", "b"]
    assert LineSplitter().feed(b"a b\rc d\n") == ["a b", "c d"]  # spaces are no line end


def test_rule_what_follows_a_records_marker_is_one_record_even_with_another_marker():
    splitter = LineSplitter()
    assert splitter.feed(b"bar\x1e20\x1fn\x1fx\x1ey\n") == ["bar", "\x1e20\x1fn\x1fx\x1ey"]


def test_rule_a_line_of_four_byte_characters_is_cut_to_its_bytes_too():
    # No shortcut may take a character for fewer than 4 bytes: "😀" is 4.
    assert cut_line("😀😀", limit=7) == "😀 [... 4 more bytes cut]"
    assert cut_line("😀😀", limit=8) == "😀😀"


def test_rule_a_blank_redraw_before_an_unfinished_line_goes_too():
    splitter = LineSplitter()
    assert splitter.feed(b"a\n \rb") == ["a"]  # the blank redraw is dropped, "b" waits
    assert splitter.feed(b" \t\r") == ["b \t"]
    assert splitter.feed(b"\r  \r") == []
    assert splitter.feed(b"") == []
