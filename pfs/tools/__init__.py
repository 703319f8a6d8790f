"""The tools: the ``pfs`` command, local clusters, the demo, certificates, the server process helper."""
