#!/usr/bin/env bash
# Build the reference IO500 harness (IO500/io500 with hpc/ior's IOR and mdtest, and
# VI4IO/pfind) from source trees already on disk: nothing is downloaded. IO500's own
# prepare.sh clones the three repositories from the internet; this does its build steps on
# the given directories instead.
#
#   ./deploy/io500-reference.sh IO500_SRC IOR_SRC PFIND_SRC [DEST]
#
# IO500_SRC  a checkout (or `git archive` export) of https://github.com/IO500/io500
# IOR_SRC    of https://github.com/hpc/ior  (prepare.sh pins IOR_HASH; use that commit)
# PFIND_SRC  of https://github.com/VI4IO/pfind
# DEST       where the build goes (default ./io500-reference); the harness ends up as
#            DEST/io500/io500 (pass it to `pfs bench io500 --compare --reference ...`)
#
# Requirements: a C compiler, Open MPI (mpicc, mpirun), make, and autoconf, automake,
# libtool for IOR's ./bootstrap (apt-get install autoconf automake libtool
# libopenmpi-dev openmpi-bin). The sources are copied, never modified in place.
set -euo pipefail

if [ $# -lt 3 ]; then
  sed -n '2,17p' "$0" >&2
  exit 2
fi
IO500_SRC=$(realpath "$1")
IOR_SRC=$(realpath "$2")
PFIND_SRC=$(realpath "$3")
DEST=$(realpath -m "${4:-io500-reference}")
JOBS=${NPROC:-$(nproc 2>/dev/null || echo 2)}

for tool in mpicc make autoconf automake libtoolize; do
  command -v "$tool" >/dev/null || {
    echo "io500-reference: $tool is missing (apt-get install autoconf automake libtool" \
         "libopenmpi-dev openmpi-bin)" >&2
    exit 1
  }
done
for d in "$IO500_SRC/src" "$IOR_SRC/src" "$PFIND_SRC/src"; do
  [ -d "$d" ] || { echo "io500-reference: $d is not a directory" >&2; exit 1; }
done

mkdir -p "$DEST"
# io500's Makefile expects ./build/ior and ./build/pfind beside its own sources
rm -rf "$DEST/io500"
cp -a "$IO500_SRC" "$DEST/io500"
mkdir -p "$DEST/io500/build" "$DEST/io500/bin"
rm -rf "$DEST/io500/build/ior" "$DEST/io500/build/pfind"
cp -a "$IOR_SRC" "$DEST/io500/build/ior"
cp -a "$PFIND_SRC" "$DEST/io500/build/pfind"

echo "io500-reference: building IOR and mdtest" >&2
(
  cd "$DEST/io500/build/ior"
  ./bootstrap >/dev/null
  ./configure --prefix="$DEST/io500" >/dev/null
  cd src
  make -j"$JOBS" >/dev/null
  make install >/dev/null
)

echo "io500-reference: building pfind (without lz4: prepare.sh would download it)" >&2
(
  cd "$DEST/io500/build/pfind"
  ./compile.sh >/dev/null
  ln -sf "$DEST/io500/build/pfind/pfind" "$DEST/io500/bin/pfind"
)

echo "io500-reference: building io500" >&2
(
  cd "$DEST/io500"
  # the Makefile asks git for its version; a `git archive` export has none, so name it
  version=$(git -C "$IO500_SRC" describe --always --abbrev=12 2>/dev/null || echo export)
  make -j"$JOBS" VERSION_GIT="$version" VERSION_TREE= >/dev/null
)
echo "io500-reference: built $DEST/io500/io500" >&2
echo "$DEST/io500/io500"
