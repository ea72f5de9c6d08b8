"""The bench test hosts for the benchmarks that run a launch over SSH (stragglers, hangs).

``tests/cluster.py``'s namespace SSH hosts in its ``bench`` profile (``bnode1``... on
``10.201.0.0/24``), so that a benchmark can run while the test suite runs its own ``test``
profile cluster. Needs root; :func:`unavailable_reason` says why they cannot be made here.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from cluster import cluster_unavailable_reason, start_cluster  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterator


def unavailable_reason() -> str | None:
    """Why the bench test hosts cannot be made here (not root, no ``ip netns``), or None."""
    return cluster_unavailable_reason()


@contextlib.contextmanager
def ssh_hosts(count: int) -> Iterator[dict[str, object]]:
    """Start ``count`` bench test hosts; yield the Launcher fields that reach them over SSH.

    ``hostnames`` and ``ssh_config_file``; the hosts are stopped when the block ends.
    """
    with tempfile.TemporaryDirectory() as work_dir:
        cluster = start_cluster(count, Path(work_dir), profile="bench")
        try:
            yield {"hostnames": cluster.names(), "ssh_config_file": cluster.ssh_config}
        finally:
            cluster.stop()
