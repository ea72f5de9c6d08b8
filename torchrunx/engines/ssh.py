"""Starting an agent on a remote host: one SSH connection (paramiko) that runs the agent command.

The command and the script it reads from stdin are those of every agent
(:mod:`torchrunx.engines.command`); ``~/.ssh/config`` (or ``ssh_config_file``) says where and
how each host is reached (:func:`resolve_ssh_target`), ProxyJump and ProxyCommand included.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrunx.engines.command import (
    READS_PER_CALL,
    AgentOutput,
    PipeReaders,
    agent_exit_error,
    drain,
    remote_command,
    write_all,
)
from torchrunx.engines.forward import PortForward
from torchrunx.engines.relay import Adopt, LauncherRelay
from torchrunx.errors import AgentFailedError, ShipError
from torchrunx.wire.relay import MAX_DATA

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import paramiko
    from paramiko import Channel

    from torchrunx.engines.protocol import OnLine, Reader
    from torchrunx.engines.ship import Bundle


@dataclass(frozen=True)
class SshTarget:
    """Where and how to reach a host, resolved from the SSH config (pure data)."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identities_only: bool
    known_hosts_files: tuple[str, ...]
    strict_host_key_checking: str
    connect_timeout: float
    proxy_jump: str | None
    proxy_command: str | None


def _default_ssh_config() -> Path | None:
    path = Path("~/.ssh/config").expanduser()
    return path if path.is_file() else None


def read_ssh_config(path: Path | None) -> paramiko.SSHConfig:
    """Parse an SSH config file (an empty config for ``None``); the caller must not change it.

    A file is parsed once while it stays the same (its inode, size, modification and change
    times): a launch looks up each host it starts in the same file (a tree's interior hosts,
    at once from the start threads), and a parse of a long file costs milliseconds. A changed
    file is read again.

    Raises:
        ValueError: The file cannot be read or parsed.
    """
    import paramiko  # noqa: PLC0415 (paramiko is only needed for remote hosts)

    if path is None:
        return paramiko.SSHConfig()
    try:
        info = path.stat()
        version = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        return _parsed_config(str(path), version)
    except (OSError, UnicodeDecodeError, paramiko.ConfigParseError) as exc:
        raise ValueError(f"cannot read SSH config file {str(path)!r}: {exc}") from exc


@functools.lru_cache(maxsize=16)
def _parsed_config(path: str, version: tuple[int, ...]) -> paramiko.SSHConfig:
    """``path`` parsed (``version``: the file as it was seen, so a changed file is a new key)."""
    import paramiko  # noqa: PLC0415

    del version  # the cache's key only
    return paramiko.SSHConfig.from_path(path)


def resolve_ssh_target(
    alias: str, config_file: str | Path | None, connect_timeout: float
) -> SshTarget:
    """Read ``~/.ssh/config`` (or ``config_file``) for ``alias``.

    Honours HostName, User, Port, IdentityFile, IdentitiesOnly, UserKnownHostsFile,
    StrictHostKeyChecking, ConnectTimeout, ProxyJump and ProxyCommand.

    Raises:
        ValueError: The config file cannot be read or parsed.
    """
    path = Path(config_file).expanduser() if config_file is not None else _default_ssh_config()
    options = read_ssh_config(path).lookup(alias)
    known_hosts = ["~/.ssh/known_hosts"]
    if "userknownhostsfile" in options:
        known_hosts = str(options["userknownhostsfile"]).split()
    proxy_jump = options.get("proxyjump")
    return SshTarget(
        alias=alias,
        hostname=str(options.get("hostname", alias)),
        port=int(options.get("port", 22)),
        user=str(options.get("user", getpass.getuser())),
        identity_files=tuple(str(Path(p).expanduser()) for p in options.get("identityfile", [])),
        identities_only=str(options.get("identitiesonly", "no")).lower() == "yes",
        known_hosts_files=tuple(str(Path(p).expanduser()) for p in known_hosts),
        strict_host_key_checking=str(options.get("stricthostkeychecking", "ask")).lower(),
        connect_timeout=float(options.get("connecttimeout", connect_timeout)),
        proxy_jump=None if proxy_jump in (None, "none") else str(proxy_jump),
        proxy_command=options.get("proxycommand"),
    )


