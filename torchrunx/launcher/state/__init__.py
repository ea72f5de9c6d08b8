"""The launch's state and its decisions: pure code, no socket, no process, no clock of its own.

:class:`~torchrunx.launcher.state.state.LaunchState` is the launch around its attempt, made of
two parts that own their data (:mod:`~torchrunx.launcher.state.agent_table`: every agent and
the world; :mod:`~torchrunx.launcher.state.attempt`: the attempt's ranks and faults), with the
records and the moves allowed (:mod:`~torchrunx.launcher.state.records`). Beside them: which
failure is the cause and whether it restarts (:mod:`~torchrunx.launcher.state.failures`), the
error raised (:mod:`~torchrunx.launcher.state.reports`), the next world
(:mod:`~torchrunx.launcher.state.spares`), a stall's diagnosis
(:mod:`~torchrunx.launcher.state.hangs`), the health report
(:mod:`~torchrunx.launcher.state.health`) and the results
(:mod:`~torchrunx.launcher.state.results`).

It reads :mod:`torchrunx.launcher.settings` and nothing else of the launcher; the launch
(:mod:`torchrunx.launcher.launch`) applies what arrives to it through its methods.
"""
