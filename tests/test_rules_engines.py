"""Rules of the engines (pure): kubectl's options and pods, Ray's nodes, which transport starts what."""

from __future__ import annotations

import json

import pytest

from torchrunx import plugins
from torchrunx.engines.command import AGENT_ARGV
from torchrunx.engines.kubernetes import (
    KubectlOptions,
    KubectlTransport,
    KubernetesProvider,
    parse_options,
    read_pods,
    split_provider_argument,
)
from torchrunx.engines.ray import RayProvider, RayTransport, node_table, ordered, ray_address
from torchrunx.engines.ray_actor import agent_environ
from torchrunx.launcher.settings.plan import check_agent_start, paired_transport, start_methods
from torchrunx.launcher.settings.resolve import hostnames_source

# -- kubectl ----------------------------------------------------------------------------------


def test_options_are_key_value_entries_joined_by_ampersands():
    assert parse_options(None, "x") == KubectlOptions()
    assert parse_options("", "x") == KubectlOptions()
    assert parse_options(
        "namespace=ml&context=prod&container=c&kubectl=/bin/k", "x"
    ) == KubectlOptions(namespace="ml", context="prod", container="c", kubectl="/bin/k")
    assert parse_options("namespace=ml&&", "x") == KubectlOptions(namespace="ml")
    assert parse_options("context=kind=x", "x") == KubectlOptions(context="kind=x")  # the first =
    for bad in ("namespace", "zone=eu", "namespace=", "=ml"):
        with pytest.raises(
            ValueError, match=rf"^where: cannot read {bad!r}; expected KEY=VALUE"
        ) as info:
            parse_options(f"context=a&{bad}", "where")
        assert "namespace, context, container, kubectl" in str(info.value)


def test_the_provider_argument_is_a_selector_then_options():
    assert split_provider_argument("app=x") == ("app=x", KubectlOptions())
    assert split_provider_argument(" app in (a,b),tier!=db ?namespace=ml") == (
        "app in (a,b),tier!=db",
        KubectlOptions(namespace="ml"),
    )
    message = (
        "hostnames='kubernetes' needs a label selector: 'kubernetes:SELECTOR', for example "
        "'kubernetes:jobset.sigs.k8s.io/jobset-name=train' or "
        "'kubernetes:app=trainer?namespace=ml&context=prod'"
    )
    for empty in (None, "", "?namespace=ml", "  "):
        with pytest.raises(ValueError, match=r"^hostnames='kubernetes' needs") as info:
            split_provider_argument(empty)
        assert str(info.value) == message
    with pytest.raises(
        ValueError, match=r"^hostnames='kubernetes:...\?OPTIONS': cannot read 'ns=ml'"
    ):
        split_provider_argument("app=x?ns=ml")


def test_kubectl_command_lines_follow_its_documented_form():
    options = KubectlOptions(namespace="ml", context="prod", container="trainer", kubectl="kc")
    assert options.exec_argv("pod-0") == [
        "kc",
        "--context=prod",
        "--namespace=ml",
        "exec",
        "-i",
        "pod-0",
        "-c",
        "trainer",
        "--",
        *AGENT_ARGV,
    ]
    assert KubectlOptions().exec_argv("p") == ["kubectl", "exec", "-i", "p", "--", *AGENT_ARGV]
    assert options.get_argv(selector="app=x") == [
        "kc",
        "--context=prod",
        "--namespace=ml",
        "get",
        "pods",
        "--request-timeout=30s",
        "-l",
        "app=x",
        "-o",
        "json",
    ]
    assert KubectlOptions().get_argv(names=["a", "b"]) == [
        "kubectl",
        "get",
        "pods",
        "--request-timeout=30s",
        "a",
        "b",
        "-o",
        "json",
    ]
    assert options.where() == "namespace ml of context prod"
    assert KubectlOptions().where() == "the default namespace of the current context"
    assert (
        KubectlTransport("container=t")
        .describe("p")
        .startswith("kubectl exec -i p -c t -- bash --noprofile")
    )


def _pod(name: str, containers: list[dict[str, object]], **meta: object) -> dict[str, object]:
    return {
        "metadata": {"name": name, **meta},
        "spec": {"containers": containers},
        "status": {"phase": "Running", "podIP": "10.0.0.9"},
    }


