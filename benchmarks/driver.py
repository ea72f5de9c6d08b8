"""One measured launch (or several back to back) with torchrunx: ours, or the original 0.4.

Run by ``run.py`` in a fresh process, with the main interpreter for ours and the upstream virtual
environment's interpreter for torchrunx 0.4 (both are imported as ``torchrunx``)::

    python driver.py SPEC_JSON

The working directory is the run's scratch directory. The last line printed is
``BENCH-RESULT {json}``: the wall-clock time of every call and result, the exception if one was
raised and when, this process's peak RSS, and a summary of what the ranks returned.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import cloudpickle
import workloads

RESULT_PREFIX = "BENCH-RESULT "


def main() -> None:
    spec: dict[str, Any] = json.loads(sys.argv[1])
    cloudpickle.register_pickle_by_value(workloads)
    remote = spec["hosts"] != ["localhost"]
    if spec["tool"] == "upstream" and remote:
        # 0.4 tells its agents to reach it at socket.getfqdn(), which is "localhost" on this
        # machine; on a real cluster it is a name every node resolves. Answer the bench
        # bridge's name for the launcher instead.
        socket.getfqdn = lambda name="": spec["launcher_name"]  # noqa: ARG005
    import torchrunx  # noqa: PLC0415 (after the patch above)

    if spec["import_torch"]:
        import torch  # noqa: F401, PLC0415 (as a script that gets tensors back has)

    launcher = torchrunx.Launcher(**launcher_fields(spec, remote))
    func = getattr(workloads, spec["workload"])
    args = (str(Path.cwd()), *spec["args"])
    if spec["cut_veth"]:
        start_link_cutter(spec["cut_veth"], spec["world_size"])
    report: dict[str, Any] = {"calls": [], "results": [], "error": None, "error_at": None}
    cpu_before = cpu_seconds()
    for _ in range(spec["launches"]):
        called = time.time()
        try:
            result = launcher.run(func, *args)
        except Exception as exc:  # noqa: BLE001 (the failure cases measure exactly this)
            report["error_at"] = time.time()
            report["error"] = (
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            )
            report["traceback"] = traceback.format_exc(limit=3)
            break
        report["results"].append(time.time())
        report["calls"].append(called)
        report["value"] = summarize(result, spec["world_size"])
    finish_report(report, cpu_before)


def finish_report(report: dict[str, Any], cpu_before: float) -> None:
    """Add this process's CPU time since ``cpu_before``, its peak RSS and the log lines in
    files to ``report``, and print it as the last line (``ssh_floor.py`` reports this way too).
    """
    report["launcher_cpu_s"] = cpu_seconds() - cpu_before
    report["launcher_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report["log_lines_in_files"] = count_lines_in_log_files(Path.cwd())
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(report), flush=True)


def cpu_seconds() -> float:
    """CPU time used by this process (all its threads) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def launcher_fields(spec: dict[str, Any], remote: bool) -> dict[str, Any]:
    """The ``Launcher`` fields both versions share, plus ours' ``agent_timeout`` if given."""
    fields: dict[str, Any] = {
        "hostnames": spec["hosts"],
        "workers_per_host": spec["workers"],
        "backend": spec["backend"],
    }
    if remote:
        fields["ssh_config_file"] = spec["ssh_config"]
    if spec["agent_timeout"] is not None:
        fields["agent_timeout"] = spec["agent_timeout"]
    return fields


def summarize(result: Any, world_size: int) -> Any:  # noqa: ANN401 (whatever the ranks returned)
    """What the harness needs from the ranks' values: sizes of tensors, else rank 0's value."""
    values = [result.rank(i) for i in range(world_size)]
    if all(hasattr(v, "numel") for v in values):
        return [int(v.numel() * v.element_size()) for v in values]
    return values[0]


def start_link_cutter(veth: str, world_size: int) -> None:
    """Once every rank has started, write ``fault`` and set the host's veth down."""

    def cut() -> None:
        scratch = Path.cwd()
        while not all((scratch / f"start-{r}").exists() for r in range(world_size)):
            time.sleep(0.01)
        time.sleep(0.3)
        workloads.mark(str(scratch), "fault")
        subprocess.run(["ip", "link", "set", veth, "down"], check=True)

    threading.Thread(target=cut, daemon=True).start()


def count_lines_in_log_files(scratch: Path) -> int:
    """Worker lines written to log files under ``torchrunx_logs/`` (both versions' default)."""
    count = 0
    # os.walk does not follow links, so the "latest" link does not count a launch twice.
    for folder, _, names in os.walk(scratch / "torchrunx_logs"):
        for name in names:
            path = Path(folder, name)
            if path.is_symlink() or not path.is_file():
                continue
            with path.open(errors="replace") as f:
                count += sum(1 for line in f if workloads.LINE_MARKER in line)
    return count


if __name__ == "__main__":
    main()
