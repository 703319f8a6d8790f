"""Typed calls to the metaserver, by inode number (the FUSE layer's view).

One multiplexed connection; when it breaks, the call in flight fails with the error and
the next call reconnects, so a mount whose metaserver went away returns errors and
recovers when it is back.

``direct=True`` (the synchronous client): calls go over a blocking connection instead,
one at a time, from whichever thread makes them; ``call`` then never suspends, so the
synchronous client runs metadata-only coroutines to completion in the caller's thread
(``pfs.client.sync``) with no hop into its trio thread. A call made from the trio
thread blocks that loop for one round trip.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Any

import trio

from pfs import auth
from pfs.auth import ClientAuth
from pfs.client.types import Cred, DirEntry, StatResult
from pfs.wire.blocking import BlockingRpcClient
from pfs.wire.connect import open_blocking, open_rpc
from pfs.wire.rpc import RpcClient

log = logging.getLogger(__name__)

RENAME_NOREPLACE = 1
CLOSE_DELAY = 0.2  # seconds a deferred close waits for a request to carry it
RENAME_EXCHANGE = 2


def fsname(name: str | bytes) -> bytes:
    return os.fsencode(name) if isinstance(name, str) else bytes(name)


class MetaClient:
    def __init__(self, nursery: trio.Nursery, host: str, port: int, *,
                 timeout: float = 60.0, cred: Cred | None = None,
                 auth: ClientAuth | None = None, direct: bool = False) -> None:
        self._nursery = nursery
        self._auth = auth or ClientAuth()
        self.host, self.port = host, port
        self.timeout = timeout
        self.cred = cred or Cred.current()
        self._rpc: RpcClient | None = None
        self._connect_lock = trio.Lock()
        self.direct = direct
        self._blocking: BlockingRpcClient | None = None
        self._blocking_lock = threading.Lock()
        self._disconnected = False
        # direct mode: the blocking connection's number (handle ids are per connection),
        # and the handles closed with nothing to commit, released by the next request
        self.generation = 0
        self._closes: list[int] = []
        self._closes_gen = 0
        self._closes_lock = threading.Lock()
        self._flush_due = False
        try:
            self._token: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
        except RuntimeError:  # made outside trio: deferred closes wait for a request
            self._token = None

    async def _client(self) -> RpcClient:
        rpc = self._rpc
        if rpc is not None and rpc.alive:
            return rpc
        async with self._connect_lock:
            if self._rpc is None or not self._rpc.alive:
                try:
                    self._rpc = await open_rpc(self._auth, self._nursery, self.host,
                                               self.port, timeout=self.timeout)
                except auth.AuthError:
                    raise
                except OSError as exc:
                    raise self._unreachable(exc) from None
                await self._rpc.call("hello", {"client": f"pfs-{os.getpid()}"})
            return self._rpc

    def _unreachable(self, exc: OSError) -> OSError:
        return OSError(errno.ENOTCONN, f"metaserver {self.host}:{self.port} unreachable: "
                                       f"{exc.strerror or exc}")

    def _blocking_client(self) -> BlockingRpcClient:
        with self._blocking_lock:
            if self._disconnected:
                raise OSError(errno.ENOTCONN, "the client was closed")
            rpc = self._blocking
            if rpc is None or not rpc.alive:
                self._blocking = None
                try:
                    rpc = open_blocking(self._auth, self.host, self.port, timeout=self.timeout)
                except auth.AuthError:
                    raise
                except OSError as exc:
                    raise self._unreachable(exc) from None
                try:
                    rpc.call("hello", {"client": f"pfs-{os.getpid()}"})
                except BaseException:
                    rpc.close()
                    raise
                self._blocking = rpc
                self.generation += 1
            return rpc

    def _blocking_call(self, method: str, fields: dict[str, Any]) -> dict[str, Any]:
        rpc = self._blocking_client()
        with self._closes_lock:
            closes, self._closes = self._closes, []
            if self._closes_gen != self.generation:
                closes = []  # opened on a connection that is gone: released with it
        if closes:
            fields = {**fields, "closes": closes}
        return rpc.call(method, fields)

    async def call(self, method: str, **fields: Any) -> dict[str, Any]:
        if self.direct:
            return self._blocking_call(method, fields)
        rpc = await self._client()
        return (await rpc.call(method, fields)).fields

    def defer_close(self, fh: int, generation: int) -> bool:
        """Direct mode: release handle ``fh`` (opened on connection ``generation``, with
        nothing to commit) along with the next request, or a ``release`` of its own
        after CLOSE_DELAY, instead of a round trip now (docs/rpc.md, ``closes``). False:
        not deferred (not direct mode), close it now."""
        if not self.direct:
            return False
        with self._closes_lock:
            if generation != self.generation or self._blocking is None:
                return True  # its connection is gone, and the handle with it
            if self._closes_gen != generation:
                self._closes, self._closes_gen = [], generation
            self._closes.append(fh)
            flush = not self._flush_due and self._token is not None
            self._flush_due = self._flush_due or flush
        if flush:
            assert self._token is not None
            try:
                self._token.run_sync_soon(self._nursery.start_soon, self._flush_closes)
            except trio.RunFinishedError:
                pass  # the client is gone; so are its handles
        return True

    async def _flush_closes(self) -> None:
        """Release deferred closes that no request carried within CLOSE_DELAY."""
        await trio.sleep(CLOSE_DELAY)
        with self._closes_lock:
            self._flush_due = False
            due = bool(self._closes)
        if due:
            try:
                self._blocking_call("release", {})
            except OSError as exc:  # the connection broke: the server released them
                log.debug("releasing closed handles: %s", exc)

    async def _entry_call(self, method: str, parent: int, want_parent: bool,
                          **fields: Any) -> tuple[dict[str, Any], StatResult | None]:
        """An entry change in directory ``parent``: the reply, and with ``want_parent``
        the directory's attributes after the change (docs/rpc.md), else None."""
        if not want_parent:
            return await self.call(method, parent=parent, **fields), None
        r = await self.call(method, parent=parent, want_parent=True, **fields)
        pa = r.get("parent_attr")
        return r, StatResult.from_wire(pa) if pa is not None else None

    def _cred(self, cred: Cred | None) -> list[Any]:
        return (cred or self.cred).to_wire()

    def disconnect(self) -> None:
        if self._rpc is not None:
            self._rpc.close()
            self._rpc = None
        with self._blocking_lock:
            if self._blocking is not None:
                self._blocking.close()
                self._blocking = None
        with self._closes_lock:
            self._closes = []  # the metaserver releases them with the connection

    def shutdown(self) -> None:
        """Disconnect for good: a late caller (a deferred ``release`` running after the
        client closed) must not open a connection nothing would close."""
        with self._blocking_lock:
            self._disconnected = True
        self.disconnect()

    # -- namespace -----------------------------------------------------------
    async def resolve(self, path: str | bytes, follow: bool = True,
                      cred: Cred | None = None) -> tuple[StatResult, int, bytes]:
        r = await self.call("resolve", path=fsname(path), follow=follow, cred=self._cred(cred))
        return StatResult.from_wire(r["attr"]), r["parent"], r["name"]

    async def lookup(self, parent: int, name: str | bytes, cred: Cred | None = None) -> StatResult:
        r = await self.call("lookup", parent=parent, name=fsname(name), cred=self._cred(cred))
        return StatResult.from_wire(r["attr"])

    async def getattr(self, ino: int) -> StatResult:
        return StatResult.from_wire((await self.call("getattr", ino=ino))["attr"])

    async def setattr(self, ino: int, cred: Cred | None = None, **changes: Any) -> StatResult:
        fields = {k: v for k, v in changes.items() if v is not None}
        r = await self.call("setattr", ino=ino, cred=self._cred(cred), **fields)
        return StatResult.from_wire(r["attr"])

    async def access(self, ino: int, mask: int, cred: Cred | None = None) -> None:
        await self.call("access", ino=ino, mask=mask, cred=self._cred(cred))

    # The six entry changes take ``want_parent``: the parent's attributes after the
    # change come back as the last value (None without it).
    async def mkdir(self, parent: int, name: str | bytes, mode: int, cred: Cred | None = None,
                    want_parent: bool = False) -> tuple[StatResult, StatResult | None]:
        r, pa = await self._entry_call("mkdir", parent, want_parent, name=fsname(name),
                                       mode=mode, cred=self._cred(cred))
        return StatResult.from_wire(r["attr"]), pa

    async def mknod(self, parent: int, name: str | bytes, mode: int, rdev: int = 0,
                    cred: Cred | None = None, want_parent: bool = False
                    ) -> tuple[StatResult, StatResult | None]:
        r, pa = await self._entry_call("mknod", parent, want_parent, name=fsname(name),
                                       mode=mode, rdev=rdev, cred=self._cred(cred))
        return StatResult.from_wire(r["attr"]), pa

    async def create(self, parent: int, name: str | bytes, mode: int, flags: int,
                     cred: Cred | None = None, want_parent: bool = False
                     ) -> tuple[dict[str, Any], StatResult | None]:
        return await self._entry_call("create", parent, want_parent, name=fsname(name),
                                      mode=mode, flags=flags, cred=self._cred(cred))

    async def open(self, ino: int, flags: int, cred: Cred | None = None) -> dict[str, Any]:
        return await self.call("open", ino=ino, flags=flags, cred=self._cred(cred))

    async def close(self, fh: int, written_end: int | None = None,
                    mtime: int | None = None) -> None:
        await self.call("close", fh=fh, written_end=written_end, mtime=mtime)

    async def renew(self, fh: int) -> dict[str, Any]:
        """A fresh capability for open handle ``fh``: ``{"cap", "cap_ttl"}``."""
        return await self.call("renew", fh=fh)

    async def commit_size(self, fh: int, written_end: int | None,
                          mtime: int | None = None) -> StatResult:
        r = await self.call("commit_size", fh=fh, written_end=written_end, mtime=mtime)
        return StatResult.from_wire(r["attr"])

    async def unlink(self, parent: int, name: str | bytes, cred: Cred | None = None,
                     want_parent: bool = False) -> StatResult | None:
        _, pa = await self._entry_call("unlink", parent, want_parent, name=fsname(name),
                                       cred=self._cred(cred))
        return pa

    async def rmdir(self, parent: int, name: str | bytes, cred: Cred | None = None,
                    want_parent: bool = False) -> StatResult | None:
        _, pa = await self._entry_call("rmdir", parent, want_parent, name=fsname(name),
                                       cred=self._cred(cred))
        return pa

    async def rename(self, parent: int, name: str | bytes, newparent: int,
                     newname: str | bytes, flags: int = 0, cred: Cred | None = None) -> None:
        await self.call("rename", parent=parent, name=fsname(name), newparent=newparent,
                        newname=fsname(newname), flags=flags, cred=self._cred(cred))

    async def link(self, ino: int, newparent: int, newname: str | bytes,
                   cred: Cred | None = None) -> StatResult:
        r = await self.call("link", ino=ino, newparent=newparent, newname=fsname(newname),
                            cred=self._cred(cred))
        return StatResult.from_wire(r["attr"])

    async def symlink(self, parent: int, name: str | bytes, target: str | bytes,
                      cred: Cred | None = None, want_parent: bool = False
                      ) -> tuple[StatResult, StatResult | None]:
        r, pa = await self._entry_call("symlink", parent, want_parent, name=fsname(name),
                                       target=fsname(target), cred=self._cred(cred))
        return StatResult.from_wire(r["attr"]), pa

    async def readlink(self, ino: int) -> bytes:
        return (await self.call("readlink", ino=ino))["target"]

    async def readdir(self, ino: int, cookie: int = 0, limit: int = 1024, plus: bool = False,
                      cred: Cred | None = None) -> tuple[list[DirEntry], bool]:
        r = await self.call("readdir", ino=ino, cookie=cookie, limit=limit, plus=plus,
                            cred=self._cred(cred))
        out = []
        for name, child, mode, ck, attr in r["entries"]:
            out.append(DirEntry(os.fsdecode(name), "", child, mode, ck,
                                StatResult.from_wire(attr) if attr else None))
        return out, bool(r["eof"])

    async def statfs(self) -> dict[str, int]:
        return await self.call("statfs")

    async def getxattr(self, ino: int, name: str | bytes, cred: Cred | None = None) -> bytes:
        return (await self.call("getxattr", ino=ino, name=fsname(name),
                                cred=self._cred(cred)))["value"]

    async def setxattr(self, ino: int, name: str | bytes, value: bytes, flags: int = 0,
                       cred: Cred | None = None) -> None:
        await self.call("setxattr", ino=ino, name=fsname(name), value=bytes(value), flags=flags,
                        cred=self._cred(cred))

    async def listxattr(self, ino: int, cred: Cred | None = None) -> list[bytes]:
        return (await self.call("listxattr", ino=ino, cred=self._cred(cred)))["names"]

    async def removexattr(self, ino: int, name: str | bytes, cred: Cred | None = None) -> None:
        await self.call("removexattr", ino=ino, name=fsname(name), cred=self._cred(cred))

    async def get_layout(self, ino: int) -> dict[str, Any]:
        return (await self.call("get_layout", ino=ino))["layout"]

    async def set_layout(self, ino: int, unit: int = 0, count: int = 0, replicas: int = 0,
                         cred: Cred | None = None) -> dict[str, Any]:
        return (await self.call("set_layout", ino=ino, unit=unit, count=count,
                                replicas=replicas, cred=self._cred(cred)))["layout"]

    async def servers(self) -> dict[str, dict[str, Any]]:
        return (await self.call("servers"))["servers"]
