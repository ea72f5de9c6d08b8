"""``TORCHRUNX_DEBUGPY`` against another local user: only the launching user's IDE attaches.

The attacker is a real second account (tests/attacker.py) on the launcher's machine and on an
SSH test host. It connects to the debugger's port and speaks first, as an IDE would (DAP
``initialize``); debugpy answers any client, so an answer means it could go on to ``attach``
and ``evaluate`` code as the user. Each test then attaches the user's own IDE, which must
still work, and the launch must end normally.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from attacker import as_attacker
from test_debugger import (
    _attach_as_an_ide,
    _env,
    _free_port,
    _launch_for_an_ide,
    _until_waiting,
)

from torchrunx.peercred import (
    PeerSocket,
    find_peer,
    held_by,
    loopback_peer,
    proc_address,
    same_user,
)

ATTACKER = r"""
import json, socket, sys
port = int(sys.argv[1])
try:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
except OSError as exc:
    print("NOCONNECT", exc)
    sys.exit(0)
body = json.dumps({"seq": 1, "type": "request", "command": "initialize",
                   "arguments": {"adapterID": "python", "clientID": "intruder"}}).encode()
try:
    sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
    data = sock.recv(65536)
except (ConnectionResetError, BrokenPipeError):
    data = b""
except socket.timeout:
    print("SILENT")
    sys.exit(0)
