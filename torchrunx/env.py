"""Environment forwarding: which launcher variables reach agents and workers.

An agent on the launcher's own machine starts from the launcher's whole environment (less
per-process variables); every agent, local or remote, then exports the launcher's variables
that match the forwarded patterns and the values given in ``extra_env_vars``. Values never
appear on a command line: they travel on the agent's stdin (see
:mod:`torchrunx.engines.command`),
are exported by the agent's shell, and workers inherit them.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

logger = logging.getLogger("torchrunx.launcher")

DEFAULT_ENV_VARS: tuple[str, ...] = (
    "PATH",
    "LD_LIBRARY_PATH",
    "LIBRARY_PATH",
    "PYTHON*",
    "CUDA*",
    "TORCH*",
    "PYTORCH*",
    "NCCL*",
    "OMP_*",
)
"""``fnmatch`` patterns of the launcher's variables that are copied by default."""

DEFAULT_ENV_VARS_FOR_COPY = DEFAULT_ENV_VARS
"""torchrunx 0.4's name for :data:`DEFAULT_ENV_VARS` (the default of ``copy_env_vars``)."""

_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Variables that describe one process and must never be copied to another one.
_NEVER_FORWARDED = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHRUNX_RESTART_COUNT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        # Set by torchrun for the processes it starts: a launcher started under torchrun must
        # not hand its elastic agent's store or error file to workers of its own.
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
    }
)


