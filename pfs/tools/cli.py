"""The ``pfs`` command line."""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import stat as statmod
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfs.tools import admin_servers

log = logging.getLogger(__name__)

COPY_CHUNK = 32 << 20
PROGRESS_MIN = 64 << 20

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``4096``, ``64K``, ``1M``, ``2G`` (binary units; a trailing B or iB is allowed)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _SUFFIX else (t, "")
    try:
        value = float(num) * _SUFFIX[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(value)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Progress:
    """A one-line progress bar on stderr for large copies (only on a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label = total, label
        self.on = total >= PROGRESS_MIN and sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n
        if self.on:
            frac = self.done / self.total if self.total else 1.0
            rate = self.done / max(1e-9, time.monotonic() - self.t0)
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {human(rate)}/s")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.on:
            sys.stderr.write("\n")


# ---------------------------------------------------------------------------
def _client(args: argparse.Namespace) -> Any:
    import pfs
    from pfs.core.config import ConfigError

    try:
        return pfs.connect(config=args.config, meta=args.meta)
    except ConfigError as exc:
        raise SystemExit(f"pfs: {exc}") from None


def cmd_ls(args: argparse.Namespace) -> None:
    with _client(args) as c:
        for path in args.paths or ["/"]:
            st = c.stat(path)
            entries = c.scandir(path) if st.is_dir() else None
            if entries is None:
                print(path)
                continue
            for e in sorted(entries, key=lambda e: e.name):
                if args.long and e.attr is not None:
                    a = e.attr
                    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(a.st_mtime))
                    print(f"{statmod.filemode(a.st_mode)} {a.st_nlink:3d} {a.st_uid:5d} "
                          f"{a.st_gid:5d} {a.st_size:12d} {when} {e.name}")
                else:
                    print(e.name)


def cmd_stat(args: argparse.Namespace) -> None:
    with _client(args) as c:
        for path in args.paths:
            st = c.lstat(path)
            print(json.dumps({"path": path, "ino": st.st_ino, "mode": statmod.filemode(st.st_mode),
                              "nlink": st.st_nlink, "uid": st.st_uid, "gid": st.st_gid,
                              "size": st.st_size, "atime_ns": st.st_atime_ns,
                              "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}))


def cmd_mkdir(args: argparse.Namespace) -> None:
    with _client(args) as c:
        for path in args.paths:
            if args.parents:
                c.makedirs(path, exist_ok=True)
            else:
                c.mkdir(path)


def _rm_tree(c: Any, path: str) -> None:
    for e in c.scandir(path):
        if e.is_dir():
            _rm_tree(c, e.path)
        else:
            c.remove(e.path)
    c.rmdir(path)


def cmd_rm(args: argparse.Namespace) -> None:
    with _client(args) as c:
        for path in args.paths:
            st = c.lstat(path)
            if st.is_dir():
                if not args.recursive:
                    raise OSError(errno.EISDIR, f"{path} is a directory (use -r)")
                _rm_tree(c, path)
            else:
                c.remove(path)


def cmd_mv(args: argparse.Namespace) -> None:
    with _client(args) as c:
        c.rename(args.src, args.dst)


def cmd_cat(args: argparse.Namespace) -> None:
    out = sys.stdout.buffer
    with _client(args) as c:
        for path in args.paths:
            with c.open(path, "rb") as f:
                while chunk := f.read(COPY_CHUNK):
                    out.write(chunk)
    out.flush()


def cmd_put(args: argparse.Namespace) -> None:
    with _client(args) as c, open(args.local, "rb", buffering=0) as src:
        total = os.fstat(src.fileno()).st_size
        remote = args.remote
        if remote.endswith("/") or (c.exists(remote) and c.stat(remote).is_dir()):
            remote = remote.rstrip("/") + "/" + os.path.basename(args.local)
        bar = Progress(total, f"put {args.local}")
        buf = bytearray(min(COPY_CHUNK, max(total, 1)))
        t0 = time.perf_counter()
        with c.open(remote, "wb") as dst:
            while n := src.readinto(buf):
                dst.write(memoryview(buf)[:n])
                bar.add(n)
        bar.finish()
        _report(args, "put", total, time.perf_counter() - t0)


def cmd_get(args: argparse.Namespace) -> None:
    with _client(args) as c:
        local = args.local
        if os.path.isdir(local):
            local = os.path.join(local, os.path.basename(args.remote.rstrip("/")))
        t0 = time.perf_counter()
        with c.open(args.remote, "rb") as src, open(local, "wb", buffering=0) as dst:
            total = src.size
            bar = Progress(total, f"get {args.remote}")
            buf = bytearray(min(COPY_CHUNK, max(total, 1)))
            while n := src.readinto(buf):
                dst.write(memoryview(buf)[:n])
                bar.add(n)
            bar.finish()
        _report(args, "get", total, time.perf_counter() - t0)


def _report(args: argparse.Namespace, what: str, nbytes: int, secs: float) -> None:
    if args.verbose:
        print(f"{what}: {human(nbytes)} in {secs:.2f} s ({nbytes / max(secs, 1e-9) / 1e9:.2f} GB/s)",
              file=sys.stderr)


def cmd_setstripe(args: argparse.Namespace) -> None:
    with _client(args) as c:
        lay = c.set_layout(args.path, count=args.count or 0, unit=args.unit or 0,
                           replicas=args.replicas or 0, durable=args.durable)
        print(json.dumps(lay))


def cmd_getstripe(args: argparse.Namespace) -> None:
    with _client(args) as c:
        print(json.dumps(c.get_layout(args.path)))


def _df_row(name: str, total: int, free: int, note: str = "") -> str:
    used = total - free
    pct = 100 * used / total if total else 0
    return (f"{name:<40} {human(total):>11} {human(used):>11} {human(free):>11} "
            f"{pct:4.0f}%  {note}").rstrip()


def cmd_df(args: argparse.Namespace) -> None:
    """One row per data server (and per data directory where it has several), then the
    total, each physical filesystem counted once (``lfs df``)."""
    with _client(args) as c:
        servers = c._run(c.aio.meta.servers)
        s = c.statvfs()
    print(f"{'server / directory':<40} {'size':>11} {'used':>11} {'avail':>11} {'use%':>5}  "
          "state")
    for sid, srv in sorted(servers.items(), key=lambda kv: (kv[1]["host"], kv[1]["port"])):
        state = admin_servers.state_of(srv)
        state = state if state == "up" else state.upper()  # what is wrong stands out
        print(_df_row(f"{sid[:8]} {srv['host']}:{srv['port']}", srv["total"], srv["free"],
                      state))
        dirs = srv.get("dirs") or []
        if len(dirs) > 1:
            for path, _fs, total, free in dirs:
                print(_df_row(f"  {path}", total, free))
    total, free = s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize
    print(_df_row("total (each filesystem once)", total, free,
                  f"{s.f_files - s.f_ffree} files"))


def cmd_load(args: argparse.Namespace) -> None:
    """Load a safetensors checkpoint with the loader fast path and report the rate."""
    from pfs.loader.safetensors import CheckpointError, LoadStats, load_safetensors

    stats = LoadStats()
    pfs_source = not args.local and (args.config or args.meta or os.environ.get("PFS_CONFIG"))
    try:
        if pfs_source:
            with _client(args) as c:
                out = load_safetensors(args.path, args.device, c, args.tp_rank, args.tp_size,
                                       _split_arg(args.split), framework=args.framework,
                                       stats=stats)
        else:
            out = load_safetensors(args.path, args.device, None, args.tp_rank, args.tp_size,
                                   _split_arg(args.split), framework=args.framework,
                                   stats=stats)
    except CheckpointError as exc:
        raise SystemExit(f"pfs load: {exc}") from None
    kind = type(next(iter(out.values()))).__module__.split(".")[0] if out else "-"
    print(f"loaded {stats.tensors} tensors ({kind}) from {stats.files} file(s): "
          f"{stats.bytes} bytes ({human(stats.bytes)}) in {stats.seconds:.3f} s, "
          f"{stats.gbps:.2f} GB/s [{'pfs' if pfs_source else 'local ' + stats.engine}, "
          f"{stats.requests} reads, device {args.device}]")


def _split_arg(items: list[str] | None) -> dict[str, int] | None:
    """``--split PATTERN=DIM`` (repeatable) as the loader's split rules."""
    if not items:
        return None
    out: dict[str, int] = {}
    for item in items:
        pattern, sep, dim = item.rpartition("=")
        if not sep or not pattern or dim.lstrip("-") not in ("0", "1", "2", "3"):
            raise SystemExit(f"pfs load: --split wants PATTERN=DIM, not {item!r}")
        out[pattern] = int(dim)
    return out


# -- cluster ------------------------------------------------------------------
def cmd_cluster_up(args: argparse.Namespace) -> None:
    from pfs.tools import cluster

    try:
        path = cluster.up(Path(args.dir), args.data_servers, args.meta_port,
                          tls=True if args.tls else None)
    except cluster.ClusterError as exc:
        raise SystemExit(f"pfs cluster up: {exc}") from None
    print(path)


def cmd_cluster_init(args: argparse.Namespace) -> None:
    from pfs.tools import cluster

    for p in cluster.init(Path(args.dir), args.tls):
        print(p)


def cmd_certs(args: argparse.Namespace) -> None:
    from pfs.core.config import ConfigError
    from pfs.tools.certs import generate

    try:
        for p in generate(Path(args.dir), args.host, args.client, args.uids, args.gids):
            print(p)
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"pfs certs: {exc}") from None


