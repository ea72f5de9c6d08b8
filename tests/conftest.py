"""Shared pytest fixtures."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest
from cluster import cluster_unavailable_reason, start_cluster

if TYPE_CHECKING:
    from collections.abc import Iterator

    from cluster import TestCluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestCluster]:
    """A running 2-host SSH test cluster (``node1``, ``node2``), shared by the whole session.

    Skipped where no cluster can be made, except on CI (``CI`` set), where that is a failure.
    """
    reason = cluster_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"test cluster required on CI: {reason}")
        pytest.skip(reason)
    test_cluster = start_cluster(2, tmp_path_factory.mktemp("cluster"))
    yield test_cluster
    test_cluster.stop()


def torchrunx_processes() -> list[str]:
    """Live (non-zombie) agents and workers on this machine, test hosts included.

    The test hosts share this machine's pid namespace, so one look covers every host. Agents
    run ``python -c BOOT`` whose code names ``torchrunx.agent``; workers are forks of agents
    and keep that command line.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "torchrunx.agent" in cmdline and state != "Z":
            found.append(f"{entry}: {cmdline[:120]}")
    return found


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """After every test: no agent or worker may be left on any host."""
    yield
    assert torchrunx_processes() == []
