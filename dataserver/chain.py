"""A data server's part in chain replication: version checks, forwarding, catch-up.

A client sends a stripe's write to its chain's head only. Each member applies the write
under the blocks' exclusive lock, records ``(chain, version, sequence)`` on its replica
(dataserver/objects.py), forwards it to the next member and answers once that one did,
so the head's answer means the tail has it; the lock is held until then, so overlapping
writes reach every member in the one order the head applied them (replicas stay
byte-identical). A member the next one refuses (connection refused or broken) or keeps
waiting past ``forward_timeout`` reports it to the metaserver (``chain_drop``), which
takes it out of the chain (a new version); the write then goes on to the member after
it, and is acknowledged by the rest. The member taken out is *stale*: the metaserver
tells it at its next registration, and it serves nothing of that chain until it has
been caught up (:func:`copy_object`, the machinery repair uses too) and put back.

Versions: a request names the chain version its sender knows. A server refuses one
older than what it has seen of that chain (from requests, replies of the metaserver or
its replicas' records), and anything of a chain it was taken out of, with
``CHAIN_STALE`` (``EREMCHG``): the client fetches the layout again and retries.
"""
from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import crc32c
import trio

from pfs.core.auth import ClientAuth
from pfs.core.config import parse_addr
from pfs.core.messages import data as D
from pfs.core.messages import meta as M
from pfs.core.messages.base import parse_reply
from pfs.core.wire.connect import open_rpc
from pfs.core.wire.pool import ConnectionPool
from pfs.core.wire.protocol import Limits
from pfs.core.wire.rpc import RpcClient
from pfs.dataserver import checksums as ck
from pfs.dataserver.cuts import Marks
from pfs.dataserver.objects import ObjectStore

log = logging.getLogger(__name__)

CHAIN_STALE = D.CHAIN_STALE
# the next member is gone (or hung): take it out of the chain
DEAD_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ENOTCONN,
                         errno.ETIMEDOUT, errno.EPIPE, errno.EHOSTUNREACH,
                         errno.ECONNABORTED, errno.EHOSTDOWN})
META_TIMEOUT = 10.0
COPY_CHUNK = 4 << 20  # bytes per request of a copy
# a restore moves every chain's version 2**20 ahead (metaserver/backup.py VERSION_GAP);
# membership changes move it by one
RESTORE_JUMP = 1 << 19
MAX_OBJ = (1 << 63) - 1  # the whole object, for its lock

Apply = Callable[[tuple[int, int], int, Any], Awaitable[int]]


def stale(what: str) -> OSError:
    return OSError(CHAIN_STALE, f"chain version stale: {what}; refresh the layout")


class Peers:
    """Connections to the metaserver and to other data servers (looked up by sid through
    the metaserver's ``servers``), opened on first use, their readers in ``run``'s
    nursery."""

    def __init__(self, auth: ClientAuth, meta: str, limits: Limits | None = None) -> None:
        self.auth = auth
        self.meta = meta
        self.limits = limits
        self._pool = ConnectionPool("the data server's peer connections")  # "": metaserver
        self.run = self._pool.run
        self._addrs: dict[str, tuple[str, int]] = {}

    async def _client(self, key: str) -> RpcClient:
        async def open_(nursery: trio.Nursery) -> RpcClient:
            if key:
                host, port = await self._address(key)
            else:
                if not self.meta:
                    raise OSError(errno.ENOTCONN, "no metaserver configured")
                host, port = parse_addr(self.meta)
            return await open_rpc(self.auth, nursery, host, port, limits=self.limits,
                                  timeout=META_TIMEOUT)

        return await self._pool.get(key, open_)

    async def _address(self, sid: str) -> tuple[str, int]:
        addr = self._addrs.get(sid)
        if addr is None:
            meta = await self._client("")
            reply = await meta.request(M.Servers(), timeout=META_TIMEOUT)
            for s, rec in reply.servers.items():
                self._addrs[s] = (rec["host"], int(rec["port"]))
            addr = self._addrs.get(sid)
        if addr is None:
            raise OSError(errno.EHOSTDOWN, f"data server {sid} is not known to the metaserver")
        return addr

    def forget(self, sid: str) -> None:
        """A call to ``sid`` failed: connect anew next time, looking it up again."""
        self._pool.forget(sid)
        self._addrs.pop(sid, None)

    async def meta_request(self, msg: Any) -> Any:
        try:
            return await (await self._client("")).request(msg, timeout=META_TIMEOUT)
        except OSError:
            self.forget("")
            raise

    async def request(self, sid: str, msg: Any, payload: Any = None,
                      timeout: float | None = None) -> Any:
        try:
            client = await self._client(sid)
            return await client.request(msg, payload=payload, timeout=timeout)
        except OSError as exc:
            if exc.errno in DEAD_ERRNOS:
                self.forget(sid)
            raise

    async def fetch(self, sid: str, msg: Any, timeout: float | None = None
                    ) -> tuple[Any, bytes]:
        """As :meth:`request`, with the reply's payload: (reply, bytes)."""
        try:
            result = await (await self._client(sid)).send(msg, timeout=timeout)
        except OSError as exc:
            if exc.errno in DEAD_ERRNOS:
                self.forget(sid)
            raise
        return parse_reply(msg, result.fields), bytes(result.payload or b"")


