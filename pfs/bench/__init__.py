"""Benchmarks: ``pfs bench throughput | meta | fuse | io500 | sweep | caps | wire | loader | iops | close |
failover | repair | kvcache``.

Every benchmark measures its references in the same run (local file, loopback socket,
raw LMDB, MooseFS), because shared machines are noisy and only same-run ratios mean much.
See docs/benchmarks.md for what each figure means and for figures from real runs.
"""
from __future__ import annotations

import sys

USAGE = """usage: pfs bench {throughput,meta,fuse,io500,io500-peers,sweep,caps,wire,loader,iops,close,failover,repair,kvcache} [options]   (-h after a subcommand for its options)

  throughput  native-client sequential write/read of a striped file vs a local file
              and a loopback socket
  meta        creates/stats/unlinks per second, 1 and N client processes, vs raw LMDB
  fuse        dd write / cold read and create/stat/unlink on a pfs mount, the native client,
              a local dir and a MooseFS mount, in one run
  io500       the twelve IO500 phases and score on a directory or the native client
  io500-peers the reference IO500 harness on several file systems (LABEL=PATH ...),
              interleaved, medians and ratios to the first
  sweep       data paths: engines x block sizes x patterns x threads, local/native/mount
  caps        1 MiB and 4 KiB reads/s with capability checks on and off
  wire        wire security: MAC/AEAD primitives, sealed frames, and 1 MiB / 4 KiB reads
              with frames plain, MAC'd, encrypted and over TLS (CPU us per read, GB/s/core)
  loader      sharded safetensors checkpoint into CPU tensors: pfs loader (short-circuit
              on/off, local), safetensors local, FUSE; warm and cold
  iops        4 KiB random reads: IOPS, p50/p99, posix/uring at queue depths 1/8/32,
              local file, network path and short-circuit
  close       write + close latency: durable close vs --no-sync (scratch) vs a local
              file's fsync, at 1 MiB and 64 MiB
  failover    reads of a 2-replica file while one replica is stopped (SIGSTOP) or
              killed: time to the first read served, longest read, time to `down`
  kvcache     KV-cache blocks (16K/256K/2M) put and got by 1/4/16 processes: node tier,
              data server, beside redis-server and a local-directory file store
"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], list(argv[1:])
    if cmd == "throughput":
        from pfs.bench.throughput import main as run
    elif cmd == "meta":
        from pfs.bench.meta import main as run
    elif cmd == "fuse":
        from pfs.bench.fusebench import main as run
    elif cmd == "caps":
        from pfs.bench.caps import main as run
    elif cmd == "wire":
        from pfs.bench.wire import main as run
    elif cmd == "io500":
        from pfs.bench.io500 import main as run
    elif cmd == "io500-peers":
        from pfs.bench.io500peers import main as run
    elif cmd == "sweep":
        from pfs.bench.sweep import main as run
    elif cmd == "loader":
        from pfs.bench.loader import main as run
    elif cmd == "iops":
        from pfs.bench.iops import main as run
    elif cmd == "close":
        from pfs.bench.closelat import main as run
    elif cmd == "failover":
        from pfs.bench.failover import main as run
    elif cmd == "repair":
        from pfs.bench.repair import main as run
    elif cmd == "kvcache":
        from pfs.bench.kvcache import main as run
    else:
        print(f"pfs bench: unknown benchmark {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)
