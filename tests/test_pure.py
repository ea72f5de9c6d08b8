"""Pure logic: command builders with hostile values, env selection, slots, handshake."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import pytest
from wire_helpers import server_handshake

import torchrunx as trx
from torchrunx.engines.command import AGENT_COMMAND, agent_script
from torchrunx.env import forwarded_env
from torchrunx.errors import ProtocolError, WorkerFailedError, is_collective_error
from torchrunx.events import (
    AgentState,
    Restarting,
    WorkersStarted,
    dataclass_to_dict,
    event_to_dict,
)
from torchrunx.launcher.settings import resolve as hosts
from torchrunx.launcher.settings.plan import agent_timings
from torchrunx.wire import handshake, messages, records
from torchrunx.wire.bootstrap import AgentBootstrap, AgentTimings

HOSTILE = [
    "a b",
    "it's",
    'say "hi"',
    "x; rm -rf /tmp/nope",
    "$(touch /tmp/pwned)",
    "`id`",
    "new\nline",
    "tab\tback\\slash",
    "",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_agent_script_keeps_hostile_values_intact(value, tmp_path):
    # The real agent command and script, with an "interpreter" that prints what it got.
    workdir = tmp_path / "work dir; $(touch pwned)"
    workdir.mkdir()
    fake_python = tmp_path / "fake python"
    fake_python.write_text('#!/bin/sh\nprintf "%s|" "$TRX_VALUE" "$1" "$2"; pwd\n')
    fake_python.chmod(0o755)
    env_file = tmp_path / "env file.sh"
    env_file.write_text('export TRX_VALUE="$TRX_VALUE"\n')
    script = agent_script(
        env={"TRX_VALUE": value}, cwd=str(workdir), python=str(fake_python), env_file=str(env_file)
    )
    out = subprocess.run(
        ["bash", "-c", AGENT_COMMAND], input=script, capture_output=True, check=True
    )
    assert out.stdout.decode() == f"{value}|-u|-c|{workdir}\n"
    assert not (tmp_path / "pwned").exists()
    assert not (workdir / "pwned").exists()


def test_agent_script_has_no_values_on_the_command_line():
    script = agent_script(
        env={"SECRET_TOKEN": "hunter2"}, cwd="/w", python="/py", env_file="/e v.sh"
    )
    assert "hunter2" not in AGENT_COMMAND
    text = script.decode()
    assert text.endswith("\0")
    assert "export SECRET_TOKEN=hunter2;" in text
    assert "source '/e v.sh'" in text
    assert text.index("export") < text.index("source") < text.index("exec /py -u -c")


def test_forwarded_env_patterns():
    environ = {
        "PATH": "/bin",
        "CUDA_HOME": "/c",
        "MY_VAR": "1",
        "RANK": "3",
        "TORCH_X": "y",
        "OTHER": "z",
    }
    assert forwarded_env(("PATH", "CUDA*", "TORCH*"), environ) == {
        "PATH": "/bin",
        "CUDA_HOME": "/c",
        "TORCH_X": "y",
    }
    assert forwarded_env(("MY_*", "RANK"), environ) == {"MY_VAR": "1"}  # RANK is per worker


def test_is_local_host():
    assert hosts.is_local_host("localhost")
    assert hosts.is_local_host("127.0.0.1")
    assert hosts.is_local_host(socket.gethostname())
    assert not hosts.is_local_host("unreachable.invalid")


def test_worker_failed_error_names_the_signal():
    error = WorkerFailedError("node1", 1, 3, 1234, None, 9)
    assert error.signal_name == "SIGKILL"
    assert "rank 3" in str(error)
    assert "node1" in str(error)
    assert "pid 1234" in str(error)
    assert "signal 9 (SIGKILL)" in str(error)


def _serve(sock: socket.socket, secret: bytes, outcome: list[object]) -> None:
    try:
        outcome.append(server_handshake(sock, secret))
    except ProtocolError as exc:
        outcome.append(exc)
        sock.close()  # as the launcher does: drop the peer


@pytest.mark.parametrize("client_secret", [b"x" * 32, b""])
def test_handshake_rejects_a_wrong_secret(client_secret):
    server, client = socket.socketpair()
    outcome: list[object] = []
    thread = threading.Thread(target=_serve, args=(server, b"s" * 32, outcome))
    thread.start()
    with pytest.raises((ProtocolError, ConnectionError)):
        handshake.client_handshake(client, client_secret, "worker")
    thread.join()
    assert isinstance(outcome[0], ProtocolError)
    assert "failed to authenticate" in str(outcome[0])
    client.close()


def test_handshake_accepts_the_right_secret_both_ways():
    server, client = socket.socketpair()
    outcome: list[object] = []
    thread = threading.Thread(target=_serve, args=(server, b"s" * 32, outcome))
    thread.start()
    client_keys = handshake.client_handshake(client, b"s" * 32, "agent")
    thread.join()
    role, server_keys = outcome[0]
    assert role == "agent"
    assert server_keys.send == client_keys.receive != server_keys.receive == client_keys.send
    sender = records.Connection(server, server_keys)
    receiver = records.Connection(client, client_keys)
    sender.send(messages.WorkerResult(rank=3), [b"stream", memoryview(b"tensor bytes"), b""])
    message, payload = receiver.recv()
    assert message == messages.WorkerResult(rank=3)
    assert [bytes(part) for part in payload] == [b"stream", b"tensor bytes", b""]
    sender.close()
    receiver.close()


def test_serialization_round_trips_tensors_out_of_band():
    import torch

    from torchrunx import serialization

    values = {
        "float": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "bf16": torch.ones(5, dtype=torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(10)[::2],
        "grad": torch.ones(2, requires_grad=True),
        "nested": [torch.zeros(2, dtype=torch.int64), "text"],
    }
    parts = serialization.dumps(values)
    assert len(parts) > 5  # the plain tensors travelled out of band
    restored = serialization.loads([bytearray(part) for part in parts])
    for key, value in values.items():
        if key == "nested":
            assert torch.equal(restored[key][0], value[0])
            assert restored[key][1] == "text"
        else:
            assert restored[key].dtype == value.dtype
            assert restored[key].shape == value.shape
            assert torch.equal(restored[key].detach(), value.detach())
    assert restored["grad"].requires_grad


GLOO_PEER_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:18864. This is typically caused by a remote worker crashing."
)


def test_collective_errors_are_told_from_causes():
    import torch.distributed as dist

    assert is_collective_error(RuntimeError(GLOO_PEER_CLOSED))  # what gloo raised in torch 2.13
    assert is_collective_error(dist.DistBackendError("NCCL communicator was aborted"))
    assert is_collective_error(dist.DistStoreError("wait timeout after 30000ms"))
    # Wrapped by the user's code (raise ... from, or raised while handling): the chain shows it.
    wrapped = ValueError("training step 12 failed")
    wrapped.__cause__ = RuntimeError(GLOO_PEER_CLOSED)
    assert is_collective_error(wrapped)
    handling = KeyError("batch")
    handling.__context__ = dist.DistNetworkError("Connection reset by peer")
    assert is_collective_error(handling)
    # Causes: the user's own errors, and unrelated runtime errors.
    assert not is_collective_error(ConnectionResetError(104, "Connection reset by peer"))  # S3?
    assert not is_collective_error(ValueError("rank zero failed"))
    assert not is_collective_error(RuntimeError("CUDA out of memory"))
    assert not is_collective_error(KeyboardInterrupt())

    class UnprintableError(RuntimeError):
        def __str__(self) -> str:
            raise ValueError("no text")

    assert not is_collective_error(UnprintableError())  # and no exception from the check itself


def test_tensors_travel_without_numpy_and_without_a_copy():
    # torch does not install numpy and torchrunx does not declare it: a worker must pickle
    # tensors where importing numpy fails (run in a fresh interpreter that blocks it).
    code = """
