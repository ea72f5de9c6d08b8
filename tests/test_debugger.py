"""``breakpoint()`` in a worker opens pdb in the launcher's terminal (a real pseudo-terminal).

Each test writes a launching script to a file (so the workers get its lines, as a user's script
would), runs it in a pseudo-terminal with pexpect and types at it as a user at a shell would.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pexpect
import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import os, sys
import torchrunx as trx

def work(stops):
    rank = int(os.environ["RANK"])
    value = 41 + rank
    if rank in stops:
        breakpoint()
    return value + 1

hosts = sys.argv[1].split(",")
stops = [int(r) for r in sys.argv[2].split(",") if r]
launcher = trx.Launcher(
    hostnames=hosts, workers_per_host=2, backend=None,
    ssh_config_file=sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None,
    launch_timeout=float(sys.argv[4]) if len(sys.argv) > 4 else None,
)
result = launcher.run(work, stops)
print("RESULTS", result.ranks, flush=True)
"""

DIST_SCRIPT = """
import os, sys
import torch.distributed as dist
import torchrunx as trx

def work():
    rank = dist.get_rank()
    value = 41 + rank
    dist.breakpoint(rank=1)
    return value + 1

hosts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["localhost"]
result = trx.Launcher(
    hostnames=hosts, workers_per_host=2, backend="gloo",
    ssh_config_file=sys.argv[2] if len(sys.argv) > 2 else None,
).run(work)
print("RESULTS", result.ranks, flush=True)
"""

TIMER_SCRIPT = """
import os
import torchrunx as trx

def work():
    rank = int(os.environ["RANK"])
    with trx.timer.expires(after=2, scope="step"):
        if rank == 1:
            breakpoint()
        value = rank
    return value

result = trx.launch(work, hostnames=["localhost"], workers_per_host=2, backend=None)
print("RESULTS", result.ranks, flush=True)
"""

WARM_SCRIPT = """
import os
import torchrunx as trx

def work(stop):
    rank = int(os.environ["RANK"])
    value = 41 + rank
    if stop and rank == 1:
        breakpoint()
    return value + 1

launcher = trx.Launcher(hostnames=["localhost"], workers_per_host=2, backend=None)
with launcher.warm(keep_workers=True) as warm:
    print("FIRST", warm.run(work, False).ranks, flush=True)
    print("SECOND", warm.run(work, True).ranks, flush=True)
    print("THIRD", warm.run(work, True).ranks, flush=True)
"""

FAIL_WHILE_PAUSED_SCRIPT = """
import os, sys, time
import torchrunx as trx

def work(folder):
    rank = int(os.environ["RANK"])
    if rank == 1:
        breakpoint()
        return rank
    while not os.path.exists(f"{folder}/go"):
        time.sleep(0.02)
    raise ValueError("rank 0 failed while rank 1 was in the debugger")

trx.launch(work, func_args=(sys.argv[1],), hostnames=["localhost"], workers_per_host=2,
           backend=None)
"""

RAISE_SCRIPT = """
import os, sys
import torchrunx as trx

def work():
    rank = int(os.environ["RANK"])
    value = 41 + rank
    if rank == 1:
        raise ValueError(f"boom in rank {rank}")
    return value

hosts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["localhost"]
trx.Launcher(
    hostnames=hosts, workers_per_host=2, backend=None,
    ssh_config_file=sys.argv[2] if len(sys.argv) > 2 else None,
).run(work)
"""

BREAK_LINE = 9
"""The line of ``breakpoint()`` in SCRIPT (the stop is at the line after it)."""


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        **extra,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TERM": "dumb",
    }


def _terminal(
    tmp_path: Path, command: str, argv: list[str], env: dict[str, str] | None = None
) -> pexpect.spawn:
    """``command argv`` in a pseudo-terminal in ``tmp_path``, logged to terminal.log."""
    child = pexpect.spawn(
        command,
        argv,
        cwd=str(tmp_path),
        env=env or _env(),
        encoding="utf-8",
        timeout=120,
        codec_errors="replace",
    )
    child.logfile_read = open(tmp_path / "terminal.log", "w")  # noqa: SIM115 (closed with it)
    return child


