"""The parallel suite's layout: every pytest-xdist worker's test hosts are its own (pure)."""

from __future__ import annotations

import itertools
import re

import pytest
from cluster import PER_WORKER, PROFILES, Profile, worker_profile

WORKERS = range(45)


def _every_profile() -> list[Profile]:
    """The machine-wide profiles, and every worker's copy of the per-worker ones."""
    copies = [worker_profile(name, worker) for name in PER_WORKER for worker in WORKERS]
    return [*PROFILES.values(), *copies]


def test_outside_xdist_and_for_machine_wide_profiles_the_profile_is_unchanged(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    for name, profile in PROFILES.items():
        assert worker_profile(name) is profile
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    for name in set(PROFILES) - PER_WORKER:  # one SLURM, Ray and bench cluster a machine
        assert worker_profile(name) is PROFILES[name]
    assert worker_profile("test") == worker_profile("test", 3) != PROFILES["test"]


def test_worker_profiles_are_named_after_the_worker():
    one = worker_profile("test", 1)
    assert (one.host(1).name, one.host(1).address, one.host(1).netns) == (
        "w1node1",
        "10.211.0.11",
        "trxw1-w1node1",
    )
    assert worker_profile("reach", 1).host(2).address == "10.211.4.12"
    with pytest.raises(ValueError, match="at most 45 workers"):
        worker_profile("test", 45)


def test_no_two_profiles_share_a_name_a_link_an_address_or_a_marker():
    profiles = _every_profile()
    hosts = [profile.host(i) for profile in profiles for i in (1, 2, 99)]
    for values in (
        [p.subnet for p in profiles],
        [p.bridge for p in profiles],
        [p.hosts_marker for p in profiles],
        [p.launcher_name for p in profiles],
        [p.unreachable_name for p in profiles],
        [h.name for h in hosts],
        [h.netns for h in hosts],
        [h.veth for h in hosts],
    ):
        assert len(set(values)) == len(values)
    for link in [*(p.bridge for p in profiles), *(h.veth for h in hosts)]:
        assert len(link) <= 15, link  # IFNAMSIZ
        assert re.fullmatch(r"[a-z0-9]+", link), link


def test_a_profile_cleans_up_only_what_is_its_own():
    """A stale cluster's removal (by prefix, link pattern and marker) spares every other."""
    profiles = _every_profile()
    for mine, other in itertools.permutations(profiles, 2):
        for i in (1, 2, 99):
            host = other.host(i)
            assert not host.netns.startswith(mine.netns_prefix), (mine.name, host.netns)
            assert not mine.owns_link(host.veth), (mine.name, host.veth)
        assert not mine.owns_link(other.bridge)
        assert not mine.is_marked(f"10.0.0.1 x {other.hosts_marker}\n".encode())
