"""The launcher's open-file limit: raised for a launch that needs more, and put back after.

A launch holds descriptors for each host: its agent's connection, its SSH session or
process pipes, a relayed host's channel pairs, a tree child's stand-in pipes, log files.
Measured on the bench test hosts: 6 to 9 per host with 1 worker, 9 to 12 with 4. The common
soft limit of 1,024 (``ulimit -n``) ends a launch of about 100 hosts with "Too many open
files", while the hard limit is usually far higher. So a launch raises the soft limit of its
process to what it may need (:func:`descriptors_needed`), never above the hard limit and never
lower than it was, and puts it back when the last launch of the process that raised it ends
(launches may run at once in threads: each holds its need, :class:`DescriptorLimit`). A hard
limit below the need is said in a warning that names the fix; the launch goes on and may
fail there with its own error.
"""

from __future__ import annotations

import logging
import resource
import threading

logger = logging.getLogger("torchrunx.launcher")

BASE_DESCRIPTORS = 256
"""What a launch needs whatever its hosts: its listener, view, log router, Python's own."""
PER_HOST = 12
"""Descriptors a host may hold, beyond its workers' (about twice the measured 6 to 9)."""
PER_WORKER = 2
"""Descriptors a worker may add to its host's (log files, direct results; measured 1)."""
GUESSED_WORKERS = 8
"""Workers counted for a host whose agent counts its own (``workers_per_host="auto"``)."""

_lock = threading.Lock()
_needs: list[int] = []
_before: int | None = None
"""The soft limit before the first launch of those running raised it (None: not raised)."""


def descriptors_needed(hosts: int, workers: int) -> int:
    """What a launch of ``hosts`` hosts and ``workers`` workers in all may need at once."""
    return BASE_DESCRIPTORS + PER_HOST * hosts + PER_WORKER * workers


def _infinite(limit: int) -> bool:
    return limit == resource.RLIM_INFINITY


class DescriptorLimit:
    """One launch's hold on the process's open-file limit (see the module).

    Raises the soft limit to ``needed`` at once (up to the hard limit); :meth:`release` (once)
    puts it back when no other launch of the process holds it.
    """

    def __init__(self, needed: int) -> None:
        """Hold ``needed`` descriptors for a launch."""
        global _before  # noqa: PLW0603 (the process's one limit, shared by its launches)
        self.needed = needed
        self._held = True
        with _lock:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            _needs.append(needed)
            if _infinite(soft) or soft >= needed:
                return
            target = needed if _infinite(hard) else min(needed, hard)
            if target > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                if _before is None:
                    _before = soft
                logger.debug("open-file limit raised from %d to %d for this launch", soft, target)
            if target < needed:
                logger.warning(
                    "this launch may need %d open files, and this process may open %d at most "
                    "(its hard limit): it may fail with 'Too many open files'. Raise the hard "
                    "limit (ulimit -Hn, or nofile in /etc/security/limits.conf) or launch on "
                    "fewer hosts",
                    needed,
                    hard,
                )

    def release(self) -> None:
        """The launch is over: the limit goes back once no other launch holds it."""
        global _before  # noqa: PLW0603
        with _lock:
            if not self._held:
                return
            self._held = False
            _needs.remove(self.needed)
            if _needs or _before is None:
                return
            _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (_before, hard))
            _before = None
