#!/usr/bin/env bash
# Install everything, then run the whole test suite (real servers on loopback, real
# LMDB, real FUSE mounts: needs root and /dev/fuse for the mount tests).
#   ./deploy/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
# setup.sh installed Open MPI and mpi4py: the two-rank io500 test must run, not skip
export PFS_REQUIRE_MPI=1
exec .venv/bin/python -m pytest "$@"
