"""``pfs admin kv``: the KV-cache tier from an operator's seat - each data server's block
store (budget, bytes used, blocks, hits, misses, evictions, pinned, corrupt: its
``KvStats``) and this node's shared-memory tier (blocks and bytes held). A client
process's own counters (hits per tier, bytes) are on its metrics endpoint
(``pfs_client_kv_*``), since they live and die with the process."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pfs.kvcache import KVCache
from pfs.kvcache.arena import NAME as ARENA
from pfs.kvcache.nodetier import NodeTier, default_dir
from pfs.tools.output import human, print_json

COLUMNS = ("budget", "used", "blocks", "hits", "misses", "evictions", "puts", "pinned",
           "corrupt")


def node_record(node_dir: str | None, clear: bool = False) -> dict[str, Any]:
    d = Path(node_dir) if node_dir else default_dir()
    if not (d / ARENA).is_file():
        return {"dir": str(d), "blocks": 0, "bytes": 0}
    tier = NodeTier(d, 1, adopt=True)  # the arena as its users sized it
    if clear:
        tier.clear()
    u = tier.usage()
    tier.close()
    return {"dir": str(d), "blocks": u.blocks, "bytes": u.bytes}


def kv_record(args: argparse.Namespace) -> dict[str, Any]:
    with KVCache(args.config, "admin", meta=args.meta, node_tier_bytes=0, refresh=0) as kv:
        servers = kv.server_stats()
        addrs = dict(kv.aio.pool.addrs)
    return {"servers": {sid: {"address": "{}:{}".format(*addrs[sid]), **s}
                        for sid, s in sorted(servers.items())},
            "node": node_record(args.node_dir, args.clear_node)}


def cmd_admin_kv(args: argparse.Namespace) -> None:
    rec = kv_record(args)
    if args.json:
        print_json(rec)
        return
    node = rec["node"]
    print(f"node tier {node['dir']}: {node['blocks']} blocks, {human(node['bytes'])}")
    print(f"{'server':<8} {'address':<21} " + " ".join(f"{c:>9}" for c in COLUMNS))
    for sid, s in rec["servers"].items():
        if "error" in s:
            print(f"{sid[:8]:<8} {s['address']:<21} {s['error']}")
            continue
        cells = [human(s.get(c, 0)) if c in ("budget", "used") else str(s.get(c, "-"))
                 for c in COLUMNS]
        print(f"{sid[:8]:<8} {s['address']:<21} " + " ".join(f"{c:>9}" for c in cells))


def add_commands(adm: Any) -> None:
    sp = adm.add_parser("kv", help="the KV-cache tier: each data server's block store "
                                   "(budget, used, hits, misses, evictions) and this "
                                   "node's shared-memory tier")
    sp.add_argument("--config", default=os.environ.get("PFS_CONFIG"),
                    help="client.toml (default: $PFS_CONFIG)")
    sp.add_argument("--meta", help="metaserver HOST:PORT")
    sp.add_argument("--node-dir", help="the node tier's folder (default /dev/shm/pfs-kv-UID)")
    sp.add_argument("--clear-node", action="store_true",
                    help="remove every block of this node's tier first")
    sp.add_argument("--json", action="store_true", help="one JSON document for scripts")
    sp.set_defaults(fn=cmd_admin_kv)
