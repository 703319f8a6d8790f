"""``pfs bench fuse``: the pfs FUSE mount beside the native client, a local directory and a
MooseFS mount, all measured in one run, the way a plain filesystem benchmark measures:

  write      ``dd if=SRC of=DIR/f bs=1M count=MB conv=fsync``  (SRC: random bytes in /dev/shm)
  cold read  drop caches (sync; echo 3 > /proc/sys/vm/drop_caches), ``dd if=DIR/f of=/dev/null bs=1M``
  metadata   create (open O_CREAT|O_EXCL + close), stat, unlink of NFILES empty files in a
             fresh directory, by this process; and between stat and unlink one cold
             ``ls -l`` of that directory (scandir + lstat of each entry, once cached
             attributes expired): entries/s

The native client does the same with its own API: the same random bytes written from memory
in 64 MiB calls, fsync, close; cold read into a preallocated buffer in 64 MiB calls; the
metadata loop through the path API (``pfs bench meta``, one client process). MB/s = 10^6
B/s as dd prints it; medians of --reps. The CPU of each metadata operation is split by
process: the caller (this process), the FUSE daemon (pfs mount, mfsmount) and the servers
(pfs metaserver + data servers, MooseFS master + chunk servers), in microseconds of CPU
per operation (user + system, every thread, from /proc/PID/stat).
Targets are interleaved within each repetition so drift on a noisy machine hits all alike.

MooseFS is started with ``moosefs-up.sh`` (1 master, 4 chunk servers, goal 1, on loopback)
and removed afterwards with ``moosefs-down.sh --purge``. The pfs cluster has 4 data servers
and the benchmark directory has stripe count 4, unit 1 MiB.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from pfs.bench import meta as metabench
from pfs.bench.common import (
    aim,
    bench_main,
    cluster_for,
    drop_caches,
    log,
    machine_info,
    median_record,
    proc_cpu,
    ratio,
    run_quiet,
    self_cpu,
    table,
    work_dir,
)

METRICS = ("write_MBps", "read_MBps", "create_ops", "stat_ops", "unlink_ops")
META_PHASES = ("create", "stat", "readdir", "unlink")
PARTS = ("caller", "daemon", "servers")  # where a metadata operation's CPU goes
ATTR_EXPIRY = 1.2  # seconds before the listing: the mounts' cached attributes (1 s) expired


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cluster directory: use (or start) the cluster there")
    p.add_argument("--config", help="client.toml of a running cluster to use")
    p.add_argument("--mb", type=int, default=1024, help="MiB per file (default 1024)")
    p.add_argument("--nfiles", type=int, default=1000,
                   help="files for create/stat/unlink (default 1000)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; medians (default 3)")
    p.add_argument("--targets", default="local,mount,native,moosefs",
                   help="which to measure (default local,mount,native,moosefs)")
    p.add_argument("--peers-dir", default=os.environ.get("PFS_PEERS_DIR"),
                   help="a folder with moosefs-up.sh and moosefs-down.sh, to measure a MooseFS "
                        "mount beside pfs (default: $PFS_PEERS_DIR; none: MooseFS skipped)")
    p.add_argument("--replicas", type=int, default=0,
                   help="replicas of the pfs benchmark directory, and the same MooseFS goal "
                        "(mfssetgoal -r) on its mount: like with like (default: each "
                        "side's own default)")
    p.add_argument("--mount-opts", default="", help="-o options for pfs mount")
    p.add_argument("--local-dir", help="scratch space (local target, cluster, mount points)")
    p.add_argument("--quick", action="store_true", help="64 MiB, 200 files, 1 rep")
    p.add_argument("--json", help="write all results here")


# -- helpers -------------------------------------------------------------------------
def dd(args: list[str]) -> tuple[float, float, float]:
    """Run dd; (MB/s, seconds, dd's CPU seconds)."""
    c0 = os.times()
    r = run_quiet(["dd", *args])
    c1 = os.times()
    if r.returncode:
        raise RuntimeError(f"dd {' '.join(args)} failed: {r.stderr.strip()}")
    m = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", r.stderr, re.M)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {r.stderr!r}")
    nbytes, secs = int(m.group(1)), float(m.group(2))
    cpu = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    return nbytes / secs / 1e6, secs, cpu


