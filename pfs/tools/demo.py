"""The README's first command: a local cluster, a real workload, a printed result.

Starts (or reuses) a cluster in DIR, writes a tree of files — one large striped file and
a few hundred small ones — through the native client, reads everything back, checks
SHA-256 digests, and prints what it did and how fast.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pfs
from pfs.client.sync import Client
from pfs.tools import cluster
from pfs.tools.fscmds import rm_tree


def run_demo(d: Path, size: int, keep: bool = False) -> None:
    t_up = time.perf_counter()
    client_toml = cluster.up(d)
    print(f"cluster up in {time.perf_counter() - t_up:.1f} s: {client_toml}")
    try:
        with pfs.connect(config=client_toml) as c:
            _workload(c, size)
    finally:
        if not keep:
            cluster.down(d)
            print(f"cluster in {d} stopped (data kept; `pfs cluster up --dir {d}` restarts it)")
        else:
            print(f"cluster left running: PFS_CONFIG={client_toml} pfs ls /demo")


def _workload(c: Client, size: int) -> None:
    root = "/demo"
    if c.exists(root):
        rm_tree(c, root)
    c.makedirs(f"{root}/small")
    layout = c.set_layout(root, count=4, unit=1 << 20)
    print(f"{root}: stripe count {layout['count']}, unit {layout['unit'] >> 10} KiB")

    data = os.urandom(size)
    want = hashlib.sha256(data).hexdigest()
    t0 = time.perf_counter()
    with c.open(f"{root}/big.bin", "wb") as f:
        f.write(data)
    t_write = time.perf_counter() - t0

    small = {f"{root}/small/f{i:04d}": os.urandom(1 + (i * 7919) % 20000) for i in range(300)}
    t0 = time.perf_counter()
    for path, blob in small.items():
        with c.open(path, "wb") as f:
            f.write(blob)
    t_small = time.perf_counter() - t0

    buf = bytearray(size)
    t0 = time.perf_counter()
    with c.open(f"{root}/big.bin", "rb") as f:
        n = f.readinto(buf)
    t_read = time.perf_counter() - t0
    got = hashlib.sha256(memoryview(buf)[:n]).hexdigest()
    bad = [p for p, blob in small.items() if c.read_file(p) != blob]
    layout = c.get_layout(f"{root}/big.bin")
    servers = sorted({s for stripe in layout["servers"] for s in stripe})

    print(f"wrote {size / 2**20:.0f} MiB striped over {len(servers)} data servers "
          f"in {t_write:.2f} s ({size / t_write / 1e9:.2f} GB/s)")
    print(f"read it back in {t_read:.2f} s ({size / t_read / 1e9:.2f} GB/s)")
    print(f"wrote {len(small)} small files in {t_small:.2f} s ({len(small) / t_small:.0f} files/s)")
    ok = got == want and n == size and not bad
    print(f"sha256 {got[:16]}... {'matches' if got == want else 'DIFFERS'}; "
          f"small files {'all match' if not bad else f'{len(bad)} differ'}")
    print("RESULT: " + ("OK" if ok else "FAILED"))
    if not ok:
        raise SystemExit(1)
