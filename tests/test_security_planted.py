"""Modules planted in the folder a launch starts from: none is imported by torchrunx's processes.

Another local user (``tests/attacker.py``) writes ``json.py``, ``zlib.py``, ``socket.py``... into
a shared mode-1777 folder, and the launch starts from there (its working directory). Each
planted module appends a line to a marker file when it is imported, so an empty marker means
that no process of the launch imported it: the agent's boot code, the agent and its workers
(on this machine and over SSH), a relaying host's relay and its child, ``torchrunx check``
and its probes, and the step that unpacks shipped code. Plain ``python /elsewhere/script.py``
run from that folder imports none of them either (its ``sys.path`` starts with the script's
folder, not the working one).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from attacker import plant, shared_folder

import torchrunx as trx
from torchrunx.engines.command import AGENT_ARGV, agent_script, unpack_source
from torchrunx.wire.bootstrap import BOOT_CODE, SAFE_PATH_MARK, SAVED_PYTHONPATH, agent_environ
from torchrunx.worker.worker import users_path

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parent.parent

PLANTED = (
    # the boot code's and the agent's own imports, and what they import in turn
    *("json", "re", "enum", "functools", "zlib", "struct", "socket", "selectors", "pickle"),
    *("hmac", "secrets", "signal", "threading", "cloudpickle", "torch"),
    # Python 3.13's -c imports linecache to keep the code for tracebacks
    "linecache",
    # looked for by site at every start (from sys.path, never from the working folder)
    *("sitecustomize", "usercustomize"),
)
"""Modules the other user plants: each is imported by the processes of a launch, or by
Python's start, from somewhere: never from the working folder."""


class Planted:
    """A shared folder with :data:`PLANTED` in it, written by the other user, and its marker."""

    def __init__(self, folder: Path, marker: Path) -> None:
        self.folder = folder
        self.marker = marker
        for module in PLANTED:
            plant(folder, module, marker)

    def imports(self) -> str:
        """What the marker recorded: one line per import of a planted module (pid uid argv)."""
        return self.marker.read_text()


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[Planted]:
    """:class:`Planted`, its marker outside the shared folder (the other user may write it)."""
    marker = tmp_path / "marker"
    with shared_folder() as folder:
        yield Planted(folder, marker)


def _where() -> dict[str, object]:
    """What a worker says: where it ran."""
    return {"host": socket.gethostname(), "cwd": os.getcwd(), "rank": int(os.environ["RANK"])}


def _launch_checked(planted: Planted, **launch: object) -> trx.LaunchResult:
    """``trx.launch(_where, **launch)``; the marker is checked first, even if the launch failed."""
    try:
        result = trx.launch(_where, **launch)  # type: ignore[arg-type]
    except Exception:
        assert planted.imports() == "", planted.imports()
        raise
    assert planted.imports() == "", planted.imports()
    return result


# -- the boot code, under every Python this machine has ---------------------------------------

REPORTER = """\
import json, os, sys


def main(line):
    sys.stdout.write(json.dumps({
        "path": sys.path,
        "safe_path": os.environ.get("PYTHONSAFEPATH"),
        "pythonpath": os.environ.get("PYTHONPATH"),
        "saved": [k for k in os.environ if k.startswith("_TORCHRUNX")],
        "line": json.loads(line)["marker"],
        "globals": sorted(k for k in vars(sys.modules["__main__"]) if not k.startswith("__")),
    }) + "\\n")
"""
"""Stands in for the agent: what the boot code left it (its sys.path, environment, line)."""


def _interpreter(version: str) -> str | None:
    """A real interpreter of ``version`` (``launcher``: this one): pyenv's, else on PATH."""
    if version == "launcher":
        return sys.executable
    found = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
    if found:
        return str(found[-1])
    on_path = Path(f"/usr/bin/python{version}")
    return str(on_path) if on_path.exists() else None


def _boot(
    python: str,
    planted: Planted,
    reporter: Path,
    line: dict[str, object],
    environ: dict[str, str] | None = None,
) -> dict[str, object]:
    """Run the agent's script and boot code as a launch does, in the planted folder.

    ``line``: the bootstrap's fields that the boot code reads (``sys_path`` after the
    reporter's folder). The boot code calls the reporter instead of the agent; returns what
    it reported.
    """
    code = BOOT_CODE.replace("import torchrunx.agent.agent as a;", "import trx_reporter as a;")
    assert code != BOOT_CODE
    script = agent_script(env={}, cwd=str(planted.folder), python=python, env_file=None, code=code)
    sys_path = line.get("sys_path", [])
    assert isinstance(sys_path, list)
    line = {**line, "sys_path": [str(reporter), *sys_path], "marker": "the line"}
    done = subprocess.run(
        list(AGENT_ARGV),
        input=script + json.dumps(line).encode() + b"\n",
        capture_output=True,
        env={"PATH": os.environ["PATH"], **(environ or {})},
        timeout=60,
        check=False,
    )
    assert planted.imports() == "", planted.imports()
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


