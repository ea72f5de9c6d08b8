"""The launcher's open-file limit: raised for a launch that needs more, put back after.

Each case runs in a process of its own: the limit is the whole process's, and the test
session's own must not change under the other tests.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from torchrunx.launcher.launch.limits import (
    BASE_DESCRIPTORS,
    PER_HOST,
    PER_WORKER,
    descriptors_needed,
)


def _run(code: str, timeout: float = 120) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_rule_a_launch_needs_a_base_and_a_share_per_host_and_per_worker():
    assert descriptors_needed(0, 0) == BASE_DESCRIPTORS
    assert descriptors_needed(1024, 8192) == BASE_DESCRIPTORS + 1024 * PER_HOST + 8192 * PER_WORKER
    # Above the peaks measured on the bench test hosts (a tree's launcher: 565 descriptors for
    # 64 hosts x 1 worker, 405 for 32 x 4; flat: 397 and 301), with half as much to spare.
    for hosts, workers, peak in ((64, 64, 565), (32, 128, 405), (64, 64, 397), (32, 128, 301)):
        assert descriptors_needed(hosts, workers) >= 1.5 * peak


def test_the_limit_is_raised_held_by_each_launch_and_put_back_by_the_last():
    out = _run(
        """
        import resource
        from torchrunx.launcher.launch.limits import DescriptorLimit
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        soft = lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        a = DescriptorLimit(500)
        print("a", soft())
        b = DescriptorLimit(300)   # needs less than is there: nothing changes
        c = DescriptorLimit(800)   # needs more: raised again
        print("c", soft())
        a.release(); a.release()   # released twice: once counts
        c.release()
        print("b holds", soft())   # another launch still runs: not put back under it
        b.release()
        print("none", soft())
        DescriptorLimit(32).release()  # needs less than the limit: never lowered
        print("low", soft())
        """
    )
    assert out.split() == ["a", "500", "c", "800", "b", "holds", "800", "none", "64", "low", "64"]


def test_a_hard_limit_below_the_need_is_reached_and_said_with_the_fix():
    out = _run(
        """
        import logging, resource
        from torchrunx.launcher.launch.limits import DescriptorLimit
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 200))  # the hard limit too: this process
        hold = DescriptorLimit(500)
        print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        hold.release()
        print("after", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """
    )
    assert "soft 200" in out and "after 64" in out
    assert "this launch may need 500 open files, and this process may open 200 at most" in out
    assert "ulimit -Hn" in out


def test_a_launch_on_more_hosts_than_the_soft_limit_allows_runs_and_puts_it_back():
    # 12 local agents need about 100 descriptors: under a soft limit of 48 the launch failed
    # with "Too many open files" before its agents started.
    out = _run(
        """
        import resource
        import torchrunx as trx
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard))

        def host_rank():
            import os
            return int(os.environ["RANK"])

        result = trx.launch(
            host_rank, hostnames=["localhost"] * 12, workers_per_host=1, backend=None,
            log_handlers=[],
        )
        print("ranks", result.ranks)
        print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """,
        timeout=180,
    )
    assert f"ranks {list(range(12))}" in out, out
    assert "soft 48" in out, out
