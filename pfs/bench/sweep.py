"""``pfs bench sweep``: measure data paths. Every combination of

  target      local (a file on local disk), native (a pfs file through the native
              client), mount (a file on a pfs FUSE mount)
  engine      posix (preadv/pwritev), posix-direct (O_DIRECT), uring-qdN (io_uring, N ops
              in flight), uring-direct-qdN, gds (GPUDirect Storage into GPU memory, reads,
              where a GPU is present); the native target has one engine, ``native``, the
              client's own striped data path
  block size  4 KiB .. 16 MiB
  pattern     seqread, randread, seqwrite, randwrite
  threads     concurrent workers (OS threads, each with its own engine; for native,
              concurrent requests on one client)

is one *point*, run for ``--seconds`` or one pass over the ``--file-size`` test file,
whichever ends first (a cold pass with ``--drop-caches``). Each point gives throughput
(GB/s, 10^9 B/s), IOPS, latency p50/p99/p99.9 (per call: a batch of N ops on uring-qdN
counts N times its call's latency), CPU seconds (this process and, for native and mount,
the pfs servers and the FUSE daemon) and GB/s per CPU core.

Results go to ``--out``: ``points.jsonl`` (one line per finished point: a rerun skips
those, so an interrupted sweep resumes), ``results.csv``, ``results.json`` (with the
winners) and three plots: ``throughput_vs_bs.png``, ``latency_cdf.png``,
``gbps_per_core.png``. The summary names the data path that wins each workload phase:
inference (random reads <= 64 KiB: IOPS, and p99 latency), loading (sequential reads >=
1 MiB: GB/s, and GB/s per core) and checkpointing (sequential writes >= 1 MiB: GB/s).

A TOML file (``--config-file``) sets any option for larger sweeps; unknown keys are
refused. ``--quick`` is a small preset (a few seconds per target).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from pfs.bench.common import (
    GB,
    cluster_for,
    drop_caches,
    fmt_size,
    log,
    machine_info,
    parse_size,
    proc_cpu,
    steps,
    table,
)

PATTERNS = ("seqread", "randread", "seqwrite", "randwrite")
TARGETS = ("local", "native", "mount")
MAX_BUFFERS = 64 << 20  # bytes of buffers per worker (qd x bs is capped by this)
QUANTILES = [0.0, 1, 5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 99, 99.9, 100.0]
CSV_FIELDS = ["target", "engine", "block_size", "pattern", "threads", "status", "ops", "bytes",
              "seconds", "GBps", "IOPS", "lat_p50_us", "lat_p99_us", "lat_p999_us",
              "cpu_s", "GBps_per_core", "qd"]


def _size_list(v: Any) -> list[int]:
    items = v.split(",") if isinstance(v, str) else list(v)
    return [x if isinstance(x, int) else parse_size(str(x).strip()) for x in items
            if str(x).strip()]


def _str_list(v: Any) -> list[str]:
    items = v.split(",") if isinstance(v, str) else list(v)
    return [str(x).strip() for x in items if str(x).strip()]


def _int_list(v: Any) -> list[int]:
    items = v.split(",") if isinstance(v, str) else list(v)
    return [int(x) for x in items if str(x).strip()]


def gpu_present() -> bool:
    try:
        from pfs.client.device import libcuda_missing
        from pfs.loader.gpu import kvikio_missing

        return libcuda_missing() is None and kvikio_missing() is None
    except ImportError:
        return False


def default_engines() -> list[str]:
    out = ["posix", "posix-direct", "uring-qd1", "uring-qd8", "uring-qd32"]
    return out + (["gds"] if gpu_present() else [])


@dataclass
class SweepConfig:
    targets: list[str] = field(default_factory=lambda: ["local"])
    engines: list[str] = field(default_factory=default_engines)
    block_sizes: list[int] = field(default_factory=lambda: [4 << 10, 16 << 10, 64 << 10,
                                                             256 << 10, 1 << 20, 4 << 20,
                                                             16 << 20])
    patterns: list[str] = field(default_factory=lambda: list(PATTERNS))
    threads: list[int] = field(default_factory=lambda: [1, 2])
    seconds: float = 0.5
    file_size: int = 256 << 20
    drop_caches: bool = False
    out: str = "sweep-results"
    local_dir: str = ""  # where the local target's file goes (default: a temp dir)
    mount: str = ""  # an existing pfs mount (default: mount the cluster under test)
    config: str = ""  # client.toml of a running cluster
    dir: str = ""  # a cluster directory (started there if not running)
    pfs_dir: str = "/bench-sweep"

    CONVERT = {"targets": _str_list, "engines": _str_list, "block_sizes": _size_list,
               "patterns": _str_list, "threads": _int_list, "file_size": lambda v: v if
               isinstance(v, int) else parse_size(str(v)), "seconds": float}

    def set(self, key: str, value: Any, origin: str) -> None:
        names = {f.name for f in fields(self)}
        if key not in names:
            raise SystemExit(f"pfs bench sweep: {origin}: unknown key {key!r}; "
                             f"known: {', '.join(sorted(names))}")
        conv = self.CONVERT.get(key)
        setattr(self, key, conv(value) if conv else value)

    def check(self) -> None:
        for t in self.targets:
            if t not in TARGETS:
                raise SystemExit(f"pfs bench sweep: unknown target {t!r}; known: {TARGETS}")
        for p in self.patterns:
            if p not in PATTERNS:
                raise SystemExit(f"pfs bench sweep: unknown pattern {p!r}; known: {PATTERNS}")
        for e in self.engines:
            parse_engine(e)
        if any(b < 512 or b > self.file_size for b in self.block_sizes):
            raise SystemExit("pfs bench sweep: block sizes must be in [512 B, --file-size]")


QUICK = {"engines": ["posix", "posix-direct", "uring-qd1", "uring-qd16"],
         "block_sizes": [4 << 10, 1 << 20], "threads": [1], "seconds": 0.2,
         "file_size": 32 << 20}


def parse_engine(spec: str) -> tuple[str, bool, int]:
    """``posix``, ``posix-direct``, ``uring-qd8``, ``uring-direct-qd32``, ``gds``,
    ``native`` -> (base, direct, queue depth)."""
    parts = spec.split("-")
    base, direct, qd = parts[0], False, 1
    for p in parts[1:]:
        if p == "direct":
            direct = True
        elif p.startswith("qd") and p[2:].isdigit() and int(p[2:]) > 0:
            qd = int(p[2:])
        else:
            raise SystemExit(f"pfs bench sweep: bad engine {spec!r} (e.g. posix, posix-direct, "
                             "uring-qd8, uring-direct-qd32, gds)")
    if base not in ("posix", "uring", "gds", "native"):
        raise SystemExit(f"pfs bench sweep: unknown engine {spec!r}")
    return base, direct, qd


@dataclass(frozen=True)
class Point:
    target: str
    engine: str
    block_size: int
    pattern: str
    threads: int

    def key(self) -> str:
        return f"{self.target}|{self.engine}|{self.block_size}|{self.pattern}|{self.threads}"

    def label(self) -> str:
        return (f"{self.target} {self.engine} {fmt_size(self.block_size)} {self.pattern} "
                f"x{self.threads}")


def points_of(cfg: SweepConfig) -> list[Point]:
    out = []
    for t in cfg.targets:
        engines = ["native"] if t == "native" else [e for e in cfg.engines if e != "native"]
        for e in engines:
            for p in cfg.patterns:
                for bs in cfg.block_sizes:
                    for n in cfg.threads:
                        out.append(Point(t, e, bs, p, n))
    return out


# -- one point ---------------------------------------------------------------------
class Plan:
    """Which offsets a worker visits: sequential through its own region, or random over
    the whole file; at most one pass worth of ops."""

    def __init__(self, pattern: str, bs: int, file_size: int, threads: int, worker: int,
                 seed: int) -> None:
        nblocks = max(1, file_size // bs)
        per = max(1, nblocks // threads)
        self.max_ops = per
        self.random = pattern.startswith("rand")
        self.start = (worker * per) % nblocks
        self.nblocks = nblocks
        self.bs = bs
        self.rng = np.random.default_rng(seed + worker)
        self.i = 0

    def take(self, n: int) -> list[int]:
        n = min(n, self.max_ops - self.i)
        if n <= 0:
            return []
        if self.random:
            blocks = self.rng.integers(0, self.nblocks, n)
            out = [int(b) * self.bs for b in blocks]
        else:
            out = [((self.start + self.i + k) % self.nblocks) * self.bs for k in range(n)]
        self.i += n
        return out


class Worker:
    """One thread's loop; fills in ops, bytes and per-call latencies."""

    def __init__(self) -> None:
        self.ops = 0
        self.bytes = 0
        self.lat: list[float] = []  # seconds per call
        self.weight: list[int] = []  # ops per call
        self.t0 = self.t1 = 0.0
        self.error: BaseException | None = None


