"""Ray: a running Ray cluster's nodes as hosts, and agents started by one actor per node.

``hostnames="ray"`` (or ``"ray:ADDRESS"``; else ``RAY_ADDRESS``, else ``"auto"``) connects to the
cluster (``ray.init``) unless this process already is, and takes its alive nodes that have CPUs
or GPUs, by IP address, with their GPUs as workers (else their CPUs). Their agents start with the
``ray`` transport:

- one placement group for the launch, one bundle per host pinned to its node (Ray's
  ``node:IP`` resource, ``STRICT_SPREAD``), each holding 1 CPU and the node's GPUs, so that Ray
  schedules nothing else on them while the launch runs;
- one small actor per host in its bundle (:class:`~torchrunx.engines.ray_actor.AgentRunner`),
  which starts our agent as its own process, writes the script and bootstrap line to its
  stdin, and relays its output; the launcher reads that output through a thread per agent;
- the agent connects back to the launcher over its own authenticated, encrypted connection, as
  over SSH; Ray carries only the start (and the agent's early output).

An actor or node that dies ends its agent (its stdin closes) and is an
:class:`~torchrunx.AgentFailedError` naming the node. The launch's end kills every actor it
made, removes the placement group, and disconnects from Ray if it connected.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import ipaddress
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from torchrunx.engines import ray_actor
from torchrunx.engines.builtin import agent_route
from torchrunx.engines.command import AGENT_ARGV, AgentOutput, PipeReaders, drain
from torchrunx.engines.protocol import Transport
from torchrunx.errors import AgentFailedError
from torchrunx.hosts.hostlists import HostSlots

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torchrunx.engines.protocol import AgentProcess, AgentStart

logger = logging.getLogger("torchrunx.ray")

_READ_WAIT = 1.0
"""Seconds one read of an actor waits for output (a long poll: output comes at once)."""
_STATE: dict[str, Any] = {"owned": False, "open": set()}
"""Whether torchrunx connected this process to Ray (then it disconnects once no launch uses
it), and the transports that use the connection (their ids), launches and warm agents alike."""
_CONNECT_LOCK = threading.Lock()


def _ray() -> Any:  # noqa: ANN401 (Ray's module, untyped)
    try:
        import ray  # noqa: PLC0415 (an optional extra)
    except ImportError as exc:
        raise RuntimeError(
            f"hostnames='ray' and agent_start='ray' need Ray: pip install 'torchrunx[ray]' ({exc})"
        ) from exc
    return ray


def ray_address(argument: str | None, environ: Mapping[str, str]) -> str:
    """The cluster's address: the argument, else ``RAY_ADDRESS``, else ``"auto"``."""
    return argument or environ.get("RAY_ADDRESS") or "auto"


def connect(address: str) -> Any:  # noqa: ANN401 (Ray's module, untyped)
    """Ray, connected to the cluster at ``address`` (once: a connection already made is used).

    Raises:
        RuntimeError: Ray is not installed, or no cluster answers at ``address``.
    """
    ray = _ray()
    with _CONNECT_LOCK:
        if not ray.is_initialized():
            # ray.init points this process's breakpoint() at Ray's debugger (PYTHONBREAKPOINT);
            # a connection torchrunx makes leaves the caller's environment as it was.
            breakpoint_hook = os.environ.get("PYTHONBREAKPOINT")
            # ... and sets a SIGTERM handler of its own (sys.exit) in the main thread, over the
            # launch's (a preemption notice) and past the launch: put the one before it back.
            sigterm = _current_sigterm()
            try:
                ray.init(
                    address=address,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                    namespace="torchrunx",
                )
            except Exception as exc:
                raise RuntimeError(
                    f"cannot connect to the Ray cluster at {address!r}: {exc}; start it (ray start "
                    "--head) or give its address: hostnames='ray:ADDRESS' or RAY_ADDRESS"
                ) from exc
            finally:
                if breakpoint_hook is None:
                    os.environ.pop("PYTHONBREAKPOINT", None)
                else:
                    os.environ["PYTHONBREAKPOINT"] = breakpoint_hook
                if sigterm is not None:
                    signal.signal(signal.SIGTERM, sigterm)
            _STATE["owned"] = True
    return ray


