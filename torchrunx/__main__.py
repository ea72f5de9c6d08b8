"""``python -m torchrunx``: the ``torchrunx`` command (see :func:`torchrunx.cli.main`)."""

from torchrunx.cli import main

raise SystemExit(main())
