"""ProxyJump as OpenSSH reads it: every hop of a list, in order, each with its user and port."""

from __future__ import annotations

import os

import pytest

import torchrunx as trx
from torchrunx.engines.ssh import last_jump, parse_jump, resolve_ssh_target, ssh_connect
from torchrunx.errors import AgentFailedError

CONFIG = """
Host target
    HostName 10.9.0.3
    ProxyJump alice@first:2222,second
Host first
    HostName 10.9.0.1
    User bob
    ProxyJump bastion
Host second
    HostName 10.9.0.2
    ProxyJump never-used
Host bastion
    HostName 10.9.0.9
Host broken
    HostName 10.9.0.4
    ProxyJump first:http
"""


@pytest.mark.parametrize(
    ("hop", "parsed"),
    [
        ("node1", ("", "node1", None)),
        ("alice@node1", ("alice", "node1", None)),
        ("alice@node1:2222", ("alice", "node1", 2222)),
        ("node1:22", ("", "node1", 22)),
        ("[fe80::1]:2200", ("", "fe80::1", 2200)),
        ("carol@[::1]", ("carol", "::1", None)),
        ("fe80::1", ("", "fe80::1", None)),
        ("a@b@host:1", ("a@b", "host", 1)),
    ],
)
def test_a_hop_is_user_host_and_port(hop, parsed):
    assert parse_jump(hop) == parsed


@pytest.mark.parametrize("hop", ["node1:http", "node1:0", "node1:65536", "alice@", ":22", "[]:22"])
def test_a_malformed_hop_is_refused(hop):
    with pytest.raises(ValueError, match="ProxyJump hop"):
        parse_jump(hop)


def test_a_list_is_visited_in_order_the_host_reached_through_the_last_hop(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(CONFIG)
    target = resolve_ssh_target("target", config, 5.0)
    assert target.proxy_jump == "alice@first:2222,second"
    # The host is reached through "second", which is reached through the rest of the list
    # (not through its own entry's ProxyJump) ...
    second = last_jump(target.proxy_jump, config, 5.0)
    assert (second.alias, second.hostname, second.port) == ("second", "10.9.0.2", 22)
    assert second.proxy_jump == "alice@first:2222"
    # ... and "first" with the user and port of the list, and its own entry's ProxyJump.
    first = last_jump(second.proxy_jump, config, 5.0)
    assert (first.hostname, first.user, first.port) == ("10.9.0.1", "alice", 2222)
    assert first.proxy_jump == "bastion"
    bastion = last_jump(first.proxy_jump, config, 5.0)
    assert (bastion.hostname, bastion.proxy_jump) == ("10.9.0.9", None)


def test_a_malformed_proxyjump_is_an_agent_failure_naming_the_host(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(CONFIG)
    with pytest.raises(AgentFailedError, match=r"broken.*ProxyJump 'first:http'.*not a port"):
        ssh_connect(resolve_ssh_target("broken", config, 5.0), config)


def client_address() -> str:
    """The address the agent's SSH connection came from (sshd's ``SSH_CONNECTION``)."""
    return os.environ["SSH_CONNECTION"].split()[0]


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("jump", "comes_from"),
    [
        ("root@{node1}:22", "node1"),
        ("{node1},{node2}", "node2"),
        ("{node2},root@{node1}:22", "node1"),
    ],
)
def test_an_agent_starts_through_every_hop(cluster, tmp_path, jump, comes_from):
    # An alias of node2 reached through the hops: its SSH connection comes from the last one.
    names = dict(zip(("node1", "node2"), cluster.names(), strict=True))
    jump, comes_from = jump.format(**names), names[comes_from]
    config = tmp_path / "ssh_config"
    address = {host.name: host.address for host in cluster.hosts}
    entry = cluster.ssh_config.read_text().split(f"Host {names['node2']}\n", 1)[1]
    entry = entry.split("\nHost ")[0]
    config.write_text(
        cluster.ssh_config.read_text() + f"\nHost hopped\n{entry}\n    ProxyJump {jump}\n"
    )
    result = trx.launch(
        client_address,
        hostnames=["hopped"],
        workers_per_host=1,
        backend=None,
        ssh_config_file=config,
    )
    assert result.rank(0) == address[comes_from]