def peers_dir(arg: str | None) -> Path | None:
    return Path(arg) if arg else None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def mount_available() -> bool:
    """Whether ``pfs mount`` can run here: it needs pyfuse3 (the ``fuse`` extra)."""
    return importlib.util.find_spec("pyfuse3") is not None


def _pids_of_mount(mnt: Path) -> list[int]:
    """Processes whose command line names ``mnt`` (the FUSE daemon serving it)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if os.fsencode(str(mnt)) in argv or any(os.fsencode(str(mnt)) in a and b"mfsmount" in a
                                                for a in argv):
            out.append(int(p))
    return out


def _is_mounted(mnt: Path) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == str(mnt) for line in f)


class Target:
    def __init__(self, name: str, path: Path | None, servers: list[int],
                 daemon: list[int] | None = None) -> None:
        self.name, self.path = name, path
        self.servers, self.daemon = servers, daemon or []
        self.pids = servers + self.daemon

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of this process, the FUSE daemon and the servers."""
        return {"caller": time.process_time(),
                "daemon": sum(proc_cpu(p) for p in self.daemon),
                "servers": sum(proc_cpu(p) for p in self.servers)}


# -- set-up ----------------------------------------------------------------------
def pfs_mount(toml: Path, mnt: Path, opts: str) -> None:
    mnt.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pfs.tools.cli", "mount", "--config", str(toml), str(mnt)]
    if opts:
        argv += ["-o", opts]
    r = run_quiet(argv, timeout=120)
    if r.returncode or not _is_mounted(mnt):
        raise RuntimeError(f"pfs mount failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")


def pfs_umount(mnt: Path) -> None:
    if not _is_mounted(mnt):
        return
    r = run_quiet([sys.executable, "-m", "pfs.tools.cli", "umount", str(mnt)], timeout=60)
    if r.returncode and _is_mounted(mnt):
        run_quiet(["fusermount3", "-u", str(mnt)])
    if _is_mounted(mnt):
        run_quiet(["umount", "-l", str(mnt)])


def moosefs_up(peers: Path, mnt: Path, base: Path) -> dict[str, str]:
    env = dict(os.environ, MFS_BASE=str(base))
    port = 19419
    while not all(_port_free(port + i) for i in range(7)):
        port += 100
    env["MFS_PORT_BASE"] = str(port)
    r = run_quiet(["bash", str(peers / "moosefs-up.sh"), str(mnt)], env=env, timeout=180)
    if r.returncode:
        raise RuntimeError(f"moosefs-up.sh failed: {r.stderr.strip()}\n{r.stdout.strip()}")
    log(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "MooseFS up")
    return env


def moosefs_goal(mnt: Path, goal: int) -> None:
    """Every new file under ``mnt`` gets ``goal`` copies (MooseFS's replicas)."""
    r = run_quiet(["mfssetgoal", "-r", str(goal), str(mnt)], timeout=60)
    if r.returncode:
        raise RuntimeError(f"mfssetgoal -r {goal} {mnt}: {r.stderr.strip()}")
    log(f"MooseFS goal {goal}")


def moosefs_down(peers: Path, mnt: Path, env: dict[str, str]) -> None:
    r = run_quiet(["bash", str(peers / "moosefs-down.sh"), str(mnt), "--purge"], env=env,
                  timeout=180)
    if r.returncode:
        log(f"moosefs-down.sh: {r.stderr.strip()}")


