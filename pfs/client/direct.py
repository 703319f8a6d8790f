"""Small reads and writes of the synchronous client, in the calling thread.

A read or write through ``pfs.connect()`` otherwise crosses into the client's trio thread
and back, which costs more CPU than a small request itself (docs/architecture.md). For a
request that is one run of one stripe and at most ``direct_max`` bytes, the sync
client instead sends it over a blocking connection (:mod:`pfs.wire.blocking`) to the data
server (to each replica, in turn, for a write), from a small pool per server shared by
the caller's threads (at most MAX_PER_SERVER connections each).

This path only takes the easy case and says so by returning None: no known address for
a server yet, a capability due for renewal, a server that refuses the capability or
cannot be reached. The caller then takes the trio path, which has the whole logic
(looking up moved servers, renewing capabilities, replica failover) and the final word
on errors. A refused request changed nothing, so sending it again there is safe.
"""
from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from typing import Any

from pfs.auth import ClientAuth
from pfs.wire.blocking import BlockingRpcClient
from pfs.wire.connect import open_blocking

log = logging.getLogger(__name__)

# blocking connections per data server: more threads than this wait for one (opening a
# connection per request, handshake included, would cost far more than the request)
MAX_PER_SERVER = 8
# errors after which the trio path takes over (it renews, reconnects, fails over)
HAND_OVER = frozenset({errno.EACCES, errno.ESTALE, errno.ECONNRESET, errno.ECONNREFUSED,
                       errno.ENOTCONN, errno.ETIMEDOUT, errno.EPIPE, errno.EPROTO,
                       errno.EHOSTUNREACH, errno.ECONNABORTED})


class DirectData:
    """Blocking connections to data servers, by server id, for any thread."""

    def __init__(self, auth: ClientAuth,
                 address: Callable[[str], tuple[str, int] | None],
                 timeout: float = 60.0) -> None:
        self._auth = auth
        # the async DataClient's address cache (filled by its lookups): a server the
        # trio path has not reached yet is left to it
        self._address = address
        self.timeout = timeout
        self._idle: dict[str, list[BlockingRpcClient]] = {}
        self._count: dict[str, int] = {}  # connections per server, idle or in use
        self._cond = threading.Condition()
        self.closed = False

    def _take(self, sid: str) -> BlockingRpcClient | None:
        addr = self._address(sid)
        if addr is None:
            return None
        with self._cond:
            while True:
                if self.closed:
                    return None
                idle = self._idle.get(sid)
                while idle:
                    rpc = idle.pop()
                    if rpc.alive:
                        return rpc
                    self._count[sid] -= 1
                if self._count.get(sid, 0) < MAX_PER_SERVER:
                    self._count[sid] = self._count.get(sid, 0) + 1
                    break
                self._cond.wait()
        try:
            return open_blocking(self._auth, addr[0], addr[1], timeout=self.timeout)
        except OSError as exc:  # moved, down, refused: the trio path finds out
            log.debug("direct connection to data server %s at %s:%d: %s", sid, *addr, exc)
            with self._cond:
                self._count[sid] -= 1
                self._cond.notify()
            return None

    def _give(self, sid: str, rpc: BlockingRpcClient) -> None:
        """Back to the pool; a connection that failed (closed) leaves it."""
        with self._cond:
            if self.closed or not rpc.alive:
                rpc.close()
                self._count[sid] -= 1
            else:
                self._idle.setdefault(sid, []).append(rpc)
            self._cond.notify()

    def call(self, sid: str, method: str, fields: dict[str, Any], *,
             payload: Any = None, into: memoryview | None = None
             ) -> tuple[dict[str, Any], int] | None:
        """One request to server ``sid``: (reply fields, payload bytes received), or
        None when it is left to the trio path (see the module doc)."""
        rpc = self._take(sid)
        if rpc is None:
            return None
        try:
            reply = rpc.call_into(method, fields, payload=payload, into=into)
        except OSError as exc:
            if exc.errno in HAND_OVER:
                return None
            raise
        finally:
            self._give(sid, rpc)  # a failed connection is closed and leaves the pool
        return reply

    def close(self) -> None:
        with self._cond:
            self.closed = True
            pools, self._idle = self._idle, {}
            self._cond.notify_all()
        for idle in pools.values():
            for rpc in idle:
                rpc.close()
