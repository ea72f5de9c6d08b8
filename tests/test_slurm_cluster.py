"""The SLURM test cluster itself: batch jobs, srun steps, stdin, --export, SSH from a job."""

from __future__ import annotations

import shlex
import sys
import time

import pytest
from slurm_cluster import SlurmJobTimeoutError

pytestmark = pytest.mark.slurm


def test_two_node_batch_job_sees_its_nodes(slurm, tmp_path):
    out = tmp_path / "job.txt"
    script = f"""
exec > {out}
echo "nodelist=$SLURM_JOB_NODELIST"
echo "hostname=$(hostname)"
echo "hostnames=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd,)"
srun --overlap hostname | sort | sed 's/^/srun=/'
"""
    result = slurm.sbatch(script, nodes=2)
    assert (result.state, result.exit_code) == ("COMPLETED", 0), result
    assert out.read_text().splitlines() == [
        "nodelist=snode[1-2]",
        "hostname=snode1",
        "hostnames=snode1,snode2",
        "srun=snode1",
        "srun=snode2",
    ]
    assert slurm.names() == ["snode1", "snode2"]


def test_srun_forwards_stdin_to_the_task(slurm):
    script = """
printf 'hello\\nworld\\n' | srun --overlap --nodes=1 --ntasks=1 -w snode2 bash -c 'cat; echo done; hostname'
"""
    result = slurm.sbatch(script, nodes=2)
    assert result.exit_code == 0, result
    assert result.stdout.splitlines() == ["hello", "world", "done", "snode2"]


def test_srun_streams_stdin_line_by_line_and_passes_eof(slurm):
    echo = "import sys\nfor line in sys.stdin:\n    print('echo', len(line), flush=True)\nprint('eof', flush=True)"
    driver = (
        "import subprocess, sys\n"
        f"echo = {echo!r}\n"
        "argv = ['srun', '--overlap', '--nodes=1', '--ntasks=1', '-w', 'snode2', sys.executable, '-c', echo]\n"
        "srun = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "for size in (1, 10, 200000):\n"
        "    srun.stdin.write('x' * size + '\\n'); srun.stdin.flush()\n"
        "    print(srun.stdout.readline().strip())\n"  # answered before more input: no buffering
        "srun.stdin.close()\n"
        "print(srun.stdout.read().strip(), srun.wait())\n"
    )
    result = slurm.sbatch(f"{shlex.quote(sys.executable)} -c {shlex.quote(driver)}", nodes=2)
    assert result.exit_code == 0, result
    assert result.stdout.splitlines() == ["echo 2", "echo 11", "echo 200001", "eof 0"]


def test_srun_export_names_passes_only_those_and_slurm_variables(slurm):
    script = """
FOO=bar srun --overlap --export=HOME,PATH,USER --nodes=1 --ntasks=1 -w snode2 env
"""
    result = slurm.sbatch(script, nodes=2, env={"USER": "root", "HOME": str(slurm.home)})
    assert result.exit_code == 0, result
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert env["HOME"] == str(slurm.home)
    assert env["USER"] == "root"
    assert env["SLURM_CONF"] == str(slurm.conf)
    assert env["SLURMD_NODENAME"] == "snode2"
    assert "FOO" not in env
    assert "TORCHRUNX_TEST_SESSION" not in env


def test_job_reaches_the_other_node_over_ssh_with_its_home(slurm):
    connect = (
        "import os, paramiko\n"
        "config = paramiko.SSHConfig.from_path(os.path.expanduser('~/.ssh/config'))\n"
        "options = config.lookup('snode2')\n"
        "client = paramiko.SSHClient()\n"
        "client.load_host_keys(os.path.expanduser('~/.ssh/known_hosts'))\n"
        "client.connect(options['hostname'], username=options['user'], key_filename=options['identityfile'], timeout=10)\n"
        "print('paramiko=' + client.exec_command('hostname')[1].read().decode().strip())\n"
        "client.close()\n"
    )
    script = f"""
set -e
echo "ssh=$(ssh -F "$HOME/.ssh/config" snode2 hostname)"
{shlex.quote(sys.executable)} -c {shlex.quote(connect)}
"""
    result = slurm.sbatch(script, nodes=2, env={"HOME": str(slurm.home)})
    assert result.exit_code == 0, result
    assert result.stdout.splitlines() == ["ssh=snode2", "paramiko=snode2"]


def test_a_killed_srun_ends_its_step_unless_its_shepherd_dies_too(slurm, tmp_path):
    # srun forks a shepherd that cancels the step when srun dies; killing the whole process
    # group kills the shepherd too, and the remote task then lives until scancel JOB.STEP.
    probe = (
        "import os, signal, subprocess, sys, time\n"
        "def start(name):\n"
        f"    pid_file = {str(tmp_path)!r} + '/' + name\n"
        "    task = f'echo $$ > {pid_file}; exec sleep 300'\n"
        "    srun = subprocess.Popen(['srun', '--overlap', '-N1', '-n1', '-w', 'snode2', 'bash', '-c', task], start_new_session=True)\n"
        "    while not os.path.exists(pid_file) or not open(pid_file).read().strip():\n"
        "        time.sleep(0.05)\n"
        "    return srun, int(open(pid_file).read())\n"
        "def gone(pid, timeout):\n"
        "    deadline = time.monotonic() + timeout\n"
        "    while os.path.exists(f'/proc/{pid}') and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    return not os.path.exists(f'/proc/{pid}')\n"
        "srun, task = start('alone')\n"
        "srun.kill(); srun.wait()\n"
        "print('srun killed: task gone', gone(task, 5))\n"
        "srun, task = start('group')\n"
        "os.killpg(srun.pid, signal.SIGKILL); srun.wait()\n"
        "print('group killed: task gone', gone(task, 2))\n"
        "subprocess.run(['scancel', os.environ['SLURM_JOB_ID'] + '.1'], check=True)\n"
        "print('after scancel: task gone', gone(task, 5))\n"
    )
    script = f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)}"
    result = slurm.sbatch(script, nodes=2)
    assert result.exit_code == 0, result
    assert result.stdout.splitlines() == [
        "srun killed: task gone True",
        "group killed: task gone False",
        "after scancel: task gone True",
    ]


def test_sbatch_timeout_cancels_the_job_and_reports_its_output(slurm):
    start = time.monotonic()
    with pytest.raises(SlurmJobTimeoutError, match="started") as caught:
        slurm.sbatch("echo started; sleep 300", nodes=1, timeout=3)
    assert time.monotonic() - start < 20
    assert "cancelled" in str(caught.value)
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""


def test_scancel_all_ends_running_jobs(slurm, tmp_path):
    marker = tmp_path / "running"
    submitted = slurm.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--output=/dev/null",
            f"--wrap=touch {marker}; sleep 300",
        ]
    )
    assert submitted.returncode == 0, submitted.stderr
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    slurm.scancel_all()
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""
