"""A pool of RPC connections by key, opened on first use (one at a time per key), their
readers in :meth:`ConnectionPool.run`'s nursery, closed when it ends: the metaserver's
connections to data servers and a data server's to its chain peers."""
from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable

import trio

from pfs.core.wire.rpc import RpcClient

# opens a connection whose reader runs in the nursery given
Opener = Callable[[trio.Nursery], Awaitable[RpcClient]]


class ConnectionPool:
    def __init__(self, what: str) -> None:
        self._what = what  # who holds the pool, for the error when it is not running
        self._nursery: trio.Nursery | None = None
        self._clients: dict[str, RpcClient] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Keep connections until cancelled, then close them."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            for client in self._clients.values():
                client.close()

    async def get(self, key: str, open_: Opener) -> RpcClient:
        """The live connection of ``key``, else a new one from ``open_``."""
        async with self._locks.setdefault(key, trio.Lock()):
            client = self._clients.get(key)
            if client is not None and client.alive:
                return client
            if self._nursery is None:
                raise OSError(errno.ENOTCONN, f"{self._what} is not running: no connections")
            client = await open_(self._nursery)
            self._clients[key] = client
            return client

    def forget(self, key: str) -> None:
        """Close ``key``'s connection: the next call connects anew."""
        old = self._clients.pop(key, None)
        if old is not None:
            old.close()
