"""Launches on localhost: real agents, forked workers, gloo groups and real faults."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import listened_during_launch

import torchrunx as trx
from torchrunx.launcher.launch.inbox import Inbox
from torchrunx.launcher.starts.agent_starts import listen_hosts
from torchrunx.wire import handshake
from torchrunx.wire.handshake import MAGIC
from torchrunx.wire.messages import (
    AgentDone,
    AgentHello,
    LogLines,
    Message,
    WorkerHello,
    WorkerResult,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchrunx.launcher.net.listener import FrameReceived

LOCAL = {"hostnames": ["localhost"], "workers_per_host": 2, "backend": "gloo"}


def rank_info() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env": {
            k: os.environ[k]
            for k in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "GROUP_WORLD_SIZE",
                "ROLE_NAME",
                "ROLE_RANK",
                "ROLE_WORLD_SIZE",
            )
        },
        "sum": total.item(),
        "pid": os.getpid(),
        "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
    }


def _slow_rank_1() -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(1.5)
    return rank


@pytest.mark.quick  # the quick tier's smoke launches
def test_localhost_gloo_collectives_and_results():
    result = trx.Launcher(**LOCAL).run(rank_info)
    assert [r["rank"] for r in result.ranks] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in result.ranks)
    assert result.rank(1)["env"] == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_RANK": "1",
        "ROLE_WORLD_SIZE": "2",
    }
    assert result.index("localhost", 1) == result.rank(1)
    assert list(result.results) == ["localhost"]
    assert result.rank(0)["pid"] != result.rank(1)["pid"] != os.getpid()
    assert result.rank(0)["master"][1] != "29500"


def add(a: int, b: int, *, scale: int = 1) -> int:
    return (a + b) * scale + int(os.environ["RANK"])


def test_arguments_and_per_rank_return_values_and_consecutive_launches():
    first = trx.launch(
        add, (1, 2), {"scale": 10}, hostnames=["localhost"], workers_per_host=3, backend=None
    )
    assert first.ranks == [30, 31, 32]
    second = trx.Launcher(hostnames=["localhost"], workers_per_host=1, backend=None).run(add, 5, 6)
    assert second.ranks == [11]


def test_duplicate_hostnames_keep_every_result():
    result = trx.launch(
        add, (0, 0), hostnames=["localhost", "localhost"], workers_per_host=[1, 2], backend="gloo"
    )
    assert result.ranks == [0, 1, 2]
    assert result.results == {"localhost": [0, 1, 2]}
    assert result.per_host == ((0,), (1, 2))


def test_auto_workers_is_one_per_cpu_core_without_gpus():
    result = trx.launch(
        lambda: os.environ["LOCAL_WORLD_SIZE"], hostnames=["localhost"], backend=None
    )
    assert result.ranks == [str(len(os.sched_getaffinity(0)))] * len(os.sched_getaffinity(0))


class RankOneError(Exception):
    pass


def raise_on_rank_one() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RankOneError("rank one is unhappy")
    dist.barrier()


@pytest.mark.quick  # the quick tier's smoke launches
def test_worker_exception_keeps_its_type_and_remote_traceback():
    with pytest.raises(RankOneError, match="rank one is unhappy") as info:
        trx.Launcher(**LOCAL).run(raise_on_rank_one)
    cause = info.value.__cause__
    assert type(cause).__name__ == "RemoteTraceback"
    assert "raise_on_rank_one" in str(cause)
    assert 'raise RankOneError("rank one is unhappy")' in str(cause)
    assert any("rank 1" in note and "localhost" in note for note in info.value.__notes__)


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception has no text")


def raise_unprintable() -> None:
    print("about to fail")
    raise UnprintableError("x")


def test_exception_whose_str_raises_keeps_its_type_and_traceback():
    with pytest.raises(UnprintableError) as info:
        trx.launch(raise_unprintable, hostnames=["localhost"], workers_per_host=1, backend=None)
    assert info.value.args == ("x",)
    cause = info.value.__cause__
    assert type(cause).__name__ == "RemoteTraceback"
    assert 'raise UnprintableError("x")' in cause.text
    assert "UnprintableError: <exception str() failed>" in cause.text
    notes = "\n".join(info.value.__notes__)
    assert "raised in worker rank 0 (local rank 0 on host 'localhost'" in notes
    assert "about to fail" in notes


def group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def test_a_fractional_process_group_timeout_is_accepted():
    result = trx.launch(group_size, hostnames=["localhost"], workers_per_host=1, timeout=1.5)
    assert result.ranks == [1]


def rank_zero_fails_while_one_waits(waiting: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        deadline = time.monotonic() + 60  # until rank 1 is about to wait in the barrier
        while not os.path.exists(waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ValueError("rank zero failed")
    open(waiting, "w").close()
    dist.barrier()


def test_rank_zero_fails_while_rank_one_waits_in_barrier_fails_fast(tmp_path):
    started = time.monotonic()
    with pytest.raises(ValueError, match="rank zero failed"):
        trx.Launcher(**{**LOCAL, "timeout": 120}).run(
            rank_zero_fails_while_one_waits, str(tmp_path / "waiting")
        )
    # Behaviour, not speed: the launch must not sit in the barrier until the 120 s timeout.
    assert time.monotonic() - started < 60


def kill_self_on_rank_one(how: str) -> None:
    import ctypes
    import signal

    if os.environ["RANK"] == "1":
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            ctypes.string_at(0)
        else:
            sys.exit(3)
    time.sleep(120)


@pytest.mark.parametrize(
    ("how", "described"),
    [
        ("sigkill", "signal 9 (SIGKILL)"),
        ("segfault", "signal 11 (SIGSEGV)"),
        ("exit", "exit code 3"),
    ],
)
def test_worker_death_is_a_worker_failed_error(how, described):
    started = time.monotonic()
    with pytest.raises(trx.WorkerFailedError) as info:
        trx.Launcher(**LOCAL).run(kill_self_on_rank_one, how)
    error = info.value
    assert described in str(error)
    assert (error.hostname, error.local_rank, error.rank) == ("localhost", 1, 1)
    assert error.pid > 0
    if how == "exit":
        assert (error.exitcode, error.signal, error.signal_name) == (3, None, None)
    else:
        assert error.exitcode is None
        assert error.signal_name == {"sigkill": "SIGKILL", "segfault": "SIGSEGV"}[how]
    assert time.monotonic() - started < 60  # rank 0 sleeps 120 s: it was stopped, not waited for


def kill_rank_one_while_rank_zero_waits_in_barrier(marker: str) -> None:
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 0:
        # Rank 0 outlives the launcher's SIGTERM (SIGKILL comes only after the 3 s grace), so
        # its barrier's "Connection closed by peer", the echo of rank 1's death, is always
        # reported: the echo and the death both reach the launcher, in either order.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        Path(marker).touch()
        dist.barrier()
        return
    deadline = time.monotonic() + 60  # rank 1 dies once rank 0 is at its barrier (no sleep)
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def test_worker_killed_during_a_collective_is_reported_not_its_peers_echo(tmp_path):
    # Rank 0's barrier fails as rank 1 dies (gloo: the connection closed by its peer); the death
    # is the cause and is what is raised, the echo a note. (Which of the two arrives first is
    # varied in the pure tests: tests/test_rules_failures.py.)
    launcher = trx.Launcher(**LOCAL)
    for attempt in range(2):
        marker = tmp_path / f"at-barrier-{attempt}"
        with pytest.raises(trx.WorkerFailedError) as info:
            launcher.run(kill_rank_one_while_rank_zero_waits_in_barrier, str(marker))
        error = info.value
        assert (error.rank, error.signal_name) == (1, "SIGKILL")
        notes = "\n".join(getattr(error, "__notes__", []))
        # Rank 0's barrier error (gloo words it in several ways: "Connection closed by peer",
        # "Connection reset by peer", a pair closure...) is a note, never the cause.
        assert re.search(r"other failures seen while stopping: \w*Error: ", notes), notes


def raise_an_echo_just_before(deadline: float) -> None:
    time.sleep(max(deadline - time.time(), 0.0))
    raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer [10.0.0.2]:1234")


def test_launch_timeout_during_a_collective_errors_wait_raises_that_error():
    # The error is raised 0.35 s before launch_timeout, and waits up to 0.5 s for a cause; the
    # timeout passing meanwhile must not turn a worker's failure into a LaunchTimeoutError.
    limit = 3.0
    launcher = trx.Launcher(
        hostnames=["localhost"], workers_per_host=1, backend=None, launch_timeout=limit
    )
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        launcher.run(raise_an_echo_just_before, time.time() + limit - 0.35)


def test_unpicklable_return_value_is_a_serialization_error():
    with pytest.raises(trx.SerializationError, match=r"return value of rank 0 .*cannot be pickled"):
        trx.launch(threading.Lock, hostnames=["localhost"], workers_per_host=1, backend=None)


def test_environment_forwarding_extra_vars_and_env_file(tmp_path, monkeypatch):
    env_file = tmp_path / "env.sh"
    env_file.write_text('export FROM_ENV_FILE="sourced $MY_EXTRA_VAR"\n')
    monkeypatch.setenv("MY_EXTRA_VAR", "extra value; with $(specials)")
    monkeypatch.setenv("TORCH_TEST_VAR", "default pattern")
    monkeypatch.setenv("NOT_FORWARDED", "nope")

    def read_env() -> dict[str, str | None]:
        return {
            k: os.environ.get(k)
            for k in ("MY_EXTRA_VAR", "TORCH_TEST_VAR", "NOT_FORWARDED", "FROM_ENV_FILE")
        }

    result = trx.launch(
        read_env,
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        extra_env_vars=("MY_*",),
        env_file=env_file,
    )
    assert result.rank(0) == {
        "MY_EXTRA_VAR": "extra value; with $(specials)",
        "TORCH_TEST_VAR": "default pattern",
        "NOT_FORWARDED": "nope",  # the launcher's own machine: its whole environment
        "FROM_ENV_FILE": "sourced extra value; with $(specials)",
    }


def test_main_module_exception_class_and_function_round_trip(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(
            """
            import torchrunx as trx

            class MainError(Exception):
                pass

            def fail():
                import os
                if os.environ["RANK"] == "1":
                    raise MainError("defined in __main__")
                return 0

            if __name__ == "__main__":
                try:
                    trx.launch(fail, hostnames=["localhost"], workers_per_host=2, backend=None)
                except MainError as e:
                    print("caught MainError:", e, "| cause:", type(e.__cause__).__name__)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert "caught MainError: defined in __main__ | cause: RemoteTraceback" in out.stdout, (
        out.stderr
    )


