"""``pfs bench wire``: what wire security costs on the data path (docs/security.md).

Three parts, in one run:

- ``primitives``: µs per call and GB/s of one core for the candidate MACs and AEADs from
  ``cryptography`` and ``hashlib`` over 4 KiB and 1 MiB (what the suites were chosen by),
  with a memory copy for scale.
- ``frames``: one process, two framed connections over a socket pair (the real
  transport, pfs/core/wire/transport.py): CPU µs per frame, sender and receiver
  together, for plain, mac and encrypt frames from a buffer and from a file (plain: with
  ``sendfile``; sealed: read into user space, sealed, sent), and the option not taken
  for the sealed file path: ``sendfile`` plus a second read of the same range to MAC it.
- ``reads``: two local clusters, one in key mode (its data servers allow every level,
  so the client's ``wire_security`` decides: none, mac, encrypt) and one in TLS mode;
  random aligned 1 MiB and 4 KiB reads of one file over TCP (short-circuit off), the
  modes alternated for ``--rounds`` rounds: reads/s, CPU µs per read (client and data
  servers) and GB/s per core, medians.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from pfs.bench.common import CpuMeter, fmt_size, parse_size, self_cpu
from pfs.core.wire import seal
from pfs.core.wire.protocol import Kind
from pfs.core.wire.transport import Connection
from pfs.tools import cluster

MODES = ("none", "mac", "encrypt", "tls")


# -- primitives --------------------------------------------------------------------
def _per_call(fn: Callable[[], object], seconds: float) -> float:
    """µs per call of ``fn``: the best of three runs of about ``seconds`` / 3 each."""
    fn()
    best = float("inf")
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        deadline = t0 + seconds / 3
        while True:
            for _ in range(8):
                fn()
            n += 8
            t = time.perf_counter()
            if t >= deadline:
                break
        best = min(best, (t - t0) / n)
    return best * 1e6


def _candidates(data: bytes, buf: bytearray) -> dict[str, Callable[[], object]]:
    """The MACs and AEADs considered, each as one call over ``data``."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    k16, k32, nonce, head = os.urandom(16), os.urandom(32), bytes(12), os.urandom(64)
    gcm128, gcm256, chacha = AESGCM(k16), AESGCM(k32), ChaCha20Poly1305(k32)
    size = len(data)
    return {
        "AES-128-GMAC (AES-GCM, tag only)": lambda: gcm128.encrypt(nonce, head, data),
        "AES-256-GMAC": lambda: gcm256.encrypt(nonce, head, data),
        "AES-128-GCM encrypt": lambda: gcm128.encrypt_into(nonce, data, head, buf),
        "AES-256-GCM encrypt": lambda: gcm256.encrypt_into(nonce, data, head, buf),
        "ChaCha20-Poly1305 encrypt": lambda: chacha.encrypt_into(nonce, data, head, buf),
        "ChaCha20-Poly1305, tag only": lambda: chacha.encrypt(nonce, head, data),
        "Poly1305": lambda: Poly1305.generate_tag(k32, data),
        "BLAKE2b keyed (hashlib)": lambda: hashlib.blake2b(data, key=k32,
                                                           digest_size=16).digest(),
        "HMAC-SHA256": lambda: hmac.digest(k32, data, "sha256"),
        "memory copy (reference)": lambda: buf.__setitem__(slice(0, size), data),
    }


def primitives(sizes: tuple[int, ...] = (4096, 1 << 20),
               seconds: float = 0.5) -> dict[str, dict[str, float]]:
    """µs per call of each candidate, per size."""
    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        cands = _candidates(os.urandom(size), bytearray(size + 16))
        out[fmt_size(size)] = {name: _per_call(fn, seconds) for name, fn in cands.items()}
    return out