def test_a_pods_gpus_are_those_of_the_container_exec_enters():
    gpu = {"limits": {"nvidia.com/gpu": "4"}}
    pods = [
        _pod("first", [{"name": "a", "resources": gpu}, {"name": "b"}]),
        _pod(
            "default",
            [{"name": "a"}, {"name": "b", "resources": gpu}],
            annotations={"kubectl.kubernetes.io/default-container": "b"},
        ),
        _pod("requests", [{"name": "a", "resources": {"requests": {"nvidia.com/gpu": 2}}}]),
        _pod("none", []),
    ]
    text = json.dumps({"kind": "List", "items": pods})
    assert [(p.name, p.gpus) for p in read_pods(text)] == [
        ("first", 4),
        ("default", 4),
        ("requests", 2),
        ("none", 0),
    ]
    assert [p.gpus for p in read_pods(text, container="b")] == [0, 4, 0, 0]
    assert [p.gpus for p in read_pods(text, container="zzz")] == [0, 0, 0, 0]


def test_a_pod_runs_only_when_running_and_not_being_deleted():
    base = _pod("p", [])
    cases = [
        (base, ("Running", "10.0.0.9", True)),
        ({**base, "status": {"phase": "Pending"}}, ("Pending", None, False)),
        ({**base, "status": {}}, ("Unknown", None, False)),
        (
            {**base, "metadata": {"name": "p", "deletionTimestamp": "t"}},
            ("Running", "10.0.0.9", False),
        ),
    ]
    for item, expected in cases:
        (pod,) = read_pods(json.dumps(item))
        assert (pod.phase, pod.ip, pod.running) == expected
    for text in ("", "[]", '{"kind": "List"}', '{"kind": "Pod"}', "null"):
        with pytest.raises(ValueError, match="cannot read kubectl's pod list"):
            read_pods(text)


def test_pods_come_in_the_jobs_own_order():
    def pod(name: str, **marks: str) -> dict[str, object]:
        return _pod(name, [], labels=marks)

    index = "batch.kubernetes.io/job-completion-index"
    replica = "training.kubeflow.org/replica-index"
    jobset = "jobset.sigs.k8s.io/job-index"
    items = [
        pod("w-10"),
        pod("w-9"),
        pod("j1-0", **{jobset: "1", index: "0"}),
        pod("i-a", **{index: "1"}),
        pod("g0", **{jobset: "0", replica: "2"}),
        pod("i-b", **{replica: "0"}),
        pod("z-master", **{"training.kubeflow.org/replica-type": "Master"}),
        pod("x", **{index: "not-a-number"}),
    ]
    pods = sorted(read_pods(json.dumps({"kind": "List", "items": items})), key=lambda p: p.order)
    # the master first; then job 0 (unset is 0) by index; the unindexed by natural name; job 1
    assert [p.name for p in pods] == ["z-master", "i-b", "i-a", "g0", "w-9", "w-10", "x", "j1-0"]


def test_a_pod_being_deleted_is_said_to_be_deleting_else_its_phase():
    base = _pod("p", [])
    deleting = {**base, "metadata": {"name": "p", "deletionTimestamp": "t"}}
    pending = {**base, "status": {"phase": "Pending", "podIP": ""}}
    (running,) = read_pods(json.dumps(base))
    (gone,) = read_pods(json.dumps(deleting))
    (waiting,) = read_pods(json.dumps(pending))
    assert (running.state, gone.state, waiting.state) == ("Running", "deleting", "Pending")
    assert waiting.ip is None  # an empty podIP is no address


def test_an_empty_pod_list_is_no_pod_not_an_unreadable_answer():
    assert read_pods(json.dumps({"kind": "List", "items": []})) == []


