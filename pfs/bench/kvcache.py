"""``pfs bench kvcache``: KV-cache blocks put and got by 1/4/16 client processes, at
16 KiB, 256 KiB and 2 MiB, through pfs's KV cache and beside two references, in one run:

- ``node``: pfs hits in this node's shared-memory tier (puts ``sync=False``: they return
  once the node tier holds the block; the homes are written behind, outside the timing);
- ``local``: pfs with no node tier, the block's home a data server on this host read by
  short-circuit: the client reads the record from the server's slab itself, located
  through the index the server publishes in shared memory (no request per get);
- ``server``: pfs with no node tier and no short-circuit: every get a request to the
  block's home data server (here on loopback, the path a remote home takes);
- ``redis``: redis-server (started here on loopback with a private dir and port, no
  persistence), SET/GET over one connection per process;
- ``file``: a local-directory store, one file per block (as LMCache's local-disk backend
  keeps them), on the filesystem of ``--local-dir``, read from the page cache.

Per cell: put and get p50/p99 latency, aggregate GB/s (bytes over the span from the first
start to the last end), GB/s per core (bytes over the CPU seconds of the clients and
of the servers: data servers or redis), and the clients' CPU microseconds per get. Every get checks the block's tag (process, index,
size): a wrong block counts as an error. Aims: pfs gets (local short-circuit, and server)
>= 2x Redis's GB/s at 256 KiB and up; node-tier get p50 within 1.5x a local file read's.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

from pfs.bench.common import (
    GB,
    bench_main,
    cluster_for,
    fmt_size,
    log,
    machine_info,
    proc_cpu,
    ratio,
    table,
    work_dir,
)
from pfs.bench.resp import Resp, redis_server

BACKENDS = ("node", "local", "server", "redis", "file")
SIZES = "16k,256k,2m"
PROCS = "1,4,16"
PFS = ("node", "local", "server")  # the backends that are pfs
SETTLE = 2.2  # seconds between the puts and the timed gets (a slab flush passes)
_TAG = struct.Struct("<IIQ")  # process, index, size: the first bytes of every block


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="client config of an existing cluster (default: start one)")
    p.add_argument("--dir", help="cluster directory: use (or start) the cluster there")
    p.add_argument("--data-servers", type=int, default=2)
    p.add_argument("--sizes", default=SIZES, help=f"block sizes (default {SIZES})")
    p.add_argument("--procs", default=PROCS, help=f"client processes (default {PROCS})")
    p.add_argument("--backends", default=",".join(BACKENDS), help=",".join(BACKENDS))
    p.add_argument("--bytes", default="64m",
                   help="bytes put (and got) per cell, all processes together (default 64m)")
    p.add_argument("--max-ops", type=int, default=512, help="ops per process per cell cap")
    p.add_argument("--local-dir", help="scratch space: the file store and a cluster")
    p.add_argument("--node-dir", default="/dev/shm",
                   help="where the node tier's folder goes (default /dev/shm; a tmpfs "
                        "mounted huge=within_size maps another process's blocks faster)")
    p.add_argument("--json", help="write all results here")


# -- one client process ------------------------------------------------------------
class _Store:
    """One backend as the worker drives it: put(key, view), get_into(key, out)."""

    def __init__(self, backend: str, conf: dict[str, Any]) -> None:
        self.backend = backend
        if backend in PFS:
            from pfs.kvcache import KVCache

            self.kv: Any = KVCache(conf["client_toml"], "bench-kv", node_dir=conf["node_dir"],
                                   node_tier_bytes=conf["node_bytes"] if backend == "node"
                                   else 0, short_circuit=backend != "server")
        elif backend == "redis":
            self.kv = Resp("127.0.0.1", conf["redis_port"])
        else:
            self.dir = Path(conf["file_dir"])

    def put(self, key: bytes, view: memoryview) -> None:
        if self.backend == "node":
            self.kv.put(key, view, sync=False)
        elif self.backend in PFS:
            self.kv.put(key, view)
        elif self.backend == "redis":
            self.kv.set(key, view)
        else:
            name = self.dir / key.hex()
            tmp = name.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(view)
            os.rename(tmp, name)

    def settle(self) -> None:
        if self.backend == "node":
            self.kv.flush()
        if self.backend in PFS:
            # the servers flush the slabs the puts wrote every SYNC_INTERVAL: let that
            # pass, or its CPU is counted to the gets (redis and the file store keep no
            # such work behind)
            time.sleep(SETTLE)

    def get_into(self, key: bytes, out: memoryview) -> int | None:
        if self.backend in PFS:
            return self.kv.get_into(key, out)  # type: ignore[no-any-return]
        if self.backend == "redis":
            return self.kv.get_into(key, out)  # type: ignore[no-any-return]
        try:
            with open(self.dir / key.hex(), "rb", buffering=0) as f:
                return f.readinto(out)  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def remove(self, keys: list[bytes]) -> None:
        if self.backend in PFS:
            self.kv.remove(keys)
        elif self.backend == "redis":
            self.kv.delete(keys)
        else:
            for k in keys:
                (self.dir / k.hex()).unlink(missing_ok=True)

    def close(self) -> None:
        if self.backend != "file":
            self.kv.close()


def _worker(rank: int, conf: dict[str, Any], barrier: Any, results: Any) -> None:
    stores = {b: _Store(b, conf) for b in conf["backends"]}
    try:
        for size, ops in conf["cells"]:
            data = bytearray(os.urandom(size))
            out = memoryview(bytearray(size))
            for b in conf["backends"]:
                st = stores[b]
                keys = [b"%s-%d-%d-%d" % (b.encode(), size, rank, i) for i in range(ops)]
                rec: dict[str, Any] = {"backend": b, "size": size, "rank": rank, "errors": 0}
                barrier.wait()
                lat = []
                c0, t0 = time.process_time(), time.perf_counter()
                for i, k in enumerate(keys):
                    _TAG.pack_into(data, 0, rank, i, size)
                    s = time.perf_counter()
                    st.put(k, memoryview(data))
                    lat.append(time.perf_counter() - s)
                rec.update(put=lat, put_span=(t0, time.perf_counter()),
                           put_cpu=time.process_time() - c0)
                st.settle()  # sync=False puts reach their homes (not timed)
                barrier.wait()
                lat = []
                c0, t0 = time.process_time(), time.perf_counter()
                for i, k in enumerate(keys):
                    s = time.perf_counter()
                    n = st.get_into(k, out)
                    lat.append(time.perf_counter() - s)
                    if n != size or _TAG.unpack_from(out) != (rank, i, size):
                        rec["errors"] += 1
                rec.update(get=lat, get_span=(t0, time.perf_counter()),
                           get_cpu=time.process_time() - c0)
                barrier.wait()
                st.remove(keys)
                results.put(rec)
                barrier.wait()
    finally:
        for st in stores.values():
            st.close()


# -- the run -------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _cell(recs: list[dict[str, Any]], cpu: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": recs[0]["backend"], "size": recs[0]["size"],
                           "procs": len(recs), "errors": sum(r["errors"] for r in recs)}
    for op in ("put", "get"):
        lat = [x for r in recs for x in r[op]]
        span = (max(r[f"{op}_span"][1] for r in recs) - min(r[f"{op}_span"][0] for r in recs))
        nbytes = len(lat) * out["size"]
        cores = sum(r[f"{op}_cpu"] for r in recs) + cpu[op]
        out[op] = {"ops": len(lat), "p50_us": _pct(lat, 0.5) * 1e6,
                   "p99_us": _pct(lat, 0.99) * 1e6,
                   "GBps": nbytes / span / GB if span > 0 else 0.0,
                   "cpu_s": cores, "client_cpu_s": cores - cpu[op],
                   "client_cpu_us_per_op": (cores - cpu[op]) / len(lat) * 1e6 if lat else 0.0,
                   "GBps_per_core": nbytes / cores / GB if cores > 0 else 0.0}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pfs.bench.common import parse_size
    from pfs.kvcache.nodetier import tmpfs_page_mode

    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    procs = [int(p) for p in args.procs.split(",") if p]
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"pfs bench kvcache: unknown backend {b!r}; known: {BACKENDS}")
    total = parse_size(args.bytes)
    res: dict[str, Any] = {"bench": "kvcache", "cells": []}
    with work_dir(args.local_dir, "pfs-bench-kv-") as wd, \
            cluster_for(args, wd, args.data_servers) as cut, \
            (redis_server(wd) if "redis" in backends
             else contextlib.nullcontext(None)) as redis:
        res["machine"] = machine_info(wd)
        if redis is None and "redis" in backends:
            log("redis-server is not installed: no redis column")
            backends.remove("redis")
        node_dir = Path(args.node_dir) / f"pfs-kv-bench-{os.getpid()}"
        mode = tmpfs_page_mode(args.node_dir)
        res["node_dir"] = f"{args.node_dir} ({f'tmpfs huge={mode}' if mode else 'not tmpfs'})"
        file_dir = wd / "files"
        file_dir.mkdir()
        servers = {"node": [p for n, p in cut.pids.items() if n.startswith("data")],
                   "redis": [redis[1]] if redis else []}
        servers["server"] = servers["local"] = servers["node"]
        servers["file"] = []
        try:
            for n in procs:
                cells = [(s, max(4, min(args.max_ops, total // s // n))) for s in sizes]
                conf = {"client_toml": str(cut.client_toml), "node_dir": str(node_dir),
                        "node_bytes": 4 << 30, "redis_port": redis[0] if redis else 0,
                        "file_dir": str(file_dir), "backends": backends, "cells": cells}
                log(f"{n} client process(es): {', '.join(backends)} at "
                    f"{', '.join(fmt_size(s) for s in sizes)}")
                res["cells"] += _run_procs(n, conf, servers)
        finally:
            shutil.rmtree(node_dir, ignore_errors=True)
    res["aims"] = _aims(res["cells"])
    return res


def _run_procs(n: int, conf: dict[str, Any], servers: dict[str, list[int]]) -> list[
        dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n + 1, timeout=600)
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(r, conf, barrier, results), daemon=True)
               for r in range(n)]
    for w in workers:
        w.start()
    cells = []
    try:
        for _size, _ops in conf["cells"]:
            for b in conf["backends"]:
                cpu: dict[str, float] = {}
                pids = servers[b]
                barrier.wait()
                c0 = sum(proc_cpu(p) for p in pids)
                barrier.wait()
                c1 = sum(proc_cpu(p) for p in pids)
                barrier.wait()
                c2 = sum(proc_cpu(p) for p in pids)
                cpu = {"put": c1 - c0, "get": c2 - c1}
                barrier.wait()
                recs = [results.get(timeout=600) for _ in range(n)]
                cells.append(_cell(recs, cpu))
    finally:
        for w in workers:
            w.join(60)
            if w.is_alive():
                w.kill()
    return cells


def _aims(cells: list[dict[str, Any]]) -> list[str]:
    by = {(c["backend"], c["size"], c["procs"]): c for c in cells}
    out = []
    for (b, size, n), c in sorted(by.items()):
        if b in ("node", "local", "server") and size >= 256 << 10 \
                and ("redis", size, n) in by:  # node: where a repeated get on a node lands
            r = ratio(c["get"]["GBps"], by["redis", size, n]["get"]["GBps"])
            out.append(f"get GB/s pfs {b} / redis at {fmt_size(size)}, {n} proc: {r:.2f}x "
                       f"(aim >= 2): {'met' if r >= 2 else 'NOT met'}")
        if b == "local" and ("file", size, n) in by:
            r = ratio(c["get"]["p50_us"], by["file", size, n]["get"]["p50_us"])
            out.append(f"get p50 local short-circuit / local file at {fmt_size(size)}, {n} "
                       f"proc: {r:.2f}x")
        if b == "node" and ("file", size, n) in by:
            r = ratio(c["get"]["p50_us"], by["file", size, n]["get"]["p50_us"])
            out.append(f"get p50 node tier / local file at {fmt_size(size)}, {n} proc: "
                       f"{r:.2f}x (aim <= 1.5): {'met' if r <= 1.5 else 'NOT met'}")
    return out


def report(res: dict[str, Any]) -> str:
    rows = []
    for c in res["cells"]:
        p, g = c["put"], c["get"]
        rows.append([fmt_size(c["size"]), str(c["procs"]), c["backend"],
                     f"{p['p50_us']:.0f}", f"{p['p99_us']:.0f}", f"{p['GBps']:.2f}",
                     f"{g['p50_us']:.0f}", f"{g['p99_us']:.0f}", f"{g['GBps']:.2f}",
                     f"{g['GBps_per_core']:.2f}", f"{g['client_cpu_us_per_op']:.1f}",
                     str(c["errors"])])
    return "\n".join([
        "pfs bench kvcache: put/get of KV blocks (us, GB/s = 1e9 B/s; per core: over the "
        "CPU of clients and servers)",
        table(rows, ["block", "procs", "backend", "put p50", "put p99", "put GB/s",
                     "get p50", "get p99", "get GB/s", "get GB/s/core",
                     "get client CPU us", "errors"]),
        f"node tier in {res.get('node_dir', '/dev/shm')}",
        *res["aims"]])


def main(argv: list[str]) -> int:
    return bench_main("kvcache", __doc__, add_args, run, report, argv)
