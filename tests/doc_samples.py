"""The samples of output in the docs, each made by the code that prints it.

``tests/test_docs_samples.py`` compares each with the block marked ``<!-- sample: NAME -->`` in
the docs (and writes it there with ``TORCHRUNX_WRITE_SAMPLES=1``). Where a sample shows hosts,
pids, times or paths of a real launch, it is made from the real formatting code fed with those
values fixed (the state, the report, the error a launch would hold), so no host is needed: the
text is the code's, the values are the page's. Names of the samples that run in this process
(no subprocess, no launch) are in :data:`QUICK`, and run in the quick tier.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

Maker = Callable[["Place"], str]
SAMPLES: dict[str, Maker] = {}
"""Every sample's name, and what makes its text."""
QUICK: set[str] = set()
"""The samples made in this process, quickly (the quick tier)."""


@dataclass(frozen=True)
class Place:
    """Where a sample is made: a fresh folder, and the test's ``monkeypatch``."""

    tmp_path: Path
    monkeypatch: pytest.MonkeyPatch

    def bare_env(self, **variables: str) -> None:
        """Only ``PATH`` and ``variables`` in the environment: the forwarded names a page shows."""
        path = os.environ["PATH"]
        for name in list(os.environ):
            self.monkeypatch.delenv(name)
        self.monkeypatch.setenv("PATH", path)
        for name, value in variables.items():
            self.monkeypatch.setenv(name, value)


def sample(name: str, *, quick: bool = True) -> Callable[[Maker], Maker]:
    """Register ``name``'s maker."""

    def register(maker: Maker) -> Maker:
        assert name not in SAMPLES, name
        SAMPLES[name] = maker
        if quick:
            QUICK.add(name)
        return maker

    return register


def command(argv: list[str]) -> tuple[int, str, str]:
    """Run the ``torchrunx`` command in this process: its status, stdout and stderr."""
    from torchrunx.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:
            status = int(exc.code or 0)
    return status, out.getvalue(), err.getvalue()


