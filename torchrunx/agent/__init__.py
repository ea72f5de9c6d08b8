"""The host side: the agent of every host of a launch, started by the launcher, and its fork.

The guardian (:mod:`~torchrunx.agent.guardian`), the agent (:mod:`~torchrunx.agent.agent`;
its module docstring lists its parts: its link to the launcher, its attempts, its worker
group, watchdog and store), and the fork of each worker (:mod:`~torchrunx.agent.workerprocess`),
up to the point where the child runs :mod:`torchrunx.worker` (the worker side, which this
package imports and which never imports it). Beside the agent, what a host runs instead of it:
a relaying host's end (:mod:`~torchrunx.agent.relay`), ``torchrunx check``'s probe
(:mod:`~torchrunx.agent.probe`), and the unpacking of shipped code before torchrunx is
importable (:mod:`~torchrunx.agent.unpack`). Nothing here imports :mod:`torchrunx.launcher`,
:mod:`torchrunx.engines` or :mod:`torchrunx.hosts`; ``tests/test_layout.py`` checks it.
"""
