#!/usr/bin/env bash
# Old vs new code on one machine, alternated: 3 repetitions of `pfs bench throughput`, `meta`,
# `fuse` and `iops`, each version run from its own checkout (PYTHONPATH) with one venv.
#   docs/ab/run.sh OLD_CHECKOUT NEW_CHECKOUT OUTDIR [PYTHON]
# then: python3 docs/ab/compare.py OUTDIR   (medians, spreads, new/old)
set -u
OLD=$1; NEW=$2; OUT=$3; P=${4:-.venv/bin/python}
P=$(realpath "$P"); mkdir -p "$OUT"
# the CLI's module moved with the package layout
cli() { if [ -f "$1/pfs/tools/cli.py" ]; then echo pfs.tools.cli; else echo pfs.cli; fi; }
for rep in 1 2 3; do
  for ver in base new; do
    if [ $ver = base ]; then T=$OLD; else T=$NEW; fi
    M=$(cli "$T")
    ( cd "$T"; export PYTHONPATH=$PWD
      $P -m $M bench throughput --size 512M --reps 1 --no-cold --json $OUT/$ver-tp-$rep.json > $OUT/$ver-tp-$rep.txt 2>&1
      $P -m $M bench meta --files 600 --clients 1,4 --lmdb-ops 200 --json $OUT/$ver-meta-$rep.json > $OUT/$ver-meta-$rep.txt 2>&1
      $P -m $M bench fuse --mb 256 --nfiles 400 --reps 1 --targets mount,native --json $OUT/$ver-fuse-$rep.json > $OUT/$ver-fuse-$rep.txt 2>&1
      $P -m $M bench iops --file-size 64M --seconds 0.5 --qd 1,32 --json $OUT/$ver-iops-$rep.json > $OUT/$ver-iops-$rep.txt 2>&1
    )
    echo "rep $rep $ver done $(date +%T)"
  done
done