def _host_key_policy(strict: str) -> paramiko.MissingHostKeyPolicy:
    import paramiko  # noqa: PLC0415

    if strict in {"no", "off", "accept-new"}:
        # Accepted in memory only: torchrunx never writes the user's known_hosts file.
        return paramiko.AutoAddPolicy()
    return paramiko.RejectPolicy()


def ssh_connect(
    target: SshTarget, config_file: str | Path | None, *, depth: int = 0
) -> list[paramiko.SSHClient]:
    """Open an authenticated SSH connection; returns the chain of clients, the target last.

    ProxyJump hosts come first in the list (each resolved from the same config).

    Raises:
        AgentFailedError: The host is unreachable, its key is unknown, or authentication failed.
    """
    import paramiko  # noqa: PLC0415

    chain: list[paramiko.SSHClient] = []
    sock: Any = None
    if target.proxy_jump is not None and depth < 8:
        try:
            jump_target = last_jump(target.proxy_jump, config_file, target.connect_timeout)
        except ValueError as exc:
            raise AgentFailedError(target.alias, f"ProxyJump {target.proxy_jump!r}: {exc}") from exc
        chain = ssh_connect(jump_target, config_file, depth=depth + 1)
        transport = chain[-1].get_transport()
        assert transport is not None  # noqa: S101 (connected just above)
        sock = transport.open_channel(
            "direct-tcpip",
            (target.hostname, target.port),
            ("127.0.0.1", 0),
            timeout=target.connect_timeout,
        )
    elif target.proxy_command is not None:
        sock = paramiko.ProxyCommand(target.proxy_command)
    client = paramiko.SSHClient()
    for known_hosts in target.known_hosts_files:
        if Path(known_hosts).is_file():
            client.get_host_keys().load(known_hosts)
    client.set_missing_host_key_policy(_host_key_policy(target.strict_host_key_checking))
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=list(target.identity_files) or None,
            look_for_keys=not target.identities_only,
            allow_agent=not target.identities_only,
            timeout=target.connect_timeout,
            banner_timeout=target.connect_timeout,
            auth_timeout=target.connect_timeout,
            channel_timeout=target.connect_timeout,
            sock=sock,
        )
    except (paramiko.SSHException, OSError, EOFError, UnicodeError) as exc:
        # UnicodeError: socket's IDNA encoding refused the name ("a..b", a label over 63).
        _close_all([client, *chain])
        # A name that does not resolve says all in its message: no socket traceback below it.
        unresolved = isinstance(exc, socket.gaierror | UnicodeError)
        raise _ssh_error(target, exc) from (None if unresolved else exc)
    return [*chain, client]


def _ssh_error(target: SshTarget, exc: BaseException) -> AgentFailedError:
    """Translate a paramiko/socket error into an AgentFailedError that says what to do."""
    import paramiko  # noqa: PLC0415

    where = f"{target.user}@{target.hostname}:{target.port}"
    if isinstance(exc, paramiko.AuthenticationException):
        reason = (
            f"SSH authentication failed for {where}: {exc}; check IdentityFile/User in your "
            "SSH config, or that your key is in the host's authorized_keys"
        )
    elif isinstance(exc, paramiko.BadHostKeyException):
        reason = f"host key of {where} does not match known_hosts: {exc}"
    elif isinstance(exc, paramiko.SSHException):
        hint = ""
        if "known_hosts" in str(exc):
            hint = (
                "; connect once with `ssh` to record its key, or set "
                "StrictHostKeyChecking accept-new for this host in your SSH config"
            )
        reason = f"SSH to {where} failed: {exc}{hint}"
    elif isinstance(exc, socket.gaierror | UnicodeError):
        mapped = "" if target.alias == target.hostname else f" (HostName of {target.alias!r})"
        reason = (
            f"the host name {target.hostname!r}{mapped} does not resolve ("
            f"{getattr(exc, 'strerror', None) or exc}): check its spelling, or give its address "
            "with a Host entry and HostName in your SSH config"
        )
    elif isinstance(exc, ConnectionRefusedError):
        reason = f"cannot connect to {where}: refused; does sshd run there, on port {target.port}?"
    elif isinstance(exc, TimeoutError):
        reason = (
            f"cannot connect to {where}: no answer in {target.connect_timeout:g} s "
            "(ConnectTimeout); is the host up and reachable?"
        )
    else:
        what = str(exc) or type(exc).__name__
        reason = f"cannot connect to {where} ({what}); is the host up and reachable?"
    return AgentFailedError(target.alias, reason)


