"""Rules of the log fields' checks and of a ``log_handlers`` function's call (pure).

``check_log_fields`` checks ``log_handlers`` and ``console_ranks`` together before anything
starts; ``call_handler_factory`` calls a function with the resolved launch if it takes it.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

import pytest

from torchrunx.logs import (
    LogSetup,
    SourceFilter,
    call_handler_factory,
    check_log_fields,
    is_handler_list,
)

if TYPE_CHECKING:
    import inspect

HANDLER = logging.NullHandler()
SETUP = LogSetup(hostnames=("node1", "node2"), workers_per_host=(2, None), log_level=20)


def factory() -> list[logging.Handler]:
    return [HANDLER]


@pytest.mark.parametrize(
    "handlers", ["auto", None, [], [HANDLER], (HANDLER,), ["auto"], ["auto", HANDLER], factory]
)
def test_rule_every_form_of_log_handlers_passes_with_the_default_console(handlers):
    check_log_fields(handlers)
    check_log_fields(handlers, (0,))
    check_log_fields(handlers, [0])  # a list of ranks is the same ranks


@pytest.mark.parametrize("handlers", ["auto", ["auto"], ["auto", HANDLER], factory])
@pytest.mark.parametrize("ranks", ["all", (), (1,), (0, 3), [2]])
def test_rule_console_ranks_need_the_default_handlers_or_a_function_that_may_return_them(
    handlers, ranks
):
    check_log_fields(handlers, ranks)


@pytest.mark.parametrize("handlers", [None, [], [HANDLER], (HANDLER,)])
@pytest.mark.parametrize("ranks", ["all", (), (1,)])
def test_rule_console_ranks_without_the_default_handlers_is_refused_naming_the_way(handlers, ranks):
    message = (
        f"console_ranks={ranks!r} chooses what the default console shows, but "
        f'log_handlers={handlers!r} has no default handlers: put "auto" in the list '
        '(log_handlers=["auto", ...]), or use trx.stream_handler(hostname, local_rank) for '
        "each worker to show"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_log_fields(handlers, ranks)


@pytest.mark.parametrize(
    "ranks", ["every", "ALL", 0, (-1,), (0, -2), (True,), (1.0,), ("0",), None]
)
def test_rule_console_ranks_are_all_or_ranks_from_0(ranks):
    message = f'console_ranks must be "all" or global ranks (integers >= 0), got {ranks!r}'
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_log_fields("auto", ranks)


@pytest.mark.parametrize("handlers", [[1], ["files"], ["auto", "auto2"], "stderr", 5, HANDLER])
def test_rule_anything_else_is_no_log_handlers(handlers):
    message = (
        'log_handlers must be "auto", None, a list of logging.Handler (with "auto" among '
        "them to keep the default handlers) or a function returning one, got "
        f"{handlers!r}"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        check_log_fields(handlers)


def test_rule_a_handler_list_is_a_list_or_tuple_of_handlers_and_auto():
    assert is_handler_list([]) and is_handler_list(()) and is_handler_list(["auto", HANDLER])
    assert not is_handler_list("auto")  # a string is not a list of them
    assert not is_handler_list([HANDLER, "x"])
    assert not is_handler_list({HANDLER})
    assert not is_handler_list(None)


def test_rule_a_function_gets_the_setup_only_if_it_takes_an_argument():
    seen: list[object] = []

    def bare() -> list[logging.Handler]:
        seen.append("bare")
        return [HANDLER]

    def with_setup(setup: LogSetup) -> tuple[logging.Handler | str, ...]:
        seen.append(setup)
        return ("auto", HANDLER)

    def optional(setup: LogSetup | None = None) -> list[logging.Handler]:
        seen.append(("optional", setup))
        return []

    def star(*args: object) -> list[logging.Handler]:
        seen.append(args)
        return []

    def keyword_only(*, setup: LogSetup | None = None) -> list[logging.Handler]:
        seen.append(("keyword", setup))
        return []

    assert call_handler_factory(bare, SETUP) == [HANDLER]
    assert call_handler_factory(with_setup, SETUP) == ["auto", HANDLER]  # a list, from a tuple
    assert call_handler_factory(optional, SETUP) == []
    assert call_handler_factory(star, SETUP) == []
    assert call_handler_factory(keyword_only, SETUP) == []
    assert seen == ["bare", SETUP, ("optional", None), (SETUP,), ("keyword", None)]


@pytest.mark.parametrize("made", ["oops", None, [1], HANDLER])
def test_rule_a_function_must_return_handlers(made):
    def wrong() -> object:
        return made

    message = (
        f"the log_handlers function {wrong.__qualname__!r} returned {made!r}; it must return a "
        'list of logging.Handler (and "auto" for the defaults)'
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        call_handler_factory(wrong, SETUP)


def test_rule_a_source_filter_passes_its_host_its_entry_and_its_rank_only():
    any_entry = SourceFilter("node1", 1, None)
    assert any_entry.accepts("node1", 0, 1) and any_entry.accepts("node1", 3, 1)
    assert not any_entry.accepts("node2", 0, 1) and not any_entry.accepts("node1", 0, 0)
    assert not any_entry.accepts("node1", 0, None)
    agent = SourceFilter("node1", None, 2)
    assert agent.accepts("node1", 2, None)
    assert not agent.accepts("node1", 1, None) and not agent.accepts("node1", 2, 0)


def test_rule_a_callable_without_a_signature_is_called_bare_and_named_by_its_repr():
    assert call_handler_factory(list, SETUP) == []  # list() itself: no signature to read

    class Maker:
        def __call__(self, setup: LogSetup) -> str:
            return f"not handlers for {setup.hostnames}"

        def __repr__(self) -> str:
            return "<the maker>"

    with pytest.raises(TypeError, match=r"^the log_handlers function <the maker> returned "):
        call_handler_factory(Maker(), SETUP)


def test_rule_a_source_filter_reads_a_records_source_attributes():
    def record(**source: object) -> logging.LogRecord:
        made = logging.LogRecord("w", logging.INFO, "", 0, "text", None, None)
        made.__dict__.update(source)
        return made

    worker = SourceFilter("node1", 1, 0)
    assert worker.filter(record(hostname="node1", host_index=0, local_rank=1))
    assert not worker.filter(record(hostname="node1", host_index=0, local_rank=0))
    assert not worker.filter(record(hostname="node2", host_index=0, local_rank=1))
    assert not worker.filter(record(hostname="node1", host_index=1, local_rank=1))
    assert not worker.filter(record())  # a record of no source
    agent = SourceFilter("node1", None, None)
    assert agent.filter(record(hostname="node1", host_index=5, local_rank=None))
    assert agent.filter(record(hostname="node1"))  # no local rank: the agent's


def test_rule_a_callable_whose_signature_cannot_be_read_is_called_bare():
    calls: list[tuple[object, ...]] = []

    class Unreadable:
        @property
        def __signature__(self) -> inspect.Signature:
            raise ValueError("no signature")

        def __call__(self, *args: object) -> list[logging.Handler]:
            calls.append(args)
            return []

    assert call_handler_factory(Unreadable(), SETUP) == []
    assert calls == [()]


@pytest.mark.parametrize("handlers", [[HANDLER, "auto"], (HANDLER, HANDLER, "auto")])
@pytest.mark.parametrize("ranks", ["all", (1,), ()])
def test_rule_auto_anywhere_in_the_list_keeps_the_default_console_for_console_ranks(
    handlers, ranks
):
    check_log_fields(handlers, ranks)


def test_rule_console_ranks_word_all_is_no_log_handlers():
    with pytest.raises(TypeError, match=r"^log_handlers must be .*, got 'all'$"):
        check_log_fields("all")
