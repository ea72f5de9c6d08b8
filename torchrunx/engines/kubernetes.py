"""Kubernetes: the pods of a job as hosts, and agents started with ``kubectl exec -i``.

``hostnames="kubernetes:SELECTOR"`` takes the pods that a label selector picks (the pods of a
JobSet, an Indexed Job or a PyTorchJob), in the job's own order, each with the GPUs its
container requests (``nvidia.com/gpu``); their agents start with the ``kubectl`` transport::

    kubectl [--context=C] [--namespace=N] exec -i POD [-c CONTAINER] -- bash ... -c ...

The secret and the environment go on stdin, as over SSH. Options follow a ``?`` after the
selector, or the ``:`` of ``agent_start="kubectl:..."``: ``namespace=``, ``context=``,
``container=`` and ``kubectl=`` (the client's path), joined with ``&``.

Only ``kubectl get pods -o json`` (by selector or by names) and ``kubectl exec -i`` are used,
as kubectl documents them; no Kubernetes API client is needed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchrunx.engines.builtin import agent_route
from torchrunx.engines.command import AGENT_ARGV, CommandAgent
from torchrunx.engines.protocol import Transport
from torchrunx.errors import AgentFailedError
from torchrunx.hosts.hostlists import HostSlots

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from torchrunx.engines.protocol import AgentProcess, AgentStart

GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource that GPUs are requested by (the NVIDIA device plugin's)."""

_OPTIONS = ("namespace", "context", "container", "kubectl")
_GET_TIMEOUT = 30.0
"""Seconds a ``kubectl get`` may take (``--request-timeout`` too)."""

# The orders the usual job controllers give their pods, first match wins.
_INDEX_KEYS = (
    "batch.kubernetes.io/job-completion-index",  # Indexed Job (and each job of a JobSet)
    "training.kubeflow.org/replica-index",  # PyTorchJob (Kubeflow training operator)
)
_GROUP_KEYS = ("jobset.sigs.k8s.io/job-index",)
_REPLICA_TYPE_KEY = "training.kubeflow.org/replica-type"


@dataclass(frozen=True)
class KubectlOptions:
    """How ``kubectl`` is called: its context, namespace, the container, the client's path."""

    namespace: str | None = None
    context: str | None = None
    container: str | None = None
    kubectl: str = "kubectl"

    def base(self) -> list[str]:
        """``kubectl`` with the global flags (``--context``, ``--namespace``)."""
        argv = [self.kubectl]
        if self.context:
            argv.append(f"--context={self.context}")
        if self.namespace:
            argv.append(f"--namespace={self.namespace}")
        return argv

    def exec_argv(self, pod: str) -> list[str]:
        """The command that starts the agent in ``pod``: ``kubectl exec -i POD -- AGENT``."""
        argv = [*self.base(), "exec", "-i", pod]
        if self.container:
            argv += ["-c", self.container]
        return [*argv, "--", *AGENT_ARGV]

    def get_argv(self, *, selector: str | None = None, names: Sequence[str] = ()) -> list[str]:
        """``kubectl get pods`` as JSON, by label selector or by names."""
        argv = [*self.base(), "get", "pods", f"--request-timeout={int(_GET_TIMEOUT)}s"]
        if selector is not None:
            argv += ["-l", selector]
        return [*argv, *names, "-o", "json"]

    def where(self) -> str:
        """Where the pods are looked for, for messages."""
        namespace = f"namespace {self.namespace}" if self.namespace else "the default namespace"
        context = f"context {self.context}" if self.context else "the current context"
        return f"{namespace} of {context}"


def parse_options(text: str | None, what: str) -> KubectlOptions:
    """``"namespace=ml&context=prod"`` as options (``None`` or ``""``: the defaults).

    Raises:
        ValueError: An entry is not ``KEY=VALUE`` or names no option; ``what`` says whose.
    """
    values: dict[str, str] = {}
    for entry in filter(None, (text or "").split("&")):
        key, sep, value = entry.partition("=")
        if not sep or key not in _OPTIONS or not value:
            raise ValueError(
                f"{what}: cannot read {entry!r}; expected KEY=VALUE entries joined with '&', "
                f"KEY one of {', '.join(_OPTIONS)} (for example namespace=ml&context=prod)"
            )
        values[key] = value
    return KubectlOptions(**values)


