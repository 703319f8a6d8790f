"""The file commands of ``pfs``: ls, stat, mkdir, rm, mv, cat, setstripe, getstripe, df.

Each takes the parsed arguments and a connected client, prints people's output by
default and one JSON document with ``--json``, and raises ``OSError`` naming the path
(the command line prints it as one line)."""
from __future__ import annotations

import argparse
import errno
import stat as statmod
import sys
import time
from typing import Any

from pfs.tools.output import group_name, human, naming, print_json, user_name

COPY_CHUNK = 32 << 20


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def _kind(mode: int) -> str:
    return ("directory" if statmod.S_ISDIR(mode) else "symlink" if statmod.S_ISLNK(mode)
            else "file" if statmod.S_ISREG(mode) else "other")


def _attr_record(path: str, st: Any) -> dict[str, Any]:
    return {"path": path, "type": _kind(st.st_mode), "ino": st.st_ino,
            "mode": statmod.filemode(st.st_mode), "nlink": st.st_nlink,
            "uid": st.st_uid, "gid": st.st_gid, "size": st.st_size,
            "atime_ns": st.st_atime_ns, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def cmd_ls(args: argparse.Namespace, c: Any) -> None:
    out: list[dict[str, Any]] = []
    for path in args.paths or ["/"]:
        with naming(path):
            st = c.stat(path)
            entries = c.scandir(path) if st.is_dir() else None
        if entries is None:
            if args.json:
                out.append(_attr_record(path, st))
            else:
                print(path)
            continue
        if len(args.paths) > 1 and not args.json:
            print(f"{path}:")
        for e in sorted(entries, key=lambda e: e.name):
            a = e.attr
            if args.json:
                out.append(_attr_record(e.path, a) if a is not None else {"path": e.path})
            elif args.long and a is not None:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(a.st_mtime))
                print(f"{statmod.filemode(a.st_mode)} {a.st_nlink:3d} {user_name(a.st_uid):<8} "
                      f"{group_name(a.st_gid):<8} {a.st_size:12d} {when} {e.name}")
            else:
                print(e.name)
    if args.json:
        print_json(out)


def cmd_stat(args: argparse.Namespace, c: Any) -> None:
    recs = []
    for path in args.paths:
        with naming(path):
            recs.append(_attr_record(path, c.lstat(path)))
    if args.json:
        print_json(recs if len(recs) > 1 else recs[0])
        return
    for r in recs:
        print(f"  File: {r['path']}\n  Type: {r['type']}  Size: {r['size']} "
              f"({human(r['size'])})  Inode: {r['ino']}  Links: {r['nlink']}\n"
              f"  Mode: {r['mode']}  Uid: {user_name(r['uid'])} ({r['uid']})  "
              f"Gid: {group_name(r['gid'])} ({r['gid']})\n"
              f"Access: {_when(r['atime_ns'])}\nModify: {_when(r['mtime_ns'])}\n"
              f"Change: {_when(r['ctime_ns'])}")


def cmd_mkdir(args: argparse.Namespace, c: Any) -> None:
    for path in args.paths:
        with naming(path):
            if args.parents:
                c.makedirs(path, exist_ok=True)
            else:
                c.mkdir(path)


def rm_tree(c: Any, path: str) -> None:
    """Remove the directory ``path`` and everything below it (``pfs rm -r``, the demo)."""
    for e in c.scandir(path):
        if e.is_dir():
            rm_tree(c, e.path)
        else:
            c.remove(e.path)
    c.rmdir(path)


def cmd_rm(args: argparse.Namespace, c: Any) -> None:
    for path in args.paths:
        with naming(path):
            st = c.lstat(path)
            if st.is_dir():
                if not args.recursive:
                    raise OSError(errno.EISDIR, "Is a directory (use -r)", path)
                rm_tree(c, path)
            else:
                c.remove(path)


def cmd_mv(args: argparse.Namespace, c: Any) -> None:
    with naming(args.src):
        c.rename(args.src, args.dst)


def cmd_cat(args: argparse.Namespace, c: Any) -> None:
    out = sys.stdout.buffer
    for path in args.paths:
        with naming(path), c.open(path, "rb") as f:
            while chunk := f.read(COPY_CHUNK):
                out.write(chunk)
    out.flush()


# -- layouts ---------------------------------------------------------------------------
def live_servers(c: Any) -> dict[str, dict[str, Any]]:
    return dict(c._run(c.aio.meta.servers))


def check_layout(path: str, count: int | None, unit: int | None, replicas: int | None,
                 live: int) -> None:
    """Refuse values the cluster cannot honour, naming the path and the limit."""
    from pfs.core.layout import MAX_UNIT, MIN_UNIT

    def bad(what: str) -> OSError:
        return OSError(errno.EINVAL, what, path)

    if count is not None and not 1 <= count <= live:
        raise bad(f"stripe count {count} must be between 1 and {live} (the live data servers)")
    if replicas is not None and not 1 <= replicas <= live:
        raise bad(f"replicas {replicas} must be between 1 and {live} (the live data servers)")
    if unit is not None and (unit % MIN_UNIT or not MIN_UNIT <= unit <= MAX_UNIT):
        raise bad(f"stripe unit {unit} must be a multiple of {MIN_UNIT} up to {MAX_UNIT}")


