"""What you see while a launch runs: its logs, ``/health``, the debugger, a look at the stacks.

:mod:`~torchrunx.launcher.view.logrouter` hands every forwarded line to the log handlers and
keeps the output tails; :mod:`~torchrunx.launcher.view.logdirs` makes the log folders and the
events file; :mod:`~torchrunx.launcher.view.health_server` serves ``GET /health`` (the report
is :mod:`torchrunx.launcher.state.health`'s); :mod:`~torchrunx.launcher.view.debugger` shares
the terminal with the ranks in pdb; :mod:`~torchrunx.launcher.view.where` prints every rank's
stacks on SIGQUIT, grouped.

It reads the state (:mod:`torchrunx.launcher.state`) and the loop
(:mod:`torchrunx.launcher.net`); the launch (:mod:`torchrunx.launcher.launch`) drives it.
The dry run and ``torchrunx check``, which you call yourself, are entry points of
:mod:`torchrunx.launcher`.
"""
