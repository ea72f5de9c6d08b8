"""``breakpoint()`` in a worker: pdb with its input and output on the worker's channel.

A worker installs :func:`install` as ``sys.breakpointhook`` (and as ``pdb.set_trace``). When
the function calls ``breakpoint()`` (or ``pdb.set_trace()``), a :class:`RankPdb` stops in the
caller's frame: everything pdb writes goes to
the launcher as :class:`~torchrunx.wire.messages.DebugOutput`, and each prompt waits for the
line the user types in the launcher's terminal (:class:`~torchrunx.wire.messages.DebugInput`).
The launcher's side is :mod:`torchrunx.launcher.view.debugger`.

Without a terminal at the launcher (its stdin is not a TTY: a batch job, a notebook, a pipe) a
breakpoint is skipped with a warning on the worker's stderr naming the rank and the line; the
function goes on. ``PYTHONBREAKPOINT`` is honoured as Python does: ``0`` disables breakpoints,
another hook (``ipdb.set_trace``, ...) is called instead of ours.
"""

from __future__ import annotations

import bdb
import contextlib
import io
import os
import pdb  # noqa: T100 (the debugger is the feature)
import selectors
import socket
import sys
import threading
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, cast

from torchrunx import timer
from torchrunx.errors import ProtocolError
from torchrunx.peercred import held_by, loopback_peer
from torchrunx.wire.messages import DebugInput, DebugOutput, DebugpyListening
from torchrunx.worker.hooks import after_import

if TYPE_CHECKING:
    from types import FrameType

    from torchrunx.wire.channel import ChannelConnection


class _Output(io.TextIOBase):
    """pdb's stdout: text collected until the next prompt (or the end of the interaction)."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def writable(self) -> bool:
        """Always."""
        return True

    def write(self, text: str) -> int:
        """Keep ``text`` for the next :class:`DebugOutput`."""
        self._parts.append(text)
        return len(text)

    def take(self) -> str:
        """Everything written since the last take."""
        text = "".join(self._parts)
        self._parts.clear()
        return text


class _Input(io.TextIOBase):
    """pdb's stdin: each line is asked of the launcher."""

    def __init__(self, session: _Session) -> None:
        self._session = session

    def readable(self) -> bool:
        """Always."""
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]  # noqa: ARG002
        """Send what pdb wrote (ending with its prompt) and wait for the typed line."""
        return self._session.ask()


class _Session:
    """One worker's channel to the launcher's terminal (one debugger at a time)."""

    def __init__(self, conn: ChannelConnection, rank: int) -> None:
        self.conn = conn
        self.rank = rank
        self.output = _Output()
        self.lock = threading.Lock()
        self.where = ""
        self.detached = False
        """The launcher said it has no terminal (any more): continue, do not ask again."""

    def ask(self) -> str:
        if self.detached:
            return "c\n"
        self.conn.send(DebugOutput(self.rank, self.output.take(), waiting=True, where=self.where))
        while True:
            try:
                message, _payload = self.conn.recv()
            except (OSError, ProtocolError):
                self.detached = True  # the launcher is gone: nothing will answer
                return "c\n"
            if isinstance(message, DebugInput):
                if message.line is None:
                    self.detached = True
                    return "c\n"
                return message.line.rstrip("\r\n") + "\n"

    def ended(self, *, resumed: bool) -> None:
        text = self.output.take()
        if text or resumed:
            self.conn.send(
                DebugOutput(self.rank, text, waiting=False, where=self.where, resumed=resumed)
            )


class RankPdb(pdb.Pdb):
    """pdb for one rank, speaking through the launcher's terminal."""

    def __init__(self, session: _Session, hostname: str) -> None:
        """A debugger on ``session``'s channel; the prompt names the rank and host."""
        super().__init__(
            stdin=cast("IO[str]", _Input(session)),
            stdout=cast("IO[str]", session.output),
            nosigint=True,
            readrc=False,
        )
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {session.rank} on {hostname}) "
        self._session = session
        self._resumed = False

    def interaction(self, frame: FrameType | None, tb: Any) -> None:  # noqa: ANN401 (pdb's)
        """One stop: the whole exchange holds the session, then says whether the rank resumed."""
        session = self._session
        with session.lock:
            where, lineno, last = frame, None if frame is None else frame.f_lineno, tb
            while where is None and last is not None:  # post-mortem: the frame that raised
                if last.tb_next is None:
                    where, lineno = last.tb_frame, last.tb_lineno
                last = last.tb_next
            if where is not None:
                code = where.f_code
                session.where = f"{code.co_filename}:{lineno} in {code.co_name}"
            self._resumed = False
            paused = timer.pause()  # a timer.expires block's limit does not count meanwhile
            try:
                super().interaction(frame, tb)
            finally:
                timer.resume(paused)
                session.ended(resumed=self._resumed)

    def set_continue(self) -> None:
        """``c``: the rank runs on (the launcher may turn to another rank)."""
        self._resumed = True
        super().set_continue()

    def set_quit(self) -> None:
        """``q``: the rank raises ``BdbQuit`` (its run fails, as with pdb anywhere)."""
        self._resumed = True
        super().set_quit()