def moosefs_pids(base: Path) -> tuple[list[int], list[int]]:
    """(master and chunk servers, mfsmount) of the MooseFS in ``base``."""
    def pids(files: list[Path]) -> list[int]:
        out = []
        for lock in files:
            try:
                txt = "".join(ch for ch in lock.read_text() if ch.isdigit())
                if txt:
                    out.append(int(txt))
            except OSError:
                pass
        return out
    return (pids([base / "master" / ".mfsmaster.lock",
                  *base.glob("cs*/var/.mfschunkserver.lock")]),
            pids([base / "mfsmount.pid"]))


# -- one target, one repetition -----------------------------------------------------
def posix_io(t: Target, src: Path, mb: int) -> dict[str, Any]:
    assert t.path is not None
    f = t.path / f"fsbench-{os.getpid()}"
    p0 = sum(proc_cpu(p) for p in t.pids)
    w, ws, wcpu = dd([f"if={src}", f"of={f}", "bs=1M", f"count={mb}", "conv=fsync"])
    p1 = sum(proc_cpu(p) for p in t.pids)
    dropped = drop_caches()
    p2 = sum(proc_cpu(p) for p in t.pids)
    rd, rs, rcpu = dd([f"if={f}", "of=/dev/null", "bs=1M"])
    p3 = sum(proc_cpu(p) for p in t.pids)
    os.unlink(f)
    return {"write_MBps": w, "read_MBps": rd, "write_s": ws, "read_s": rs,
            "write_cpu_s": wcpu + p1 - p0, "read_cpu_s": rcpu + p3 - p2,
            "drop_caches_ok": dropped}


def native_io(c: Any, data: memoryview, rbuf: memoryview, pids: list[int]) -> dict[str, Any]:
    chunk = 64 << 20
    path = f"/bench-fuse/native-{os.getpid()}"

    def cpu() -> float:
        return self_cpu() + sum(proc_cpu(p) for p in pids)

    c0, t0 = cpu(), time.perf_counter()
    with c.open(path, "wb") as f:
        off = 0
        while off < len(data):
            off += f.write(data[off:off + chunk])
        f.fsync()
    ws, c1 = time.perf_counter() - t0, cpu()
    dropped = drop_caches()
    c2, t0 = cpu(), time.perf_counter()
    with c.open(path, "rb") as f:
        got = 0
        while got < len(rbuf):
            n = f.readinto(rbuf[got:got + chunk])
            if not n:
                break
            got += n
    rs, c3 = time.perf_counter() - t0, cpu()
    if got != len(data) or rbuf != data:
        raise RuntimeError("native read-back differs from what was written")
    c.remove(path)
    return {"write_MBps": len(data) / ws / 1e6, "read_MBps": len(data) / rs / 1e6,
            "write_s": ws, "read_s": rs, "write_cpu_s": c1 - c0, "read_cpu_s": c3 - c2,
            "drop_caches_ok": dropped}


def meta_ops(t: Target, nfiles: int, toml: Path | None) -> dict[str, Any]:
    if t.name != "native":
        return posix_meta(t, nfiles)
    rec = metabench.measure("pfs", str(toml), 1, nfiles, t.pids, t.name)
    return {"create_ops": rec["create"]["ops_per_s"], "stat_ops": rec["stat"]["ops_per_s"],
            "unlink_ops": rec["unlink"]["ops_per_s"],
            "create_cpu_us": rec["create"]["cpu_us_per_op"],
            "stat_cpu_us": rec["stat"]["cpu_us_per_op"],
            "unlink_cpu_us": rec["unlink"]["cpu_us_per_op"]}


