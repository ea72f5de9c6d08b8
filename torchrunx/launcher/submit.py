"""Submit a launch to SLURM from a login node, and get its result back: :func:`submit`.

What submitit users do: the call goes into a batch job, the job runs the launch on the nodes
SLURM gives it (the allocation's hosts, ``srun`` steps: as any launch inside ``sbatch``), and
the caller waits for the job (or comes back later) and reads every rank's return value::

    job = trx.submit(train, func_args=(10,), sbatch=("--nodes=2", "--gres=gpu:8"))
    job.job_id                # SLURM's
    result = job.result()     # waits; the LaunchResult, or the launch's exception raised
    job.cancel()              # scancel

Each job has a private folder (mode 0700) under ``folder`` (``./torchrunx_jobs`` by default),
on a filesystem the nodes share with the login node:

- ``call.pkl``: the caller's ``sys.path``, then the launcher, the function and its arguments
  (cloudpickle), unpickled once that path is set, so that a function pickled by reference is
  importable in the job as here;
- ``job.sh``: the batch script; ``stdout`` and ``stderr``: the job's output;
- ``result.pkl``: written (whole, then renamed) by the job when the launch ends: the
  :class:`~torchrunx.LaunchResult`, or the exception the launch raised.

The job runs the caller's interpreter (``sys.executable``) with the caller's environment
(``sbatch`` exports it), in the caller's working directory. :meth:`SlurmJob.attach` reads a
job's folder again, from another process or later.
"""

from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cloudpickle

from torchrunx.errors import SerializationError, SlurmError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from torchrunx.launcher.launcher import Launcher
    from torchrunx.launcher.state.results import LaunchResult

ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
)
"""SLURM job states in which the job has not ended (``scontrol show job``'s ``JobState``)."""

_BOOT = (
    "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
    "from torchrunx.launcher.submit import run_job; run_job(sys.argv[1])"
)
"""The job's program: no module from its working folder before the caller's own code runs."""


def job_script(python: str, folder: Path, cwd: str) -> str:
    """The batch script of a job whose folder is ``folder`` (pure; every value quoted)."""
    return (
        "#!/bin/bash\n"
        f"cd {shlex.quote(cwd)} || exit 1\n"
        f"exec {shlex.quote(python)} -c {shlex.quote(_BOOT)} {shlex.quote(str(folder))}\n"
    )


def sbatch_argv(folder: Path, options: Sequence[str], *, sbatch: str = "sbatch") -> list[str]:
    """The ``sbatch`` command line that submits ``folder``'s job (pure)."""
    return [
        sbatch,
        "--parsable",
        "--job-name=torchrunx",
        f"--output={folder / 'stdout'}",
        f"--error={folder / 'stderr'}",
        *options,
        str(folder / "job.sh"),
    ]


def job_state(scontrol_output: str) -> str | None:
    """``JobState`` in ``scontrol show job -o ID``'s line; None if the job is not known."""
    for word in scontrol_output.split():
        key, _, value = word.partition("=")
        if key == "JobState":
            return value
    return None


@dataclass
class SlurmJob:
    """A launch submitted to SLURM (:func:`submit`), or a job folder read again (:meth:`attach`)."""

    job_id: str
    folder: Path
    poll: float = 1.0
    """Seconds between looks at the job while waiting (the first ones are quicker)."""

    @classmethod
    def attach(cls, folder: str | Path) -> SlurmJob:
        """The job of ``folder`` (a job's own folder, as :attr:`folder` names it).

        Raises:
            ValueError: ``folder`` is not a job folder (it has no ``job_id`` file).
        """
        path = Path(folder)
        try:
            job_id = (path / "job_id").read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"{str(path)!r} is not a torchrunx job folder (no job_id file): give the "
                "folder that SlurmJob.folder names"
            ) from exc
        return cls(job_id, path)

    def state(self) -> str:
        """SLURM's ``JobState`` (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``...).

        ``DONE`` once SLURM no longer knows the job (it ended a while ago) and its result is
        there; ``UNKNOWN`` if neither.

        Raises:
            SlurmError: ``scontrol`` cannot be run.
        """
        shown = _slurm(["scontrol", "show", "job", "-o", self.job_id], check=False)
        state = job_state(shown.stdout) if shown.returncode == 0 else None
        if state is not None:
            return state.split()[0]
        return "DONE" if (self.folder / "result.pkl").exists() else "UNKNOWN"

    def done(self) -> bool:
        """Whether the job has ended (its result may still be on its way for a moment)."""
        return self.state() not in ACTIVE_STATES

    def wait(self, timeout: float | None = None) -> LaunchResult[Any]:
        """Wait for the job to end; its :class:`~torchrunx.LaunchResult`.

        Raises:
            TimeoutError: It has not ended in ``timeout`` seconds (it goes on).
            SlurmError: It ended without a result (cancelled, a node failed, out of time):
                the message says its state and the end of its stderr.
            Exception: What the launch raised (a worker's exception, an
                :class:`~torchrunx.AgentFailedError`...), with its notes.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.1
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"SLURM job {self.job_id} has not ended in {timeout:g} s")
            time.sleep(pause if deadline is None else min(pause, deadline - time.monotonic()))
            pause = min(pause * 2, self.poll)
        return self._outcome()

    def result(self, timeout: float | None = None) -> LaunchResult[Any]:
        """The same as :meth:`wait`."""
        return self.wait(timeout)

    def cancel(self, timeout: float = 60) -> None:
        """Cancel the job (``scancel``) and wait until SLURM says it has ended.

        Raises:
            SlurmError: ``scancel`` failed, or the job still runs ``timeout`` seconds later.
        """
        _slurm(["scancel", self.job_id])
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                raise SlurmError(f"SLURM job {self.job_id} still runs {timeout:g} s after scancel")
            time.sleep(0.2)

    def _outcome(self) -> LaunchResult[Any]:
        """The result file's value, waited for briefly (the job writes it as it ends)."""
        path = self.folder / "result.pkl"
        deadline = time.monotonic() + 10  # a shared filesystem may show it a little later
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not path.exists():
            state = self.state()
            tail = _tail(self.folder / "stderr")
            raise SlurmError(
                f"SLURM job {self.job_id} ended ({state}) without a result: cancelled, out of "
                f"time, or its node failed; the end of its stderr ({self.folder / 'stderr'}):"
                f"\n{tail}"
            )
        kind, value = pickle.loads(path.read_bytes())  # noqa: S301 (the user's own private folder)
        if kind == "error":
            raise value
        return value  # type: ignore[no-any-return]  # a LaunchResult