def _spawn(
    tmp_path: Path, *args: str, text: str = SCRIPT, env: dict[str, str] | None = None
) -> pexpect.spawn:
    """The launching script ``text`` with ``args``, in a pseudo-terminal."""
    script = tmp_path / "launch.py"
    script.write_text(text)
    return _terminal(tmp_path, sys.executable, [str(script), *args], env)


def _without_terminal(
    tmp_path: Path, text: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The launching script ``text`` with ``args``, stdin not a terminal; its outcome."""
    script = tmp_path / "launch.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env or _env(),
        cwd=tmp_path,
        timeout=120,
        check=False,
    )


@contextlib.contextmanager
def _closing(child: pexpect.spawn) -> Iterator[pexpect.spawn]:
    """The terminal's process ended (killed if still running) and its log closed after."""
    try:
        yield child
    finally:
        child.close(force=True)
        child.logfile_read.close()


def _prompt(rank: int, host: str = "localhost") -> str:
    return re.escape(f"(Pdb rank {rank} on {host}) ")


def _finish(child: pexpect.spawn) -> str:
    child.expect(pexpect.EOF)
    child.close()
    return str(child.before)


def test_breakpoint_opens_pdb_in_the_launchers_terminal_and_c_resumes(tmp_path):
    with _closing(_spawn(tmp_path, "localhost", "1")) as child:
        started = time.monotonic()
        child.expect(_prompt(1))
        assert time.monotonic() - started < 60
        header = str(child.before)
        assert "--- pdb: rank 1 on localhost at " in header
        assert f"launch.py:{BREAK_LINE + 1} in work ---" in header  # the script's own file
        assert "-> return value + 1" in header  # its line, from the script's text
        child.sendline("p value")
        child.expect(_prompt(1))
        assert "42" in str(child.before)
        child.sendline("value = 100")
        child.expect(_prompt(1))
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 101]"))  # rank 1 went on with the changed value
        _finish(child)
        assert child.exitstatus == 0


def test_torch_distributed_breakpoint_works_unchanged(tmp_path):
    with _closing(_spawn(tmp_path, text=DIST_SCRIPT)) as child:
        child.expect(_prompt(1))
        assert "Type 'up' to get to the frame that called dist.breakpoint(rank=1)" in str(
            child.before
        )
        child.sendline("up")
        child.expect(_prompt(1))
        assert "-> dist.breakpoint(rank=1)" in str(child.before)
        child.sendline("p value")
        child.expect(_prompt(1))
        assert "42" in str(child.before)
        child.sendline("c")  # rank 0 waited in torch's barrier meanwhile
        child.expect(re.escape("RESULTS [42, 43]"))
        _finish(child)
        assert child.exitstatus == 0


def test_post_mortem_opens_pdb_at_the_raising_frame_then_the_launch_raises(tmp_path):
    with _closing(
        _spawn(tmp_path, text=RAISE_SCRIPT, env=_env(TORCHRUNX_POST_MORTEM="1"))
    ) as child:
        child.expect(_prompt(1))
        before = str(child.before)
        assert "rank 1 raised ValueError: boom in rank 1; post-mortem" in before
        assert "launch.py:9 in work ---" in before  # the raising line
        child.sendline("p value")
        child.expect(_prompt(1))
        assert "42" in str(child.before)
        child.sendline("c")
        rest = _finish(child)
        assert child.exitstatus == 1
        assert "ValueError: boom in rank 1" in rest  # raised as without the post-mortem


def test_pdb_set_trace_works_as_breakpoint(tmp_path):
    text = SCRIPT.replace(
        "        breakpoint()", "        import pdb; pdb.set_trace(header='hello from rank 1')"
    )
    with _closing(_spawn(tmp_path, "localhost", "1", text=text)) as child:
        child.expect(_prompt(1))
        assert "hello from rank 1" in str(child.before)
        assert "-> return value + 1" in str(child.before)
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 43]"))
        _finish(child)
        assert child.exitstatus == 0


