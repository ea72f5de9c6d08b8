"""The Kubernetes engine against a ``kubectl`` stand-in (tests/kubectl_standin.py).

No Kubernetes cluster can run here, so pods are mapped to the namespace test hosts by a script
that answers the two kubectl commands torchrunx uses (``get pods -o json``, ``exec -i``) as
kubectl documents them. Every call is logged, so the tests check the exact command lines too.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx.engines.command import AGENT_ARGV
from torchrunx.engines.kubernetes import KubernetesProvider, read_pods

STANDIN = Path(__file__).with_name("kubectl_standin.py")


class Kubectl:
    """The stand-in, on PATH as ``kubectl``, with a pod table and a log of every call."""

    def __init__(self, folder: Path) -> None:
        self.bin = folder / "bin"
        self.bin.mkdir()
        self.path = self.bin / "kubectl"
        self.path.write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} "$@"\n')
        self.path.chmod(0o755)
        self.table = folder / "pods.json"
        self.log = folder / "calls.jsonl"
        self.log.touch()

    def pods(
        self, pods: list[dict[str, object]], contexts: tuple[str, ...] = ("kind-test", "prod")
    ) -> None:
        table = {
            "current-context": contexts[0],
            "contexts": {c: {"namespace": "default"} for c in contexts},
            "pods": pods,
        }
        self.table.write_text(json.dumps(table))

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def kubectl(tmp_path, monkeypatch):
    standin = Kubectl(tmp_path)
    monkeypatch.setenv("PATH", f"{standin.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KUBECTL_STANDIN_PODS", str(standin.table))
    monkeypatch.setenv("KUBECTL_STANDIN_LOG", str(standin.log))
    return standin


def _pod(name: str, **fields: object) -> dict[str, object]:
    return {
        "name": name,
        "namespace": "ml",
        "context": "prod",
        "phase": "Running",
        "podIP": "10.0.0.1",
        "labels": {"app": "trainer"},
        "containers": [{"name": "trainer"}],
        **fields,
    }


def test_provider_takes_the_selected_running_pods_in_the_jobs_order(kubectl):
    index = "batch.kubernetes.io/job-completion-index"
    kubectl.pods(
        [
            _pod(
                "train-10", annotations={index: "10"}, containers=[{"name": "trainer", "gpus": 8}]
            ),
            _pod("train-2", annotations={index: "2"}, containers=[{"name": "trainer", "gpus": 8}]),
            _pod(
                "train-0",
                annotations={index: "0"},
                containers=[{"name": "sidecar"}, {"name": "trainer", "gpus": 8}],
            ),
            _pod("other-0", labels={"app": "eval"}),
            _pod("train-x", namespace="default"),  # another namespace: not picked
        ]
    )
    hosts = KubernetesProvider().hosts(
        "app=trainer?namespace=ml&context=prod&container=trainer", {}
    )
    assert [(h.hostname, h.workers) for h in hosts] == [
        ("train-0", 8),
        ("train-2", 8),
        ("train-10", 8),
    ]
    get = kubectl.calls()[-1]
    assert get[:2] == ["--context=prod", "--namespace=ml"]
    assert get[2:4] == ["get", "pods"] and get[-4:] == ["-l", "app=trainer", "-o", "json"]


def test_provider_counts_gpus_of_the_container_exec_enters_and_orders_pytorchjobs(kubectl):
    replica = {
        "training.kubeflow.org/replica-type": "worker",
        "training.kubeflow.org/replica-index": "0",
    }
    kubectl.pods(
        [
            _pod(
                "job-worker-0",
                labels={"app": "trainer", **replica},
                containers=[{"name": "pytorch", "gpus": 4}],
            ),
            _pod(
                "job-master-0",
                labels={
                    "app": "trainer",
                    **replica,
                    "training.kubeflow.org/replica-type": "master",
                },
                containers=[{"name": "pytorch", "gpus": 4}, {"name": "sidecar", "gpus": 1}],
            ),
            _pod(
                "job-cpu-0", labels={"app": "trainer", "training.kubeflow.org/replica-index": "1"}
            ),
        ]
    )
    hosts = KubernetesProvider().hosts("app=trainer?namespace=ml&context=prod", {})
    # master first, then by replica index; a pod without GPUs lets its agent count
    assert [(h.hostname, h.workers) for h in hosts] == [
        ("job-master-0", 4),
        ("job-worker-0", 4),
        ("job-cpu-0", None),
    ]


def test_provider_refuses_pods_that_do_not_run_and_selectors_that_match_none(kubectl):
    kubectl.pods(
        [_pod("train-0"), _pod("train-1", phase="Pending"), _pod("train-2", deleting=True)]
    )
    with pytest.raises(
        RuntimeError, match=r"2 of 3 pods do not run: train-1 \(Pending\), train-2 \(deleting\)"
    ):
        trx.Launcher(hostnames="kubernetes:app=trainer?namespace=ml&context=prod").plan()
    with pytest.raises(
        RuntimeError, match="no pod matches 'app=nothing' in namespace ml of context prod"
    ):
        trx.Launcher(hostnames="kubernetes:app=nothing?namespace=ml&context=prod").plan()
    with pytest.raises(ValueError, match="needs a label selector"):
        trx.Launcher(hostnames="kubernetes").plan()
    with pytest.raises(ValueError, match="cannot read 'zone=eu'"):
        trx.Launcher(hostnames="kubernetes:app=trainer?zone=eu").plan()


def test_kubectl_missing_is_named_with_the_option_that_fixes_it(kubectl, monkeypatch):
    with pytest.raises(
        RuntimeError, match="'/no/kubectl' not found: install kubectl, or give its path"
    ):
        trx.Launcher(hostnames="kubernetes:app=trainer?kubectl=/no/kubectl").plan()
    with pytest.raises(trx.AgentFailedError, match="not found: install kubectl") as info:
        trx.launch(
            os.getpid,
            hostnames=["pod-a"],
            agent_start="kubectl:kubectl=/no/kubectl",
            workers_per_host=1,
            backend=None,
        )
    assert info.value.hostname == "pod-a"


def test_a_pod_that_is_not_there_fails_its_host_by_name(kubectl):
    kubectl.pods([_pod("train-0")])
    with pytest.raises(
        trx.AgentFailedError, match="cannot find pod ghost-0 in namespace ml of context prod"
    ) as info:
        trx.launch(
            os.getpid,
            hostnames=["ghost-0"],
            agent_start="kubectl:namespace=ml&context=prod",
            workers_per_host=1,
            backend=None,
        )
    assert info.value.hostname == "ghost-0"
    assert 'pods "ghost-0" not found' in str(info.value)


def test_dry_run_shows_the_provider_and_the_kubectl_command(kubectl):
    kubectl.pods(
        [
            _pod("train-0", containers=[{"name": "trainer", "gpus": 2}]),
            _pod("train-1", containers=[{"name": "trainer", "gpus": 2}]),
        ]
    )
    text = trx.Launcher(
        hostnames="kubernetes:app=trainer?namespace=ml&context=prod&container=trainer"
    ).dry_run()
    assert (
        "hosts from: host provider kubernetes (app=trainer?namespace=ml&context=prod&container=trainer)"
        in text
    )
    assert "agent start: kubectl:namespace=ml&context=prod&container=trainer (2 hosts)" in text
    assert "world size: 4" in text
    assert (
        "train-1: kubectl --context=prod --namespace=ml exec -i train-1 -c trainer -- bash --noprofile"
        in text
    )


def test_read_pods_takes_one_pod_or_a_list_and_refuses_other_text():
    pod = {
        "kind": "Pod",
        "metadata": {"name": "a"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]},
        "status": {"phase": "Running", "podIP": "10.1.2.3"},
    }
    assert [(p.name, p.gpus, p.ip, p.running) for p in read_pods(json.dumps(pod))] == [
        ("a", 2, "10.1.2.3", True)
    ]
    listed = {
        "kind": "List",
        "items": [pod, {**pod, "metadata": {"name": "b", "deletionTimestamp": "x"}}],
    }
    assert [(p.name, p.running) for p in read_pods(json.dumps(listed))] == [
        ("a", True),
        ("b", False),
    ]
    assert read_pods(json.dumps(pod), container="other")[0].gpus == 0
    with pytest.raises(ValueError, match="cannot read kubectl's pod list"):
        read_pods("error: You must be logged in to the server (Unauthorized)")


# -- on the namespace test hosts ------------------------------------------------------------


def _cluster_pods(cluster, **extra: object) -> list[dict[str, object]]:
    return [
        _pod(
            f"train-{i}",
            podIP=host.address,
            enter=cluster.enter_argv(host),
            annotations={"batch.kubernetes.io/job-completion-index": str(i)},
            **extra,
        )
        for i, host in enumerate(cluster.hosts)
    ]


def where() -> dict[str, object]:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {"host": socket.gethostname(), "rank": int(os.environ["RANK"]), "sum": total.item()}


@pytest.mark.cluster
def test_pods_by_selector_run_the_function_through_kubectl_exec(cluster, kubectl):
    kubectl.pods(_cluster_pods(cluster))
    result = trx.launch(
        where,
        hostnames="kubernetes:app=trainer?namespace=ml&context=prod&container=trainer",
        workers_per_host=2,
        backend="gloo",
    )
    assert list(result.results) == ["train-0", "train-1"]
    assert [r["host"] for r in result.ranks] == [n for n in cluster.names() for _ in (0, 1)]
    assert all(r["sum"] == 6.0 for r in result.ranks)
    execs = [c for c in kubectl.calls() if "exec" in c]
    assert sorted(c[c.index("exec") + 2] for c in execs) == ["train-0", "train-1"]
    for call in execs:  # the documented form; nothing but the constant command on the line
        assert call[:5] == ["--context=prod", "--namespace=ml", "exec", "-i", call[4]]
        assert call[5:8] == ["-c", "trainer", "--"]
        assert call[8:] == list(AGENT_ARGV)


@pytest.mark.cluster
def test_a_raising_rank_and_warm_agents_over_kubectl(cluster, kubectl):
    kubectl.pods(_cluster_pods(cluster))

    def fail_on_rank_1() -> None:
        if int(os.environ["RANK"]) == 1:
            raise KeyError("no such shard")

    with pytest.raises(KeyError, match="no such shard") as info:
        trx.launch(
            fail_on_rank_1,
            hostnames=["train-0", "train-1"],
            agent_start="kubectl:namespace=ml&context=prod",
            workers_per_host=1,
            backend=None,
        )
    assert "train-1" in "\n".join(getattr(info.value, "__notes__", []))
    launcher = trx.Launcher(
        hostnames="kubernetes:app=trainer?namespace=ml&context=prod",
        workers_per_host=1,
        backend=None,
    )
    with launcher.warm(keep_workers=True) as warm:
        first = warm.run(os.getpid).ranks
        second = warm.run(os.getpid).ranks
    assert first == second


@pytest.mark.cluster
def test_the_kubernetes_example_launches_on_the_selected_pods(cluster, kubectl, tmp_path):
    from test_examples import run_example

    kubectl.pods(_cluster_pods(cluster))
    script = Path(__file__).resolve().parent.parent / "examples" / "kubernetes" / "launch.py"
    args = ["--selector", "app=trainer", "--namespace", "ml", "--context", "prod", "--workers", "1"]
    done = run_example(script, args, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (
        "agent start: kubectl:namespace=ml&context=prod&container=trainer (2 hosts)" in done.stdout
    )
    assert "pod train-0: ranks [0], each saw a world of 2" in done.stdout
    assert "pod train-1: ranks [1], each saw a world of 2" in done.stdout


@pytest.mark.cluster
def test_pods_that_cannot_reach_the_launcher_relay_over_kubectl_exec(cluster, kubectl):
    # relay="on": the launcher listens on 127.0.0.1 only, which the pods (the test hosts'
    # namespaces) cannot reach: every connection travels over `kubectl exec -i`'s stdio.
    kubectl.pods(_cluster_pods(cluster))
    result = trx.launch(
        where,
        hostnames="kubernetes:app=trainer?namespace=ml&context=prod&container=trainer",
        workers_per_host=2,
        backend="gloo",
        relay="on",
    )
    assert [r["host"] for r in result.ranks] == [n for n in cluster.names() for _ in (0, 1)]
    assert all(r["sum"] == 6.0 for r in result.ranks)


@pytest.mark.cluster
def test_code_ships_over_kubectl_exec(cluster, kubectl, tmp_path, monkeypatch):
    # The same exchange as over SSH, on `kubectl exec -i`'s stdio; the cache is the test's.
    kubectl.pods(_cluster_pods(cluster))
    project = tmp_path / "project"
    project.mkdir()
    (project / "settings.txt").write_text("kubectl\n")
    monkeypatch.chdir(project)
    monkeypatch.setenv("TORCHRUNX_CACHE_DIR", str(tmp_path / "cache"))
    result = trx.launch(
        _cwd_and_settings,
        hostnames="kubernetes:app=trainer?namespace=ml&context=prod&container=trainer",
        workers_per_host=1,
        backend=None,
        ship=(".",),
        extra_env_vars=("TORCHRUNX_CACHE_DIR",),
    )
    trees = tmp_path / "cache" / "code" / "trees"
    for cwd, settings in result.ranks:
        assert cwd.startswith(str(trees) + "/"), cwd
        assert settings == "kubectl\n"


def _cwd_and_settings() -> tuple[str, str]:
    with open("settings.txt") as f:
        return os.getcwd(), f.read()