def parse_jump(hop: str) -> tuple[str, str, int | None]:
    """``[user@]host[:port]`` (an IPv6 host in brackets) as ``(user, host, port)``.

    Raises:
        ValueError: The port is not a number from 1 to 65535, or the host is empty.
    """
    user, _, rest = hop.strip().rpartition("@")
    port: str | None = None
    if rest.startswith("["):  # [v6]:port or [v6]
        host, _, tail = rest[1:].partition("]")
        port = tail.removeprefix(":") or None
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:  # a bare name, or an IPv6 address without brackets (no port then)
        host = rest
    if not host:
        raise ValueError(f"ProxyJump hop {hop!r} names no host")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"ProxyJump hop {hop!r}: {port!r} is not a port")
    return user, host, None if port is None else int(port)


def last_jump(proxy_jump: str, config_file: str | Path | None, timeout: float) -> SshTarget:
    """The hop a ``ProxyJump`` list reaches its host through: the last one, as OpenSSH does.

    ``ProxyJump a,b,c``: hops are visited in order, so the host is reached through ``c``, which
    is reached through ``b`` (``ProxyJump a,b`` for ``c``, whatever ``c``'s own entry says), and
    so on; the first hop uses its own entry's ProxyJump, if any. Each hop is resolved from the
    same SSH config, then given the user and port written in the list.

    Raises:
        ValueError: A hop is malformed, or the SSH config cannot be read.
    """
    *before, last = [hop for hop in proxy_jump.split(",") if hop.strip()] or [""]
    user, host, port = parse_jump(last)
    target = resolve_ssh_target(host, config_file, timeout)
    fields = dict(target.__dict__)
    if user:
        fields["user"] = user
    if port is not None:
        fields["port"] = port
    if before:
        fields["proxy_jump"] = ",".join(before)
    return SshTarget(**fields)


def _close_all(clients: list[paramiko.SSHClient]) -> None:
    for client in reversed(clients):
        with contextlib.suppress(Exception):
            client.close()


