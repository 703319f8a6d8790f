#!/usr/bin/env bash
# Install everything, check the code with ruff and mypy, then run the whole test suite:
# every tier (unit, integration: real servers on loopback and real LMDB, mount: real FUSE
# mounts, which need root and /dev/fuse). `pytest -m unit` etc. run one tier.
#   ./deploy/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
# ruff and mypy come with the dev extra that setup.sh installed
echo "test: ruff" >&2
.venv/bin/ruff check pfs metaserver dataserver fuse tests
echo "test: mypy" >&2
.venv/bin/mypy pfs tests
# setup.sh installed Open MPI and mpi4py: the two-rank io500 test must run, not skip
export PFS_REQUIRE_MPI=1
# setup.sh installed the engines' interface modules: the adapter tests must run, not skip
export PFS_REQUIRE_ENGINES=1
# ... and the reference loaders of pfs bench loader (the loaders extra)
export PFS_REQUIRE_LOADERS=1
echo "test: pytest" >&2
exec .venv/bin/python -m pytest "$@"
