"""Restarts, the watchdog, events and the health endpoint, with real workers and real faults."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

import pytest

import torchrunx as trx
from torchrunx import events as ev


def flaky_until_third_attempt() -> dict[str, object]:
    import torch.distributed as dist

    attempt = int(os.environ["TORCHRUNX_RESTART_COUNT"])
    if attempt == 0:
        if dist.get_rank() == 1:
            raise RuntimeError("bad luck in attempt 0")
        time.sleep(60)  # not in a collective: rank 1's error would fail it too, at any moment
    if attempt == 1:
        if dist.get_rank() == 0:
            os._exit(7)  # a death this time
        time.sleep(60)  # no collective: the peer's error must not race the death report
    dist.barrier()
    return {
        "attempt": attempt,
        "elastic": os.environ["TORCHELASTIC_RESTART_COUNT"],
        "max": os.environ["TORCHELASTIC_MAX_RESTARTS"],
        "agent_pid": os.getppid(),
        "rank": dist.get_rank(),
    }


def test_fails_twice_then_succeeds_on_the_same_agents(log_dir):
    seen: list[ev.Event] = []
    result = trx.Launcher(
        hostnames=["localhost"],
        workers_per_host=2,
        backend="gloo",
        max_restarts=2,
        event_handlers=(seen.append,),
    ).run(flaky_until_third_attempt)
    assert result.restarts == 2
    assert [r["rank"] for r in result.ranks] == [0, 1]
    assert {(r["attempt"], r["elastic"], r["max"]) for r in result.ranks} == {(2, "2", "2")}
    # One agent for the whole launch: it was started once and forked every generation.
    (agent,) = [e for e in seen if isinstance(e, ev.AgentStarted)]
    assert {r["agent_pid"] for r in result.ranks} == {agent.pid}
    restarts = [e for e in seen if isinstance(e, ev.Restarting)]
    assert [(e.attempt, e.max_restarts) for e in restarts] == [(1, 2), (2, 2)]
    assert "bad luck in attempt 0" in restarts[0].reason
    assert "exit code 7" in restarts[1].reason
    failed = [(e.rank, e.attempt) for e in seen if isinstance(e, ev.WorkerFailed)]
    assert failed == [(1, 0), (0, 1)]
    assert [type(e).__name__ for e in seen if isinstance(e, ev.WorkersStarted)] == [
        "WorkersStarted"
    ] * 3
    finished = seen[-1]
    assert isinstance(finished, ev.LaunchFinished)
    assert (finished.succeeded, finished.attempts, finished.error) == (True, 3, None)
    # Every worker ends in exactly one final state per attempt.
    final = [
        (e.attempt, e.rank, e.new)
        for e in seen
        if isinstance(e, ev.WorkerStateChanged) and e.new.is_final
    ]
    assert sorted(final) == [
        (0, 0, trx.WorkerState.STOPPED),
        (0, 1, trx.WorkerState.FAILED),
        (1, 0, trx.WorkerState.FAILED),
        (1, 1, trx.WorkerState.STOPPED),
        (2, 0, trx.WorkerState.SUCCEEDED),
        (2, 1, trx.WorkerState.SUCCEEDED),
    ]
    # The same events, as JSON lines, beside the launch's log folder.
    (folder,) = (path for path in log_dir.iterdir() if path.is_dir() and not path.is_symlink())
    events = log_dir / f"{folder.name}.events.jsonl"
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [line["event"] for line in lines] == [type(e).__name__ for e in seen]
    assert lines[-1]["succeeded"] is True
    timings = result.timings
    assert len(timings.function) == len(timings.process_group_init) == 2
    assert 0 < timings.agents_started < timings.total
    assert all(t > 0 for t in timings.process_group_init)


def always_fails() -> None:
    attempt = os.environ["TORCHRUNX_RESTART_COUNT"]
    raise ValueError(f"attempt {attempt} failed")


def test_restarts_exhausted_raise_the_last_failure_with_the_history():
    with pytest.raises(ValueError, match="attempt 2 failed") as info:
        trx.launch(
            always_fails, hostnames=["localhost"], workers_per_host=1, backend=None, max_restarts=2
        )
    notes = "\n".join(info.value.__notes__)
    assert "restarted 2 time(s) (max_restarts=2)" in notes
    assert "attempt 0: ValueError: attempt 0 failed" in notes
    assert "attempt 1: ValueError: attempt 1 failed" in notes


def raise_file_not_found() -> int:
    attempt = int(os.environ["TORCHRUNX_RESTART_COUNT"])
    if attempt == 0:
        raise FileNotFoundError("checkpoint missing")
    return attempt


def test_restart_on_filters_failures():
    # Only deaths restart: an exception is raised at once.
    with pytest.raises(FileNotFoundError):
        trx.launch(
            raise_file_not_found,
            hostnames=["localhost"],
            workers_per_host=1,
            backend=None,
            max_restarts=3,
            restart_on=("deaths",),
        )
    # A base class name matches a subclass raised in the worker.
    result = trx.launch(
        raise_file_not_found,
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        max_restarts=3,
        restart_on=("OSError",),
    )
    assert (result.ranks, result.restarts) == ([1], 1)
    with pytest.raises(ValueError, match="max_restarts must be an integer >= 0"):
        trx.Launcher(max_restarts=-1).validate()
    with pytest.raises(TypeError, match="restart_on must be a tuple"):
        trx.Launcher(restart_on="deaths").validate()  # type: ignore[arg-type]


def stuck_in_a_step(stuck_rank: int) -> str:
    import torch.distributed as dist

    for step in range(50):
        with trx.timer.expires(after=1.0, scope="train step"):
            if dist.get_rank() == stuck_rank and step == 2:
                time.sleep(120)  # a hang: the watchdog must end it
        dist.barrier()  # outside the timed block: the others wait here, untimed
    return "done"


@pytest.mark.cluster
def test_watchdog_catches_a_stuck_step_on_a_remote_host(cluster):
    started = time.monotonic()
    with pytest.raises(trx.WorkerTimeoutError) as info:
        trx.launch(
            stuck_in_a_step,
            func_args=(3,),
            hostnames=cluster.names(),
            workers_per_host=2,
            backend="gloo",
            ssh_config_file=cluster.ssh_config,
        )
    error = info.value
    assert (error.hostname, error.rank, error.local_rank, error.scope, error.limit) == (
        cluster.names()[1],
        3,
        1,
        "train step",
        1.0,
    )
    assert "stayed in timer scope 'train step' longer than its limit of 1 s" in str(error)
    notes = "\n".join(error.__notes__)
    assert "Python stack of rank 3 when its limit passed" in notes
    assert "in stuck_in_a_step" in notes
    assert time.monotonic() - started < 30  # not the 120 s sleep


def test_watchdog_timeout_restarts_like_a_failure():
    def hang_once() -> int:
        attempt = int(os.environ["TORCHRUNX_RESTART_COUNT"])
        with trx.timer.expires(after=0.5, scope="load"):
            if attempt == 0:
                time.sleep(60)
        return attempt

    result = trx.launch(
        hang_once, hostnames=["localhost"], workers_per_host=1, backend=None, max_restarts=1
    )
    assert (result.ranks, result.restarts) == ([1], 1)


def test_timer_outside_a_worker_is_a_plain_block():
    with trx.timer.expires(after=0.01, scope="local"):
        time.sleep(0.05)  # no watchdog here: nothing happens
    with pytest.raises(ValueError, match="after must be a positive number"):
        trx.timer.expires(after=0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (a local test URL)
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_for_file(path: str, *, fail_first: bool) -> int:
    import torch.distributed as dist

    attempt = int(os.environ["TORCHRUNX_RESTART_COUNT"])
    if fail_first and attempt == 0 and dist.get_rank() == 1:
        raise RuntimeError("first attempt fails")
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return dist.get_rank()


def test_health_endpoint_while_a_launch_runs(tmp_path, monkeypatch):
    import threading

    port = _free_port()
    monkeypatch.setenv("TORCHRUNX_HEALTH_CHECK_PORT", str(port))
    monkeypatch.setenv("TORCHRUNX_HEALTH_CHECK_DETAILS", "1")  # failures with their messages
    url = f"http://127.0.0.1:{port}/health"
    during_restart: list[tuple[int, dict[str, object]]] = []

    def on_event(event: ev.Event) -> None:
        # Handlers run in the launcher's thread: the launch is held right here, mid-restart.
        if isinstance(event, ev.Restarting):
            during_restart.append(_get(url))

    release = tmp_path / "release"
    outcome: dict[str, object] = {}

    def run() -> None:
        launcher = trx.Launcher(
            hostnames=["localhost"],
            workers_per_host=2,
            backend="gloo",
            max_restarts=1,
            event_handlers=(on_event,),
        )
        outcome["result"] = launcher.run(wait_for_file, str(release), fail_first=True)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        status, report = 0, {}
        while time.monotonic() < deadline:
            try:
                status, report = _get(url)
            except OSError:
                time.sleep(0.05)
                continue
            workers = report["workers"]
            if (
                report["attempt"] == 1
                and len(workers) == 2
                and all(w["state"] == "HEALTHY" for w in workers)
            ):
                break
            time.sleep(0.05)
        assert status == 200, report
        assert report["healthy"] is True
        assert report["restarts"] == 1 and report["max_restarts"] == 1
        assert [a["state"] for a in report["agents"]] == ["RUNNING"]
        assert [a["hostname"] for a in report["agents"]] == ["localhost"]
        assert report["agents"][0]["last_heartbeat_age"] < 5
        assert [(w["rank"], w["local_rank"]) for w in report["workers"]] == [(0, 0), (1, 1)]
        assert all(isinstance(w["pid"], int) for w in report["workers"])
        assert any("first attempt fails" in f for f in report["failures"])
    finally:
        release.write_text("go")
        thread.join(60)
    assert outcome["result"].ranks == [0, 1]
    # Mid-restart the endpoint said 503, with the failed worker.
    ((code, mid),) = during_restart
    assert code == 503 and mid["healthy"] is False
    assert {w["rank"]: w["state"] for w in mid["workers"]}[1] == "FAILED"
    # The endpoint lives only as long as the launch.
    with pytest.raises(urllib.error.URLError, match="Connection refused"):
        _get(url)


def kill_my_agent_once() -> int:
    import signal

    if os.environ["TORCHRUNX_RESTART_COUNT"] == "0":
        os.kill(os.getppid(), signal.SIGKILL)  # the agent dies; this worker dies with it
        time.sleep(30)
    return os.getppid()


def test_a_dead_agent_is_replaced_only_when_asked():
    with pytest.raises(trx.AgentFailedError, match="agent on host 'localhost' failed"):
        trx.launch(
            kill_my_agent_once,
            hostnames=["localhost"],
            workers_per_host=1,
            backend=None,
            max_restarts=1,
        )
    seen: list[ev.Event] = []
    result = trx.launch(
        kill_my_agent_once,
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        max_restarts=1,
        restart_on=("hosts",),
        event_handlers=(seen.append,),
    )
    first, second = [e.pid for e in seen if isinstance(e, ev.AgentStarted)]
    assert first != second
    assert (result.ranks, result.restarts) == ([second], 1)


def one_host_done_early_the_other_dies(folder: str) -> int:
    rank = int(os.environ["RANK"])
    if os.environ["TORCHRUNX_RESTART_COUNT"] != "0":
        return rank
    if rank == 1:  # host 1: says who it is and when it returns, then returns
        _write_whole(f"{folder}/returned", f"{os.getpid()} {time.time()!r}")
        return rank
    # Host 0 dies only once host 1's worker has returned and ended (a bounded wait on facts,
    # not a sleep): its agent is idle by then. If it never does, nothing is written and the
    # test fails.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(f"{folder}/returned"):
            with open(f"{folder}/returned") as f:
                pid = int(f.read().split()[0])
            if not os.path.exists(f"/proc/{pid}"):
                _write_whole(f"{folder}/died", repr(time.time()))
                os._exit(7)
        time.sleep(0.05)
    os._exit(8)


def _write_whole(path: str, text: str) -> None:
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)  # a reader sees all of it or nothing


def test_restart_when_another_hosts_workers_already_finished(tmp_path):
    # Two agents (two names for this machine): host 1's only worker returns at once, host 0's
    # dies once it has. Host 1's agent must still be there to restart its worker.
    seen: list[ev.Event] = []
    result = trx.launch(
        one_host_done_early_the_other_dies,
        (str(tmp_path),),
        hostnames=["localhost", "127.0.0.1"],
        workers_per_host=1,
        backend=None,
        max_restarts=1,
        event_handlers=(seen.append,),
    )
    assert (result.ranks, result.restarts) == ([0, 1], 1)
    # Host 1 finished first: its worker returned (and ended) before host 0's died.
    returned = float((tmp_path / "returned").read_text().split()[1])
    died = float((tmp_path / "died").read_text())
    assert returned < died
    succeeded = [
        e
        for e in seen
        if isinstance(e, ev.WorkerStateChanged)
        and (e.rank, e.attempt, e.new) == (1, 0, ev.WorkerState.SUCCEEDED)
    ]
    assert len(succeeded) == 1  # attempt 0's rank 1 returned its value, it was not stopped
    (restart,) = [e for e in seen if isinstance(e, ev.Restarting)]
    assert "exit code 7" in restart.reason  # the restart answered host 0's death


class NeedsTwoArguments(Exception):  # noqa: N818 (a user's exception, as users name them)
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} and {b}")


def raise_unpicklable_once() -> str:
    if os.environ["TORCHRUNX_RESTART_COUNT"] == "0":
        raise NeedsTwoArguments(1, 2)
    return "ok"


def test_an_exception_that_cannot_travel_back_still_restarts():
    result = trx.launch(
        raise_unpicklable_once,
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        max_restarts=1,
        restart_on=("NeedsTwoArguments",),
    )
    assert (result.ranks, result.restarts) == (["ok"], 1)


def test_health_port_zero_is_announced_in_the_first_event(monkeypatch):
    monkeypatch.setenv("TORCHRUNX_HEALTH_CHECK_PORT", "0")
    seen: list[ev.Event] = []
    trx.launch(
        os.getpid,
        hostnames=["localhost"],
        workers_per_host=1,
        backend=None,
        event_handlers=(seen.append,),
    )
    started = seen[0]
    assert isinstance(started, ev.LaunchStarted)
    assert started.health_url is not None
    assert started.health_url.endswith("/health")
    assert int(started.health_url.rsplit(":", 1)[1].split("/")[0]) > 0
