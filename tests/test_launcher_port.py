"""TORCHRUNX_LAUNCHER_PORT: the launcher's port (or the first free one of a range) for a firewall."""

from __future__ import annotations

import os
import socket

import pytest
from conftest import listening_addresses, torchrunx_processes

import torchrunx as trx
from torchrunx import events as ev
from torchrunx.launcher.settings.environ import PORT_ENV_VAR, launcher_ports

LOCAL = {"hostnames": ["localhost"], "workers_per_host": 1, "backend": None}


def one() -> int:
    return 1


@pytest.mark.parametrize(
    ("value", "ports"),
    [
        (None, (0,)),
        ("", (0,)),
        ("29400", (29400,)),
        ("29400-29402", (29400, 29401, 29402)),
        (" 29400 - 29401 ", (29400, 29401)),
        ("65535", (65535,)),
    ],
)
def test_the_ports_allowed(value, ports):
    assert launcher_ports({} if value is None else {PORT_ENV_VAR: value}) == ports


@pytest.mark.parametrize("value", ["abc", "0", "65536", "29410-29400", "29400-", "-29400", "1.5"])
def test_a_bad_value_says_what_is_expected(value):
    with pytest.raises(ValueError, match=rf"{PORT_ENV_VAR}=.*expected a port from 1 to 65535"):
        launcher_ports({PORT_ENV_VAR: value})


def taken_pair() -> tuple[socket.socket, int]:
    """A port held by a listening socket here, with the next port free."""
    for _ in range(50):
        held = socket.create_server(("127.0.0.1", 0))
        port = held.getsockname()[1]
        try:
            socket.create_server(("127.0.0.1", port + 1)).close()
        except OSError:
            held.close()
            continue
        return held, port
    raise AssertionError("no free pair of ports")


def launched_on(listen_sockets: list[socket.socket]) -> tuple[int, set[str], object]:
    """Launch ``one``; the launcher's port and where it listened as the launch started."""
    seen: list[tuple[int, set[str]]] = []

    def on_event(event: ev.Event) -> None:
        if isinstance(event, ev.LaunchStarted):
            port = listen_sockets[-1].getsockname()[1]
            seen.append((port, listening_addresses(port, os.getpid())))

    result = trx.launch(one, event_handlers=(on_event,), **LOCAL)  # type: ignore[arg-type]
    ((port, listened),) = seen
    return port, listened, result


def test_a_launch_listens_on_the_port_given(monkeypatch, listen_sockets):
    held, port = taken_pair()
    held.close()  # now free
    monkeypatch.setenv(PORT_ENV_VAR, str(port))
    used, listened, result = launched_on(listen_sockets)
    assert result.ranks == [1]
    assert used == port
    assert listened == {"127.0.0.1"}  # every host is this machine: loopback only, as before


def test_a_range_gives_the_first_free_port(monkeypatch, listen_sockets):
    held, port = taken_pair()
    with held:
        monkeypatch.setenv(PORT_ENV_VAR, f"{port}-{port + 1}")
        used, _, result = launched_on(listen_sockets)
    assert result.ranks == [1]
    assert used == port + 1


def test_no_free_port_fails_before_anything_starts_and_names_the_variable(monkeypatch):
    held, port = taken_pair()
    with held:
        monkeypatch.setenv(PORT_ENV_VAR, str(port))
        with pytest.raises(OSError, match="in use") as info:
            trx.launch(one, **LOCAL)
    assert any(PORT_ENV_VAR in note for note in info.value.__notes__)
    assert torchrunx_processes() == []