def _addresses(layout: dict[str, Any], servers: dict[str, dict[str, Any]]) -> list[list[str]]:
    def addr(sid: str) -> str:
        s = servers.get(sid)
        return f"{s['host']}:{s['port']}" if s else "unknown"

    return [[addr(sid) for sid in stripe] for stripe in layout.get("servers") or []]


def print_layout(path: str, layout: dict[str, Any], servers: dict[str, dict[str, Any]],
                 as_json: bool) -> None:
    addrs = _addresses(layout, servers)
    if as_json:
        print_json({"path": path, **layout, "addresses": addrs})
        return

    def val(key: str, fmt: Any = str) -> str:
        v = layout.get(key) or 0
        return fmt(v) if v else "inherited"

    sync = "no (scratch)" if layout.get("durable") is False else "yes"
    print(f"{path}\n  stripe count: {val('count')}  unit: {val('unit', human)}  "
          f"replicas: {val('replicas')}  sync on close: {sync}")
    for i, (stripe, where) in enumerate(zip(layout.get("servers") or [], addrs, strict=True)):
        print(f"  stripe {i}: " + ", ".join(f"{sid[:8]} {a}" for sid, a in
                                              zip(stripe, where, strict=True)))


def cmd_setstripe(args: argparse.Namespace, c: Any) -> None:
    """Change the fields given, keep the others; refuse values the cluster cannot honour."""
    path = args.path
    servers = live_servers(c)
    live = sum(1 for s in servers.values() if s["alive"])
    check_layout(path, args.count, args.unit, args.replicas, live)
    with naming(path):
        cur = c.get_layout(path)
        if args.count is None and args.unit is None and args.replicas is None \
                and args.durable is None:
            raise OSError(errno.EINVAL, "nothing to change (give --count, --unit, "
                                        "--replicas or --sync/--no-sync)", path)
        lay = c.set_layout(path, count=args.count or cur.get("count") or 0,
                           unit=args.unit or cur.get("unit") or 0,
                           replicas=args.replicas or cur.get("replicas") or 0,
                           durable=args.durable)
    print_layout(path, lay, servers, args.json)


def cmd_getstripe(args: argparse.Namespace, c: Any) -> None:
    servers = live_servers(c)
    with naming(args.path):
        lay = c.get_layout(args.path)
    print_layout(args.path, lay, servers, args.json)


# -- capacity --------------------------------------------------------------------------
def server_state(s: dict[str, Any]) -> str:
    """up, suspect, down, draining or full (from ``alive``/``full`` for an older
    metaserver)."""
    return str(s.get("state") or ("down" if not s.get("alive") else
                                  "full" if s.get("full") else "up"))


def _df_row(name: str, total: int, free: int, note: str = "") -> str:
    used = total - free
    pct = 100 * used / total if total else 0
    return (f"{name:<40} {human(total):>11} {human(used):>11} {human(free):>11} "
            f"{pct:4.0f}%  {note}").rstrip()


def cmd_df(args: argparse.Namespace, c: Any) -> None:
    """One row per data server (and per data directory where it has several), then the
    total, each physical filesystem counted once (``lfs df``). A server's KV-cache
    blocks (bytes used of its budget) are noted on its row; they count as avail, since
    file writes take their space back."""
    servers = live_servers(c)
    s = c.statvfs()
    total, free = s.f_blocks * s.f_frsize, s.f_bavail * s.f_frsize
    ordered = sorted(servers.items(), key=lambda kv: (kv[1]["host"], kv[1]["port"]))
    if args.json:
        print_json({"servers": [{"sid": sid, "address": f"{v['host']}:{v['port']}",
                                 "state": server_state(v), "total": v["total"],
                                 "free": v["free"], "dirs": v.get("dirs") or [],
                                 **({"kv": v["kv"]} if v.get("kv") else {})}
                                for sid, v in ordered],
                    "total": total, "free": free, "files": s.f_files - s.f_ffree})
        return
    print(f"{'server / directory':<40} {'size':>11} {'used':>11} {'avail':>11} {'use%':>5}  "
          "state")
    for sid, srv in ordered:
        state = server_state(srv)
        note = state.upper() if state != "up" else state
        kv = srv.get("kv")
        if kv:
            note += f"  kv cache {human(kv['used'])} of {human(kv['budget'])}"
        print(_df_row(f"{sid[:8]} {srv['host']}:{srv['port']}", srv["total"], srv["free"],
                      note))
        dirs = srv.get("dirs") or []
        if len(dirs) > 1:
            for dpath, _fs, dtotal, dfree in dirs:
                print(_df_row(f"  {dpath}", dtotal, dfree))
    print(_df_row("total (each filesystem once)", total, free,
                  f"{s.f_files - s.f_ffree} files"))
