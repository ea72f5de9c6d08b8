"""The settings of a launch (:class:`Launcher`) and its entry points: run, warm, dry_run.

A :class:`Launcher` holds the fields as given and checks them (:meth:`Launcher.validate`);
:meth:`Launcher.plan` resolves them once into a frozen
:class:`~torchrunx.launcher.settings.plan.LaunchPlan` (hosts, workers, how each agent starts,
forwarded variables), which is all the launch reads::

    Launcher.run(func) ─ validate ─ pickle the call ─ plan ─ Launch(plan, call).execute()
      (orchestrator.py: listen, start agents, hellos, specs, monitor, restart or raise,
      collect, stop) ─ LaunchResult
    Launcher.warm() ─ plan ─ Launch(plan).open() ─ WarmLauncher (warm.py: many runs)
    Launcher.dry_run() ─ plan ─ the description of what run would start (nothing starts)

The caller's thread runs the launch and owns every decision (see
:mod:`torchrunx.launcher.launch.session` for the other threads).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shlex
from dataclasses import dataclass
from pathlib import Path  # noqa: TC003 (tyro reads the field types)
from typing import TYPE_CHECKING, Annotated, Any, Literal, ParamSpec, TypeVar

import tyro

from torchrunx import plugins, serialization
from torchrunx.env import (
    DEFAULT_ENV_VARS,
    check_env_fields,
    check_launch_env,
    exported_env,
    split_extra_env_vars,
    unmatched_env_vars,
)
from torchrunx.events import EventHandler  # noqa: TC001 (tyro reads the field types)
from torchrunx.launcher.dryrun import describe_launch
from torchrunx.launcher.launch.orchestrator import Launch
from torchrunx.launcher.launch.preempt import default_grace, sigterm_preempts
from torchrunx.launcher.launch.stalls import DEFAULT_STALL_TIMEOUT, check_stall_fields
from torchrunx.launcher.launch.stragglers import (
    DEFAULT_STRAGGLER_THRESHOLD,
    check_straggler_threshold,
)
from torchrunx.launcher.settings.environ import health_port_from_env, read_environ
from torchrunx.launcher.settings.plan import (
    Backend,
    LaunchPlan,
    Observability,
    PlanHosts,
    Reach,
    Resilience,
    StallAction,
    Timeouts,
    check_agent_start,
    check_event_handlers,
    check_relay,
    check_tree,
    check_tree_radix,
    paired_transport,
    start_methods,
)
from torchrunx.launcher.settings.reach import (
    check_container,
    check_files,
    check_python,
    check_python_hosts,
    check_ship,
)
from torchrunx.launcher.settings.renamed import refuse_renamed, refuses_renamed_keywords
from torchrunx.launcher.settings.resolve import (
    Hostnames,
    HostsSource,
    check_hostnames,
    check_workers,
)
from torchrunx.launcher.state.failures import RESTART_CATEGORIES, check_restarts
from torchrunx.launcher.state.results import LaunchResult
from torchrunx.launcher.state.spares import check_resilience, check_spare_names, world_and_spares
from torchrunx.launcher.view.where import sigquit_shows_stacks
from torchrunx.launcher.warm import WarmLauncher
from torchrunx.logs import ConsoleRanks, LogHandlers, check_log_fields

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

logger = logging.getLogger("torchrunx.launcher")

P = ParamSpec("P")
R = TypeVar("R")

_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "auto", None)
_Sources = tuple[HostsSource, HostsSource | None]  # what hostnames, spare_hosts name (or None)
_TUPLE_FIELDS = ("default_env_vars", "copy_env_vars", "extra_env_vars", "restart_on", "spare_hosts")
"""Fields a preset may give as a list (TOML, JSON), made tuples."""


@refuses_renamed_keywords
@dataclass(frozen=True)
class Launcher:
    """How to run a function on many hosts and workers; `run` does it.

    Every field has a default, so `Launcher().run(func)` runs one worker per GPU (or CPU
    core) on this machine, or on every node of the SLURM allocation it runs in.

    The fields by group (its plan's): hosts (hostnames, workers_per_host, agent_start,
    spare_hosts); workers (backend, isolate_gpus); reach (ssh_config_file, default_env_vars,
    copy_env_vars, extra_env_vars, env_file, launcher_address, relay, tree_radix, python, ship,
    ship_exclude, container); timeouts (timeout, agent_timeout, start_timeout, launch_timeout);
    resilience (max_restarts, restart_on, min_hosts, preemption_grace, requeue_on_preemption);
    observability (stall_timeout, on_stall, straggler_threshold, health_check_port,
    console_ranks, event_handlers, log_handlers).
    """

    hostnames: Hostnames = "auto"
    """Hosts to run on: a list of names; "auto" (the SLURM allocation, or another detected
scheduler's, if inside one, else localhost); a host provider such as "slurm", "pbs", "lsf",
the engines "ray" and "kubernetes:SELECTOR", or "hostfile:PATH"; or the path of a
hostfile (with a slash on the command line: ./hostfile)."""

    workers_per_host: Literal["auto", "slurm", "gpu", "cpu"] | int | list[int] = "auto"
    """Workers per host: one number, one per host, "slurm" (what SLURM gave each node), or
the GPUs of each host with "gpu" (an error for a host without any), its CPU cores with "cpu",
or the default "auto" (a hostfile's or scheduler's slots, else GPUs, else CPU cores)."""

    agent_start: str = "auto"
    """How agents start, a transport: "ssh"; "srun", a job step per node of the allocation; the
engines' "ray" and "kubectl:namespace=NS"; or "auto": the host provider's own, else srun in an
allocation whose nodes are the hosts, else ssh (this machine's agent: a plain subprocess)."""

    ssh_config_file: str | Path | None = None
    """SSH config for reaching hosts; None: ~/.ssh/config if it exists."""

    backend: Backend = "auto"
    """torch.distributed backend. "auto": nccl if every host has a GPU for each of its workers,
else gloo (one choice for the whole launch, from the GPUs each agent counts); None: no process
group. With nccl each worker's current CUDA device is LOCAL_RANK's GPU, bound to the group."""

    timeout: float = 600
    """Process-group timeout in seconds, for collectives and the group's set-up (1.5 is fine)."""

    isolate_gpus: bool = False
    """False: every worker sees every GPU of its host and LOCAL_RANK picks one, as under
torchrun. True: each worker sees only its own GPU, as cuda:0 (CUDA_VISIBLE_DEVICES = local
rank modulo the host's GPUs, unless CUDA_VISIBLE_DEVICES is already set)."""

    default_env_vars: tuple[str, ...] = DEFAULT_ENV_VARS
    """Launcher environment variables (fnmatch patterns) copied to agents and workers on every
host. Workers on this machine see the launcher's whole environment anyway."""

    copy_env_vars: tuple[str, ...] | None = None
    """torchrunx 0.4's name for default_env_vars: give one or the other (None: not given)."""

    extra_env_vars: tuple[str, ...] | dict[str, str] | None = ()
    """More variables for every agent and worker on every host: fnmatch patterns of launcher
variables to copy, on top of default_env_vars, and NAME=VALUE entries to set (in Python also a
dict of names and values, as in torchrunx 0.4)."""

    env_file: str | Path | None = None
    """A bash file sourced on every host before the agent starts (after copied variables)."""

    launcher_address: str | None = None
    """Address remote agents connect back to; None: $TORCHRUNX_LAUNCHER_ADDR if set, else each SSH
connection's local address (srun agents: this machine's address on the route to their node)."""

    relay: Literal["off", "auto", "on"] = "off"
    """Carry remote agents' and workers' connections to the launcher over each agent's own
channel (the stdio of ssh, srun or kubectl exec) instead of connecting back: "on"; "auto": for
hosts that cannot open a connection to the launcher; "off": always connect back."""

    tree_radix: int | None = None
    """Tree start over SSH: the launcher starts at most this many agents (and the spares), and each
of them as many more from its host with OpenSSH's ssh (the ssh config and keys at the same path
there), their connections relayed (relay="on"); up to k + k*k hosts (spares not counted); see
How it works. None: the launcher starts every agent."""

    python: str | dict[str, str] | None = None
    """The Python interpreter of remote hosts not at the launcher's path: a path (or a name on
PATH) for all, or a dict of hostname (or provider, like @srun) to path; on the command line
one path, or pairs. Such a host keeps its interpreter's own packages. None: the launcher's."""

    ship: tuple[str, ...] = ()
    """Paths to copy to the remote hosts, for hosts that do not share this machine's files, for
example . (the working directory). Honours .gitignore files and ship_exclude; each host keeps
one copy per user, by content, under ~/.cache/torchrunx/code, so an unchanged tree is not sent
again. Remote agents and workers run in the copy, with it on sys.path; torchrunx travels too."""

    ship_exclude: tuple[str, ...] = ()
    """Patterns, in the syntax of .gitignore, of shipped files to leave out: data/ or *.ckpt."""

    container: str | None = None
    """A command that runs each remote host's agent and workers in a container there (ssh and
srun hosts), such as podman exec -i NAME, docker exec -i NAME or apptainer exec IMAGE, or for
srun hosts pyxis's options, such as --container-image=IMAGE. Its python3 runs them unless
python names another; it should share the host's network."""

    agent_timeout: float = 5.0
    """Seconds without a heartbeat after which a host counts as lost (cut link, frozen host)."""

    start_timeout: float = 60.0
    """Seconds for every agent to start and connect back (SSH connect included)."""

    launch_timeout: float | None = None
    """Wall-clock limit in seconds for the whole launch (None: no limit)."""

    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT
    """Seconds without progress of any rank (a collective completed, trx.progress()) before every
rank's flight recorder and stacks are read and a diagnosis shown (docs/debugging.md); None: off."""

    on_stall: StallAction = "report"
    """After a stall's diagnosis: "report" (keep waiting), "fail" (raise StallError), or the
workers "restart" as after a failure (it needs max_restarts, and "timeouts" in restart_on)."""

    straggler_threshold: float | None = DEFAULT_STRAGGLER_THRESHOLD
    """Name a rank that enters most collectives last, this many seconds after the median rank or
more: a warning, a StragglerFound event, LaunchResult.stragglers (docs/debugging.md); None: off."""

    max_restarts: int = 0
    """Restart the whole worker group, on the same agents, up to this many times after a
worker fails; then raise the last failure, with the earlier ones in its notes."""

    restart_on: tuple[str, ...] = RESTART_CATEGORIES
    """Failures that restart: "exceptions" (the function raised), "deaths" (a worker exited
or was killed), "timeouts" (a torchrunx.timer watchdog expired), "hosts" (an agent died or
its host was lost: a new agent there, or a spare, takes over; not in the default), or
exception type names, for example "OSError" (those types and their subclasses only)."""

    spare_hosts: int | tuple[str, ...] = 0
    """Hosts that wait to replace a failed one (with "hosts" in restart_on): a count taken from
the end of hostnames (the last nodes of a SLURM allocation or hostfile), or the names of other
hosts. Their agents start with the launch and wait, torch imported; a failed or lost host is
quarantined and a spare takes its place and its ranks (see docs/resilience.md)."""

    min_hosts: int | None = None
    """With "hosts" in restart_on: when a host fails and no spare is left, go on with the hosts
left, down to this many (WORLD_SIZE and the ranks change), like torchrun's --nnodes=MIN:MAX.
None: never fewer hosts (without spare_hosts, a failed host gets a new agent in place)."""

    preemption_grace: float | None = None
    """Seconds the ranks get, after a SIGTERM to the launcher or to one host's agent, to save
and return (torchrunx.preemption_requested() turns True); then everything stops and the
caller gets torchrunx.Preempted. None: inside a SLURM job, SLURM's KillWait less 2 s, else 0,
where SIGTERM stops the launch at once, with exit status 143."""

    requeue_on_preemption: bool = False
    """Inside an sbatch job: after a preemption, requeue the job (scontrol requeue), as
submitit does; the job's script runs again and the function resumes from its checkpoint."""

    health_check_port: int | None = None
    """Serve GET /health (JSON; 200 while healthy, 503 after a failure) on this port while
the launch runs, on 127.0.0.1 unless $TORCHRUNX_HEALTH_CHECK_HOST names another address (*:
every interface); 0 picks a free port; None: $TORCHRUNX_HEALTH_CHECK_PORT if set, else none."""

    console_ranks: ConsoleRanks = (0,)
    """The workers whose output the default console shows, each line prefixed [host:local_rank]:
global ranks (--console-ranks 0 3), "all", or none (an empty tuple). Every worker's output is in
its file either way. Like torchrun's --tee and --local-ranks-filter."""

    event_handlers: Annotated[tuple[EventHandler, ...], tyro.conf.Suppress] = ()
    """Functions, or objects with a record(event) method, that receive every launch event."""

    log_handlers: Annotated[LogHandlers, tyro.conf.Suppress] = "auto"
    """Where forwarded logs go. "auto": the workers of console_ranks (rank 0) on stdout, with
their agents' warnings (INFO lines too where the torchrunx.agent logger allows INFO), and every
agent and worker in files under $TORCHRUNX_LOG_DIR; None: nowhere; or logging.Handlers that
receive every record ("auto" among them keeps the defaults too), or a function making that list,
given a trx.LogSetup (the resolved hosts) if it takes an argument."""

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> Launcher:  # noqa: ANN401 (field values)
        """A launcher from a named preset (entry point group ``torchrunx.presets``).

        Args:
            name: The preset's name, e.g. ``"gpu_x8"``.
            **overrides: Fields to set on top of the preset.

        Raises:
            ValueError: No preset has that name.
            TypeError: The preset or an override names a field ``Launcher`` does not have.
        """
        values = {**plugins.preset(name), **overrides}
        refuse_renamed(f"Launcher.from_preset({name!r})", values)
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"preset {name!r} or its overrides set unknown fields {unknown}")
        listed = [key for key in _TUPLE_FIELDS if isinstance(values.get(key), list)]
        return cls(**{**values, **{key: tuple(values[key]) for key in listed}})

    def run(self, func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> LaunchResult[R]:
        """Run ``func(*args, **kwargs)`` in every worker and return every rank's value.

        Raises:
            ValueError: A field is invalid (raised before any host is touched).
            TypeError: ``func`` is not callable.
            SerializationError: The function, an argument or a return value cannot be pickled.
            AgentFailedError: An agent could not be started, died, or its host was lost.
            WorkerFailedError: A worker died without raising (exit code or signal).
            Exception: The exception a worker raised, with its own type, the remote traceback
                as ``__cause__`` and the host and rank in its notes.
        """
        sources = self._check_fields()
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")
        plan = _plan_of(self, None, sources, warm=False, keep=False)
        call = serialization.dumps_call(func, args, kwargs)
        launch = Launch(plan, call)
        try:
            with (
                sigterm_preempts(launch.session.preempt, plan.resilience.preemption_grace),
                sigquit_shows_stacks(launch.session.ask_stacks),
            ):
                per_host = launch.execute()
        finally:
            launch.close()
        return LaunchResult(
            launch.host_changes.hostnames(),
            per_host,
            launch.state.restarts,
            launch.session.timings(),
            world_changes=tuple(launch.state.agent_table.world_changes),
            stragglers=launch.session.stragglers.watch.last_run,
        )

    def warm(self, *, keep_workers: bool = False) -> WarmLauncher:
        """Start the agents now and keep them for many runs, each on fresh workers.

        Use the result as a context manager (the agents end with the block), or call its
        ``close()``; see :mod:`torchrunx.launcher.warm` for what persists between runs.

        Args:
            keep_workers: Keep the workers too, and their process group: each run's function
                is called in the same worker processes, so what a run loads (module globals,
                :data:`torchrunx.worker_cache`, a CUDA context) is there in the next. A
                failed run's workers are replaced by fresh ones (``LaunchResult.fresh_workers``
                and a warning say so).

        Raises:
            ValueError: A field is invalid (raised before any host is touched).
            AgentFailedError: An agent could not be started or did not connect.
        """
        if not isinstance(keep_workers, bool):
            raise TypeError(f"keep_workers must be True or False, got {keep_workers!r}")
        plan = self.plan(warm=True, keep_workers=keep_workers)
        launch = Launch(plan, [])
        try:
            with sigterm_preempts(launch.session.preempt, 0.0):  # nothing runs yet: SIGTERM stops
                launch.open()
        except BaseException:
            launch.close()
            raise
        return WarmLauncher(plan, launch)

    def plan(
        self,
        *,
        warm: bool = False,
        keep_workers: bool = False,
        environ: Mapping[str, str] | None = None,
    ) -> LaunchPlan:
        """Check every field and resolve what a launch needs, once: the frozen plan it runs.

        The hosts and their workers (the SLURM allocation, a hostfile, a provider), how each
        agent starts, the forwarded variables, the health port, and every environment variable
        the launcher reads (:mod:`~torchrunx.launcher.settings.environ`); nothing is started.

        Args:
            warm: For :meth:`warm` (agents that stay from run to run).
            keep_workers: For ``warm(keep_workers=True)``.
            environ: The launcher's environment to read (None: this process's).

        Raises:
            ValueError: A field is invalid.
            TypeError: A field has the wrong type.
            RuntimeError: ``"slurm"`` or ``agent_start="srun"`` outside an allocation.
        """
        sources = self._check_fields()
        return _plan_of(self, environ, sources, warm=warm, keep=keep_workers)

    def validate(self) -> None:
        """Check every field, and the launcher's variables; raise before anything starts.

        Raises:
            ValueError: A field, or a variable of the environment, has an invalid value.
            TypeError: A field has the wrong type.
        """
        self._check_fields()
        read_environ()  # raises ValueError for a bad TORCHRUNX_* variable

    def _check_fields(self) -> _Sources:
        """Check every field (not the environment); what hostnames and spare_hosts name."""
        source = check_hostnames(self.hostnames)  # classified here, once: the plan keeps it
        check_workers(self.workers_per_host, self.hostnames)
        check_agent_start(self.agent_start)
        check_relay(self.relay)
        check_tree_radix(self.tree_radix)
        check_python(self.python)
        check_ship(self.ship, self.ship_exclude)
        check_container(self.container)
        _validate_choice("backend", self.backend, _BACKENDS)
        if not isinstance(self.isolate_gpus, bool):
            raise TypeError(f"isolate_gpus must be True or False, got {self.isolate_gpus!r}")
        for name in ("timeout", "agent_timeout", "start_timeout", "launch_timeout"):
            value = getattr(self, name)
            if value is not None or name != "launch_timeout":
                _validate_seconds(name, value)
        check_env_fields(self.default_env_vars, self.copy_env_vars, self.extra_env_vars)
        check_log_fields(self.log_handlers, self.console_ranks)
        check_restarts(self.max_restarts, self.restart_on)
        check_stall_fields(self.stall_timeout, self.on_stall, self.max_restarts)
        check_straggler_threshold(self.straggler_threshold)
        check_resilience(self.spare_hosts, self.min_hosts, self.restart_on, self.max_restarts)
        spares = check_spare_names(
            self.spare_hosts, self.workers_per_host, self.requeue_on_preemption
        )
        if self.preemption_grace is not None:
            _validate_seconds("preemption_grace", self.preemption_grace, zero=True)
        check_event_handlers(self.event_handlers)
        health_port_from_env(self.health_check_port, {})  # raises ValueError for a bad port
        check_files(self.env_file, self.ssh_config_file)
        return source, spares

    def set_logging_handlers(self, handler_factory: LogHandlers) -> Launcher:
        """Set :attr:`log_handlers` as torchrunx 0.4 did; returns this launcher.

        Sets ``log_handlers`` on this launcher itself, as 0.4 did, so that both
        ``Launcher(...).set_logging_handlers(f).run(g)`` and a separate call before ``run``
        work. Prefer ``Launcher(log_handlers=f)``.

        Args:
            handler_factory: A function returning ``logging.Handler`` objects, a list of them,
                ``"auto"`` or ``None`` (see ``log_handlers``).

        Raises:
            TypeError: ``handler_factory`` is none of these.
        """
        check_log_fields(handler_factory, self.console_ranks)
        # Launcher is frozen, but 0.4's method changed the launcher it was called on, and
        # scripts call it without using the return value.
        object.__setattr__(self, "log_handlers", handler_factory)
        return self

    def exported_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables every agent exports, on every host (values as the launcher has them).

        The launcher's variables (of ``environ``; None: this process's) matching
        ``default_env_vars`` (or ``copy_env_vars``) and the patterns of ``extra_env_vars``,
        then the values given in ``extra_env_vars``.

        Raises:
            TypeError: ``extra_env_vars`` has the wrong type.
            ValueError: ``extra_env_vars`` sets a name that cannot be exported.
        """
        patterns, values = split_extra_env_vars(self.extra_env_vars)
        defaults = self.default_env_vars if self.copy_env_vars is None else self.copy_env_vars
        return exported_env((*defaults, *patterns), values, environ)

    def dry_run(self) -> str:
        """Describe what :meth:`run` would start, without starting or contacting anything.

        The description lists the resolved hosts, workers per host and ranks, the names (never
        the values) of the forwarded environment variables, and the command line each agent
        would be started with.

        Raises:
            ValueError: A field is invalid, as for :meth:`run`.
            RuntimeError: ``"slurm"`` outside an allocation, as for :meth:`run`.
        """
        plan = self.plan()
        env = (self.default_env_vars, self.copy_env_vars, self.extra_env_vars)
        return describe_launch(plan, unmatched=unmatched_env_vars(*env, plan.from_env.environ))


def launch(
    func: Callable[..., R],
    func_args: tuple[Any, ...] | None = None,
    func_kwargs: dict[str, Any] | None = None,
    **launcher_fields: Any,  # noqa: ANN401 (the Launcher's fields, checked by its constructor)
) -> LaunchResult[R]:
    """Run ``func(*func_args, **func_kwargs)`` on every worker: ``Launcher(**fields).run(...)``.

    Raises:
        TypeError: An unknown launcher field (for one of an earlier release, it names what
            replaces it).
        Exception: Whatever :meth:`Launcher.run` raises.
    """
    refuse_renamed("launch()", launcher_fields)
    launcher = Launcher(**launcher_fields)
    return launcher.run(func, *(func_args or ()), **(func_kwargs or {}))


def _validate_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {list(choices)}")


def _validate_seconds(name: str, value: object, *, zero: bool = False) -> None:
    """A timeout must be a finite number of seconds above 0 (``zero``: or 0), an int or a float."""
    if isinstance(value, int | float) and not isinstance(value, bool) and not math.isfinite(value):
        no_limit = " (for no limit, use launch_timeout=None)" if name == "launch_timeout" else ""
        raise ValueError(f"{name} must be a finite number of seconds, got {value!r}{no_limit}")
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or value < 0
        or (value == 0 and not zero)
    ):
        least = "0 or more" if zero else "a positive number of"
        raise ValueError(f"{name} must be {least} seconds, got {value!r}")


def _plan_of(
    it: Launcher, environ: Mapping[str, str] | None, sources: _Sources, *, warm: bool, keep: bool
) -> LaunchPlan:
    """The plan of ``it``, whose fields are checked; ``environ`` (None: os.environ) read once."""
    from_env = read_environ(environ)
    env = from_env.environ
    check_launch_env(it.default_env_vars, it.copy_env_vars, it.extra_env_vars, env)
    world, spares = world_and_spares(
        it.hostnames,
        it.workers_per_host,
        spare_hosts=it.spare_hosts,
        min_hosts=it.min_hosts,
        sources=sources,
        environ=env,
    )
    hosts = world + spares
    names = [h.hostname for h in hosts]
    methods, argument = start_methods(it.agent_start, names, paired_transport(sources[0]), env)
    check_python_hosts(it.python, names, methods)
    check_tree(
        it.tree_radix, methods, len(spares), python=it.python, ship=it.ship, container=it.container
    )
    return LaunchPlan(
        hosts=PlanHosts(
            tuple(hosts), tuple(methods), sources[0], argument, it.workers_per_host, len(spares)
        ),
        reach=Reach(
            env=it.exported_env(env),
            env_file=it.env_file,
            launcher_address=it.launcher_address,
            relay="on" if it.tree_radix is not None else it.relay,
            tree_radix=it.tree_radix,
            python=it.python,
            ship=tuple(str(p) for p in it.ship),
            ship_exclude=tuple(it.ship_exclude),
            container=tuple(shlex.split(it.container)) if it.container else (),
            ssh_config_file=it.ssh_config_file,
        ),
        timeouts=Timeouts(
            float(it.timeout), float(it.agent_timeout), float(it.start_timeout), it.launch_timeout
        ),
        resilience=Resilience(
            max_restarts=it.max_restarts,
            restart_on=tuple(it.restart_on),
            min_hosts=it.min_hosts,
            preemption_grace=(
                default_grace(env) if it.preemption_grace is None else float(it.preemption_grace)
            ),
            requeue=it.requeue_on_preemption,
        ),
        observability=Observability(
            stall_timeout=it.stall_timeout,
            on_stall=it.on_stall,
            straggler_threshold=it.straggler_threshold,
            health_port=from_env.health_port
            if it.health_check_port is None
            else it.health_check_port,
            event_handlers=tuple(it.event_handlers),
            log_handlers=it.log_handlers,
            console_ranks="all" if it.console_ranks == "all" else tuple(map(int, it.console_ranks)),
        ),
        from_env=from_env,
        backend=it.backend,
        isolate_gpus=it.isolate_gpus,
        warm=warm,
        keep_workers=warm and keep,
    )
