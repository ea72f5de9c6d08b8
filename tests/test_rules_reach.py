"""Pure rules of hosts that do not share the launcher's files: ``python=``, ``ship=``."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

import torchrunx as trx
from torchrunx.agent import unpack
from torchrunx.engines import ship
from torchrunx.engines.command import MISSING_PYTHON, agent_script, unpack_source
from torchrunx.errors import ShipError
from torchrunx.launcher.settings import reach
from torchrunx.launcher.settings.plan import agent_timings
from torchrunx.wire.bootstrap import BOOT_CODE, AgentBootstrap

PACKAGE = Path(trx.__file__).resolve().parent


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _paths(bundle: ship.Bundle) -> list[str]:
    return [f.path for f in bundle.files if not f.path.startswith(".torchrunx-lib/")]


def test_a_bundle_honours_gitignore_files_excludes_and_never_ships_git_or_caches(tmp_path):
    _tree(
        tmp_path,
        {
            "train.py": "x",
            ".gitignore": "outputs/\n*.log\n!keep.log\n",
            "outputs/run1/metrics.json": "{}",
            "debug.log": "noise",
            "keep.log": "kept",
            "pkg/__init__.py": "",
            "pkg/.gitignore": "generated_*.py\n",
            "pkg/generated_a.py": "",
            "pkg/model.py": "",
            "pkg/__pycache__/model.cpython-311.pyc": "",
            "stray.pyc": "",
            ".git/HEAD": "ref",
            "data/big.ckpt": "weights",
            "data/small.txt": "s",
        },
    )
    bundle = ship.make_bundle(["."], ["*.ckpt"], cwd=tmp_path)
    assert _paths(bundle) == [
        ".gitignore",
        "data/small.txt",
        "keep.log",
        "pkg/.gitignore",
        "pkg/__init__.py",
        "pkg/model.py",
        "train.py",
    ]


def test_nested_gitignore_files_apply_below_their_own_folder_only(tmp_path):
    _tree(
        tmp_path,
        {
            "a/.gitignore": "/top.py\n",  # anchored: a/top.py only, not a/sub/top.py
            "a/top.py": "",
            "a/sub/top.py": "",
            "b/.gitignore": "*.tmp\n",
            "b/x.tmp": "",
            "b/keep.py": "",
            "c/x.tmp": "",  # b's pattern is not c's
            "logs": "a file, not a folder",
            "d/.gitignore": b"\xff\xfe not utf-8\nbuild/\n".decode("latin-1"),
            "d/build/out.bin": "",
            "d/run.py": "",
        },
    )
    (tmp_path / "d" / ".gitignore").write_bytes(b"\xff\xfe not utf-8\nbuild/\n")
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "data.bin").write_text("x")
    (tmp_path / "linked").symlink_to(tmp_path / "real")  # a link to a folder: not followed
    bundle = ship.make_bundle(["."], ["logs/"], cwd=tmp_path)  # a folder pattern: not the file
    assert _paths(bundle) == [
        "a/.gitignore",
        "a/sub/top.py",
        "b/.gitignore",
        "b/keep.py",
        "c/x.tmp",
        "d/.gitignore",
        "d/run.py",
        "logs",
        "real/data.bin",
    ]
    assert ship.make_bundle(["."], ["logs"], cwd=tmp_path).place(tmp_path / "logs") == "logs"
    assert "logs" not in _paths(ship.make_bundle(["."], ["logs"], cwd=tmp_path))


def test_a_bundle_is_made_from_the_working_directory_by_default(tmp_path, monkeypatch):
    _tree(tmp_path, {"a.py": "1"})
    monkeypatch.chdir(tmp_path)
    bundle = ship.make_bundle(["."])
    assert _paths(bundle) == ["a.py"]
    assert bundle.timeout == 60.0
    assert ship.make_bundle(["."], timeout=5.0).timeout == 5.0
    assert b" " not in bundle.manifest  # compact: it travels to every host that lacks it
    assert json.loads(bundle.manifest)[0][0] == ".torchrunx-lib/torchrunx/__init__.py"


def test_a_bundle_ships_torchrunx_unless_a_shipped_path_holds_it(tmp_path):
    _tree(tmp_path, {"a.py": ""})
    bundle = ship.make_bundle(["."], cwd=tmp_path)
    lib = [f.path for f in bundle.files if f.path.startswith(".torchrunx-lib/")]
    assert ".torchrunx-lib/torchrunx/__init__.py" in lib
    assert ".torchrunx-lib/torchrunx/agent/unpack.py" in lib
    assert not any("__pycache__" in p for p in lib)
    assert ship.lib_entry(bundle) == ".torchrunx-lib"
    holding = ship.make_bundle([str(PACKAGE)], cwd=PACKAGE.parent)  # the package itself
    assert ship.lib_entry(holding) is None
    assert "torchrunx/__init__.py" in [f.path for f in holding.files]


def test_paths_outside_the_working_directory_get_their_own_place(tmp_path):
    _tree(tmp_path / "work", {"main.py": ""})
    _tree(tmp_path / "libs" / "shared", {"util.py": "", "sub/x.py": ""})
    _tree(tmp_path / "single", {"settings.toml": "a=1"})
    bundle = ship.make_bundle(
        ["main.py", "../libs/shared", str(tmp_path / "single" / "settings.toml")],
        cwd=tmp_path / "work",
    )
    assert _paths(bundle) == [
        ".torchrunx-paths/1-shared/sub/x.py",
        ".torchrunx-paths/1-shared/util.py",
        ".torchrunx-paths/2-settings.toml",
        "main.py",
    ]
    assert bundle.place(tmp_path / "libs" / "shared" / "sub") == ".torchrunx-paths/1-shared/sub"
    assert bundle.place(tmp_path / "work" / "main.py") == "main.py"
    assert bundle.place(tmp_path / "work" / "other.py") is None  # not shipped
    assert bundle.place(tmp_path / "libs") is None


def test_the_digest_follows_content_path_and_mode_only(tmp_path):
    _tree(tmp_path, {"a.py": "1", "b/c.py": "2"})
    first = ship.make_bundle(["."], cwd=tmp_path)
    assert first.digest == ship.make_bundle(["."], cwd=tmp_path).digest
    os.utime(tmp_path / "a.py", (1, 1))  # a new mtime, same bytes
    assert ship.make_bundle(["."], cwd=tmp_path).digest == first.digest
    (tmp_path / "a.py").write_text("3")
    changed = ship.make_bundle(["."], cwd=tmp_path)
    assert changed.digest != first.digest
    (tmp_path / "a.py").write_text("1")
    (tmp_path / "a.py").chmod(0o755)
    executable = ship.make_bundle(["."], cwd=tmp_path)
    assert executable.digest != first.digest
    entry = next(e for e in json.loads(executable.manifest) if e[0] == "a.py")
    assert entry[1] is True and entry[2] == 1
    assert len(first.digest) == 32


def test_a_missing_shipped_path_is_named_with_the_working_directory(tmp_path):
    with pytest.raises(ValueError, match=r"ship: 'nope' does not exist \(relative to the working"):
        ship.make_bundle(["nope"], cwd=tmp_path)


def test_launcher_checks_ship_and_python_fields(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"ship: 'src' does not exist"):
        trx.Launcher(hostnames=["a"], ship=("src",)).validate()
    with pytest.raises(TypeError, match=r"ship must be a tuple of paths, for example \('\.',\)"):
        trx.Launcher(hostnames=["a"], ship=".").validate()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ship_exclude must be a tuple of patterns"):
        trx.Launcher(hostnames=["a"], ship_exclude="*.ckpt").validate()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="python must be an interpreter's path"):
        trx.Launcher(hostnames=["a"], python="").validate()
    with pytest.raises(TypeError, match="python must be an interpreter's path"):
        trx.Launcher(hostnames=["a"], python={"a": 3}).validate()  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"python names hosts that are not in the launch: \['c'\]"):
        trx.Launcher(hostnames=["a", "b"], python={"a": "/p", "c": "/q"}).plan()
    trx.Launcher(hostnames=["a"], python={"a": "/p"}, ship=(".",)).validate()


def test_python_for_each_host():
    assert reach.python_for(None, "a") is None
    assert reach.python_for("/opt/py", "a") == "/opt/py"
    assert reach.python_for({"a": "/opt/py"}, "a") == "/opt/py"
    assert reach.python_for({"a": "/opt/py"}, "b") is None
    # Per provider: "@METHOD" covers the hosts that start that way; a host's own key wins.
    per = {"@srun": "/venv/bin/python", "a": "/opt/py"}
    assert reach.python_for(per, "a", "srun") == "/opt/py"
    assert reach.python_for(per, "b", "srun") == "/venv/bin/python"
    assert reach.python_for(per, "b", "ssh") is None
    assert reach.python_for(per, "b") is None
    assert reach.default_python(per, "b", (), "srun") == "/venv/bin/python"
    reach.check_python_hosts(per, ["a", "b"], ["ssh", "srun"])
    with pytest.raises(ValueError, match=r"\['@srun'\].*@METHOD keys may name \['@ssh'\]"):
        reach.check_python_hosts(per, ["a", "b"], ["ssh", "ssh"])
    with pytest.raises(ValueError, match=r"not in the launch: \['@local'\]"):
        reach.check_python_hosts({"@local": "/p"}, ["localhost"], ["local"])
    plan = trx.Launcher(hostnames=["a", "b"], python={"@ssh": "/venv/bin/python"}).plan()
    assert plan.reach.python == {"@ssh": "/venv/bin/python"}
    text = trx.Launcher(hostnames=["a", "b"], python={"@ssh": "/v/python", "b": "/b"}).dry_run()
    assert "python on a: /v/python" in text
    assert "python on b: /b" in text


def test_project_paths_leave_out_the_launchers_installation(tmp_path):
    site = os.path.join(sys.prefix, "lib", "site-packages")
    paths = reach.project_paths(["", str(tmp_path), site, sys.base_prefix + "/lib/python3.zip"])
    assert paths[0] == os.getcwd()
    assert str(tmp_path) in paths
    assert site not in paths
    assert not any(p.startswith(sys.base_prefix + "/lib") for p in paths)
    root = str(PACKAGE.parent)
    installed = root.startswith(tuple(os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)))
    assert (root in paths) is not installed  # an editable checkout travels by its path


def test_shipped_hosts_get_tree_relative_paths_and_torchrunx_first(tmp_path, monkeypatch):
    _tree(tmp_path, {"src/pkg/__init__.py": "", "scripts/run.py": ""})
    monkeypatch.chdir(tmp_path)
    bundle = ship.make_bundle(["."], cwd=tmp_path)
    path = ["", str(tmp_path / "src"), "/elsewhere/shared", os.path.join(sys.prefix, "lib")]
    placed = reach.host_sys_path(bundle, path)
    assert placed[:4] == (".torchrunx-lib", ".", "src", "/elsewhere/shared")
    # After them only project paths that were not shipped (torchrunx's editable checkout).
    assert set(placed[4:]) <= set(reach.project_paths(path)) - {os.getcwd(), str(tmp_path / "src")}
    assert not any(p.startswith(sys.prefix) for p in placed)


def test_the_agent_script_checks_the_interpreter_then_unpacks_then_starts():
    script = agent_script(
        env={"A": "1"},
        cwd="/work",
        python="/opt/py",
        env_file=None,
        ship="0123abcd",
    ).decode()
    assert script.endswith("\0")
    check = script.index("command -v /opt/py")
    unpacking = script.index("/opt/py -I -S -c")
    into = script.index('cd "$_torchrunx_code/trees/0123abcd"')
    start = script.index("exec /opt/py -u -c")
    assert check < unpacking < into < start
    assert "exit 127" in script[check:unpacking]
    assert "cd /work" not in script
    assert "${TORCHRUNX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/torchrunx}/code" in script
    assert unpack_source().splitlines()[0] in script
    plain = agent_script(env={}, cwd="/work", python="/opt/py", env_file="/e.sh").decode()
    assert "cd /work || {" in plain
    sourced = plain.index("source /e.sh && ")
    assert sourced < plain.index("_torchrunx_r=") < plain.index(" exec /opt/py -u -c")
    assert "torchrunx-ship" not in plain
    assert shlex.quote(MISSING_PYTHON.format(python="/opt/py")) in plain


def test_the_boot_code_puts_a_kept_path_before_the_interpreters_own(tmp_path, monkeypatch):
    line = AgentBootstrap(
        host_index=0,
        hostname="h",
        launcher_address="127.0.0.1",
        launcher_port=1,
        secret=b"s" * 32,
        workers=1,
        preload_torch=False,
        timings=agent_timings(5.0),
        log_level=20,
        sys_path=(".torchrunx-lib", "/abs"),
        keep_path=True,
    ).to_json_line()
    assert AgentBootstrap.from_json_line(line).keep_path is True
    names: dict[str, object] = {"__name__": "boot"}
    monkeypatch.chdir(tmp_path)  # the working folder, which the boot code takes off sys.path
    code = BOOT_CODE.split("\nimport torchrunx")[0].replace(
        "sys.stdin.buffer.readline()", repr(line)
    )
    original = list(sys.path)
    try:
        exec(code, names)  # noqa: S102 (the boot code, up to its import of torchrunx)
        assert sys.path[:2] == [str(tmp_path / ".torchrunx-lib"), "/abs"]
        assert sys.path[2:] == original
    finally:
        sys.path[:] = original


def _age(path: Path, days: float) -> None:
    then = time.time() - days * 86400
    os.utime(path, (then, then), follow_symlinks=False)


def test_the_cache_keeps_what_was_used_lately_and_cleans_the_rest(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHRUNX_CACHE_DAYS", raising=False)
    blobs, trees = tmp_path / "blobs", tmp_path / "trees"
    blobs.mkdir()
    trees.mkdir()
    for name in ("old-r", "shared-r", "fresh-r", "orphan-r"):
        (blobs / name).write_text(name)
    for tree, names in {
        "old": ["old-r", "shared-r"],
        "recent": ["shared-r"],
        "now": ["fresh-r"],
    }.items():
        (trees / tree).mkdir()
        for name in names:
            (trees / tree / name).hardlink_to(blobs / name)
    (trees / ".tmp-crashed-1").mkdir()
    (blobs / ".tmp-1-abc").write_text("partial")
    for path in blobs.iterdir():
        _age(path, 30)
    _age(trees / "old", 15)
    _age(trees / "recent", 13)
    _age(trees / "now", 30)  # old, but the tree of this launch
    _age(trees / ".tmp-crashed-1", 2)
    unpack.clean(tmp_path, keep="now")
    assert sorted(p.name for p in trees.iterdir()) == ["now", "recent"]
    # A blob goes once no tree links to it and it is old: "old-r" (its tree went), "orphan-r".
    assert sorted(p.name for p in blobs.iterdir()) == ["fresh-r", "shared-r"]
    monkeypatch.setenv("TORCHRUNX_CACHE_DAYS", "1")
    unpack.clean(tmp_path, keep="now")
    assert sorted(p.name for p in trees.iterdir()) == ["now"]
    assert sorted(p.name for p in blobs.iterdir()) == ["fresh-r"]


def test_a_trees_record_goes_a_day_after_its_tree_and_never_before(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHRUNX_CACHE_DAYS", raising=False)
    trees, records = tmp_path / "trees", tmp_path / "records"
    trees.mkdir()
    records.mkdir()
    (trees / "kept").mkdir()
    _age(trees / "kept", 1)
    (trees / ".tmp-stale-gone-1-2").mkdir()  # a tree set aside, a day and more ago
    _age(trees / ".tmp-stale-gone-1-2", 1.5)
    (trees / ".tmp-stale-kept-1-3").mkdir()  # set aside lately: a launch may run in it
    for name, days in {
        "kept": 30,  # its tree is there: kept, however old
        "gone": 1.5,  # its tree went
        "making": 0.5,  # no tree yet: a launch may be about to put it in place
        ".tmp-gone-1": 1.5,  # a record cut short
        ".tmp-now-1": 0.5,
    }.items():
        (records / name).write_text("{}")
        _age(records / name, days)
    unpack.clean(tmp_path, keep="now")
    assert sorted(p.name for p in records.iterdir()) == [".tmp-now-1", "kept", "making"]
    assert sorted(p.name for p in trees.iterdir()) == [".tmp-stale-kept-1-3", "kept"]


def test_container_is_a_command_line_put_before_the_agent_command():
    from torchrunx.engines.builtin import openssh_command, srun_command
    from torchrunx.engines.command import AGENT_COMMAND, remote_command

    reach.check_container(None)
    reach.check_container("podman exec -i trainer")
    with pytest.raises(TypeError, match="container must be a command line"):
        reach.check_container(["podman", "exec"])
    with pytest.raises(ValueError, match="container is empty"):
        reach.check_container("  ")
    with pytest.raises(ValueError, match="is not a command line: No closing quotation"):
        reach.check_container("podman exec -i 'x")
    prefix = ("podman", "exec", "-i", "my box")
    assert remote_command() == AGENT_COMMAND
    assert remote_command(prefix) == f"podman exec -i 'my box' {AGENT_COMMAND}"
    assert openssh_command("ssh", "h", None, 5, prefix)[-1] == remote_command(prefix)
    srun = srun_command("h", cpus=None, container=prefix)
    assert srun[srun.index("podman") : srun.index("podman") + 5] == [*prefix, "bash"]
    assert reach.default_python(None, "h", prefix) == "python3"
    assert reach.default_python("/opt/py", "h", prefix) == "/opt/py"
    assert reach.default_python(None, "h", ()) is None
    assert trx.Launcher(
        hostnames=["a"], container="apptainer exec img.sif"
    ).plan().reach.container == (
        "apptainer",
        "exec",
        "img.sif",
    )
    assert "remote agents run in a container, started with: apptainer exec img.sif" in (
        trx.Launcher(hostnames=["a"], container="apptainer exec img.sif").dry_run()
    )


def test_pyxis_options_are_srun_options_before_the_agent_command():
    from torchrunx.engines.builtin import SrunTransport, SshTransport, srun_command
    from torchrunx.engines.command import AGENT_ARGV

    options = ("--container-image=/img/train.sqsh", "--container-mounts=/data:/data")
    reach.check_container(" ".join(options))
    srun = srun_command("h", cpus=4, container=options)
    # srun reads options up to its command: the pyxis options come after its own, before bash.
    assert srun[: srun.index(options[0])][-1] == "--cpus-per-task=4"
    assert srun[srun.index(options[0]) :] == [*options, *AGENT_ARGV]
    assert SrunTransport.container_options is True
    assert not SshTransport.container_options
    assert reach.default_python(None, "h", options) == "python3"


def test_a_shipped_folders_containment_is_judged_by_whole_path_components(tmp_path):
    """A sibling folder whose name starts with the shipped folder's is outside it."""
    _tree(tmp_path / "work", {"main.py": ""})
    _tree(tmp_path / "work2", {"util.py": ""})
    bundle = ship.make_bundle(["."], cwd=tmp_path / "work")
    assert bundle.place(tmp_path / "work" / "main.py") == "main.py"
    assert bundle.place(tmp_path / "work2" / "util.py") is None  # not below work/
    assert bundle.place(tmp_path / "work2") is None
    beside = ship.make_bundle(["main.py", "../work2"], cwd=tmp_path / "work")
    assert _paths(beside) == [".torchrunx-paths/1-work2/util.py", "main.py"]
    assert beside.place(tmp_path / "work2" / "util.py") == ".torchrunx-paths/1-work2/util.py"


