"""The low-level client of one data server's KV block store (trio): what the KV-cache
API (``pfs.kvcache``) builds its remote tier on.

    async with KvServerClient.connect(host, port, creds) as kv:
        await kv.put("llama3-8b", key, block)
        n = await kv.get_into("llama3-8b", key, memoryview(out))   # None: a miss

Requests are checked here as the server checks them (namespace, key and value limits:
``EINVAL``/``EMSGSIZE`` before anything is sent). A value's CRC32C goes with the put
(the server refuses a value that does not match it) and comes back with the get, where
it is checked again on the bytes received: a mismatch is ``EIO``, never wrong bytes
returned as a hit. Connections are opened on first use and again after one failed; the
credentials are the client's (its node key's data-plane key, as for file data). Given
the server's id (``sid``), a client on the server's host talks to it over its local Unix
socket (``\0pfs-data/<sid>``, as short-circuit file reads do; the same authentication),
which skips TCP; anywhere else, or when that socket refuses it, over TCP.
"""
from __future__ import annotations

import errno
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from pfs.core import crcfast
from pfs.core.auth import ClientAuth
from pfs.core.errors import ProtocolError
from pfs.core.messages import kv as K
from pfs.core.messages.base import RequestMessage, parse_reply
from pfs.core.wire.connect import open_rpc
from pfs.core.wire.rpc import RpcClient
from pfs.core.wire.transport import local_socket_name, open_unix_connection

log = logging.getLogger(__name__)

THREAD_CRC = 1 << 20  # values from this size are checksummed in a thread
_M = TypeVar("_M", bound=RequestMessage)
Buffer = bytes | bytearray | memoryview


def _checked(msg: _M, payload: Any = None) -> _M:
    """``msg`` as the server will decode it: its field errors raised here."""
    return type(msg).from_wire(msg.to_wire(), payload)


def _bytes_view(buf: Buffer, what: str) -> memoryview:
    """``buf`` as a flat byte view; EINVAL for what has none (not contiguous)."""
    try:
        return memoryview(buf).cast("B")
    except TypeError as exc:
        raise OSError(errno.EINVAL, f"kv {what}: the buffer must be contiguous bytes "
                                    f"({exc})") from None


async def _crc(view: memoryview) -> int:
    if view.nbytes >= THREAD_CRC:
        return int(await trio.to_thread.run_sync(crcfast.crc32c, view))
    return int(crcfast.crc32c(view))