def test_two_ranks_at_a_breakpoint_wait_their_turn_and_can_be_switched(tmp_path):
    with _closing(_spawn(tmp_path, "localhost", "0,1")) as child:
        child.expect(r"\(Pdb rank (\d) on localhost\) ")
        first = int(child.match.group(1))
        other = 1 - first
        child.expect(re.escape(f"rank {other} on localhost stopped in the debugger at "))
        child.sendline(":ranks")
        child.expect(_prompt(first))
        listing = str(child.before)
        assert f"* rank {first} on localhost: waits" in listing
        assert f"  rank {other} on localhost: waits" in listing
        child.sendline(f":rank {other}")  # switch: the other rank's prompt
        child.expect(_prompt(other))
        child.sendline("p value")
        child.expect(_prompt(other))
        assert str(41 + other) in str(child.before)
        child.sendline("c")  # it runs on; the first rank gets the terminal back
        child.expect(_prompt(first))
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 43]"))
        _finish(child)
        assert child.exitstatus == 0


def test_a_paused_rank_does_not_trip_launch_timeout(tmp_path):
    launch_timeout = "3"  # seconds
    with _closing(_spawn(tmp_path, "localhost", "1", "", launch_timeout)) as child:
        child.expect(_prompt(1))
        time.sleep(5)  # longer than launch_timeout, in the debugger
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 43]"))
        _finish(child)
        assert child.exitstatus == 0


def test_a_paused_rank_does_not_trip_its_timer_expires_block(tmp_path):
    with _closing(_spawn(tmp_path, text=TIMER_SCRIPT)) as child:
        child.expect(_prompt(1))
        time.sleep(4)  # twice the block's limit, in the debugger
        child.sendline("c")
        child.expect(re.escape("RESULTS [0, 1]"))
        _finish(child)
        assert child.exitstatus == 0


def test_breakpoints_in_warm_runs_with_workers_that_stay(tmp_path):
    with _closing(_spawn(tmp_path, text=WARM_SCRIPT)) as child:
        child.expect(re.escape("FIRST [42, 43]"))
        child.expect(_prompt(1))  # the second run's breakpoint, in the same worker
        child.sendline("value = 0")
        child.expect(_prompt(1))
        child.sendline("c")
        child.expect(re.escape("SECOND [42, 1]"))
        child.expect(_prompt(1))  # and the third's
        child.sendline("c")
        child.expect(re.escape("THIRD [42, 43]"))
        _finish(child)
        assert child.exitstatus == 0


def test_a_failure_elsewhere_while_a_rank_is_in_the_debugger_ends_the_launch(tmp_path):
    with _closing(_spawn(tmp_path, str(tmp_path), text=FAIL_WHILE_PAUSED_SCRIPT)) as child:
        child.expect(_prompt(1))
        (tmp_path / "go").touch()  # rank 0 raises now; nobody types anything
        rest = _finish(child)
        assert child.exitstatus == 1
        assert "ValueError: rank 0 failed while rank 1 was in the debugger" in rest


def test_ctrl_d_lets_every_rank_in_the_debugger_run_on(tmp_path):
    with _closing(_spawn(tmp_path, "localhost", "0,1")) as child:
        child.expect(r"\(Pdb rank \d on localhost\) ")
        child.sendeof()  # Ctrl-D at an empty line: the end of the terminal's input
        child.expect("torchrunx: end of input: every rank in the debugger runs on")
        child.expect(re.escape("RESULTS [42, 43]"))  # the other rank did not wait either
        _finish(child)
        assert child.exitstatus == 0


def test_q_in_the_debugger_fails_the_launch_with_bdbquit(tmp_path):
    with _closing(_spawn(tmp_path, "localhost", "1")) as child:
        child.expect(_prompt(1))
        child.sendline("q")
        rest = _finish(child)
        assert child.exitstatus == 1
        assert "BdbQuit" in rest
        assert "RESULTS" not in rest


def test_ctrl_c_in_the_debugger_stops_the_launch_cleanly(tmp_path):
    with _closing(_spawn(tmp_path, "localhost", "1")) as child:
        child.expect(_prompt(1))
        child.sendintr()
        rest = _finish(child)
        assert "KeyboardInterrupt" in rest
        assert child.exitstatus not in (0, None) or child.signalstatus is not None
    # No agent or worker is left: the autouse fixture no_leftover_processes checks every host.


def test_without_a_terminal_a_breakpoint_is_skipped_with_a_warning(tmp_path):
    done = _without_terminal(tmp_path, SCRIPT, "localhost", "1")
    script = tmp_path / "launch.py"
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "RESULTS [42, 43]"
    assert (
        f"breakpoint() at {script}:{BREAK_LINE} in rank 1 skipped: the launcher has no terminal"
        in done.stderr
    ), done.stderr
    assert "BdbQuit" not in done.stderr


