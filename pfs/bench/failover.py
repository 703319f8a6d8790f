"""``pfs bench failover``: how long reads stall when a replica fails. A file with two
replicas per stripe is read in a loop; one data server holding a replica of it is
stopped (SIGSTOP: a hung process, its connections open) or killed (SIGKILL: connections
refused), and the benchmark records the time from the fault to the first read that
completes after it, the longest and median read in the seconds after, and when the
metaserver showed the server ``down``. The server is then resumed (SIGCONT) or started
again and the time until it shows ``up`` is recorded. Each fault is measured with reads
over TCP (``network``) and, where the servers are local, through short-circuit
descriptors (``local``). Needs a cluster whose processes it may signal: its own, or
``--dir``."""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
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
    table,
    work_dir,
)

FAULTS = ("sigstop", "kill")
PATHS = ("network", "local")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cluster directory: use (or start) the cluster there")
    p.add_argument("--size", type=parse_size, default=64 << 20, help="file size (default 64M)")
    p.add_argument("--unit", type=parse_size, default=4 << 20, help="stripe unit (default 4M)")
    p.add_argument("--count", type=int, default=2, help="stripe count (default 2)")
    p.add_argument("--data-servers", type=int, default=3)
    p.add_argument("--after", type=float, default=8.0,
                   help="seconds of reads measured after each fault (default 8)")
    p.add_argument("--faults", default=",".join(FAULTS), help="sigstop,kill")
    p.add_argument("--paths", default=",".join(PATHS), help="network,local")
    p.add_argument("--local-dir", help="scratch space (own cluster)")
    p.add_argument("--json", help="write all results here")


def _servers(c: Any) -> dict[str, dict[str, Any]]:
    return c._run(c.aio.meta.servers)  # type: ignore[no-any-return]


def _process_of(d: Path, sid: str) -> tuple[str, int]:
    from pfs.tools import cluster

    for name, pid in cluster.running(d).items():
        idf = d / "data" / f"ds{name[4:]}" / "server.id"
        if name.startswith("data") and idf.exists() and idf.read_text().strip() == sid:
            return name, pid
    raise RuntimeError(f"no process of the cluster in {d} serves {sid}")


def _until(cond: Any, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def _one(d: Path, toml: Path, fault: str, path: str, args: argparse.Namespace,
         data: memoryview) -> dict[str, Any]:
    import pfs
    from pfs.core.config import ClientConfig, load
    from pfs.tools import cluster

    cfg = dataclasses.replace(load(ClientConfig, toml), short_circuit=path == "local")
    with pfs.connect(config=cfg) as c:
        name = f"/bench-failover-{os.getpid()}-{fault}-{path}"
        c.makedirs(name, exist_ok=True)
        c.set_layout(name, count=args.count, unit=args.unit, replicas=2)
        c.write_file(f"{name}/f", data)
        victim = c.get_layout(f"{name}/f")["servers"][0][0]
        proc, pid = _process_of(d, victim)
        for _ in range(3):  # latency estimates, descriptors
            c.read_file(f"{name}/f")
        ends: list[tuple[float, float]] = []  # (end, seconds) of each read
        bad: list[str] = []
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    ok = c.read_file(f"{name}/f") == data
                except OSError as exc:
                    bad.append(str(exc))
                    continue
                if not ok:
                    bad.append("wrong bytes")
                ends.append((time.monotonic(), time.monotonic() - t))

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        time.sleep(0.5)
        os.kill(pid, signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
        t_fault = time.monotonic()
        down = _until(lambda: _servers(c)[victim]["state"] == "down", args.after)
        time.sleep(max(0.0, args.after - (time.monotonic() - t_fault)))
        stop.set()
        if fault == "sigstop":
            os.kill(pid, signal.SIGCONT)
        else:
            cluster.up(d)
        th.join(120)
        back = _until(lambda: _servers(c)[victim]["state"] == "up", 30.0)
        after = [(e, s) for e, s in ends if e > t_fault]
        c.remove(f"{name}/f")
        c.rmdir(name)
    return {"fault": fault, "path": path, "server": victim, "process": proc,
            "first_read_s": (after[0][0] - t_fault) if after else None,
            "reads_after": len(after),
            "max_read_s": max((s for _, s in after), default=None),
            "median_read_s": median([s for _, s in after]) if after else None,
            "down_s": down, "up_again_s": back, "errors": bad[:5], "n_errors": len(bad)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    faults = [f for f in args.faults.split(",") if f]
    paths = [p for p in args.paths.split(",") if p]
    for f in faults:
        if f not in FAULTS:
            raise SystemExit(f"pfs bench failover: unknown fault {f!r}; known: {FAULTS}")
    with work_dir(args.local_dir, "pfs-bench-failover-") as wd, \
            cluster_for(args, wd, args.data_servers) as cut:
        if cut.dir is None:
            raise SystemExit("pfs bench failover: needs a cluster it may signal (--dir)")
        data = memoryview(random_buffer(args.size))
        result: dict[str, Any] = {"bench": "failover", "machine": machine_info(wd),
                                  "config": {"size": args.size, "unit": args.unit,
                                             "count": args.count, "replicas": 2,
                                             "after_s": args.after}, "points": []}
        for fault in faults:
            for path in paths:
                log(f"{fault}, reads over {path}: {fmt_size(args.size)} file")
                result["points"].append(_one(cut.dir, cut.client_toml, fault, path, args,
                                             data))
    return result


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def report(res: dict[str, Any]) -> str:
    rows = [[p["fault"], p["path"], _s(p["first_read_s"]), _s(p["max_read_s"]),
             _s(p["median_read_s"]), str(p["reads_after"]), _s(p["down_s"]),
             _s(p["up_again_s"]), str(p["n_errors"])] for p in res["points"]]
    cfg = res["config"]
    return "\n".join([
        f"pfs bench failover: {fmt_size(cfg['size'])} file, 2 replicas, reads in a loop; "
        "seconds from the fault",
        table(rows, ["fault", "reads", "first read", "max read", "median read", "reads",
                     "down", "up again", "errors"])])


def main(argv: list[str]) -> int:
    return bench_main("failover", __doc__, add_args, run, report, argv)
