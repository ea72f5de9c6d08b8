"""The layout of the package: who may import whom, and how big a module or class may grow.

Read from the source (every import: module level, in functions, and under TYPE_CHECKING), so a
new import that breaks the boundary fails here before it fails on a host without the
launcher's dependencies.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torchrunx"

LAUNCHER_SIDE = (
    "torchrunx.launcher",
    "torchrunx.engines",
    "torchrunx.hosts",
    "torchrunx.plugins",
    "torchrunx.cli",
    "torchrunx.integrations.cli",
    "torchrunx.integrations.parsing",
)
"""What runs only in the caller's process: the host side never imports it."""

HOST_SIDE = ("torchrunx.agent", "torchrunx.worker", "torchrunx.wire")
"""What runs on every host (the agent, its guardian and workers) and what it shares."""

PACKAGES = ("launcher", "engines", "agent", "worker", "wire", "hosts", "integrations")
"""The folders under ``torchrunx/`` (each with its sub-packages, if any)."""

MAX_FOLDER_MODULES = 16
"""Modules in one folder, its ``__init__.py`` aside (the folder itself): more, and it is cut
into sub-packages that say what each part is."""

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
"""A class's own lines (its ``class`` statement to its last line)."""
MAX_CLASS_WITH_BASES_LINES = 500
"""A class's lines and those of every base of the package that only it extends: a class split
across files by inheritance is still one class (compose parts instead)."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every module's imports of the package's modules (a name imported from a package that
    is a module of its own counts as that module)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if not node.module.startswith("torchrunx"):
                    continue
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("torchrunx"))
        found.discard(name)
        graph[name] = found
    return graph


def _under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` imports, directly or not, with the module that imports it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        current = todo.pop()
        for target in graph.get(current, set()):
            if target not in seen:
                seen[target] = current
                todo.append(target)
    return seen


def test_the_packages_hold_every_module():
    modules = _modules()
    top = sorted(n for n in modules if n.count(".") == 1)
    assert {f"torchrunx.{package}" for package in PACKAGES} <= set(top)
    for init in PACKAGE.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says what it holds"


def test_no_folder_holds_more_than_16_modules():
    crowded = []
    for folder in [PACKAGE, *(p.parent for p in PACKAGE.rglob("*/__init__.py"))]:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if count > MAX_FOLDER_MODULES:
            crowded.append(f"{folder.relative_to(PACKAGE.parent)}/: {count} modules")
    assert crowded == []
    assert not [p for p in PACKAGE.rglob("*.py") if not (p.parent / "__init__.py").exists()]


def test_the_host_side_never_imports_the_launcher_side():
    modules = _modules()
    graph = _imports(modules)
    host_side = [n for n in modules if _under(n, HOST_SIDE)]
    assert len(host_side) >= 10
    # What a worker's own code imports: the framework glue, never the 0.4 command-line shim.
    host_side += ["torchrunx.integrations", "torchrunx.integrations.lightning"]
    for name in host_side:
        for target, via in _reachable(graph, name).items():
            assert not _under(target, LAUNCHER_SIDE), f"{name} imports {target} (via {via})"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, set()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_type_checking_imports_included():
    assert _cycles(_imports(_modules())) == []


def _package(name: str, path: Path, depth: int | None) -> str:
    """The package of a module: the folder that holds it, or its first ``depth`` levels under
    ``torchrunx/`` (1: ``torchrunx.launcher`` for all of ``launcher/``). A module at the top of
    ``torchrunx/`` (the API, ``errors``, ``plugins``...) is a node of its own."""
    folder = path.parent.relative_to(PACKAGE.parent).parts
    if len(folder) == 1:
        return name
    return ".".join(folder if depth is None else folder[: depth + 1])


def _package_imports(depth: int | None) -> dict[str, set[str]]:
    """Which package imports which (type-checking imports included)."""
    modules = _modules()
    packages: dict[str, set[str]] = {}
    for name, targets in _imports(modules).items():
        source = _package(name, modules[name], depth)
        found = packages.setdefault(source, set())
        found.update(_package(t, modules[t], depth) for t in targets if t in modules)
        found.discard(source)
    return packages


def test_no_package_import_cycle_folders_or_their_sub_packages():
    top, folders = _package_imports(1), _package_imports(None)
    assert {"torchrunx.engines", "torchrunx.agent", "torchrunx.plugins"} <= top[
        "torchrunx.launcher"
    ]
    assert "torchrunx.launcher.state" in folders["torchrunx.launcher.launch"]
    assert _cycles(top) == []
    assert _cycles(folders) == []


def test_the_engines_are_a_layer_under_the_launcher():
    modules = _modules()
    graph = _imports(modules)
    engines = [n for n in modules if _under(n, ("torchrunx.engines",))]
    assert "torchrunx.engines.protocol" in engines
    for name in engines:
        for target, via in _reachable(graph, name).items():
            assert not _under(target, ("torchrunx.launcher",)), f"{name} imports {target} ({via})"


def test_no_module_imports_a_private_name_of_another_package_nor_an_engine_any():
    modules = _modules()
    private = []
    for name, path in modules.items():
        own = _package(name, path, None)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
                continue
            if node.module not in modules:
                continue
            theirs = _package(node.module, modules[node.module], None)
            for alias in node.names:
                hidden = alias.name.startswith("_") and not alias.name.startswith("__")
                if hidden and (theirs != own or _under(name, ("torchrunx.engines",))):
                    private.append(f"{name} imports {node.module}.{alias.name}")
    assert private == []


def test_an_agent_and_a_worker_load_nothing_of_the_launcher_side():
    code = (
        "import sys, torchrunx.agent.agent, torchrunx.worker.worker, torchrunx.agent.guardian\n"
        "import torchrunx.agent.workerprocess, torchrunx.integrations\n"
        "print('\\n'.join(m for m in sys.modules if m.startswith('torchrunx')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    loaded = done.stdout.split()
    assert {"torchrunx.agent.agent", "torchrunx.worker.worker", "torchrunx.integrations"} <= set(
        loaded
    )
    assert [m for m in loaded if _under(m, LAUNCHER_SIDE)] == []


def test_no_module_or_class_is_too_big_to_read():
    too_big = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_big.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_big.append(f"class {name}.{node.name}: {size} lines")
    assert too_big == []


def _classes(sources: dict[str, str]) -> dict[str, tuple[int, list[str]]]:
    """Every class of ``sources`` (module -> text): its lines and its bases of ``sources``.

    A base is named as the source names it (``Base`` or ``module.Base``); it counts if exactly
    one class of that name is defined in ``sources``.
    """
    found: dict[str, tuple[int, list[str]]] = {}
    names: dict[str, list[str]] = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                full = f"{module}.{node.name}"
                bases = [
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute))
                ]
                found[full] = ((node.end_lineno or node.lineno) - node.lineno + 1, bases)
                names.setdefault(node.name, []).append(full)
    return {
        full: (size, [names[b][0] for b in bases if len(names.get(b, [])) == 1])
        for full, (size, bases) in found.items()
    }


def _sizes_with_sole_bases(classes: dict[str, tuple[int, list[str]]]) -> dict[str, int]:
    """Each class's lines plus those of the bases that only it (or its sole-base chain) extends."""
    children: dict[str, set[str]] = {}
    for name, (_, bases) in classes.items():
        for base in bases:
            children.setdefault(base, set()).add(name)
    sizes = {}
    for name, (size, bases) in classes.items():
        total, todo, seen = size, [(name, b) for b in bases], {name}
        while todo:
            child, base = todo.pop()
            if base in seen or children.get(base) != {child}:
                continue  # shared by several classes: an interface, not a part of this one
            seen.add(base)
            total += classes[base][0]
            todo.extend((base, b) for b in classes[base][1])
        sizes[name] = total
    return sizes


