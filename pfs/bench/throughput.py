"""``pfs bench throughput``: sequential write and read of one large file through the native
client, beside the references measured in the same run on the same machine:

- **local**: the same bytes written to a plain file (``os.write`` in the same chunks, then
  ``fsync``) in the filesystem that holds the data servers' objects, read back warm (page
  cache) and cold (after ``drop_caches``; root only), into the same preallocated buffer;
- **socket**: the same number of bytes over one loopback TCP connection from a separate
  sender process (``sendall`` of 64 MiB slices) into the preallocated buffer
  (``recv_into``): the ceiling for anything that moves bytes through the network stack.

pfs write = open (create) + writes of ``--chunk`` bytes + fsync + close, so it is durable
like the local write. pfs read = open + ``readinto`` of ``--chunk`` slices of a buffer
allocated once + close; "warm" means the data servers' object files are in their page
cache (just written), "cold" means every cache was dropped first. ``pfs_read_*`` go over
TCP (short-circuit off: what a node without a local data server gets); ``pfs_sc_read_*``
are the same reads short-circuited (the data servers run on this host, so the client reads
their objects through descriptors they hand over). Every read is checked bit-exact against
what was written (outside the timed span).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pfs.bench.common import (
    CpuMeter,
    aim,
    bench_main,
    cluster_for,
    drop_caches,
    fmt_size,
    log,
    machine_info,
    median_record,
    parse_size,
    proc_cpu,
    rate_fields,
    ratio,
    steps,
    table,
    work_dir,
)

PATHS = ("local_write", "local_read_warm", "local_read_cold",
         "pfs_write", "pfs_read_warm", "pfs_read_cold", "pfs_sc_read_warm", "pfs_sc_read_cold",
         "socket")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cluster directory: the cluster there (a stopped one is "
                                 "started for the run and stopped after)")
    p.add_argument("--config", help="client.toml of a running cluster to use")
    p.add_argument("--size", type=parse_size, default=1 << 30, help="file size (default 1G)")
    p.add_argument("--count", type=int, default=4, help="stripe count (default 4)")
    p.add_argument("--replicas", type=int, default=0,
                   help="replicas per stripe (default: the cluster's, 2 where it has two "
                        "or more data servers)")
    p.add_argument("--unit", type=parse_size, default=1 << 20, help="stripe unit (default 1M)")
    p.add_argument("--chunk", type=parse_size, default=64 << 20,
                   help="bytes per read/write call, local and pfs alike (default 64M)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; medians reported (default 3)")
    p.add_argument("--data-servers", type=int, default=4,
                   help="data servers of the cluster this command starts (default 4)")
    p.add_argument("--local-dir", help="where the local reference file (and the bench's own "
                                       "cluster) live; default: the temp dir")
    p.add_argument("--no-cold", action="store_true", help="skip the cold (cache-dropped) reads")
    p.add_argument("--no-checksums", action="store_true",
                   help="MEASUREMENT ONLY: the cluster this command starts keeps no block "
                        "checksums (compare with a run without it)")
    p.add_argument("--quick", action="store_true", help="small and fast: 64M, 1 rep")
    p.add_argument("--json", help="write all results here")


# -- local file ------------------------------------------------------------------------
def _write_all(fd: int, view: memoryview, chunk: int) -> None:
    off = 0
    while off < len(view):
        off += os.write(fd, view[off:off + chunk])


def local_write(path: Path, data: memoryview, chunk: int, meter: CpuMeter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with meter.span(out):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
    return rate_fields(len(data), out)


def local_read(path: Path, buf: memoryview, chunk: int, meter: CpuMeter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with meter.span(out):
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < len(buf):
                n = f.readinto(buf[got:got + chunk])
                if not n:
                    break
                got += n
    if got != len(buf):
        raise RuntimeError(f"local read returned {got} of {len(buf)} bytes")
    return rate_fields(got, out)


# -- pfs native client ---------------------------------------------------------------
def pfs_write(c: Any, path: str, data: memoryview, chunk: int, meter: CpuMeter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with meter.span(out):
        with c.open(path, "wb") as f:
            off = 0
            while off < len(data):
                off += f.write(data[off:off + chunk])
            f.fsync()
    return rate_fields(len(data), out)


def pfs_read(c: Any, path: str, buf: memoryview, chunk: int, meter: CpuMeter) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with meter.span(out):
        with c.open(path, "rb") as f:
            got = 0
            while got < len(buf):
                n = f.readinto(buf[got:got + chunk])
                if not n:
                    break
                got += n
    if got != len(buf):
        raise RuntimeError(f"pfs read returned {got} of {len(buf)} bytes")
    return rate_fields(got, out)


# -- loopback socket ---------------------------------------------------------------
_SENDER = r"""
import os, socket, sys
port, size, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
block = os.urandom(min(chunk, size))
s = socket.create_connection(("127.0.0.1", port))
assert s.recv(1) == b"g"
view = memoryview(block)
left = size
while left:
    n = min(left, len(block))
    s.sendall(view[:n])
    left -= n
