"""The launcher's environment variables, read once per launch by ``Launcher.plan()``.

:func:`read_environ` reads every variable the launcher side uses during a launch (the
``TORCHRUNX_*`` of docs/environment.md, ``XDG_*`` folders, SLURM's job) from one mapping
(``os.environ`` unless given), checks them, and returns :class:`LauncherEnviron`: the plan
keeps it, and the launch's parts take their values from the plan, never from ``os.environ``.
The parsers below take the mapping to read; each raises ``ValueError`` for a bad value, naming
the variable, before anything starts.

Not read here: what an agent or a worker reads on its own host (another process), and what runs
outside a launch (``torchrunx top`` finds the views' folder with
:func:`~torchrunx.launcher.view.view_server.runtime_dir`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from torchrunx.env import flag_from_env
from torchrunx.wire.bootstrap import is_module_name

if TYPE_CHECKING:
    from collections.abc import Mapping

PRELOAD_ENV_VAR = "TORCHRUNX_PRELOAD"
"""Modules every agent imports before it forks its workers."""
LOG_LEVEL_ENV_VAR = "TORCHRUNX_LOG_LEVEL"
LOG_DIR_ENV_VAR = "TORCHRUNX_LOG_DIR"
DEFAULT_LOG_DIR = "./torchrunx_logs"
"""Where ``log_handlers="auto"`` writes its files unless :data:`LOG_DIR_ENV_VAR` is set."""
HEALTH_PORT_ENV_VAR = "TORCHRUNX_HEALTH_CHECK_PORT"
"""The environment variable that turns the endpoint on when ``health_check_port`` is not set."""
HEALTH_HOST_ENV_VAR = "TORCHRUNX_HEALTH_CHECK_HOST"
"""The address the launcher serves the endpoint on (unset: ``127.0.0.1``; ``*``: every one)."""
HEALTH_DETAILS_ENV_VAR = "TORCHRUNX_HEALTH_CHECK_DETAILS"
"""``1`` serves the first line of each failure's message, not only its exception type."""
HEALTH_TOKEN_ENV_VAR = "TORCHRUNX_HEALTH_CHECK_TOKEN"  # noqa: S105 (a variable's name)
"""A token: when set, a request is answered only with ``Authorization: Bearer <token>``."""
DEFAULT_HEALTH_HOST = "127.0.0.1"
"""Where the launcher serves the endpoint unless :data:`HEALTH_HOST_ENV_VAR` says otherwise."""
POST_MORTEM_ENV_VAR = "TORCHRUNX_POST_MORTEM"
"""Set (``1``): a rank that raises opens pdb at the raising frame in the launcher's terminal."""
DEBUGPY_ENV_VAR = "TORCHRUNX_DEBUGPY"
"""``RANK`` or ``RANK:PORT``: that rank waits for an IDE's debugger (debugpy) before it runs."""
DEBUGPY_PORT = 5678
"""debugpy's own default port."""
ADDRESS_ENV_VAR = "TORCHRUNX_LAUNCHER_ADDR"
"""The address remote agents connect back to, when ``launcher_address`` is not given."""
LISTEN_ENV_VAR = "TORCHRUNX_LISTEN_ADDR"
"""Where the launcher listens for agents and workers, when set (``*``: every interface)."""
PORT_ENV_VAR = "TORCHRUNX_LAUNCHER_PORT"
"""The port the launcher listens on (``29400``), or a range to take the first free one of
(``29400-29409``), so that a firewall rule can name it; unset: an ephemeral port."""


