"""The launch's I/O: its one loop and its connections.

:mod:`~torchrunx.launcher.net.ioloop` is the one epoll loop, which the caller's thread turns
(every connection, every local agent's pidfd and output pipes, a wake-up pipe);
:mod:`~torchrunx.launcher.net.listener` the listening socket: accepting, the non-blocking
handshake, frames in, buffered frames out; :mod:`~torchrunx.launcher.net.channels` a worker's
channel as the launcher holds it, carried by its agent's connection.

It imports :mod:`torchrunx.wire` and nothing of the launcher: what arrives is handed on as
events, which the launch (:mod:`torchrunx.launcher.launch`) applies.
"""
