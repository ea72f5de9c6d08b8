"""Keywords of earlier torchrunx releases, refused with what replaces them.

``Launcher(worker_timeout=60)`` would otherwise fail with Python's bare "unexpected keyword
argument"; a script migrating from torchrunx 0.4 is told what to write instead.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

RENAMED_FIELDS = {
    "worker_timeout": "renamed in torchrunx 0.5: use timeout=SECONDS (the process-group timeout)",
    "handler_factory": (
        "renamed in torchrunx 0.5: use log_handlers=... (or launcher.set_logging_handlers(...))"
    ),
    "env_vars": "renamed: use default_env_vars=(patterns, ...)",
    "log_dir": "removed: set the TORCHRUNX_LOG_DIR environment variable instead",
}
"""Keywords of earlier torchrunx releases (0.1 to 0.4) that no longer exist, and what replaces
them. Kept apart from unknown keywords so that a migrating script is told what to write."""


def refuse_renamed(caller: str, keywords: Iterable[str]) -> None:
    """Raise a TypeError naming the replacement of a keyword of an earlier release."""
    for name in keywords:
        if name in RENAMED_FIELDS:
            raise TypeError(f"{caller} got {name}=..., which was {RENAMED_FIELDS[name]}")


_C = TypeVar("_C")


def refuses_renamed_keywords(cls: type[_C]) -> type[_C]:
    """Make the dataclass's ``__init__`` name the replacement of an earlier release's keyword.

    Without it, ``Launcher(worker_timeout=60)`` fails with Python's bare "unexpected keyword
    argument". The wrapper keeps the generated signature (``inspect.signature``, tyro).
    """
    init: Callable[..., None] = cls.__init__

    @functools.wraps(init)
    def checked_init(self: object, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401 (the fields)
        refuse_renamed(f"{cls.__name__}()", kwargs)
        init(self, *args, **kwargs)

    setattr(cls, "__init__", checked_init)  # noqa: B010 (replacing a method mypy knows)
    return cls
