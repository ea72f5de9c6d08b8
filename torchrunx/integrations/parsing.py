"""``torchrunx.integrations.parsing``: how 0.4's documentation spelled :mod:`.cli`.

Its names are those of :mod:`torchrunx.integrations.cli`, with the same warnings.
"""

from torchrunx.integrations.cli import add_torchrunx_argument_group, launcher_from_args

__all__ = ["add_torchrunx_argument_group", "launcher_from_args"]
