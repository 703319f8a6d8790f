"""``python -m pfs.bench ...``: what ``pfs bench ...`` runs (in the ``pfs`` process's place)."""
from __future__ import annotations

import logging
import sys

from pfs.bench import main
from pfs.tools.cli import _sigterm_unwinds


def run(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # a SIGTERM unwinds like Ctrl-C: the clusters and mounts a benchmark started stop
    _sigterm_unwinds()
    try:
        return main(argv)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
