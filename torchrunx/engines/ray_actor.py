"""The Ray actor that starts one agent on its node, and relays the agent's output.

Shipped to Ray's workers *by value* (``cloudpickle.register_pickle_by_value``), so a node needs
Ray and Python, not torchrunx on its path: this module imports only the standard library. The
agent is its own process in its own session (its workers are forked from it, never from a Ray
worker); its stdin stays open while the actor lives, so the agent stops by itself when the
actor ends, however it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections import deque

_READ_SIZE = 65536


def agent_environ(environ: dict[str, str]) -> dict[str, str]:
    """The environment the agent starts with: the node's, less what Ray set for its workers.

    Ray's ``RAY_*`` variables go, and the ``PYTHONBREAKPOINT`` that points ``breakpoint()`` at
    Ray's debugger (the ranks' ``breakpoint()`` is torchrunx's). ``CUDA_VISIBLE_DEVICES`` stays:
    Ray sets it to the GPUs it reserved for the actor.
    """
    return {
        name: value
        for name, value in environ.items()
        if not name.startswith("RAY_") and not _rays_debugger(name, value)
    }


def _rays_debugger(name: str, value: str) -> bool:
    return name == "PYTHONBREAKPOINT" and value.startswith("ray.")


class AgentRunner:
    """One agent process: started by :meth:`start`, read by :meth:`read`, ended by :meth:`close`.

    Ray calls these from several threads (``max_concurrency``): a long :meth:`read` does not
    hold up :meth:`close`.
    """

    def __init__(self) -> None:
        """Nothing runs until :meth:`start`."""
        self._process: subprocess.Popen[bytes] | None = None
        self._chunks: deque[tuple[bool, bytes]] = deque()
        self._open_streams = 0
        self._changed = threading.Condition()

    def start(self, argv: list[str], payload: bytes) -> tuple[int, str]:
        """Start ``argv`` and write ``payload`` (the script and bootstrap line) to its stdin.

        Returns:
            The agent's pid and this node's hostname.
        """
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=agent_environ(dict(os.environ)),
            start_new_session=True,
        )
        self._process = process
        self._open_streams = 2
        for is_stderr, stream in ((False, process.stdout), (True, process.stderr)):
            threading.Thread(
                target=self._pump,
                args=(is_stderr, stream),
                name="torchrunx-agent-output",
                daemon=True,
            ).start()
        assert process.stdin is not None  # noqa: S101 (Popen with PIPE)
        with contextlib.suppress(OSError):  # it died at once: read() tells
            process.stdin.write(payload)
            process.stdin.flush()
        return process.pid, os.uname().nodename

    def _pump(self, is_stderr: bool, stream: object) -> None:
        fd = stream.fileno()  # type: ignore[attr-defined]
        while True:
            try:
                chunk = os.read(fd, _READ_SIZE)
            except OSError:
                chunk = b""
            with self._changed:
                if chunk:
                    self._chunks.append((is_stderr, chunk))
                else:
                    self._open_streams -= 1
                self._changed.notify_all()
            if not chunk:
                return

    def _status(self) -> int | None:
        """The agent's exit status once it has ended and both its streams are read to the end."""
        if self._process is None or self._open_streams > 0:
            return None
        return self._process.poll()

    def read(self, timeout: float) -> tuple[list[tuple[bool, bytes]], int | None]:
        """What the agent wrote since the last read, and its exit status once it has ended.

        Waits up to ``timeout`` seconds for either.
        """
        with self._changed:
            self._changed.wait_for(lambda: bool(self._chunks) or self._open_streams == 0, timeout)
            chunks = list(self._chunks)
            self._chunks.clear()
        status = self._status()
        if status is None and self._open_streams == 0 and self._process is not None:
            status = self._process.wait()
        return chunks, status

    def close(self, grace: float) -> int | None:
        """Close the agent's stdin (it stops), wait ``grace`` seconds, then SIGKILL its session.

        Returns:
            Its exit status (``None`` if it was never started).
        """
        process = self._process
        if process is None:
            return None
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        try:
            return process.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            return process.wait()