@dataclass(frozen=True)
class LauncherEnviron:
    """What the launcher's environment says, read once (:func:`read_environ`)."""

    environ: Mapping[str, str] = field(repr=False)
    """The launcher's environment as it was read (a copy): the base of a local agent's, the
    source of forwarded variables, ``TORCHRUNX_LAUNCHER_ADDR`` and ``TORCHRUNX_LISTEN_ADDR``
    (:mod:`torchrunx.launcher.starts.agent_starts`), SLURM's job; never in a repr (values may
    be secrets)."""
    log_level: int
    """``TORCHRUNX_LOG_LEVEL``: agents', workers' and the default handlers' level."""
    log_dir: Path | None
    """``TORCHRUNX_LOG_DIR``: the folder of ``log_handlers="auto"``'s files; None: no files."""
    hints: Path | None
    """The folder that remembers the hints said once; None: ``TORCHRUNX_HINTS=0``, no hints."""
    progress: bool | None
    """``TORCHRUNX_PROGRESS``: True (``1``) or False (``0``) forces the start's progress line;
    None: drawn on a terminal only."""
    view: bool
    """Whether the launch opens a view socket for ``torchrunx top`` (``TORCHRUNX_VIEW``)."""
    preload: tuple[str, ...]
    """``TORCHRUNX_PRELOAD``: modules each agent imports before it forks its workers."""
    launcher_ports: tuple[int, ...]
    """``TORCHRUNX_LAUNCHER_PORT``: the ports to listen on, in order (``(0,)``: any)."""
    health_port: int | None
    """``TORCHRUNX_HEALTH_CHECK_PORT``: the health endpoint's port, if set (the field wins)."""
    health_host: str
    """``TORCHRUNX_HEALTH_CHECK_HOST``: where ``GET /health`` listens (``""``: everywhere)."""
    health_token: str | None = field(repr=False)
    """``TORCHRUNX_HEALTH_CHECK_TOKEN``: the token requests must carry; None: none."""
    health_details: bool
    """``TORCHRUNX_HEALTH_CHECK_DETAILS``: failures are served with their first line."""
    post_mortem: bool
    """``TORCHRUNX_POST_MORTEM``: a rank that raises opens pdb (with a terminal)."""
    debugpy: tuple[int, int] | None
    """``TORCHRUNX_DEBUGPY``: ``(rank, port)`` of the rank that waits for an IDE's debugger."""

    @property
    def port_text(self) -> str:
        """``TORCHRUNX_LAUNCHER_PORT`` as given (for a message), empty if unset."""
        return self.environ.get(PORT_ENV_VAR, "")


def read_environ(environ: Mapping[str, str] | None = None) -> LauncherEnviron:
    """Read and check every variable the launcher uses in a launch, once.

    Args:
        environ: The environment to read; ``None``: this process's (``os.environ``), the one
            place the launcher side reads it.

    Raises:
        ValueError: A variable has a value it does not take (the message names it).
    """
    env = dict(os.environ if environ is None else environ)
    log_dir = env.get(LOG_DIR_ENV_VAR, DEFAULT_LOG_DIR)
    return LauncherEnviron(
        environ=env,
        log_level=log_level_from_env(env),
        log_dir=Path(log_dir) if log_dir else None,
        hints=None if env.get("TORCHRUNX_HINTS", "1") == "0" else hints_folder(env),
        progress={"1": True, "0": False}.get(env.get("TORCHRUNX_PROGRESS", "")),
        view=env.get("TORCHRUNX_VIEW", "1") != "0",
        preload=preload_from_env(env),
        launcher_ports=launcher_ports(env),
        health_port=health_port_from_env(None, env),
        health_host=health_host_from_env(env),
        health_token=health_token_from_env(env),
        health_details=health_details_from_env(env),
        post_mortem=flag_from_env(POST_MORTEM_ENV_VAR, env),
        debugpy=debugpy_from_env(env),
    )


def hints_folder(environ: Mapping[str, str]) -> Path:
    """The folder of the markers that say a hint was shown to this user.

    ``$TORCHRUNX_CACHE_DIR/hints``, else ``$XDG_CACHE_HOME/torchrunx/hints``, else
    ``~/.cache/torchrunx/hints``.
    """
    cache = environ.get("TORCHRUNX_CACHE_DIR") or str(
        Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchrunx"
    )
    return Path(cache) / "hints"


def preload_from_env(environ: Mapping[str, str]) -> tuple[str, ...]:
    """``TORCHRUNX_PRELOAD``: the modules every agent imports once, before it forks its workers.

    A comma-separated list of module names (``"transformers,numpy"``); empty or unset: none.
    Each worker inherits the imported modules instead of importing them itself (see
    docs/environment.md).

    Raises:
        ValueError: An entry is not a dotted module name (a path, a space, an empty entry).
    """
    raw = environ.get(PRELOAD_ENV_VAR, "").strip()
    if not raw:
        return ()
    names = tuple(name.strip() for name in raw.split(","))
    bad = [name for name in names if not is_module_name(name)]
    if bad:
        msg = (
            f"{PRELOAD_ENV_VAR}={raw!r}: {', '.join(repr(b) for b in bad)} is not a module name; "
            "give importable module names separated by commas, e.g. "
            f"{PRELOAD_ENV_VAR}=transformers,numpy"
        )
        raise ValueError(msg)
    return names


def log_level_from_env(environ: Mapping[str, str]) -> int:
    """``TORCHRUNX_LOG_LEVEL`` as a number: a level name (``DEBUG``) or number; default INFO.

    Raises:
        ValueError: The value is neither a known level name nor a number.
    """
    value = environ.get(LOG_LEVEL_ENV_VAR, "INFO").strip()
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ValueError(  # noqa: TRY004 (a bad value of a string setting)
            f"TORCHRUNX_LOG_LEVEL={value!r} is not a logging level (DEBUG, INFO, WARNING, ...)"
        )
    return level