def submit(  # noqa: PLR0913 (the call, then where and how it is submitted)
    func: Callable[..., Any],
    func_args: tuple[Any, ...] | None = None,
    func_kwargs: dict[str, Any] | None = None,
    *,
    launcher: Launcher | None = None,
    sbatch: Sequence[str] = (),
    folder: str | Path = "torchrunx_jobs",
) -> SlurmJob:
    """Submit ``func(*func_args, **func_kwargs)`` on every worker of a new SLURM job.

    The job runs ``launcher.run(func, ...)`` (``Launcher()`` by default: every node of the
    job's allocation, one worker per GPU, else per CPU core); ``sbatch`` holds the options of
    its allocation (``--nodes=2``, ``--gres=gpu:8``, ``--time=2:00:00``, ``--partition``...).

    Raises:
        SerializationError: The launcher, the function or an argument cannot be pickled.
        SlurmError: ``sbatch`` is missing or refused the job (its message).
        ValueError: A field of ``launcher`` is invalid (checked here, before submitting).
    """
    from torchrunx.launcher.launcher import Launcher  # noqa: PLC0415 (no import cycle)

    chosen = launcher if launcher is not None else Launcher()
    chosen.validate()
    call = (chosen, func, tuple(func_args or ()), dict(func_kwargs or {}))
    try:  # the caller's sys.path apart: the job sets it before it unpickles the call
        payload = cloudpickle.dumps((list(sys.path), cloudpickle.dumps(call)))
    except Exception as exc:
        raise SerializationError(f"cannot pickle the job's call with cloudpickle: {exc}") from exc
    root = Path(folder).absolute()
    root.mkdir(parents=True, exist_ok=True)
    job_folder = root / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{uuid.uuid4().hex[:8]}"
    job_folder.mkdir(mode=0o700)
    _write_whole(job_folder / "call.pkl", payload)
    script = job_folder / "job.sh"
    script.write_text(job_script(sys.executable, job_folder, str(Path.cwd())))
    script.chmod(0o700)
    submitted = _slurm(sbatch_argv(job_folder, sbatch))
    job_id = submitted.stdout.strip().split(";")[0]
    _write_whole(job_folder / "job_id", job_id.encode())
    return SlurmJob(job_id, job_folder)


def run_job(folder: str) -> None:
    """In the batch job: run the launch of ``folder``'s call; write its outcome; exit 0 or 1."""
    path = Path(folder)
    outcome: tuple[str, object]
    try:
        caller_path, call = pickle.loads((path / "call.pkl").read_bytes())  # noqa: S301 (the user's own private folder)
        sys.path[:0] = [p for p in caller_path if p not in sys.path]
        launcher, func, args, kwargs = pickle.loads(call)  # noqa: S301 (the same)
        outcome = ("ok", launcher.run(func, *args, **kwargs))
    except Exception as exc:  # noqa: BLE001 (any failure goes back to the caller)
        outcome = ("error", exc)
    try:
        data = cloudpickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 (a value or an error that does not pickle)
        error = SerializationError(f"the job's outcome cannot be pickled: {exc}; {outcome[1]!r}")
        outcome, data = ("error", error), cloudpickle.dumps(("error", error))
    _write_whole(path / "result.pkl", data)
    if outcome[0] == "error":
        sys.stderr.write(f"torchrunx: the launch failed: {outcome[1]!r}\n")
        sys.exit(1)


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to a new private file next to ``path``, then rename it into place."""
    partial = path.with_name(path.name + ".tmp")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    partial.replace(path)


def _tail(path: Path, lines: int = 20) -> str:
    """The last lines of a file ("(empty)" or "(missing)" otherwise)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(missing)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _slurm(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """A SLURM command's result; with ``check``, a failure is a :class:`SlurmError`."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError as exc:
        raise SlurmError(
            f"{argv[0]} is not installed here: submit from a machine of the SLURM cluster (a "
            "login node)"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{shlex.join(argv)} did not answer in 60 s") from exc
    if check and done.returncode != 0:
        message = (done.stderr or done.stdout).strip()
        raise SlurmError(f"{shlex.join(argv)} failed (exit status {done.returncode}): {message}")
    return done
