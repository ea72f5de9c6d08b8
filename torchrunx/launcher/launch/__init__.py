"""One launch as it happens, read top to bottom, and the parts it is made of.

:class:`~torchrunx.launcher.launch.orchestrator.Launch` decides: start, hellos, specs, monitor,
restart or not, collect, stop. It holds three parts, composed, each with its own job:
:mod:`~torchrunx.launcher.launch.session` (the launch's parts, opened and closed together, and
its one loop), :mod:`~torchrunx.launcher.launch.replace` (failed hosts between attempts) and
:mod:`~torchrunx.launcher.launch.dispatch` (what the workers are sent, their results).
:mod:`~torchrunx.launcher.launch.inbox` applies what arrives to the state;
:mod:`~torchrunx.launcher.launch.preempt` handles SIGTERM with a grace period.

It is the top of the launcher's packages but one: it drives :mod:`torchrunx.launcher.starts`,
:mod:`torchrunx.launcher.net`, :mod:`torchrunx.launcher.view` and the pure
:mod:`torchrunx.launcher.state`; only the entry points of :mod:`torchrunx.launcher` import it.
"""
