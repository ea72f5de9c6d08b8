"""A ``kubectl`` stand-in for the tests: the few subcommands torchrunx uses, on namespace hosts.

No Kubernetes cluster can run on the test machines, so this script answers as kubectl does
(kubectl's documented CLI and JSON output) for what torchrunx calls, and nothing else:

* global flags ``--context=NAME`` / ``--context NAME`` and ``--namespace=NS`` / ``-n NS``;
* ``get pods [-l SELECTOR | --selector=SELECTOR] [NAME ...] [--request-timeout=T] -o json``:
  a ``List`` of ``Pod`` objects (one ``Pod`` for a single name), ``NotFound`` as kubectl says it;
* ``exec -i POD [-c CONTAINER] -- COMMAND ...``: runs COMMAND inside the test host the pod is
  mapped to (its network, mount and UTS namespaces, as a container's process would be), with
  stdin, stdout and stderr passed through, and its exit status.

Anything else fails loudly, so a transport that used more would be caught. The pods come from
the JSON file named by ``KUBECTL_STANDIN_PODS``; every call is appended to the file named by
``KUBECTL_STANDIN_LOG`` (one JSON argv per line), for the tests to check what was called.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

_SET_BASED = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(in|notin)\s*\(([^)]*)\))?\s*$")


def _fail(message: str, code: int = 1) -> None:
    sys.stderr.write(message + "\n")
    sys.exit(code)


def _split_selector(selector: str) -> list[str]:
    """Requirements separated by commas outside parentheses."""
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def matches(labels: dict[str, str], selector: str) -> bool:
    """Whether ``labels`` satisfy a label selector (equality- and set-based, as kubectl reads it)."""
    for requirement in _split_selector(selector):
        for op in ("!=", "==", "="):
            if op in requirement:
                key, value = (part.strip() for part in requirement.split(op, 1))
                if (labels.get(key) == value) == (op == "!="):
                    return False
                break
        else:
            found = _SET_BASED.match(requirement)
            if found is None:
                _fail(f'error: unable to parse requirement: "{requirement}"')
                return False
            negate, key, op, values = found.groups()
            if op:
                wanted = {v.strip() for v in values.split(",")}
                if (labels.get(key) in wanted) != (op == "in"):
                    return False
            elif (key in labels) == bool(negate):
                return False
    return True


def pod_object(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod of the table as the API server returns it."""
    containers = []
    for container in pod.get("containers", [{"name": "main"}]):
        gpus = container.get("gpus", 0)
        resources = (
            {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}}
            if gpus
            else {}
        )
        containers.append(
            {"name": container["name"], "image": "trainer:test", "resources": resources}
        )
    metadata: dict[str, Any] = {
        "name": pod["name"],
        "namespace": pod.get("namespace", "default"),
        "labels": pod.get("labels", {}),
        "annotations": pod.get("annotations", {}),
    }
    if pod.get("deleting"):
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": pod.get("phase", "Running")}
    if pod.get("podIP") and status["phase"] == "Running":
        status["podIP"] = pod["podIP"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": containers},
        "status": status,
    }


def main(argv: list[str]) -> None:
    with open(os.environ["KUBECTL_STANDIN_LOG"], "a") as log:
        log.write(json.dumps(argv) + "\n")
    with open(os.environ["KUBECTL_STANDIN_PODS"]) as f:
        table = json.load(f)
    context = table.get("current-context", "default")
    namespace: str | None = None
    rest: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--":
            rest += ["--", *args]
            break
        if arg.startswith("--context="):
            context = arg.split("=", 1)[1]
        elif arg == "--context":
            context = args.pop(0)
        elif arg.startswith("--namespace="):
            namespace = arg.split("=", 1)[1]
        elif arg in ("-n", "--namespace"):
            namespace = args.pop(0)
        else:
            rest.append(arg)
    if context not in table.get("contexts", {}):
        _fail(f'error: context "{context}" does not exist')
    namespace = namespace or table["contexts"][context].get("namespace", "default")
    pods = [
        p
        for p in table["pods"]
        if p.get("context", context) == context and p.get("namespace", "default") == namespace
    ]
    if rest[:2] == ["get", "pods"] or rest[:2] == ["get", "pod"]:
        _get(rest[2:], pods, namespace)
    elif rest[:1] == ["exec"]:
        _exec(rest[1:], pods)
    else:
        _fail(f"kubectl stand-in: unsupported command {argv!r}", 2)


def _get(args: list[str], pods: list[dict[str, Any]], namespace: str) -> None:  # noqa: C901 (kubectl's flags)
    selector, names, output = None, [], None
    while args:
        arg = args.pop(0)
        if arg in ("-l", "--selector"):
            selector = args.pop(0)
        elif arg.startswith("--selector="):
            selector = arg.split("=", 1)[1]
        elif arg == "-o":
            output = args.pop(0)
        elif arg.startswith("--request-timeout="):
            continue
        elif arg.startswith("-"):
            _fail(f"kubectl stand-in: unsupported get flag {arg!r}", 2)
        else:
            names.append(arg)
    if output != "json":
        _fail("kubectl stand-in: only -o json is supported", 2)
    if names:
        by_name = {p["name"]: p for p in pods}
        missing = [n for n in names if n not in by_name]
        for name in missing:
            sys.stderr.write(f'Error from server (NotFound): pods "{name}" not found\n')
        found = [pod_object(by_name[n]) for n in names if n in by_name]
        if len(names) == 1 and found:
            print(json.dumps(found[0]))
        elif found:
            print(json.dumps({"apiVersion": "v1", "kind": "List", "items": found}))
        sys.exit(1 if missing else 0)
    chosen = [p for p in pods if selector is None or matches(p.get("labels", {}), selector)]
    print(
        json.dumps({"apiVersion": "v1", "kind": "List", "items": [pod_object(p) for p in chosen]})
    )


def _exec(args: list[str], pods: list[dict[str, Any]]) -> None:  # noqa: C901 (kubectl's flags)
    stdin, container, pod_name = False, None, None
    while args and args[0] != "--":
        arg = args.pop(0)
        if arg in ("-i", "--stdin"):
            stdin = True
        elif arg in ("-c", "--container"):
            container = args.pop(0)
        elif arg.startswith("-"):
            _fail(f"kubectl stand-in: unsupported exec flag {arg!r}", 2)
        elif pod_name is None:
            pod_name = arg
        else:
            _fail(
                "error: exec [POD] [COMMAND] is not supported anymore; use exec [POD] -- [COMMAND]"
            )
    command = args[1:]
    if pod_name is None or not command:
        _fail("error: you must specify at least one command for the container")
    pod = next((p for p in pods if p["name"] == pod_name), None)
    if pod is None:
        _fail(f'Error from server (NotFound): pods "{pod_name}" not found')
        return
    if pod.get("phase", "Running") != "Running":
        _fail(
            f"error: cannot exec into a container in a completed pod; current phase is {pod['phase']}"
        )
    names = [c["name"] for c in pod.get("containers", [{"name": "main"}])]
    if container is not None and container not in names:
        _fail(f'error: unable to upgrade connection: container not found ("{container}")')
    if not stdin:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
    enter = pod["enter"]
    os.execvp(enter[0], [*enter, *command])  # noqa: S606 (exec, as kubectl's exec does)


if __name__ == "__main__":
    main(sys.argv[1:])