@dataclass
class _Installed:
    """This worker's debugging set-up (:func:`install`)."""

    session: _Session
    hostname: str
    terminal: bool
    ide_attached: bool = False


_installed: _Installed | None = None


def install(conn: ChannelConnection, rank: int, hostname: str, *, terminal: bool) -> None:
    """Make ``breakpoint()`` and ``torch.distributed.breakpoint()`` open pdb at the launcher.

    ``terminal``: the launcher has one (:attr:`~torchrunx.wire.messages.WorkerSpec.debugger`);
    without one, breakpoints are skipped with a warning. ``torch.distributed.breakpoint`` makes
    its debugger with ``torch.distributed._make_distributed_pdb`` (which reads ``/dev/stdin``):
    once torch is imported, that function makes ours instead.
    """
    global _installed  # noqa: PLW0603 (one set-up per worker process)
    _installed = _Installed(_Session(conn, rank), hostname, terminal)
    sys.breakpointhook = _breakpointhook
    pdb.set_trace = _set_trace  # import pdb; pdb.set_trace(), as common as breakpoint()
    after_import("torch", _use_in_torch)


def _ours() -> _Installed:
    assert _installed is not None  # noqa: S101 (the hooks exist only once installed)
    return _installed


def _new_pdb() -> RankPdb:
    return RankPdb(_ours().session, _ours().hostname)


def _use_in_torch() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and callable(getattr(dist, "_make_distributed_pdb", None)):
        setattr(dist, "_make_distributed_pdb", _make_pdb)  # noqa: B010 (torch's private name)


def _make_pdb() -> pdb.Pdb:
    """The debugger for ``torch.distributed.breakpoint()``: ours, or one that skips."""
    return _new_pdb() if _ours().terminal else _SkippingPdb()


class _SkippingPdb(pdb.Pdb):
    """No terminal at the launcher: ``set_trace`` says so and the rank goes on."""

    def message(self, msg: str) -> None:
        """Nothing to show it in."""
        del msg

    def set_trace(self, frame: FrameType | None = None) -> None:
        """Report the skipped breakpoint at the caller of ``torch.distributed.breakpoint``."""
        _skip(frame or sys._getframe(2))  # noqa: SLF001 (torch's breakpoint, then its caller)


