"""``pfs admin status``: the cluster as the metaserver sees it - its address and protocol
version, then each data server's address, state, failure domain, capacity, heartbeat
age, load over its last heartbeat interval and version (``mfscli``, ``juicefs status``,
``lfs df`` in one table).

The server table is built here once: ``pfs admin servers`` prints the same records and
the same table (full server ids instead of 8 characters), so the two never disagree.
"""
from __future__ import annotations

import argparse
from typing import Any

from pfs.tools.fscmds import live_servers, server_state
from pfs.tools.output import human, print_json, tool_version


def server_records(servers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The metaserver's server records as the tools print them, ordered by address.
    ``version``, ``protocol`` and ``load`` are None for a server too old to report them
    (or not heard from since the metaserver started)."""
    out = []
    for sid, s in sorted(servers.items(), key=lambda kv: (kv[1].get("host", ""),
                                                           kv[1].get("port", 0))):
        total, free = s.get("total", 0), s.get("free", 0)
        out.append({
            "sid": sid, "address": f"{s.get('host', '?')}:{s.get('port', '?')}",
            "state": server_state(s), "domain": s.get("domain", ""),
            "total": total, "free": free,
            "used_pct": round(100 * (total - free) / total, 1) if total else 0.0,
            "heartbeat_age": s.get("age"), "dirs": len(s.get("dirs") or []),
            "version": s.get("version"), "protocol": s.get("protocol"),
            "load": s.get("load"), "kv": s.get("kv")})
    return out


def kv_table(records: list[dict[str, Any]]) -> list[str]:
    """The KV-cache blocks of the servers that keep some (none: no lines): bytes used of
    the budget, blocks, and hits, misses and evictions since each server started."""
    rows = [s for s in records if s.get("kv")]
    if not rows:
        return []
    out = [f"{'kv cache':<8} {'used':>10} {'budget':>10} {'blocks':>8} {'hits':>10} "
           f"{'misses':>10} {'hit%':>5} {'evictions':>10}"]
    for s in rows:
        kv = s["kv"]
        hits, misses = kv.get("hits", 0), kv.get("misses", 0)
        pct = f"{100 * hits / (hits + misses):5.1f}" if hits + misses else f"{'-':>5}"
        out.append(f"{s['sid'][:8]:<8} {human(kv.get('used', 0)):>10} "
                   f"{human(kv.get('budget', 0)):>10} {kv.get('blocks', 0):>8} {hits:>10} "
                   f"{misses:>10} {pct} {kv.get('evictions', 0):>10}")
    return out


def _rate(n: float) -> str:
    return f"{human(n)}/s".replace(" ", "")


def server_table(records: list[dict[str, Any]], full_ids: bool = False) -> list[str]:
    """One line per server, under a header; load is per second over the server's last
    heartbeat interval ("-": not reported)."""
    w = 33 if full_ids else 8
    out = [f"{'server':<{w}} {'address':<21} {'state':<8} {'domain':<12} {'size':>10} "
           f"{'used':>6} {'heartbeat':>9} {'req/s':>6} {'in':>10} {'out':>10} "
           f"{'conns':>5}  version"]
    for s in records:
        age, load = s["heartbeat_age"], s["load"]
        if load:
            ld = (f"{load.get('requests', 0):>6} {_rate(load.get('bytes_in', 0)):>10} "
                  f"{_rate(load.get('bytes_out', 0)):>10} {load.get('connections', 0):>5}")
        else:
            ld = f"{'-':>6} {'-':>10} {'-':>10} {'-':>5}"
        proto = s["protocol"]
        version = (f"{s['version']} (protocol {proto[0]}-{proto[1]})"
                   if s["version"] and proto else s["version"] or "-")
        out.append(f"{s['sid'][:w]:<{w}} {s['address']:<21} {s['state']:<8} "
                   f"{s['domain'][:12]:<12} {human(s['total']):>10} {s['used_pct']:5.1f}% "
                   f"{'-' if age is None else f'{age:.1f} s ago':>9} {ld}  {version}")
    return out


def status_record(c: Any) -> dict[str, Any]:
    """What ``pfs admin status --json`` prints."""
    hello = c._run(c.aio.meta.hello, "pfs admin status")
    vfs = c.statvfs()
    meta = c.aio.meta
    return {
        "tool": tool_version(),
        "meta": {"address": f"{meta.host}:{meta.port}", "protocol": hello.version},
        "servers": server_records(live_servers(c)),
        "capacity": {"total": vfs.f_blocks * vfs.f_frsize, "free": vfs.f_bavail * vfs.f_frsize,
                     "files": vfs.f_files - vfs.f_ffree},
    }


def cmd_admin_status(args: argparse.Namespace, c: Any) -> None:
    rec = status_record(c)
    if args.json:
        print_json(rec)
        return
    m, cap = rec["meta"], rec["capacity"]
    servers = rec["servers"]
    up = sum(1 for s in servers if s["state"] != "down")
    print(f"metaserver {m['address']}  protocol {m['protocol']}  ({rec['tool']})")
    print(f"data servers: {up} of {len(servers)} up;  capacity {human(cap['total'])}, "
          f"{human(cap['free'])} free;  {cap['files']} files")
    print("\n".join(server_table(servers)))
    kv = kv_table(servers)
    if kv:
        print("\n" + "\n".join(kv))
