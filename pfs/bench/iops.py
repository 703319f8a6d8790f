"""``pfs bench iops``: 4 KiB random reads — IOPS and p50/p99 latency — with the ``posix``
and ``uring`` engines at queue depths 1, 8 and 32, on three paths, in one run:

- ``local``: a plain file (``--file-size`` random bytes, in the page cache) read with
  :func:`pfs.core.engine.get_engine` ``(engine, queue_depth=qd)``;
- ``network``: a pfs file of the same size (stripe count ``--count``, unit ``--unit``)
  read by the native client with short-circuit **off**, so every read is an RPC to a
  data server over loopback TCP; the engine is the **data servers'** (``dataserver
  --engine``): this command starts one cluster per engine (unless given ``--dir`` or
  ``--config``, whose servers keep their own engine, shown as ``servers``);
- ``short_circuit``: the same pfs file with short-circuit **on**: the client reads the
  objects itself through the descriptors the local data servers hand over, with the
  engine under test (its queue depth = qd).
- ``sync_api``: the same file through what most programs call, ``pfs.connect()`` and
  ``File.preadinto``, from qd **threads** sharing one open file. Small reads run in the
  calling thread: with short-circuit on (``local``) a ``preadv`` of the object's
  descriptor, with it off (``tcp``) one request over a blocking connection to the data
  server (docs/architecture.md).

Queue depth qd = qd trio tasks, each issuing one 4 KiB read at a random 4 KiB-aligned
offset, waiting for it, and issuing the next: qd reads in flight. Each point runs
``--seconds`` (after 64 untimed reads that open connections and descriptors); latency is
per read, from issue to completion as the task sees it. Everything is page-cache warm
(the files were just written / read): this measures the software path, not a disk.
CPU: this process (+ the data servers for the pfs paths), shown as CPU microseconds per
read.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from pfs.bench.common import (
    CpuMeter,
    bench_main,
    cluster_in_dir,
    cluster_pids,
    fmt_size,
    log,
    machine_info,
    parse_size,
    random_buffer,
    table,
    work_dir,
)

ENGINES = ("posix", "uring")
PATHS = ("local", "network", "short_circuit", "sync_api")
BLOCK = 4096


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cluster directory: the cluster there (a stopped one is "
                                 "started for the run and stopped after; its servers' "
                                 "engine is used)")
    p.add_argument("--config", help="client.toml of a running cluster to use")
    p.add_argument("--file-size", type=parse_size, default=1 << 30,
                   help="size of the file read at random (default 1G)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per point (default 2)")
    p.add_argument("--qd", default="1,8,32", help="queue depths (default 1,8,32)")
    p.add_argument("--engines", default=",".join(ENGINES), help="default posix,uring")
    p.add_argument("--paths", default=",".join(PATHS),
                   help="default local,network,short_circuit")
    p.add_argument("--count", type=int, default=4, help="pfs stripe count (default 4)")
    p.add_argument("--unit", type=parse_size, default=1 << 20,
                   help="pfs stripe unit (default 1M)")
    p.add_argument("--data-servers", type=int, default=4,
                   help="data servers per cluster this command starts (default 4)")
    p.add_argument("--local-dir", help="where the local file (and the bench's own clusters) "
                                       "live; default: the temp dir")
    p.add_argument("--quick", action="store_true", help="tiny: 16M file, 0.3 s per point")
    p.add_argument("--json", help="write all results here")


# -- one point -------------------------------------------------------------------------
async def _drive(read: Any, nblocks: int, qd: int, seconds: float) -> tuple[list[float], float]:
    """qd tasks of back-to-back ``await read(offset, buf)``; (latencies, seconds)."""
    rng = random.Random(qd)
    warm = memoryview(bytearray(BLOCK))
    for _ in range(64):
        await read(rng.randrange(nblocks) * BLOCK, warm)
    lats: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(seed: int) -> None:
        r = random.Random(seed)
        buf = memoryview(bytearray(BLOCK))
        clock = time.perf_counter
        while True:
            t0 = clock()
            if t0 >= deadline:
                return
            n = await read(r.randrange(nblocks) * BLOCK, buf)
            lats.append(clock() - t0)
            if n != BLOCK:
                raise RuntimeError(f"short read: {n} of {BLOCK} bytes")

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(qd):
            nursery.start_soon(worker, qd * 1000 + i)
    return lats, time.perf_counter() - t0


def _record(lats: list[float], dt: float, span: dict[str, Any]) -> dict[str, Any]:
    if len(lats) >= 2:
        q = statistics.quantiles(lats, n=100)
        p50, p99 = q[49], q[98]
    else:
        p50 = p99 = lats[0] if lats else 0.0
    cpu = span["cpu_self_s"] + span["cpu_servers_s"]
    return {"ios": len(lats), "seconds": dt, "iops": len(lats) / dt if dt > 0 else 0.0,
            "p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "cpu_self_s": span["cpu_self_s"],
            "cpu_servers_s": span["cpu_servers_s"],
            "cpu_us_per_io": cpu / len(lats) * 1e6 if lats else 0.0,
            "machine_busy_pct": span["machine_busy_pct"]}


def local_point(path: Path, size: int, engine: str, qd: int, seconds: float) -> dict[str, Any]:
    from pfs.core.engine import get_engine

    fd = os.open(path, os.O_RDONLY)
    try:
        async def go() -> tuple[list[float], float]:
            eng = get_engine(engine, queue_depth=qd)
            try:
                return await _drive(lambda off, buf: eng.read_into(fd, off, buf),
                                    size // BLOCK, qd, seconds)
            finally:
                eng.close()

        span: dict[str, Any] = {}
        with CpuMeter().span(span):
            lats, dt = trio.run(go)
    finally:
        os.close(fd)
    return _record(lats, dt, span)


def pfs_point(c: Any, path: str, size: int, qd: int, seconds: float, pids: list[int],
              engine: str | None = None) -> dict[str, Any]:
    """Random reads of pfs ``path`` through client ``c``; ``engine``: the short-circuit
    engine to read local objects with (a fresh one of queue depth qd)."""
    from pfs.core.engine import get_engine

    loc = c.aio.local
    if engine is not None:
        if loc is None:
            raise RuntimeError("short-circuit reads are off in this client")
        if loc._engine is not None:
            loc._engine.close()
        loc._engine = get_engine(engine, queue_depth=qd)
    before = dict(loc.stats) if loc is not None else {}

    async def go() -> tuple[list[float], float]:
        fh = await c.aio.open(path, "rb")
        try:
            return await _drive(lambda off, buf: fh.pread_into(buf, off), size // BLOCK, qd,
                                seconds)
        finally:
            await fh.close()

    span: dict[str, Any] = {}
    with CpuMeter(pids).span(span):
        lats, dt = c._run(go)
    rec = _record(lats, dt, span)
    if loc is not None:
        rec["short_circuit_reads"] = loc.stats["local_reads"] - before.get("local_reads", 0)
        if engine is not None and rec["short_circuit_reads"] < rec["ios"]:
            raise RuntimeError(f"short-circuit on, but only {rec['short_circuit_reads']} of "
                               f"{rec['ios']} reads were local")
    return rec


def sync_point(c: Any, path: str, size: int, qd: int, seconds: float,
               pids: list[int]) -> dict[str, Any]:
    """Random reads of pfs ``path`` with the sync API: ``qd`` threads calling
    ``File.preadinto`` on one shared file."""
    nblocks = size // BLOCK
    per_thread: list[list[float]] = [[] for _ in range(qd)]
    errors: list[BaseException] = []
    warmed, start = threading.Barrier(qd + 1), threading.Barrier(qd + 1)
    deadline = [0.0]

    def worker(i: int, f: Any) -> None:
        r = random.Random(qd * 1000 + i)
        buf = bytearray(BLOCK)
        out = per_thread[i]
        clock = time.perf_counter
        try:
            for _ in range(64):  # untimed: descriptors of every stripe
                f.preadinto(buf, r.randrange(nblocks) * BLOCK)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            errors.append(exc)
        warmed.wait()
        start.wait()  # the deadline is set between the two
        try:
            while (t0 := clock()) < deadline[0]:
                n = f.preadinto(buf, r.randrange(nblocks) * BLOCK)
                out.append(clock() - t0)
                if n != BLOCK:
                    raise RuntimeError(f"short read: {n} of {BLOCK} bytes")
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            errors.append(exc)

    loc = c.aio.local
    before = loc.stats["local_reads"] if loc is not None else 0
    with c.open(path, "rb") as f:
        threads = [threading.Thread(target=worker, args=(i, f)) for i in range(qd)]
        for t in threads:
            t.start()
        warmed.wait()
        span: dict[str, Any] = {}
        with CpuMeter(pids).span(span):
            t0 = time.perf_counter()
            deadline[0] = t0 + seconds
            start.wait()
            for t in threads:
                t.join()
            dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    rec = _record([x for lst in per_thread for x in lst], dt, span)
    if loc is not None:  # the warm-up reads count too
        rec["short_circuit_reads"] = loc.stats["local_reads"] - before
    return rec


# -- clusters ----------------------------------------------------------------------
@contextlib.contextmanager
def clusters(args: argparse.Namespace, wd: Path, engines: list[str]
             ) -> Iterator[dict[str, tuple[Path, list[int]]]]:
    """{server engine label: (client.toml, server pids)}."""
    from pfs.tools import cluster

    if args.config:
        toml = Path(args.config).resolve()
        yield {"servers": (toml, list(cluster_pids(toml.parent).values()))}
        return
    if args.dir:
        d = Path(args.dir).resolve()
        with cluster_in_dir(d, args.data_servers) as toml:
            yield {"servers": (toml, list(cluster_pids(d).values()))}
        return
    started: list[Path] = []
    try:
        out = {}
        for eng in engines:
            d = wd / f"cluster-{eng}"
            started.append(d)
            t0 = time.perf_counter()
            toml = cluster.up(d, data_servers=args.data_servers, data_args=["--engine", eng])
            log(f"started a cluster with {args.data_servers} {eng} data servers in "
                f"{time.perf_counter() - t0:.1f} s")
            out[eng] = (toml, list(cluster_pids(d).values()))
        yield out
    finally:
        for d in started:
            cluster.down(d)
            shutil.rmtree(d, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import pfs
    from pfs.core import config as cfgmod
    from pfs.core.engine import uring_unavailable

    if args.quick:
        args.file_size = min(args.file_size, 16 << 20)
        args.seconds = min(args.seconds, 0.3)
    size = max(BLOCK, args.file_size // BLOCK * BLOCK)
    qds = [int(x) for x in args.qd.split(",") if x]
    engines = [e for e in args.engines.split(",") if e]
    paths = [p for p in args.paths.split(",") if p]
    notes: list[str] = []
    why = uring_unavailable()
    if why and "uring" in engines:
        notes.append(f"io_uring unavailable ({why}): uring points skipped")
        engines.remove("uring")
    points: list[dict[str, Any]] = []
    with work_dir(args.local_dir, "pfs-bench-iops-") as wd:
        result: dict[str, Any] = {
            "bench": "iops", "machine": machine_info(wd),
            "config": {"file_size": size, "block": BLOCK, "seconds": args.seconds,
                       "queue_depths": qds, "engines": engines, "paths": paths,
                       "stripe_count": args.count, "stripe_unit": args.unit},
            "notes": notes,
        }
        log(f"making {fmt_size(size)} of random data")
        data = random_buffer(size)

        def add(path: str, engine: str, qd: int, rec: dict[str, Any]) -> None:
            rec.update(path=path, engine=engine, qd=qd)
            points.append(rec)
            log(f"  {path:13s} {engine:8s} qd {qd:2d}: {rec['iops']:9.0f} IOPS  "
                f"p50 {rec['p50_us']:7.1f} us  p99 {rec['p99_us']:7.1f} us")

        if "local" in paths:
            lpath = wd / "iops.bin"
            with open(lpath, "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
            with open(lpath, "rb", buffering=0) as rf:  # into the page cache
                while rf.read(64 << 20):
                    pass
            for qd in qds:
                for eng in engines:
                    add("local", eng, qd, local_point(lpath, size, eng, qd, args.seconds))
        net = [p for p in paths if p != "local"]
        if net:
            with clusters(args, wd, engines if "network" in net else engines[:1]) as cls:
                result["config"]["clusters"] = {k: str(v[0].parent) for k, v in cls.items()}
                for label, (toml, pids) in cls.items():
                    cfg_off = cfgmod.load(cfgmod.ClientConfig, toml)
                    cfg_off.short_circuit = False
                    cfg_on = cfgmod.load(cfgmod.ClientConfig, toml)
                    cfg_on.short_circuit = True
                    fpath = f"/bench-iops-{os.getpid()}"
                    with pfs.connect(config=cfg_off) as c_off, pfs.connect(config=cfg_on) as c_on:
                        c_off.makedirs(fpath, exist_ok=True)
                        c_off.set_layout(fpath, count=args.count, unit=args.unit)
                        fname = f"{fpath}/f"
                        try:
                            with c_off.open(fname, "wb") as fh:
                                view = memoryview(data)
                                for off in range(0, size, 64 << 20):
                                    fh.write(view[off:off + (64 << 20)])
                                fh.fsync()
                            if "network" in net:
                                for qd in qds:
                                    add("network", label, qd,
                                        pfs_point(c_off, fname, size, qd, args.seconds, pids))
                            if "short_circuit" in net and label == next(iter(cls)):
                                for qd in qds:
                                    for eng in engines:
                                        add("short_circuit", eng, qd,
                                            pfs_point(c_on, fname, size, qd, args.seconds, pids,
                                                      engine=eng))
                            if "sync_api" in net and label == next(iter(cls)):
                                for qd in qds:
                                    for how, cl in (("local", c_on), ("tcp", c_off)):
                                        add("sync_api", how, qd,
                                            sync_point(cl, fname, size, qd, args.seconds, pids))
                        finally:
                            try:
                                c_off.remove(fname)
                                c_off.rmdir(fpath)
                            except OSError:
                                pass
    result["points"] = points
    return result


def report(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [f"pfs bench iops: 4 KiB random reads of a {fmt_size(cfg['file_size'])} file "
             f"(page cache warm), {cfg['seconds']:g} s per point; network = short-circuit "
             f"off (engine = the data servers'), short_circuit = client reads local objects "
             f"with the engine",
             f"machine: {res['machine'].get('cpus')} CPUs ({res['machine'].get('cpu_model', '?')}), "
             f"{res['machine'].get('fs', '?')}", ""]
    order = {p: i for i, p in enumerate(PATHS)}
    pts = sorted(res["points"], key=lambda p: (order.get(p["path"], 9), p["qd"], p["engine"]))
    rows = [[p["path"], p["engine"], str(p["qd"]), f"{p['iops']:.0f}", f"{p['p50_us']:.1f}",
             f"{p['p99_us']:.1f}", f"{p['cpu_us_per_io']:.1f}"] for p in pts]
    lines.append(table(rows, ["path", "engine", "qd", "IOPS", "p50 us", "p99 us", "CPU us/IO"]))
    for n in res.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return bench_main("iops", __doc__, add_args, run, report, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
