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