class KvServerClient:
    """Calls to the KV store of the data server at ``host:port``; connection readers run
    in ``nursery`` (see :meth:`connect` for a client with a nursery of its own)."""

    def __init__(self, nursery: trio.Nursery, host: str, port: int,
                 auth: ClientAuth | None = None, *, timeout: float = 60.0,
                 connections: int = 1, sid: str | None = None) -> None:
        self.host, self.port = host, port
        # the server's id: try its local socket first (None: TCP only)
        self.sid = sid
        self.local: bool | None = None  # over the local socket (None: not tried yet)
        self.timeout = timeout
        self._auth = (auth or ClientAuth()).for_data()
        self._nursery = nursery
        n = max(1, connections)
        self._conns: list[RpcClient | None] = [None] * n
        self._locks = [trio.Lock() for _ in range(n)]
        self._rr = itertools.count()

    @classmethod
    @asynccontextmanager
    async def connect(cls, host: str, port: int, auth: ClientAuth | None = None,
                      **kw: Any) -> AsyncIterator[KvServerClient]:
        """A client with a nursery of its own, closed on exit."""
        async with trio.open_nursery() as nursery:
            client = cls(nursery, host, port, auth, **kw)
            try:
                yield client
            finally:
                client.close()
                nursery.cancel_scope.cancel()

    async def _conn(self) -> RpcClient:
        """A live connection (round robin), opened on first use and after a failure."""
        i = next(self._rr) % len(self._conns)
        conn = self._conns[i]
        if conn is not None and conn.alive:
            return conn
        async with self._locks[i]:
            conn = self._conns[i]
            if conn is None or not conn.alive:
                conn = await self._open_local() if self.local is not False else None
                if conn is None:
                    conn = await open_rpc(self._auth, self._nursery, self.host, self.port,
                                          timeout=self.timeout)
                self._conns[i] = conn
            return conn

    async def _open_local(self) -> RpcClient | None:
        """A connection over the server's local socket, or None (not on this host, no
        ``sid``, or refused: TCP from then on)."""
        if self.sid is None:
            self.local = False
            return None
        try:
            conn = await open_unix_connection(local_socket_name(self.sid))
        except OSError:  # no server of this id on this host
            self.local = False
            return None
        try:
            await self._auth.hello(conn)
        except (OSError, ProtocolError, trio.TooSlowError) as exc:
            conn.close()
            self.local = False
            log.info("local data server %s refused us (%s): KV blocks over TCP",
                     self.sid, exc)
            return None
        except BaseException:
            conn.close()
            raise
        self.local = True
        client = RpcClient(conn, self.timeout)
        self._nursery.start_soon(client.run, name=f"kv-local {self.sid}")
        return client

    def close(self) -> None:
        for i, conn in enumerate(self._conns):
            if conn is not None:
                conn.close()
            self._conns[i] = None

    # -- the calls -----------------------------------------------------------------
    async def put(self, ns: str, key: bytes, buf: Buffer, *, pin: bool = False) -> int:
        """Store ``buf`` (1 byte to 64 MiB) under ``key`` in namespace ``ns``; the bytes
        stored. The server evicts other blocks to make room (it never refuses a put for
        a full cache)."""
        view = _bytes_view(buf, "put")
        if not 0 < view.nbytes <= K.MAX_VALUE:
            raise OSError(errno.EMSGSIZE if view.nbytes else errno.EINVAL,
                          f"kv put: a value of {view.nbytes} bytes; values are 1 to "
                          f"{K.MAX_VALUE} bytes")
        msg = _checked(K.KvPut(ns=ns, key=key, crc=await _crc(view), pin=pin))
        conn = await self._conn()
        res = await conn.send(msg, payload=view)
        reply: K.KvPutReply = parse_reply(msg, res.fields)
        return reply.n

    async def get_into(self, ns: str, key: bytes, out: memoryview) -> int | None:
        """The value of ``key`` read into ``out``: its length, or None for a miss (absent,
        evicted, or dropped by the server as corrupt). ``ERANGE`` when it is longer than
        ``out``; ``EIO`` when the bytes received do not match its CRC32C."""
        view = _bytes_view(out, "get")
        if view.readonly:
            raise OSError(errno.EINVAL, "kv get: the output buffer is read-only")
        if not view.nbytes:
            raise OSError(errno.EINVAL, "kv get: an empty output buffer")
        msg = _checked(K.KvGet(ns=ns, key=key, len=min(view.nbytes, K.MAX_VALUE)))
        conn = await self._conn()
        res = await conn.send(msg, into=view)
        reply: K.KvGetReply = parse_reply(msg, res.fields)
        if not reply.found:
            return None
        if res.nbytes != reply.n:
            raise OSError(errno.EPROTO, f"kv get {ns}/{key.hex()}: {res.nbytes} bytes "
                                        f"received for a {reply.n}-byte value")
        # checked by the server as read; on an authenticated connection (MAC, TLS) these
        # are the bytes it checked, so only a plain one is checked again here
        if not conn.conn.authenticated and await _crc(view[:reply.n]) != reply.crc:
            raise OSError(errno.EIO, f"kv get {ns}/{key.hex()} from {self.host}:"
                                     f"{self.port}: the bytes received do not match "
                                     f"their CRC32C")
        return reply.n

    async def exists(self, ns: str, keys: list[bytes]) -> list[bool]:
        """Whether each key is held (one call for up to 4096 keys)."""
        out: list[bool] = []
        for i in range(0, len(keys), K.MAX_KEYS):
            msg = _checked(K.KvExists(ns=ns, keys=list(keys[i:i + K.MAX_KEYS])))
            conn = await self._conn()
            reply: K.KvExistsReply = await conn.request(msg)
            out.extend(reply.present)
        return out

    async def remove(self, ns: str, keys: list[bytes]) -> int:
        """Forget the keys; how many were held."""
        n = 0
        for i in range(0, len(keys), K.MAX_KEYS):
            msg = _checked(K.KvRemove(ns=ns, keys=list(keys[i:i + K.MAX_KEYS])))
            conn = await self._conn()
            reply: K.KvRemoveReply = await conn.request(msg)
            n += reply.n
        return n

    async def stats(self) -> dict[str, int]:
        """The server's KV counters: budget, used, blocks, hits, misses, evictions,
        puts, pinned, corrupt."""
        conn = await self._conn()
        reply: K.KvStatsReply = await conn.request(K.KvStats())
        return {name: getattr(reply, name) for name in K.KvStatsReply._fields}
