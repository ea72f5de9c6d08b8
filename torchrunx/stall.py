"""``torchrunx.progress()``: tell the launcher's stall detection that this rank moves on.

With ``Launcher.stall_timeout`` set (the default), the launcher reports a stall when no rank
has made progress for that long. A rank makes progress when one of its collectives completes
(read from PyTorch's flight recorder) or when it calls :func:`progress`: call it where your
code moves on without collectives (a step of a loop with ``backend=None``, a long stretch of
data loading or evaluation on one rank). It costs a counter's increment: no message is sent
from the calling thread.

With ``backend=None`` there are no collectives to read: stall detection starts with a
launch's first :func:`progress` call, and a launch that never calls it is never reported.

Outside a torchrunx worker (plain ``python``, a unit test) it does nothing.
"""

from __future__ import annotations

_calls = 0


def progress() -> None:
    """This rank made progress: the launch is not stalled (see the module)."""
    global _calls  # noqa: PLW0603 (one counter per worker process)
    _calls += 1


def calls() -> int:
    """How many times :func:`progress` was called in this process (read by the worker's probe)."""
    return _calls
