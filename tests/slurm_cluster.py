"""A real SLURM cluster on this machine, built on the ``"slurm"`` profile of the namespace hosts.

Debian's ``slurm-wlm`` and ``munge`` packages provide the daemons; nothing of theirs is started by
the system or configured under ``/etc``. :func:`start_slurm_cluster` first starts SSH test hosts
``snode1``... (``cluster.start_cluster(n, ..., profile="slurm")``, subnet ``10.202.0``), then:

* ``munged`` in the root namespaces, with a fresh key and its socket in ``/run/torchrunx-slurm``
  (``munged`` refuses a socket below pytest's private temporary directories). That socket is a
  filesystem path, so it is reachable from every network namespace; the ``slurm.conf`` names it
  in ``AuthInfo``, so every SLURM client and daemon uses it.
* ``slurmctld`` in the root namespaces, listening on the test bridge address (``10.202.0.1``).
* One ``slurmd -N snodeK`` per host, run *inside* the host: it joins the network, mount and UTS
  namespaces of the host's ``sshd`` (:meth:`cluster.TestCluster.enter_argv`), so a batch script or
  an ``srun`` task on ``snode1`` has ``snode1``'s address, ``/etc/hosts`` and hostname, exactly as
  a command run there over SSH does. (``ip netns exec`` is not used: it remounts ``/sys``, and
  ``slurmd`` then finds no cgroup filesystem.) Filesystem and pid namespace are shared with this
  machine, so jobs see the checkout and temporary files, and tests can see their processes.

The configuration is minimal: root runs everything, ``proctrack/linuxproc`` and ``task/none``
(no cgroups), no accounting, ``select/cons_tres`` with ``CR_Core`` and ``config_overrides``
(every node has the configured CPUs whatever this machine has). Clients find it through
``SLURM_CONF``, which :attr:`SlurmCluster.env` carries and batch jobs inherit; nothing is written
to ``/etc/slurm``. ``slurmctld`` starts pending batch jobs once a second
(``batch_sched_delay=0``), so a short job takes about a second; :meth:`SlurmCluster.sbatch`
polls ``scontrol`` every 0.1 s for its end (``sbatch --wait`` polls every 2 s), then returns the
job's state and output files.

Everything else lives in a ``torchrunx-slurm`` directory under the fixture's directory. The
daemons' command lines name one of the two, and ``slurmscriptd`` and ``slurmstepd`` inherit
``SLURM_CONF``: that is how :func:`slurm_processes` finds what a crashed earlier run left behind
(killed at start) and proves that a stopped cluster left nothing. Job processes die with their
host's network namespace. As with the SSH hosts, only one SLURM test cluster can run on a
machine at a time. Requires root, the namespace tools and the SLURM and munge binaries (see
:func:`slurm_unavailable_reason`).

Facts about SLURM 22.05 that tests rely on, checked on this cluster: ``srun`` forwards its
standard input to task 0 as it arrives, and closes it at EOF; ``--export=NAME,...`` gives the
task only those variables plus ``SLURM_*`` (``SLURM_CONF`` included); ``srun`` forks a
*shepherd* child that cancels the step if ``srun`` dies, so SIGKILL on ``srun`` alone ends the
remote task at once, but SIGKILL on its whole process group (the shepherd too) leaves the task
running until ``scancel JOBID.STEPID`` or the end of the job.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from cluster import (
    CHECKOUT,
    TestCluster,
    cluster_unavailable_reason,
    reap_process,
    run_command,
    start_cluster,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

STATE_DIR_NAME = "torchrunx-slurm"
"""Name of the directories holding all state; daemons whose command line names one are ours."""
MUNGE_DIR = Path("/run") / STATE_DIR_NAME
"""``munged``'s socket, key and seed. ``munged`` wants every directory above its socket
searchable by all and none writable by others, which pytest's temporary directories are not."""
SLURMCTLD_PORT = 16817
"""``slurmctld`` port on the test bridge address, clear of a real SLURM's default 6817."""
PYXIS = CHECKOUT / ".pyxis"
"""enroot and pyxis, built by ``scripts/build_pyxis.sh``; the cluster loads pyxis if they are."""
DAEMONS = ("munged", "slurmctld", "slurmscriptd", "slurmd", "slurmstepd")
"""Names of the processes that :func:`slurm_processes` looks for."""
_REQUIRED_TOOLS = (
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
)
_ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)
"""Job states after which the job still has to end."""


