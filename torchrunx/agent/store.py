"""The rendezvous store of an attempt: listening before any rank looks for it.

Every rank of a worker group meets in one ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``. With plain
``env://``, rank 0 opens that port when it joins the group, and a rank that gets there first is
refused and backs off for 0.25-0.7 s (torch's retry): most runs paid it once ranks were on two
hosts. Here the port listens from before the launcher sends any spec:

1. The agent of host 0 opens a listening socket for the next attempt (:class:`StoreSocket`)
   before it says hello, and again each time an attempt's workers have ended; its port is the
   ``free_port`` of its ``AgentHello`` and ``WorkersEnded``, the launcher's ``MASTER_PORT``.
2. Its worker of local rank 0 (global rank 0) inherits the socket when forked, and serves it
   with a ``TCPStore`` (``master_listen_fd``) as soon as torch is imported in it: at once when
   the agent imported torch before the fork, else when the function first imports it
   (:func:`serve_when_torch_imported`). The other workers and the agent close their copies.
3. Every worker gets ``TORCHELASTIC_USE_AGENT_STORE=True``, so ``env://`` rendezvous (ours,
   and ``init_process_group()`` called by the user, Lightning, Accelerate or DeepSpeed) makes
   every rank a client of that store, rank 0 included, as under torchrun.

A rank that connects before the server runs is accepted by the kernel and waits in the backlog,
so no rank ever backs off. Each attempt gets a fresh socket and store (``env://`` adds no
per-attempt prefix with an agent store; a socket whose backlog may hold the connections of an
abandoned attempt's ranks is never reused). The store lives in rank 0's process and ends with
it: the agent never runs a thread or imports torch for it, and a function that never joins a
process group costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

from torchrunx.worker.hooks import after_import

logger = logging.getLogger("torchrunx.agentstore")

_servers: list[Any] = []
"""The store served by this process (rank 0), kept alive as long as the process."""


def listen_address(*, local_only: bool) -> str:
    """Where the store listens: loopback, or every interface (``""``).

    Loopback when every host of the launch is the launcher's machine
    (``AgentBootstrap.local_only``: every rank is local then); else every interface, since the
    other hosts' ranks reach it at an address only they know.
    """
    return "127.0.0.1" if local_only else ""


def free_port() -> int:
    """A port free now on every interface (a host other than 0 offers it for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A socket listening on ``port`` (0: a free one) of ``host`` (``""``: every interface)."""
    if host == "" and socket.has_dualstack_ipv6():
        return socket.create_server(
            ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=socket.SOMAXCONN
        )
    return socket.create_server((host or "0.0.0.0", port), backlog=socket.SOMAXCONN)  # noqa: S104


class StoreSocket:
    """Host 0's agent side: the next attempt's listening socket (owned by the agent)."""

    def __init__(self, host: str, port: int = 0) -> None:
        """Open the first attempt's socket (on ``host``; ``""``: every interface).

        ``port``: the port to listen on (0: a free one). A spare host's agent that takes host
        0's place opens its store on the port it last reported free.
        """
        self.host = host
        self.sock: socket.socket | None = listening_socket(host, port)
        self.port = int(self.sock.getsockname()[1])

    def handed_over(self) -> None:
        """The workers were forked (rank 0 holds the socket now): close the agent's copy."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def renew(self) -> int:
        """Open the next attempt's socket (the last one is never reused); its port."""
        self.close()
        self.sock = listening_socket(self.host)
        self.port = int(self.sock.getsockname()[1])
        return self.port

    def close(self) -> None:
        """Close the agent's copy of the socket; idempotent."""
        self.handed_over()


def serve_when_torch_imported(fd: int, port: int, timeout: float) -> None:
    """In rank 0: serve the inherited listening socket ``fd`` with a ``TCPStore``.

    At once if torch is imported, else right after the function's own ``import torch``
    (an import hook that removes itself). ``timeout``: the process group's, in seconds.
    """
    after_import("torch", lambda: _serve(fd, port, timeout))


def _serve(fd: int, port: int, timeout: float) -> None:
    """A ``TCPStore`` server on the listening socket ``fd`` (which it owns from now on)."""
    try:
        import datetime as dt  # noqa: PLC0415 (torch imported it already; the agent needs none)

        import torch.distributed as dist  # noqa: PLC0415 (imported by now; never loads torch)

        if not dist.is_available():  # a build without distributed: nothing to serve
            raise ImportError("torch.distributed is not available in this build")  # noqa: TRY301
        _servers.append(
            dist.TCPStore(  # type: ignore[attr-defined]  # torch's stubs do not export it
                "127.0.0.1",  # its own client's address: the socket listens there too
                port,
                None,
                True,  # noqa: FBT003 (torch's positional is_master)
                dt.timedelta(seconds=timeout),
                wait_for_workers=False,
                master_listen_fd=fd,
            )
        )
    except Exception:
        # Nothing serves it: closed, it refuses the ranks at once instead of a long wait.
        logger.exception("cannot serve the rendezvous store on port %d", port)
        with contextlib.suppress(OSError):
            socket.socket(fileno=fd).close()