def split_provider_argument(argument: str | None) -> tuple[str, KubectlOptions]:
    """``"SELECTOR?OPTIONS"`` of ``hostnames="kubernetes:..."`` as the selector and the options.

    Raises:
        ValueError: No selector, or options that cannot be read.
    """
    selector, _, options = (argument or "").partition("?")
    if not selector.strip():
        raise ValueError(
            "hostnames='kubernetes' needs a label selector: 'kubernetes:SELECTOR', for example "
            "'kubernetes:jobset.sigs.k8s.io/jobset-name=train' or "
            "'kubernetes:app=trainer?namespace=ml&context=prod'"
        )
    return selector.strip(), parse_options(options, "hostnames='kubernetes:...?OPTIONS'")


@dataclass(frozen=True)
class Pod:
    """What a launch needs of a pod (read from ``kubectl get pods -o json``)."""

    name: str
    phase: str
    ip: str | None
    gpus: int
    deleting: bool
    order: tuple[Any, ...]

    @property
    def running(self) -> bool:
        """Running and not being deleted."""
        return self.phase == "Running" and not self.deleting

    @property
    def state(self) -> str:
        """Its phase, or ``"deleting"``: what an error says of it."""
        return "deleting" if self.deleting else self.phase


def read_pods(text: str, container: str | None = None) -> list[Pod]:
    """The pods of ``kubectl get pods -o json`` output (a ``List`` or one ``Pod``), unsorted.

    ``gpus`` counts ``nvidia.com/gpu`` of the container the agent runs in: ``container``, else
    the pod's ``kubectl.kubernetes.io/default-container``, else its first container (as
    ``kubectl exec`` picks it).

    Raises:
        ValueError: The text is not that JSON.
    """
    try:
        document = json.loads(text)
        items = document["items"] if document.get("kind") == "List" else [document]
        return [_pod(item, container) for item in items]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"cannot read kubectl's pod list: {exc!r}") from exc


def _pod(item: dict[str, Any], container: str | None) -> Pod:
    meta = item["metadata"]
    status = item.get("status") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    containers = (item.get("spec") or {}).get("containers") or []
    chosen = container or annotations.get("kubectl.kubernetes.io/default-container")
    picked = next((c for c in containers if c.get("name") == chosen), None)
    if picked is None and containers and container is None:
        picked = containers[0]
    resources = (picked or {}).get("resources") or {}
    requested = (resources.get("limits") or {}).get(GPU_RESOURCE) or (
        resources.get("requests") or {}
    ).get(GPU_RESOURCE)
    return Pod(
        name=meta["name"],
        phase=str(status.get("phase", "Unknown")),
        ip=status.get("podIP") or None,
        gpus=int(requested or 0),
        deleting=meta.get("deletionTimestamp") is not None,
        order=_order(meta["name"], {**annotations, **labels}),
    )


def _order(name: str, marks: Mapping[str, str]) -> tuple[Any, ...]:
    """The job's own order: JobSet job index, master first, completion or replica index, name.

    A pod without a job index is in job 0; one without a completion or replica index comes
    after the indexed ones; names compare their numbers as numbers (``w-9`` before ``w-10``).
    """
    group = _number(marks, _GROUP_KEYS)
    index = _number(marks, _INDEX_KEYS)
    master = str(marks.get(_REPLICA_TYPE_KEY)).lower() == "master"
    parts = re.split(r"(\d+)", name)  # text, number, text...: numbers at the odd places
    natural = tuple(int(part) if place % 2 else part for place, part in enumerate(parts))
    return (group or 0, not master, index is None, index or 0, natural)