def posix_meta(t: Target, nfiles: int) -> dict[str, Any]:
    """The metadata loops through a mounted filesystem, in this process: per phase,
    operations per second and CPU per operation by part (``Target.cpu``)."""
    assert t.path is not None
    d = t.path / f"fsmeta-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    paths = [str(d / f"f{i:06d}") for i in range(nfiles)]

    def create() -> int:
        for p in paths:
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return nfiles

    def stat_() -> int:
        for p in paths:
            os.stat(p)
        return nfiles

    def readdir() -> int:  # ls -l: the listing, then each entry's attributes
        n = 0
        with os.scandir(d) as it:
            for e in it:
                e.stat(follow_symlinks=False)
                n += 1
        return n

    def unlink() -> int:
        for p in paths:
            os.unlink(p)
        return nfiles

    out: dict[str, Any] = {}
    try:
        for ph, fn in zip(META_PHASES, (create, stat_, readdir, unlink), strict=True):
            if ph == "readdir":
                time.sleep(ATTR_EXPIRY)
            c0, t0 = t.cpu(), time.perf_counter()
            n = fn()
            secs, c1 = time.perf_counter() - t0, t.cpu()
            out[f"{ph}_ops"] = n / secs if secs > 0 else 0.0
            for part in PARTS:
                out[f"{ph}_{part}_us"] = 1e6 * (c1[part] - c0[part]) / max(n, 1)
            out[f"{ph}_cpu_us"] = sum(out[f"{ph}_{part}_us"] for part in PARTS)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


# -- the run -----------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    import pfs

    if args.quick:
        args.mb, args.nfiles, args.reps = min(args.mb, 64), min(args.nfiles, 200), 1
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    notes: list[str] = []
    if "mount" in wanted and not mount_available():
        notes.append("`pfs mount` is not available in this checkout: mount target skipped")
        wanted.remove("mount")
    peers = peers_dir(args.peers_dir)
    if "moosefs" in wanted and (peers is None or not (peers / "moosefs-up.sh").exists()):
        notes.append(f"no moosefs-up.sh in {peers}: MooseFS target skipped" if peers else
                     "no --peers-dir (or PFS_PEERS_DIR): MooseFS target skipped")
        wanted.remove("moosefs")
    if "moosefs" in wanted and not shutil.which("mfsmount"):
        notes.append("MooseFS is not installed: MooseFS target skipped")
        wanted.remove("moosefs")
    for n in notes:
        log(n)
    size = args.mb << 20
    res: dict[str, Any] = {"bench": "fuse", "notes": notes}
    src = Path(f"/dev/shm/pfs-bench-rand-{os.getpid()}")
    mfs_env: dict[str, str] | None = None
    with contextlib.ExitStack() as stack:
        wd = stack.enter_context(work_dir(args.local_dir, "pfs-bench-fuse-"))
        need_pfs = "mount" in wanted or "native" in wanted
        cut = stack.enter_context(cluster_for(args, wd, 4)) if need_pfs else None
        res["machine"] = machine_info(wd)
        res["config"] = {"mb": args.mb, "nfiles": args.nfiles, "reps": args.reps,
                         "targets": wanted, "stripe_count": 4, "stripe_unit": 1 << 20,
                         "replicas": args.replicas or "each side's default",
                         "src": str(src)}
        pmnt, mmnt, mbase = wd / "pfs-mnt", wd / "mfs-mnt", wd / "mfs-base"
        try:
            log(f"making {args.mb} MiB of random data in {src}")
            from pfs.bench.common import random_buffer

            data = memoryview(random_buffer(size))
            with open(src, "wb") as f:
                f.write(data)
            rbuf = memoryview(bytearray(size))
            targets: list[Target] = []
            server_pids = list(cut.pids.values()) if cut else []
            toml = cut.client_toml if cut else None
            with (pfs.connect(config=toml) if toml else contextlib.nullcontext()) as c:
                if c is not None:
                    c.makedirs("/bench-fuse", exist_ok=True)
                    c.set_layout("/bench-fuse", count=4, unit=1 << 20,
                                 replicas=args.replicas)
                for name in wanted:
                    if name == "local":
                        (wd / "local").mkdir()
                        targets.append(Target("local", wd / "local", []))
                    elif name == "mount":
                        log("mounting pfs")
                        assert toml is not None  # the mount needs a cluster
                        pfs_mount(toml, pmnt, args.mount_opts)
                        targets.append(Target("mount", pmnt / "bench-fuse", server_pids,
                                              _pids_of_mount(pmnt)))
                    elif name == "native":
                        targets.append(Target("native", None, server_pids))
                    elif name == "moosefs":
                        log("starting MooseFS")
                        assert peers is not None  # else the target was skipped above
                        mfs_env = moosefs_up(peers, mmnt, mbase)
                        if args.replicas:
                            moosefs_goal(mmnt, args.replicas)
                        targets.append(Target("moosefs", mmnt, *moosefs_pids(mbase)))
                    else:
                        raise SystemExit(f"unknown target {name!r}")
                runs: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
                for rep in range(args.reps):
                    for t in targets:
                        log(f"rep {rep + 1}/{args.reps}: {t.name}")
                        if t.name == "native":
                            r = native_io(c, data, rbuf, t.pids)
                        else:
                            r = posix_io(t, src, args.mb)
                        r.update(meta_ops(t, args.nfiles, toml))
                        log("  " + " ".join(f"{k}={r[k]:.0f}" for k in METRICS))
                        runs[t.name].append(r)
        finally:
            if _is_mounted(pmnt):
                pfs_umount(pmnt)
            if mfs_env is not None and peers is not None:
                moosefs_down(peers, mmnt, mfs_env)
            src.unlink(missing_ok=True)
    res["runs"] = runs
    med = {k: median_record(v) for k, v in runs.items()}
    res["median"] = med
    res["ratios"] = ratios(med)
    return res