@dataclass(frozen=True)
class JobResult:
    """How a batch job ended.

    Attributes:
        job_id: The SLURM job id.
        state: Final ``JobState``, e.g. ``"COMPLETED"``, ``"FAILED"``, ``"CANCELLED"``.
        exit_code: Exit status of the batch script (``ExitCode`` before the colon); 0 on success.
        signal: Signal that ended the batch script (``ExitCode`` after the colon), or 0.
        stdout: The job's ``--output`` file.
        stderr: The job's ``--error`` file.
    """

    job_id: str
    state: str
    exit_code: int
    signal: int
    stdout: str
    stderr: str


class SlurmJobTimeoutError(TimeoutError):
    """A batch job did not end in time; it was cancelled. The message holds its output."""


class SlurmCluster:
    """A running SLURM cluster over SSH test hosts. Made by :func:`start_slurm_cluster`.

    Attributes:
        ssh: The underlying SSH test hosts (``snode1``...), with ``ssh_config`` and friends.
        workdir: The ``torchrunx-slurm`` directory holding configuration, state and logs.
        conf: The ``slurm.conf``.
        env: Variables to add to the environment of every SLURM command (``sbatch``, ``srun``,
            ``sinfo``...) run from the root namespace: ``SLURM_CONF``. Batch jobs inherit it.
        home: A home directory for jobs, whose ``.ssh`` has ``config`` (every host by name, a
            copy of ``ssh.ssh_config``), ``known_hosts`` and ``id_ed25519``: with ``HOME`` set to
            it, paramiko (which expands ``~`` from ``HOME``) reaches every host as ``root`` with
            no options. OpenSSH's ``ssh`` ignores ``HOME`` (it reads the passwd entry's home);
            give it ``-F "$HOME/.ssh/config"``.
        cpus_per_node: CPUs each node offers.
        jobs_dir: Where :meth:`sbatch` writes scripts and the jobs' output files.
    """

    __test__: ClassVar[bool] = False  # not a pytest test class

    def __init__(self, ssh: TestCluster, workdir: Path, cpus_per_node: int) -> None:
        """Describe a cluster; nothing is started. Use :func:`start_slurm_cluster` instead.

        Args:
            ssh: The running SSH test hosts.
            workdir: Existing, empty directory for all configuration, state and logs.
            cpus_per_node: CPUs each node offers.
        """
        self.ssh = ssh
        self.workdir = workdir
        self.cpus_per_node = cpus_per_node
        self.conf = workdir / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self.home = workdir / "home"
        self.jobs_dir = workdir / "jobs"
        self._munge_dir = MUNGE_DIR
        self._munge_socket = self._munge_dir / "munge.socket"
        self._logs = workdir / "logs"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._script_count = 0

    def names(self) -> list[str]:
        """Return the node names (the SSH host names), in order."""
        return self.ssh.names()

    def run(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 30,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM command (``sinfo``, ``scontrol``...) from the root namespaces.

        Args:
            argv: Command and arguments.
            env: Extra variables, over this process's environment and :attr:`env`.
            timeout: Seconds before :class:`subprocess.TimeoutExpired` is raised.
            stdin: Text fed to the command's standard input (none if ``None``).

        Returns:
            The finished process, with text ``stdout`` and ``stderr``; its exit status is not
            checked.
        """
        return subprocess.run(
            argv,
            input=stdin,
            stdin=subprocess.DEVNULL if stdin is None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env, **(env or {})},
            check=False,
        )

    def python_job(  # noqa: PLR0913 (sbatch's knobs, passed on)
        self,
        source: str,
        folder: Path,
        *,
        nodes: int = 2,
        job_id_argument: bool = False,
        env: Mapping[str, str] | None = None,
        extra_args: Iterable[str] = ("--ntasks-per-node=1",),
        timeout: float = 120,
    ) -> JobResult:
        """A batch job that runs the Python ``source`` (saved in ``folder``) with this interpreter.

        Args:
            source: The Python program the job runs (written to ``folder / "job.py"``).
            folder: Where the program is saved (a test's ``tmp_path``).
            nodes: Number of nodes (``--nodes``).
            job_id_argument: Pass the job's id (``$SLURM_JOB_ID``) as the program's argument.
            env: Extra variables, as for :meth:`sbatch`.
            extra_args: More ``sbatch`` options (default: one task per node).
            timeout: Seconds from submission to the end of the job.

        Returns:
            How the job ended, as :meth:`sbatch` returns it.
        """
        program = folder / "job.py"
        program.write_text(source)
        line = f"{shlex.quote(sys.executable)} {shlex.quote(str(program))}"
        if job_id_argument:
            line += ' "$SLURM_JOB_ID"'
        return self.sbatch(
            line + "\n", nodes=nodes, env=env, extra_args=extra_args, timeout=timeout
        )

    def sbatch(  # noqa: PLR0913 (sbatch has many knobs)
        self,
        script: Path | str,
        *,
        nodes: int,
        env: Mapping[str, str] | None = None,
        extra_args: Iterable[str] = (),
        script_args: Iterable[str] = (),
        timeout: float = 120,
    ) -> JobResult:
        """Submit a batch job and wait for it to end.

        Args:
            script: The batch script: a file, or its text (``#!/bin/bash`` is prepended if it has
                no ``#!`` line).
            nodes: Number of nodes (``--nodes``).
            env: Extra variables for ``sbatch``, over this process's environment and :attr:`env`;
                the job inherits them all (``--export=ALL``).
            extra_args: More ``sbatch`` options, placed before the script.
            script_args: Arguments of the batch script, placed after it.
            timeout: Seconds from submission to the end of the job.

        Returns:
            How the job ended, with its output; a failed job is not an error.

        Raises:
            RuntimeError: If ``sbatch`` fails, or the job vanishes from ``slurmctld``.
            SlurmJobTimeoutError: If the job has not ended in ``timeout`` seconds; it is cancelled
                first, and the message holds its output so far.
        """
        self._script_count += 1
        if isinstance(script, str):
            path = self.jobs_dir / f"script{self._script_count}.sh"
            text = script if script.startswith("#!") else "#!/bin/bash\n" + script
            path.write_text(text)
            script = path
        argv = [
            "sbatch",
            "--parsable",
            f"--nodes={nodes}",
            f"--output={self.jobs_dir}/%j.out",
            f"--error={self.jobs_dir}/%j.err",
            f"--chdir={self.jobs_dir}",
            *extra_args,
            str(script),
            *script_args,
        ]
        submitted = self.run(argv, env=env)
        if submitted.returncode != 0:
            msg = f"{shlex.join(argv)} failed ({submitted.returncode}): {submitted.stderr.strip()}"
            raise RuntimeError(msg)
        job_id = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        fields = self._job_fields(job_id)
        while fields.get("JobState") in _ACTIVE_STATES:
            if time.monotonic() > deadline:
                self.run(["scancel", job_id])
                self._wait_job_gone_active(job_id, timeout=30)
                result = self._result(job_id, self._job_fields(job_id))
                msg = (
                    f"job {job_id} did not end in {timeout}s; cancelled.\n"
                    f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
                )
                raise SlurmJobTimeoutError(msg)
            time.sleep(0.1)
            fields = self._job_fields(job_id)
        if "JobState" not in fields:
            msg = f"job {job_id} vanished from slurmctld: {fields}"
            raise RuntimeError(msg)
        return self._result(job_id, fields)

    def scancel_all(self, timeout: float = 30) -> None:
        """Cancel every job and wait until none is left running.

        Args:
            timeout: Seconds to wait for the jobs to end.

        Raises:
            RuntimeError: If jobs are still active after ``timeout`` seconds.
        """
        self.run(["scancel", "--full", "--user=root"])
        deadline = time.monotonic() + timeout
        while active := self._active_jobs():
            if time.monotonic() > deadline:
                msg = f"jobs still active {timeout}s after scancel: {active}"
                raise RuntimeError(msg)
            time.sleep(0.1)

    def wait_nodes_idle(self, timeout: float = 30) -> None:
        """Wait until every node is idle (registered, and running no job).

        Args:
            timeout: Seconds to wait.

        Raises:
            RuntimeError: If a daemon exited, or the nodes are not idle in time.
        """
        deadline = time.monotonic() + timeout
        expected = str(len(self.ssh.hosts))
        while self.run(["sinfo", "-h", "-t", "idle", "-o", "%D"]).stdout.strip() != expected:
            for name, daemon in self._daemons.items():
                if daemon.poll() is not None:
                    msg = f"{name} exited ({daemon.returncode}):\n{self._log_tail(name)}"
                    raise RuntimeError(msg)
            if time.monotonic() > deadline:
                nodes = self.run(["sinfo", "-N", "-h", "-o", "%N %T %E"]).stdout
                msg = f"nodes not idle in {timeout}s:\n{nodes}\n{self._log_tail('slurmctld')}"
                raise RuntimeError(msg)
            time.sleep(0.05)

    def stop(self) -> None:
        """Cancel jobs, stop the daemons, remove the state, then stop the SSH test hosts.

        Safe to call more than once, and on a cluster that only partly started.
        """
        atexit.unregister(self.stop)
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                self.scancel_all(timeout=15)
        # slurmd first (steps outlive it, but the hosts' processes all die with ssh.stop()),
        # then the controller, then munge, which the others use to the end.
        rank = {"slurmctld": 1, "munged": 2}
        order = sorted(self._daemons, key=lambda name: rank.get(name, 0))
        for name in order:
            daemon = self._daemons[name]
            daemon.terminate()
            reap_process(daemon, timeout=5)
        self._daemons.clear()
        self.ssh.stop()  # kills whatever is left in the hosts: slurmstepd, job processes
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(self._munge_dir, ignore_errors=True)

    def _active_jobs(self) -> list[str]:
        listed = self.run(["squeue", "-h", "-o", "%i %T"]).stdout.split("\n")
        return [line for line in listed if line.strip()]

    def _job_fields(self, job_id: str) -> dict[str, str]:
        """Fields of ``scontrol show job -o``; empty once the job record is gone."""
        shown = self.run(["scontrol", "show", "job", "-o", job_id])
        if shown.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))

    def _wait_job_gone_active(self, job_id: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._job_fields(job_id).get("JobState") in _ACTIVE_STATES:
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)

    def _result(self, job_id: str, fields: Mapping[str, str]) -> JobResult:
        code, _, sig = fields.get("ExitCode", "-1:0").partition(":")
        return JobResult(
            job_id=job_id,
            state=fields.get("JobState", "UNKNOWN"),
            exit_code=int(code),
            signal=int(sig or 0),
            stdout=_read(self.jobs_dir / f"{job_id}.out"),
            stderr=_read(self.jobs_dir / f"{job_id}.err"),
        )

    def _log_tail(self, name: str, lines: int = 30) -> str:
        path = self._logs / f"{name}.log"
        return "\n".join(_read(path).splitlines()[-lines:])

    def _start(self) -> None:
        for directory in (
            self._logs,
            self.jobs_dir,
            self.workdir / "state",
            self.workdir / "spool",
        ):
            directory.mkdir()
        self._make_home()
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for host in self.ssh.hosts:
            argv = ["slurmd", "-D", "-f", str(self.conf), "-N", host.name]
            self._spawn(f"slurmd-{host.name}", [*self.ssh.enter_argv(host), *argv])
        self.wait_nodes_idle()

    def _make_home(self) -> None:
        ssh_dir = self.home / ".ssh"
        ssh_dir.mkdir(parents=True, mode=0o700)
        shutil.copy(self.ssh.ssh_config, ssh_dir / "config")
        shutil.copy(self.ssh.known_hosts, ssh_dir / "known_hosts")
        shutil.copy(self.ssh.identity_file, ssh_dir / "id_ed25519")
        shutil.copy(f"{self.ssh.identity_file}.pub", ssh_dir / "id_ed25519.pub")
        (ssh_dir / "id_ed25519").chmod(0o600)

    def _start_munge(self) -> None:
        shutil.rmtree(self._munge_dir, ignore_errors=True)  # left by a crashed run
        self._munge_dir.mkdir(mode=0o755)
        self._munge_dir.chmod(0o755)  # mkdir's mode is masked by the umask
        key = self._munge_dir / "munge.key"
        run_command(["mungekey", "--create", f"--keyfile={key}"])
        argv = [
            "munged",
            "--foreground",
            f"--socket={self._munge_socket}",
            f"--key-file={key}",
            f"--pid-file={self._munge_dir / 'munged.pid'}",
            f"--log-file={self._logs / 'munged-file.log'}",
            f"--seed-file={self._munge_dir / 'munged.seed'}",
        ]
        self._spawn("munged", argv)
        deadline = time.monotonic() + 10
        while not self._munge_socket.exists():
            if self._daemons["munged"].poll() is not None or time.monotonic() > deadline:
                msg = f"munged did not start:\n{self._log_tail('munged')}"
                raise RuntimeError(msg)
            time.sleep(0.01)

    def _write_conf(self) -> None:
        plugstack = self.workdir / "plugstack.conf"
        # No SPANK plugins from /etc/slurm/plugstack.conf.d; pyxis if it was built.
        plugstack.write_text(self._pyxis_conf() if pyxis_unavailable_reason() is None else "")
        controller = self.ssh.launcher_address
        lines = [
            "ClusterName=torchrunx",
            f"SlurmctldHost=localhost({controller})",
            f"SlurmctldPort={SLURMCTLD_PORT}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self._munge_socket}",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=batch_sched_delay=0",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "MinJobAge=10",
            "KillWait=5",
            "InactiveLimit=0",
            f"PlugStackConfig={plugstack}",
            f"StateSaveLocation={self.workdir / 'state'}",
            f"SlurmctldPidFile={self.workdir / 'slurmctld.pid'}",
            f"SlurmctldLogFile={self._logs / 'slurmctld-file.log'}",
            f"SlurmdSpoolDir={self.workdir / 'spool' / '%n'}",
            f"SlurmdPidFile={self.workdir / 'spool' / '%n.pid'}",
            f"SlurmdLogFile={self._logs / 'slurmd-%n-file.log'}",
        ]
        lines += [
            f"NodeName={host.name} NodeAddr={host.address} CPUs={self.cpus_per_node} "
            "RealMemory=1000 State=UNKNOWN"
            for host in self.ssh.hosts
        ]
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("".join(f"{line}\n" for line in lines))

    def _pyxis_conf(self) -> str:
        """pyxis's plugstack line; writes enroot's configuration for this cluster's folders.

        enroot reads only its own configuration file (pyxis gives it none of the
        ``ENROOT_*_PATH`` variables of the job or of ``slurmstepd``), so the paths of its
        runtime, data, cache and temporary files are written there, under :attr:`workdir`.
        """
        enroot = self.workdir / "enroot"
        paths = {name: enroot / name.lower() for name in ("RUNTIME", "DATA", "CACHE", "TEMP")}
        for path in paths.values():
            path.mkdir(parents=True, exist_ok=True)
        (PYXIS / "etc" / "enroot" / "enroot.conf").write_text(
            "".join(f"ENROOT_{name}_PATH {path}\n" for name, path in paths.items())
        )
        return (
            f"optional {PYXIS / 'lib' / 'spank_pyxis.so'} runtime_path={self.workdir / 'pyxis'}\n"
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        with (self._logs / f"{name}.log").open("wb") as log:
            self._daemons[name] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # pyxis runs enroot from slurmstepd's PATH (that of slurmd).
                env={**os.environ, **self.env, "PATH": f"{PYXIS / 'bin'}:{os.environ['PATH']}"},
                start_new_session=True,
            )


def slurm_unavailable_reason() -> str | None:
    """Say why a SLURM test cluster cannot be made here.

    Returns:
        ``None`` if it can be made, else the reason it cannot.
    """
    reason = cluster_unavailable_reason()
    if reason is not None:
        return reason
    missing = [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"SLURM test cluster needs missing tools (slurm-wlm, munge): {', '.join(missing)}"
    return None


def pyxis_unavailable_reason() -> str | None:
    """Say why pyxis cannot run on the SLURM test cluster (see ``scripts/build_pyxis.sh``).

    Returns:
        ``None`` if pyxis and enroot were built into :data:`PYXIS`, else what is missing.
    """
    if not (PYXIS / "lib" / "spank_pyxis.so").exists() or not (PYXIS / "bin" / "enroot").exists():
        return (
            f"pyxis is not built in {PYXIS}: to test it, give scripts/build_pyxis.sh the git "
            "repositories of pyxis and enroot (TORCHRUNX_PYXIS_SOURCES=DIR holding "
            "NVIDIA+pyxis/repo and NVIDIA+enroot/repo, then scripts/test.sh; or "
            "scripts/build_pyxis.sh PYXIS_GIT ENROOT_GIT)"
        )
    if shutil.which("mksquashfs") is None or shutil.which("unsquashfs") is None:
        return "pyxis needs squashfs-tools (mksquashfs, unsquashfs)"
    return None


def start_slurm_cluster(n: int, workdir: Path, cpus_per_node: int = 2) -> SlurmCluster:
    """Start ``n`` SSH test hosts ``snode1``... and a SLURM cluster on them; wait until idle.

    First kills root-namespace SLURM and munge daemons left by a crashed earlier run (their host
    processes go with the earlier network namespaces, which :func:`cluster.start_cluster`
    removes). The cluster is stopped at interpreter exit if :meth:`SlurmCluster.stop` was not
    called.

    Args:
        n: Number of nodes, 1 to 99.
        workdir: Existing directory without whitespace in its path; a ``torchrunx-slurm``
            directory (SLURM state) and an ``ssh`` directory (the hosts' keys and configs) are
            made in it.
        cpus_per_node: CPUs each node offers to jobs, whatever this machine has.

    Returns:
        The running cluster, every node idle.
    """
    workdir = workdir.resolve()
    kill_stale_daemons()
    (workdir / "ssh").mkdir()
    ssh = start_cluster(n, workdir / "ssh", profile="slurm")
    state = workdir / STATE_DIR_NAME
    try:
        state.mkdir()
        cluster = SlurmCluster(ssh, state, cpus_per_node)
    except BaseException:
        ssh.stop()
        raise
    atexit.register(cluster.stop)
    try:
        cluster._start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def kill_stale_daemons(grace: float = 3.0) -> list[str]:
    """Kill the daemons of any SLURM test cluster (see :func:`slurm_processes`).

    Args:
        grace: Seconds between SIGTERM and SIGKILL.

    Returns:
        The killed processes, as ``"pid: command line"``.
    """
    found = slurm_processes()
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (alive := [pid for pid in found if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [f"{pid}: {cmdline}" for pid, cmdline in found.items()]


def slurm_processes() -> dict[int, str]:
    """Live daemons of any SLURM test cluster on this machine, on the hosts too.

    A process is one if its name is in :data:`DAEMONS` and its command line names a
    ``torchrunx-slurm`` directory (``munged``, ``slurmctld``, ``slurmd``) or its ``SLURM_CONF``
    does (``slurmscriptd`` and ``slurmstepd``, which inherit the environment of ``slurmctld`` and
    ``slurmd``). Job processes are not included: they die with their host's network namespace.

    Returns:
        Command line by pid.
    """
    marker = f"/{STATE_DIR_NAME}/".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not _alive(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            if comm not in DAEMONS:
                continue
            if marker not in cmdline:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    conf = [var for var in f.read().split(b"\0") if var.startswith(b"SLURM_CONF=")]
                if not any(marker in var for var in conf):
                    continue
        except OSError:
            continue
        found[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
