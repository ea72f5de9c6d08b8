"""Rules of a launch's result: ranks host by host, values looked up by rank or host (pure)."""

from __future__ import annotations

import pytest

from torchrunx.launcher.state.results import LaunchResult


def _result() -> LaunchResult[str]:
    return LaunchResult(("a", "b", "a"), (("a0", "a1"), ("b0",), ("a2",)))


def test_rule_a_rank_is_looked_up_in_host_order_and_one_past_the_last_is_refused():
    result = _result()
    assert [result.rank(i) for i in range(4)] == ["a0", "a1", "b0", "a2"]
    for missing in (4, -1):
        with pytest.raises(IndexError) as raised:
            result.rank(missing)
        assert str(raised.value) == (f"rank {missing} does not exist; this launch had ranks 0..3")


def test_rule_a_hosts_local_rank_counts_through_its_entries_and_the_end_is_refused():
    result = _result()
    assert [result.index("a", i) for i in range(3)] == ["a0", "a1", "a2"]
    assert result.index("b", 0) == "b0"
    for missing in (1, -1):
        with pytest.raises(IndexError) as raised:
            result.index("b", missing)
        assert str(raised.value) == (f"host 'b' ran 1 workers; local rank {missing} does not exist")
    with pytest.raises(KeyError) as unknown:
        result.index("c", 0)
    assert unknown.value.args[0] == "host 'c' was not part of this launch (hosts: ['a', 'b'])"


def test_rule_a_result_made_without_the_launchs_details_says_fresh_workers_and_nothing_else():
    """Every run's workers are fresh but a warm run's that kept them (which says so)."""
    result = _result()
    assert result.fresh_workers is True
    assert (result.restarts, result.world_changes, result.stragglers) == (0, (), ())
