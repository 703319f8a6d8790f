#!/usr/bin/env bash
# Install what pfs needs on a fresh Debian/Ubuntu machine, idempotently:
# system packages (FUSE 3 and the headers pyfuse3 builds against; Open MPI for the
# multi-rank `pfs bench io500`), a virtualenv in .venv, and the project with its fuse, dev,
# mpi and loaders extras, and the inference engines' interface modules (adapter tests).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v fusermount3 >/dev/null || need_apt+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need_apt+=(libfuse3-dev)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
dpkg -s python3-venv >/dev/null 2>&1 || python3 -m venv --help >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v rsync >/dev/null || need_apt+=(rsync)
command -v git >/dev/null || need_apt+=(git)
command -v strace >/dev/null || need_apt+=(strace)  # tests compare system-call sequences with mdtest's
command -v mpirun >/dev/null || need_apt+=(openmpi-bin)
dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  echo "setup: installing ${need_apt[*]} with apt-get" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.pfs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ deploy/engines-interfaces.txt -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/pip install -q -e '.[fuse,dev,mpi,loaders]'
  # LMCache's and SGLang's interface modules, without their GPU dependency trees
  .venv/bin/pip install -q --no-deps -r deploy/engines-interfaces.txt
  touch "$stamp"
fi
