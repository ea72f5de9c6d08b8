"""Griffe extension for the documentation site: Sphinx roles in docstrings as inline code.

torchrunx's docstrings cross-reference with Sphinx roles (:meth:`run`, :class:`~x.Launcher`),
which read well in the source and in ``help()``. Markdown has no such syntax, so mkdocstrings
would print the role verbatim; this extension turns each one into inline code (``run``,
``Launcher``) as griffe loads the package. Enabled in ``mkdocs.yml``.
"""
# ruff: noqa: INP001 (loaded by mkdocstrings from its file path, not imported from a package)

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:attr|class|const|data|exc|func|meth|mod|obj):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):  # "~a.b.C" shows only "C", as in Sphinx
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites ``:role:`target``` as ```target``` in every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: ARG002, ANN401 (griffe's hook signature)
        """Rewrite the roles of one object's docstring, before it is parsed."""
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