def warnings_of(logger: str, action: Callable[[], object]) -> list[str]:
    """The messages ``logger`` warned of while ``action`` ran."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger(logger).addHandler(handler)
    try:
        action()
    finally:
        logging.getLogger(logger).removeHandler(handler)
    return said


# -- the command line --------------------------------------------------------------------------


@sample("cli-dry-run")
def _cli_dry_run(place: Place) -> str:
    (place.tmp_path / "train.py").write_text("")
    place.monkeypatch.chdir(place.tmp_path)
    place.bare_env(PYTHONPATH="/home/me/project", TORCHRUNX_LOG_DIR="logs")
    argv = ["--hostnames", "localhost", "--workers-per-host", "2", "--dry-run", "--", "train.py"]
    argv += ["--lr", "0.1"]
    status, out, err = command(argv)
    assert status == 0, err
    return f"$ torchrunx {' '.join(argv)}\n{out}"


@sample("index-dry-run")
def _index_dry_run(place: Place) -> str:
    import torchrunx as trx

    place.bare_env(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    call = 'trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo").dry_run()'
    text = trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend="gloo").dry_run()
    return f">>> print({call})\n{text}"


@sample("cli-forms")
def _cli_forms(place: Place) -> str:
    import textwrap

    place.monkeypatch.setenv("COLUMNS", "100")
    _, out, _ = command(["--help"])
    forms = out[out.index("  torchrunx [options] -- script.py") :]
    return textwrap.dedent(forms[: forms.index("\n\n")])


@sample("tyro-help-excerpt")
def _tyro_help_excerpt(place: Place) -> str:
    import tyro

    import torchrunx as trx

    place.monkeypatch.setenv("COLUMNS", "100")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(trx.Launcher, args=["--help"])
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--hostnames "))
    end = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--ssh-config-file"))
    margin = len(lines[start]) - len(lines[start].lstrip())  # the frame of tyro's panel
    lines = [line[margin:].rstrip() for line in lines]
    return "\n".join(lines[start:end])


@sample("cli-renamed-option")
def _cli_renamed_option(place: Place) -> str:
    argv = ["--worker-timeout", "60", "--", "train.py"]
    status, _, err = command(argv)
    assert status == 2
    return f"$ torchrunx {' '.join(argv)}\n{err}"


@sample("cli-torchrun-option")
def _cli_torchrun_option(place: Place) -> str:
    argv = ["--nproc-per-node", "8", "--", "train.py"]
    status, _, err = command(argv)
    assert status == 2
    return f"$ torchrunx {' '.join(argv)}\n{err}"


@sample("cli-torchrun-table")
def _cli_torchrun_table(place: Place) -> str:
    from torchrunx.cli_hints import hint_lines

    return "\n".join(["| torchrun | with torchrunx write |", "| --- | --- |", *hint_lines()])


@sample("builtins")
def _builtins(place: Place) -> str:
    from torchrunx import plugins

    every = plugins._entry_points

    def own(group: str) -> dict:  # torchrunx's own: a plugin installed by another test is not
        return {k: e for k, e in every(group).items() if e.dist and e.dist.name == "torchrunx"}

    place.monkeypatch.setattr(plugins, "_entry_points", own)
    status, out, _ = command(["builtins"])
    assert status == 0
    return f"$ torchrunx builtins\n{out}"


# -- torchrunx check ---------------------------------------------------------------------------


def _checks(problems: dict[str, str], seconds: float) -> str:
    """``torchrunx check``'s lines for hosts ``node1``... all ready but those in ``problems``.

    A problem is either a probe report's field to change (``"torch=2.12.0"``,
    ``"route_back=..."``), or the reason its SSH connection failed.
    """
    import dataclasses

    from torchrunx.agent.probe import ProbeReport
    from torchrunx.launcher.preflight import Local, format_checks, judge

    local = Local("3.11.7", "0.5.0", "2.13.0", None, "auto", None)
    hosts = sorted({"node1", "node2", *problems})
    checks = []
    for index, host in enumerate(hosts):
        report = ProbeReport(
            host,
            "/shared/venv/bin/python",
            "3.11.7",
            "0.5.0",
            "2.13.0",
            8,
            64,
            "/home/me",
            "ok",
            None if len(hosts) == 1 else "ok",
            None,
            0.8,
        )
        problem = problems.get(host)
        field, _, value = (problem or "").partition("=")
        start_failure = None
        if problem is not None and field in {f.name for f in dataclasses.fields(ProbeReport)}:
            report = dataclasses.replace(report, **{field: value})
        elif problem is not None:
            start_failure = problem
        lines = [(False, report.to_line())]
        checks.append(
            judge(
                index,
                host,
                "ssh",
                local,
                start_failure=start_failure,
                status=0,
                lines=lines,
                seconds=seconds,
                timeout=60.0,
            )
        )
    names = " ".join(hosts)
    return f"$ torchrunx check --hostnames {names}\n{format_checks(checks, seconds)}"


@sample("check-torch")
def _check_torch(place: Place) -> str:
    return _checks({"node2": "torch=2.12.0"}, 1.4)


@sample("check-route-back")
def _check_route_back(place: Place) -> str:
    return _checks({"node2": "route_back=cannot connect to 10.0.0.5:41233: timed out"}, 4.2)


@sample("check-known-hosts")
def _check_known_hosts(place: Place) -> str:
    import paramiko

    from torchrunx.engines.ssh import SshTarget, _ssh_error

    target = SshTarget(
        alias="node3",
        hostname="node3",
        port=22,
        user="root",
        identity_files=(),
        identities_only=False,
        known_hosts_files=(),
        strict_host_key_checking="yes",
        connect_timeout=10.0,
        proxy_jump=None,
        proxy_command=None,
    )
    key = paramiko.RSAKey.generate(1024)
    client = paramiko.SSHClient()
    client._transport = types.SimpleNamespace(_log=lambda *_: None)  # no connection: no log
    try:  # paramiko's own words for a host missing from known_hosts
        paramiko.RejectPolicy().missing_host_key(client, "node3", key)
    except paramiko.SSHException as exc:
        reason = _ssh_error(target, exc).reason
    return _checks({"node3": reason}, 1.3)


# -- errors ------------------------------------------------------------------------------------


@sample("error-tree")
def _error_tree(place: Place) -> str:
    import textwrap

    import torchrunx.errors

    doc = torchrunx.errors.__doc__ or ""
    drawing = doc[doc.index("::\n\n") + 4 :]
    drawing = drawing[: drawing.index("\n\n", drawing.index("SystemExit"))]
    return textwrap.dedent(drawing).replace("``", "")


@sample("nested-launch")
def _nested_launch(place: Place) -> str:
    from torchrunx.env import refuse_nested_launch

    try:
        refuse_nested_launch({"TORCHELASTIC_RUN_ID": "torchrunx", "RANK": "1", "WORLD_SIZE": "2"})
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    raise AssertionError("not refused")


# -- environment -------------------------------------------------------------------------------


@sample("env-unmatched")
def _env_unmatched(place: Place) -> str:
    import torchrunx as trx

    place.bare_env(WANDB_PROJECT="demo")
    launcher = trx.Launcher(hostnames=["localhost"], extra_env_vars=("WANDB_PROJCT",))
    (said,) = warnings_of("torchrunx.launcher", launcher.dry_run)
    return said


@sample("env-backend-auto")
def _env_backend_auto(place: Place) -> str:
    import torchrunx as trx
    from torchrunx.launcher.dryrun import describe_plan

    place.bare_env()
    plan = trx.Launcher(hostnames=["localhost"], workers_per_host=8, backend="auto").plan()
    text = describe_plan(plan, gpus=[8])  # this machine's GPUs, as counted: 8
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("backend:"))
    return "\n".join(lines[start : start + 2])


# -- logging, hints, events --------------------------------------------------------------------


@sample("hint-logs")
def _hint_logs(place: Place) -> str:
    from torchrunx.launcher.view import logrouter

    said = io.StringIO()
    place.monkeypatch.chdir(place.tmp_path)
    place.monkeypatch.setattr(logrouter, "say_once", lambda _, text, __: said.write(text))
    hints = place.tmp_path / "hints"
    logrouter.first_launch_hint(place.tmp_path / "torchrunx_logs" / "2026-11-28T06:13:42", hints)
    return said.getvalue()


@sample("hint-auto-cores")
def _hint_auto_cores(place: Place) -> str:
    from torchrunx.launcher.view.logrouter import auto_cores_text

    return auto_cores_text([("login1", 64)]) or ""


@sample("progress")
def _progress(place: Place) -> str:
    from torchrunx.launcher.view.progress import mib, progress_text

    return progress_text("agents starting", 5, 8, "hosts up", 2.3) + (
        f"; code shipped: {mib(12 * 2**20)}"
    )


@sample("progress-results")
def _progress_results(place: Place) -> str:
    from torchrunx.launcher.view.progress import progress_text

    return progress_text("results", 96 * 2**20, None, "bytes", 1.4)


@sample("straggler-warning")
def _straggler_warning(place: Place) -> str:
    from torchrunx.launcher.launch.stragglers import straggler_warning
    from torchrunx.launcher.state.hangs import Straggler

    return straggler_warning(Straggler(5, 0.9, 50, 0.8), "node2", 0.1)


@sample("top")
def _top(place: Place) -> str:
    from torchrunx.commands.top import Ages, Screen

    figures = [  # pid, cpu, rss, gpu, collectives, loss
        (5883, 98.4, 2.7, 94, 1532, "2.31"),
        (5884, 97.0, 2.7, 95, 1532, "2.29"),
        (7710, 99.0, 2.7, 93, 1530, "2.30"),
        (7711, 96.2, 2.7, 94, 1532, "2.33"),
    ]
    workers = [
        {
            "rank": r,
            "host_index": r // 2,
            "hostname": f"node{r // 2 + 1}",
            "local_rank": r % 2,
            "pid": pid,
            "state": "HEALTHY",
            "cpu_percent": cpu,
            "rss_bytes": int(rss * (1 << 30)),
            "gpu_percent": gpu,
            "gpu_memory_bytes": 39 << 30,
            "collectives": count,
        }
        for r, (pid, cpu, rss, gpu, count, _) in enumerate(figures)
    ]
    snapshot = {
        "pid": 5872,
        "log_dir": "torchrunx_logs/2026-11-28T10:24:20",
        "report": {
            "healthy": True,
            "launch_state": "running",
            "attempt": 0,
            "restarts": 0,
            "max_restarts": 1,
            "uptime": 41.2,
            "agents": [
                {"hostname": h, "state": "RUNNING", "last_heartbeat_age": age, "role": "host"}
                for h, age in (("node1", 0.4), ("node2", 0.1))
            ],
            "workers": workers,
            "failures": [],
            "world_changes": [],
        },
        "last_lines": {
            f"{r // 2}:{r % 2}": f"step 170 loss {loss}" for r, (*_, loss) in enumerate(figures)
        },
    }
    ages = Ages()
    screen = Screen()  # the live screen: the first rank selected, the keys under the table
    screen.lines(snapshot, ages, now=0.0)  # first seen in that state 38.5 s before
    return "\n".join(screen.lines(snapshot, ages, now=38.5))


@sample("event-line")
def _event_line(place: Place) -> str:
    from torchrunx.events import EventSink, Restarting

    path = place.tmp_path / "events.jsonl"
    sink = EventSink([], path)
    sink.emit(Restarting(1, 2, "RuntimeError: bad luck in attempt 0", time=1795274134.49))
    sink.close()
    return path.read_text()


@sample("agent-command")
def _agent_command(place: Place) -> str:
    from torchrunx.engines.command import AGENT_COMMAND

    return AGENT_COMMAND


# -- failures and their notes ------------------------------------------------------------------


def printed(error: BaseException) -> str:
    """The last lines of the traceback Python prints for ``error``: its type, message, notes."""
    import traceback

    return "".join(traceback.format_exception_only(error))


def raised_in_worker(error: BaseException, where: str) -> BaseException:
    """``error`` as the launcher rebuilds it from what the worker sent (``where``: the worker)."""
    from torchrunx import serialization
    from torchrunx.launcher.state.reports import rebuild_exception
    from torchrunx.wire.messages import WorkerException

    message = WorkerException(0, type(error).__name__, str(error), "Traceback ...\n")
    return rebuild_exception(message, [bytearray(p) for p in serialization.dumps(error)], where)


@sample("output-tail")
def _output_tail(place: Place) -> str:
    from torchrunx.launcher.state.reports import output_tail_note, worker_where

    where = worker_where(3, 1, "node2", 5120)
    error = raised_in_worker(RuntimeError("loss diverged"), where)
    tail = [f"epoch {n}: loss {loss}" for n, loss in ((28, 3.2), (29, 41.7), (30, "nan"))]
    note = output_tail_note(tail, "torchrunx_logs/2025-06-01T14:03:27/node2[1].log")
    error.add_note(note or "")
    return printed(error)


@sample("output-tail-note")
def _output_tail_note(place: Place) -> str:
    from torchrunx.launcher.state.reports import output_tail_note

    tail = ["step 118: loss 0.71", "Traceback (most recent call last):", "  ..."]
    return output_tail_note(tail, "torchrunx_logs/2026-11-28T10:24:20/node1[1].log") or ""


@sample("restarts-notes")
def _restarts_notes(place: Place) -> str:
    from torchrunx.launcher.state.reports import finish_report, summary, worker_where

    history = [f"attempt {n}: {summary(ValueError(f'attempt {n} failed'))}" for n in (0, 1)]
    error = raised_in_worker(ValueError("attempt 2 failed"), worker_where(0, 0, "node1", 4250))
    return printed(finish_report(error, others=[], history=history, max_restarts=2))


@sample("watchdog-error")
def _watchdog_error(place: Place) -> str:
    from torchrunx.launcher.state.reports import watchdog_error
    from torchrunx.wire.messages import WorkerTimedOut

    stack = (
        "Current thread 0x00007f4e83a7cb80 (most recent call first):\n"
        '  File "/home/me/train.py", line 9 in train_step\n'
        '  File "/home/me/train.py", line 15 in train\n'
    )
    return printed(watchdog_error("node2", 3, WorkerTimedOut(1, "step", 60.0, stack)))


@sample("oom-kill")
def _oom_kill(place: Place) -> str:
    from torchrunx.agent.memory import MemoryFacts, sigkill_cause
    from torchrunx.errors import WorkerFailedError

    before = MemoryFacts(oom_kills=3, cgroup="/slurm/uid_0/job_42", cgroup_oom_kills=0)
    after = MemoryFacts(3, "/slurm/uid_0/job_42", 1, limit=256 * 2**20, peak=256 * 2**20)
    return str(WorkerFailedError("node2", 1, 1, 51234, None, 9, sigkill_cause(before, after)))


@sample("health-json")
def _health_json(place: Place) -> str:
    import json

    from torchrunx.errors import WorkerFailedError
    from torchrunx.events import AgentState, WorkerState
    from torchrunx.launcher.state.health import AgentHealth, HealthReport, WorkerHealth
    from torchrunx.launcher.state.reports import summary

    segfault = WorkerFailedError("node2", 1, 3, 51234, None, 11)
    states = [WorkerState.HEALTHY] * 2 + [WorkerState.INIT] * 2
    pids = [48211, 48212, 51377, 51378]
    running = (2871001088, 94, 41875931136, 1532)  # rss, gpu %, gpu memory, collectives
    uses = [(97.5, *running), (98.1, *running), *[(None, 402653184, None, None, None)] * 2]
    report = HealthReport(
        healthy=False,
        launch_state="restarting",
        attempt=1,
        restarts=1,
        max_restarts=3,
        uptime=754.125,
        agents=tuple(
            AgentHealth(i, f"node{i + 1}", AgentState.RUNNING, age, "host")
            for i, age in ((0, 0.412), (1, 0.873))
        ),
        workers=tuple(
            WorkerHealth(rank, rank // 2, f"node{rank // 2 + 1}", rank % 2, pids[rank], state, *use)
            for rank, state, use in zip(range(4), states, uses, strict=True)
        ),
        failures=(f"attempt 0: {summary(segfault)}",),
    )
    body = json.loads(report.to_json())  # the body, one line; shown a row per agent and worker

    def row(value: object) -> str:
        if isinstance(value, list) and value:
            return "[\n" + ",\n".join(f"    {json.dumps(v)}" for v in value) + "\n  ]"
        return json.dumps(value)

    return "{\n" + ",\n".join(f'  "{key}": {row(value)}' for key, value in body.items()) + "\n}"


# -- debugging ---------------------------------------------------------------------------------


@sample("breakpoint-skipped")
def _breakpoint_skipped(place: Place) -> str:
    from torchrunx.worker.debugger import skipped_text

    return skipped_text("/home/me/train.py:41", 1)


@sample("debugpy-waits")
def _debugpy_waits(place: Place) -> str:
    from torchrunx.launcher.launch.outward import debugpy_text

    return debugpy_text(3, 5690, "node2", "forwarded")


@sample("worker-no-direct")
def _worker_no_direct(place: Place) -> str:
    from torchrunx.worker.worker import no_direct_text

    return no_direct_text(("10.0.0.5", 41233), TimeoutError("timed out"))


# -- engines -----------------------------------------------------------------------------------


@sample("srun-command")
def _srun_command(place: Place) -> str:
    import shlex

    from torchrunx.engines.builtin import srun_command

    return shlex.join(srun_command("node2", cpus=64))


@sample("kubernetes-dry-run", quick=False)
def _kubernetes_dry_run(place: Place) -> str:
    """The dry run's hosts and its first command line, pods listed by the kubectl stand-in."""
    import json
    import sys

    import torchrunx as trx

    standin = Path(__file__).with_name("kubectl_standin.py")
    kubectl = place.tmp_path / "bin" / "kubectl"
    kubectl.parent.mkdir()
    kubectl.write_text(f'#!/bin/sh\nexec {sys.executable} {standin} "$@"\n')
    kubectl.chmod(0o755)
    pods = [
        {
            "name": f"train-{i}",
            "namespace": "ml",
            "context": "prod",
            "phase": "Running",
            "podIP": f"10.0.0.{i + 1}",
            "labels": {"app": "trainer"},
            "containers": [{"name": "trainer", "gpus": 2}],
        }
        for i in range(2)
    ]
    table = {"current-context": "prod", "contexts": {"prod": {"namespace": "default"}}}
    (place.tmp_path / "pods.json").write_text(json.dumps({**table, "pods": pods}))
    place.bare_env(
        KUBECTL_STANDIN_PODS=str(place.tmp_path / "pods.json"),
        KUBECTL_STANDIN_LOG=str(place.tmp_path / "calls.jsonl"),
    )
    place.monkeypatch.setenv("PATH", f"{kubectl.parent}:{os.environ['PATH']}")
    selector = "kubernetes:app=trainer?namespace=ml&context=prod&container=trainer"
    lines = trx.Launcher(hostnames=selector).dry_run().splitlines()
    commands = lines.index("agent command lines (the script and secret go on stdin, never here):")
    return "\n".join([*lines[1:4], "...", *lines[commands : commands + 2]])


