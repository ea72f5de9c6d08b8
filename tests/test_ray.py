"""The Ray engine on a real multi-node Ray cluster: ``ray start`` on namespace test hosts.

The launcher runs here, outside the cluster's hosts, and connects as a Ray driver; agents start
through one actor per node. After every test: no actor alive, no placement group left, no
Ray connection left open by torchrunx, and (conftest) no agent or worker process on any host.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from cluster import cluster_unavailable_reason
from conftest import SESSION_MARKER, wait_gone
from ray_cluster import RayCluster, ray_unavailable_reason, start_ray_cluster

import torchrunx as trx

on_ray = pytest.mark.cluster


def test_without_ray_installed_the_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(RuntimeError, match=r"need Ray: pip install 'torchrunx\[ray\]'"):
        trx.Launcher(hostnames="ray").plan()
    with pytest.raises(trx.AgentFailedError, match=r"need Ray: pip install 'torchrunx\[ray\]'"):
        trx.launch(
            os.getpid, hostnames=["10.0.0.1"], agent_start="ray", workers_per_host=1, backend=None
        )


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory):
    reason = cluster_unavailable_reason() or ray_unavailable_reason()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"Ray test cluster required on CI: {reason}")
        pytest.skip(reason)
    cluster = start_ray_cluster(2, tmp_path_factory.mktemp("ray"), marker=SESSION_MARKER)
    yield cluster
    cluster.stop()


@pytest.fixture
def ray_hosts(ray_cluster: RayCluster):
    """The provider spec of the cluster; after the test, nothing of the launch is left in Ray."""
    yield f"ray:{ray_cluster.address}"
    import ray

    assert not ray.is_initialized()  # torchrunx disconnected what it connected
    assert ray_cluster.leftovers() == {"actors": [], "placement_groups": []}


def kill_actor_of_host(ray_cluster: RayCluster, index: int) -> None:
    """Kill, from a driver of its own, the actor that started host ``index``'s agent."""
    ray_cluster.driver(
        f"import ray;ray.init(address={ray_cluster.address!r},logging_level='ERROR',log_to_driver=False)\n"
        "import ray.util\n"
        "names=[a['name'] for a in ray.util.list_named_actors(all_namespaces=True)"
        f" if a['name'].startswith('torchrunx-agent-') and '-{index}-' in a['name']]\n"
        "assert len(names)==1, names\n"
        "ray.kill(ray.get_actor(names[0], namespace='torchrunx'))\n"
    )