def test_a_nested_gitignore_applies_below_its_own_folder_only_not_to_a_sibling_with_its_prefix(
    tmp_path,
):
    _tree(
        tmp_path,
        {
            "a/.gitignore": "*.tmp\n",
            "a/x.tmp": "",
            "ab/x.tmp": "",  # "ab" starts with "a": still not below a/
            "ab/y.py": "",
        },
    )
    assert _paths(ship.make_bundle(["."], cwd=tmp_path)) == ["a/.gitignore", "ab/x.tmp", "ab/y.py"]


def test_a_file_below_an_ignored_folder_is_not_shipped_even_if_a_pattern_takes_it_back(tmp_path):
    """As git: a file cannot be re-included when a folder above it is excluded."""
    _tree(
        tmp_path,
        {
            ".gitignore": "build/\n!build/keep.txt\n/out/\n!out/keep.txt\n",
            "build/keep.txt": "",
            "build/drop.bin": "",
            "src/build/keep.txt": "",  # an unanchored folder pattern: any build/ folder
            "out/keep.txt": "",
            "src/out/keep.txt": "",  # an anchored one: the top's out/ only
            "run.py": "",
        },
    )
    assert _paths(ship.make_bundle(["."], cwd=tmp_path)) == [
        ".gitignore",
        "run.py",
        "src/out/keep.txt",
    ]


