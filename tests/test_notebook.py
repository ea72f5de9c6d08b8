"""A launch from a Jupyter kernel, with a function defined in a notebook cell."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CELLS = [
    "import torchrunx as trx",
    # Defined in the notebook: workers get it by value (cloudpickle), not by import.
    """\
def scaled_sum(scale: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(value)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} sees {value.item()}")
    return value.item()""",
    """\
result = trx.launch(
    scaled_sum,
    func_args=(10.0,),
    hostnames=["localhost"],
    workers_per_host=2,
    backend="gloo",
)
print("ranks returned", result.ranks)""",
]


def _notebook_modules():
    try:
        import nbclient
        import nbformat
    except ImportError as exc:
        if os.environ.get("CI"):  # CI installs .[dev]: a missing package is a failure there
            pytest.fail(f"notebook test needs nbclient, nbformat and ipykernel: {exc}")
        pytest.skip(f"notebook test needs nbclient, nbformat and ipykernel: {exc}")
    return nbclient, nbformat


def test_launch_from_a_notebook_with_a_function_defined_in_a_cell(tmp_path, monkeypatch):
    nbclient, nbformat = _notebook_modules()
    # The kernel imports this checkout's torchrunx, as an installed one would be.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's own migration warning
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS]
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(notebook, tmp_path / "launch.ipynb")

    client = nbclient.NotebookClient(
        nbformat.read(tmp_path / "launch.ipynb", as_version=4),
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    executed = client.execute()

    outputs = executed.cells[2].outputs
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, "\n".join("\n".join(o.traceback) for o in errors)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    # 10 * 1 + 10 * 2, summed over both ranks, is what every rank returns.
    assert "ranks returned [30.0, 30.0]" in text
    # Rank 0's print is forwarded into the cell's output, as on a console.
    assert "[localhost:0] rank 0 of 2 sees 30.0" in text


WARM_NOTEBOOK = ROOT / "examples" / "warm_agents.ipynb"


def _client(nbclient, nbformat, notebook, tmp_path):
    return nbclient.NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )


def _text(cell) -> str:
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert not errors, "\n".join("\n".join(o.traceback) for o in errors)
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_the_warm_agents_notebook_runs_twice_on_the_same_agents(tmp_path, monkeypatch):
    nbclient, nbformat = _notebook_modules()
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    executed = _client(nbclient, nbformat, nbformat.read(WARM_NOTEBOOK, as_version=4), tmp_path)
    executed = executed.execute()
    texts = [_text(cell) for cell in executed.cells if cell.cell_type == "code"]
    assert "first run: [30.0, 30.0]" in texts[2]
    assert "second run: [3.0, 3.0]" in texts[3]
    assert "same agents: True" in texts[3]
    assert "closed=True" in texts[4]


def test_killing_the_kernel_ends_its_warm_agents(tmp_path, monkeypatch):
    """The kernel dies without closing them: the agents see it and end by themselves."""
    from conftest import torchrunx_processes

    nbclient, nbformat = _notebook_modules()
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    notebook = nbformat.read(WARM_NOTEBOOK, as_version=4)
    notebook.cells = [c for c in notebook.cells if c.cell_type == "code"][:3]  # no close()
    client = _client(nbclient, nbformat, notebook, tmp_path)
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        assert "first run: [30.0, 30.0]" in _text(notebook.cells[2])
        assert torchrunx_processes()  # the agents wait for the next run
        kernel = client.km.provisioner.process  # the kernel's Popen (a local provisioner)
        os.kill(kernel.pid, signal.SIGKILL)  # no atexit, no finalizer runs in the kernel
        kernel.wait(10)
    deadline = time.monotonic() + 40  # agent_timeout (30 s) at most, stdin EOF at once
    while torchrunx_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert torchrunx_processes() == []