def _buffers(n: int, bs: int, gpu: bool, fill: bool) -> list[Any]:
    from pfs.core.engine import aligned_buffer

    if gpu:
        import cupy  # the gpu extra

        return [cupy.zeros(bs, dtype=cupy.uint8) for _ in range(n)]
    bufs = [aligned_buffer(bs) for _ in range(n)]
    if fill:
        pat = np.random.default_rng(7).bytes(bs)
        for b in bufs:
            b[:] = pat
    return bufs


def run_engine_worker(path: str, point: Point, cfg: SweepConfig, w: Worker, wid: int,
                      start: threading.Barrier) -> None:
    import trio

    from pfs.core.engine import Engine, Op, get_engine

    base, direct, qd = parse_engine(point.engine)
    write = "write" in point.pattern
    bs = point.block_size
    nbuf = max(1, min(qd, MAX_BUFFERS // bs))
    plan = Plan(point.pattern, bs, cfg.file_size, point.threads, wid, seed=1234)
    flags = (os.O_RDWR if write else os.O_RDONLY) | (os.O_DIRECT if direct else 0)

    async def main() -> None:
        if base == "gds":
            from pfs.loader.gpu import GdsEngine  # the gpu extra's engine: GPU buffers only

            eng: Engine = GdsEngine(queue_depth=max(qd, 1))
        else:
            eng = get_engine(base, queue_depth=max(qd, 1))
        fd = os.open(path, flags)
        try:
            bufs = _buffers(nbuf, bs, base == "gds", write)
            start.wait()
            w.t0 = time.perf_counter()
            deadline = w.t0 + cfg.seconds
            while time.perf_counter() < deadline:
                offs = plan.take(qd)
                if not offs:
                    break
                ops = [Op(fd, off, bs, bufs[k % nbuf], write) for k, off in enumerate(offs)]
                c0 = time.perf_counter()
                counts = await eng.submit(ops)
                w.lat.append(time.perf_counter() - c0)
                w.weight.append(len(ops))
                w.ops += len(ops)
                w.bytes += sum(counts)
            w.t1 = time.perf_counter()
        finally:
            os.close(fd)
            eng.close()

    try:
        trio.run(main)
    except BaseException as exc:  # noqa: BLE001 - reported by the point's runner
        w.error = exc
        with contextlib.suppress(threading.BrokenBarrierError):
            start.abort()


def run_native(toml: str, path: str, point: Point, cfg: SweepConfig) -> list[Worker]:
    """``threads`` concurrent requests on one native client."""
    import trio

    from pfs.client.aio import AsyncClient

    write = "write" in point.pattern
    bs = point.block_size
    workers = [Worker() for _ in range(point.threads)]

    async def one(f: Any, w: Worker, wid: int, ready: trio.Event) -> None:
        plan = Plan(point.pattern, bs, cfg.file_size, point.threads, wid, seed=1234)
        buf = memoryview(bytearray(np.random.default_rng(7).bytes(bs)) if write
                         else bytearray(bs))
        await ready.wait()
        w.t0 = time.perf_counter()
        deadline = w.t0 + cfg.seconds
        while time.perf_counter() < deadline:
            offs = plan.take(1)
            if not offs:
                break
            c0 = time.perf_counter()
            if write:
                n = await f.pwrite(buf, offs[0])
            else:
                n = await f.pread_into(buf, offs[0])
            w.lat.append(time.perf_counter() - c0)
            w.weight.append(1)
            w.ops += 1
            w.bytes += n
        w.t1 = time.perf_counter()

    async def main() -> None:
        async with AsyncClient.connect(toml) as client:
            f = await client.open(path, "r+b" if write else "rb")
            try:
                ready = trio.Event()
                async with trio.open_nursery() as n:
                    for i, w in enumerate(workers):
                        n.start_soon(one, f, w, i, ready)
                    ready.set()
                if write:
                    await f.fsync()
            finally:
                await f.close()

    trio.run(main)
    return workers


def measure(point: Point, cfg: SweepConfig, env: Env) -> dict[str, Any]:
    """Run one point; its record (status ``ok``, or ``skipped: why``)."""
    rec: dict[str, Any] = asdict(point)
    base, direct, qd = parse_engine(point.engine)
    rec["qd"] = qd
    write = "write" in point.pattern
    if base == "gds" and write:
        return {**rec, "status": "skipped: gds only reads"}
    if base == "gds" and not gpu_present():
        return {**rec, "status": "skipped: no CUDA device / kvikio"}
    if cfg.drop_caches and not write:
        drop_caches()
    pids = env.pids.get(point.target, [])
    cpu0 = time.process_time() + sum(proc_cpu(p) for p in pids)  # ns clock for this process
    try:
        if point.target == "native":
            workers = run_native(env.toml, env.native_file, point, cfg)
        else:
            path = env.files[point.target]
            workers = [Worker() for _ in range(point.threads)]
            start = threading.Barrier(point.threads)
            ths = [threading.Thread(target=run_engine_worker, args=(path, point, cfg, w, i, start),
                                    name=f"sweep-{i}") for i, w in enumerate(workers)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            errs = [w.error for w in workers if w.error is not None]
            if errs:
                raise errs[0]
            if write:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    except (OSError, ImportError) as exc:
        return {**rec, "status": f"skipped: {exc}"}
    cpu = time.process_time() + sum(proc_cpu(p) for p in pids) - cpu0
    secs = max(w.t1 for w in workers) - min(w.t0 for w in workers)
    ops = sum(w.ops for w in workers)
    nbytes = sum(w.bytes for w in workers)
    lat = np.repeat(np.array([x for w in workers for x in w.lat]),
                    [k for w in workers for k in w.weight]) * 1e6
    q = np.percentile(lat, QUANTILES).tolist() if lat.size else [0.0] * len(QUANTILES)
    rec.update({
        "status": "ok", "ops": ops, "bytes": nbytes, "seconds": secs,
        "GBps": nbytes / secs / GB if secs > 0 else 0.0,
        "IOPS": ops / secs if secs > 0 else 0.0,
        "lat_p50_us": float(np.percentile(lat, 50)) if lat.size else 0.0,
        "lat_p99_us": float(np.percentile(lat, 99)) if lat.size else 0.0,
        "lat_p999_us": float(np.percentile(lat, 99.9)) if lat.size else 0.0,
        "lat_quantiles_us": q,
        "cpu_s": cpu,
        "GBps_per_core": nbytes / cpu / GB if cpu > 0 else 0.0,
    })
    return rec


# -- the targets -------------------------------------------------------------------
@dataclass
class Env:
    files: dict[str, str] = field(default_factory=dict)  # target -> test file path
    toml: str = ""
    native_file: str = ""
    pids: dict[str, list[int]] = field(default_factory=dict)  # target -> server pids


def make_file(path: str, size: int) -> None:
    """A test file of ``size`` random bytes, on disk (fsync) unless it already is."""
    try:
        if os.stat(path).st_size == size:
            return
    except FileNotFoundError:
        pass
    chunk = np.random.default_rng(11).bytes(min(size, 16 << 20))
    with open(path, "wb") as f:
        done = 0
        while done < size:
            n = min(len(chunk), size - done)
            f.write(chunk[:n])
            done += n
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def environment(cfg: SweepConfig, work: Path) -> Iterator[Env]:
    """Test files on every target: local scratch, the cluster (given or started) and a
    mount (given or made here)."""
    env = Env()
    with contextlib.ExitStack() as stack:
        if "local" in cfg.targets:
            d = Path(cfg.local_dir) if cfg.local_dir else work
            d.mkdir(parents=True, exist_ok=True)
            env.files["local"] = str(d / f"sweep-local-{os.getpid()}.dat")
            stack.callback(lambda: Path(env.files["local"]).unlink(missing_ok=True))
            make_file(env.files["local"], cfg.file_size)
        need_cluster = "native" in cfg.targets or ("mount" in cfg.targets and not cfg.mount)
        if need_cluster:
            ns = argparse.Namespace(config=cfg.config or None, dir=cfg.dir or None)
            cut = stack.enter_context(cluster_for(ns, work, 4))
            env.toml = str(cut.client_toml)
            server_pids = list(cut.pids.values())
        else:
            server_pids = []
        if "native" in cfg.targets:
            import pfs

            env.native_file = f"{cfg.pfs_dir.rstrip('/')}/sweep-native-{os.getpid()}.dat"
            with pfs.connect(config=env.toml) as c:
                c.makedirs(cfg.pfs_dir, exist_ok=True)
                with c.open(env.native_file, "wb") as f:
                    chunk = np.random.default_rng(11).bytes(min(cfg.file_size, 16 << 20))
                    done = 0
                    while done < cfg.file_size:
                        n = min(len(chunk), cfg.file_size - done)
                        done += f.write(memoryview(chunk)[:n])
                    f.fsync()

            def rm_native() -> None:
                with pfs.connect(config=env.toml) as c:
                    c.remove(env.native_file)

            stack.callback(rm_native)
            env.pids["native"] = server_pids
        if "mount" in cfg.targets:
            from pfs.bench.fusebench import _pids_of_mount, pfs_mount, pfs_umount

            if cfg.mount:
                mnt = Path(cfg.mount)
            else:
                mnt = work / "mnt"
                pfs_mount(Path(env.toml), mnt, "")
                stack.callback(pfs_umount, mnt)
            d = mnt / cfg.pfs_dir.strip("/")
            d.mkdir(parents=True, exist_ok=True)
            env.files["mount"] = str(d / f"sweep-mount-{os.getpid()}.dat")
            stack.callback(lambda: Path(env.files["mount"]).unlink(missing_ok=True))
            make_file(env.files["mount"], cfg.file_size)
            env.pids["mount"] = server_pids + _pids_of_mount(mnt)
        yield env


# -- winners -----------------------------------------------------------------------
PHASES_OF_WORK = [
    # name, what, pattern, block-size test, metric, higher is better
    ("inference", "random reads <= 64 KiB", "randread", lambda b: b <= 64 << 10, "IOPS", True),
    ("inference (latency)", "random reads <= 64 KiB", "randread", lambda b: b <= 64 << 10,
     "lat_p99_us", False),
    ("loading", "sequential reads >= 1 MiB", "seqread", lambda b: b >= 1 << 20, "GBps", True),
    ("loading (CPU)", "sequential reads >= 1 MiB", "seqread", lambda b: b >= 1 << 20,
     "GBps_per_core", True),
    ("checkpointing", "sequential writes >= 1 MiB", "seqwrite", lambda b: b >= 1 << 20,
     "GBps", True),
]


def winners(recs: list[dict[str, Any]], target: str | None = None) -> list[dict[str, Any]]:
    """Per phase of work: each data path's geometric mean of the metric over its matching
    points (every block size and thread count), and the best path."""
    out = []
    for name, what, pattern, bs_ok, metric, higher in PHASES_OF_WORK:
        by_path: dict[str, list[float]] = {}
        for r in recs:
            if r.get("status") != "ok" or r["pattern"] != pattern or not bs_ok(r["block_size"]):
                continue
            if target is not None and r["target"] != target:
                continue
            if r[metric] > 0:
                by_path.setdefault(f"{r['target']}/{r['engine']}", []).append(r[metric])
        if not by_path:
            continue
        means = {p: math.exp(sum(math.log(v) for v in vs) / len(vs)) for p, vs in by_path.items()}
        best = max(means, key=means.get) if higher else min(means, key=means.get)  # type: ignore[arg-type]
        out.append({"phase": name, "workload": what, "metric": metric, "winner": best,
                    "value": means[best], "all": dict(sorted(means.items(), key=lambda kv: kv[1],
                                                              reverse=higher))})
    return out


# -- output ------------------------------------------------------------------------
def write_csv(path: Path, recs: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in recs:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r.get(k), float) else r.get(k, ""))
                        for k in CSV_FIELDS})