@pytest.mark.cluster
def test_breakpoint_on_an_ssh_host_opens_pdb_in_the_launchers_terminal(cluster, tmp_path):
    hosts = cluster.names()
    with _closing(_spawn(tmp_path, ",".join(hosts), "3", str(cluster.ssh_config))) as child:
        child.expect(_prompt(3, hosts[1]))
        assert f"--- pdb: rank 3 on {hosts[1]} at " in str(child.before)
        assert "-> return value + 1" in str(child.before)  # the script is not on that host
        child.sendline("p value, os.environ['LOCAL_RANK']")
        child.expect(_prompt(3, hosts[1]))
        assert "(44, '1')" in str(child.before)
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 43, 44, 45]"))
        _finish(child)
        assert child.exitstatus == 0


def test_the_debugging_example_stops_rank_1_and_finishes_after_c(tmp_path):
    example = ROOT / "examples" / "12_debug_a_rank.py"
    with _closing(_terminal(tmp_path, sys.executable, [str(example), "--steps", "5"])) as child:
        child.expect(_prompt(1))
        assert "12_debug_a_rank.py" in str(child.before)
        child.sendline("p step, rank")
        child.expect(_prompt(1))
        assert "(3, 1)" in str(child.before)
        child.sendline("c")
        child.expect(r"final loss per rank: \[[\d.]+, [\d.]+\]")
        _finish(child)
        assert child.exitstatus == 0


def test_a_post_mortem_variable_that_is_not_yes_or_no_is_an_error_before_anything_starts(
    tmp_path,
):
    env = _env(TORCHRUNX_POST_MORTEM="maybe", TORCHRUNX_LOG_DIR=str(tmp_path / "logs"))
    done = _without_terminal(tmp_path, RAISE_SCRIPT, env=env)
    assert done.returncode == 1
    assert (
        "ValueError: TORCHRUNX_POST_MORTEM='maybe' is not one of 1, true, yes, on, 0, false, no, off"
        in done.stderr
    ), done.stderr
    assert not list((tmp_path / "logs").glob("*")), "a log folder was made"  # nothing started


def test_breakpoint_in_a_script_run_by_the_torchrunx_command(tmp_path):
    (tmp_path / "train.py").write_text(
        "import os\n"
        "rank = int(os.environ['RANK'])\n"
        "value = 41 + rank\n"
        "if rank == 1:\n"
        "    breakpoint()\n"
        "print(f'rank {rank} value {value}', flush=True)\n"
    )
    options = "--hostnames localhost --workers-per-host 2 --backend None --console-ranks all"
    argv = ["-m", "torchrunx", *options.split(), "--", "train.py"]
    with _closing(_terminal(tmp_path, sys.executable, argv)) as child:
        child.expect(_prompt(1))
        assert "train.py(6)<module>()" in str(child.before)
        child.sendline("value = 7")
        child.expect(_prompt(1))
        child.sendline("c")
        child.expect(re.escape("rank 1 value 7"))
        _finish(child)
        assert child.exitstatus == 0


SLURM_SCRIPT = """
import os, sys
import torchrunx as trx

def work():
    rank = int(os.environ["RANK"])
    value = 41 + rank
    if rank == 1:
        breakpoint()
    return value + 1

result = trx.Launcher(workers_per_host=1, backend=None).run(work)  # the allocation's nodes
print("RESULTS", result.ranks, flush=True)
"""


@pytest.mark.slurm
def test_in_a_batch_job_a_breakpoint_on_an_srun_started_rank_is_skipped(slurm, tmp_path):
    result = slurm.python_job(SLURM_SCRIPT, tmp_path, env={"PYTHONPATH": str(ROOT)}, extra_args=())
    assert result.exit_code == 0, result
    assert "RESULTS [42, 43]" in result.stdout.splitlines(), result
    assert (
        f"breakpoint() at {tmp_path / 'job.py'}:9 in rank 1 skipped: the launcher has no terminal"
        in result.stderr
    ), result