def sleep_in_a_background_launch(
    listeners: list[socket.socket],
) -> tuple[threading.Thread, dict[str, object]]:
    """A launch whose one worker sleeps 4 s, in a thread; returns once its port listens."""
    outcome: dict[str, object] = {}

    def run_launch() -> None:
        outcome["result"] = trx.launch(
            time.sleep, (4,), hostnames=["localhost"], workers_per_host=1, backend=None
        )

    thread = threading.Thread(target=run_launch)
    thread.start()
    deadline = time.monotonic() + 10
    while not listeners and time.monotonic() < deadline:
        time.sleep(0.05)
    return thread, outcome


def test_a_peer_with_the_secret_cannot_speak_for_another_role(
    monkeypatch, capsys, log_dir, listen_sockets
):
    listeners = listen_sockets
    """Roles are enforced: a worker's connection cannot send an agent's messages, and back."""
    secrets: list[bytes] = []
    real_secret = handshake.new_secret

    def spy_secret() -> bytes:
        secrets.append(real_secret())
        return secrets[-1]

    monkeypatch.setattr(handshake, "new_secret", spy_secret)
    thread, outcome = sleep_in_a_background_launch(listeners)
    address = ("127.0.0.1", listeners[0].getsockname()[1])
    forged = LogLines(((0, 50, "forged", "FORGED LOG LINE", 0.0),))
    attempts: list[tuple[handshake.Role, list[Message]]] = [
        ("worker", [AgentHello(0, "localhost", 1, 1, 1)]),  # a worker claiming to be an agent
        ("worker", [forged]),  # an agent's message as a worker's first
        ("worker", [WorkerHello(rank=99, local_rank=0, pid=1, attempt=0), forged]),
        ("agent", [WorkerResult(rank=0), forged]),  # a worker's message as an agent's first
    ]
    for role, messages in attempts:
        conn = handshake.connect(address, secrets[0], role, timeout=10)
        for message in messages:
            with contextlib.suppress(OSError):
                conn.send(message)
        conn.sock.settimeout(10)
        with pytest.raises(ConnectionError):  # dropped: EOF, or a reset (not a timeout)
            conn.recv()
        conn.close()
    thread.join(60)
    assert outcome["result"].ranks == [None]  # the launch itself was not disturbed
    assert "FORGED" not in capsys.readouterr().out
    assert "FORGED" not in "".join(p.read_text() for p in log_dir.rglob("*.log"))