def plots(out: Path, recs: list[dict[str, Any]]) -> list[str]:
    """The three PNGs; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in recs if r.get("status") == "ok"]
    made = []

    def best(pattern: str, metric: str) -> dict[str, list[tuple[int, float]]]:
        # per path: (block size, best value over thread counts)
        d: dict[str, dict[int, float]] = {}
        for r in ok:
            if r["pattern"] == pattern:
                cur = d.setdefault(f"{r['target']}/{r['engine']}", {})
                cur[r["block_size"]] = max(cur.get(r["block_size"], 0.0), r[metric])
        return {p: sorted(v.items()) for p, v in d.items()}

    def bs_axis(ax: Any) -> None:
        ax.set_xscale("log", base=2)
        ticks = sorted({r["block_size"] for r in ok})
        ax.set_xticks(ticks)
        ax.set_xticklabels([fmt_size(t).replace(" ", "") for t in ticks], rotation=45,
                           fontsize=7)

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
    for ax, pattern in zip(axes.flat, PATTERNS, strict=True):
        for p, pts in best(pattern, "GBps").items():
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax.set_title(f"{pattern}: throughput (best over thread counts)")
        ax.set_ylabel("GB/s")
        ax.set_yscale("log")
        bs_axis(ax)
        ax.grid(True, alpha=0.3)
    for ax in axes.flat:
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_bs.png", dpi=100)
    plt.close(fig)
    made.append("throughput_vs_bs.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    for ax, pattern in zip(axes.flat, ("randread", "randwrite"), strict=True):
        small = [r for r in ok if r["pattern"] == pattern]
        if small:
            bs = min(r["block_size"] for r in small)
            th = min(r["threads"] for r in small)
            for r in small:
                if r["block_size"] == bs and r["threads"] == th:
                    ax.plot(r["lat_quantiles_us"], [q / 100 for q in QUANTILES], marker=".",
                            label=f"{r['target']}/{r['engine']}")
            ax.set_title(f"{pattern} {fmt_size(bs)}, {th} thread(s): latency CDF")
        ax.set_xscale("log")
        ax.set_xlabel("latency per call (us)")
        ax.set_ylabel("fraction of ops")
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=100)
    plt.close(fig)
    made.append("latency_cdf.png")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
    for ax, pattern in zip(axes.flat, ("seqread", "seqwrite"), strict=True):
        for p, pts in best(pattern, "GBps_per_core").items():
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax.set_title(f"{pattern}: GB/s per CPU core")
        ax.set_ylabel("GB/s per core")
        ax.set_yscale("log")
        bs_axis(ax)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "gbps_per_core.png", dpi=100)
    plt.close(fig)
    made.append("gbps_per_core.png")
    return made


def report(recs: list[dict[str, Any]], result: dict[str, Any]) -> str:
    rows = []
    for r in recs:
        if r.get("status") != "ok":
            continue
        rows.append([f"{r['target']}/{r['engine']}", fmt_size(r["block_size"]), r["pattern"],
                     str(r["threads"]), f"{r['GBps']:.3f}", f"{r['IOPS']:,.0f}",
                     f"{r['lat_p50_us']:.0f}", f"{r['lat_p99_us']:.0f}",
                     f"{r['lat_p999_us']:.0f}", f"{r['cpu_s']:.2f}", f"{r['GBps_per_core']:.2f}"])
    lines = [table(rows, ["path", "bs", "pattern", "thr", "GB/s", "IOPS", "p50 us", "p99 us",
                          "p99.9 us", "CPU s", "GB/s/core"])]
    skipped = [r for r in recs if r.get("status") != "ok"]
    if skipped:
        lines.append("")
        why: dict[str, list[str]] = {}
        for r in skipped:
            why.setdefault(r["status"], []).append(f"{r['target']}/{r['engine']}")
        for w, who in why.items():
            lines.append(f"not measured ({len(who)} points, {', '.join(sorted(set(who)))}): {w}")
    lines.append("")
    lines.append("winners (geometric mean over block sizes and thread counts):")
    for scope, ws in result["winners"].items():
        for w in ws:
            unit = {"IOPS": "IOPS", "GBps": "GB/s", "GBps_per_core": "GB/s per core",
                    "lat_p99_us": "us p99"}[w["metric"]]
            lines.append(f"  {scope:8s} {w['phase']:20s} {w['workload']:28s} {w['winner']:24s} "
                         f"{w['value']:,.3f} {unit}")
    return "\n".join(lines)


# -- the run -----------------------------------------------------------------------
def load_done(out: Path) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    p = out / "points.jsonl"
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut short by an interrupted run
            done[Point(r["target"], r["engine"], r["block_size"], r["pattern"],
                       r["threads"]).key()] = r
    return done


def progress(i: int, n: int, rec: dict[str, Any], t_start: float, fresh: int) -> None:
    label = Point(rec["target"], rec["engine"], rec["block_size"], rec["pattern"],
                  rec["threads"]).label()
    if rec["status"] == "ok":
        what = (f"{rec['GBps']:.3f} GB/s  {rec['IOPS']:,.0f} IOPS  p99 {rec['lat_p99_us']:.0f} us"
                f"  {rec['GBps_per_core']:.2f} GB/s/core")
    else:
        what = rec["status"]
    el = time.perf_counter() - t_start
    eta = el / fresh * (n - i) if fresh else 0.0
    log(f"[{i:>4}/{n}] {label:45s} {what}   (eta {eta:.0f} s)")


def run(cfg: SweepConfig, fresh: bool = False) -> dict[str, Any]:
    cfg.check()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"seconds": cfg.seconds, "file_size": cfg.file_size, "drop_caches": cfg.drop_caches}
    meta_p = out / "sweep-meta.json"
    if fresh:
        (out / "points.jsonl").unlink(missing_ok=True)
    elif meta_p.exists() and json.loads(meta_p.read_text()) != meta:
        raise SystemExit(f"pfs bench sweep: {out} holds points measured with other settings "
                         f"({meta_p.read_text().strip()}); use --fresh or another --out")
    meta_p.write_text(json.dumps(meta) + "\n")
    done = load_done(out)
    pts = points_of(cfg)
    todo = [p for p in pts if p.key() not in done]
    if len(todo) < len(pts):
        log(f"sweep: resuming: {len(pts) - len(todo)} of {len(pts)} points already in "
            f"{out / 'points.jsonl'}")
    recs: dict[str, dict[str, Any]] = {k: v for k, v in done.items()}
    if todo:
        targets = sorted({p.target for p in todo}, key=TARGETS.index)
        sub = SweepConfig(**{**asdict(cfg), "targets": targets})
        from pfs.bench.common import work_dir

        with work_dir(cfg.local_dir or None, "pfs-sweep-") as wd, environment(sub, wd) as env, \
                open(out / "points.jsonl", "a") as log_f, \
                steps(len(todo), "sweep", unit="point") as bar:
            t_start = time.perf_counter()
            for i, p in enumerate(todo, 1):
                rec = measure(p, cfg, env)
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
                recs[p.key()] = rec
                progress(len(pts) - len(todo) + i, len(pts), rec, t_start, i)
                bar.add(1)
    ordered = [recs[p.key()] for p in pts if p.key() in recs]
    result: dict[str, Any] = {
        "bench": "sweep", "config": asdict(cfg), "machine": machine_info(),
        "points": ordered,
        "winners": {"overall": winners(ordered),
                    **{t: winners(ordered, t) for t in cfg.targets}},
    }
    write_csv(out / "results.csv", ordered)
    result["plots"] = plots(out, ordered)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-file", help="TOML file with any of the options below "
                   "(keys: targets, engines, block_sizes, patterns, threads, seconds, "
                   "file_size, drop_caches, out, local_dir, mount, config, dir, pfs_dir)")
    p.add_argument("--targets", help="local,native,mount (default local)")
    p.add_argument("--engines", help="posix,posix-direct,uring-qd1,uring-qd8,uring-qd32[,gds] "
                   "(default; gds where a GPU is present)")
    p.add_argument("--block-sizes", help="default 4k,16k,64k,256k,1m,4m,16m")
    p.add_argument("--patterns", help="default seqread,randread,seqwrite,randwrite")
    p.add_argument("--threads", help="default 1,2")
    p.add_argument("--seconds", type=float, help="per point at most (default 0.5)")
    p.add_argument("--file-size", help="test file per target (default 256M): one pass at most "
                   "per point")
    p.add_argument("--drop-caches", action="store_true", help="cold reads: drop the page cache "
                   "before each read point (root)")
    p.add_argument("--out", help="results directory (default ./sweep-results); a rerun resumes")
    p.add_argument("--fresh", action="store_true", help="forget the points already in --out")
    p.add_argument("--local-dir", help="where the local target's test file goes")
    p.add_argument("--mount", help="an existing pfs mount for the mount target (default: "
                   "mount the cluster under test in a scratch directory)")
    p.add_argument("--config", help="client.toml of a running cluster (native and mount)")
    p.add_argument("--dir", help="cluster directory: use (or start) the cluster there "
                   "(default: a fresh cluster of 4 data servers, removed afterwards)")
    p.add_argument("--pfs-dir", help="pfs directory for the test files (default /bench-sweep)")
    p.add_argument("--quick", action="store_true", help="engines posix, posix-direct, "
                   "uring-qd1, uring-qd16; 4 KiB and 1 MiB; 1 thread; 0.2 s; 32 MiB file")


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    cfg = SweepConfig()
    if args.quick:
        for k, v in QUICK.items():
            cfg.set(k, v, "--quick")
    if args.config_file:
        with open(args.config_file, "rb") as f:
            for k, v in tomllib.load(f).items():
                cfg.set(k, v, args.config_file)
    for k in ("targets", "engines", "block_sizes", "patterns", "threads", "seconds", "file_size",
              "out", "local_dir", "mount", "config", "dir", "pfs_dir"):
        v = getattr(args, k)
        if v is not None:
            cfg.set(k, v, f"--{k.replace('_', '-')}")
    if args.drop_caches:
        cfg.drop_caches = True
    return cfg


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pfs bench sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.add_argument("--json", metavar="PATH", help="write all results here (as the other "
                                                  "benchmarks; the CSV stays in --out)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    res = run(cfg, fresh=args.fresh)
    print(report(res["points"], res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2, default=str)
    log(f"sweep: results, CSV and plots in {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