def ratios(med: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for a, b in (("mount", "moosefs"), ("native", "moosefs"), ("mount", "local"),
                 ("native", "local"), ("mount", "native")):
        if a in med and b in med:
            for m in METRICS:
                out[f"{a}/{b} {m}"] = round(ratio(med[a][m], med[b][m]), 3)
    return out


def report(res: dict[str, Any]) -> str:
    med, cfg, m = res["median"], res["config"], res["machine"]
    lines = [f"pfs bench fuse: {cfg['mb']} MiB files (dd bs=1M, conv=fsync; cold read after "
             f"drop_caches), {cfg['nfiles']} files for metadata, median of {cfg['reps']}",
             f"machine: {m.get('cpus')} CPUs ({m.get('cpu_model', '?')}), {m.get('fs', '?')}"]
    lines += [f"note: {n}" for n in res.get("notes", [])]
    lines.append("")
    rows = [[name, f"{r['write_MBps']:.0f}", f"{r['read_MBps']:.0f}", f"{r['create_ops']:,.0f}",
             f"{r['stat_ops']:,.0f}", f"{r['unlink_ops']:,.0f}", f"{r['write_cpu_s']:.2f}",
             f"{r['read_cpu_s']:.2f}"] for name, r in med.items()]
    lines.append(table(rows, ["target", "write MB/s", "cold read MB/s", "creates/s", "stats/s",
                              "unlinks/s", "write CPU s", "read CPU s"]))
    cpu_rows = [[name] + [f"{r[f'{ph}_{part}_us']:,.0f}" for ph in META_PHASES
                          for part in PARTS]
                for name, r in med.items() if "create_daemon_us" in r]
    if cpu_rows:
        lines.append("")
        lines.append("CPU us per operation (per entry for readdir: a cold ls -l), by part: "
                     "c = the caller, d = the FUSE daemon, s = the servers")
        lines.append(table(cpu_rows, ["target"] + [f"{ph[:6]} {part[0]}" for ph in META_PHASES
                                                   for part in PARTS]))
        lines.append("entries/s (cold ls -l): " + ", ".join(
            f"{name} {r['readdir_ops']:,.0f}" for name, r in med.items() if "readdir_ops" in r))
    lines.append("")
    lines.append("ratios:")
    for k, v in res["ratios"].items():
        lines.append(f"  {k:36s} {v:.3f}")
    r = res["ratios"]
    for m in METRICS:
        lines.append(aim(f"mount >= MooseFS on {m}", r.get(f"mount/moosefs {m}"), 1.0))
    lines.append(aim("mount read >= 0.4x native read", r.get("mount/native read_MBps"), 0.4))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return bench_main("fuse", __doc__, add_args, run, report, argv)
