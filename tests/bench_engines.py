"""Engine micro-benchmark (not a test): posix vs uring on one local file.

    python tests/bench_engines.py [--size 512M] [--file PATH] [--seconds 2]

Reads a file (page cache warm unless --direct) in large batched ops, and 4 KiB random
reads at queue depths 1, 8, 32 from as many trio tasks; prints GB/s, IOPS, p50/p99 latency
and CPU seconds per GB.
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time

import trio

from pfs.engine import Op, aligned_buffer, get_engine


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def seq(engine_name: str, fd: int, size: int, op_size: int, qd: int, rounds: int,
              direct: bool, **opts: int) -> tuple[float, float]:
    eng = get_engine(engine_name, queue_depth=qd, **opts)
    buf = aligned_buffer(size) if direct else memoryview(bytearray(size))
    best, cpus = 0.0, 0.0
    for _ in range(rounds):
        ops = [Op(fd, off, min(op_size, size - off), buf[off:off + op_size])
               for off in range(0, size, op_size)]
        t0, c0 = time.perf_counter(), cpu()
        counts = await eng.submit(ops)
        dt, dc = time.perf_counter() - t0, cpu() - c0
        assert sum(counts) == size
        if size / dt > best:
            best, cpus = size / dt, dc
    eng.close()
    return best / 1e9, cpus / (size / 1e9)


async def rand4k(engine_name: str, fd: int, size: int, qd: int, seconds: float,
                 direct: bool) -> tuple[float, float, float]:
    eng = get_engine(engine_name, queue_depth=qd)
    lat: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        buf = aligned_buffer(4096) if direct else memoryview(bytearray(4096))
        blocks = size // 4096
        while time.perf_counter() < deadline:
            off = rng.randrange(blocks) * 4096
            t0 = time.perf_counter()
            await eng.read_into(fd, off, buf)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        for i in range(qd):
            n.start_soon(worker, i)
    dt = time.perf_counter() - t0
    eng.close()
    q = statistics.quantiles(lat, n=100)
    return len(lat) / dt, q[49] * 1e6, q[98] * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--file", default="/tmp/pfs-bench-engines.bin")
    p.add_argument("--size", type=int, default=512 << 20)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--direct", action="store_true")
    args = p.parse_args()
    if not os.path.exists(args.file) or os.path.getsize(args.file) < args.size:
        with open(args.file, "wb") as f:
            for _ in range(args.size >> 20):
                f.write(os.urandom(1 << 20))
    flags = os.O_RDONLY | (os.O_DIRECT if args.direct else 0)
    fd = os.open(args.file, flags)
    os.pread(fd, 1, 0) if not args.direct else None
    print(f"file {args.file} {args.size >> 20} MiB, direct={args.direct}, cpus={os.cpu_count()}")
    for op_size in (1 << 20, 4 << 20):
        for name in ("posix", "uring"):
            gbs, cpg = trio.run(seq, name, fd, args.size, op_size, 32, 3, args.direct)
            print(f"seq  {name:6s} op {op_size >> 20} MiB qd 32: {gbs:6.2f} GB/s, "
                  f"{cpg:5.3f} CPU s/GB")
    for qd in (1, 8, 32):
        for name in ("posix", "uring"):
            iops, p50, p99 = trio.run(rand4k, name, fd, args.size, qd, args.seconds, args.direct)
            print(f"4k   {name:6s} qd {qd:2d}: {iops:9.0f} IOPS, p50 {p50:7.1f} us, "
                  f"p99 {p99:7.1f} us")
    os.close(fd)


if __name__ == "__main__":
    main()
