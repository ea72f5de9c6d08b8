"""The launcher side: everything that runs in the caller's process.

The settings (:mod:`~torchrunx.launcher.launcher`), the launch that starts the agents, reads
their messages and decides (:mod:`~torchrunx.launcher.launch.orchestrator`,
:mod:`~torchrunx.launcher.state.state`), warm agents, the health endpoint, events and results.
Agents and workers never import this package.
"""
