"""``pfs bench caps``: what security costs on the data path.

Two local clusters in one run, identical but for one test-only switch: in one the data
servers check every request's capability (the default), in the other they are started
with ``--insecure-skip-caps``. Both are authenticated (key mode) and both clients send
capabilities, so the difference is the check itself: the per-connection cache lookup,
the rights/object/expiry/fence comparisons and, for a capability not seen before on the
connection, one Ed25519 verification. Reads of 1 MiB and 4 KiB at random aligned offsets
of one file over TCP (short-circuit reads off, so every read is a request a data server
checks), ``--concurrency`` reads in flight; the two clusters are measured in
alternating order for ``--rounds`` rounds and the medians compared (noisy machines).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from pfs.bench.common import fmt_size, parse_size
from pfs.core import caps
from pfs.tools import cluster


async def _measure(toml: Path, path: str, size: int, block: int, seconds: float,
                   concurrency: int) -> float:
    from pfs.client.aio import AsyncClient
    from pfs.core.config import ClientConfig, load

    # Every read must reach a data server, which checks its capability: with short-circuit
    # on (the default where the data servers are on this host) the client would read the
    # objects itself after one check at descriptor hand-out, and nothing would be measured.
    cfg = load(ClientConfig, toml)
    cfg.short_circuit = False
    async with AsyncClient.connect(cfg) as c:
        f = await c.open(path, "rb")
        blocks = size // block
        done = 0
        bufs = [bytearray(block) for _ in range(concurrency)]
        for b in bufs:  # warm: connections made, capability verified once per connection
            await f.pread_into(b, 0)
        deadline = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            nonlocal done
            rng = random.Random(i)
            buf = bufs[i]
            while time.perf_counter() < deadline:
                await f.pread_into(buf, rng.randrange(blocks) * block)
                done += 1

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for i in range(concurrency):
                n.start_soon(worker, i)
        elapsed = time.perf_counter() - t0
        await f.close()
    return done / elapsed


def micro(n: int = 20000) -> dict[str, float]:
    """Microseconds per check, measured in this process with the data server's pieces: a
    capability already verified on the connection (every request after the first: the
    connection's cache, then rights, object and expiry), and the first sight of one (an
    Ed25519 verification)."""
    signer = caps.CapSigner.generate()
    cap_bytes, _ = signer.issue(5, caps.READ | caps.WRITE)
    verifier = caps.CapVerifier(signer.public_bytes)
    cache = caps.CapCache(verifier)

    def check() -> None:
        cap = cache.get(cap_bytes)
        if not (cap.rights & caps.READ and cap.covers(5, 1) and cap.expiry >= time.time()):
            raise AssertionError("the benchmark's capability was refused")

    check()
    t0 = time.perf_counter()
    for _ in range(n):
        check()
    cached = (time.perf_counter() - t0) / n * 1e6
    m = max(1, n // 20)
    t0 = time.perf_counter()
    for _ in range(m):
        verifier.verify(cap_bytes)
    first = (time.perf_counter() - t0) / m * 1e6
    return {"cached_us": cached, "first_us": first}


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="pfs-bench-caps-"))
    dirs = {"on": base / "caps-on", "off": base / "caps-off"}
    tomls: dict[str, Path] = {}
    try:
        for mode, d in dirs.items():
            tomls[mode] = cluster.up(d, data_servers=args.data_servers,
                                     data_args=["--insecure-skip-caps"] if mode == "off" else None)
        data = random.Random(1).randbytes(args.size)
        import pfs

        for toml in tomls.values():
            with pfs.connect(config=toml) as c:
                c.set_layout("/", count=args.data_servers, unit=1 << 20)
                c.write_file("/bench.bin", data)
        results: dict[str, dict[str, list[float]]] = {
            m: {"1MiB": [], "4KiB": []} for m in dirs}
        for r in range(args.rounds):
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            for label, block in (("1MiB", 1 << 20), ("4KiB", 4096)):
                for mode in order:
                    rate = trio.run(_measure, tomls[mode], "/bench.bin", args.size, block,
                                    args.seconds, args.concurrency)
                    results[mode][label].append(rate)
        out: dict[str, Any] = {"size": args.size, "rounds": args.rounds,
                               "seconds": args.seconds, "concurrency": args.concurrency,
                               "data_servers": args.data_servers, "reads_per_s": {},
                               "check_us": micro()}
        for label in ("1MiB", "4KiB"):
            on = statistics.median(results["on"][label])
            off = statistics.median(results["off"][label])
            out["reads_per_s"][label] = {"caps_on": on, "caps_off": off,
                                         "slowdown_pct": 100 * (off - on) / off if off else 0.0,
                                         "all_on": results["on"][label],
                                         "all_off": results["off"][label]}
        return out
    finally:
        for d in dirs.values():
            if d.exists():
                cluster.down(d)
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pfs bench caps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="file size")
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=8, help="reads in flight")
    p.add_argument("--data-servers", type=int, default=2)
    p.add_argument("--dir", help="where the two clusters live (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--json", metavar="PATH", help="write all results here (- : print them "
                                                  "instead of the table)")
    args = p.parse_args(argv)
    out = run(args)
    if args.json == "-":
        print(json.dumps(out, indent=2))
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(f"capability checks on vs off: {fmt_size(args.size)} file, {args.data_servers} data "
          f"servers, {args.concurrency} reads in flight, median of {args.rounds} x "
          f"{args.seconds:g} s")
    print(f"{'read size':>10} {'checks on':>14} {'checks off':>14} {'cost':>8}")
    for label, r in out["reads_per_s"].items():
        print(f"{label:>10} {r['caps_on']:>10.0f} /s {r['caps_off']:>10.0f} /s "
              f"{r['slowdown_pct']:>+7.1f}%")
    m = out["check_us"]
    print(f"one check: {m['cached_us']:.2f} us with the capability cached on the connection, "
          f"{m['first_us']:.0f} us the first time (Ed25519)")
    sys.stdout.flush()
    return 0