def test_the_master_comes_first_within_its_job_not_before_the_jobs_before_it():
    def pod(name: str, **marks: str) -> dict[str, object]:
        return _pod(name, [], labels=marks)

    jobset = "jobset.sigs.k8s.io/job-index"
    kind = "training.kubeflow.org/replica-type"
    items = [
        pod("b-worker", **{jobset: "1"}),
        pod("b-master", **{jobset: "1", kind: "Master"}),
        pod("a-worker", **{jobset: "0"}),
        pod("plain-master", **{kind: "master"}),  # the training operator's label is lower case
    ]
    pods = sorted(read_pods(json.dumps({"kind": "List", "items": items})), key=lambda p: p.order)
    assert [p.name for p in pods] == ["plain-master", "a-worker", "b-master", "b-worker"]


def test_the_kubernetes_provider_pairs_with_kubectl_and_its_options():
    provider = KubernetesProvider()
    assert provider.transport("app=x") == "kubectl"
    assert provider.transport(None) == "kubectl"
    assert provider.transport("app=x?") == "kubectl"
    assert provider.transport("app=x?namespace=ml&context=c") == "kubectl:namespace=ml&context=c"
    assert provider.detect({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) is False


# -- Ray ----------------------------------------------------------------------------------------


def _node(
    address: str, alive: bool = True, cpus: float = 2, gpus: float = 0, name: str = ""
) -> dict[str, object]:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {
        "NodeID": address,
        "Alive": alive,
        "NodeManagerAddress": address,
        "NodeManagerHostname": name or f"host-{address}",
        "Resources": resources,
    }


def test_ray_hosts_are_alive_nodes_that_can_run_work_by_address_and_unique_name():
    nodes = [
        _node("10.0.0.2", name="gpu-a", gpus=8),
        _node("10.0.0.3", alive=False),
        _node("10.0.0.4", cpus=0, name="head"),
        _node("10.0.0.5", name="same"),
        _node("10.0.0.6", name="same", cpus=0, gpus=1),
        _node("10.0.0.7", cpus=1, name="small"),
        {"NodeID": "n8", "Alive": True, "NodeManagerAddress": "10.0.0.8", "Resources": {"GPU": 1}},
        {"NodeID": "n9", "NodeManagerAddress": "10.0.0.9", "Resources": {"CPU": 4}},
        {
            "NodeID": "n10",
            "Alive": True,
            "NodeManagerAddress": "10.0.0.10",
            "Resources": {"memory": 1},
        },
    ]
    table = node_table(nodes)
    assert sorted(table) == [
        "10.0.0.2",
        "10.0.0.5",
        "10.0.0.6",
        "10.0.0.7",
        "10.0.0.8",
        "gpu-a",
        "small",
    ]
    assert table["gpu-a"] is table["10.0.0.2"]
    assert node_table([]) == {}


def test_ray_addresses_sort_as_numbers_and_the_address_comes_from_the_argument_or_env():
    assert ordered(["10.0.0.10", "fd00::1", "10.0.0.9", "c", "::1", "b", "10.0.1.1"]) == [
        "10.0.0.9",
        "10.0.0.10",
        "10.0.1.1",
        "::1",
        "fd00::1",
        "b",
        "c",
    ]
    assert ray_address("h:1", {"RAY_ADDRESS": "e:2"}) == "h:1"
    assert ray_address(None, {"RAY_ADDRESS": "e:2"}) == "e:2"
    assert ray_address(None, {}) == "auto"
    assert RayProvider().transport(None) == "ray"
    assert RayProvider().transport("h:1") == "ray:h:1"
    assert RayProvider().detect({"RAY_ADDRESS": "h:1"}) is False
    assert "a Ray actor on node 10.0.0.2 (cluster h:1;" in RayTransport("h:1").describe("10.0.0.2")


def test_the_agent_started_by_an_actor_gets_the_nodes_environment_less_rays():
    environ = {
        "RAY_JOB_ID": "01",
        "RAY_RAYLET_PID": "7",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "PATH": "/bin",
        "XRAY": "x",
        "PYTHONBREAKPOINT": "ray.util.rpdb.set_trace",  # Ray's debugger, set for its workers
    }
    assert agent_environ(environ) == {"CUDA_VISIBLE_DEVICES": "2,3", "PATH": "/bin", "XRAY": "x"}
    own = {"PYTHONBREAKPOINT": "ipdb.set_trace"}  # the node's own choice stays
    assert agent_environ(own) == own


# -- which transport starts each host -----------------------------------------------------------


def test_a_paired_transport_starts_every_host_unless_agent_start_names_another():
    hosts = ["localhost", "10.9.9.9"]
    assert start_methods("auto", hosts, "ray:h:1") == (["ray", "ray"], "h:1")
    assert start_methods("auto", hosts, "kubectl") == (["kubectl", "kubectl"], None)
    assert start_methods("ssh", hosts, "ray") == (["local", "ssh"], None)
    assert start_methods("auto", hosts, None) == (["local", "ssh"], None)
    assert start_methods("kubectl:namespace=ml", hosts) == (["kubectl", "kubectl"], "namespace=ml")
    assert start_methods("local", hosts) == (["local", "local"], None)
    assert paired_transport(hostnames_source(["node1"])) is None
    assert paired_transport(hostnames_source("ray:h:1")) == "ray:h:1"
    source = hostnames_source("kubernetes:app=x?namespace=ml")
    assert paired_transport(source) == "kubectl:namespace=ml"


def test_agent_start_must_name_a_transport_that_takes_its_argument():
    for good in (
        "auto",
        "ssh",
        "srun",
        "local",
        "ray",
        "ray:h:1",
        "kubectl",
        "kubectl:namespace=ml",
    ):
        check_agent_start(good)
    with pytest.raises(
        ValueError,
        match=r"agent_start='rsh': no transport named 'rsh' \(known: auto, kubectl, local, ray, srun, ssh;",
    ):
        check_agent_start("rsh")
    with pytest.raises(
        ValueError, match=r"agent_start=ssh:'x': the ssh transport takes no argument"
    ):
        check_agent_start("ssh:x")
    with pytest.raises(ValueError, match=r"agent_start='kubectl:zone=eu': cannot read 'zone=eu'"):
        check_agent_start("kubectl:zone=eu")
    with pytest.raises(TypeError, match="agent_start must be a string"):
        check_agent_start(["ssh"])
    assert plugins.transport_spec("ray:h:1") == ("ray", "h:1")
    assert plugins.transport_spec("ssh") == ("ssh", None)
    assert plugins.transport_spec("kubectl:") == ("kubectl", "")


def test_a_transport_has_every_capability_as_an_attribute_false_unless_declared():
    from torchrunx.engines.builtin import LocalTransport, SrunTransport, SshTransport
    from torchrunx.engines.kubernetes import KubectlTransport
    from torchrunx.engines.protocol import CAPABILITIES, Transport, with_declared_capabilities

    class Structural:  # the form docs/engines.md shows: only what it has
        name = "docker"
        remote = True
        relays = True

    made = with_declared_capabilities(Structural())
    assert (made.relays, made.ships, made.containers, made.container_options) == (
        True,
        False,
        False,
        False,
    )
    assert isinstance(made, Transport) is False  # no start(): the loader refuses it first
    assert {c: getattr(LocalTransport(), c) for c in CAPABILITIES} == dict.fromkeys(
        CAPABILITIES, False
    )
    assert (SshTransport.relays, SshTransport.ships, SshTransport.containers) == (True,) * 3
    assert not SshTransport.container_options
    assert SrunTransport.container_options
    assert KubectlTransport.relays
    assert not KubectlTransport.containers

    class Slotted:
        __slots__ = ()
        name = "slotted"
        remote = False

    with pytest.raises(TypeError, match="declare relays = False"):
        with_declared_capabilities(Slotted())


def test_the_transport_loader_gives_a_plugin_the_capabilities_it_leaves_out(monkeypatch):
    class Minimal:
        name = "minimal"
        remote = True

        def __init__(self, argument):
            self.argument = argument

        def start(self, start):
            raise NotImplementedError

        def describe(self, hostname):
            return hostname

        def close(self):
            pass

    monkeypatch.setitem(plugins._BUILTIN_TRANSPORTS, "minimal", "tests:unused")
    monkeypatch.setattr(plugins, "_import_ref", lambda _ref: Minimal)
    made = plugins.transport("minimal", "x")
    assert made.argument == "x"
    assert not (made.relays or made.ships or made.containers or made.container_options)