s.recv(1)  # the receiver says when it has everything: our CPU is read before we exit
"""


def socket_transfer(buf: memoryview, chunk: int, meter: CpuMeter) -> dict[str, Any]:
    """Bytes from a sender process over loopback TCP into ``buf`` (``recv_into``)."""
    size = len(buf)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, str(port), str(size), str(chunk)])
    out: dict[str, Any] = {}
    try:
        lsock.settimeout(60)
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(120)
            time.sleep(0.05)  # the sender has its block ready once it connected; settle
            c0 = proc_cpu(proc.pid)
            with meter.span(out):
                conn.sendall(b"g")
                got = 0
                while got < size:
                    n = conn.recv_into(buf[got:got + chunk])
                    if not n:
                        raise RuntimeError(f"sender closed after {got} of {size} bytes")
                    got += n
            c1 = proc_cpu(proc.pid)
            conn.sendall(b"d")
        proc.wait(timeout=30)
    finally:
        lsock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out["cpu_sender_s"] = c1 - c0
    return rate_fields(size, out, extra_cpu=c1 - c0)


# -- the run ---------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    import pfs

    if args.quick:
        args.size = min(args.size, 64 << 20)
        args.reps = 1
    size, chunk = args.size, args.chunk
    with work_dir(args.local_dir, "pfs-bench-tp-") as wd, \
            cluster_for(args, wd, args.data_servers) as cut:
        server_pids = list(cut.pids.values())
        meter_local = CpuMeter()
        meter_pfs = CpuMeter(server_pids)
        log(f"making {fmt_size(size)} of random data")
        data = random_buffer_view(size)
        rbuf = memoryview(bytearray(size))
        _prefault(rbuf)
        local_path = wd / "local-ref.bin"
        runs: list[dict[str, Any]] = []
        cold_ok = not args.no_cold
        result: dict[str, Any] = {
            "bench": "throughput",
            "machine": machine_info(wd),
            "config": {"size": size, "chunk": chunk, "stripe_count": args.count,
                       "replicas": args.replicas or "cluster default",
                       "stripe_unit": args.unit, "reps": args.reps,
                       "data_servers": len([n for n in cut.pids if n.startswith("data")]),
                       "server_pids_counted": len(server_pids),
                       "cluster": str(cut.dir) if cut.dir else None,
                       "local_file": str(local_path)},
        }
        from pfs.core.config import ClientConfig, load

        net_cfg = load(ClientConfig, cut.client_toml)
        net_cfg.short_circuit = False  # pfs_read_*: every byte over TCP (a remote node)
        with pfs.connect(config=cut.client_toml) as c, pfs.connect(config=net_cfg) as cn, \
                steps(args.reps, "throughput", unit="rep") as bar:
            bdir = f"/bench-tp-{os.getpid()}"
            c.makedirs(bdir, exist_ok=True)
            c.set_layout(bdir, count=args.count, unit=args.unit, replicas=args.replicas)
            lay = None
            try:
                for rep in range(args.reps):
                    r: dict[str, Any] = {}
                    log(f"rep {rep + 1}/{args.reps}: local write")
                    r["local_write"] = local_write(local_path, data, chunk, meter_local)
                    r["local_read_warm"] = local_read(local_path, rbuf, chunk, meter_local)
                    _check(rbuf, data, "local warm read")
                    if cold_ok:
                        cold_ok = drop_caches()
                        if cold_ok:
                            r["local_read_cold"] = local_read(local_path, rbuf, chunk, meter_local)
                            _check(rbuf, data, "local cold read")
                        else:
                            log("cannot drop caches (not root): cold reads skipped")
                    os.unlink(local_path)

                    path = f"{bdir}/f{rep}"
                    log(f"rep {rep + 1}/{args.reps}: pfs write")
                    r["pfs_write"] = pfs_write(c, path, data, chunk, meter_pfs)
                    lay = lay or c.get_layout(path)
                    r["pfs_read_warm"] = pfs_read(cn, path, rbuf, chunk, meter_pfs)
                    _check(rbuf, data, "pfs warm read")
                    # pfs_sc_read_*: the same reads short-circuited (the data servers are
                    # on this host: the client reads their objects' descriptors itself)
                    r["pfs_sc_read_warm"] = pfs_read(c, path, rbuf, chunk, meter_pfs)
                    _check(rbuf, data, "pfs short-circuit warm read")
                    if cold_ok and drop_caches():
                        r["pfs_read_cold"] = pfs_read(cn, path, rbuf, chunk, meter_pfs)
                        _check(rbuf, data, "pfs cold read")
                        drop_caches()
                        r["pfs_sc_read_cold"] = pfs_read(c, path, rbuf, chunk, meter_pfs)
                        _check(rbuf, data, "pfs short-circuit cold read")
                    c.remove(path)

                    log(f"rep {rep + 1}/{args.reps}: loopback socket")
                    r["socket"] = socket_transfer(rbuf, chunk, meter_local)
                    runs.append(r)
                    log("  " + "  ".join(f"{k}={v['GBps']:.2f}" for k, v in r.items()) + " GB/s")
                    bar.add(1)
            finally:
                try:
                    for e in c.listdir(bdir):
                        c.remove(f"{bdir}/{e}")
                    c.rmdir(bdir)
                except OSError:
                    pass
        result["layout"] = lay
    med = {k: median_record([r[k] for r in runs if k in r]) for k in PATHS if any(k in r for r in runs)}
    result["runs"] = runs
    result["median"] = med
    result["ratios"] = ratios(med)
    return result


def ratios(med: dict[str, Any]) -> dict[str, float]:
    def g(k: str, f: str = "GBps") -> float:
        return med.get(k, {}).get(f, 0.0)

    out = {
        "pfs_write/local_write": ratio(g("pfs_write"), g("local_write")),
        "pfs_read_warm/local_read_warm": ratio(g("pfs_read_warm"), g("local_read_warm")),
        "pfs_read_warm/socket": ratio(g("pfs_read_warm"), g("socket")),
        "pfs_write/socket": ratio(g("pfs_write"), g("socket")),
        "pfs_read_warm/local_read_warm per core": ratio(g("pfs_read_warm", "GBps_per_core"),
                                                        g("local_read_warm", "GBps_per_core")),
    }
    if "pfs_sc_read_warm" in med:
        out["pfs_sc_read_warm/local_read_warm"] = ratio(g("pfs_sc_read_warm"),
                                                        g("local_read_warm"))
    if "pfs_read_cold" in med and "local_read_cold" in med:
        out["pfs_read_cold/local_read_cold"] = ratio(g("pfs_read_cold"), g("local_read_cold"))
    if "pfs_sc_read_cold" in med and "local_read_cold" in med:
        out["pfs_sc_read_cold/local_read_cold"] = ratio(g("pfs_sc_read_cold"),
                                                        g("local_read_cold"))
    return {k: round(v, 3) for k, v in out.items()}


def random_buffer_view(size: int) -> memoryview:
    from pfs.bench.common import random_buffer

    return memoryview(random_buffer(size))


def _prefault(view: memoryview) -> None:
    """Touch every page of a fresh buffer so no timed read pays for page faults."""
    step = 64 << 20
    zero = bytes(step)
    for off in range(0, len(view), step):
        n = min(step, len(view) - off)
        view[off:off + n] = zero[:n]


def _check(buf: memoryview, data: memoryview, what: str) -> None:
    if buf != data:
        raise RuntimeError(f"{what}: bytes read differ from bytes written")
    _prefault(buf)  # scrub, so the next read cannot pass by leftover bytes


def report(res: dict[str, Any]) -> str:
    cfg, med = res["config"], res["median"]
    lines = [f"pfs bench throughput: {fmt_size(cfg['size'])}, stripe count {cfg['stripe_count']}, "
             f"unit {fmt_size(cfg['stripe_unit'])}, {fmt_size(cfg['chunk'])} per call, "
             f"{cfg['data_servers']} data servers, median of {cfg['reps']}",
             f"machine: {res['machine'].get('cpus')} CPUs ({res['machine'].get('cpu_model', '?')}), "
             f"{res['machine'].get('fs', '?')}",
             ""]
    rows = []
    for k in PATHS:
        if k not in med:
            continue
        m = med[k]
        rows.append([k, f"{m['GBps']:.3f}", f"{m['seconds']:.2f}", f"{m['cpu_total_s']:.2f}",
                     f"{m['GBps_per_core']:.3f}", f"{m['machine_busy_pct']:.0f}"])
    lines.append(table(rows, ["path", "GB/s", "s", "CPU s", "GB/s/core", "busy%"]))
    lines.append("")
    lines.append("ratios (GB/s):")
    for k, v in res["ratios"].items():
        lines.append(f"  {k:42s} {v:.3f}")
    r = res["ratios"]
    lines.append(aim("pfs read >= 0.5x local read", r.get("pfs_read_warm/local_read_warm")
                     if "pfs_read_warm" in med else None, 0.5))
    lines.append(aim("pfs write >= 0.5x local write", r.get("pfs_write/local_write")
                     if "pfs_write" in med else None, 0.5))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return bench_main("throughput", __doc__, add_args, run, report, argv)
