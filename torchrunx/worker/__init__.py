"""The worker side: what runs in a worker process, once its agent has forked it.

:mod:`~torchrunx.worker.worker` says hello on the worker's channel, joins the process group,
runs the function and sends its outcome (``trx.worker_cache``); :mod:`~torchrunx.worker.debugger`
is ``breakpoint()`` in a worker; :mod:`~torchrunx.worker.capture` turns ``logging`` records
into marked lines (the agent's own records too); :mod:`~torchrunx.worker.frameworks` sets what
training frameworks read; :mod:`~torchrunx.worker.hooks` runs code once ``torch`` is imported.

The fork itself, the agent's code until the child becomes a worker, is
:mod:`torchrunx.agent.workerprocess`. The agent imports this package, never the reverse, and
nothing here imports the launcher's side (:mod:`torchrunx.launcher`, :mod:`torchrunx.engines`,
:mod:`torchrunx.integrations`' command-line shim); ``tests/test_layout.py`` checks it.
"""