def launcher_ports(environ: Mapping[str, str]) -> tuple[int, ...]:
    """The ports :data:`PORT_ENV_VAR` allows, in the order they are tried (``(0,)``: any).

    Raises:
        ValueError: The value is neither a port (1 to 65535) nor a range ``FIRST-LAST`` of them.
    """
    value = environ.get(PORT_ENV_VAR, "").strip()
    if not value:
        return (0,)
    first, dash, last = value.partition("-")
    bounds = (first.strip(), (last if dash else first).strip())
    if all(b.isdigit() and 0 < int(b) < 65536 for b in bounds):
        low, high = int(bounds[0]), int(bounds[1])
        if low <= high:
            return tuple(range(low, high + 1))
    raise ValueError(
        f"{PORT_ENV_VAR}={value!r}: expected a port from 1 to 65535 (29400) or a range of them "
        "(29400-29409), the lower first"
    )


def health_port_from_env(field_value: int | None, environ: Mapping[str, str]) -> int | None:
    """The port to serve the health endpoint on, or None for no endpoint.

    Args:
        field_value: ``Launcher.health_check_port``; when not None it wins.
        environ: Where to read ``TORCHRUNX_HEALTH_CHECK_PORT``. An unset or empty variable
            means no endpoint.

    Returns:
        A port number from 0 to 65535 (0: any free port), or None.

    Raises:
        ValueError: The field or the variable is not a port number from 0 to 65535.
    """
    if field_value is not None:
        if isinstance(field_value, bool) or not isinstance(field_value, int):
            raise TypeError(f"health_check_port must be an int or None, not {field_value!r}")
        if not 0 <= field_value <= 65535:
            raise ValueError(
                f"health_check_port={field_value} is not a port number (an integer from 0 to "
                "65535; 0: any free port)"
            )
        return field_value
    raw = environ.get(HEALTH_PORT_ENV_VAR)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if re.fullmatch(r"[0-9]{1,5}", text) is None or int(text) > 65535:
        raise ValueError(
            f"{HEALTH_PORT_ENV_VAR}={raw!r} is not a port number (an integer from 0 to 65535; "
            "0: any free port; empty or unset: no health endpoint)"
        )
    return int(text)


def health_host_from_env(environ: Mapping[str, str]) -> str:
    """The address the launcher serves the endpoint on, from ``TORCHRUNX_HEALTH_CHECK_HOST``.

    Unset or empty: ``127.0.0.1`` (this machine only); ``*``: ``""``, every interface (IPv6
    and IPv4 where the machine has both); else the value, an address or a name of this machine
    (``0.0.0.0``: every IPv4 interface).
    """
    value = environ.get(HEALTH_HOST_ENV_VAR, "").strip()
    if not value:
        return DEFAULT_HEALTH_HOST
    return "" if value == "*" else value


def health_token_from_env(environ: Mapping[str, str]) -> str | None:
    """The token requests must carry, from ``TORCHRUNX_HEALTH_CHECK_TOKEN`` (unset, empty: none)."""
    value = environ.get(HEALTH_TOKEN_ENV_VAR, "").strip()
    return value or None


def health_details_from_env(environ: Mapping[str, str]) -> bool:
    """Whether failures are served with their messages (``TORCHRUNX_HEALTH_CHECK_DETAILS``).

    Raises:
        ValueError: The variable is neither ``1``, ``true``, ``yes``, ``on`` nor ``0``,
            ``false``, ``no``, ``off`` or empty (any case).
    """
    return flag_from_env(HEALTH_DETAILS_ENV_VAR, environ)


def debugpy_from_env(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """``TORCHRUNX_DEBUGPY``: ``RANK`` or ``RANK:PORT`` (port 5678 if not given); unset: None.

    Raises:
        ValueError: Not a rank (an integer from 0), or a port outside 1 to 65535.
    """
    raw = environ.get(DEBUGPY_ENV_VAR, "").strip()
    if not raw:
        return None
    rank_text, _, port_text = raw.partition(":")
    port_text = port_text or str(DEBUGPY_PORT)
    if not (rank_text.isdigit() and port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ValueError(
            f"{DEBUGPY_ENV_VAR}={raw!r} is not RANK or RANK:PORT (a rank from 0, a port from 1 "
            "to 65535), for example 0 or 1:5678"
        )
    return int(rank_text), int(port_text)
