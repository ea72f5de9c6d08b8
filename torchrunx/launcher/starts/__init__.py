"""Agents started and ended, on the launcher's side (how, per host, is :mod:`torchrunx.engines`).

:mod:`~torchrunx.launcher.starts.agent_starts` makes one host's start: its script, its
bootstrap line and the address it calls back on, handed to the host's transport (made once per
launch); and where the launcher listens. :mod:`~torchrunx.launcher.starts.agent_pool` runs the
starts on a small pool of threads, replaces an agent, notices the agents' ends and closes them,
each as an event for the launch's loop.

It imports the settings, the records of :mod:`torchrunx.launcher.state`, the listener of
:mod:`torchrunx.launcher.net` and the transports of :mod:`torchrunx.engines`.
"""
