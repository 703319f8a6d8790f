"""``pfs admin repair status`` / ``lost`` / ``rebalance``: repair's progress, declaring a
data server lost for good, and moving chain memberships to new servers
(docs/architecture.md "Repair"). Servers are named as ``pfs admin servers`` names them.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from pfs.client.plan import MetaCall, Plan
from pfs.core.messages import meta as M
from pfs.tools.admin_servers import ClientOf, resolve


def call_plan(msg: Any) -> Plan[dict[str, Any]]:
    return (yield MetaCall(msg)).status  # type: ignore[no-any-return]


def lines(st: dict[str, Any]) -> list[str]:
    """``pfs admin repair status`` in words."""
    bound = f"{st['rate'] / (1 << 20):.0f} MiB/s" if st["rate"] else "none"
    out = [f"chains {st['chains']}, short of replicas {st['short']}, "
           f"moving {len(st['joining'])}; copied {st['chains_copied']} chains, "
           f"{st['objects_copied']} objects, {st['bytes_copied'] / (1 << 20):.1f} MiB at "
           f"{st['copy_rate'] / (1 << 20):.1f} MiB/s (bound: {bound})"]
    for j in st["joining"]:
        out.append(f"  chain {j['chain']}: {', '.join(j['members'])}; joining "
                   f"{', '.join(j['joining']) or '-'}; leaving {', '.join(j['leaving']) or '-'}")
    for c in st["copying"]:
        out.append(f"  copying chain {c['chain']} to {c['target']} for {c['seconds']} s")
    for sid, n in sorted(st["draining"].items()):
        out.append(f"  draining {sid}: {n} chain memberships left"
                   + (" (empty)" if n == 0 else ""))
    for sid, t in sorted(st["down"].items()):
        out.append(f"  down {sid} for {t} s (lost after {st['lost_after']} s)")
    if st["lost"]:
        out.append(f"  lost: {', '.join(st['lost'])}")
    if st["rebalancing"]:
        out.append("  rebalancing")
    return out


def _print(st: dict[str, Any], as_json: bool) -> None:
    print(json.dumps(st, indent=2, sort_keys=True) if as_json else "\n".join(lines(st)))


def cmd_status(client_of: ClientOf, args: argparse.Namespace) -> None:
    with client_of(args) as c:
        _print(c._drive(call_plan, M.RepairStatus()), args.json)


def cmd_lost(client_of: ClientOf, args: argparse.Namespace) -> None:
    with client_of(args) as c:
        try:
            sid = resolve(c._run(c.aio.meta.servers), args.server)
            st = c._drive(call_plan, M.Lost(sid=sid, cred=c.aio.meta.wire_cred(c.aio.cred)))
        except OSError as exc:
            raise SystemExit(f"pfs admin lost: {exc.strerror or exc}") from None
    print(f"{sid}: lost; its chains get new members")
    _print(st, args.json)


def cmd_rebalance(client_of: ClientOf, args: argparse.Namespace) -> None:
    with client_of(args) as c:
        try:
            st = c._drive(call_plan, M.Rebalance(cred=c.aio.meta.wire_cred(c.aio.cred)))
        except OSError as exc:
            raise SystemExit(f"pfs admin rebalance: {exc.strerror or exc}") from None
    _print(st, args.json)


def add_commands(adm: Any, client_of: ClientOf) -> None:
    """Register ``repair``, ``lost`` and ``rebalance`` on ``pfs admin``'s subparsers."""
    def client_args(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--config", help="client.toml (default: $PFS_CONFIG, then "
                                          "~/.config/pfs/client.toml, /etc/pfs/client.toml)")
        sp.add_argument("--meta", help="metaserver HOST:PORT")
        sp.add_argument("--json", action="store_true", help="as JSON")
        return sp

    rep = adm.add_parser("repair", help="repair's progress").add_subparsers(
        dest="repair_cmd", required=True)
    sp = client_args(rep.add_parser("status", help="chains short of replicas, copies in "
                                                   "flight, servers draining or down"))
    sp.set_defaults(fn=lambda a: cmd_status(client_of, a))
    sp = client_args(adm.add_parser("lost", help="a data server is gone for good: its "
                                                 "chains get new members"))
    sp.add_argument("server", help="server id, unique id prefix, or HOST:PORT")
    sp.set_defaults(fn=lambda a: cmd_lost(client_of, a))
    sp = client_args(adm.add_parser("rebalance", help="move chain memberships to the "
                                                      "least loaded (new) servers"))
    sp.set_defaults(fn=lambda a: cmd_rebalance(client_of, a))