def _breakpointhook(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 (breakpoint()'s)
    chosen = os.environ.get("PYTHONBREAKPOINT", "")
    if chosen == "0":
        return None
    if chosen not in ("", "pdb.set_trace"):  # the user's own hook, as Python would call it
        return sys.__breakpointhook__(*args, **kwargs)  # noqa: T100
    _stop_at(sys._getframe(1))  # noqa: SLF001 (the caller of breakpoint())
    return None


def _set_trace(*, header: str | None = None, **_: Any) -> None:  # noqa: ANN401
    """``pdb.set_trace()`` in a worker: as ``breakpoint()`` (``header`` shown first)."""
    _stop_at(sys._getframe(1), header)  # noqa: SLF001 (the caller of pdb.set_trace())


def _stop_at(frame: FrameType, header: str | None = None) -> None:
    """Stop in ``frame`` in the launcher's terminal, or say why not and go on."""
    if not _ours().terminal:
        _skip(frame)
        return
    debugger = _new_pdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(frame)


def skipped_text(where: str, rank: int) -> str:
    """What the launcher's stderr says of a breakpoint skipped at ``where`` (``file:line``)."""
    return (
        f"torchrunx: breakpoint() at {where} in rank {rank} skipped: the launcher has no "
        "terminal (its stdin is not a TTY), so there is nowhere to debug it; run the launcher "
        "in a terminal to debug there, or set PYTHONBREAKPOINT=0 to skip breakpoints without a "
        "word\n"
    )


def _skip(frame: FrameType) -> None:
    """Report a breakpoint skipped for want of a terminal, on the launcher's stderr."""
    session = _ours().session
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    warning = skipped_text(where, session.rank)
    skipped = DebugOutput(session.rank, warning, waiting=False, where=where, resumed=True)
    try:  # the launcher prints it on its stderr, whichever rank this is
        session.conn.send(skipped)
    except OSError:
        sys.stderr.write(warning)


def post_mortem(exc: BaseException) -> None:
    """Pdb at the frame that raised ``exc``, in the launcher's terminal (then return)."""
    if not _ours().terminal or exc.__traceback__ is None:
        return
    debugger = _new_pdb()
    debugger.reset()
    session = _ours().session
    session.output.write(
        f"torchrunx: rank {session.rank} raised {type(exc).__name__}: {exc}; post-mortem "
        "(c or q lets its exception go to the launcher)\n"
    )
    with contextlib.suppress(bdb.BdbQuit):
        debugger.interaction(None, exc.__traceback__)


def wait_for_ide(chosen: tuple[int, int] | None) -> None:
    """If ``TORCHRUNX_DEBUGPY`` chose this rank: wait for an IDE's debugger, then return.

    Once per worker process (a worker that stays runs later calls attached already). Nothing
    listens that another user of the host could use: an :class:`IdeGate` listens on this
    host's ``127.0.0.1:PORT`` and carries one connection of this user's (an IDE, or the
    launcher's SSH forward) to debugpy, which connects to the gate from this process; any other
    connection is closed unread. The launcher makes the port reachable.

    Raises:
        ModuleNotFoundError: debugpy is not installed on this host (said how to install it).
        RuntimeError: The port cannot be listened on here (in use: by whom is not told).
    """
    session = _ours().session
    if chosen is None or chosen[0] != session.rank or _ours().ide_attached:
        return
    rank, port = chosen
    try:
        import debugpy  # noqa: PLC0415, T100 (only in the chosen rank)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"TORCHRUNX_DEBUGPY chose rank {rank}, but debugpy is not installed on "
            f"{socket.gethostname()}: pip install debugpy in that host's environment"
        ) from exc
    try:
        gate = IdeGate(port)
    except OSError as exc:
        raise RuntimeError(
            f"TORCHRUNX_DEBUGPY: rank {rank} cannot listen on 127.0.0.1:{port} on "
            f"{socket.gethostname()} ({exc}): choose another port with "
            f"TORCHRUNX_DEBUGPY={rank}:PORT"
        ) from exc
    session.conn.send(DebugpyListening(rank, port))
    debugpy.connect(("127.0.0.1", port))  # returns once the IDE has spoken
    debugpy.wait_for_client()  # noqa: T100
    gate.stop_listening()
    _ours().ide_attached = True


class IdeGate:
    """``127.0.0.1:port`` for one IDE of this user, carried to this process's debugpy.

    debugpy speaks the IDE's protocol (DAP) itself, whichever end connected: the gate accepts
    debugpy's own connection (a socket this process holds) and the first connection whose
    socket belongs to this process's user (:mod:`torchrunx.peercred`), and copies bytes
    between them on a thread of its own until either end closes. Connections of other users
    are closed at once, unread: the port's owner cannot be impersonated, and debugpy (which
    does not authenticate its client) is never reachable by them.
    """

    def __init__(self, port: int) -> None:
        """Listen on ``127.0.0.1:port`` and start the gate's thread.

        Raises:
            OSError: The port cannot be listened on.
        """
        self._server = socket.create_server(("127.0.0.1", port))
        self.refused = 0
        """Connections closed unread (another user's, or a second IDE's)."""
        threading.Thread(target=self._serve, name="torchrunx-ide-gate", daemon=True).start()

    def _serve(self) -> None:
        """Accept until debugpy and one IDE are in, then carry bytes between them."""
        debuggee: socket.socket | None = None
        ide: socket.socket | None = None
        while debuggee is None or ide is None:
            try:
                conn, _ = self._server.accept()
            except OSError:  # stop_listening: the worker no longer waits for an IDE
                for end in (debuggee, ide):
                    if end is not None:
                        end.close()
                return
            peer = loopback_peer(conn)
            if peer is not None and debuggee is None and held_by(peer.inode):
                debuggee = conn
            elif peer is not None and ide is None and peer.uid == os.geteuid():
                ide = conn
            else:
                self.refused += 1
                conn.close()
        _carry(debuggee, ide)

    def stop_listening(self) -> None:
        """No more connections: the port is free (connections carried so far go on)."""
        self._server.close()


def _carry(one: socket.socket, other: socket.socket) -> None:
    """Copy bytes both ways until either end closes, then close both."""
    with selectors.DefaultSelector() as selector, one, other:
        selector.register(one, selectors.EVENT_READ, other)
        selector.register(other, selectors.EVENT_READ, one)
        while True:
            for key, _ in selector.select():
                source = cast("socket.socket", key.fileobj)
                try:
                    data = source.recv(65536)
                    if data:
                        cast("socket.socket", key.data).sendall(data)
                        continue
                except OSError:
                    pass
                return
