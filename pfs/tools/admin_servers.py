"""``pfs admin servers`` / ``drain`` / ``undrain``: the data servers as the metaserver sees
them (state, lease age, failure domain, space, load, version: the table of ``pfs admin
status``, from the same records) and the operator's draining mark.

A server is named by its id, a unique prefix of it (``pfs df`` shows 8 characters) or
``HOST:PORT``. Draining only stops new stripes going to a server (durable on the
metaserver); moving its data out is repair's.
"""
from __future__ import annotations

import argparse
import errno
from collections.abc import Callable
from typing import Any

from pfs.client.plan import MetaCall, Plan
from pfs.core.messages import meta as M
from pfs.tools.admin_status import server_records, server_table
from pfs.tools.output import print_json

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


def cmd_servers(client_of: ClientOf, args: argparse.Namespace) -> None:
    """The server table of ``pfs admin status`` (one builder: the two agree), with full
    server ids; ``--json``: the same records as ``pfs admin status --json``'s
    ``servers``."""
    with client_of(args) as c:
        records = server_records(c._run(c.aio.meta.servers))
    if args.json:
        print_json(records)
        return
    print("\n".join(server_table(records, full_ids=True)))


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
        sp.add_argument("--config", help="client.toml (default: $PFS_CONFIG, then "
                                          "~/.config/pfs/client.toml, /etc/pfs/client.toml)")
        sp.add_argument("--meta", help="metaserver HOST:PORT")
        return sp

    sp = client_args(adm.add_parser("servers", help="data servers: state (up, suspect, "
                                                    "down, draining, full), lease age, "
                                                    "failure domain, space, load, version "
                                                    "(the table of `pfs admin status`)"))
    sp.add_argument("--json", action="store_true", help="one JSON document for scripts")
    sp.set_defaults(fn=lambda a: cmd_servers(client_of, a))
    for name, on, text in (("drain", True, "stop placing new stripes on a server "
                                           "(durable; its data stays until repaired away)"),
                           ("undrain", False, "place new stripes on a drained server again")):
        sp = client_args(adm.add_parser(name, help=text))
        sp.add_argument("server", help="server id, unique id prefix, or HOST:PORT")
        sp.set_defaults(fn=lambda a, on=on: cmd_drain(client_of, on, a))
