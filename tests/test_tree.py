"""Tree start (``Launcher(tree_radix=k)``): the launcher starts ``k`` agents, each its children.

On the SSH test hosts, with every new connection from them to the launcher dropped (an
``iptables`` rule, as in tests/test_relay.py): the children connect to their interior host,
whose relay carries their connections over its own SSH session. Six hosts on the two test
namespaces (a name may repeat: each is a host of its own to the launch), radix 2: the launcher
starts hosts 0 and 1, host 0 starts hosts 2 and 3, host 1 starts hosts 4 and 5.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import escaped_processes, torchrunx_processes
from test_relay import connections_back_dropped

import torchrunx as trx
from torchrunx.launcher.settings.plan import check_tree, check_tree_radix
from torchrunx.launcher.starts.tree import Tree, tree_children, tree_parent
from torchrunx.wire.bootstrap import AgentBootstrap, AgentTimings, TreeChild


def _children_of(pid: int, name: str) -> list[int]:
    """Live processes whose parent is ``pid`` and whose program is ``name``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                program = os.path.basename(f.read().split(b"\0", 1)[0].decode())
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid and program == name:
            found.append(int(entry))
    return found


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _relay_above(pid: int) -> int:
    """The host's relay process above ``pid`` (a worker of an interior host), else 0."""
    while pid > 1:
        pid = _parent(pid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"torchrunx.agent.relay" in f.read():
                return pid
    return 0


def _hello(launcher_pid: int) -> dict[str, object]:
    rank = int(os.environ["RANK"])
    print(f"tree rank {rank} says hello", flush=True)
    return {
        "rank": rank,
        "host": os.uname().nodename,
        "launcher_ssh": len(_children_of(launcher_pid, "ssh")),
    }


def _wait_nothing_left(seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while (torchrunx_processes() or escaped_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert torchrunx_processes() == []
    assert escaped_processes() == []


@pytest.mark.cluster
def test_a_tree_of_six_hosts_runs_every_rank_with_no_route_back(cluster, capfd):
    node1, node2 = cluster.names()
    with connections_back_dropped(cluster):
        result = trx.launch(
            _hello,
            func_args=(os.getpid(),),
            hostnames=[node1, node2] * 3,
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
            tree_radix=2,
            console_ranks="all",
        )
    ranks = result.ranks
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3, 4, 5]
    assert [r["host"] for r in ranks] == [node1, node2] * 3
    # The launcher runs at most two ssh clients (the interior hosts'), for six hosts. (Each
    # rank counts them once; a count of 1 has been seen at the last rank: not understood yet.)
    counts = [r["launcher_ssh"] for r in ranks]
    assert max(counts) == 2 and min(counts) >= 1, ranks
    out = capfd.readouterr().out
    for rank, host in enumerate([node1, node2] * 3):
        assert f"[{host}:0] tree rank {rank} says hello" in out, out  # [host:local rank]
    _wait_nothing_left()


def _kill_interior_host_0() -> None:
    if os.environ["RANK"] == "0":  # host 0: interior, it started hosts 2 and 3
        time.sleep(3)  # every host has started
        os.kill(_relay_above(os.getpid()), signal.SIGKILL)  # its relay: the host is lost
    time.sleep(120)


@pytest.mark.cluster
def test_a_lost_interior_host_fails_its_subtree_naming_it(cluster):
    node1, node2 = cluster.names()
    started = time.monotonic()
    with connections_back_dropped(cluster), pytest.raises(trx.AgentFailedError) as info:
        trx.launch(
            _kill_interior_host_0,
            hostnames=[node1, node2] * 3,
            workers_per_host=1,
            backend=None,
            ssh_config_file=cluster.ssh_config,
            tree_radix=2,
            agent_timeout=5,
        )
    took = time.monotonic() - started
    text = str(info.value) + "\n" + "\n".join(getattr(info.value, "__notes__", []))
    print(f"TREE-LOST-ERROR hostname={info.value.hostname!r}\n{text}\nEND")
    assert info.value.hostname in (node1, node2), text
    for child, host in ((2, node1), (3, node2)):  # host 0's subtree, each named
        assert (
            f"host {host} (host index {child}) was started by interior host {node1} "
            "(host index 0), which was lost"
        ) in text, text
    assert "host index 4" not in text, text  # host 1's subtree was not lost
    assert took < 60, took
    _wait_nothing_left()


def test_tree_layout_is_a_heap_under_the_launcher():
    assert [tree_parent(j, 2) for j in range(8)] == [None, None, 0, 0, 1, 1, 2, 2]
    assert tree_children(0, 2, 6) == [2, 3]
    assert tree_children(1, 2, 5) == [4]
    assert tree_children(2, 2, 6) == []
    assert [tree_parent(j, 3) for j in range(3, 12)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_tree_radix_values_are_checked():
    check_tree_radix(None)
    check_tree_radix(4)
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match=r"^tree_radix="):
            check_tree_radix(bad)
    with pytest.raises(ValueError, match="depth 3 or more"):
        check_tree(2, ["ssh"] * 7, 0)
    check_tree(2, ["ssh"] * 6, 0)
    with pytest.raises(ValueError, match="over SSH"):
        check_tree(2, ["ssh", "local"], 0)
    with pytest.raises(ValueError, match="spare hosts"):
        check_tree(2, ["ssh"] * 3, 1)
    with pytest.raises(ValueError, match="ship is not supported"):
        check_tree(2, ["ssh"] * 3, 0, ship=(".",))
    with pytest.raises(ValueError, match="depth 3 or more"):
        trx.Launcher(hostnames=["a"] * 4, agent_start="ssh", tree_radix=1).plan()


def test_an_interior_bootstrap_carries_its_children():
    boot = AgentBootstrap(
        host_index=0,
        hostname="a",
        launcher_address="127.0.0.1",
        launcher_port=5,
        secret=b"s",
        workers=1,
        preload_torch=False,
        timings=AgentTimings(1.0, 2.0, 3.0, 4.0, 5.0),
        log_level=20,
        sys_path=(),
        relay="on",
        tree=(TreeChild(2, "c", 1), TreeChild(3, "d", None)),
        tree_script="export X=1",
        tree_ssh_config="/cfg",
    )
    again = AgentBootstrap.from_json_line(boot.to_json_line())
    assert again.tree == boot.tree
    assert (again.tree_script, again.tree_ssh_config) == ("export X=1", "/cfg")
    line = json.loads(boot.to_json_line())
    line["tree"] = [[2, "", 1]]
    with pytest.raises(trx.TorchrunxError, match="field 'tree'"):
        AgentBootstrap.from_json_line(json.dumps(line))


def test_a_child_ends_named_when_its_interior_host_is_lost():
    tree = Tree(2, ["a", "b", "c", "d", "e"])
    lines: list[tuple[bool, str]] = []
    child = tree.child(2, lambda is_stderr, text: lines.append((is_stderr, text)))
    handle = tree.on_tree(0)
    handle(json.dumps({"host": 2, "err": True, "line": "ssh says"}).encode())
    handle(json.dumps({"host": 4, "exit": 0}).encode())  # host 1's child: ignored here
    assert child.wait(0) is None
    handle(None)
    assert child.wait(5) == 255
    assert child.lost.startswith("host c (host index 2) was started by interior host a")
    assert tree.child(3).wait(0) == 255
    assert tree.child(4).wait(0) is None
    ((_fd, read),) = child.readers()
    assert read() is False
    assert lines == [(True, "ssh says")]
    tail = child.stderr_tail()
    assert "ssh says" in tail
    assert "host c (host index 2) was started by interior host a (host index 0)" in tail
    assert "which was lost" in tail
    with pytest.raises(trx.AgentFailedError, match="cannot be started again"):
        tree.child(2, lambda *_: None)
    for index in range(2, 5):
        tree.child(index).close()
