"""torchrunx 0.4's ``argparse`` helpers, under the import path 0.4 scripts use.

A script written for 0.4 starts with ``from torchrunx.integrations.cli import
add_torchrunx_argument_group, launcher_from_args``. Both names work here, with a
``DeprecationWarning`` naming today's: :func:`torchrunx.add_launcher_arguments` and
:func:`torchrunx.launcher_from_args` (see ``docs/cli.md``). The options they add are today's
(``--hostnames``, ``--workers-per-host``, ``--backend``, ``--copy-env-vars``,
``--extra-env-vars``, ...), with today's defaults; 0.4's ``--worker-timeout`` is an error
that names ``--timeout`` (``docs/migrating.md``). 0.4's documentation also spelled this module
``torchrunx.integrations.parsing``, which works too.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torchrunx import cli, cli_hints

if TYPE_CHECKING:
    import argparse

    from torchrunx.launcher.launcher import Launcher

__all__ = ["add_torchrunx_argument_group", "launcher_from_args"]


def _renamed(old: str, new: str) -> None:
    warnings.warn(
        f"torchrunx.integrations.cli.{old} is torchrunx 0.4's name: use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


def add_torchrunx_argument_group(parser: argparse.ArgumentParser) -> None:
    """0.4's name of :func:`torchrunx.add_launcher_arguments`: the launcher's options, in a group.

    Args:
        parser: The parser to add the options to (in a group titled ``torchrunx``, as in 0.4).
    """
    _renamed("add_torchrunx_argument_group", "torchrunx.add_launcher_arguments(parser)")
    group = cli.add_launcher_arguments(parser)
    # 0.4's --worker-timeout (and the other renamed keywords): an error naming the new option,
    # as on the torchrunx command, instead of argparse's bare "unrecognized arguments".
    cli_hints.add_renamed_options(group)


def launcher_from_args(args: argparse.Namespace) -> Launcher:
    """0.4's path of :func:`torchrunx.launcher_from_args`: the launcher the options describe.

    Args:
        args: What ``parser.parse_args()`` returned.

    Returns:
        A launcher with the parsed fields.
    """
    _renamed("launcher_from_args", "torchrunx.launcher_from_args(args)")
    return cli.launcher_from_args(args)