print("ANSWERED" if data else "CLOSED")
"""


def _attack(port: int, prefix: list[str] | None = None) -> str:
    """The other user's DAP ``initialize`` at ``127.0.0.1:port``: what came back."""
    done = subprocess.run(
        [*(prefix or []), *as_attacker(["python3", "-c", ATTACKER, str(port)])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# -- the rule: who is at the other end (pure, on made-up tables) ----------------------------

TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:162E 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100007F:162E 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 222 1
   2: 0100007F:9C40 0100007F:162E 01 00000000:00000000 00:00000000 00000000  1001        0 333 1
   3: 0100007F:9C41 0100007F:162F 01 00000000:00000000 00:00000000 00000000     0        0 444 1
"""


def test_proc_address_is_written_as_the_kernel_writes_it():
    if sys.byteorder == "little":
        assert proc_address("127.0.0.1", 5678) == "0100007F:162E"
        assert proc_address("10.1.2.3", 1) == "0302010A:0001"
    assert proc_address("::1", 80).endswith(":0050")


def test_the_peer_is_the_row_whose_local_end_is_our_remote_end():
    if sys.byteorder != "little":
        pytest.skip("the made-up table is written for a little-endian machine")
    # Our accepted socket is row 1 (local 5678, remote 40000): the peer is row 2, uid 1001.
    assert find_peer(TABLE, ("127.0.0.1", 5678), ("127.0.0.1", 40000)) == PeerSocket(1001, 333)
    # Not the row with our own local end, nor one with a port that only shares digits.
    assert find_peer(TABLE, ("127.0.0.1", 5679), ("127.0.0.1", 40001)) == PeerSocket(0, 444)
    assert find_peer(TABLE, ("127.0.0.1", 5678), ("127.0.0.1", 40001)) is None
    assert find_peer(TABLE, ("127.0.0.1", 5679), ("127.0.0.1", 40000)) is None


def test_an_ipv6_address_is_four_words_each_in_this_machines_byte_order():
    if sys.byteorder != "little":
        pytest.skip("the words are written for a little-endian machine")
    assert proc_address("::1", 80) == "00000000000000000000000001000000:0050"
    assert proc_address("2001:db8:1:2:3:4:5:6", 65535) == "B80D0120020001000400030006000500:FFFF"
    assert proc_address("2001:db8:aaaa:bbbb:cccc:dddd:eeee:ffff", 1) == (
        "B80D0120BBBBAAAADDDDCCCCFFFFEEEE:0001"
    )


def test_the_first_row_is_read_and_short_rows_are_skipped_not_the_end():
    if sys.byteorder != "little":
        pytest.skip("the made-up table is written for a little-endian machine")
    header = TABLE.splitlines()[0]
    row = "   0: 0100007F:9C40 0100007F:162E 01 00000000:00000000 00:00000000 00000000  1001 0 333"
    assert len(row.split()) == 10  # the fewest fields a row is read with: its inode the last
    local, peer = ("127.0.0.1", 5678), ("127.0.0.1", 40000)
    assert find_peer(f"{header}\n{row}\n", local, peer) == PeerSocket(1001, 333)
    short = "   9: 0100007F:9C40 0100007F:162E 01 00000000:00000000 00:00000000 00000000  7"
    assert find_peer(f"{header}\n{short}\n{row}\n", local, peer) == PeerSocket(1001, 333)
    assert find_peer(f"{header}\n{short}\n", local, peer) is None
    assert find_peer(row, local, peer) is None  # the first line is the header, never a row


def test_a_row_without_its_inode_is_skipped_not_read_past_its_end():
    if sys.byteorder != "little":
        pytest.skip("the made-up table is written for a little-endian machine")
    header = TABLE.splitlines()[0]
    row = "   0: 0100007F:9C40 0100007F:162E 01 00000000:00000000 00:00000000 00000000  1001 0"
    assert len(row.split()) == 9  # the peer's addresses, its uid, then no inode
    assert find_peer(f"{header}\n{row}\n", ("127.0.0.1", 5678), ("127.0.0.1", 40000)) is None


def test_the_addresses_hex_digits_are_read_in_either_case():
    if sys.byteorder != "little":
        pytest.skip("the made-up table is written for a little-endian machine")
    header = TABLE.splitlines()[0]
    row = "   0: 0a00007f:9c40 0a00007f:162e 01 00000000:00000000 00:00000000 00000000  1001 0 333"
    local, peer = ("127.0.0.10", 5678), ("127.0.0.10", 40000)
    assert find_peer(f"{header}\n{row}\n", local, peer) == PeerSocket(1001, 333)


def test_a_socket_whose_other_end_is_unknown_is_never_the_users_own():
    with socket.socket() as unconnected:  # no peer: nothing to look up
        assert loopback_peer(unconnected) is None
        assert same_user(unconnected) is False


def test_a_real_connection_of_this_process_is_found_with_its_uid_and_inode():
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            peer = loopback_peer(accepted)
            assert peer is not None
            assert peer.uid == 0  # the tests run as root
            assert held_by(peer.inode)  # the client socket is this process's
            assert f"socket:[{peer.inode}]" in {
                str(p.readlink()) for p in Path("/proc/self/fd").iterdir() if p.is_symlink()
            }


def test_another_users_connection_is_seen_as_theirs():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        holder = subprocess.Popen(
            as_attacker(
                [
                    "python3",
                    "-c",
                    f"import socket,sys; s=socket.create_connection(('127.0.0.1',{port})); sys.stdin.read()",
                ]
            ),
            stdin=subprocess.PIPE,
        )
        try:
            server.settimeout(30)
            accepted, _ = server.accept()
            with accepted:
                peer = loopback_peer(accepted)
                assert peer is not None
                assert peer.uid != 0
                assert not held_by(peer.inode)
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait(30)


# -- real launches ---------------------------------------------------------------------------


def _finish(process: subprocess.Popen[str], tmp_path: Path, port: int, expected: str) -> None:
    """Attach as the user's IDE, let the ranks return, and check the launch's result."""
    with _attach_as_an_ide(port):
        (tmp_path / "go").touch()
        out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert out.splitlines()[-1] == expected


def test_on_this_machine_another_user_cannot_attach_to_the_chosen_rank(tmp_path):
    port = _free_port()
    process = _launch_for_an_ide(tmp_path, port, "localhost")
    try:
        _until_waiting(process)
        assert _attack(port) == "CLOSED"  # closed unread: debugpy never saw it
        assert _attack(port) == "CLOSED"  # and again: the user's IDE still gets in
        _finish(process, tmp_path, port, "RESULTS [0, 10]")
    finally:
        process.kill()
        process.communicate()
    with socket.socket() as sock:  # nothing listens once the IDE is attached and it ended
        assert sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.cluster
def test_over_ssh_another_user_cannot_attach_on_either_machine(cluster, tmp_path):
    port = _free_port()
    hosts = cluster.names()
    process = _launch_for_an_ide(tmp_path, port, ",".join(hosts), str(cluster.ssh_config))
    try:
        _until_waiting(process)
        # On the launcher's machine: the forward refuses another user's connection.
        assert _attack(port) == "CLOSED"
        # On the rank's host: the port there carries only the user's own connections.
        assert _attack(port, cluster.enter_argv(hosts[1])) == "CLOSED"
        _finish(process, tmp_path, port, "RESULTS [0, 10, 20, 30]")
    finally:
        process.kill()
        process.communicate()


ASKS_FOR_A_PORT = """
import os, sys
import torchrunx as trx

def work(port):
    from torchrunx.worker import debugger
    from torchrunx.wire.messages import DebugpyListening
    rank = int(os.environ["RANK"])
    if rank == 3:  # a worker (or code it runs) names a port TORCHRUNX_DEBUGPY did not
        debugger._ours().session.conn.send(DebugpyListening(rank, port))
    return rank

hosts = sys.argv[1].split(",")
print("RESULTS", trx.Launcher(hostnames=hosts, workers_per_host=2, backend=None,
      ssh_config_file=sys.argv[2]).run(work, int(sys.argv[3])).ranks, flush=True)
"""


@pytest.mark.cluster
def test_a_worker_cannot_open_a_forward_to_a_port_the_user_did_not_name(cluster, tmp_path):
    port = _free_port()
    script = tmp_path / "asks.py"
    script.write_text(ASKS_FOR_A_PORT)
    process = subprocess.Popen(
        [
            sys.executable,
            str(script),
            ",".join(cluster.names()),
            str(cluster.ssh_config),
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=tmp_path,
    )
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert out.splitlines()[-1] == "RESULTS [0, 1, 2, 3]"
    assert (
        f"rank 3 asked for an IDE's debugger on port {port}, which TORCHRUNX_DEBUGPY did not "
        "name: nothing forwarded"
    ) in err
    assert "waits for an IDE's debugger" not in err  # nothing told the user to attach there