def _current_sigterm() -> Any:  # noqa: ANN401 (a handler, SIG_DFL or SIG_IGN)
    """This process's SIGTERM handler, or None off the main thread (where none can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def disconnect(user: object) -> None:
    """``user`` no longer needs Ray: disconnect if torchrunx connected and nothing else uses it.

    A caller's own ``ray.init`` stays, and so does a connection that warm agents (or a launch
    in another thread) still use.
    """
    with _CONNECT_LOCK:
        _STATE["open"].discard(id(user))
        if _STATE["owned"] and not _STATE["open"]:
            _STATE["owned"] = False
            _ray().shutdown()


def node_table(nodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Alive nodes that can run work, by IP address (and by hostname where it is unique)."""
    usable = [n for n in nodes if n.get("Alive") and _can_work(n["Resources"])]
    table = {str(n["NodeManagerAddress"]): n for n in usable}
    names = collections.Counter(_hostname(n) for n in usable)
    for node in usable:
        name = _hostname(node)
        if name and names[name] == 1:
            table.setdefault(name, node)
    return table


def _can_work(resources: Mapping[str, float]) -> bool:
    return any(resources.get(kind) for kind in ("CPU", "GPU"))


def _hostname(node: Mapping[str, Any]) -> str:
    return str(node.get("NodeManagerHostname") or "")


def ordered(addresses: list[str]) -> list[str]:
    """IPv4 addresses in numeric order, then IPv6 ones, then anything else by name."""
    ips: list[tuple[int, int, str]] = []
    others = []
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:  # noqa: PERF203 (a name, not an address)
            others.append(address)
        else:
            ips.append((ip.version, int(ip), address))
    return [address for *_, address in sorted(ips)] + sorted(others)


class RayProvider:
    """``hostnames="ray"`` or ``"ray:ADDRESS"``: the nodes of a running Ray cluster."""

    def detect(self, environ: Mapping[str, str]) -> bool:
        """Never: ``"auto"`` does not pick a Ray cluster; name the provider."""
        del environ
        return False

    def hosts(self, argument: str | None, environ: Mapping[str, str]) -> list[HostSlots]:
        """Each alive node with CPUs or GPUs, by IP; workers: its GPUs, else its CPUs.

        Raises:
            RuntimeError: Ray is missing, the cluster does not answer, or it has no node.
        """
        ray = connect(ray_address(argument, environ))
        nodes = {str(n["NodeManagerAddress"]): n for n in node_table(ray.nodes()).values()}
        if not nodes:
            raise RuntimeError(
                "hostnames='ray': the Ray cluster has no alive node with CPUs or GPUs"
            )
        hosts = []
        for address in ordered(list(nodes)):
            resources = nodes[address]["Resources"]
            count = int(resources.get("GPU", 0)) or int(resources.get("CPU", 0))
            hosts.append(HostSlots(address, count or None))
        return hosts

    def transport(self, argument: str | None) -> str:
        """The ``ray`` transport, at the same address."""
        return f"ray:{argument}" if argument else "ray"


PROVIDER = RayProvider()