# -- frames over a socket pair ------------------------------------------------------
async def _frames(mode: str, size: int, count: int, path: str | None,
                  mac_copy: bool = False) -> float:
    """CPU µs per frame (both ends, this process) for ``count`` frames of ``size``."""
    import socket

    a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    tx, rx = Connection(a, name="tx"), Connection(b, name="rx")
    if mode != "none":
        key = os.urandom(32)
        k1, k2 = seal.session_keys(key, bytes(32), bytes(32), mode.encode())
        suite = seal.MAC if mode == "mac" else seal.ENCRYPT
        tx.install(seal.Session(suite, k1, k2, "rx"))
        rx.install(seal.Session(suite, k2, k1, "tx"))
    payload = os.urandom(size)
    dest = memoryview(bytearray(size))
    fd = os.open(path, os.O_RDONLY) if path else -1
    scratch = bytearray(size) if mac_copy else None
    other = seal.Sealer(bytes(16), False)  # mac_copy: a MAC nobody checks, for its cost

    async def send() -> None:
        for i in range(count):
            if fd < 0:
                await tx.send_frame(Kind.REPLY, i, {"n": size}, payload)
            else:
                if scratch is not None:  # the option not taken: MAC a second read
                    os.preadv(fd, [scratch], 0)
                    other.payload_tag([memoryview(scratch)])
                await tx.send_frame_from_file(Kind.REPLY, i, {"n": size}, fd, 0, size)

    async def recv() -> None:
        for _ in range(count):
            head = await rx.recv_head()
            assert head is not None
            await rx.recv_payload_into(dest[:head.payload_len])

    c0 = self_cpu()
    try:
        async with trio.open_nursery() as n:
            n.start_soon(send)
            n.start_soon(recv)
    finally:
        tx.close()
        rx.close()
        if fd >= 0:
            os.close(fd)
    return (self_cpu() - c0) / count * 1e6


