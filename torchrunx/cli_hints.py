"""Options the ``torchrunx`` command refuses, each with what to write instead.

Two kinds: keywords of earlier torchrunx releases (``--worker-timeout``: their message is
:data:`torchrunx.launcher.settings.renamed.RENAMED_FIELDS`'s, with the new option), and
``torchrun``'s options. Users bring ``torchrun`` habits (``--nproc-per-node=8``,
``--standalone``, ``--tee 3``): each of torchrun's options, in both spellings
(``--nproc-per-node`` and ``--nproc_per_node``), is a hidden option whose use is an error naming
torchrunx's counterpart, with the value carried over where there is one (``--nproc-per-node 8``:
``--workers-per-host 8``). :data:`TORCHRUN_OPTIONS` is the one table of them
(``tests/test_cli.py`` checks that docs/migrating.md lists each).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True)
class TorchrunOption:
    """One of torchrun's options and what takes its place here."""

    names: tuple[str, ...]
    """Its spellings, without the dashes (``nproc-per-node``...); ``_`` forms are added."""
    instead: str
    """What to write here; ``{value}`` is the value the user gave (or ``N``)."""
    takes_value: bool = True


TORCHRUN_OPTIONS: tuple[TorchrunOption, ...] = (
    TorchrunOption(("nproc-per-node",), "--workers-per-host {value} (one count, or one per host)"),
    TorchrunOption(
        ("nnodes",),
        "--hostnames NODE1 NODE2 ... (the hosts, listed once; inside a SLURM allocation its "
        "nodes are the default)",
    ),
    TorchrunOption(("standalone",), "--hostnames localhost", takes_value=False),
    TorchrunOption(("node-rank",), "nothing: hosts are numbered in the order of --hostnames"),
    TorchrunOption(
        ("rdzv-backend", "rdzv-endpoint", "rdzv-id", "rdzv-conf", "master-addr", "master-port"),
        "nothing: there is no rendezvous; the launcher assigns every rank, MASTER_ADDR and "
        "MASTER_PORT",
    ),
    TorchrunOption(
        ("tee", "local-ranks-filter"),
        "--console-ranks all (every rank's output on the console; chosen ranks: "
        "--console-ranks 0 3)",
    ),
    TorchrunOption(
        ("log-dir", "redirects"),
        "nothing: every worker's output goes to its own file under ./torchrunx_logs "
        "(TORCHRUNX_LOG_DIR moves it)",
    ),
    TorchrunOption(
        ("monitor-interval",),
        "nothing: a worker's death is seen at once, a lost host within --agent-timeout",
    ),
    TorchrunOption(("start-method",), "nothing: workers are forked by the agent on their host"),
    TorchrunOption(
        ("no-python", "run-path"),
        "nothing: workers run Python (a script, -m module or module:function after --)",
        takes_value=False,
    ),
    TorchrunOption(("max_restarts",), "--max-restarts {value}"),
)
"""torchrun's options (``torchrun --help``, PyTorch 2.x), each with its counterpart."""


class _TorchrunOption(argparse.Action):
    """A torchrun option: its use is an error that names what to write instead."""

    def __init__(self, *args: object, instead: str, **kwargs: object) -> None:
        """An action refusing the option with ``instead`` (see :class:`TorchrunOption`)."""
        self.instead = instead
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # argparse's own arguments

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> NoReturn:
        """Refuse the option, naming the counterpart (with the value given, if any)."""
        del parser, namespace, option_string
        value = values if isinstance(values, str) else "N"
        raise argparse.ArgumentError(
            self, "torchrun's option; with torchrunx write " + self.instead.format(value=value)
        )


def add_torchrun_options(parser: argparse.ArgumentParser) -> None:
    """Add torchrun's options to ``parser``, hidden, each an error naming its counterpart."""
    known = parser._option_string_actions  # noqa: SLF001 (only options this parser lacks)
    for option in TORCHRUN_OPTIONS:
        for name in option.names:
            strings = [s for s in {f"--{name}", f"--{name.replace('-', '_')}"} if s not in known]
            if not strings:
                continue
            parser.add_argument(
                *sorted(strings),
                action=_TorchrunOption,
                instead=option.instead,
                nargs="?" if option.takes_value else 0,
                dest=f"torchrun_{name.replace('-', '_')}",
                help=argparse.SUPPRESS,
            )


def hint_lines() -> list[str]:
    """The table as Markdown rows (``| torchrun | torchrunx |``), for docs/migrating.md."""
    rows = []
    for option in TORCHRUN_OPTIONS:
        names = ", ".join(f"`--{name}`" for name in option.names)
        rows.append(f"| {names} | {option.instead.format(value='N')} |")
    return rows


class _Renamed(argparse.Action):
    """An option of an earlier torchrunx (``--worker-timeout``): its error names the new one."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object, **__: object) -> NoReturn:
        """Refuse the option, with what replaced it (``Launcher``'s message for the keyword)."""
        from torchrunx.launcher.settings.renamed import RENAMED_FIELDS  # noqa: PLC0415 (workers import this module)

        message = RENAMED_FIELDS[self.dest]
        if new := re.search(r"use (\w+)=", message):
            option = "--" + new[1].replace("_", "-")
            known = option in parser._option_string_actions  # noqa: SLF001
            message += f"; on the command line: {option}" if known else " (no command-line option)"
        raise argparse.ArgumentError(self, message)


def add_renamed_options(group: argparse._ArgumentGroup) -> None:
    """Hidden options of earlier releases (``--worker-timeout``): each an error naming the new.

    Args:
        group: Where :func:`add_launcher_arguments` put the launcher's options.
    """
    from torchrunx.launcher.settings.renamed import RENAMED_FIELDS  # noqa: PLC0415 (workers import this module)

    for name in RENAMED_FIELDS:  # keywords of earlier releases, for a clear error
        option = "--" + name.replace("_", "-")
        group.add_argument(option, action=_Renamed, nargs="*", dest=name, help=argparse.SUPPRESS)
