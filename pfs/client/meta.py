"""Typed calls to the metaserver, by inode number (the FUSE layer's view).

One multiplexed connection; when it breaks, the call in flight fails with the error and
the next call reconnects, so a mount whose metaserver went away returns errors and
recovers when it is back.

``direct=True`` (the synchronous client): calls go over a blocking connection instead
(``_blocking_call``), one at a time, from whichever thread makes them: the blocking
driver carries the sync client's metadata plans (``pfs.client.ops``) out in the caller's
thread with no hop into its trio thread. A call made from the trio thread blocks that
loop for one round trip.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Any

import trio

from pfs.client.types import Cred, DirEntry, StatResult
from pfs.core import auth
from pfs.core.auth import ClientAuth
from pfs.core.messages import meta as M
from pfs.core.messages.base import RequestMessage
from pfs.core.messages.records import At, WireCred
from pfs.core.wire.blocking import BlockingRpcClient
from pfs.core.wire.connect import open_blocking, open_rpc
from pfs.core.wire.rpc import RpcClient, parse_reply

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
        self._wire_cred: tuple[Cred | None, WireCred] = (None, (0, 0, ()))
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
                await self._rpc.request(M.Hello(client=f"pfs-{os.getpid()}"))
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
                    hello = M.Hello(client=f"pfs-{os.getpid()}")
                    parse_reply(hello, rpc.call(hello.method, hello.to_wire()))
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
        """An untyped call (fields as keywords, the reply's map back); prefer
        :meth:`request` with a message of :mod:`pfs.core.messages.meta`."""
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
                self._blocking_call("release", M.Release().to_wire())
            except OSError as exc:  # the connection broke: the server released them
                log.debug("releasing closed handles: %s", exc)

    async def request(self, msg: RequestMessage) -> Any:
        """A typed call: ``msg`` (a request of :mod:`pfs.core.messages.meta`) out, its typed
        reply back (``EPROTO`` if the reply does not fit it)."""
        fields = msg.to_wire()
        if self.direct:
            return parse_reply(msg, self._blocking_call(msg.method, fields))
        rpc = await self._client()
        return parse_reply(msg, (await rpc.call(msg.method, fields)).fields)

    async def _entry(self, msg: M.EntryChange) -> tuple[Any, StatResult | None]:
        """An entry change: the typed reply, and the directory's attributes after the
        change when ``msg`` asked for them (``want_parent``, docs/rpc.md), else None."""
        r = await self.request(msg)
        pa = r.parent_attr
        return r, StatResult.from_wire(pa) if pa is not None else None

    def wire_cred(self, cred: Cred | None = None) -> WireCred:
        """A message's ``cred``: ``cred``, or the client's own (the last one's is kept:
        callers pass the same credentials over and over)."""
        c = cred or self.cred
        last = self._wire_cred
        if last[0] is c:
            return last[1]
        wire = (c.uid, c.gid, tuple(c.groups))
        self._wire_cred = (c, wire)
        return wire

    _cred = wire_cred

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
        r = await self.request(M.Resolve(path=fsname(path), follow=follow,
                                         cred=self._cred(cred)))
        return StatResult.from_wire(r.attr), r.parent, r.name

    async def lookup(self, parent: int, name: str | bytes, cred: Cred | None = None) -> StatResult:
        r = await self.request(M.Lookup(parent=parent, name=fsname(name), cred=self._cred(cred)))
        return StatResult.from_wire(r.attr)

    async def getattr(self, ino: int) -> StatResult:
        return StatResult.from_wire((await self.request(M.Getattr(ino=ino))).attr)

    async def setattr(self, ino: int, cred: Cred | None = None, **changes: Any) -> StatResult:
        r = await self.request(M.Setattr(ino=ino, cred=self._cred(cred), **changes))
        return StatResult.from_wire(r.attr)

    async def access(self, ino: int, mask: int, cred: Cred | None = None) -> None:
        await self.request(M.Access(ino=ino, mask=mask, cred=self._cred(cred)))

    # The six entry changes take ``want_parent``: the parent's attributes after the
    # change come back as the last value (None without it).
    async def mkdir(self, parent: int, name: str | bytes, mode: int, cred: Cred | None = None,
                    want_parent: bool = False) -> tuple[StatResult, StatResult | None]:
        r, pa = await self._entry(M.Mkdir(at=At.of(parent, fsname(name)), mode=mode,
                                          cred=self._cred(cred), want_parent=want_parent))
        return StatResult.from_wire(r.attr), pa

    async def mknod(self, parent: int, name: str | bytes, mode: int, rdev: int = 0,
                    cred: Cred | None = None, want_parent: bool = False
                    ) -> tuple[StatResult, StatResult | None]:
        r, pa = await self._entry(M.Mknod(at=At.of(parent, fsname(name)), mode=mode, rdev=rdev,
                                          cred=self._cred(cred), want_parent=want_parent))
        return StatResult.from_wire(r.attr), pa

    async def create(self, parent: int, name: str | bytes, mode: int, flags: int,
                     cred: Cred | None = None, want_parent: bool = False
                     ) -> tuple[dict[str, Any], StatResult | None]:
        r, pa = await self._entry(M.Create(at=At.of(parent, fsname(name)), mode=mode,
                                           flags=flags, cred=self._cred(cred),
                                           want_parent=want_parent))
        return r.to_wire(), pa

    async def open(self, ino: int, flags: int, cred: Cred | None = None) -> dict[str, Any]:
        r = await self.request(M.Open(ino=ino, flags=flags, cred=self._cred(cred)))
        return r.to_wire()

    async def close(self, fh: int, written_end: int | None = None,
                    mtime: int | None = None) -> None:
        await self.request(M.Close(fh=fh, written_end=written_end, mtime=mtime))

    async def renew(self, fh: int) -> dict[str, Any]:
        """A fresh capability for open handle ``fh``: ``{"cap", "cap_ttl"}``."""
        return (await self.request(M.Renew(fh=fh))).to_wire()

    async def commit_size(self, fh: int, written_end: int | None,
                          mtime: int | None = None) -> StatResult:
        r = await self.request(M.CommitSize(fh=fh, written_end=written_end, mtime=mtime))
        return StatResult.from_wire(r.attr)

    async def unlink(self, parent: int, name: str | bytes, cred: Cred | None = None,
                     want_parent: bool = False) -> StatResult | None:
        _, pa = await self._entry(M.Unlink(at=At.of(parent, fsname(name)),
                                           cred=self._cred(cred), want_parent=want_parent))
        return pa

    async def rmdir(self, parent: int, name: str | bytes, cred: Cred | None = None,
                    want_parent: bool = False) -> StatResult | None:
        _, pa = await self._entry(M.Rmdir(at=At.of(parent, fsname(name)),
                                          cred=self._cred(cred), want_parent=want_parent))
        return pa

    async def rename(self, parent: int, name: str | bytes, newparent: int,
                     newname: str | bytes, flags: int = 0, cred: Cred | None = None) -> None:
        await self.request(M.Rename(at=At.of(parent, fsname(name)),
                                    new=At.of(newparent, fsname(newname)), flags=flags,
                                    cred=self._cred(cred)))

    async def link(self, ino: int, newparent: int, newname: str | bytes,
                   cred: Cred | None = None) -> StatResult:
        r = await self.request(M.Link(ino=ino, new=At.of(newparent, fsname(newname)),
                                      cred=self._cred(cred)))
        return StatResult.from_wire(r.attr)

    async def symlink(self, parent: int, name: str | bytes, target: str | bytes,
                      cred: Cred | None = None, want_parent: bool = False
                      ) -> tuple[StatResult, StatResult | None]:
        r, pa = await self._entry(M.Symlink(at=At.of(parent, fsname(name)),
                                            target=fsname(target), cred=self._cred(cred),
                                            want_parent=want_parent))
        return StatResult.from_wire(r.attr), pa

    async def readlink(self, ino: int) -> bytes:
        r: M.TargetReply = await self.request(M.Readlink(ino=ino))
        return r.target

    async def readdir(self, ino: int, cookie: int = 0, limit: int = 1024, plus: bool = False,
                      cred: Cred | None = None) -> tuple[list[DirEntry], bool]:
        r = await self.request(M.Readdir(ino=ino, cookie=cookie, limit=limit, plus=plus,
                                         cred=self._cred(cred)))
        out = []
        for name, child, mode, ck, attr in r.entries:
            out.append(DirEntry(os.fsdecode(name), "", child, mode, ck,
                                StatResult.from_wire(attr) if attr else None))
        return out, bool(r.eof)

    async def statfs(self) -> dict[str, int]:
        return (await self.request(M.Statfs())).to_wire()

    async def getxattr(self, ino: int, name: str | bytes, cred: Cred | None = None) -> bytes:
        r: M.ValueReply = await self.request(M.Getxattr(ino=ino, name=fsname(name),
                                                        cred=self._cred(cred)))
        return r.value

    async def setxattr(self, ino: int, name: str | bytes, value: bytes, flags: int = 0,
                       cred: Cred | None = None) -> None:
        await self.request(M.Setxattr(ino=ino, name=fsname(name), value=bytes(value),
                                      flags=flags, cred=self._cred(cred)))

    async def listxattr(self, ino: int, cred: Cred | None = None) -> list[bytes]:
        r: M.NamesReply = await self.request(M.Listxattr(ino=ino, cred=self._cred(cred)))
        return r.names

    async def removexattr(self, ino: int, name: str | bytes, cred: Cred | None = None) -> None:
        await self.request(M.Removexattr(ino=ino, name=fsname(name), cred=self._cred(cred)))

    async def get_layout(self, ino: int) -> dict[str, Any]:
        r: M.LayoutReply = await self.request(M.GetLayout(ino=ino))
        return r.layout  # type: ignore[return-value]  # nil for symlinks and devices

    async def set_layout(self, ino: int, unit: int = 0, count: int = 0, replicas: int = 0,
                         cred: Cred | None = None) -> dict[str, Any]:
        r: M.LayoutReply = await self.request(M.SetLayout(ino=ino, unit=unit, count=count,
                                                          replicas=replicas,
                                                          cred=self._cred(cred)))
        return r.layout  # type: ignore[return-value]

    async def servers(self) -> dict[str, dict[str, Any]]:
        r: M.ServersReply = await self.request(M.Servers())
        return r.servers