class RayTransport(Transport):
    """Agents started by Ray actors, one per host, in one placement group for the launch."""

    name = "ray"
    remote = True

    def __init__(self, argument: str | None = None) -> None:
        """``argument``: the cluster's address (else ``RAY_ADDRESS``, else ``"auto"``)."""
        self.argument = argument
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[str, Any]] | None = None
        self._group: Any = None
        self._bundles: dict[str, int] = {}
        self._actors: set[Any] = set()
        self._runner: Any = None
        self._tag = f"{os.getpid()}-{time.monotonic_ns()}"

    # -- the launch's reservation -----------------------------------------------------------

    def _open(self, start: AgentStart) -> Any:  # noqa: ANN401 (Ray's module)
        """Connect, map the hosts to nodes and reserve them (once, for every host at once).

        Raises:
            AgentFailedError: Ray is missing, a host is no alive node, or the reservation
                is not granted within the start's connect timeout.
        """
        with self._lock:
            try:
                ray = connect(ray_address(self.argument, start.environ))  # the plan's
            except RuntimeError as exc:
                raise AgentFailedError(start.hostname, str(exc)) from exc
            with _CONNECT_LOCK:
                _STATE["open"].add(id(self))
            if self._group is None:
                self._nodes = node_table(ray.nodes())
                hosts = list(dict.fromkeys(start.hostnames or (start.hostname,)))
                missing = [h for h in hosts if h not in self._nodes]
                if missing:
                    known = ", ".join(
                        sorted({str(n["NodeManagerAddress"]) for n in self._nodes.values()})
                    )
                    raise AgentFailedError(
                        missing[0],
                        f"{', '.join(missing)} is no alive node of the Ray cluster with CPUs or "
                        f"GPUs (its nodes: {known or 'none'}); use hostnames='ray' for them all",
                    )
                self._reserve(ray, hosts, start.connect_timeout)
                ray.cloudpickle.register_pickle_by_value(ray_actor)
                self._runner = ray.remote(ray_actor.AgentRunner)
            return ray

    def _reserve(self, ray: Any, hosts: list[str], timeout: float) -> None:  # noqa: ANN401
        from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

        assert self._nodes is not None  # noqa: S101 (read just before)
        bundles = []
        for host in hosts:
            node = self._nodes[host]
            bundle = {"CPU": 1.0, f"node:{node['NodeManagerAddress']}": 0.001}
            gpus = float(node["Resources"].get("GPU", 0))
            if gpus:
                bundle["GPU"] = gpus
            bundles.append(bundle)
        group = placement_group(bundles, strategy="STRICT_SPREAD", name=f"torchrunx-{self._tag}")
        try:
            ray.get(group.ready(), timeout=timeout)
        except Exception as exc:
            remove_placement_group(group)
            raise AgentFailedError(
                hosts[0],
                f"Ray did not reserve 1 CPU and every GPU on each of {', '.join(hosts)} within "
                f"{timeout:g} s ({type(exc).__name__}): are they busy with other work?",
            ) from exc
        self._group = group
        self._bundles = {host: index for index, host in enumerate(hosts)}

    # -- one host ---------------------------------------------------------------------------

    def start(self, start: AgentStart) -> AgentProcess:
        """Start the host's actor in its bundle; the actor starts the agent.

        Raises:
            AgentFailedError: Ray, the node or the actor failed, or it did not start in time.
        """
        ray = self._open(start)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        assert self._nodes is not None  # noqa: S101 (opened)
        node = self._nodes[start.hostname]
        address = start.launcher_address or agent_route(
            start.hostname, str(node["NodeManagerAddress"])
        )
        strategy = PlacementGroupSchedulingStrategy(
            self._group, placement_group_bundle_index=self._bundles[start.hostname]
        )
        actor = self._runner.options(
            num_cpus=1,
            num_gpus=float(node["Resources"].get("GPU", 0)),
            scheduling_strategy=strategy,
            max_restarts=0,
            max_concurrency=4,
            name=f"torchrunx-agent-{self._tag}-{start.index}-{time.monotonic_ns()}",
        ).remote()
        with self._lock:
            self._actors.add(actor)
        where = f"Ray node {start.hostname} ({str(node['NodeID'])[:12]})"
        try:
            pid, _ = ray.get(
                actor.start.remote(list(AGENT_ARGV), start.payload(address)),
                timeout=start.connect_timeout,
            )
        except Exception as exc:
            self._forget(ray, actor)
            raise AgentFailedError(
                start.hostname,
                f"the Ray actor that starts its agent on {where} failed or did not start within "
                f"{start.connect_timeout:g} s: {type(exc).__name__}: {_first_line(exc)}",
            ) from exc
        logger.debug("agent of %s started by a Ray actor (pid %d)", where, pid)
        return RayAgent(start.hostname, where, actor, start, functools.partial(self._forget, ray))

    def _forget(self, ray: Any, actor: Any) -> None:  # noqa: ANN401
        """Kill ``actor`` (its agent's stdin closes) and stop tracking it."""
        with self._lock:
            self._actors.discard(actor)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

    def describe(self, hostname: str) -> str:
        """What starts the agent (no Ray call: a dry run contacts nothing)."""
        address = self.argument or "RAY_ADDRESS, else auto"  # a launch reads the plan's
        return (
            f"a Ray actor on node {hostname} (cluster {address}; 1 CPU and the node's GPUs, "
            "placement group STRICT_SPREAD) runs bash --noprofile --norc -c ... (the agent)"
        )

    def close(self) -> None:
        """Kill every actor left, remove the placement group, disconnect if torchrunx connected."""
        with self._lock:
            actors, self._actors = list(self._actors), set()
            group, self._group = self._group, None
        if actors or group is not None:
            ray = _ray()
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            if group is not None:
                from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

                with contextlib.suppress(Exception):
                    remove_placement_group(group)
        disconnect(self)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