def test_rule_only_files_are_shipped_a_dangling_link_is_left_out(tmp_path):
    _tree(tmp_path, {"a.py": ""})
    (tmp_path / "gone.py").symlink_to(tmp_path / "nowhere.py")
    (tmp_path / "same.py").symlink_to(tmp_path / "a.py")  # a link to a file: the file
    assert _paths(ship.make_bundle(["."], cwd=tmp_path)) == ["a.py", "same.py"]


def test_rule_a_folder_inside_torchrunx_does_not_hold_torchrunx_so_all_of_it_ships(tmp_path):
    inner = ship.make_bundle([str(PACKAGE / "wire")], cwd=tmp_path)
    assert ship.lib_entry(inner) == ".torchrunx-lib"
    paths = [f.path for f in inner.files]
    assert ".torchrunx-lib/torchrunx/agent/unpack.py" in paths
    assert ".torchrunx-paths/1-wire/relay.py" in paths


def test_rule_a_file_is_executable_on_the_hosts_when_its_owner_may_run_it(tmp_path):
    _tree(tmp_path, {"mine.sh": "", "others.sh": ""})
    (tmp_path / "mine.sh").chmod(0o744)
    (tmp_path / "others.sh").chmod(0o645)  # the group's and others' bits are not the owner's
    bundle = ship.make_bundle(["."], cwd=tmp_path)
    assert {f.path: f.executable for f in bundle.files if f.path.endswith(".sh")} == {
        "mine.sh": True,
        "others.sh": False,
    }


