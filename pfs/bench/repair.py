"""``pfs bench repair``: how fast a lost server's replicas are put back, and what reads
see meanwhile. A cluster of its own (``--data-servers``, metaserver ``repair_rate`` from
``--rate``) holds ``--size`` bytes in files of two replicas per stripe; reads of every
file in a loop measure the read throughput before; then one data server is killed and
declared lost (``pfs admin lost``), and the benchmark records the time until no chain is
short (``pfs admin repair status``), the bytes re-copied (the lost server's object files)
and so the repair rate, and the read throughput during the repair. Every read is
compared with what was written."""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pfs.bench.common import (
    bench_main,
    fmt_size,
    log,
    machine_info,
    parse_size,
    random_buffer,
    table,
    work_dir,
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=parse_size, default=1 << 30, help="bytes written (default 1G)")
    p.add_argument("--files", type=int, default=8, help="files (default 8)")
    p.add_argument("--unit", type=parse_size, default=4 << 20, help="stripe unit (default 4M)")
    p.add_argument("--count", type=int, default=3, help="stripe count (default 3)")
    p.add_argument("--data-servers", type=int, default=4)
    p.add_argument("--rate", type=parse_size, default=0,
                   help="the metaserver's repair_rate, bytes/s (default 0: unbounded)")
    p.add_argument("--before", type=float, default=5.0,
                   help="seconds of reads measured before the loss (default 5)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds the repair may take (default 1800)")
    p.add_argument("--local-dir", help="scratch space (the cluster goes there)")
    p.add_argument("--json", help="write all results here")


class Reader:
    """Reads every file in a loop, comparing bytes; counts bytes per window."""

    def __init__(self, c: Any, files: dict[str, memoryview]) -> None:
        self.c, self.files = c, files
        self.nbytes = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for path, data in self.files.items():
                if self.stop.is_set():
                    return
                try:
                    if self.c.read_file(path) != data:
                        self.errors.append(f"{path}: wrong bytes")
                except OSError as exc:
                    self.errors.append(f"{path}: {exc}")
                    continue
                self.nbytes += len(data)

    def window(self, until: Any) -> tuple[float, float]:
        """Bytes/s read until ``until()`` is true; (rate, seconds)."""
        n0, t0 = self.nbytes, time.monotonic()
        while not until():
            time.sleep(0.05)
        secs = time.monotonic() - t0
        return (self.nbytes - n0) / secs if secs > 0 else 0.0, secs


def _objects_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("objects/*/*") if not p.name.endswith(".crc"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import pfs
    from pfs.core.messages import meta as M
    from pfs.tools import cluster
    from pfs.tools.admin_repair import call_plan

    with work_dir(args.local_dir, "pfs-bench-repair-") as wd:
        d = wd / "cluster"
        try:
            toml = cluster.up(d, data_servers=args.data_servers,
                              meta_settings={"repair_rate": args.rate})
            per = max(1, args.size // args.files)
            buf = memoryview(random_buffer(per))
            with pfs.connect(config=toml) as c:
                c.mkdir("/bench-repair")
                c.set_layout("/bench-repair", count=args.count, unit=args.unit, replicas=2)
                files = {f"/bench-repair/f{i}": buf for i in range(args.files)}
                log(f"writing {args.files} files of {fmt_size(per)}, 2 replicas")
                for path in files:
                    c.write_file(path, buf)
                victim = c.get_layout(next(iter(files)))["servers"][0][0]
                ids = {(p / "server.id").read_text().strip(): p
                       for p in (d / "data").glob("ds*")}
                lost_bytes = _objects_bytes(ids[victim])
                name = "data" + ids[victim].name[2:]
                reader = Reader(c, files)
                reader.thread.start()
                end = time.monotonic() + args.before
                before, _ = reader.window(lambda: time.monotonic() >= end)
                os.kill(cluster.running(d)[name], signal.SIGKILL)
                c._drive(call_plan, M.Lost(sid=victim, cred=c.aio.meta.wire_cred(c.aio.cred)))
                log(f"killed and declared lost {victim}: {fmt_size(lost_bytes)} to re-copy")
                deadline = time.monotonic() + args.timeout

                def settled() -> bool:
                    st = c._drive(call_plan, M.RepairStatus())
                    if time.monotonic() > deadline:
                        raise SystemExit("pfs bench repair: the repair did not finish in "
                                         f"{args.timeout} s")
                    return bool(st["short"] == 0 and not st["joining"]
                                and not st["copying"])

                during, secs = reader.window(settled)
                reader.stop.set()
                reader.thread.join(120)
        finally:
            cluster.down(d)
    return {"bench": "repair", "machine": machine_info(wd),
            "config": {"size": per * args.files, "files": args.files, "unit": args.unit,
                       "count": args.count, "data_servers": args.data_servers,
                       "rate": args.rate, "replicas": 2},
            "recopied_bytes": lost_bytes, "repair_s": secs,
            "repair_gbps": lost_bytes / secs / 1e9 if secs > 0 else 0.0,
            "read_before_gbps": before / 1e9, "read_during_gbps": during / 1e9,
            "errors": reader.errors[:5], "n_errors": len(reader.errors)}


def report(res: dict[str, Any]) -> str:
    cfg = res["config"]
    rows = [[fmt_size(res["recopied_bytes"]), f"{res['repair_s']:.2f}",
             f"{res['repair_gbps']:.3f}", f"{res['read_before_gbps']:.3f}",
             f"{res['read_during_gbps']:.3f}", str(res["n_errors"])]]
    return "\n".join([
        f"pfs bench repair: {fmt_size(cfg['size'])} in {cfg['files']} files, 2 replicas, "
        f"{cfg['data_servers']} data servers, repair_rate "
        f"{'unbounded' if not cfg['rate'] else fmt_size(cfg['rate']) + '/s'}",
        table(rows, ["re-copied", "repair s", "repair GB/s", "read GB/s before",
                     "read GB/s during", "errors"])])


def main(argv: list[str]) -> int:
    return bench_main("repair", __doc__, add_args, run, report, argv)