def test_connection_without_the_secret_is_rejected_and_nothing_unpickled(
    tmp_path, capsys, log_dir, listen_sockets
):
    listeners = listen_sockets
    marker = tmp_path / "unpickled"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    thread, outcome = sleep_in_a_background_launch(listeners)
    port = listeners[0].getsockname()[1]
    evil = pickle.dumps(Evil())
    forged_log = pickle.dumps(LogLines(((0, 50, "forged", "FORGED LOG LINE", 0.0),)))
    frame = struct.pack("!QI", len(forged_log), 0) + forged_log
    for attempt in (
        evil,
        MAGIC + b"A" + b"\0" * 64 + frame,
        MAGIC + b"W" + b"\0" * 64 + evil,
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.recv(64)  # the launcher's greeting
            sock.sendall(attempt)
            sock.settimeout(10)
            # Refused: the launcher closed the connection (FIN, or RST as data was unread).
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1024) == b""
    thread.join(60)
    assert outcome["result"].ranks == [None]  # the launch itself was not disturbed
    assert not marker.exists()
    assert "FORGED" not in capsys.readouterr().out
    assert "FORGED" not in "".join(p.read_text() for p in log_dir.rglob("*.log"))


def init_group_again() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")


def test_a_second_init_process_group_says_what_to_do():
    with pytest.raises(ValueError, match="twice") as info:
        trx.launch(init_group_again, hostnames=["localhost"], workers_per_host=1, backend="gloo")
    notes = "\n".join(info.value.__notes__)
    assert "torchrunx had already initialised the process group (backend='gloo')" in notes
    assert "backend=None" in notes


