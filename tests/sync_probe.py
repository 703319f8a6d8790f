"""A probe of durable acknowledgements: how many of a file's objects each data server
holds written but not yet synced (the data server's ``sync`` reply counts them)."""
from __future__ import annotations

from pfs.client.sync import Client
from pfs.core.layout import Layout
from pfs.core.messages import data as D


def unsynced(c: Client, path: str) -> dict[str, int]:
    """Server -> how many of ``path``'s objects there hold writes not yet synced (the
    probe syncs them: ask once)."""
    f = c.open(path, "rb")
    try:
        h = f.handle  # type: ignore[attr-defined]
        lay: Layout = h.layout
        out: dict[str, int] = {}
        for sid, stripes in by_server(lay).items():
            msg = D.Sync(objs=[(h.ino, s) for s in stripes], cap=h.cap)
            res = c._run(c.aio.data.send, sid, msg)
            out[sid] = res.fields["dirty"]
        return out
    finally:
        f.close()


def by_server(lay: Layout) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for stripe, sids in enumerate(lay.servers):
        for sid in sids:
            out.setdefault(sid, []).append(stripe)
    return out