def forwarded_env(
    patterns: Iterable[str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The launcher's variables whose names match any of ``patterns`` (``fnmatch``, case-sensitive).

    Per-process variables (``RANK``, ``MASTER_PORT``, ...) are never copied: every worker gets
    its own.
    """
    env = os.environ if environ is None else environ
    pattern_list = list(patterns)
    return {
        name: value
        for name, value in env.items()
        if name not in _NEVER_FORWARDED
        and _SHELL_NAME.fullmatch(name)  # a name bash can export; others cannot be forwarded
        and any(fnmatch.fnmatchcase(name, pattern) for pattern in pattern_list)
    }


def unmatched_patterns(
    patterns: Iterable[str], environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The ``patterns`` that no variable of ``environ`` (the launcher's) matches, once each.

    Such a pattern forwards nothing: most often a typo (``WANDB_PROJCT``), or a variable that is
    set on the hosts but not where the launcher runs.
    """
    env = os.environ if environ is None else environ
    return tuple(
        pattern
        for pattern in dict.fromkeys(patterns)
        if not any(fnmatch.fnmatchcase(name, pattern) for name in env)
    )


def unmatched_env_vars(
    default: Iterable[str],
    copy: Iterable[str] | None,
    extra: object,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """The patterns a user gave that match no variable of the launcher: they forward nothing.

    Those of ``extra_env_vars``, and those of ``default_env_vars`` / ``copy_env_vars`` that are
    not torchrunx's own defaults (``NCCL*`` on a machine without NCCL is no mistake). A launch
    (and so the dry run and ``torchrunx check``) warns of each one; the dry run lists them.
    ``environ``: the launcher's (the plan's; None: this process's).
    """
    patterns, _ = split_extra_env_vars(extra)
    chosen = default if copy is None else copy
    given = (*(p for p in chosen if p not in DEFAULT_ENV_VARS), *patterns)
    return unmatched_patterns(given, environ)


def check_launch_env(
    default: Iterable[str],
    copy: Iterable[str] | None,
    extra: object,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Before a launch: refuse one inside a worker; warn of patterns that forward nothing.

    ``environ``: the launcher's (the plan's; None: this process's).

    Raises:
        RuntimeError: This process is a torchrunx worker (:func:`refuse_nested_launch`).
    """
    refuse_nested_launch(environ)
    for pattern in unmatched_env_vars(default, copy, extra, environ):
        logger.warning(
            "no variable of the launcher matches %r, so no worker gets it: a typo, or a "
            "variable set on the hosts but not here? (extra_env_vars, default_env_vars)",
            pattern,
        )


def check_env_fields(default: object, copy: object, extra: object) -> None:
    """``default_env_vars``, ``copy_env_vars`` and ``extra_env_vars`` of a Launcher.

    Raises:
        TypeError: A field of the wrong type (a bare string, say).
        ValueError: Both ``default_env_vars`` and ``copy_env_vars`` given, or a bad name.
    """
    for name, value in (("default_env_vars", default), ("copy_env_vars", copy)):
        if value is None and name == "copy_env_vars":
            continue
        if not isinstance(value, list | tuple) or not all(isinstance(p, str) for p in value):
            raise TypeError(f"{name} must be a tuple of fnmatch patterns, got {value!r}")
    if copy is not None and tuple(default) != DEFAULT_ENV_VARS:  # type: ignore[arg-type]  # checked above
        raise ValueError(
            "copy_env_vars (torchrunx 0.4's name) and default_env_vars are the same setting: "
            "give only one of them"
        )
    split_extra_env_vars(extra)  # raises TypeError or ValueError


def split_extra_env_vars(extra: object) -> tuple[tuple[str, ...], dict[str, str]]:
    """``extra_env_vars`` as (patterns of launcher variables to copy, values to set).

    A dict (torchrunx 0.4's form) holds names and values. In a tuple or list, an entry
    ``NAME=VALUE`` is a value and every other entry an ``fnmatch`` pattern (a variable's name
    cannot contain ``=``). ``None`` (0.4's default) is neither.

    Raises:
        TypeError: None of these forms, or a name or value that is not a string.
        ValueError: A name that bash cannot export or that torchrunx sets for each worker, or
            a value holding a NUL byte (no environment can hold one).
    """
    if extra is None:
        return (), {}
    if isinstance(extra, dict):
        patterns: tuple[str, ...] = ()
        items: list[tuple[object, object]] = list(extra.items())
    elif isinstance(extra, list | tuple) and all(isinstance(entry, str) for entry in extra):
        patterns = tuple(entry for entry in extra if "=" not in entry)
        items = [tuple(entry.split("=", 1)) for entry in extra if "=" in entry]
    else:
        raise TypeError(
            "extra_env_vars must be a tuple of fnmatch patterns and NAME=VALUE entries, or a "
            f"dict of names and values, got {extra!r}"
        )
    values: dict[str, str] = {}
    for name, value in items:
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(
                f"extra_env_vars: names and values must be strings, got {name!r}: {value!r}"
            )
        if not _SHELL_NAME.fullmatch(name):
            raise ValueError(
                f"extra_env_vars: {name!r} is not a variable name bash can export (letters, "
                "digits and _, not starting with a digit)"
            )
        if name in _NEVER_FORWARDED:
            raise ValueError(
                f"extra_env_vars: {name} is set by torchrunx for each worker and cannot be "
                "given for all of them"
            )
        if "\0" in value:
            raise ValueError(f"extra_env_vars: the value of {name} contains a NUL byte")
        values[name] = value
    return patterns, values


def exported_env(
    patterns: Iterable[str], values: Mapping[str, str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What every agent's shell exports: launcher variables matching ``patterns``, then ``values``.

    A name in ``values`` wins over a launcher variable of the same name.
    """
    return {**forwarded_env(patterns, environ), **values}


def local_agent_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an agent on the launcher's own machine starts with.

    The launcher's whole environment, as ``torchrun`` passes it on, less the per-process
    variables (``RANK``, ``MASTER_PORT``, ...) that every worker gets its own of.
    """
    env = os.environ if environ is None else environ
    return {name: value for name, value in env.items() if name not in _NEVER_FORWARDED}


def worker_env(  # noqa: PLR0913 (the variables torch.distributed expects, one argument each)
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    group_rank: int,
    master_addr: str,
    master_port: int,
    group_world_size: int = 1,
    attempt: int = 0,
    max_restarts: int = 0,
) -> dict[str, str]:
    """The torch.distributed variables of one worker (torchrun's names), and its attempt.

    ``TORCHRUNX_RESTART_COUNT`` is 0 for the first worker group and n after the n-th
    restart; ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_MAX_RESTARTS`` carry the same
    for code written for torchrun. ``TORCHELASTIC_RUN_ID`` makes
    ``torch.distributed.is_torchelastic_launched()`` true, as under torchrun: Lightning then
    reads the ranks from these variables (see ``torchrunx.integrations``).
    ``TORCHELASTIC_USE_AGENT_STORE=True``: the store at ``MASTER_ADDR:MASTER_PORT`` is
    hosted by host 0's agent (:mod:`torchrunx.agent.store`), so ``env://`` rendezvous makes
    every rank a client, rank 0 included, as under torchrun. A launch has one role, torchrun's
    default ``"default"``: ``ROLE_RANK`` and ``ROLE_WORLD_SIZE`` are ``RANK`` and
    ``WORLD_SIZE``; ``GROUP_WORLD_SIZE`` is the number of hosts (worker groups).
    """
    return {
        "TORCHRUNX_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_RUN_ID": "torchrunx",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def refuse_nested_launch(environ: Mapping[str, str] | None = None) -> None:
    """Raise if this process is a torchrunx worker: a launch here would launch in every worker.

    The usual cause: a script that calls ``trx.launch`` itself, run with the ``torchrunx``
    command (which runs the script in every worker). A worker has ``TORCHELASTIC_RUN_ID``
    ``torchrunx`` (see :func:`worker_env`); processes it starts inherit it, and are refused too.

    Raises:
        RuntimeError: This is a worker (the message says which, and what to do instead).
    """
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_RUN_ID") != "torchrunx" or "RANK" not in env:
        return
    raise RuntimeError(
        f"a launch was started inside a torchrunx worker (rank {env['RANK']} of "
        f"{env.get('WORLD_SIZE', '?')}), so every worker would start a launch of its own. A "
        "script that calls trx.launch (or Launcher.run) itself runs with python, not with the "
        "torchrunx command: `python script.py`; inside a worker, call the function directly"
    )


def flag_from_env(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A yes/no variable's value.

    Yes: ``1``, ``true``, ``yes``, ``on``; no: ``0``, ``false``, ``no``, ``off``, empty or unset
    (any case).

    Raises:
        ValueError: Any other value (so a typo never passes for "off").
    """
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not one of 1, true, yes, on, 0, false, no, off")