@pytest.fixture
def reporter(tmp_path: Path) -> Path:
    """A private folder holding the reporter module (``trx_reporter``)."""
    folder = tmp_path / "reporter"
    folder.mkdir()
    (folder / "trx_reporter.py").write_text(REPORTER)
    return folder


@pytest.mark.parametrize("version", ["launcher", "3.10", "3.12", "3.13"])
def test_the_boot_code_imports_nothing_from_the_working_folder(version, planted, reporter):
    python = _interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (under ~/.pyenv or /usr/bin)")
    folder = str(planted.folder)
    # The working folder is everywhere a start may put it: -c's "" (3.10 has no -P), PYTHONPATH
    # (its path, ".", an empty entry: site imports sitecustomize from there), and the
    # launcher's own sys.path (python -m, a notebook).
    pythonpath = f"{folder}:.::{reporter}:"
    line = {"sys_path": ["", folder, "."], "keep_path": True}
    report = _boot(python, planted, reporter, line, environ={"PYTHONPATH": pythonpath})
    assert report["line"] == "the line"
    path = report["path"]
    assert isinstance(path, list)
    assert path[0] == str(reporter)
    assert not [e for e in path if os.path.realpath(e or ".") == os.path.realpath(folder)], path
    assert report["safe_path"] is None  # the marker that turned -P on is not inherited
    assert report["pythonpath"] == pythonpath  # the user's own, for the workers' processes
    assert report["saved"] == []
    assert report["globals"] == ["a", "json", "os", "posix", "sys"]


def test_the_working_folder_stays_where_the_launchers_torchrunx_is_in_it(planted, reporter):
    """A checkout that the user launches from: its torchrunx is the one the launcher runs."""
    folder = str(planted.folder)
    line = {"sys_path": [folder], "package_root": folder}
    report = _boot(sys.executable, planted, reporter, line)
    assert report["path"] == [str(reporter), folder]


def test_the_users_pythonsafepath_is_left_and_no_pythonpath_stays_none(planted, reporter):
    report = _boot(sys.executable, planted, reporter, {}, environ={"PYTHONSAFEPATH": "1"})
    assert report["safe_path"] == "1"
    assert report["pythonpath"] is None
    assert report["saved"] == []


def test_rule_the_agents_interpreter_starts_safe_unless_the_user_set_pythonsafepath():
    script = agent_script(env={}, cwd="/w", python="python3", env_file=None).decode()
    start = script.rsplit(" && ", 1)[1]
    assert start.startswith(
        f'PYTHONSAFEPATH="${{PYTHONSAFEPATH:-{SAFE_PATH_MARK}}}" '
        f'{SAVED_PYTHONPATH}="${{PYTHONPATH-}}" PYTHONPATH="$_torchrunx_p" exec python3 -u -c '
    )


@pytest.mark.parametrize(
    ("pythonpath", "kept"),
    [
        (None, ""),
        ("", ""),
        ("/a:/b c", "/a:/b c"),
        (".", ""),
        ("/a::/b", "/a:/b"),
        ("/a:", "/a"),
        (":/a", "/a"),
        ("WORK:/a:./:WORK/", "/a"),
        ("sub:*:$HOME", "sub:*:$HOME"),  # relative, a glob, a dollar: kept as they are
    ],
)
def test_rule_pythonpath_loses_the_working_folder_as_the_interpreter_starts(
    pythonpath, kept, tmp_path
):
    (tmp_path / "sub").mkdir()
    environ = {"PATH": os.environ["PATH"]}
    if pythonpath is not None:
        environ["PYTHONPATH"] = pythonpath.replace("WORK", str(tmp_path))
    interpreter = tmp_path / "python"  # says what environment it was started with
    interpreter.write_text("#!/bin/sh\nexec env\n")
    interpreter.chmod(0o755)
    script = agent_script(env={}, cwd=str(tmp_path), python=str(interpreter), env_file=None)
    done = subprocess.run(
        list(AGENT_ARGV), input=script, env=environ, capture_output=True, timeout=30, check=True
    )
    values = dict(line.split("=", 1) for line in done.stdout.decode().splitlines() if "=" in line)
    assert values.get("PYTHONPATH") == kept
    assert values.get(SAVED_PYTHONPATH) == environ.get("PYTHONPATH", "")


def test_rule_a_relays_child_starts_as_the_agents_script_starts_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = agent_environ({"PYTHONPATH": f".:/a::{tmp_path}:/b", "HOME": "/h"})
    assert started == {
        "PYTHONPATH": "/a:/b",
        SAVED_PYTHONPATH: f".:/a::{tmp_path}:/b",
        "PYTHONSAFEPATH": SAFE_PATH_MARK,
        "HOME": "/h",
    }
    assert agent_environ({"PYTHONSAFEPATH": "1"})["PYTHONSAFEPATH"] == "1"
    assert agent_environ({})[SAVED_PYTHONPATH] == ""


