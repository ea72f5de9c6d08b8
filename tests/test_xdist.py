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


def test_a_shared_profile_waits_for_the_run_that_holds_its_hosts(monkeypatch):
    # A benchmark run and the suite's benchmark smoke test both use the bench profile; each
    # start removed the other's hosts as stale (a host key mismatch mid-launch). The lock of a
    # shared profile is held while its cluster lives: the next start waits, then says why.
    import dataclasses
    import subprocess
    import sys
    from pathlib import Path

    import cluster

    profile = dataclasses.replace(PROFILES["bench"], name="locktest")  # type: ignore[arg-type]
    monkeypatch.setattr(cluster, "SHARED_PROFILES", frozenset({"locktest"}))
    assert cluster._hold_profile(PROFILES["test"]) is None  # a profile of its own: no lock
    path = Path("/run/torchrunx-cluster-locktest.lock")
    code = (
        "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        monkeypatch.setattr(cluster, "PROFILE_WAIT", 1.0)
        with pytest.raises(RuntimeError, match="locktest test hosts were in use by another run"):
            cluster._hold_profile(profile)
    finally:
        holder.communicate(timeout=30)  # its stdin closed: it ends, and its lock with it
    handle = cluster._hold_profile(profile)  # free again: held at once
    assert handle is not None
    handle.close()
    path.unlink()
