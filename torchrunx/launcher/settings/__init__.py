"""The launch's settings, resolved once: what the rest of the launcher reads.

:mod:`~torchrunx.launcher.settings.plan` owns :class:`LaunchPlan` (the fields of a
:class:`~torchrunx.Launcher` resolved and frozen, in groups);
:mod:`~torchrunx.launcher.settings.environ` the environment variables, read once into the plan;
:mod:`~torchrunx.launcher.settings.resolve`
what ``hostnames`` and ``workers_per_host`` name (through the host providers of
:mod:`torchrunx.plugins`); :mod:`~torchrunx.launcher.settings.reach` each remote host's
interpreter, ``sys.path`` and shipped code; :mod:`~torchrunx.launcher.settings.renamed` the
keywords of earlier releases, refused with their replacement.

It imports :mod:`torchrunx.hosts`, :mod:`torchrunx.plugins` and :mod:`torchrunx.engines` (the
layers below), and nothing else of the launcher: every other launcher package reads it.
"""