def cmd_cluster_down(args: argparse.Namespace) -> None:
    from pfs.tools import cluster

    stopped = cluster.down(Path(args.dir))
    print(f"stopped {len(stopped)} process(es)" + (f": {', '.join(stopped)}" if stopped else ""))


def cmd_cluster_status(args: argparse.Namespace) -> None:
    from pfs.tools import cluster

    try:
        st = cluster.status(Path(args.dir))
    except cluster.ClusterError as exc:
        raise SystemExit(f"pfs cluster status: {exc}") from None
    print(json.dumps(st, indent=2))
    if "meta" in st["processes"]:  # type: ignore[operator]
        import pfs

        with pfs.connect(config=Path(args.dir) / "client.toml") as c:
            servers = c._run(c.aio.meta.servers)
            for sid, s in sorted(servers.items()):
                print(f"data server {sid} {s['host']}:{s['port']} "
                      f"{'DOWN' if not s['alive'] else 'FULL' if s.get('full') else 'up'} "
                      f"free {human(s['free'])} of {human(s['total'])}")


def cmd_meta_serve(args: argparse.Namespace) -> None:
    from pfs.metaserver.__main__ import main as meta_main

    sys.exit(meta_main(args.rest))


def cmd_data_serve(args: argparse.Namespace) -> None:
    from pfs.dataserver.__main__ import main as data_main

    sys.exit(data_main(args.rest))