def test_rule_a_worker_loads_the_users_call_with_the_launchers_whole_path(tmp_path, monkeypatch):
    """The agent's sys.path lost the working folder; the user's code gets it back where the
    launcher had it, then what the host's interpreter and the imports added."""
    monkeypatch.chdir(tmp_path)
    launchers = ("", "/script", "/site")
    agents = ["/script", "/site", "/host/own", "/added"]
    assert users_path(launchers, agents) == [
        str(tmp_path),
        "/script",
        "/site",
        "/host/own",
        "/added",
    ]
    assert users_path((".", "rel"), ["/x"]) == [str(tmp_path), str(tmp_path / "rel"), "/x"]


# -- the unpack step ---------------------------------------------------------------------------


def test_the_unpack_step_imports_nothing_from_the_folder_it_starts_in(planted, tmp_path):
    """It runs isolated (``-I -S``): an ``srun`` step starts it in the launcher's folder."""
    script = agent_script(
        env={}, cwd="/unused", python=sys.executable, env_file=None, ship="0" * 32
    ).decode()
    assert f'{shlex.quote(sys.executable)} -I -S -c "$_torchrunx_unpack"' in script
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", unpack_source(), str(tmp_path / "cache"), "0" * 32],
        cwd=planted.folder,
        input=b"",
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert planted.imports() == "", planted.imports()
    assert done.returncode != 0  # no list of files came: it stops, having imported its modules


# -- real launches from the planted folder -----------------------------------------------------


def _pythonpath_with_an_empty_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PYTHONPATH=$PWD:$PYTHONPATH`` with no PYTHONPATH before: an empty entry, the working
    folder for Python (``site`` would import ``sitecustomize`` from it); forwarded (PYTHON*)."""
    monkeypatch.setenv("PYTHONPATH", f"{os.environ.get('PYTHONPATH', ROOT)}:")


def test_a_local_launch_from_a_planted_folder_imports_none_of_its_modules(planted, monkeypatch):
    monkeypatch.chdir(planted.folder)
    _pythonpath_with_an_empty_entry(monkeypatch)
    result = _launch_checked(planted, hostnames=["localhost"], workers_per_host=2, backend="gloo")
    assert [r["rank"] for r in result.ranks] == [0, 1]
    assert {r["cwd"] for r in result.ranks} == {str(planted.folder)}


def test_a_function_from_the_working_folder_still_loads_where_the_launcher_has_it(
    planted, monkeypatch
):
    """The launcher's sys.path names the working folder (a notebook's, ``python -m``): the
    agent imports nothing from it, but the user's function, named by reference, loads there."""
    module = planted.folder / "trx_users_own.py"  # the user's own module, written by the user
    module.write_text("import os\n\ndef where():\n    return os.getcwd()\n")
    monkeypatch.chdir(planted.folder)
    monkeypatch.setattr(sys, "path", [*sys.path, str(planted.folder)])
    import trx_users_own

    try:
        result = trx.launch(
            trx_users_own.where, hostnames=["localhost"], workers_per_host=1, backend=None
        )
    finally:
        sys.modules.pop("trx_users_own", None)
    assert planted.imports() == "", planted.imports()
    assert result.rank(0) == str(planted.folder)


@pytest.mark.cluster
@pytest.mark.parametrize("relay", ["off", "on"])
def test_an_ssh_launch_from_a_planted_folder_imports_none_of_its_modules(
    relay, planted, cluster, monkeypatch
):
    monkeypatch.chdir(planted.folder)
    _pythonpath_with_an_empty_entry(monkeypatch)
    result = _launch_checked(
        planted,
        hostnames=cluster.names(),
        workers_per_host=1,
        backend="gloo",
        ssh_config_file=cluster.ssh_config,
        relay=relay,
    )
    assert [r["host"] for r in result.ranks] == cluster.names()
    assert {r["cwd"] for r in result.ranks} == {str(planted.folder)}


# -- torchrunx check ---------------------------------------------------------------------------

CONSOLE_SCRIPT = "import sys\nfrom torchrunx.cli import main\nsys.exit(main())\n"
"""What pip writes for ``[project.scripts]``: its own folder, not the working one, on sys.path."""


def _check(planted: Planted, tmp_path: Path, *hostnames: str, ssh_config: str | None = None):
    script = tmp_path / "bin" / "torchrunx"
    script.parent.mkdir()
    script.write_text(CONSOLE_SCRIPT)
    options = ["--ssh-config-file", ssh_config] if ssh_config else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), "check", "--hostnames", *hostnames, *options],
        cwd=planted.folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert planted.imports() == "", planted.imports()
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_torchrunx_check_from_a_planted_folder_imports_none_of_its_modules(planted, tmp_path):
    out = _check(planted, tmp_path, "localhost")
    assert out.splitlines()[-1].endswith(": all ready"), out


@pytest.mark.cluster
def test_torchrunx_check_of_ssh_hosts_from_a_planted_folder_imports_none_of_its_modules(
    planted, tmp_path, cluster
):
    out = _check(planted, tmp_path, *cluster.names(), ssh_config=str(cluster.ssh_config))
    assert out.splitlines()[-1].endswith(": all ready"), out
