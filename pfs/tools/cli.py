"""The ``pfs`` command line."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfs.tools import (
    admin_backup,
    admin_keys,
    admin_kv,
    admin_repair,
    admin_servers,
    fscmds,
    transfer,
)
from pfs.tools.admin_status import cmd_admin_status
from pfs.tools.output import (
    EXIT_INTERRUPTED,
    Progress,
    error_line,
    exit_status,
    human,
    parse_size,
    print_json,
    tool_version,
)

log = logging.getLogger(__name__)

__all__ = ["build_parser", "human", "main", "parse_size"]


# ---------------------------------------------------------------------------
def _client(args: argparse.Namespace) -> Any:
    """A client for one command: never a /metrics endpoint (the config's
    ``metrics_port`` is the mount's or a long-running program's, maybe bound already)."""
    import dataclasses

    import pfs
    from pfs.core.config import ConfigError, client_config

    try:
        cfg = client_config(args.config, args.meta)
        return pfs.connect(config=dataclasses.replace(cfg, metrics_port=0))
    except ConfigError as exc:
        raise SystemExit(f"pfs: {exc}") from None


def _with_client(fn: Callable[[argparse.Namespace, Any], None]
                 ) -> Callable[[argparse.Namespace], None]:
    """A command that needs a connected client: connect, run, close."""
    def run(args: argparse.Namespace) -> None:
        with _client(args) as c:
            fn(args, c)

    run.__doc__ = fn.__doc__
    return run


def cmd_load(args: argparse.Namespace) -> None:
    """Load a safetensors checkpoint with the loader fast path and report the rate."""
    from pfs.loader.safetensors import CheckpointError, LoadStats

    stats = LoadStats(progress=Progress(None, "load"))  # a bar on a terminal, if long
    pfs_source = not args.local and _names_pfs(args)
    try:
        with stats.progress:
            out = _load(args, stats, pfs_source)
    except (CheckpointError, ValueError) as exc:
        raise SystemExit(f"pfs load: {args.path}: {exc}") from None
    kind = type(next(iter(out.values()))).__module__.split(".")[0] if out else "-"
    if args.json:
        print_json({"path": args.path, "source": "pfs" if pfs_source else "local",
                    "engine": stats.engine, "device": args.device, "framework": kind,
                    "files": stats.files, "tensors": stats.tensors, "bytes": stats.bytes,
                    "read_bytes": stats.read_bytes, "requests": stats.requests,
                    "seconds": stats.seconds, "GBps": stats.gbps})
        return
    print(f"loaded {stats.tensors} tensors ({kind}) from {stats.files} file(s): "
          f"{stats.bytes} bytes ({human(stats.bytes)}) in {stats.seconds:.3f} s, "
          f"{stats.gbps:.2f} GB/s [{'pfs' if pfs_source else 'local ' + stats.engine}, "
          f"{stats.requests} reads, device {args.device}]")


def _names_pfs(args: argparse.Namespace) -> bool:
    """Whether ``pfs load PATH`` reads from pfs: a cluster named (``--config``, ``--meta``,
    ``$PFS_CONFIG``), or, with none named, PATH not on local disk and a client config
    found where every other command looks for one (the user's, then the node's)."""
    from pfs.core.config import ConfigError, find_client_config

    if args.config or args.meta or os.environ.get("PFS_CONFIG"):
        return True
    if os.path.exists(args.path):
        return False
    try:
        find_client_config()
    except ConfigError:
        return False  # reported as a missing local path, the likelier mistake
    return True


def _load(args: argparse.Namespace, stats: Any, pfs_source: Any) -> dict[str, Any]:
    from pfs.loader.safetensors import load_safetensors

    split = _split_arg(args.split)
    if not pfs_source:
        return load_safetensors(args.path, args.device, None, args.tp_rank, args.tp_size,
                                split, framework=args.framework, stats=stats)
    with _client(args) as c:
        return load_safetensors(args.path, args.device, c, args.tp_rank, args.tp_size,
                                split, framework=args.framework, stats=stats)


def _device(text: str) -> str:
    """``--device``: cpu, cuda or cuda:N."""
    kind, _, num = text.partition(":")
    if text == "cpu" or (kind == "cuda" and (not num or num.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda or cuda:N)")


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

    d = Path(args.dir)
    before = cluster.running(d) if d.exists() else {}
    try:
        path = cluster.up(d, args.data_servers, args.meta_port,
                          tls=True if args.tls else None)
    except cluster.ClusterError as exc:
        raise SystemExit(f"pfs cluster up: {exc}") from None
    if not args.tls and not cluster.load_spec(Path(args.dir)).tls:  # type: ignore[union-attr]
        print(f"pfs cluster up: {cluster.admin_notice(Path(args.dir))}", file=sys.stderr)
    if before:
        print(f"pfs cluster up: {d} was already running ({', '.join(sorted(before))}); "
              "started what was missing", file=sys.stderr)
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

    d = Path(args.dir)
    if not d.is_dir():
        raise OSError(errno.ENOENT, "No such directory (no cluster there)", str(d))
    stopped = cluster.down(d)
    if not stopped:
        print(f"no cluster was running in {d}")
        return
    print(f"stopped {len(stopped)} process(es): {', '.join(stopped)}")


def cmd_cluster_status(args: argparse.Namespace) -> None:
    from pfs.tools import cluster

    try:
        st = cluster.status(Path(args.dir))
    except cluster.ClusterError as exc:
        raise SystemExit(f"pfs cluster status: {exc}") from None
    procs: dict[str, int] = st["processes"]  # type: ignore[assignment]
    servers: dict[str, dict[str, Any]] = {}
    if "meta" in procs:
        import pfs

        with pfs.connect(config=Path(args.dir) / "client.toml") as c:
            servers = fscmds.live_servers(c)
    if args.json:
        print_json({**st, "servers": servers})
        return
    print(f"cluster {st['dir']}: metaserver {st['meta']}, "
          f"{len(procs)} process(es) running of {int(st['data_servers']) + 1}")  # type: ignore[call-overload]
    for name, pid in sorted(procs.items()):
        print(f"  {name:<8} pid {pid}")
    for sid, s in sorted(servers.items()):
        print(f"data server {sid[:8]} {s['host']}:{s['port']} {fscmds.server_state(s)} "
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
    """Check a running cluster (read-only unless --repair); exit 0 clean, 1 problems,
    2 incomplete (after --repair: of the check that follows the repair)."""
    import trio

    from pfs.core.config import ConfigError
    from pfs.tools.fsck import fsck, render

    if args.remove_orphans and not args.repair:
        print("pfs fsck: --remove-orphans needs --repair", file=sys.stderr)
        sys.exit(2)
    try:
        report = trio.run(lambda: fsck(args.config, args.meta, verify=args.verify,
                                       rate=args.rate, paths=args.paths,
                                       repair=args.repair,
                                       remove_orphans=args.remove_orphans))
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
    p.add_argument("--version", action="version", version=tool_version())
    sub = p.add_subparsers(dest="cmd", required=True)

    def client_cmd(name: str, fn: Callable[[argparse.Namespace], None], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument("--config", help="client.toml (default: $PFS_CONFIG, then "
                                          "~/.config/pfs/client.toml, /etc/pfs/client.toml)")
        sp.add_argument("--meta", help="metaserver HOST:PORT")
        sp.set_defaults(fn=fn)
        return sp

    def data_cmd(name: str, fn: Callable[[argparse.Namespace, Any], None],
                 help: str) -> argparse.ArgumentParser:
        """A command that prints data: people's format, or ``--json``."""
        sp = client_cmd(name, _with_client(fn), help)
        sp.add_argument("--json", action="store_true", help="one JSON document for scripts")
        return sp

    sp = data_cmd("ls", fscmds.cmd_ls, "list directories")
    sp.add_argument("-l", "--long", action="store_true", help="mode, links, owner, size, time")
    sp.add_argument("paths", nargs="*", metavar="PATH")
    data_cmd("stat", fscmds.cmd_stat, "show attributes").add_argument(
        "paths", nargs="+", metavar="PATH")
    sp = client_cmd("mkdir", _with_client(fscmds.cmd_mkdir), "make directories")
    sp.add_argument("-p", "--parents", action="store_true", help="make parents, no error if "
                                                                 "it exists")
    sp.add_argument("paths", nargs="+", metavar="PATH")
    sp = client_cmd("rm", _with_client(fscmds.cmd_rm), "remove files (and trees with -r)")
    sp.add_argument("-r", "--recursive", action="store_true", help="remove directories too")
    sp.add_argument("paths", nargs="+", metavar="PATH")
    sp = client_cmd("mv", _with_client(fscmds.cmd_mv), "rename")
    sp.add_argument("src")
    sp.add_argument("dst")
    client_cmd("cat", _with_client(fscmds.cmd_cat), "print files").add_argument(
        "paths", nargs="+", metavar="PATH")
    sp = client_cmd("put", _with_client(transfer.cmd_put),
                    "copy local files into pfs (- is stdin); atomic: a temporary name, "
                    "renamed when complete")
    sp.add_argument("-r", "--recursive", action="store_true", help="copy directories")
    sp.add_argument("sources", nargs="+", metavar="LOCAL")
    sp.add_argument("dest", metavar="REMOTE", help="a file, or a directory to copy into")
    sp = client_cmd("get", _with_client(transfer.cmd_get),
                    "copy pfs files to local disk (- is stdout); atomic: a temporary name, "
                    "renamed when complete")
    sp.add_argument("-r", "--recursive", action="store_true", help="copy directories")
    sp.add_argument("sources", nargs="+", metavar="REMOTE")
    sp.add_argument("dest", metavar="LOCAL", help="a file, a directory to copy into, or -")
    sp = data_cmd("setstripe", fscmds.cmd_setstripe,
                  "change a directory's default (or an empty file's) layout: only the "
                  "fields given")
    sp.add_argument("--count", "-c", type=int, help="stripes a file is cut into (at most the "
                                                    "live data servers)")
    sp.add_argument("--unit", "-S", type=parse_size, help="stripe unit, e.g. 1M (a multiple "
                                                          "of 4 KiB)")
    sp.add_argument("--replicas", "-r", type=int, help="copies of each stripe (at most the "
                                                       "live data servers)")
    sync = sp.add_mutually_exclusive_group()
    sync.add_argument("--no-sync", dest="durable", action="store_const", const=False,
                      help="scratch data: close() does not wait for the data to reach "
                           "stable storage (fsync still does); inherited by new files")
    sync.add_argument("--sync", dest="durable", action="store_const", const=True,
                      help="close() syncs the data before it commits the size (default)")
    sp.add_argument("path")
    data_cmd("getstripe", fscmds.cmd_getstripe,
             "show a layout and its servers' addresses").add_argument("path")
    data_cmd("df", fscmds.cmd_df, "capacity of the cluster, per data server")
    sp = client_cmd("load", cmd_load, "load a safetensors checkpoint (file, index or "
                                      "directory) and report GB/s")
    sp.add_argument("path", help="a local path, or a pfs path (with --config/--meta/$PFS_CONFIG, "
                                      "or when no local PATH exists and a client config is "
                                      "found: ~/.config/pfs/client.toml, /etc/pfs/client.toml)")
    sp.add_argument("--device", default="cpu", type=_device, help="cpu, cuda or cuda:N")
    sp.add_argument("--tp-rank", type=int, default=None, help="this rank's tensor-parallel "
                                                              "index")
    sp.add_argument("--tp-size", type=int, default=None, help="tensor-parallel ranks")
    sp.add_argument("--split", action="append", metavar="PATTERN=DIM",
                    help="tensor-parallel rule: tensors matching PATTERN cut along DIM")
    sp.add_argument("--framework", choices=["torch", "numpy"], default=None,
                    help="what the tensors come back as (default: torch if installed)")
    sp.add_argument("--local", action="store_true", help="PATH is on local disk")
    sp.add_argument("--json", action="store_true", help="one JSON document for scripts")

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
    sp.add_argument("--json", action="store_true", help="one JSON document for scripts")
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
        sp.add_argument("--repair", action="store_true",
                        help="replace missing, short and corrupt replicas with good copies "
                             "from their chains, then check again")
        sp.add_argument("--remove-orphans", action="store_true",
                        help="with --repair: delete objects no file references")
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
    sp = adm.add_parser("status", help="the metaserver and every data server: address, "
                                       "state, domain, capacity, heartbeat age, load, "
                                       "version")
    sp.add_argument("--config", help="client.toml (default: $PFS_CONFIG, then "
                                      "~/.config/pfs/client.toml, /etc/pfs/client.toml)")
    sp.add_argument("--meta", help="metaserver HOST:PORT")
    sp.add_argument("--json", action="store_true", help="one JSON document for scripts")
    sp.set_defaults(fn=_with_client(cmd_admin_status))
    fsck_args(adm.add_parser("fsck", help=fsck_help + " (pfs fsck)"))
    admin_keys.add_parser(adm)
    admin_backup.add_parser(adm)  # backup, restore
    admin_servers.add_commands(adm, _client)  # servers, drain, undrain
    admin_repair.add_commands(adm, _client)  # repair status, lost, rebalance
    admin_kv.add_commands(adm)  # kv

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
    _global_options_everywhere(p)
    return p