class RayAgent(PipeReaders):
    """An agent started by a Ray actor; its output comes through the actor, read by a thread."""

    def __init__(
        self,
        hostname: str,
        where: str,
        actor: Any,  # noqa: ANN401 (a Ray actor handle)
        start: AgentStart,
        forget: Any,  # noqa: ANN401 (kills the actor)
    ) -> None:
        """Start reading the actor's relay of the agent's output in a thread."""
        self.hostname = hostname
        self._where = where
        self._actor = actor
        self._forget = forget
        self._output = AgentOutput(start.on_line)
        self._pipes = {False: os.pipe(), True: os.pipe()}
        self._streams = {is_stderr: pipe[0] for is_stderr, pipe in self._pipes.items()}
        self._exit = os.pipe()
        for read_end, write_end in self._pipes.values():
            os.set_blocking(read_end, False)
            os.set_blocking(write_end, False)
        os.set_blocking(self._exit[0], False)
        self._status: int | None = None
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._reader = threading.Thread(target=self._pump, name="torchrunx-ray-relay", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        """Copy the actor's chunks into the pipes until the agent has ended (or the actor)."""
        ray = _ray()
        status: int | None = None
        try:
            while not self._stopping.is_set():
                try:
                    chunks, status = ray.get(
                        self._actor.read.remote(_READ_WAIT), timeout=_READ_WAIT + 2.0
                    )
                except ray.exceptions.GetTimeoutError:
                    continue  # a slow or cut-off node: the heartbeats judge it
                for is_stderr, chunk in chunks:
                    self._write(self._pipes[is_stderr][1], chunk)
                if status is not None:
                    break
        except Exception as exc:  # noqa: BLE001 (the actor or its node died: the agent with it)
            if not self._stopping.is_set():
                note = f"torchrunx: the Ray actor of this agent died ({self._where}): "
                self._write(self._pipes[True][1], f"{note}{_first_line(exc)}\n".encode())
            status = 255
        finally:  # this thread owns the write ends: it closes them, never close()
            self._status = 255 if status is None else status
            for _, write_end in self._pipes.values():
                os.close(write_end)
            self._done.set()
            with contextlib.suppress(OSError):  # the launcher closed its end already
                os.write(self._exit[1], b"x")
            os.close(self._exit[1])

    def _write(self, fd: int, data: bytes) -> None:
        """Write all of ``data`` as the launcher reads; drop it once the agent is being closed."""
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:  # noqa: PERF203 (the pipe is full: wait for the launcher)
                if self._stopping.is_set():
                    return
                time.sleep(0.01)
            except OSError:  # the launcher closed its end: nobody reads any more
                return

    @property
    def exit_fd(self) -> int:
        """Readable once the agent's end (or its actor's) is known."""
        return self._exit[0]

    def wait(self, timeout: float | None) -> int | None:
        """The agent's exit status once known, or ``None`` after ``timeout`` seconds."""
        return self._status if self._done.wait(timeout) else None

    def close(self, grace: float = 5.0) -> None:
        """Close the agent's stdin through its actor and wait ``grace``; then kill the actor.

        A lost agent (``grace=0``) is not waited for: killing its actor closes its stdin, and
        it stops its workers by itself.
        """
        if grace > 0 and not self._done.is_set():
            with contextlib.suppress(Exception):
                _ray().get(self._actor.close.remote(grace), timeout=grace + 1.0)
            self._done.wait(_READ_WAIT + 1.0)
        self._stopping.set()
        self._forget(self._actor)
        self._reader.join(timeout=_READ_WAIT + 3.0)
        drain(self.readers(), 0.5)
        for fd in (*(p[0] for p in self._pipes.values()), self._exit[0]):
            with contextlib.suppress(OSError):
                os.close(fd)
