"""Tree start's host side (``Launcher(tree_radix=k)``): an interior host starts its children.

An interior host runs the relay (:mod:`torchrunx.agent.relay`), which holds a
:class:`~torchrunx.agent.tree.starts.TreeStarts`: where its children reach it (one listening
socket per address on its routes to them) and their starts over SSH, with their output and
their ends sent to the launcher as TREE frames. See docs/how_it_works.md, "Tree start".
"""
