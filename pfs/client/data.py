"""Connections to data servers for the trio driver (:mod:`pfs.client.trio_driver`): a few
per server, opened on first use, looked up again when a server moved. What to send where
is the planner's (:mod:`pfs.client.plan`)."""
from __future__ import annotations

import errno
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from pfs.core.auth import ClientAuth
from pfs.core.messages.base import RequestMessage
from pfs.core.wire.connect import open_rpc
from pfs.core.wire.rpc import Result, RpcClient

log = logging.getLogger(__name__)

# Largest single request; bigger pieces (huge stripe units) are cut to this.
MAX_REQUEST = 8 << 20
# Requests in flight per client, across all servers: bounds memory and socket queues.
MAX_IN_FLIGHT = 64


async def run_all(jobs: list[Callable[[], Awaitable[Any]]]) -> None:
    """Run jobs concurrently; if any fails, raise its OSError itself (not a group), so
    callers see the errno of the failure as for a single call."""
    if len(jobs) == 1:
        await jobs[0]()
        return
    try:
        async with trio.open_nursery() as n:
            for job in jobs:
                n.start_soon(job)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        first = next((e for e in leaves if isinstance(e, OSError)), None)
        if first is None or any(not isinstance(e, (OSError, trio.Cancelled)) for e in leaves):
            raise
        raise first from group


def _leaves(group: BaseExceptionGroup) -> Any:
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


class DataClient:
    """Connections to data servers and the parallel read/write of stripe pieces."""

    def __init__(self, nursery: trio.Nursery,
                 lookup_servers: Callable[[], Awaitable[dict[str, dict[str, Any]]]], *,
                 connections_per_server: int = 2, timeout: float = 60.0,
                 auth: ClientAuth | None = None) -> None:
        self._nursery = nursery
        self._auth = auth or ClientAuth()
        self._lookup_servers = lookup_servers
        self._per_server = max(1, connections_per_server)
        self.timeout = timeout
        self._addrs: dict[str, tuple[str, int]] = {}
        self._conns: dict[str, list[RpcClient]] = {}
        self._rr = itertools.count()
        self._locks: dict[str, trio.Lock] = {}
        # a place among the requests in flight: a caller that times a request (a hedged
        # read) takes it first, so waiting for one is not counted as the server's time
        self.slots = trio.Semaphore(MAX_IN_FLIGHT)

    def known_address(self, sid: str) -> tuple[str, int] | None:
        """Where server ``sid`` was last seen, without asking the metaserver."""
        return self._addrs.get(sid)

    async def _address(self, sid: str) -> tuple[str, int]:
        if sid not in self._addrs:
            servers = await self._lookup_servers()
            self._addrs = {k: (v["host"], int(v["port"])) for k, v in servers.items()}
            if sid not in self._addrs:
                raise OSError(errno.EIO, f"data server {sid} is not registered")
        return self._addrs[sid]

    async def connection(self, sid: str) -> RpcClient:
        conns = self._conns.get(sid)
        if conns and len(conns) >= self._per_server:
            c = conns[next(self._rr) % len(conns)]
            if c.alive:
                return c
        lock = self._locks.setdefault(sid, trio.Lock())
        async with lock:
            conns = [c for c in self._conns.get(sid, []) if c.alive]
            if len(conns) < self._per_server:
                host, port = await self._address(sid)
                try:
                    conns.append(await open_rpc(self._auth, self._nursery, host, port,
                                                timeout=self.timeout))
                except OSError as first:
                    err = first
                    self._addrs.pop(sid, None)  # it may have moved: ask again next time
                    if not conns:
                        # ... and now, once: a server that restarted registered anew,
                        # usually on another port
                        try:
                            moved = await self._address(sid)
                        except OSError:
                            moved = (host, port)
                        if moved != (host, port):
                            host, port = moved
                            try:
                                conns.append(await open_rpc(
                                    self._auth, self._nursery, host, port, timeout=self.timeout))
                            except OSError as again:
                                self._addrs.pop(sid, None)
                                err = again
                    if not conns:
                        raise OSError(err.errno or errno.EIO,
                                      f"data server {sid} at {host}:{port}: {err.strerror}") from None
            self._conns[sid] = conns
            return conns[next(self._rr) % len(conns)]

    async def send(self, sid: str, msg: RequestMessage, *, held: bool = False,
                   **kw: Any) -> Result:
        """Request ``msg`` to server ``sid`` (``payload``, ``into``, ``timeout`` as
        :meth:`RpcClient.send`); ``held``: the caller holds a place of :attr:`slots`."""
        if not held:
            async with self.slots:
                return await self.send(sid, msg, held=True, **kw)
        conn = await self.connection(sid)
        return await conn.send(msg, **kw)

    def close(self) -> None:
        for conns in self._conns.values():
            for c in conns:
                c.close()
        self._conns.clear()

