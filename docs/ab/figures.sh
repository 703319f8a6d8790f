#!/usr/bin/env bash
# The quiet figures of docs/benchmarks.md, one part after another (never two at once, and
# nothing else running): docs/ab/figures.sh OUTDIR [PART...]
#   parts: kv kvhuge meta loader fuse io500ext4 io500mnt peers (default: all, ~16 min)
#   env: PFS (the pfs CLI, default .venv/bin/pfs), PEERS (a folder with moosefs-up.sh and
#        moosefs-down.sh: fuse and peers are skipped without it), IO500 (the built
#        harness, deploy/io500-reference.sh; default /tmp/io500ref/io500/io500)
# io500mnt and peers share a cluster in /tmp/io500-pfs mounted at /tmp/io500-mnt; the
# script stops both at the end.
set -u
OUT=$1; shift
PARTS=${*:-kv kvhuge meta loader fuse io500ext4 io500mnt peers}
PFS=$(realpath "${PFS:-.venv/bin/pfs}")
PEERS=${PEERS:-}; IO500=${IO500:-/tmp/io500ref/io500/io500}
SIZES="-n 2 --easy-size 256m --easy-files 5000 --hard-files 2000 --hard-segments 10000 --stonewall 2"
mkdir -p "$OUT"
log() { echo "$(date -u +%T) $*" | tee -a "$OUT/times.txt"; }
mnt_up() {
  mountpoint -q /tmp/io500-mnt && return 0
  $PFS cluster up --dir /tmp/io500-pfs > "$OUT/cluster.txt" 2>&1
  mkdir -p /tmp/io500-mnt && $PFS mount /tmp/io500-mnt --config /tmp/io500-pfs/client.toml
}
for part in $PARTS; do
  if [ -z "$PEERS" ] && { [ $part = fuse ] || [ $part = peers ]; }; then
    log "skip $part: set PEERS to a folder with moosefs-up.sh"; continue
  fi
  log "start $part"; sync
  case $part in
    kv) $PFS bench kvcache --bytes 32m --max-ops 256 --json "$OUT/kv.json" > "$OUT/kv.txt" 2>&1 ;;
    kvhuge) mkdir -p /tmp/kvhuge; mountpoint -q /tmp/kvhuge || mount -t tmpfs -o mode=1777,huge=within_size,size=8g tmpfs /tmp/kvhuge
      $PFS bench kvcache --bytes 32m --max-ops 256 --backends node,local,file,redis --node-dir /tmp/kvhuge \
        --json "$OUT/kvhuge.json" > "$OUT/kvhuge.txt" 2>&1
      umount /tmp/kvhuge ;;
    meta) $PFS bench meta --json "$OUT/meta.json" > "$OUT/meta.txt" 2>&1 ;;
    loader) $PFS bench loader --size 1.25G --hidden 2048 --reps 3 --stability 3 --json "$OUT/loader.json" > "$OUT/loader.txt" 2>&1 ;;
    fuse) $PFS bench fuse --targets mount,moosefs --replicas 2 --mb 64 --nfiles 2000 --reps 3 --peers-dir "$PEERS" \
        --json "$OUT/fuse.json" > "$OUT/fuse.txt" 2>&1 ;;
    io500ext4) rm -rf /tmp/io500run; mkdir -p /tmp/io500run/ext4
      $PFS bench io500 --compare $SIZES --repeat 3 --reference "$IO500" --path /tmp/io500run/ext4 \
        --json "$OUT/io500ext4.json" > "$OUT/io500ext4.txt" 2>&1 ;;
    io500mnt) mnt_up
      $PFS bench io500 --compare $SIZES --repeat 3 --reference "$IO500" --path /tmp/io500-mnt \
        --json "$OUT/io500mnt.json" > "$OUT/io500mnt.txt" 2>&1 ;;
    peers) mnt_up; bash "$PEERS/moosefs-up.sh" /tmp/mfs > "$OUT/mfs.txt" 2>&1; mfssetgoal -r 2 /tmp/mfs >> "$OUT/mfs.txt" 2>&1
      mkdir -p /tmp/io500-mnt/io500 /tmp/mfs/io500
      $PFS bench io500-peers --reference "$IO500" $SIZES --repeat 3 pfs=/tmp/io500-mnt/io500 moosefs=/tmp/mfs/io500 \
        --json "$OUT/peers.json" > "$OUT/peers.txt" 2>&1
      bash "$PEERS/moosefs-down.sh" /tmp/mfs --purge >> "$OUT/mfs.txt" 2>&1 ;;
    *) echo "unknown part $part" >&2 ;;
  esac
  log "end $part rc=$?"
done
if mountpoint -q /tmp/io500-mnt; then umount -l /tmp/io500-mnt; fi
[ -d /tmp/io500-pfs ] && $PFS cluster down --dir /tmp/io500-pfs > /dev/null 2>&1
log done
