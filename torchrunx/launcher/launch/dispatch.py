"""What a launch sends its workers and what it takes back: specs, calls, results.

:class:`Dispatch` (held by the orchestrator's ``Launch``) tells every agent of the world which
workers to start for an attempt (a ``WorkerSpec``: ranks, world size, where rank 0 listens,
the backend chosen once for every host), adds their log files and consoles the first time, sends
a warm run's call to workers that stay, and unpickles the results per host once every rank
returned. The order of attempts and what to do after a failure are the orchestrator's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from torchrunx import serialization
from torchrunx.devices import resolve_backend
from torchrunx.errors import AgentFailedError, SerializationError
from torchrunx.launcher.launch.replace import Failed
from torchrunx.launcher.launch.stalls import progress_every
from torchrunx.launcher.state.records import Phase
from torchrunx.launcher.view.logrouter import auto_cores_hint, auto_cores_hosts
from torchrunx.wire.messages import WorkerCall, WorkerSpec

if TYPE_CHECKING:
    from torchrunx.launcher.launch.session import LaunchLoop


class Dispatch:
    """The specs and calls sent to a launch's workers, and their results (the launch's thread)."""

    def __init__(self, session: LaunchLoop) -> None:
        """Send and collect through ``session``'s connections, log router and state."""
        self.session = session
        self._logged: set[int] = set()
        """Agents whose workers' log files and consoles were added."""

    def master_address(self) -> tuple[str, int]:
        """Rank 0 runs on host 0: its address as the other hosts can reach it, and its port."""
        agents = self.session.state.world
        peer_of = self.session.inbox.peer_of
        first = agents[0]
        if first.remote:
            address = peer_of(first).peer_address
        elif any(a.remote for a in agents):
            # Host 0 is this machine: use the address the remote agents reached us on.
            address = peer_of(next(a for a in agents if a.remote)).local_address
        else:
            address = "127.0.0.1"
        return address, first.free_port

    def send_specs(self, call: list[memoryview]) -> None:
        """Every agent of the world starts its workers of this attempt, which run ``call``.

        Raises:
            Failed: An agent of the world ended before its spec (its fault is recorded).
        """
        session, plan, st = self.session, self.session.plan, self.session.state
        for agent in st.world:  # a spec to an agent that ended would wait for nothing
            if agent.over or agent.conn is None:
                if not st.failed:
                    session.inbox.fault(
                        "agent",
                        AgentFailedError(
                            agent.slots.hostname,
                            f"its agent ended ({agent.state.value}) before the workers started",
                        ),
                        time.time(),
                        host_index=agent.index,
                    )
                raise Failed
        hellos = [a.hello for a in st.world]
        world_size = sum(h.slots for h in hellos if h is not None)
        # Decided once for every worker of every host: a group that mixes backends hangs.
        backend = resolve_backend(
            plan.backend, [(h.slots, h.gpus) for h in hellos if h is not None]
        )
        if plan.hosts.workers_per_host == "auto":  # one worker per core, where no GPU was found
            counted = [
                (a.slots.hostname, a.slots.workers, a.hello.slots, a.hello.gpus)
                for a in st.world
                if a.hello is not None
            ]
            auto_cores_hint(auto_cores_hosts(counted), plan.from_env.hints)
        master_addr, master_port = self.master_address()
        debugger = session.debugger
        stragglers = plan.observability.straggler_threshold is not None
        offset = 0
        for position, agent in enumerate(st.world):
            assert agent.hello is not None  # noqa: S101 (all hellos are in)
            spec = WorkerSpec(
                host_index=position,
                hostname=agent.slots.hostname,
                num_workers=agent.hello.slots,
                rank_offset=offset,
                world_size=world_size,
                master_addr=master_addr,
                master_port=master_port,
                backend=backend,
                timeout=plan.timeouts.process_group,
                isolate_gpus=plan.isolate_gpus,
                log_level=session.logs.level,
                attempt=st.attempt,
                max_restarts=plan.resilience.max_restarts,
                restarts=st.restarts,
                num_hosts=len(st.world),
                keep=plan.keep_workers,
                debugger=debugger.terminal,
                post_mortem=debugger.post_mortem,
                debugpy=debugger.debugpy,
                preemption_grace=plan.resilience.preemption_grace,
                progress_every=progress_every(
                    plan.observability.stall_timeout, stragglers=stragglers
                ),
                stragglers=stragglers,
            )
            st.current.assign(agent, spec)
            if agent.index not in self._logged:  # its files and consoles, once
                self._logged.add(agent.index)
                session.logs.add_workers(agent.index, spec.num_workers, offset)
            offset += spec.num_workers
            session.inbox.peer_of(agent).send(spec, call)
        if st.attempt == 0:
            session.logs.warn_missing_console_ranks(offset)
            debugger.warn_missing_rank(offset)

    def send_calls(self, call: list[memoryview]) -> None:
        """Workers that stay: send this run's ``call`` to each of them, on its channel."""
        st = self.session.state
        st.progress.move_phase(Phase.RUNNING)
        message = WorkerCall(run=st.runs)
        for rank in st.ranks:
            assert rank.conn is not None  # noqa: S101 (checked by kept_workers_well)
            self.session.inbox.peers[rank.conn].send(message, call)

    def collect(self) -> tuple[tuple[Any, ...], ...]:
        """Every rank's return value, unpickled here, per host of the world in rank order.

        Raises:
            SerializationError: A value cannot be unpickled in this process.
        """
        st = self.session.state
        position = {a.index: i for i, a in enumerate(st.world)}
        per_host: list[list[Any]] = [[] for _ in st.world]
        for rank in st.ranks:
            try:
                value = serialization.loads(st.current.take_result(rank))
            except Exception as exc:
                raise SerializationError(
                    f"cannot unpickle the return value of rank {rank.rank} in the launcher: "
                    f"{exc}; is every module it needs importable here?"
                ) from exc
            per_host[position[rank.host_index]].append(value)
        return tuple(tuple(values) for values in per_host)