def cmd_admin_migrate(args: argparse.Namespace) -> None:
    """Upgrade stores in place to this pfs's formats (pfs/core/versions.py); the servers'
    refusal of an older format names this command. Idempotent."""
    from pfs.dataserver.objects import migrate_dir
    from pfs.metaserver.store import migrate

    if not args.db and not args.data:
        raise SystemExit("pfs admin migrate: name a store: --db DIR and/or --data DIR")
    jobs: list[tuple[str, str, Callable[[str], tuple[int, int]]]] = (
        [("metadata store", d, migrate) for d in args.db]
        + [("data directory", d, migrate_dir) for d in args.data])
    for what, path, fn in jobs:
        before, after = fn(path)
        if before == after:
            print(f"{what} {path}: format {after}, nothing to do")
        else:
            print(f"{what} {path}: format {before} -> {after}")


def cmd_fsck(args: argparse.Namespace) -> None:
    """Read-only check of a running cluster; exit 0 clean, 1 problems, 2 incomplete."""
    import trio

    from pfs.core.config import ConfigError
    from pfs.tools.fsck import fsck, render

    try:
        report = trio.run(lambda: fsck(args.config, args.meta, verify=args.verify,
                                       rate=args.rate, paths=args.paths))
    except (OSError, ConfigError) as exc:
        print(f"pfs fsck: could not check: {exc}", file=sys.stderr)
        sys.exit(2)
    print(render(report, args.json))
    sys.exit(report.exit_code)


def cmd_demo(args: argparse.Namespace) -> None:
    from pfs.tools.demo import run_demo

    run_demo(Path(args.dir), args.size, keep=args.keep)


def cmd_bench(args: argparse.Namespace) -> None:
    """``pfs bench ...`` is ``python -m pfs.bench ...`` in this process's place: the
    tools never import the benchmarks (which import the tools); same pid, so signals
    and the exit status are the benchmark's own. ``-P``: this pfs, not one in the cwd."""
    os.execv(sys.executable, [sys.executable, "-P", "-m", "pfs.bench", *args.rest])


# ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pfs", description="pfs: a parallel distributed filesystem")
    p.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = p.add_subparsers(dest="cmd", required=True)

    def client_cmd(name: str, fn: Callable[[argparse.Namespace], None], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("--config", help="client.toml (default: $PFS_CONFIG)")
        sp.add_argument("--meta", help="metaserver HOST:PORT")
        sp.set_defaults(fn=fn)
        return sp

    sp = client_cmd("ls", cmd_ls, "list directories")
    sp.add_argument("-l", "--long", action="store_true")
    sp.add_argument("paths", nargs="*")
    client_cmd("stat", cmd_stat, "show attributes").add_argument("paths", nargs="+")
    sp = client_cmd("mkdir", cmd_mkdir, "make directories")
    sp.add_argument("-p", "--parents", action="store_true")
    sp.add_argument("paths", nargs="+")
    sp = client_cmd("rm", cmd_rm, "remove files (and trees with -r)")
    sp.add_argument("-r", "--recursive", action="store_true")
    sp.add_argument("paths", nargs="+")
    sp = client_cmd("mv", cmd_mv, "rename")
    sp.add_argument("src")
    sp.add_argument("dst")
    client_cmd("cat", cmd_cat, "print files").add_argument("paths", nargs="+")
    sp = client_cmd("put", cmd_put, "copy a local file into pfs")
    sp.add_argument("local")
    sp.add_argument("remote")
    sp = client_cmd("get", cmd_get, "copy a pfs file to local disk")
    sp.add_argument("remote")
    sp.add_argument("local")
    sp = client_cmd("setstripe", cmd_setstripe, "set a directory's default (or empty file's) layout")
    sp.add_argument("--count", "-c", type=int)
    sp.add_argument("--unit", "-S", type=parse_size)
    sp.add_argument("--replicas", "-r", type=int)
    sync = sp.add_mutually_exclusive_group()
    sync.add_argument("--no-sync", dest="durable", action="store_const", const=False,
                      help="scratch data: close() does not wait for the data to reach "
                           "stable storage (fsync still does); inherited by new files")
    sync.add_argument("--sync", dest="durable", action="store_const", const=True,
                      help="close() syncs the data before it commits the size (default)")
    sp.add_argument("path")
    client_cmd("getstripe", cmd_getstripe, "show a layout").add_argument("path")
    client_cmd("df", cmd_df, "capacity of the cluster")
    sp = client_cmd("load", cmd_load, "load a safetensors checkpoint (file, index or "
                                      "directory) and report GB/s")
    sp.add_argument("path", help="pfs path (with --config/--meta/$PFS_CONFIG) or local path")
    sp.add_argument("--device", default="cpu", help="cpu or cuda:N")
    sp.add_argument("--tp-rank", type=int, default=None)
    sp.add_argument("--tp-size", type=int, default=None)
    sp.add_argument("--split", action="append", metavar="PATTERN=DIM",
                    help="tensor-parallel rule: tensors matching PATTERN cut along DIM")
    sp.add_argument("--framework", choices=["torch", "numpy"], default=None)
    sp.add_argument("--local", action="store_true", help="PATH is on local disk")

    from pfs.fuse.mount import add_mount_parser  # pfs mount / pfs umount

    add_mount_parser(sub, client_cmd)

    cl = sub.add_parser("cluster", help="a local cluster on loopback").add_subparsers(
        dest="clcmd", required=True)
    sp = cl.add_parser("up", help="start a metaserver and N data servers in DIR")
    sp.add_argument("--dir", required=True)
    sp.add_argument("--data-servers", type=int, default=None, help="default 4")
    sp.add_argument("--meta-port", type=int, default=None)
    sp.add_argument("--tls", action="store_true",
                    help="mutual TLS instead of keys (on the first start)")
    sp.set_defaults(fn=cmd_cluster_up)
    sp = cl.add_parser("init", help="create DIR's keys (or --tls certificates), mode 0600")
    sp.add_argument("--dir", required=True)
    sp.add_argument("--tls", action="store_true")
    sp.set_defaults(fn=cmd_cluster_init)
    sp = cl.add_parser("down", help="stop the cluster in DIR")
    sp.add_argument("--dir", required=True)
    sp.set_defaults(fn=cmd_cluster_down)
    sp = cl.add_parser("status", help="show the cluster in DIR")
    sp.add_argument("--dir", required=True)
    sp.set_defaults(fn=cmd_cluster_status)

    for name, fn in (("meta", cmd_meta_serve), ("data", cmd_data_serve)):
        srv = sub.add_parser(name, help=f"{name} server").add_subparsers(dest="srvcmd", required=True)
        sp = srv.add_parser("serve", help=f"run a {name} server in the foreground",
                            add_help=False)
        sp.add_argument("rest", nargs=argparse.REMAINDER)
        sp.set_defaults(fn=fn)

    def fsck_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--config", help="client.toml (default: $PFS_CONFIG); its key must "
                                         "allow uid 0")
        sp.add_argument("--meta", help="metaserver HOST:PORT")
        sp.add_argument("--json", action="store_true", help="a JSON report for scripts")
        sp.add_argument("--no-verify", dest="verify", action="store_false",
                        help="do not ask data servers to verify checksums")
        sp.add_argument("--rate", type=parse_size, default=0,
                        help="bytes a second verified at most (e.g. 200M; default: no limit)")
        sp.add_argument("--no-paths", dest="paths", action="store_false",
                        help="name files by inode (no walk of the namespace)")
        sp.set_defaults(fn=cmd_fsck)

    fsck_help = ("read-only check: orphan, missing and short objects, checksums, unreachable "
                 "servers; exit 0 clean, 1 problems, 2 incomplete")
    fsck_args(sub.add_parser("fsck", help=fsck_help))
    adm = sub.add_parser("admin", help="operate on stores and clusters").add_subparsers(
        dest="admcmd", required=True)
    sp = adm.add_parser("migrate", help="upgrade metadata stores and data directories in "
                                        "place to this pfs's formats (stop the server first)")
    sp.add_argument("--db", action="append", default=[], metavar="DIR",
                    help="a metaserver's LMDB directory (repeatable)")
    sp.add_argument("--data", action="append", default=[], metavar="DIR",
                    help="a data server's data directory (repeatable)")
    sp.set_defaults(fn=cmd_admin_migrate)
    fsck_args(adm.add_parser("fsck", help=fsck_help + " (pfs fsck)"))
    admin_servers.add_commands(adm, _client)  # servers, drain, undrain

    sp = sub.add_parser("certs", help="make a CA, the server certificate and client "
                                      "certificates for mutual TLS")
    sp.add_argument("--dir", required=True, help="where (an existing CA there is reused)")
    sp.add_argument("--host", action="append", default=[], help="server name or address "
                    "(repeatable; localhost and 127.0.0.1 are always in)")
    sp.add_argument("--client", action="append", default=[], metavar="NAME",
                    help="make NAME.pem/NAME.key (repeatable)")
    sp.add_argument("--uids", default="0-4294967295", help="uids the clients may claim, LO-HI")
    sp.add_argument("--gids", default="0-4294967295", help="gids the clients may claim, LO-HI")
    sp.set_defaults(fn=cmd_certs)

    sp = sub.add_parser("demo", help="start a local cluster, write and read back a workload")
    sp.add_argument("--dir", default="/tmp/pfs-demo")
    sp.add_argument("--size", type=parse_size, default=256 << 20)
    sp.add_argument("--keep", action="store_true", help="leave the cluster running")
    sp.set_defaults(fn=cmd_demo)

    sp = sub.add_parser("bench", help="benchmarks (throughput, meta)", add_help=False)
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(fn=cmd_bench)
    return p


# Subcommands that hand their whole argument list to another parser (argparse's
# REMAINDER would swallow nothing when the first of them is an option such as --help).
_PASSTHROUGH = {("meta", "serve"): cmd_meta_serve, ("data", "serve"): cmd_data_serve,
                ("bench",): cmd_bench}


def _sigterm_unwinds() -> None:
    """SIGTERM (a timeout, a cancelled job, ``kill``) unwinds like Ctrl-C, so a command
    that started a local cluster or a mount (``demo``; ``pfs.bench`` does the same) stops it in its
    ``finally`` instead of leaving servers running. Servers and ``mount -f`` install
    their own handlers over this one."""
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for prefix, fn in _PASSTHROUGH.items():
        if tuple(argv[:len(prefix)]) == prefix:
            logging.basicConfig(level=logging.WARNING,
                                format="%(asctime)s %(name)s %(levelname)s %(message)s")
            fn(argparse.Namespace(rest=argv[len(prefix):]))
            return
    _sigterm_unwinds()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args.fn(args)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, "EIO")
        print(f"pfs: {exc.strerror or exc} [{name}]", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