class SshAgent(PipeReaders):
    """An agent on a remote host, started with paramiko over one SSH connection.

    Its output is read from the channel by the launch's loop; when the host relays, threads
    read it instead (the relay's frames on stdout, stderr into a pipe) and the loop reads pipes.
    """

    def __init__(  # noqa: PLR0913, PLR0917 (what a remote start needs)
        self,
        hostname: str,
        script: bytes,
        bootstrap_for: Callable[[str], bytes],
        config_file: str | Path | None,
        connect_timeout: float,
        on_line: OnLine,
        relay: Adopt | None = None,
        ship: Bundle | None = None,
        container: Sequence[str] = (),
    ) -> None:
        """Connect, start the agent command and hand it its script and bootstrap on stdin.

        ``bootstrap_for`` builds the bootstrap line from the launcher address that this
        connection's local end has (the address the host can reach the launcher on).
        ``relay``: the host relays (:mod:`torchrunx.engines.relay`); its channels go to it.
        ``ship``: the code shipped to the host, exchanged between the script and the bootstrap.
        ``container``: the command that runs the agent in a container there (an argv prefix).

        Raises:
            AgentFailedError: SSH failed, the command could not be started, or the code not
                shipped.
        """
        import paramiko  # noqa: PLC0415

        self.hostname = hostname
        self._output = AgentOutput(on_line)
        target = resolve_ssh_target(hostname, config_file, connect_timeout)
        connect_started = time.monotonic()
        self._clients = ssh_connect(target, config_file)
        self.connect_seconds = time.monotonic() - connect_started
        """How long the SSH connection (and authentication) took."""
        transport = self._clients[-1].get_transport()
        assert transport is not None  # noqa: S101 (connected)
        shipping = False
        # Every step below has a limit of its own, but a write on a cut link blocks in
        # paramiko's socket loop: past the whole start's limit the connection is closed.
        self._start_limit = ship.timeout if ship is not None else connect_timeout
        self._start_aborted = False
        watchdog = threading.Timer(self._start_limit, self._abort_start)
        watchdog.daemon = True
        watchdog.start()
        try:
            self._channel = transport.open_session(timeout=connect_timeout)
            self._channel.exec_command(remote_command(container))
            self._channel_fd = self._channel.fileno()  # readable when output or the end comes
            self._channel.settimeout(connect_timeout)  # a link cut now: no wait without end
            self._channel.sendall(script)
            shipping = ship is not None
            leftover = b"" if ship is None else ship.exchange(hostname, self._recv, self._send)
            shipping = False
            self._channel.settimeout(connect_timeout)
            self._channel.sendall(bootstrap_for(self._local_address(transport)))
            self._channel.settimeout(None)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._start_failed(exc, shipping=shipping) from exc
        except ShipError as exc:
            tail = self._channel_stderr()
            _close_all(self._clients)
            reason = f"the shipped code did not reach the host: {exc}"
            raise AgentFailedError(hostname, reason, tail) from exc
        finally:
            watchdog.cancel()
        if ship is not None and relay is None and leftover:
            self._output.feed(leftover, is_stderr=False)
        self._relay = None
        if relay is not None:
            channel = self._channel
            self._relay = LauncherRelay(
                hostname,
                read_out=lambda: channel.recv(MAX_DATA),
                write_in=channel.sendall,
                close_in=channel.shutdown_write,
                adopt=relay,
                initial=leftover,
            )
            err_read, err_write = os.pipe()
            os.set_blocking(err_read, False)
            self._streams = {False: self._relay.out_read, True: err_read}
            threading.Thread(
                target=_pump_stderr,
                args=(channel, err_write),
                daemon=True,
                name=f"torchrunx-relay-err-{hostname}",
            ).start()

    def _recv(self, timeout: float) -> bytes | None:
        """The channel's stdout, waiting up to ``timeout`` s (None: nothing yet)."""
        self._channel.settimeout(max(timeout, 0.001))
        try:
            return bytes(self._channel.recv(65536))
        except TimeoutError:
            return None

    def _send(self, data: bytes, timeout: float) -> None:
        """Send all of ``data``; TimeoutError if the channel takes none for ``timeout`` s."""
        self._channel.settimeout(max(timeout, 0.001))
        self._channel.sendall(data)

    def _abort_start(self) -> None:
        self._start_aborted = True
        _close_all(self._clients)

    def _start_failed(self, exc: BaseException, *, shipping: bool) -> AgentFailedError:
        """The error of a start whose channel failed; the connection is closed."""
        if self._start_aborted:
            doing = "shipping the code" if shipping else "handing the agent its script"
            reason = (
                f"the start took longer than {self._start_limit:g} s ({doing} over the SSH "
                "connection, which took nothing more): is the link to the host cut?"
            )
            return AgentFailedError(self.hostname, reason)
        ended = self._ended_early()
        _close_all(self._clients)
        if ended is None:
            return AgentFailedError(self.hostname, f"cannot start the agent over SSH: {exc}")
        status, tail = ended
        if shipping:  # killed while it unpacked, say
            reason = f"the shipped code did not reach the host: it ended (exit status {status})"
            return AgentFailedError(self.hostname, reason, tail)
        # The command ended before it read all it was sent (a missing interpreter).
        return agent_exit_error(
            self.hostname, status, remote=True, connected=False, env_file=None, stderr_tail=tail
        )

    def _ended_early(self) -> tuple[int, str] | None:
        """The exit status and stderr of a command that ended while it was being started.

        A command that fails at once (a missing interpreter, a container that is not there)
        closes the channel while its script is still being sent: what it said explains the
        failure, the closed channel does not. ``None`` if it has not ended (within a second).
        """
        channel = getattr(self, "_channel", None)
        if channel is None:
            return None
        deadline = time.monotonic() + 1.0
        while not channel.exit_status_ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not channel.exit_status_ready():
            return None
        return channel.recv_exit_status(), self._channel_stderr()

    def _channel_stderr(self) -> str:
        """What the command wrote to stderr so far (it has ended, or is ending)."""
        self._channel.settimeout(0.5)
        data = b""
        with contextlib.suppress(OSError, TimeoutError):
            while chunk := self._channel.recv_stderr(65536):
                data += chunk
        return data.decode(errors="replace").strip()

    def _local_address(self, transport: paramiko.Transport) -> str:
        import paramiko  # noqa: PLC0415

        sock = transport.sock
        if isinstance(sock, paramiko.Channel) or not hasattr(sock, "getsockname"):
            # Through a proxy: the first hop's local address is our best guess.
            first = self._clients[0].get_transport()
            sock = first.sock if first is not None else sock
        with contextlib.suppress(OSError, AttributeError, TypeError):
            address = str(sock.getsockname()[0])
            return address.removeprefix("::ffff:")
        return "127.0.0.1"

    def forward(self, port: int, remote_port: int) -> PortForward:
        """This machine's ``127.0.0.1:port`` carried to the host's ``127.0.0.1:remote_port``.

        Raises:
            OSError: ``port`` cannot be listened on here.
        """
        transport = self._clients[-1].get_transport()
        assert transport is not None  # noqa: S101 (connected while the agent runs)

        def open_channel(destination: tuple[str, int], origin: tuple[str, int]) -> Channel:
            return transport.open_channel("direct-tcpip", destination, origin)

        return PortForward(open_channel, port, remote_port)

    @property
    def exit_fd(self) -> int:
        """None: the channel's exit status is polled (:meth:`wait` with ``0``)."""
        return -1

    def readers(self) -> list[Reader]:
        """The channel (one descriptor for both streams), until both have ended.

        When relaying: the pipes the relay's threads write instead.
        """
        if self._relay is not None:
            return super().readers()
        return [] if self._output.done else [(self._channel_fd, self._read_channel)]

    def _read_channel(self) -> bool:
        channel = self._channel
        for _ in range(READS_PER_CALL):
            if channel.recv_ready():
                self._output.feed(channel.recv(65536), is_stderr=False)
            elif channel.recv_stderr_ready():
                self._output.feed(channel.recv_stderr(65536), is_stderr=True)
            elif channel.eof_received or channel.closed:
                self._output.feed(b"", is_stderr=False)
                self._output.feed(b"", is_stderr=True)
                return False
            else:
                return True
        return True

    def wait(self, timeout: float | None) -> int | None:
        """Wait for the remote command to end; its exit status, or ``None`` if still running."""
        if not self._channel.status_event.wait(timeout):
            return None
        return int(self._channel.recv_exit_status())

    def close(self, grace: float = 5.0) -> None:
        """Close the channel (the agent sees EOF on stdin and stops) and the SSH connection.

        A lost agent (``grace=0``) is not waited for: cut off from the launcher, it stops its
        workers by itself once ``agent_timeout`` passes without a heartbeat.
        """
        if self._relay is not None:
            self._relay.stop()
        with contextlib.suppress(Exception):
            self._channel.shutdown_write()
        if grace > 0:
            self.wait(grace)
        drain(self.readers(), 2.0 if grace > 0 else 0.2)
        with contextlib.suppress(Exception):
            self._channel.close()
        _close_all(self._clients)
        if self._relay is not None:  # the channel is closed: its reading threads end
            self._relay.join(2.0)
            drain(self.readers(), 0.2)
            self._relay.close_output()
            with contextlib.suppress(OSError):
                os.close(self._streams[True])


def _pump_stderr(channel: Channel, fd: int) -> None:
    """Copy ``channel``'s stderr to ``fd`` (a pipe the loop reads) until it ends; close ``fd``."""
    try:
        while data := channel.recv_stderr(65536):
            write_all(fd, data)
    except OSError:
        pass  # the loop closed its end: the agent is closed
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