def _exchange(bundle: ship.Bundle, answers: bytes) -> tuple[bytes, bytes]:
    """The launcher's side with a host that wrote ``answers`` at once: what it was sent, and
    what came after the exchange."""
    written = bytearray()
    chunks = [answers]

    def read(_timeout: float) -> bytes | None:
        return chunks.pop(0) if chunks else b""

    def write(data: bytes, _timeout: float) -> None:
        written.extend(data)

    rest = bundle.exchange("node1", read, write)
    return bytes(written), rest


def test_rule_a_file_that_shrank_since_the_bundle_was_made_is_sent_at_its_bundled_size(tmp_path):
    """The host reads exactly the manifest's size (then refuses the hash): the stream stays
    in step whatever the file holds now."""
    _tree(tmp_path, {"a.py": "abcdef"})
    bundle = ship.make_bundle(["a.py"], cwd=tmp_path)
    index = next(i for i, f in enumerate(bundle.files) if f.path == "a.py")
    (tmp_path / "a.py").write_text("ab")
    answers = b"torchrunx-ship manifest\ntorchrunx-ship need [%d]\ntorchrunx-ship done\nout" % index
    written, rest = _exchange(bundle, answers)
    assert written == b"%016d" % len(bundle.manifest) + bundle.manifest + b"ab" + bytes(4)
    assert rest == b"out"
    assert bundle.sent == {"node1": len(written)}