def _global_options_everywhere(p: argparse.ArgumentParser) -> None:
    """``pfs put -v`` as well as ``pfs -v put``: every subcommand also takes the global
    options (where it has no option of that name itself). SUPPRESS as the default keeps a
    subcommand from resetting what was given before it."""
    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in set(action.choices.values()):
                    taken = child._option_string_actions
                    passthrough = any(a.dest == "rest" for a in child._actions)
                    if not passthrough and "-v" not in taken and "--verbose" not in taken:
                        child.add_argument("-v", "--verbose", action="store_true",
                                           default=argparse.SUPPRESS, help="log more")
                    walk(child)

    walk(p)


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
    """The ``pfs`` program (``argv`` None: ``sys.argv``; given: a call from Python)."""
    try:
        try:
            _main(argv)
        except KeyboardInterrupt:  # before a command ran (while importing what it needs)
            print("pfs: interrupted", file=sys.stderr)
            sys.exit(EXIT_INTERRUPTED)
    except SystemExit as done:
        if argv is None and done.code == EXIT_INTERRUPTED:
            # The command has cleaned up. CPython 3.11 remembers a KeyboardInterrupt
            # raised inside exec() of a string (dataclasses build methods so, while
            # the client is imported) even once caught, and at exit kills itself
            # with SIGINT (status -2); leave without that final step.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        raise
    finally:
        if argv is None:
            # the exit status is decided: a Ctrl-C now would only turn it into a
            # KeyboardInterrupt during interpreter shutdown (status -2)
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for prefix, fn in _PASSTHROUGH.items():
        if tuple(argv[:len(prefix)]) == prefix:
            # no set-up here: a server sets up its own logging (INFO by default,
            # --log-level, --log-format; pfs/core/logs.py), and one made here first
            # would hold (basicConfig does nothing the second time): empty journals
            fn(argparse.Namespace(rest=argv[len(prefix):]))
            return
    _sigterm_unwinds()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    code = run(args)
    if code:
        sys.exit(code)


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; the one place user errors become one line and a status."""
    try:
        args.fn(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`pfs ls | head`): not an error of ours; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as exc:
        print(f"pfs: {error_line(exc)}", file=sys.stderr)
        return exit_status(exc)
    except KeyboardInterrupt:
        print("pfs: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    main()
