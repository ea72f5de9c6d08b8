"""``TORCHRUNX_PRELOAD``: modules each agent imports once, before it forks its workers.

The real launches count who imported a module: with the variable, only the agent of each host
(its workers inherit the module); without it, every worker.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import torchrunx as trx
from torchrunx.errors import ProtocolError
from torchrunx.launcher.settings.environ import preload_from_env
from torchrunx.wire.bootstrap import AgentBootstrap

HEAVY = """\
import os
with open(os.path.join(os.path.dirname(__file__), "imports.txt"), "a") as f:
    f.write(f"{os.getpid()} {os.getppid()}\\n")
"""


def test_the_variable_is_a_comma_separated_list_of_module_names():
    assert preload_from_env({}) == ()
    assert preload_from_env({"TORCHRUNX_PRELOAD": " "}) == ()
    assert preload_from_env({"TORCHRUNX_PRELOAD": "numpy, transformers.models"}) == (
        "numpy",
        "transformers.models",
    )
    for bad in ("a/b", "numpy,,torch", "x y", "1abc", "a.", "numpy;rm"):
        with pytest.raises(ValueError, match=r"TORCHRUNX_PRELOAD=.*is not a module name") as caught:
            preload_from_env({"TORCHRUNX_PRELOAD": bad})
        assert "TORCHRUNX_PRELOAD=transformers,numpy" in str(caught.value)  # what to do


def _boot(**changes: object) -> AgentBootstrap:
    fields: dict[str, object] = {
        "host_index": 0,
        "hostname": "node1",
        "launcher_address": "10.0.0.1",
        "launcher_port": 29500,
        "secret": bytes(32),
        "workers": 2,
        "preload_torch": False,
        "timings": trx.Launcher().plan().timeouts.agent_timings,
        "log_level": 20,
        "sys_path": ("/a",),
    }
    return AgentBootstrap(**{**fields, **changes})  # type: ignore[arg-type]


def test_the_bootstrap_carries_the_modules_and_refuses_what_is_not_a_module_name():
    boot = _boot(preload=("numpy", "a.b"))
    data = json.loads(boot.to_json_line())
    assert data["preload"] == ["numpy", "a.b"]
    assert AgentBootstrap.from_json_line(boot.to_json_line()) == boot
    assert "preload" not in json.loads(_boot().to_json_line())  # none: left out, read as ()
    assert AgentBootstrap.from_json_line(_boot().to_json_line()).preload == ()
    for bad in (["../x"], "numpy", [1], ["os; import x"]):
        with pytest.raises(ProtocolError, match="field 'preload' must be a list of module names"):
            AgentBootstrap.from_json_line(json.dumps({**data, "preload": bad}))


def import_heavy() -> int:
    import heavy_mod  # noqa: F401 (imported for what it records)

    return os.getpid()


def _importers(
    tmp_path, monkeypatch, preload: str | None, hosts: list[str], **fields: object
) -> tuple[list[int], dict[int, int]]:
    (tmp_path / "heavy_mod.py").write_text(HEAVY)
    monkeypatch.syspath_prepend(str(tmp_path))
    if preload is None:
        monkeypatch.delenv("TORCHRUNX_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("TORCHRUNX_PRELOAD", preload)
    result = trx.launch(import_heavy, hostnames=hosts, workers_per_host=2, backend=None, **fields)
    rows = (tmp_path / "imports.txt").read_text().split()
    return result.ranks, dict(zip(map(int, rows[::2]), map(int, rows[1::2]), strict=True))


def test_a_preloaded_module_is_imported_by_the_agent_once_and_not_by_its_workers(
    tmp_path, monkeypatch
):
    ranks, importers = _importers(tmp_path, monkeypatch, "heavy_mod", ["localhost"])
    [(agent, _)] = importers.items()  # one import, by the agent, the workers' parent
    assert agent not in ranks
    assert len(ranks) == 2


def test_without_the_variable_each_worker_imports_it(tmp_path, monkeypatch):
    ranks, importers = _importers(tmp_path, monkeypatch, None, ["localhost"])
    assert sorted(importers) == sorted(ranks)


def test_a_module_that_cannot_be_imported_is_named_and_left_to_the_workers(
    tmp_path, monkeypatch, capfd
):
    ranks, importers = _importers(
        tmp_path, monkeypatch, "no_such_module_x,heavy_mod", ["localhost"]
    )
    assert len(importers) == 1 and len(ranks) == 2  # the next module was still preloaded
    err = capfd.readouterr()
    said = err.out + err.err
    assert "TORCHRUNX_PRELOAD: cannot import no_such_module_x: ModuleNotFoundError" in said
    assert "each worker imports it itself" in said


def test_a_bad_value_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("TORCHRUNX_PRELOAD", "my/module")
    with pytest.raises(ValueError, match="'my/module' is not a module name"):
        trx.launch(import_heavy, hostnames=["localhost"], workers_per_host=1, backend=None)


@pytest.mark.cluster
def test_each_ssh_hosts_agent_preloads_for_its_own_workers(cluster, tmp_path, monkeypatch):
    # The test hosts share this machine's files: tmp_path is the same folder on each.
    ranks, importers = _importers(
        tmp_path, monkeypatch, "heavy_mod", cluster.names(), ssh_config_file=cluster.ssh_config
    )
    assert len(ranks) == 2 * len(cluster.names())
    assert len(importers) == len(cluster.names())  # one agent per host
    assert not set(importers) & set(ranks)
    assert sys.modules.get("heavy_mod") is None  # the launcher itself imports nothing
