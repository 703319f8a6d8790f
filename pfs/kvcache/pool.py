"""The pool of KV servers as this client knows it: which data servers hold KV blocks,
their addresses, a client per server, and which of them failed lately.

The list comes from the metaserver (its ``servers`` call) once at start, then on a timer
(``refresh`` seconds) and soon after a server fails to answer - never on a get or a put:
the hot path only ranks servers it already knows (:mod:`pfs.kvcache.homes`). A server
that failed is skipped for ``DOWN_FOR`` seconds, so its keys go to their next-ranked home
until the metaserver's own view (a server ``down``) catches up.
"""
from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from pfs.kvcache.homes import Homes

log = logging.getLogger(__name__)

DOWN_FOR = 5.0  # seconds a server that failed is left out of the homes
MIN_REFRESH_GAP = 1.0  # seconds between two refreshes asked for by failures
# errnos that mean "this server did not answer", not "this request was wrong"
UNREACHABLE = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED,
                         errno.ETIMEDOUT, errno.EPIPE, errno.ENOTCONN, errno.EHOSTUNREACH,
                         errno.ENETUNREACH, errno.ESHUTDOWN, errno.EAGAIN})
# ... and the servers to pass over: one that does not answer, or keeps no KV store
SKIP = UNREACHABLE | {errno.EOPNOTSUPP}


class BlockStore(Protocol):
    """One server's KV store, as :class:`pfs.kvcache.remote.KvServerClient` speaks it."""

    async def put(self, ns: str, key: bytes, buf: Any, *, pin: bool = False) -> Any: ...

    async def get_into(self, ns: str, key: bytes, out: memoryview) -> int | None: ...

    async def exists(self, ns: str, keys: list[bytes]) -> list[bool]: ...

    async def remove(self, ns: str, keys: list[bytes]) -> int: ...

    async def stats(self) -> dict[str, Any]: ...


Lookup = Callable[[], Awaitable[dict[str, dict[str, Any]]]]
Connect = Callable[[str, str, int], BlockStore]


def in_pool(s: dict[str, Any]) -> bool:
    """A server record (the metaserver's ``servers``) that holds KV blocks: up (or only
    suspected, so a hiccup moves no keys), not draining, and with a KV budget (its
    ``kv`` record: servers without a KV store report none)."""
    state = s.get("state") or ("up" if s.get("alive", True) else "down")
    if state in ("down", "draining"):
        return False
    kv = s.get("kv")
    return isinstance(kv, dict) and int(kv.get("budget", 0)) > 0


class Pool:
    def __init__(self, lookup: Lookup, connect: Connect,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup
        self._connect = connect
        self._clock = clock
        self.addrs: dict[str, tuple[str, int]] = {}
        self.homes = Homes(())
        self._stores: dict[str, tuple[tuple[str, int], BlockStore]] = {}
        self._down: dict[str, float] = {}  # sid -> when it may be tried again
        self._last_refresh = -MIN_REFRESH_GAP
        self._refreshing = trio.Lock()
        # the blocking twin ranks and marks servers from its callers' threads too
        self._lock = threading.Lock()
        self.refreshes = 0

    async def refresh(self) -> None:
        """Ask the metaserver for the pool now (concurrent callers wait for one ask)."""
        asked = self._last_refresh
        async with self._refreshing:
            if self._last_refresh != asked:
                return  # refreshed while this caller waited
            servers = await self._lookup()
            self._last_refresh = self._clock()
            self.refreshes += 1
            addrs = {sid: (str(s["host"]), int(s["port"])) for sid, s in servers.items()
                     if in_pool(s)}
            with self._lock:
                for sid, addr in addrs.items():
                    if sid in self._down and self.addrs.get(sid) != addr:
                        del self._down[sid]  # restarted elsewhere: try it again at once
            self.addrs = addrs
            for sid in list(self._stores):
                if self._stores[sid][0] != self.addrs.get(sid):
                    self._drop_store(sid)  # gone, or moved (restarted on another port)
            self._rebuild()

    async def refresh_soon(self) -> None:
        """A refresh after a failure, at most one per MIN_REFRESH_GAP."""
        if self._clock() - self._last_refresh >= MIN_REFRESH_GAP:
            try:
                await self.refresh()
            except OSError as exc:
                log.warning("KV pool: the metaserver did not answer: %s", exc)

    def _rebuild(self) -> None:
        with self._lock:
            now = self._clock()
            self._down = {s: t for s, t in self._down.items() if t > now and s in self.addrs}
            self.homes = Homes(s for s in self.addrs if s not in self._down)

    def _drop_store(self, sid: str) -> None:
        _addr, store = self._stores.pop(sid)
        close = getattr(store, "close", None)
        if close is not None:
            close()

    def mark_down(self, sid: str, exc: OSError) -> None:
        log.warning("KV server %s did not answer (%s): its keys go to their next home for "
                    "%.0f s", sid, exc, DOWN_FOR)
        with self._lock:
            self._down[sid] = self._clock() + DOWN_FOR
        if sid in self._stores:
            self._drop_store(sid)
        self._rebuild()

    def expire_down(self) -> None:
        """Let servers whose time out is over back into the homes."""
        if not self._down:  # (every get asks: no lock while no server is down)
            return
        with self._lock:
            due = bool(self._down) and min(self._down.values()) <= self._clock()
        if due:
            self._rebuild()

    def store(self, sid: str) -> BlockStore:
        got = self._stores.get(sid)
        if got is None:
            addr = self.addrs[sid]
            got = self._stores[sid] = (addr, self._connect(sid, *addr))
        return got[1]

    def close(self) -> None:
        for sid in list(self._stores):
            self._drop_store(sid)