@pytest.mark.slurm
def test_salloc_in_a_terminal_opens_pdb_for_a_rank_started_by_srun(slurm, tmp_path):
    script = tmp_path / "launch.py"
    script.write_text(SLURM_SCRIPT)
    argv = ["--nodes=2", sys.executable, str(script)]
    with _closing(_terminal(tmp_path, "salloc", argv, env={**_env(), **slurm.env})) as child:
        child.expect(r"\(Pdb rank 1 on (snode\d)\) ")
        host = child.match.group(1)
        child.sendline("p value, os.environ['SLURM_STEP_ID'] != ''")
        child.expect(_prompt(1, host))
        assert "(42, True)" in str(child.before)
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 43]"))
        _finish(child)
        assert child.exitstatus == 0


IDE_SCRIPT = """
import os, sys, time
import torchrunx as trx

def work(folder):
    rank = int(os.environ["RANK"])
    open(f"{folder}/ran{rank}", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{folder}/go") and time.monotonic() < deadline:
        time.sleep(0.02)  # alive until the test has seen the IDE attached
    return rank * 10

hosts = sys.argv[2].split(",")
result = trx.Launcher(
    hostnames=hosts, workers_per_host=2, backend=None,
    ssh_config_file=sys.argv[3] if len(sys.argv) > 3 else None,
).run(work, sys.argv[1])
print("RESULTS", result.ranks, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _dap_messages(sock: socket.socket) -> Iterator[dict]:
    buffer = b""
    while True:
        while b"\r\n\r\n" not in buffer:
            chunk = sock.recv(65536)
            if not chunk:
                return
            buffer += chunk
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        length = int(head.split(b":")[1])
        while len(buffer) < length:
            chunk = sock.recv(65536)
            if not chunk:
                return
            buffer += chunk
        body, buffer = buffer[:length], buffer[length:]
        yield json.loads(body)


def _dap_send(sock: socket.socket, seq: int, command: str, arguments: dict) -> None:
    body = json.dumps(
        {"seq": seq, "type": "request", "command": command, "arguments": arguments}
    ).encode()
    sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)


def _attach_as_an_ide(port: int) -> socket.socket:
    """Connect to debugpy and attach as an IDE does: initialize, attach, configurationDone."""
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            break
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on 127.0.0.1:{port}"
            time.sleep(0.1)
    try:
        messages = _dap_messages(sock)
        _dap_send(sock, 1, "initialize", {"adapterID": "python", "clientID": "torchrunx-test"})
        assert next(m for m in messages if m.get("request_seq") == 1)["success"]
        _dap_send(sock, 2, "attach", {"justMyCode": False})
        next(m for m in messages if m.get("event") == "initialized")
        _dap_send(sock, 3, "configurationDone", {})
        assert next(m for m in messages if m.get("request_seq") == 3)["success"]
    except BaseException:
        sock.close()
        raise
    return sock


def _launch_for_an_ide(tmp_path: Path, port: int, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "launch.py"
    script.write_text(IDE_SCRIPT)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(TORCHRUNX_DEBUGPY=f"1:{port}" if not args[1:] else f"3:{port}"),
        cwd=tmp_path,
    )


def _until_waiting(process: subprocess.Popen[str]) -> str:
    assert process.stderr is not None
    for line in process.stderr:
        if "waits for an IDE's debugger (debugpy)" in line:
            return line
    raise AssertionError(f"the launch ended first: {process.communicate()}")


def test_debugpy_rank_waits_for_an_ide_and_runs_once_one_attaches(tmp_path):
    port = _free_port()
    process = _launch_for_an_ide(tmp_path, port, "localhost")
    try:
        line = _until_waiting(process)
        assert line.strip() == (
            f"torchrunx: rank 1 on localhost waits for an IDE's debugger (debugpy): attach to "
            f"127.0.0.1:{port} on this machine"
        )
        time.sleep(1)
        assert not (tmp_path / "ran1").exists()  # it waits for the IDE before the function
        with _attach_as_an_ide(port):
            (tmp_path / "go").touch()
            out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        assert out.splitlines()[-1] == "RESULTS [0, 10]"
    finally:
        process.kill()
        process.communicate()


@pytest.mark.cluster
def test_debugpy_on_an_ssh_host_is_forwarded_to_this_machine(cluster, tmp_path):
    port = _free_port()
    hosts = cluster.names()
    process = _launch_for_an_ide(tmp_path, port, ",".join(hosts), str(cluster.ssh_config))
    try:
        line = _until_waiting(process)
        assert line.strip() == (
            f"torchrunx: rank 3 on {hosts[1]} waits for an IDE's debugger (debugpy): attach to "
            f"127.0.0.1:{port} on this machine (forwarded to {hosts[1]} over SSH)"
        )
        with _attach_as_an_ide(port):  # this machine's port: the test host's, through SSH
            (tmp_path / "go").touch()
            out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        assert out.splitlines()[-1] == "RESULTS [0, 10, 20, 30]"
    finally:
        process.kill()
        process.communicate()
    with socket.socket() as sock:  # the forward is closed with the launch
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_bad_debugpy_variable_is_an_error_before_anything_starts(tmp_path):
    env = _env(TORCHRUNX_DEBUGPY="one", TORCHRUNX_LOG_DIR=str(tmp_path / "logs"))
    done = _without_terminal(tmp_path, IDE_SCRIPT, str(tmp_path), "localhost", env=env)
    assert done.returncode == 1
    assert (
        "ValueError: TORCHRUNX_DEBUGPY='one' is not RANK or RANK:PORT (a rank from 0, a port "
        "from 1 to 65535), for example 0 or 1:5678"
    ) in done.stderr, done.stderr
    assert not list((tmp_path / "logs").glob("*"))


# -- the same on SSH test hosts (2 hosts x 2 workers: ranks 0-1 on the first, 2-3 on the second)


@pytest.mark.cluster
def test_on_ssh_hosts_torch_distributed_breakpoint(cluster, tmp_path):
    hosts = cluster.names()
    with _closing(
        _spawn(tmp_path, ",".join(hosts), str(cluster.ssh_config), text=DIST_SCRIPT)
    ) as child:
        child.expect(_prompt(1, hosts[0]))
        child.sendline("up")
        child.expect(_prompt(1, hosts[0]))
        assert "-> dist.breakpoint(rank=1)" in str(child.before)
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 43, 44, 45]"))
        _finish(child)
        assert child.exitstatus == 0


@pytest.mark.cluster
def test_on_ssh_hosts_two_ranks_on_two_hosts_take_turns(cluster, tmp_path):
    hosts = cluster.names()
    with _closing(_spawn(tmp_path, ",".join(hosts), "1,2", str(cluster.ssh_config))) as child:
        child.expect(r"\(Pdb rank ([12]) on [^)]+\) ")
        first = int(child.match.group(1))
        other = 3 - first
        child.sendline("c")
        child.expect(_prompt(other, hosts[other // 2]))  # the waiting one gets the terminal
        child.sendline("c")
        child.expect(re.escape("RESULTS [42, 43, 44, 45]"))
        _finish(child)
        assert child.exitstatus == 0


@pytest.mark.cluster
def test_on_ssh_hosts_post_mortem(cluster, tmp_path):
    hosts = cluster.names()
    with _closing(
        _spawn(
            tmp_path,
            ",".join(hosts),
            str(cluster.ssh_config),
            text=RAISE_SCRIPT,
            env=_env(TORCHRUNX_POST_MORTEM="1"),
        )
    ) as child:
        child.expect(_prompt(1, hosts[0]))
        assert "rank 1 raised ValueError: boom in rank 1; post-mortem" in str(child.before)
        child.sendline("c")
        rest = _finish(child)
        assert child.exitstatus == 1
        assert "ValueError: boom in rank 1" in rest


@pytest.mark.cluster
def test_on_ssh_hosts_ctrl_c_in_the_debugger_stops_everything(cluster, tmp_path):
    hosts = cluster.names()
    with _closing(_spawn(tmp_path, ",".join(hosts), "3", str(cluster.ssh_config))) as child:
        child.expect(_prompt(3, hosts[1]))
        child.sendintr()
        rest = _finish(child)
        assert "KeyboardInterrupt" in rest
    # No agent or worker is left on any host: the autouse fixture no_leftover_processes.


@pytest.mark.cluster
def test_on_ssh_hosts_without_a_terminal_a_breakpoint_is_skipped(cluster, tmp_path):
    hosts = ",".join(cluster.names())
    done = _without_terminal(tmp_path, SCRIPT, hosts, "3", str(cluster.ssh_config))
    script = tmp_path / "launch.py"
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "RESULTS [42, 43, 44, 45]"
    assert f"breakpoint() at {script}:{BREAK_LINE} in rank 3 skipped" in done.stderr, done.stderr
