"""``pfs bench meta``: file creates, stats and unlinks per second with 1 and N concurrent
clients, beside the raw LMDB transaction rate on the same disk in the same run.

Each client is a separate **process** (multiprocessing, spawn) with its own connection, its
own directory and its own share of the files: on a 2-core machine, async tasks in one
process would measure one Python interpreter's loop, not the metaserver; processes are
what N independent clients (or N nodes' mounts) look like to the server. The clients start
each phase together (a barrier); a phase's rate is all clients' operations divided by the
time from the first client's start to the last client's finish.

Operations through the native client's path API (what a program calls):
  create = ``open(path, "xb")`` + ``close()``  (O_CREAT|O_EXCL, then close: like fsbench.py)
  stat   = ``stat(path)``
  unlink = ``remove(path)``
  readdir = ``listdir(dir)`` of the client's own directory, 5 times; one op = one entry
and, with ``--batch N`` (default 256), again through the batched calls: ``create_many``,
``stat_many``, ``unlink_many`` of N paths per call (one commit per call for the changes).
The same loops run with ``os`` calls on any POSIX directory given with ``--posix DIR``
(a local directory, a pfs FUSE mount, a MooseFS mount).

Raw LMDB reference: a plain py-lmdb loop in a fresh environment beside the cluster's data,
``sync=True`` (fsync at every commit): one "op" puts an inode record (128 B) and a
directory entry, like a create does. Durable = one commit per op; batched = N ops per
commit, the ceiling for group commit.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfs.bench.common import (
    aim,
    bench_main,
    cluster_for,
    log,
    machine_info,
    median,
    proc_cpu,
    ratio,
    self_cpu,
    table,
    work_dir,
)

PHASES = ("create", "stat", "readdir", "unlink")
READDIR_PASSES = 5  # listings of its directory per client in the readdir phase
BARRIER_TIMEOUT = 600.0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cluster directory: use (or start) the cluster there")
    p.add_argument("--config", help="client.toml of a running cluster to use")
    p.add_argument("--clients", default="1,8", help="client counts, comma-separated (default 1,8)")
    p.add_argument("--files", type=int, default=4000,
                   help="files per phase, split over the clients (default 4000)")
    p.add_argument("--reps", type=int, default=1, help="repetitions; medians reported (default 1)")
    p.add_argument("--lmdb-ops", type=int, default=2000,
                   help="durable single-op LMDB transactions to time (default 2000)")
    p.add_argument("--lmdb-batch", default="8,256",
                   help="ops per LMDB transaction for the batched rates (default 8,256)")
    p.add_argument("--posix", action="append", default=[], metavar="DIR",
                   help="also run the same loops with os calls in DIR (repeatable; "
                        "LABEL=DIR to name it)")
    p.add_argument("--no-pfs", action="store_true", help="skip the pfs native client")
    p.add_argument("--batch", type=int, default=256, metavar="N",
                   help="also run the native client's batched calls (create_many, stat_many, "
                        "unlink_many), N paths per call (default 256; 0: not)")
    p.add_argument("--data-servers", type=int, default=4)
    p.add_argument("--local-dir", help="scratch space (LMDB reference, own cluster); default: temp dir")
    p.add_argument("--quick", action="store_true", help="small and fast: 400 files, 1,4 clients")
    p.add_argument("--json", help="write all results here")


# -- the client processes -------------------------------------------------------------
def _batched(fn: Callable[[list[str]], list[Any]], size: int) -> Callable[[list[str]], None]:
    """A phase over all paths through a batched call, ``size`` paths per call; an error
    of any path fails the run."""
    def run(paths: list[str]) -> None:
        for i in range(0, len(paths), size):
            for r in fn(paths[i:i + size]):
                if isinstance(r, OSError):
                    raise r
    return run


def _worker(backend: str, target: str, root: str, idx: int, n: int, barrier: Any,
            results: Any, batch: int = 0) -> None:
    """One client: its own directory, ``n`` files, the timed phases; ``batch`` > 0 (pfs
    only): create_many / stat_many / unlink_many with that many paths per call."""
    out: dict[str, Any] = {"idx": idx, "pid": os.getpid()}
    client: Any = None
    stat: Callable[[str], Any]
    unlink: Callable[[str], Any]
    try:
        if backend == "pfs":
            import pfs

            client = pfs.connect(config=target)
            d = f"{root}/w{idx}"
            client.makedirs(d, exist_ok=True)
            paths = [f"{d}/f{i:06d}" for i in range(n)]

            def create(p: str) -> None:
                client.open(p, "xb").close()

            stat, unlink, listdir = client.stat, client.remove, client.listdir
        else:
            d = os.path.join(target, root.lstrip("/"), f"w{idx}")
            os.makedirs(d, exist_ok=True)
            paths = [os.path.join(d, f"f{i:06d}") for i in range(n)]

            def create(p: str) -> None:
                os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))

            stat, unlink, listdir = os.stat, os.unlink, os.listdir
        ops = {"create": create, "stat": stat, "unlink": unlink}
        many: dict[str, Callable[[list[str]], None]] = {}
        if batch and backend == "pfs":
            many = {"create": _batched(client.create_many, batch),
                    "stat": _batched(client.stat_many, batch),
                    "unlink": _batched(client.unlink_many, batch)}
        for phase in PHASES:
            barrier.wait(BARRIER_TIMEOUT)
            c0 = self_cpu()
            t0 = time.monotonic()
            if phase == "readdir":  # one op = one entry listed
                count = sum(len(listdir(d)) for _ in range(READDIR_PASSES))
            elif phase in many:
                many[phase](paths)
                count = n
            else:
                fn = ops[phase]
                for p in paths:
                    fn(p)
                count = n
            t1 = time.monotonic()
            out[phase] = {"t0": t0, "t1": t1, "ops": count, "cpu_s": self_cpu() - c0}
        barrier.wait(BARRIER_TIMEOUT)
        if backend == "pfs":
            client.rmdir(d)
        else:
            os.rmdir(d)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out["error"] = f"{type(exc).__name__}: {exc}"
        barrier.abort()
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
        results.put(out)


def measure(backend: str, target: str, clients: int, files: int,
            server_pids: dict[str, int] | list[int], label: str, batch: int = 0
            ) -> dict[str, Any]:
    """Run ``clients`` processes over ``files`` files in all; rates per phase, and CPU
    per operation of the clients, the metaserver and the data servers apart
    (``server_pids``: name -> pid, the metaserver named ``meta``; a plain list of
    pids is counted as data servers)."""
    if isinstance(server_pids, list):
        server_pids = {f"server{i}": p for i, p in enumerate(server_pids)}
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients + 1)
    results = ctx.Queue()
    root = f"/bench-meta-{os.getpid()}-{clients}-{time.monotonic_ns()}"
    share = [files // clients + (1 if i < files % clients else 0) for i in range(clients)]
    procs = [ctx.Process(target=_worker, args=(backend, target, root, i, share[i], barrier,
                                               results, batch), daemon=True)
             for i in range(clients)]
    for pr in procs:
        pr.start()
    server_cpu: dict[str, float] = {}
    meta_cpu: dict[str, float] = {}
    meta_pids = [p for name, p in server_pids.items() if name.startswith("meta")]
    try:
        snaps: list[tuple[float, float]] = []
        for _ in range(len(PHASES) + 1):
            barrier.wait(BARRIER_TIMEOUT)
            snaps.append((sum(proc_cpu(p) for p in server_pids.values()),
                          sum(proc_cpu(p) for p in meta_pids)))
        for i, ph in enumerate(PHASES):
            server_cpu[ph] = snaps[i + 1][0] - snaps[i][0]
            meta_cpu[ph] = snaps[i + 1][1] - snaps[i][1]
    except Exception:  # noqa: BLE001 - a worker failed; its error comes through the queue
        pass
    outs = [results.get(timeout=BARRIER_TIMEOUT) for _ in procs]
    for pr in procs:
        pr.join(timeout=30)
        if pr.is_alive():
            pr.kill()
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"{label}, {clients} clients: {errors[0]}")
    rec: dict[str, Any] = {"label": label, "clients": clients, "files": files}
    for ph in PHASES:
        t0 = min(o[ph]["t0"] for o in outs)
        t1 = max(o[ph]["t1"] for o in outs)
        ops = sum(o[ph]["ops"] for o in outs)
        cpu_clients = sum(o[ph]["cpu_s"] for o in outs)
        cpu_servers = server_cpu.get(ph, 0.0)
        cpu_meta = meta_cpu.get(ph, 0.0)
        rec[ph] = {
            "ops_per_s": ops / (t1 - t0) if t1 > t0 else 0.0,
            "seconds": t1 - t0,
            "ops": ops,
            "cpu_clients_s": cpu_clients,
            "cpu_servers_s": cpu_servers,
            "cpu_us_per_op": 1e6 * (cpu_clients + cpu_servers) / ops if ops else 0.0,
            "client_us_per_op": 1e6 * cpu_clients / ops if ops else 0.0,
            "meta_us_per_op": 1e6 * cpu_meta / ops if ops else 0.0,
            "data_us_per_op": 1e6 * (cpu_servers - cpu_meta) / ops if ops else 0.0,
        }
    if backend != "pfs":
        shutil.rmtree(os.path.join(target, root.lstrip("/")), ignore_errors=True)
    else:
        _rm_pfs_dir(target, root)
    return rec


def _rm_pfs_dir(config: str, root: str) -> None:
    import pfs

    try:
        with pfs.connect(config=config) as c:
            for e in c.listdir(root):
                c.rmdir(f"{root}/{e}")
            c.rmdir(root)
    except OSError:
        pass


# -- raw LMDB ---------------------------------------------------------------------
def lmdb_rates(d: Path, ops: int, batches: list[int]) -> dict[str, Any]:
    """Durable put+commit rates of a plain py-lmdb loop in a fresh environment in ``d``."""
    import lmdb

    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    env = lmdb.open(str(d), map_size=1 << 30, sync=True, metasync=True, max_dbs=2)
    inodes = env.open_db(b"inodes")
    dents = env.open_db(b"dents")
    value = os.urandom(128)
    out: dict[str, Any] = {"ops_single": ops}
    try:
        def one(i: int, txn: Any) -> None:
            txn.put(i.to_bytes(8, "big"), value, db=inodes)
            txn.put(b"\0\0\0\0\0\0\0\1" + b"f%08d" % i, i.to_bytes(8, "big"), db=dents)

        c0, t0 = self_cpu(), time.perf_counter()
        for i in range(ops):
            with env.begin(write=True) as txn:
                one(i, txn)
        dt = time.perf_counter() - t0
        out["durable_1_per_txn"] = {"ops_per_s": ops / dt, "commits_per_s": ops / dt,
                                    "cpu_us_per_op": 1e6 * (self_cpu() - c0) / ops}
        base = ops
        for b in batches:
            n = max(ops, 40 * b)  # enough commits to time
            c0, t0 = self_cpu(), time.perf_counter()
            for start in range(0, n, b):
                with env.begin(write=True) as txn:
                    for i in range(base + start, base + min(n, start + b)):
                        one(i, txn)
            dt = time.perf_counter() - t0
            out[f"durable_{b}_per_txn"] = {"ops_per_s": n / dt, "commits_per_s": (n / b) / dt,
                                           "cpu_us_per_op": 1e6 * (self_cpu() - c0) / n}
            base += n
    finally:
        env.close()
        shutil.rmtree(d, ignore_errors=True)
    return out


# -- the run ---------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.files = min(args.files, 400)
        if args.clients == "1,8":
            args.clients = "1,4"
        args.lmdb_ops = min(args.lmdb_ops, 300)
    counts = [int(x) for x in args.clients.split(",") if x.strip()]
    batches = [int(x) for x in args.lmdb_batch.split(",") if x.strip()]
    posix = []
    for spec in args.posix:
        label, sep, path = spec.partition("=")
        posix.append((label, path) if sep else (f"posix:{spec}", spec))
    res: dict[str, Any] = {"bench": "meta"}
    with work_dir(args.local_dir, "pfs-bench-meta-") as wd:
        res["machine"] = machine_info(wd)
        res["config"] = {"clients": counts, "files": args.files, "reps": args.reps,
                         "client_kind": "processes (multiprocessing spawn), one connection each",
                         "lmdb_dir_fs": res["machine"].get("fs")}
        log("raw LMDB loop")
        res["lmdb"] = lmdb_rates(wd / "lmdb-ref", args.lmdb_ops, batches)
        targets: list[tuple[str, str, str, dict[str, int]]] = []
        rows: list[dict[str, Any]] = []
        if not args.no_pfs:
            with cluster_for(args, wd, args.data_servers) as cut:
                res["config"]["server_pids_counted"] = len(cut.pids)
                for n in counts:
                    for rep in range(args.reps):
                        log(f"pfs native, {n} client(s), rep {rep + 1}")
                        rows.append(measure("pfs", str(cut.client_toml), n, args.files,
                                            dict(cut.pids), "pfs native"))
                if args.batch:
                    for n in counts:
                        for rep in range(args.reps):
                            log(f"pfs native batched ({args.batch} paths per call), {n} "
                                f"client(s), rep {rep + 1}")
                            rows.append(measure("pfs", str(cut.client_toml), n, args.files,
                                                dict(cut.pids), f"pfs batched x{args.batch}",
                                                args.batch))
        for label, path in posix:
            targets.append(("posix", path, label, {}))
        for backend, target, label, pids in targets:
            for n in counts:
                for rep in range(args.reps):
                    log(f"{label}, {n} client(s), rep {rep + 1}")
                    rows.append(measure(backend, target, n, args.files, pids, label))
    res["runs"] = rows
    res["median"] = _medians(rows)
    return res


def _medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys: list[tuple[str, int]] = []
    for r in rows:
        if (r["label"], r["clients"]) not in keys:
            keys.append((r["label"], r["clients"]))
    out = []
    for label, n in keys:
        sel = [r for r in rows if r["label"] == label and r["clients"] == n]
        rec: dict[str, Any] = {"label": label, "clients": n, "runs": len(sel)}
        for ph in PHASES:
            rec[ph] = {k: median([r[ph][k] for r in sel]) for k in sel[0][ph]}
        out.append(rec)
    return out


def report(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"pfs bench meta: {res['config']['files']} files per phase, clients = separate "
             f"processes; machine: {m.get('cpus')} CPUs, {m.get('fs', '?')}", ""]
    rows = []
    for r in res["median"]:
        rows.append([r["label"], str(r["clients"])]
                    + [f"{r[ph]['ops_per_s']:,.0f}" for ph in PHASES]
                    + [f"{r[ph]['cpu_us_per_op']:,.0f}" for ph in PHASES])
    lines.append(table(rows, ["target", "clients", "creates/s", "stats/s", "entries/s",
                              "unlinks/s", "CPU us/create", "CPU us/stat",
                              "CPU us/entry", "CPU us/unlink"]))
    lines.append("")
    lines.append("CPU budget, us per operation (client processes / metaserver / data servers):")
    rows = []
    for r in res["median"]:
        rows.append([r["label"], str(r["clients"])]
                    + [f"{r[ph].get('client_us_per_op', 0):,.0f} / "
                       f"{r[ph].get('meta_us_per_op', 0):,.0f} / "
                       f"{r[ph].get('data_us_per_op', 0):,.0f}" for ph in PHASES])
    lines.append(table(rows, ["target", "clients", "create", "stat", "readdir entry",
                              "unlink"]))
    lines.append("")
    lines.append("raw LMDB on the same disk (one op = inode put + dentry put):")
    for k, v in res["lmdb"].items():
        if isinstance(v, dict):
            lines.append(f"  {k:22s} {v['ops_per_s']:>10,.0f} ops/s  {v['commits_per_s']:>8,.0f} "
                         f"commits/s  {v['cpu_us_per_op']:,.0f} CPU us/op")
    single = res["lmdb"]["durable_1_per_txn"]["ops_per_s"]
    for r in res["median"]:
        lines.append(f"  {r['label']} x{r['clients']}: creates/s = "
                     f"{ratio(r['create']['ops_per_s'], single):.2f}x the 1-op-per-commit LMDB rate")
    for label in sorted({r["label"] for r in res["median"] if r["label"].startswith("pfs")}):
        eight = [r for r in res["median"] if r["label"] == label and r["clients"] == 8]
        lines.append(aim(f">= 5,000 durable creates/s with 8 clients ({label})",
                         eight[0]["create"]["ops_per_s"] if eight else None, 5000))
        lines.append(aim(f">= 20,000 stats/s with 8 clients ({label})",
                         eight[0]["stat"]["ops_per_s"] if eight else None, 20000))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return bench_main("meta", __doc__, add_args, run, report, argv)