# -- logs --------------------------------------------------------------------------------------


def _record(name: str, level: int, message: str, **source: object) -> logging.LogRecord:
    """A record as the launcher makes of a forwarded line, at 14:03:29 on 2025-06-01 (UTC)."""
    created = 1748786609.118
    return logging.makeLogRecord(
        {
            "name": name,
            "levelno": level,
            "levelname": logging.getLevelName(level),
            "msg": message,
            "created": created,
            "msecs": (created % 1) * 1000,
            **source,
        }
    )


def _console(records: list[tuple[str, int, str]]) -> str:
    """What the default console handler prints of ``(host, local rank, line)`` of workers."""
    from torchrunx.logs import console_handler

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        handler = console_handler()
    for host, local_rank, line in records:
        source = {"hostname": host, "local_rank": local_rank}
        handler.handle(_record(f"worker.{local_rank}.stdout", logging.INFO, line, **source))
    handler.flush()
    return out.getvalue()


@sample("console-rank-0")
def _console_rank_0(place: Place) -> str:
    return _console([("node1", 0, "epoch 0: loss 0.931"), ("node1", 0, "epoch 1: loss 0.402")])


@sample("console-ranks")
def _console_ranks(place: Place) -> str:
    return _console([("node1", 0, "epoch 0: loss 0.931"), ("node2", 1, "epoch 0: loss 0.928")])


