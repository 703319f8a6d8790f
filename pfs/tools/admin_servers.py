"""``pfs admin servers`` / ``drain`` / ``undrain``: the data servers as the metaserver sees
them (state, lease age, failure domain, space) and the operator's draining mark.

A server is named by its id, a unique prefix of it (``pfs df`` shows 8 characters) or
``HOST:PORT``. Draining only stops new stripes going to a server (durable on the
metaserver); moving its data out is repair's.
"""
from __future__ import annotations

import argparse
import errno
import json
from collections.abc import Callable
from typing import Any

from pfs.client.plan import MetaCall, Plan
from pfs.core.messages import meta as M

ClientOf = Callable[[argparse.Namespace], Any]


def resolve(servers: dict[str, dict[str, Any]], name: str) -> str:
    """The id of the server ``name`` names (id, unique id prefix, or HOST:PORT)."""
    if name in servers:
        return name
    found = [sid for sid, s in servers.items()
             if sid.startswith(name) or f"{s.get('host')}:{s.get('port')}" == name]
    if len(found) == 1:
        return found[0]
    if not found:
        raise OSError(errno.ENOENT, f"no data server {name!r} (see `pfs admin servers`)")
    raise OSError(errno.EINVAL, f"{name!r} names {len(found)} data servers: "
                                f"{', '.join(sorted(found))}")


def drain_plan(sid: str, on: bool, cred: Any) -> Plan[str]:
    return (yield MetaCall(M.Drain(sid=sid, on=on, cred=cred))).state  # type: ignore[no-any-return]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}G"


def state_of(s: dict[str, Any]) -> str:
    """A server record's state (``state``; from ``alive``/``full`` for an older
    metaserver)."""
    return str(s.get("state") or ("down" if not s.get("alive") else
                                  "full" if s.get("full") else "up"))


def rows(servers: dict[str, dict[str, Any]]) -> list[str]:
    """The table of ``pfs admin servers``: age is seconds since the last heartbeat."""
    out = [f"{'server':<34} {'address':<22} {'state':<9} {'age':>6} {'domain':<16} "
           f"{'size':>9} {'avail':>9}"]
    for sid, s in sorted(servers.items(), key=lambda kv: (kv[1].get("host", ""),
                                                           kv[1].get("port", 0))):
        age = s.get("age")
        addr = f"{s.get('host', '?')}:{s.get('port', '?')}"
        out.append(f"{sid:<34} {addr:<22} {state_of(s):<9} "
                   f"{'-' if age is None else f'{age:.1f}s':>6} {s.get('domain', ''):<16} "
                   f"{_gib(s.get('total', 0)):>9} {_gib(s.get('free', 0)):>9}")
    return out


def cmd_servers(client_of: ClientOf, args: argparse.Namespace) -> None:
    with client_of(args) as c:
        servers = c._run(c.aio.meta.servers)
    if args.json:
        print(json.dumps(servers, indent=2, sort_keys=True))
        return
    print("\n".join(rows(servers)))


def cmd_drain(client_of: ClientOf, on: bool, args: argparse.Namespace) -> None:
    with client_of(args) as c:
        try:
            sid = resolve(c._run(c.aio.meta.servers), args.server)
            state = c._drive(drain_plan, sid, on, c.aio.meta.wire_cred(c.aio.cred))
        except OSError as exc:
            raise SystemExit(f"pfs admin {'drain' if on else 'undrain'}: "
                             f"{exc.strerror or exc}") from None
    print(f"{sid}: {state}")


def add_commands(adm: Any, client_of: ClientOf) -> None:
    """Register the subcommands on ``pfs admin``'s subparsers; ``client_of(args)`` opens
    a client from ``--config``/``--meta``."""
    def client_args(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--config", help="client.toml (default: $PFS_CONFIG)")
        sp.add_argument("--meta", help="metaserver HOST:PORT")
        return sp

    sp = client_args(adm.add_parser("servers", help="data servers: state (up, suspect, "
                                                    "down, draining, full), lease age, "
                                                    "failure domain, space"))
    sp.add_argument("--json", action="store_true", help="the metaserver's records as JSON")
    sp.set_defaults(fn=lambda a: cmd_servers(client_of, a))
    for name, on, text in (("drain", True, "stop placing new stripes on a server "
                                           "(durable; its data stays until repaired away)"),
                           ("undrain", False, "place new stripes on a drained server again")):
        sp = client_args(adm.add_parser(name, help=text))
        sp.add_argument("server", help="server id, unique id prefix, or HOST:PORT")
        sp.set_defaults(fn=lambda a, on=on: cmd_drain(client_of, on, a))
