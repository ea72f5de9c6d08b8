"""The launch secret is in no repr, no traceback's frame locals and no global of an agent.

A traceback formatted with its frames' locals (``capture_locals=True``, as some error reporters
and loggers do) shows the repr of every local of every frame: the secret must not be there,
neither in the launcher (a failed start) nor in a worker, whose stack holds the agent's frames
below the user's function.
"""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING

import pytest

import torchrunx as trx
from torchrunx.engines import command
from torchrunx.errors import AgentFailedError
from torchrunx.launcher.settings.plan import agent_timings
from torchrunx.launcher.starts.agent_starts import AgentStarts
from torchrunx.wire import handshake
from torchrunx.wire.bootstrap import AgentBootstrap

if TYPE_CHECKING:
    import subprocess

SECRET = bytes.fromhex("5ec2e7" * 10 + "00ff")


def forms(secret: bytes) -> list[str]:
    """How the secret could show in text: hex (as in the bootstrap line) and as a bytes repr."""
    return [secret.hex(), repr(secret)[2:-1], secret.hex().upper()]


def assert_no_secret(text: str, secret: bytes = SECRET) -> None:
    for form in forms(secret):
        assert form not in text, f"the secret is in:\n{text}"


@pytest.fixture
def known_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch of this test uses :data:`SECRET` (not a local of the test: its frame is in
    the tracebacks looked at)."""
    monkeypatch.setattr(handshake, "new_secret", lambda: SECRET)


def test_reprs_hold_no_secret():
    boot = AgentBootstrap(
        host_index=0,
        hostname="h",
        launcher_address="127.0.0.1",
        launcher_port=1,
        secret=SECRET,
        workers=1,
        preload_torch=False,
        timings=agent_timings(5.0),
        log_level=20,
        sys_path=(),
    )
    assert_no_secret(repr(boot))
    environ = {"PATH": "/bin", "TOKEN": SECRET.hex(), "TORCHRUNX_HEALTH_CHECK_TOKEN": SECRET.hex()}
    plan = trx.Launcher(hostnames=["localhost"], extra_env_vars=("TOKEN",)).plan(environ=environ)
    starts = AgentStarts(
        plan=plan,
        agents=[],
        port=1,
        secret=SECRET,
        log_level=20,
        emit=lambda _index, _record: None,
        script=b"export TOKEN=" + SECRET.hex().encode(),
    )
    assert starts.local_env["TOKEN"] == plan.reach.env["TOKEN"] == SECRET.hex()  # made, and held
    assert plan.from_env.health_token == SECRET.hex()
    assert_no_secret(repr(starts))
    assert_no_secret(repr(plan))


def format_with_locals(exc: BaseException) -> str:
    return "".join(traceback.TracebackException.from_exception(exc, capture_locals=True).format())


@pytest.mark.usefixtures("known_secret")
def test_a_failed_local_start_shows_no_secret_in_its_traceback_locals(monkeypatch):
    def no_bash(*_args: object, **_kwargs: object) -> subprocess.Popen[bytes]:
        raise OSError("no bash here")

    monkeypatch.setattr(command.subprocess, "Popen", no_bash)
    with pytest.raises(AgentFailedError) as info:
        trx.Launcher(hostnames=["localhost"], workers_per_host=1, backend=None).run(int)
    text = format_with_locals(info.value)
    assert "no bash here" in text  # the start's own frames are in it
    assert_no_secret(text)


@pytest.mark.usefixtures("known_secret")
def test_a_failed_ssh_start_shows_no_secret_in_its_traceback_locals():
    with pytest.raises(AgentFailedError) as info:
        trx.Launcher(
            hostnames=["torchrunx-no-such-host.invalid"],
            workers_per_host=1,
            backend=None,
            start_timeout=10,
        ).run(int)
    assert_no_secret(format_with_locals(info.value))


def stack_with_locals() -> dict[str, object]:
    """In a worker: every frame below this one, with its locals, as a traceback shows them."""
    try:
        raise ValueError("look below")  # noqa: TRY301 (a real exception, as a user's would be)
    except ValueError as exc:
        frames = traceback.StackSummary.extract(
            traceback.walk_stack(sys._getframe()), capture_locals=True
        )
        text = format_with_locals(exc) + "".join(frames.format())
    main = sys.modules["__main__"]
    return {"text": text, "frames": len(frames), "main_b": hasattr(main, "b")}


@pytest.mark.usefixtures("known_secret")
def test_no_frame_below_a_workers_function_shows_the_secret():
    result = trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend=None).run(
        stack_with_locals
    )
    for rank in result.ranks:
        assert rank["frames"] > 5  # the agent's frames too
        assert "become_worker" in rank["text"]
        assert_no_secret(str(rank["text"]))
        assert not rank["main_b"], "the bootstrap line stayed as __main__.b"