import struct, sys
sys.modules["numpy"] = None  # 'import numpy' raises ImportError, as in a bare environment
import warnings
warnings.simplefilter("ignore")  # torch warns once that numpy is missing
import torch
from torchrunx import serialization
base = torch.arange(10, dtype=torch.float32)
values = [base[3:7], base[::3], torch.ones(2, 2, dtype=torch.bfloat16), torch.empty(0)]
parts = serialization.dumps(values)
restored = serialization.loads([bytearray(part) for part in parts])
assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(values, restored))
# Zero-copy: the buffer handed to the socket is the tensor's own memory.
tensor = torch.zeros(4)
raw = serialization.dumps(tensor)[1]
tensor[0] = 5.0
assert bytes(raw)[:4] == struct.pack("f", 5.0)
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_an_exception_whose_str_raises_is_reported_with_its_type_and_traceback():
    from torchrunx.errors import exception_text
    from torchrunx.worker.worker import _exception_message

    class UnprintableError(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    try:
        raise UnprintableError("x")  # noqa: TRY301 (a traceback to format)
    except UnprintableError as caught:
        error = caught
    assert exception_text(error) == "<exception str() failed>"
    assert exception_text(ValueError("fine")) == "fine"
    message, _ = _exception_message(3, error)
    assert message.rank == 3
    assert message.type_name.endswith("UnprintableError")
    assert message.message == "<exception str() failed>"
    assert 'raise UnprintableError("x")' in message.traceback


def test_the_agent_forks_only_once_its_preload_thread_has_left_the_kernel():
    # Thread.join returns before the OS thread's destructors have run (MKL's take a lock that
    # a worker forked meanwhile would inherit held); the agent waits for /proc/self/task.
    from torchrunx.agent.preload import wait_for_thread_exit

    for _ in range(20):
        tid: list[int] = []
        thread = threading.Thread(target=lambda ids=tid: ids.append(threading.get_native_id()))
        thread.start()
        thread.join()
        wait_for_thread_exit(tid)
        assert not os.path.exists(f"/proc/self/task/{tid[0]}")


@dataclass(frozen=True)
class _Inner:
    state: AgentState
    ratio: float


@dataclass(frozen=True)
class _Outer:
    name: str
    inner: _Inner
    items: tuple[_Inner, ...]
    counts: list[int | None]
    flag: bool


def test_dataclass_to_dict_is_plain_json_data_in_field_order():
    value = _Outer(
        name="x",
        inner=_Inner(AgentState.LOST, 1.23456),
        items=(_Inner(AgentState.DONE, 2.0),),
        counts=[1, None],
        flag=True,
    )
    expected = {
        "name": "x",
        "inner": {"state": "LOST", "ratio": 1.23456},
        "items": [{"state": "DONE", "ratio": 2.0}],
        "counts": [1, None],
        "flag": True,
    }
    assert dataclass_to_dict(value) == expected
    assert list(dataclass_to_dict(value)) == ["name", "inner", "items", "counts", "flag"]
    rounded = dataclass_to_dict(value, ndigits=3)
    assert rounded["inner"] == {"state": "LOST", "ratio": 1.235}
    assert rounded["flag"] is True  # a bool is no float
    for wrong in (_Outer, {"name": "x"}, 3):
        with pytest.raises(TypeError, match="not a dataclass instance"):
            dataclass_to_dict(wrong)


def test_event_to_dict_has_the_type_first_and_full_precision():
    event = Restarting(attempt=1, max_restarts=2, reason="boom", time=1795274134.123456)
    assert event_to_dict(event) == {
        "event": "Restarting",
        "attempt": 1,
        "max_restarts": 2,
        "reason": "boom",
        "time": 1795274134.123456,
    }
    started = WorkersStarted(0, "node1", 0, ranks=(0, 1), pids=(10, 11), time=1.0)
    assert event_to_dict(started)["ranks"] == [0, 1]


def _bootstrap(**changes: object) -> AgentBootstrap:
    fields: dict[str, object] = {
        "host_index": 1,
        "hostname": "node1",
        "launcher_address": "10.0.0.1",
        "launcher_port": 29500,
        "secret": bytes(range(32)),
        "workers": None,
        "preload_torch": True,
        "timings": agent_timings(5.0),
        "log_level": 20,
        "sys_path": ("/a", "/b c"),
        "count": "gpu",
    }
    return AgentBootstrap(**{**fields, **changes})  # type: ignore[arg-type]


def test_the_agent_bootstrap_is_one_json_line_that_decodes_to_the_same_object():
    boot = _bootstrap()
    line = boot.to_json_line()
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert AgentBootstrap.from_json_line(line) == boot
    assert AgentBootstrap.from_json_line(line.decode()) == boot
    assert AgentBootstrap.from_json_line(_bootstrap(workers=3).to_json_line()).workers == 3
    data = json.loads(line)
    assert data["secret"] == bytes(range(32)).hex()  # hex, never pickled
    del data["count"]  # "auto" when absent
    assert AgentBootstrap.from_json_line(json.dumps(data)).count == "auto"
    assert data["timings"] == {  # sent by name, as the launcher derived them
        "heartbeat_interval": 1.0,
        "launcher_silence": 5.0,
        "connect_timeout": 10.0,
        "finish_timeout": 5.0,
        "guardian_grace": 13.0,
    }
    data["timings"]["connect_timeout"] = 7  # an integer is a number of seconds too
    assert AgentBootstrap.from_json_line(json.dumps(data)).timings.connect_timeout == 7.0


def test_the_host_sides_timings_are_derived_from_agent_timeout_once_on_the_launchers_side():
    timings = agent_timings(5.0)
    assert timings.heartbeat_interval == messages.HEARTBEAT_INTERVAL == 1.0
    assert timings.launcher_silence == 5.0  # the launcher is gone after agent_timeout of silence
    assert timings.finish_timeout == 5.0  # the agent's last messages get as long
    assert timings.connect_timeout == 10.0  # a connection, handshake included: twice as long
    assert timings.guardian_grace == 13.0  # 2 * agent_timeout + 3 s to stop the workers
    other = agent_timings(0.5, heartbeat_interval=0.25)
    assert other == AgentTimings(
        heartbeat_interval=0.25,
        launcher_silence=0.5,
        connect_timeout=1.0,
        finish_timeout=0.5,
        guardian_grace=4.0,
    )
    plan = trx.Launcher(hostnames=["localhost"], workers_per_host=1, agent_timeout=2.5).plan()
    assert plan.timeouts.agent_timings == agent_timings(2.5)
    assert plan.timeouts.agent_timings is plan.timeouts.agent_timings  # made once per plan
    changed = dataclasses.replace(plan.timeouts, agent=4.0)
    assert changed.agent_timings == agent_timings(4.0)


def _timings(data: dict[str, Any], **changes: object) -> dict[str, Any]:
    """``data`` with its ``timings`` changed (a field of None: left out)."""
    timings = {**data["timings"], **changes}
    return {**data, "timings": {k: v for k, v in timings.items() if v is not None}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda _: "{", "not a line of JSON"),
        (lambda _: "[1, 2]", "a JSON object expected, got list"),
        (lambda _: b"\xff\n", "not a line of JSON"),
        (lambda d: {k: v for k, v in d.items() if k != "secret"}, "field 'secret' is missing"),
        (lambda d: {**d, "secret": "zz"}, "field 'secret' must be a non-empty hex string"),
        (lambda d: {**d, "secret": ""}, "field 'secret' must be a non-empty hex string"),
        (lambda d: {**d, "host_index": -1}, "field 'host_index' must be an integer of at least 0"),
        (lambda d: {**d, "host_index": True}, "field 'host_index' must be an integer"),
        (lambda d: {**d, "hostname": 3}, "field 'hostname' must be a non-empty string"),
        (lambda d: {**d, "launcher": ["h"]}, r"field 'launcher' must be \[address, port\]"),
        (lambda d: {**d, "launcher": ["h", 70000]}, r"field 'launcher' must be \[address, port\]"),
        (lambda d: {**d, "workers": 0}, "field 'workers' must be a positive integer or null"),
        (lambda d: {**d, "workers": "2"}, "field 'workers' must be a positive integer or null"),
        (lambda d: {**d, "preload_torch": "yes"}, "field 'preload_torch' must be true or false"),
        (lambda d: {**d, "timings": 5.0}, "field 'timings' must be an object of seconds, got 5.0"),
        (lambda d: _timings(d, launcher_silence="5"), "field 'timings.launcher_silence' must be a"),
        (lambda d: _timings(d, connect_timeout=float("inf")), "field 'timings.connect_timeout' m"),
        (lambda d: _timings(d, heartbeat_interval=0), "field 'timings.heartbeat_interval' must"),
        (lambda d: _timings(d, finish_timeout=-1.0), "field 'timings.finish_timeout' must be a"),
        (lambda d: _timings(d, guardian_grace=True), "field 'timings.guardian_grace' must be a"),
        (lambda d: _timings(d, guardian_grace=None), "field 'timings.guardian_grace' is missing"),
        (
            lambda d: _timings(d, agent_timeout=5.0),
            r"unknown field\(s\) \['timings.agent_timeout'\]",
        ),
        (lambda d: {**d, "agent_timeout": 5.0}, r"unknown field\(s\) \['agent_timeout'\]"),
        (lambda d: {k: v for k, v in d.items() if k != "timings"}, "field 'timings' is missing"),
        (lambda d: {**d, "log_level": "INFO"}, "field 'log_level' must be an integer"),
        (lambda d: {**d, "sys_path": ["/a", 1]}, "field 'sys_path' must be a list of strings"),
        (lambda d: {**d, "count": "gpus"}, "field 'count' must be 'auto' or 'gpu' or 'cpu'"),
        (lambda d: {**d, "package_root": None}, "field 'package_root' must be a string"),
        (lambda d: {**d, "secret_key": "00"}, r"unknown field\(s\) \['secret_key'\]"),
    ],
)
def test_a_malformed_agent_bootstrap_is_refused_naming_the_field(change, message):
    changed = change(json.loads(_bootstrap().to_json_line()))
    line = changed if isinstance(changed, str | bytes) else json.dumps(changed)
    with pytest.raises(ProtocolError, match=f"^malformed agent bootstrap: {message}"):
        AgentBootstrap.from_json_line(line)
