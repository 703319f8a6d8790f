"""The tools: the ``pfs`` command, local clusters, the demo, certificates."""