def fault_while_ranks_run(
    hosts: str, tmp_path: Path, fault, **options: object
) -> trx.AgentFailedError:
    """Launch 2 ranks that wait; once both run, call ``fault()``; the AgentFailedError raised."""
    started = tmp_path / "started"

    def wait_forever() -> None:
        Path(f"{started}-{os.environ['RANK']}").touch()
        time.sleep(600)

    def fault_when_started() -> None:
        deadline = time.monotonic() + 60
        while not all(Path(f"{started}-{r}").exists() for r in range(2)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        fault()

    faulter = threading.Thread(target=fault_when_started)
    faulter.start()
    try:
        with pytest.raises(trx.AgentFailedError) as info:
            trx.launch(wait_forever, hostnames=hosts, workers_per_host=1, backend=None, **options)
    finally:
        faulter.join()
    return info.value


def where() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\0", b" ").decode()
    return {
        "host": socket.gethostname(),
        "rank": int(os.environ["RANK"]),
        "sum": total.item(),
        "parent": parent,
        "ray_vars": sorted(k for k in os.environ if k.startswith("RAY_")),
        "breakpoint": os.environ.get("PYTHONBREAKPOINT"),
    }


@on_ray
def test_ray_nodes_run_the_function_and_every_rank_returns(ray_cluster, ray_hosts):
    breakpoint_before = os.environ.get("PYTHONBREAKPOINT")
    sigterm_before = signal.getsignal(signal.SIGTERM)
    result = trx.launch(where, hostnames=ray_hosts, workers_per_host=2, backend="gloo")
    assert os.environ.get("PYTHONBREAKPOINT") == breakpoint_before  # ray.init's is undone
    assert signal.getsignal(signal.SIGTERM) is sigterm_before  # so is its SIGTERM handler
    addresses = [h.address for h in ray_cluster.hosts.hosts]
    assert list(result.results) == addresses  # the nodes, by address, in address order
    assert [r["host"] for r in result.ranks] == ["rnode1", "rnode1", "rnode2", "rnode2"]
    assert [r["rank"] for r in result.ranks] == [0, 1, 2, 3]
    assert all(r["sum"] == 6.0 for r in result.ranks)
    # Workers are forked from our agent (whose parent is the actor), never from a Ray worker,
    # and Ray's own variables do not reach them.
    assert all("torchrunx.agent.agent" in str(r["parent"]) for r in result.ranks)
    assert all(r["ray_vars"] == [] for r in result.ranks)
    assert all(not str(r["breakpoint"]).startswith("ray.") for r in result.ranks)
    assert result.index(addresses[1], 1)["rank"] == 3


@on_ray
def test_ray_uses_and_keeps_the_callers_own_connection(ray_cluster, ray_hosts, monkeypatch):
    import ray

    # ray.init points this process's breakpoint() at Ray's debugger: not past this test
    monkeypatch.setenv("PYTHONBREAKPOINT", os.environ.get("PYTHONBREAKPOINT", "0"))
    sigterm = signal.getsignal(signal.SIGTERM)  # and sets its own SIGTERM handler: not past it
    ray.init(address=ray_cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        result = trx.launch(where, hostnames="ray", workers_per_host=1, backend="gloo")
        assert [r["host"] for r in result.ranks] == ["rnode1", "rnode2"]
        assert ray.is_initialized()  # the caller's connection stays theirs
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


@on_ray
def test_the_ray_example_trains_on_the_clusters_nodes(ray_cluster, ray_hosts, tmp_path):
    from test_examples import ROOT, run_example

    args = ["--address", ray_cluster.address, "--workers", "1", "--steps", "30"]
    done = run_example(ROOT / "examples" / "14_ray.py", args, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [
        line for line in done.stdout.splitlines() if not line.startswith("[")
    ]  # ranks' own lines
    assert lines[:2] == [f"node {h.address}: 1 ranks on {h.name}" for h in ray_cluster.hosts.hosts]
    assert lines[2] == "every rank holds weights [1.0, 2.0, 3.0]: True"


@on_ray
def test_ray_dry_run_names_the_provider_and_the_transport(ray_cluster, ray_hosts):
    text = trx.Launcher(hostnames=ray_hosts, workers_per_host=2).dry_run()
    assert f"hosts from: host provider ray ({ray_cluster.address})" in text
    assert f"agent start: ray:{ray_cluster.address} (2 hosts)" in text
    for host in ray_cluster.hosts.hosts:
        assert f"{host.address}: a Ray actor on node {host.address}" in text


@on_ray
def test_ray_raising_rank_is_raised_with_its_node(ray_cluster, ray_hosts):
    def fail_on_rank_3() -> int:
        if int(os.environ["RANK"]) == 3:
            raise ValueError("rank 3 cannot go on")
        return 0

    with pytest.raises(ValueError, match="rank 3 cannot go on") as info:
        trx.launch(fail_on_rank_3, hostnames=ray_hosts, workers_per_host=2, backend=None)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert ray_cluster.hosts.hosts[1].address in notes


@on_ray
def test_ray_warm_agents_run_twice_in_the_same_processes(ray_cluster, ray_hosts):
    def pid() -> int:
        return os.getpid()

    launcher = trx.Launcher(hostnames=ray_hosts, workers_per_host=1, backend=None)
    with launcher.warm(keep_workers=True) as warm:
        first = warm.run(pid).ranks
        # Other launchers' dry runs and checks meanwhile leave the warm agents' connection be.
        assert "agent start: ray:" in trx.Launcher(hostnames=ray_hosts).dry_run()
        trx.Launcher(hostnames=["10.0.0.1"], agent_start="ray").validate()
        second = warm.run(pid).ranks
    assert first == second
    assert len(set(first)) == 2


@on_ray
def test_ray_hosts_that_are_not_nodes_are_refused_by_name(ray_cluster, ray_hosts):
    with pytest.raises(
        trx.AgentFailedError, match=r"10\.203\.0\.99 is no alive node of the Ray cluster"
    ):
        trx.launch(
            os.getpid,
            hostnames=["10.203.0.99"],
            agent_start=ray_hosts,  # the transport, at the same address
            workers_per_host=1,
            backend=None,
            start_timeout=30,
        )


@on_ray
def test_ray_killed_actor_ends_its_agent_and_fails_its_node(ray_cluster, ray_hosts, tmp_path):
    import tempfile

    private_dirs = set(Path(tempfile.gettempdir()).glob("torchrunx-*"))
    second = ray_cluster.hosts.hosts[1]
    error = fault_while_ranks_run(ray_hosts, tmp_path, lambda: kill_actor_of_host(ray_cluster, 1))
    assert error.hostname == second.address
    # Ray took the agent's whole tree, its private folder could not go with it: the next
    # agent on that node removes it.
    trx.launch(os.getpid, hostnames=ray_hosts, workers_per_host=1, backend=None)
    assert set(Path(tempfile.gettempdir()).glob("torchrunx-*")) <= private_dirs


@on_ray
def test_ray_warm_agent_whose_actor_is_killed_between_runs_is_replaced(ray_cluster, ray_hosts):

    def where_now() -> tuple[str, int]:
        return socket.gethostname(), os.getppid()

    launcher = trx.Launcher(
        hostnames=ray_hosts, workers_per_host=1, backend=None, restart_on=("hosts",), max_restarts=1
    )
    with launcher.warm() as warm:
        first = warm.run(where_now).ranks
        kill_actor_of_host(ray_cluster, 1)  # between runs: the agent's tree goes with its actor
        wait_gone(first[1][1], 30)  # host 1's agent (the worker's parent)
        second_run = warm.run(where_now).ranks
    assert [host for host, _ in second_run] == ["rnode1", "rnode2"]
    assert second_run[0][1] == first[0][1]  # host 0 keeps its agent
    assert second_run[1][1] != first[1][1]  # host 1 has a new one, started by a new actor


CTRL_C_SCRIPT = """
import os, sys, time
from pathlib import Path
import torchrunx as trx

def wait(folder):
    Path(folder, os.environ["RANK"]).touch()
    time.sleep(600)

trx.launch(wait, func_args=(sys.argv[2],), hostnames=sys.argv[1], workers_per_host=1, backend=None)
"""


@on_ray
def test_ray_ctrl_c_while_ranks_run_ends_everything_it_made(ray_cluster, ray_hosts, tmp_path):
    import signal
    import subprocess
    import sys

    script = tmp_path / "launch.py"
    script.write_text(CTRL_C_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    launcher = subprocess.Popen(
        [sys.executable, str(script), ray_hosts, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / str(rank)).exists() for rank in range(2)):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode != 0
    assert "KeyboardInterrupt" in stderr


@on_ray
def test_ray_killed_node_is_an_agent_failure_naming_the_node(ray_cluster, ray_hosts, tmp_path):
    second = ray_cluster.hosts.hosts[1]
    began = time.monotonic()
    # the node stays dead: this is the module's last test
    error = fault_while_ranks_run(
        ray_hosts, tmp_path, lambda: ray_cluster.kill_node(second), agent_timeout=3
    )
    assert error.hostname == second.address
    assert second.address in str(error)
    assert time.monotonic() - began < 60