def test_agent_exit_noticed_before_its_last_message_is_not_a_failure(monkeypatch):
    """The agent's exit (seen through its pidfd) may overtake its AgentDone on the socket.

    The launcher is made to hand on AgentDone 0.5 s late, as on a busy machine with many
    hosts (seen with 16 test hosts: "the agent process ended unexpectedly (exit status 0)");
    the launch must still succeed.
    """
    on_frame, on_closed = Inbox._on_frame, Inbox._on_closed
    held: dict[object, list[Callable[[], None]]] = {}  # per connection, in order

    def release(peer: object) -> None:
        for handle in held.pop(peer):
            handle()

    def late_agent_done(self: Inbox, event: FrameReceived) -> None:
        if event.peer in held:
            held[event.peer].append(lambda: on_frame(self, event))
        elif isinstance(event.message, AgentDone):  # it and what follows come 0.5 s late
            held[event.peer] = [lambda: on_frame(self, event)]
            threading.Timer(0.5, self.listener.loop.post, (lambda: release(event.peer),)).start()
        else:
            on_frame(self, event)

    def late_close(self: Inbox, peer: object) -> None:
        if peer in held:
            held[peer].append(lambda: on_closed(self, peer))
        else:
            on_closed(self, peer)

    monkeypatch.setattr(Inbox, "_on_frame", late_agent_done)
    monkeypatch.setattr(Inbox, "_on_closed", late_close)
    # The first agent ends while the second one's worker still runs.
    hosts = ["localhost", "localhost"]
    result = trx.launch(_slow_rank_1, hostnames=hosts, workers_per_host=1, backend=None)
    assert result.ranks == [0, 1]


