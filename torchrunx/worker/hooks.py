"""Code run right after a module is first imported (``torch``), in a worker.

Two things in a worker wait for ``torch``, without importing it themselves (a function that
never imports it costs nothing): rank 0's rendezvous store (:mod:`torchrunx.agent.store`)
and ``torch.distributed.breakpoint()``'s pdb (:mod:`torchrunx.worker.debugger`).
:func:`after_import` runs their code at once if the module is imported, else from an import
hook that removes itself.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import importlib.abc
    import importlib.machinery
    from collections.abc import Callable, Sequence
    from types import ModuleType


def after_import(name: str, then: Callable[[], None]) -> None:
    """Call ``then()`` now if module ``name`` is imported, else right after its import."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport:
    """Calls ``then()`` once module ``name`` has been imported (and leaves ``sys.meta_path``).

    A finder and a loader as ``sys.meta_path`` takes them (their methods), not subclasses of
    ``importlib.abc``'s: importing that module (it imports ``importlib.resources``) cost every
    agent 2 ms at its start.
    """

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """The module's own spec, with a loader that calls ``then()`` after executing it."""
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(fullname, path, target)
            if spec is not None:
                break
        if spec is None:
            return None
        if spec.loader is not None:
            spec.loader = cast("importlib.abc.Loader", _ThenLoader(spec.loader, self.then))
        return spec


class _ThenLoader:
    """Delegates to ``loader``, then calls ``then()`` once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, then: Callable[[], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        """The delegate's module."""
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        """Execute the module (which sees its own loader), then call ``then()``."""
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.then()
