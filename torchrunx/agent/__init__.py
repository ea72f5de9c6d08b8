"""The host side: what runs on every host of a launch, started by the launcher.

The guardian (:mod:`~torchrunx.agent.guardian`), the agent (:mod:`~torchrunx.agent.agent`;
its module docstring lists its parts: its link to the launcher, its attempts, its worker
group, watchdog and store), and the workers (:mod:`~torchrunx.agent.worker`). Nothing
here imports :mod:`torchrunx.launcher` or :mod:`torchrunx.hosts`; ``tests/test_layout.py``
checks it.
"""
