"""Capture in agents and workers: their ``logging`` and ``warnings`` records, to stderr, marked.

Each worker's file descriptors 1 and 2 are pipes read by its agent, so everything the worker
writes (``print``, C extensions, child processes) is captured at the descriptor level and
survives the worker's death. The records of ``logging`` and ``warnings`` are written to stderr
as marked lines (:mod:`torchrunx.wire.lines`), which keep their level and logger name. Once
connected, the agent sends its own records on its connection, in the same stream as its
workers' lines (local rank ``None``), so they keep their order.
"""

from __future__ import annotations

import logging
import sys

from torchrunx.wire.lines import MarkedLineFormatter


def capture_logging(level: int) -> None:
    """In an agent or a worker: send ``logging`` and ``warnings`` records to stderr, marked."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(MarkedLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(capture=True)
