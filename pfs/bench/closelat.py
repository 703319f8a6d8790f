"""``pfs bench close``: what a durable close costs. A file is written and closed in a
directory whose files are durable (close returns once every replica holds the data on
stable storage) and in one set to ``--no-sync`` (scratch: close commits the size only),
alternating, at each size; beside them a local file written then ``fsync``-ed then closed,
the same guarantee on one disk. Reported: the median write and close times and the
close-time ratios, all from one run."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from pfs.bench.common import (
    bench_main,
    cluster_for,
    fmt_size,
    log,
    machine_info,
    median,
    parse_size,
    random_buffer,
    ratio,
    table,
    work_dir,
)

TARGETS = ("durable", "scratch", "local_fsync")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cluster directory: use (or start) the cluster there")
    p.add_argument("--config", help="client.toml of a running cluster to use")
    p.add_argument("--sizes", default="1M,64M", help="file sizes (default 1M,64M)")
    p.add_argument("--reps", type=int, default=5, help="repetitions; medians (default 5)")
    p.add_argument("--count", type=int, default=4, help="stripe count (default 4)")
    p.add_argument("--unit", type=parse_size, default=1 << 20, help="stripe unit (default 1M)")
    p.add_argument("--data-servers", type=int, default=4)
    p.add_argument("--local-dir", help="scratch space (local reference, own cluster)")
    p.add_argument("--quick", action="store_true", help="1M only, 2 reps")
    p.add_argument("--json", help="write all results here")


def _pfs_once(c: Any, path: str, data: memoryview) -> tuple[float, float]:
    f = c.open(path, "wb")
    t0 = time.perf_counter()
    f.write(data)
    t1 = time.perf_counter()
    f.close()
    t2 = time.perf_counter()
    c.remove(path)
    return t1 - t0, t2 - t1


def _local_once(path: Path, data: memoryview) -> tuple[float, float]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    off = 0
    while off < len(data):
        off += os.write(fd, data[off:])
    t1 = time.perf_counter()
    os.fsync(fd)
    os.close(fd)
    t2 = time.perf_counter()
    os.unlink(path)
    return t1 - t0, t2 - t1


def run(args: argparse.Namespace) -> dict[str, Any]:
    import pfs

    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if args.quick:
        sizes, args.reps = sizes[:1], min(args.reps, 2)
    with work_dir(args.local_dir, "pfs-bench-close-") as wd, \
            cluster_for(args, wd, args.data_servers) as cut:
        result: dict[str, Any] = {"bench": "close", "machine": machine_info(wd),
                                  "config": {"sizes": sizes, "reps": args.reps,
                                             "stripe_count": args.count,
                                             "stripe_unit": args.unit}, "points": []}
        with pfs.connect(config=cut.client_toml) as c:
            base = f"/bench-close-{os.getpid()}"
            for name, durable in (("durable", True), ("scratch", False)):
                c.makedirs(f"{base}/{name}", exist_ok=True)
                c.set_layout(f"{base}/{name}", count=args.count, unit=args.unit,
                             durable=durable)
            try:
                for size in sizes:
                    data = memoryview(random_buffer(size))
                    times: dict[str, list[tuple[float, float]]] = {t: [] for t in TARGETS}
                    for rep in range(args.reps):
                        log(f"{fmt_size(size)} rep {rep + 1}/{args.reps}")
                        for name in ("durable", "scratch"):
                            times[name].append(_pfs_once(c, f"{base}/{name}/f{rep}", data))
                        times["local_fsync"].append(_local_once(wd / "local.bin", data))
                    for name, v in times.items():
                        result["points"].append({
                            "size": size, "target": name,
                            "write_ms": median([w for w, _ in v]) * 1e3,
                            "close_ms": median([cl for _, cl in v]) * 1e3,
                            "close_ms_all": [round(cl * 1e3, 2) for _, cl in v]})
            finally:
                for name in ("durable", "scratch"):
                    c.rmdir(f"{base}/{name}")
                c.rmdir(base)
    return result


def report(res: dict[str, Any]) -> str:
    pts = res["points"]
    rows = [[fmt_size(p["size"]), p["target"], f"{p['write_ms']:.1f}", f"{p['close_ms']:.2f}"]
            for p in pts]
    lines = [f"pfs bench close: write then close, medians of {res['config']['reps']}; "
             "durable = close syncs every replica (default), scratch = --no-sync, "
             "local_fsync = a local file's fsync + close",
             table(rows, ["size", "target", "write ms", "close ms"]), "", "ratios (close):"]
    by = {(p["size"], p["target"]): p["close_ms"] for p in pts}
    for size in sorted({p["size"] for p in pts}):
        lines.append(f"  {fmt_size(size)}: durable/scratch "
                     f"{ratio(by[(size, 'durable')], by[(size, 'scratch')]):.1f}x, "
                     f"durable/local_fsync "
                     f"{ratio(by[(size, 'durable')], by[(size, 'local_fsync')]):.2f}x")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return bench_main("close", __doc__, add_args, run, report, argv)