@sample("log-file-lines")
def _log_file_lines(place: Place) -> str:
    import time

    from torchrunx.logs import file_handler

    path = place.tmp_path / "node1[0].log"
    handler = file_handler("node1", 0, path)
    assert handler.formatter is not None
    handler.formatter.converter = time.gmtime  # the page's times are UTC, not this machine's
    source = {"hostname": "node1", "local_rank": 0}
    warning = '/home/me/train.py:12: UserWarning: no GPU\n  warnings.warn("no GPU")'
    for name, level, message, later in (
        ("worker.0.stdout", logging.INFO, "epoch 0: loss 0.931", 0.0),
        ("mylib", logging.WARNING, "learning rate is high", 0.002),
        ("py.warnings", logging.WARNING, warning, 0.003),
    ):
        record = _record(name, level, message, **source)
        record.created += later
        record.msecs = round((record.created % 1) * 1000, 3)
        handler.handle(record)
    handler.close()
    return path.read_text()


# -- stalls and stacks -------------------------------------------------------------------------

_TORCH = "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def _stack(thread: str, *frames: tuple[str, int, str]) -> str:
    """A worker's stack as ``faulthandler`` writes it (innermost frame first)."""
    lines = [f"Current thread 0x{thread} (most recent call first):"]
    lines += [f'  File "{path}", line {line} in {function}' for path, line, function in frames]
    return "\n".join(lines) + "\n"