def test_rule_a_host_that_answers_neither_have_nor_manifest_is_refused(tmp_path):
    _tree(tmp_path, {"a.py": ""})
    bundle = ship.make_bundle(["a.py"], cwd=tmp_path)
    with pytest.raises(
        ShipError, match=r"expected the host's answer to the shipped code, got b'hav'"
    ):
        _exchange(bundle, b"torchrunx-ship hav\n")
    assert _exchange(bundle, b"torchrunx-ship have\nhello") == (b"", b"hello")


def test_rule_python_naming_a_host_on_this_machine_is_refused_not_ignored():
    from torchrunx.launcher.settings.reach import check_python_hosts

    with pytest.raises(
        ValueError, match=r"^python names \['localhost'\], which run on this machine"
    ):
        check_python_hosts({"localhost": "/x/python"}, ["localhost", "node2"], ["local", "ssh"])
    check_python_hosts({"node2": "/x/python"}, ["localhost", "node2"], ["local", "ssh"])


def test_rule_one_python_for_every_host_says_it_is_not_this_machines(caplog):
    import logging

    from torchrunx.launcher.settings.reach import check_python_hosts

    with caplog.at_level(logging.WARNING, logger="torchrunx.launcher"):
        check_python_hosts("/x/python", ["localhost", "node2"], ["local", "ssh"])
    said = (
        "python='/x/python' is the interpreter of the other hosts: localhost, on this machine, "
        f"runs the launcher's own ({sys.executable})"
    )
    assert [r.getMessage() for r in caplog.records] == [said]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchrunx.launcher"):
        check_python_hosts("/x/python", ["node1", "node2"], ["ssh", "ssh"])
    assert caplog.records == []
