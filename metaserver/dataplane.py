"""The metaserver's side of the data plane: its connections to data servers, and the two
things it asks of them, truncating and deleting objects. Each call carries an admin
capability for that one server; its generation fences the inode, so every capability
issued before is stale for writing (pfs/core/caps.py)."""
from __future__ import annotations

import errno
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from pfs.core import caps
from pfs.core.auth import ClientAuth
from pfs.core.layout import object_size
from pfs.core.messages import data as D
from pfs.core.messages.base import RequestMessage
from pfs.core.wire.connect import open_rpc
from pfs.core.wire.pool import ConnectionPool
from pfs.core.wire.protocol import Limits
from pfs.core.wire.rpc import RpcClient
from pfs.metaserver.registry import Registry

DATA_TIMEOUT = 30.0  # seconds per call to a data server
DELETE_CHUNK = 1024  # object ids per delete request

# sid -> [(ino, request)], in order; ``request(cap=...)`` builds the message with the
# admin capability issued for that server
Calls = dict[str, list[tuple[int, Callable[..., RequestMessage]]]]


class DataPlane:
    def __init__(self, auth: ClientAuth, limits: Limits, registry: Registry,
                 signer: caps.CapSigner) -> None:
        self._auth = auth
        self._limits = limits
        self._registry = registry
        self._signer = signer
        self._pool = ConnectionPool("the metaserver's data plane")
        self.run = self._pool.run
        # told when a connection to a server is refused (the metaserver's failure
        # detection: a refusal it saw itself needs no probe)
        self.on_refused: Callable[[str], None] = lambda sid: None
        self.cut_floor = 0  # ns: the end of the last restore window (metaserver/backup.py)

    def forget(self, sid: str) -> None:
        """``sid`` registered again (perhaps restarted, perhaps elsewhere): the next call
        connects anew."""
        self._pool.forget(sid)

    async def _client(self, sid: str) -> RpcClient:
        async def open_(nursery: trio.Nursery) -> RpcClient:
            addr = self._registry.address(sid)
            if addr is None:
                raise OSError(errno.EHOSTDOWN, f"data server {sid} is down")
            try:
                return await self.open(nursery, *addr)
            except OSError as exc:
                if exc.errno == errno.ECONNREFUSED:
                    self.on_refused(sid)
                raise

        return await self._pool.get(sid, open_)

    async def open(self, nursery: trio.Nursery, host: str, port: int) -> RpcClient:
        """A new authenticated connection to a data server (its reader in ``nursery``)."""
        return await open_rpc(self._auth, nursery, host, port, limits=self._limits,
                              timeout=DATA_TIMEOUT)
    async def probe(self, sid: str, timeout: float) -> bool:
        """Whether ``sid`` answers a ``statfs`` within ``timeout`` seconds (a client
        reports a chain head it could not reach: is it really gone?)."""
        with trio.move_on_after(timeout):
            try:
                await (await self._client(sid)).request(D.Statfs(), timeout=timeout)
                return True
            except OSError:
                self.forget(sid)
                return False
        self.forget(sid)
        return False

    async def request(self, sid: str, build: Callable[..., RequestMessage],
                      timeout: float) -> Any:
        """One request to ``sid`` with an admin capability for every object (inode 0),
        waiting up to ``timeout`` seconds (a catch-up copies a whole chain)."""
        cap, _ = self._signer.issue(0, caps.ADMIN, ttl=timeout * 2, sid=sid)
        return await (await self._client(sid)).request(build(cap=cap), timeout=timeout)

    async def call_servers(self, calls: Calls) -> dict[str, OSError]:
        """Run each server's calls in order, servers in parallel; errors by server."""
        errors: dict[str, OSError] = {}

        async def one(sid: str, todo: list[tuple[int, Callable[..., RequestMessage]]]) -> None:
            try:
                client = await self._client(sid)
                for ino, request in todo:
                    # an admin capability for this server only; its generation fences
                    # the inode (every capability issued before is stale for writing)
                    cap, _ = self._signer.issue(ino, caps.ADMIN, ttl=DATA_TIMEOUT * 2, sid=sid)
                    await client.request(request(cap=cap))
            except OSError as exc:
                errors[sid] = exc

        async with trio.open_nursery() as nursery:
            for sid, todo in calls.items():
                nursery.start_soon(one, sid, todo)
        return errors

    async def truncate_objects(self, ino: int, layout: dict[str, Any], size: int) -> None:
        """Cut ``ino``'s objects to a file size of ``size`` on every replica, or none
        (``EIO`` naming a server that could not be reached)."""
        unit, count = layout["unit"], layout["count"]
        calls: Calls = {}
        # before any object is cut: what a restore compares (dataserver/cuts.py); never
        # inside a restore window (the namespace knows of this cut)
        at = max(time.time_ns(), self.cut_floor)
        for stripe, sids in enumerate(layout["servers"]):
            request = partial(D.Truncate, obj=(ino, stripe),
                              size=object_size(unit, count, stripe, size), at=at)
            for sid in sids:
                calls.setdefault(sid, []).append((ino, request))
        # reach every server before cutting any object: a replica cut while another
        # cannot be leaves copies that disagree about data the file (its size unchanged
        # by the failed truncation) still has
        errors = await self.call_servers({sid: [] for sid in calls})
        if not errors:
            errors = await self.call_servers(calls)
        if errors:
            sid, exc = next(iter(errors.items()))
            raise OSError(errno.EIO, f"cannot truncate inode {ino} on data server {sid}: {exc}")

    async def delete_objects(self, objs: dict[str, list[list[int]]],
                             live: set[int] | frozenset[int] = frozenset()
                             ) -> dict[str, OSError]:
        """Delete objects (``{sid: [[ino, stripe], ...]}``); errors by server. Those of
        inodes not in ``live`` (unlinked files) are tombstoned on the data servers; an
        old layout's objects of a live file are not (a new layout may own them again)."""
        calls: Calls = {}
        for sid, lst in objs.items():
            for tomb in (True, False):
                part = [(o[0], o[1]) for o in lst if (o[0] not in live) == tomb]
                calls.setdefault(sid, []).extend(
                    (0, partial(D.Delete, objs=part[i:i + DELETE_CHUNK], tomb=tomb))
                    for i in range(0, len(part), DELETE_CHUNK))
        return await self.call_servers(calls)
