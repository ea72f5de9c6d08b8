"""The commands that look at launches: ``torchrunx logs``, ``torchrunx report``, ``torchrunx top``.

They read what a launch leaves or serves (its log folder and events file, its view socket) and
never change a launch; :mod:`torchrunx.cli` dispatches to their ``main``.
"""
