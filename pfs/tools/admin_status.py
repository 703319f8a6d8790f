"""``pfs admin status``: the cluster as the metaserver sees it - its address and protocol
version, then each data server's address, state, capacity and heartbeat age (``mfscli``,
``juicefs status``, ``lfs df`` in one table)."""
from __future__ import annotations

import argparse
from typing import Any

from pfs.tools.fscmds import live_servers, server_state
from pfs.tools.output import human, print_json, tool_version


def status_record(c: Any) -> dict[str, Any]:
    """What ``pfs admin status --json`` prints."""
    hello = c._run(c.aio.meta.hello, "pfs admin status")
    servers = live_servers(c)
    vfs = c.statvfs()
    meta = c.aio.meta
    return {
        "tool": tool_version(),
        "meta": {"address": f"{meta.host}:{meta.port}", "protocol": hello.version},
        "servers": [{"sid": sid, "address": f"{s['host']}:{s['port']}",
                     "state": server_state(s), "total": s["total"], "free": s["free"],
                     "used_pct": round(100 * (s["total"] - s["free"]) / s["total"], 1)
                     if s["total"] else 0.0,
                     "heartbeat_age": s.get("age"), "dirs": len(s.get("dirs") or [])}
                    for sid, s in sorted(servers.items(),
                                         key=lambda kv: (kv[1]["host"], kv[1]["port"]))],
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
    print(f"{'server':<9} {'address':<22} {'state':<5} {'size':>10} {'used':>6} "
          f"{'heartbeat':>9}")
    for s in servers:
        age = s["heartbeat_age"]
        print(f"{s['sid'][:8]:<9} {s['address']:<22} {s['state']:<5} {human(s['total']):>10} "
              f"{s['used_pct']:5.1f}% {'-' if age is None else f'{age:.1f} s ago':>9}")
