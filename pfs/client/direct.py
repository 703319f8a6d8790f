"""Blocking connections to data servers for the blocking driver
(:mod:`pfs.client.blocking_driver`): a small pool per server shared by the caller's
threads (at most MAX_PER_SERVER connections each).

It connects only to servers whose address the trio driver's ``DataClient`` already
knows; every failure, its own included (no address, a connection refused or broken), is
an ``OSError`` for the plan to classify (a failed connection asks for a ``Reconnect``,
which the blocking driver leaves to the trio driver).
"""
from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from typing import Any

from pfs.core.auth import ClientAuth
from pfs.core.messages.base import RequestMessage
from pfs.core.wire.blocking import BlockingRpcClient
from pfs.core.wire.connect import open_blocking

log = logging.getLogger(__name__)

# blocking connections per data server: more threads than this wait for one (opening a
# connection per request, handshake included, would cost far more than the request)
MAX_PER_SERVER = 8

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

    def _take(self, sid: str) -> BlockingRpcClient:
        addr = self._address(sid)
        if addr is None:
            raise OSError(errno.ENOTCONN, f"no address known for data server {sid}")
        with self._cond:
            while True:
                if self.closed:
                    raise OSError(errno.ENOTCONN, "the client is closing")
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
        except OSError as exc:  # moved, down, refused: the trio driver finds out
            log.debug("blocking connection to data server %s at %s:%d: %s", sid, *addr, exc)
            with self._cond:
                self._count[sid] -= 1
                self._cond.notify()
            raise OSError(exc.errno or errno.ECONNREFUSED,
                          f"data server {sid} at {addr[0]}:{addr[1]}: {exc.strerror}") from None

    def _give(self, sid: str, rpc: BlockingRpcClient) -> None:
        """Back to the pool; a connection that failed (closed) leaves it."""
        with self._cond:
            if self.closed or not rpc.alive:
                rpc.close()
                self._count[sid] -= 1
            else:
                self._idle.setdefault(sid, []).append(rpc)
            self._cond.notify()

    def send(self, sid: str, msg: RequestMessage, *, payload: Any = None, into: Any = None,
             timeout: float | None = None) -> tuple[dict[str, Any], int]:
        """Request ``msg`` to server ``sid``: (reply fields, payload bytes received).
        ``timeout``: this call's, instead of the connection's (a hedge deadline; when it
        passes the connection is closed and the call is ``ETIMEDOUT``)."""
        fields, n, _ = self.exchange(sid, msg, payload=payload, into=into, timeout=timeout)
        return fields, n

    def exchange(self, sid: str, msg: RequestMessage, *, payload: Any = None,
                 into: Any = None, timeout: float | None = None
                 ) -> tuple[dict[str, Any], int, bool]:
        """As :meth:`send`, and whether the connection authenticates what it carries
        (``BlockingConnection.authenticated``): the reply's bytes are the server's."""
        rpc = self._take(sid)
        try:
            if timeout is None:
                fields, n = rpc.send(msg, payload=payload, into=into)
            else:
                rpc.conn.set_timeout(timeout)
                fields, n = rpc.send(msg, payload=payload, into=into)
                rpc.conn.set_timeout(self.timeout)
            return fields, n, rpc.conn.authenticated
        finally:
            self._give(sid, rpc)  # a failed connection is closed and leaves the pool

    def batch(self, sid: str, calls: list[tuple[RequestMessage, memoryview]]
              ) -> tuple[list[tuple[dict[str, Any], int] | OSError], bool]:
        """Requests without payload pipelined on one connection to server ``sid``
        (``BlockingRpcClient.send_batch``), and whether the connection authenticates
        what it carries."""
        rpc = self._take(sid)
        try:
            return rpc.send_batch(calls), rpc.conn.authenticated
        finally:
            self._give(sid, rpc)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            pools, self._idle = self._idle, {}
            self._cond.notify_all()
        for idle in pools.values():
            for rpc in idle:
                rpc.close()