class Replicator:
    """This server's view of chains, and its writes down them."""

    def __init__(self, store: ObjectStore, locks: ck.RangeLocks, peers: Peers,
                 forward_timeout: float = 5.0) -> None:
        self.store = store
        self.locks = locks
        self.peers = peers
        self.forward_timeout = forward_timeout
        self.sid: str | None = None
        self.view: dict[int, int] = {}  # chain id -> newest version seen
        self.out: set[int] = set()  # chains this server was taken out of (stale here)
        # False until the metaserver said which chains this server is stale in (at its
        # registration): before that, a replica taken out while this server was down
        # could be served; chained objects are refused meanwhile
        self.ready = not peers.meta

    # -- what the metaserver says -------------------------------------------------
    def taken_out(self, chains: list[int]) -> None:
        """What the metaserver says at registration and each heartbeat: the chains this
        server missed writes of (it serves none of their objects until caught up)."""
        new = set(chains)
        self.ready = True
        if new - self.out:
            log.warning("stale in chains %s: their objects are not served here until "
                        "caught up", sorted(new - self.out))
        if self.out - new:
            log.info("caught up in chains %s", sorted(self.out - new))
        self.out = new

    def _saw(self, cid: int, ver: int) -> None:
        if ver > self.view.get(cid, 0):
            self.view[cid] = ver

    # -- checks ------------------------------------------------------------------
    def check_read(self, obj: tuple[int, int], cid: int | None, ver: int | None) -> None:
        """CHAIN_STALE when this replica must not serve ``obj``: its chain is one this
        server was taken out of, or the reader's version is older than one seen."""
        rec = self.store.chain_record(obj) if self.out or not self.ready else None
        if rec is not None and (rec[0] in self.out or not self.ready):
            raise stale(f"this server was taken out of chain {rec[0]}" if self.ready else
                        "this server has not registered with the metaserver since it "
                        "started (it may have missed writes)")
        if cid:
            if not self.ready:
                raise stale("this server has not registered with the metaserver since it "
                            "started (it may have missed writes)")
            if cid in self.out:
                raise stale(f"this server was taken out of chain {cid}")
            if ver is not None and ver < self.view.get(cid, 0):
                raise stale(f"chain {cid} is at version {self.view[cid]}, not {ver}")

    # -- writes ------------------------------------------------------------------
    async def write(self, req: D.Write, apply: Apply) -> tuple[int, int | None]:
        """Apply ``req`` here and pass it down the chain; the bytes written here, and
        the chain's version when it changed meanwhile (else None)."""
        obj, off, data = req.obj, req.off, req.payload
        cid, ver = req.chain or 0, req.ver or 0
        if cid:
            # (a write forwarded by a member is taken: this server is joining again,
            # and the catch-up copy comes after it in the head's order)
            if cid in self.out and not req.seq:
                raise stale(f"this server was taken out of chain {cid}")
            if ver > self.view.get(cid, 0) and not req.seq:
                await self.learn(cid)  # a client's word is not taken: the metaserver's
                if ver > self.view.get(cid, 0):
                    raise stale(f"chain {cid} is at version {self.view.get(cid, 0)}, "
                                f"not {ver}")
            if ver < self.view.get(cid, 0):
                raise stale(f"chain {cid} is at version {self.view[cid]}, not {ver}")
        bl = ck.blocks(off, len(data))
        async with self.locks.hold(obj, bl.start, bl.stop - 1, exclusive=True):
            if cid and ver < self.view.get(cid, 0):  # changed while this write waited
                raise stale(f"chain {cid} is at version {self.view[cid]}, not {ver}")
            rec = self.store.chain_record(obj) if cid else None
            held = rec if rec is not None and rec[0] == cid else None
            if held is not None and held[1] > ver:
                raise stale(f"object {list(obj)} holds chain {cid} version {held[1]}")
            seq = req.seq or ((held[2] if held else 0) + 1)
            n = await apply(obj, off, data)
            fwd = list(req.fwd or ())
            while fwd:
                nxt = D.Write(obj=obj, off=off, cap=req.cap, chain=cid or None,
                              ver=ver if cid else None, fwd=fwd[1:] or None, seq=seq)
                # each member waits one deadline per member after it: the one next to
                # a hung member gives up (and reports it) before those above it do
                wait = self.forward_timeout * len(fwd)
                try:
                    with trio.fail_after(wait):
                        await self.peers.request(fwd[0], nxt, payload=data)
                    break
                except trio.TooSlowError:
                    err = OSError(errno.ETIMEDOUT, f"data server {fwd[0]} did not take a "
                                                   f"forwarded write within {wait} s")
                    self.peers.forget(fwd[0])
                except OSError as exc:
                    if exc.errno not in DEAD_ERRNOS:
                        raise
                    err = exc
                if not cid:  # a layout from before chains: nobody to tell, fail it
                    raise err
                ver, fwd = await self.drop(cid, ver, fwd[0], err)
            if cid:
                self._saw(cid, ver)
                self.store.set_chain_record(
                    obj, (cid, ver, max(seq, held[2] if held else 0)))
        return n, (ver if cid and ver != (req.ver or 0) else None)

    async def learn(self, cid: int) -> None:
        """The chain's version now, from the metaserver (a client named one newer than
        this server had seen: after a membership change, or after a restart), and its
        restore windows (dataserver/cuts.py)."""
        reply = await self.peers.meta_request(M.GetChain(chain=cid))
        if reply.restores is not None:
            self.store.cuts.set_windows((w[0], w[1]) for w in reply.restores if len(w) == 2)
        _cid, ver, members = reply.chain
        if self.sid not in members:
            raise stale(f"this server is not in chain {cid}")
        self._saw(cid, int(ver))

    def restore_jumped(self, cid: int | None, ver: int | None) -> bool:
        """Whether a request names a chain version a restore's jump ahead of what this
        server saw: the metadata was restored and the metaserver started again, maybe
        before this server noticed (it learns at most a heartbeat later otherwise). The
        caller learns the chain (and the restore windows with it) before answering, or a
        range cut after the backup would be served as a hole meanwhile. Once per chain
        after a restore; otherwise a dict lookup on the data path."""
        return bool(cid) and ver is not None and ver >= self.view.get(cid or 0, 0) + RESTORE_JUMP

    async def drop(self, cid: int, ver: int, sid: str, why: OSError) -> tuple[int, list[str]]:
        """Have the metaserver take ``sid`` out of chain ``cid``; the new version and the
        members after this server."""
        log.warning("chain %d: forwarding to %s failed (%s): taking it out", cid, sid, why)
        reply = await self.peers.meta_request(M.ChainDrop(chain=cid, sid=sid))
        _cid, new_ver, members = reply.chain
        if self.sid not in members:
            raise stale(f"this server is no longer in chain {cid}")
        self._saw(cid, new_ver)
        return int(new_ver), list(members[members.index(self.sid) + 1:])


    # -- catch-up ----------------------------------------------------------------
    async def catch_up(self, cid: int, ver: int, target: str, rate: int = 0
                       ) -> tuple[int, int]:
        """Copy every object of chain ``cid`` held here to ``target``, which joined the
        chain at version ``ver``: from now on writes naming an older version are refused
        (their clients fetch the chain with ``target`` in it, so their writes reach it),
        and each object is copied under its whole-object lock, after the writes before
        it. ``rate``: bytes per second at most (0: as fast as it goes; repair's bound,
        so the copy leaves the disks to clients). The objects and bytes copied."""
        self._saw(cid, ver)
        copied = 0
        sent = 0
        start = trio.current_time()

        async def pace(n: int) -> None:  # never ahead of rate bytes per second
            nonlocal sent
            sent += n
            if rate > 0:
                await trio.sleep_until(start + sent / rate)

        after: tuple[int, int] | None = None
        while True:
            page, end = await trio.to_thread.run_sync(self.store.list_objects, after, 1024)
            for ino, stripe, *_ in page:  # (size, allocated, block map summary...)
                obj = (ino, stripe)
                after = obj
                rec = self.store.chain_record(obj)
                if rec is not None and rec[0] == cid:
                    await self.copy_to(obj, target, pace)
                    copied += 1
            if end or not page:
                break
        await self.send_tombstones(cid, target)
        return copied, sent

    async def send_tombstones(self, cid: int, target: str) -> int:
        """Every tombstone held here to ``target`` (``install_tombs``): without them a
        member that joined after a deletion reads the deleted file, named again by a
        metadata restore, as holes. All of them, not only chain ``cid``'s: a record
        names no chain (its object, which did, is gone); a tombstone of a dead inode
        is harmless anywhere. The ones new there."""
        objs = self.store.tombs.objects()  # a copy: deletions meanwhile go to it too
        new = 0
        for i in range(0, len(objs), D.MAX_DELETE):
            reply = await self.peers.request(
                target, D.InstallTombs(chain=cid, objs=objs[i:i + D.MAX_DELETE]),
                timeout=META_TIMEOUT)
            new += reply.n
        if new:
            log.info("chain %d: %d tombstones copied to %s", cid, new, target)
        return new

    async def copy_to(self, obj: tuple[int, int], target: str,
                      pace: Callable[[int], Awaitable[None]] | None = None) -> int:
        """Copy this replica of ``obj`` whole to data server ``target`` (``install``),
        with its chain record; the bytes copied. What catch-up and repair call. Each
        piece is verified against this replica's block checksums before it is sent (a
        bad block fails the copy with EIO: the scrubber's to fix, not to spread) and
        carries its CRC32C, which the target checks. ``pace(n)``: called after each
        piece (the copy's rate bound)."""
        async with self.locks.hold(obj, 0, MAX_OBJ, exclusive=True):
            got = self.store.acquire_checked(obj)
            if got is None:
                return 0
            fd, cfd, release = got
            try:
                rec = self.store.chain_record(obj) or (0, 0, 0)
                size = os.fstat(fd).st_size

                def read_verified(off: int, n: int) -> bytes:
                    if cfd is not None and n:
                        first = off // ck.BLOCK
                        bad = ck.verify_fd(obj, fd, cfd, first,
                                           ck.n_blocks(off + n) - first, size)
                        if bad:
                            raise OSError(errno.EIO, f"object {list(obj)}: bad block at "
                                                     f"{bad[0]}; not copied")
                    return os.pread(fd, n, off)

                async def read_from(off: int, n: int) -> bytes:
                    return await trio.to_thread.run_sync(read_verified, off, n)

                async def send(off: int, chunk: bytes, last: bool) -> None:
                    await self.peers.request(target, D.Install(
                        obj=obj, off=off, size=size, chain=rec[0] or 1, ver=rec[1],
                        seq=rec[2], last=last, crc=crc32c.crc32c(chunk) if chunk else None,
                        cuts=[list(m) for m in self.store.cuts.marks(obj)] or None
                        if last else None),
                        payload=chunk or None, timeout=META_TIMEOUT)
                    if pace is not None:
                        await pace(len(chunk))

                return await copy_object(read_from, size, send)
            finally:
                release()

    async def install(self, req: D.Install, apply: Apply) -> int:
        """A piece of a copy from the head (``copy_to``), under the whole object's lock;
        its CRC32C checked first (a piece damaged on its way is refused, EIO)."""
        obj = req.obj
        if req.crc is not None and req.payload and \
                crc32c.crc32c(req.payload) != req.crc:
            raise OSError(errno.EIO, f"install of object {list(obj)} at {req.off}: the "
                                     "piece does not match its checksum")
        async with self.locks.hold(obj, 0, MAX_OBJ, exclusive=True):
            if req.off == 0:
                self.store.truncate(obj, 0)
            n = await apply(obj, req.off, req.payload) if req.payload else 0
            if req.last:
                self.store.truncate(obj, req.size)
                if obj in self.store.tombs:  # the head holds it: defined, not deleted data
                    await trio.to_thread.run_sync(self.store.tombs.write, [obj], True)
                    self.store.tombs.discard(obj)
                # the head's truncation records (dataserver/cuts.py) replace this replica's
                marks = [(m[0], m[1]) for m in req.cuts or [] if len(m) == 2]
                if marks or self.store.cuts.has(obj):
                    await put_cuts(self.store, obj, marks, True)
                if req.size or self.store.chain_record(obj) is not None:
                    self.store.set_chain_record(obj, (req.chain, req.ver, req.seq))
                self._saw(req.chain, req.ver)
        return n


async def put_cuts(store: ObjectStore, obj: tuple[int, int], marks: Marks,
                   clear: bool) -> None:
    """Record ``obj``'s truncation records ``marks`` (after dropping its others, with
    ``clear``): durable first, then in memory."""
    await trio.to_thread.run_sync(store.cuts.write, obj, marks, clear)
    store.cuts.put(obj, marks, clear)


async def copy_object(read_from: Callable[[int, int], Awaitable[bytes]], size: int,
                      send: Callable[[int, bytes, bool], Awaitable[None]]) -> int:
    """Copy an object of ``size`` bytes, ``COPY_CHUNK`` at a time: ``read_from(off, n)``
    reads from the source replica, ``send(off, chunk, last)`` writes to the target
    (``last``: cut it to ``size`` and record its chain version). The caller holds what
    keeps writes out meanwhile (the head's lock on the whole object). The bytes copied.
    Catch-up and repair are both built on it."""
    off = 0
    while True:
        n = min(COPY_CHUNK, size - off)
        chunk = await read_from(off, n) if n > 0 else b""
        last = off + len(chunk) >= size
        await send(off, chunk, last)
        off += len(chunk)
        if last:
            return off