def _number(marks: Mapping[str, str], keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` whose value is a whole number, as one."""
    for key in keys:
        value = str(marks.get(key))
        if value.isdigit():
            return int(value)
    return None


def run_kubectl(argv: list[str], what: str) -> str:
    """Run a ``kubectl get`` and return its stdout.

    Raises:
        RuntimeError: kubectl is missing, fails or times out; the message has its stderr.
    """
    if shutil.which(argv[0]) is None:
        raise RuntimeError(
            f"{what}: {argv[0]!r} not found: install kubectl, or give its path with the "
            "option kubectl=/path/to/kubectl"
        )
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_GET_TIMEOUT + 5, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what}: {shlex.join(argv)} took over {exc.timeout:g} s") from exc
    if done.returncode != 0:
        raise RuntimeError(
            f"{what}: {shlex.join(argv)} failed ({done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


class KubernetesProvider:
    """``hostnames="kubernetes:SELECTOR[?OPTIONS]"``: the running pods the selector picks."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Never: ``"auto"`` does not pick pods; name the provider and its selector."""
        del environ
        return False

    def hosts(self, argument: str | None, environ: Mapping[str, str]) -> list[HostSlots]:
        """The pods in the job's order; workers: the GPUs of each, else counted by its agent.

        Raises:
            RuntimeError: kubectl failed, no pod matches, or a pod does not run (yet).
            ValueError: The argument cannot be read.
        """
        del environ
        selector, options = split_provider_argument(argument)
        what = f"hostnames='kubernetes:{argument}'"
        pods = sorted(
            read_pods(run_kubectl(options.get_argv(selector=selector), what), options.container),
            key=lambda pod: pod.order,
        )
        if not pods:
            raise RuntimeError(f"{what}: no pod matches {selector!r} in {options.where()}")
        waiting = [f"{pod.name} ({pod.state})" for pod in pods if not pod.running]
        if waiting:
            raise RuntimeError(
                f"{what}: {len(waiting)} of {len(pods)} pods do not run: {', '.join(waiting)}; "
                "launch once every pod of the job runs (kubectl wait --for=condition=Ready ...)"
            )
        return [HostSlots(pod.name, pod.gpus or None) for pod in pods]

    def transport(self, argument: str | None) -> str:
        """``kubectl`` with the provider's options."""
        options = str(argument).partition("?")[2]
        return f"kubectl:{options}" if options else "kubectl"


PROVIDER = KubernetesProvider()


class KubectlTransport(Transport):
    """Agents started with ``kubectl exec -i POD -- AGENT``; the hosts are pod names."""

    name = "kubectl"
    remote = True
    relays = True
    """Its agents can relay connections (``AgentStart.relay``) over ``kubectl exec -i``."""
    ships = True
    """Its agents can fetch shipped code (``AgentStart.ship``) over ``kubectl exec -i``."""

    def __init__(self, argument: str | None = None) -> None:
        """``argument``: ``namespace=``, ``context=``, ``container=``, ``kubectl=`` joined by ``&``.

        Raises:
            ValueError: The argument cannot be read.
        """
        self.options = parse_options(argument, f"agent_start='kubectl:{argument}'")
        self._ips: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def start(self, start: AgentStart) -> AgentProcess:
        """Look the pod up (it must run), then ``kubectl exec -i`` the agent into it."""
        if shutil.which(self.options.kubectl) is None:
            raise AgentFailedError(
                start.hostname,
                f"{self.options.kubectl!r} not found: install kubectl, or give its path with "
                "agent_start='kubectl:kubectl=/path/to/kubectl'",
            )
        address = start.launcher_address or agent_route(start.hostname, self._pod_ip(start))
        return CommandAgent(
            start.hostname,
            self.options.exec_argv(start.hostname),
            dict(start.environ),
            start.script,
            lambda: start.bootstrap(address),
            start.on_line,
            relay=start.relay,
            ship=start.ship,
        )

    def _pod_ip(self, start: AgentStart) -> str:
        """The pod's IP (checked to run); what the launcher's route is looked up with."""
        with self._lock:
            known = self._ips.get(start.hostname)
        if known:
            return known
        argv = self.options.get_argv(names=[start.hostname])
        try:
            pods = read_pods(run_kubectl(argv, "kubectl"), self.options.container)
        except (RuntimeError, ValueError) as exc:
            raise AgentFailedError(
                start.hostname,
                f"cannot find pod {start.hostname} in {self.options.where()}: {exc}",
            ) from exc
        pod = pods[0] if pods else None
        if pod is None or not pod.running or not pod.ip:
            state = "not found" if pod is None else pod.state
            raise AgentFailedError(
                start.hostname, f"pod {start.hostname} does not run ({state}): no agent can start"
            )
        with self._lock:
            self._ips[start.hostname] = pod.ip
        return pod.ip

    def describe(self, hostname: str) -> str:
        """The ``kubectl exec`` command line."""
        return shlex.join(self.options.exec_argv(hostname))

    def close(self) -> None:
        """Nothing is held: each ``kubectl exec`` ended with its agent."""