# --------------------------------------------------------------------------------------------
# Where the launcher listens
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("methods", "address", "environ", "expected"),
    [
        (["local"], None, {}, ["127.0.0.1"]),
        (["local", "local"], "10.1.2.3", {"TORCHRUNX_LAUNCHER_ADDR": "10.9.9.9"}, ["127.0.0.1"]),
        (["ssh", "ssh"], None, {}, [None]),  # each SSH connection tells its own address
        (["ssh", "ssh"], "10.1.2.3", {}, ["10.1.2.3", None]),
        (["srun"], None, {"TORCHRUNX_LAUNCHER_ADDR": "fd00::1"}, ["fd00::1", None]),
        (["ssh"], "head-node", {}, [None]),  # a name may resolve otherwise on the hosts
        (["local", "ssh"], "10.1.2.3", {}, [None]),  # local agents are given 127.0.0.1
        (["local"], None, {"TORCHRUNX_LISTEN_ADDR": "*"}, [None]),
        (["ssh"], "10.1.2.3", {"TORCHRUNX_LISTEN_ADDR": " 10.4.5.6 "}, ["10.4.5.6"]),
    ],
)
def test_listen_hosts(methods, address, environ, expected):
    launcher = trx.Launcher(hostnames=["localhost"], launcher_address=address)
    assert listen_hosts(launcher.launcher_address, methods, environ) == expected


def test_a_local_launch_listens_on_loopback_only(listen_sockets):
    bound, result = listened_during_launch(
        listen_sockets,
        os.getpid,
        hostnames=["localhost", socket.gethostname()],
        workers_per_host=1,
        backend=None,
    )
    assert len(result.ranks) == 2
    assert bound == {"127.0.0.1"}


def test_where_to_listen_can_be_set(monkeypatch, listen_sockets):
    monkeypatch.setenv("TORCHRUNX_LISTEN_ADDR", "*")
    bound, result = listened_during_launch(
        listen_sockets, os.getpid, hostnames=["localhost"], workers_per_host=2, backend=None
    )
    assert len(result.ranks) == 2
    assert len(bound) == 1
    assert bound <= {"::", "0.0.0.0"}  # noqa: S104 (every interface)


def test_listening_where_this_machine_has_no_address_fails_before_anything_starts(monkeypatch):
    monkeypatch.setenv("TORCHRUNX_LISTEN_ADDR", "192.0.2.1")  # TEST-NET-1: nobody's
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Cannot assign requested address") as caught:
        trx.launch(os.getpid, hostnames=["localhost"], workers_per_host=1, backend=None)
    assert "TORCHRUNX_LISTEN_ADDR='192.0.2.1': where to listen" in caught.value.__notes__
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_host_name_that_does_not_resolve_fails_at_once_saying_so():
    with pytest.raises(trx.AgentFailedError) as info:
        trx.launch(_slow_rank_1, hostnames=["nosuchhost.invalid"], workers_per_host=1, backend=None)
    assert info.value.hostname == "nosuchhost.invalid"
    assert info.value.reason.startswith("the host name 'nosuchhost.invalid' does not resolve ("), (
        info.value.reason
    )
    assert info.value.reason.endswith(
        "): check its spelling, or give its address with a Host entry and HostName in your SSH "
        "config"
    )
    assert "connect timeout" not in info.value.reason  # it failed at once, not after a wait
    assert info.value.__cause__ is None  # no socket traceback under the message
