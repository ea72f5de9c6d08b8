"""The launcher side: everything that runs in the caller's process.

This folder holds the entry points: :mod:`~torchrunx.launcher.launcher` (``Launcher``: its
fields and their checks, ``plan``, ``run``, ``warm``, ``dry_run``), :mod:`~torchrunx.launcher.warm`
(warm agents), :mod:`~torchrunx.launcher.submit` (a launch in a SLURM batch job),
:mod:`~torchrunx.launcher.dryrun` (the dry run's text) and :mod:`~torchrunx.launcher.preflight`
(``torchrunx check``). The parts of a launch are its sub-packages, each importing only those
below it:

- :mod:`~torchrunx.launcher.launch`: one launch as it happens (``Launch``, its parts, the inbox);
- :mod:`~torchrunx.launcher.view`: what you see while it runs (logs, ``/health``, pdb, stacks);
- :mod:`~torchrunx.launcher.starts`: agents started and ended;
- :mod:`~torchrunx.launcher.net`: the loop and the connections;
- :mod:`~torchrunx.launcher.state`: the launch's state and its decisions (pure);
- :mod:`~torchrunx.launcher.settings`: the settings, resolved once.

Under them: :mod:`torchrunx.plugins`, :mod:`torchrunx.engines` (how an agent starts on a host)
and :mod:`torchrunx.hosts`. Agents and workers never import this package.
"""