def test_a_base_that_only_one_class_extends_counts_as_part_of_it():
    sources = {
        "m": "class A:\n    x = 1\n    y = 2\n\nclass B(A):\n    z = 3\n",
        "n": "import m\nclass C(m.B):\n    pass\n\nclass Shared:\n    pass\n",
        "o": "class D(Shared):\n    pass\n\nclass E(Shared):\n    pass\n",
    }
    sizes = _sizes_with_sole_bases(_classes(sources))
    assert sizes == {"m.A": 3, "m.B": 5, "n.C": 7, "n.Shared": 2, "o.D": 2, "o.E": 2}


def test_no_class_is_too_big_counting_the_bases_only_it_extends():
    sources = {name: path.read_text() for name, path in _modules().items()}
    sizes = _sizes_with_sole_bases(_classes(sources))
    too_big = [f"{n}: {s} lines" for n, s in sizes.items() if s > MAX_CLASS_WITH_BASES_LINES]
    assert too_big == []


def test_contributing_names_every_module_where_it_lives():
    readme = (PACKAGE.parent / "CONTRIBUTING.md").read_text()
    layout = readme[readme.index("## Layout") :]
    rows = {
        line.split("|")[1].strip(" `"): line
        for line in layout.splitlines()
        if "`torchrunx/" in line
    }
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = path.parent.relative_to(PACKAGE.parent).as_posix() + "/"
        if folder == "torchrunx/integrations/" or (
            path.name == "__init__.py" and folder != "torchrunx/"
        ):
            continue  # named as a folder
        if f"`{path.name}`" not in rows.get(folder, ""):
            missing.append(f"{folder}{path.name}")
    assert missing == []