_STUCK = _stack(
    "00007f31c2a8b740",
    ("/home/me/data.py", 12, "__next__"),
    ("/home/me/train.py", 54, "train_step"),
    ("/home/me/train.py", 80, "train"),
)
"""Rank 7's stack: in the data loader, not in the collective."""


def _ranks() -> tuple[list, dict[int, str]]:
    """Ranks 0-15, 8 on each of node1 and node2: their records and hosts."""
    from torchrunx.launcher.state.records import RankRecord

    ranks = [RankRecord(rank, rank // 8, rank % 8) for rank in range(16)]
    return ranks, {r.rank: f"node{r.host_index + 1}" for r in ranks}


@sample("stall-diagnosis")
def _stall_diagnosis(place: Place) -> str:
    from torchrunx.launcher.launch.stalls import StallLook, StallReport, diagnosis_text
    from torchrunx.wire.messages import RankState

    ranks, hosts = _ranks()
    step = (
        "default_pg",
        41,
        "all_reduce",
        ((1024, 1024),),
        ("Float",),
        False,
        0,
        "/home/me/train.py:57 in step",
    )
    done = ("default_pg", 40, "all_reduce", ((1024, 1024),), ("Float",), True, 0, "")
    waiting = _stack(
        "00007f2b8c9f1740", (_TORCH, 2501, "all_reduce"), ("/home/me/train.py", 57, "step")
    )
    states = {
        rank: RankState(
            group_formed=True,
            entries=(done,),
            where="/home/me/data.py:12 in __next__",
            stacks=_STUCK,
        )
        if rank == 7
        else RankState(
            group_formed=True,
            entries=(done, step),
            where="/home/me/train.py:57 in step",
            stacks=waiting,
        )
        for rank in hosts
    }
    look = StallLook(300.0, set(), set(hosts), deadline=0.0, states=states)
    text, values, _ = diagnosis_text(look, ranks, hosts)
    return f"{StallReport(300.0, text, values, 1).headline}\n{text}"


@sample("where-every-rank-is")
def _where_every_rank_is(place: Place) -> str:
    from torchrunx.launcher.view.where import StacksLook

    ranks, hosts = _ranks()
    barrier = _stack(
        "00007f2b8c9f1740",
        (_TORCH, 4135, "barrier"),
        ("/home/me/train.py", 57, "train_step"),
        ("/home/me/train.py", 80, "train"),
    )
    look = StacksLook([], now=0.0)
    look.stacks = {rank: _STUCK if rank == 7 else barrier for rank in hosts}
    return look.text(ranks, lambda r: hosts[r.rank])


@sample("sigusr1-stacks")
def _sigusr1_stacks(place: Place) -> str:
    from torchrunx.agent.attempt import stacks_record

    stack = _stack("00007f29d61b2740", ("/home/me/train.py", 41, "train_step"))
    _, level, name, text, _ = stacks_record(1, 4251, stack.rstrip(), 0.0)
    from torchrunx.logs import console_handler

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        handler = console_handler()
    record = _record(name, level, text, hostname="node2", local_rank=1)
    handler.handle(record)
    handler.flush()
    return out.getvalue()


@sample("fewer-than-min-hosts")
def _fewer_than_min_hosts(place: Place) -> str:
    """Three hosts, ``min_hosts=2``, no spare: node3 fails (dropped), then node2 (too few)."""
    from torchrunx.engines.command import agent_exit_error
    from torchrunx.errors import add_note
    from torchrunx.events import AgentState
    from torchrunx.launcher.settings.resolve import HostSlots
    from torchrunx.launcher.state.records import AgentRecord, Phase
    from torchrunx.launcher.state.reports import finish_report, summary, world_changes_note
    from torchrunx.launcher.state.spares import reshape
    from torchrunx.launcher.state.state import LaunchState

    agents = [AgentRecord(i, HostSlots(f"node{i + 1}", 2), "ssh") for i in range(3)]
    state = LaunchState(agents, started=100.0, max_restarts=3, agent_timeout=30.0)
    table = state.agent_table
    for phase in (Phase.STARTING_WORKERS, Phase.RUNNING):
        state.progress.move_phase(phase)
    errors = [  # each host's SSH connection dropped
        agent_exit_error(f"node{i}", -1, remote=True, connected=True, env_file=None, stderr_tail="")
        for i in (3, 2)
    ]
    for attempt, (error, agent) in enumerate(zip(errors, (agents[2], agents[1]), strict=True)):
        agent.state = AgentState.FAILED
        table.quarantine(agent)
        state.begin_stop(restart=True)
        state.record_restart(summary(error))
        world = reshape([a.index for a in table.world], [agent.index], [], 2)
        if world.short is not None:
            state.restart_failed(world.short)
            break
        table.reshape_world(world)
        state.next_attempt()
        assert attempt == 0
    finish_report(error, others=state.extra_failures, history=state.history, max_restarts=3)
    add_note(error, world_changes_note(table.world_changes) or "")
    return printed(error)


# -- real launches on this machine -------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _run(argv: list[str], place: Place) -> tuple[int, str, str]:
    """Run ``argv`` in the sample's folder, this checkout importable, nothing else forwarded."""
    import subprocess

    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "TORCHRUNX_HINTS": "0"}
    done = subprocess.run(
        argv, cwd=place.tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    return done.returncode, done.stdout, done.stderr


@sample("first-launch", quick=False)
def _first_launch(place: Place) -> str:
    """``docs/index.md``'s first script, run as the page runs it."""
    import sys

    page = (ROOT / "docs" / "index.md").read_text()
    start = page.index('```python title="first.py"\n')
    code = page[page.index("\n", start) + 1 : page.index("\n```", start)]
    (place.tmp_path / "first.py").write_text(code + "\n")
    status, out, err = _run([sys.executable, "first.py"], place)
    assert status == 0, err
    return f"$ python first.py\n{out}"


@sample("cli-failure", quick=False)
def _cli_failure(place: Place) -> str:
    """A function that raises on rank 0, run by the command; its pid, the launch's folder and
    the paths and line numbers inside torchrunx are shown fixed (they change with every run
    and every release)."""
    import re
    import sys

    (place.tmp_path / "train.py").write_text(
        'import os\n\n\ndef check() -> None:\n    if os.environ["RANK"] == "0":\n'
        '        raise ValueError("bad batch on rank 0")\n'
    )
    # One worker: a second one still starting (importing) when rank 0 raised had its stacks
    # added to the sample, under load.
    argv = ["--hostnames", "localhost", "--workers-per-host", "1", "--backend", "None"]
    status, _, err = _run([sys.executable, "-m", "torchrunx", *argv, "--", "train:check"], place)
    assert status == 1, err
    err = err.replace(str(ROOT / "torchrunx"), ".../torchrunx")
    err = err.replace(str(place.tmp_path), "/home/me/project")
    err = re.sub(r'(File "\.\.\./torchrunx/[^"]+", line )\d+', r"\1N", err)
    err = re.sub(r"pid \d+", "pid 18315", err)
    return re.sub(r"torchrunx_logs/[^/]+/", "torchrunx_logs/2026-11-26T13:32:59/", err)


@sample("slurm-example", quick=False)
def _slurm_example(place: Place) -> str:
    """What ``examples/slurm/launch.py`` prints, for the ranks' reports of a 2-node job."""
    import importlib.util
    import sys

    import torchrunx as trx
    from torchrunx.launcher.state.results import LaunchResult

    spec = importlib.util.spec_from_file_location("slurm_launch", ROOT / "examples/slurm/launch.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    reports = [
        {
            "rank": rank,
            "world_size": 2,
            "local_rank": 0,
            "hostname": f"node{rank + 1}",
            "backend": "gloo",
            "slurm_step": "0" if rank else None,
            "rank_sum": 1,
        }
        for rank in (0, 1)
    ]
    result = LaunchResult(("node1", "node2"), ((reports[0],), (reports[1],)))
    place.monkeypatch.setattr(trx.Launcher, "run", lambda *_: result)  # the ranks' reports
    place.monkeypatch.setattr(sys, "argv", ["launch.py"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.main()
    return out.getvalue()
