#!/usr/bin/env bash
# The main job on a fresh machine: install, start a local cluster on loopback (a
# metaserver and 4 data servers), write a real workload, read it back, print the result.
#   ./deploy/quickstart.sh [DIR]      (default DIR: /tmp/pfs-demo)
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
exec .venv/bin/pfs demo --dir "${1:-/tmp/pfs-demo}"