def frames(sizes: tuple[int, ...] = (4096, 1 << 20), total: int = 256 << 20
           ) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with tempfile.NamedTemporaryFile(prefix="pfs-bench-wire-") as f:
        f.write(os.urandom(max(sizes)))
        f.flush()
        for size in sizes:
            count = max(200, min(20000, total // size))
            row: dict[str, float] = {}
            for mode in ("none", "mac", "encrypt"):
                row[f"{mode}, from a buffer"] = trio.run(_frames, mode, size, count, None)
                row[f"{mode}, from a file"] = trio.run(_frames, mode, size, count, f.name)
            row["none, sendfile + a second read to MAC (not taken)"] = trio.run(
                _frames, "none", size, count, f.name, True)
            out[fmt_size(size)] = row
    return out


# -- reads from clusters -------------------------------------------------------------
async def _measure(toml: Path, mode: str, path: str, size: int, block: int,
                   seconds: float, concurrency: int, pids: list[int]) -> dict[str, float]:
    from pfs.client.aio import AsyncClient
    from pfs.core.config import ClientConfig, load

    cfg = load(ClientConfig, toml)
    cfg.short_circuit = False  # every read a request over TCP
    if mode != "tls":
        cfg.wire_security = mode
    async with AsyncClient.connect(cfg) as c:
        f = await c.open(path, "rb")
        blocks = size // block
        done = 0
        bufs = [bytearray(block) for _ in range(concurrency)]
        for b in bufs:  # warm: connections made, capabilities verified
            await f.pread_into(b, 0)
        deadline = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            nonlocal done
            rng = random.Random(i)
            buf = bufs[i]
            while time.perf_counter() < deadline:
                await f.pread_into(buf, rng.randrange(blocks) * block)
                done += 1

        span: dict[str, Any] = {}
        with CpuMeter(pids).span(span):
            async with trio.open_nursery() as n:
                for i in range(concurrency):
                    n.start_soon(worker, i)
        await f.close()
    cpu = span["cpu_self_s"] + span["cpu_servers_s"]
    return {"reads_per_s": done / span["seconds"],
            "cpu_us_per_read": cpu / done * 1e6 if done else 0.0,
            "GBps_per_core": done * block / cpu / 1e9 if cpu > 0 else 0.0}


def reads(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    key_dir, tls_dir = base / "key", base / "tls"
    (base / "key-data.toml").write_text('wire_security = "none"\n')  # the client decides
    tomls: dict[str, Path] = {}
    pids: dict[str, list[int]] = {}
    try:
        tomls["key"] = cluster.up(key_dir, data_servers=args.data_servers,
                                  data_args=["--config", str(base / "key-data.toml")])
        tomls["tls"] = cluster.up(tls_dir, data_servers=args.data_servers, tls=True)
        for name, d in (("key", key_dir), ("tls", tls_dir)):
            pids[name] = [p for n, p in cluster.running(d).items() if n != "meta"]
        data = random.Random(1).randbytes(args.size)
        import pfs

        for toml in tomls.values():
            with pfs.connect(config=toml) as c:
                c.set_layout("/", count=args.data_servers, unit=1 << 20)
                c.write_file("/bench.bin", data)
        res: dict[str, dict[str, list[dict[str, float]]]] = {
            m: {"1MiB": [], "4KiB": []} for m in MODES}
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for label, block in (("1MiB", 1 << 20), ("4KiB", 4096)):
                for mode in order:
                    where = "tls" if mode == "tls" else "key"
                    res[mode][label].append(trio.run(
                        _measure, tomls[where], mode, "/bench.bin", args.size, block,
                        args.seconds, args.concurrency, pids[where]))
        out: dict[str, Any] = {}
        for label in ("1MiB", "4KiB"):
            row: dict[str, Any] = {}
            for mode in MODES:
                runs = res[mode][label]
                row[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            base_cpu = row["none"]["cpu_us_per_read"]
            for mode in MODES:
                cpu = row[mode]["cpu_us_per_read"]
                row[mode]["cpu_vs_none_pct"] = 100 * (cpu - base_cpu) / base_cpu if base_cpu else 0.0
            out[label] = row
        return out
    finally:
        for d in (key_dir, tls_dir):
            if d.exists():
                cluster.down(d)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not args.no_micro:
        sizes = (4096, min(1 << 20, args.size))
        out["primitives_us"] = primitives(sizes, args.micro_seconds)
        out["frames_cpu_us"] = frames(sizes)
    if args.no_clusters:
        return out
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="pfs-bench-wire-"))
    try:
        out["reads"] = reads(args, base)
        out.update({"size": args.size, "rounds": args.rounds, "seconds": args.seconds,
                    "concurrency": args.concurrency, "data_servers": args.data_servers})
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return out


def _print(out: dict[str, Any], args: argparse.Namespace) -> None:
    for title, key, unit in (("primitives (one core, best of 3)", "primitives_us", "us/call"),
                             ("frames over a socket pair (CPU, both ends)", "frames_cpu_us",
                              "us CPU/frame")):
        if key not in out:
            continue
        print(title)
        for size, row in out[key].items():
            nbytes = parse_size(size.replace(" ", ""))
            for name, us in row.items():
                print(f"  {size:>8} {name:<52} {us:>9.1f} {unit}  "
                      f"{nbytes / us / 1e3:>6.2f} GB/s")
    if "reads" in out:
        print(f"reads over TCP: {fmt_size(args.size)} file, {args.data_servers} data servers, "
              f"{args.concurrency} in flight, median of {args.rounds} x {args.seconds:g} s")
        print(f"{'read':>6} {'mode':>8} {'reads/s':>10} {'CPU us/read':>12} "
              f"{'GB/s/core':>10} {'CPU vs none':>12}")
        for label, row in out["reads"].items():
            for mode, r in row.items():
                print(f"{label:>6} {mode:>8} {r['reads_per_s']:>10.0f} "
                      f"{r['cpu_us_per_read']:>12.1f} {r['GBps_per_core']:>10.2f} "
                      f"{r['cpu_vs_none_pct']:>+11.1f}%")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pfs bench wire", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="file size")
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=8, help="reads in flight")
    p.add_argument("--data-servers", type=int, default=2)
    p.add_argument("--micro-seconds", type=float, default=0.5,
                   help="per primitive and size")
    p.add_argument("--no-micro", action="store_true", help="skip primitives and frames")
    p.add_argument("--no-clusters", action="store_true", help="only primitives and frames")
    p.add_argument("--dir", help="where the clusters live (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print(out, args)
    return 0
