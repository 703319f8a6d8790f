"""The data server: stripe objects on local drives, served over the pfs RPC framing.

``DataService`` answers the "Data server" methods of ``docs/rpc.md``. A read replies
with the object's bytes sent by ``sendfile`` straight from the object file; a write hands
the received payload to the I/O engine. ``serve_data`` listens, registers with the
metaserver and heartbeats; the data path serves whether or not the metaserver is up.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

import trio

from pfs.core import auth, caps, metrics
from pfs.core.auth import ClientAuth, ServerAuth
from pfs.core.caps import Capability, CapCache, CapVerifier
from pfs.core.config import DataConfig, parse_addr
from pfs.core.daemon import FD_RESERVE, nofile_limit
from pfs.core.durable import fsync_dir as _fsync_dir
from pfs.core.engine import Engine, get_engine
from pfs.core.messages import data as D
from pfs.core.messages import kv as K
from pfs.core.messages import meta as M
from pfs.core.messages.base import Empty
from pfs.core.messages.records import MAX_ID, Volume
from pfs.core.versions import SUPPORTED, package_version
from pfs.core.wire.connect import open_rpc
from pfs.core.wire.protocol import Limits
from pfs.core.wire.rpc import ConnContext, Reply, Request, RpcClient, RpcService
from pfs.core.wire.transport import local_socket_name
from pfs.dataserver import capacity
from pfs.dataserver import checksums as ck
from pfs.dataserver.chain import Peers, Replicator, put_cuts
from pfs.dataserver.cuts import Marks, cut_error
from pfs.dataserver.kvstore import KvStore, default_budget
from pfs.dataserver.objects import DEFAULT_MAX_OPEN, ObjectStore
from pfs.dataserver.repair import ObjectRepair, read_verified
from pfs.dataserver.scrub import Scrubber
from pfs.dataserver.tombstones import deleted_error

log = logging.getLogger(__name__)

MAX_DELETE = D.MAX_DELETE  # object ids in one delete request
MAX_BACKOFF = 10.0  # seconds between registration attempts, at most
MAX_FENCES = 1 << 16  # inode fences kept before old ones are pruned
MIN_REPORT_GAP = 0.1  # seconds between heartbeats sent early (a full disk), at least
KV_RECLAIM_SLACK = 16 << 20  # bytes of KV slabs dropped beyond a full write's size
KV_BYTES = frozenset({"budget", "used", "live", "reclaimed"})  # kv stats that are sizes
VERSION = package_version()  # reported at registration and in heartbeats


class DataService(RpcService):
    """Serves objects from ``store`` through ``engine``."""

    name = "dataserver"
    messages = D.REGISTRY

    def __init__(self, store: ObjectStore, engine: Engine, limits: Limits | None = None,
                 *, use_sendfile: bool = True, auth: ServerAuth | None = None,
                 own_auth: ClientAuth | None = None, verify_caps: bool | None = None,
                 free_override: int = -1, meta: str = "",
                 forward_timeout: float = 5.0, kv: KvStore | None = None,
                 kv_namespaces: dict[str, set[str]] | None = None) -> None:
        super().__init__(limits, auth)
        self.store = store
        self.engine = engine
        # KV-cache blocks (kvstore.py); a server without a budget answers EOPNOTSUPP
        self.kv = kv if kv is not None else KvStore(store.dirs, 0)
        self.kv_namespaces = kv_namespaces or {}  # namespace -> node keys that may use it
        self.use_sendfile = use_sendfile
        self.sid: str | None = store.load_sid()
        self.sid_known = trio.Event()  # set once ``sid`` is (it names the local socket)
        if self.sid is not None:
            self.sid_known.set()
        self.registrations = 0  # successful registrations so far
        # registered over the metaserver connection in use: while not (it restarts, its
        # store maybe restored), restore windows may be unknown here (cuts.py)
        self.meta_up = not meta
        self.own_auth = own_auth or ClientAuth()
        secured = auth is not None and auth.mode != "open"
        # capabilities are checked on a secured server; ``verify_caps=False`` is the
        # test-only switch of the benchmark (``--insecure-skip-caps``)
        self.verify_caps = secured if verify_caps is None else verify_caps
        self.verifier: CapVerifier | None = None
        self.floor = 0  # generation at the last registration
        self.cap_ttl = 300.0
        self.fences: dict[int, tuple[int, float]] = {}  # ino -> (generation, monotonic)
        self.free_override = free_override  # >= 0: the test knob of DataConfig
        # set when a write found the disk full: heartbeat now, so that the metaserver
        # stops placing new stripes here before the next regular heartbeat
        self.report_now = trio.Event()
        # objects written (or cut) since their last sync here: what a Sync reply counts
        self.unsynced: set[tuple[int, int]] = set()
        # block-range locks: a write merges and hashes its blocks under them (checksums)
        self.locks = ck.RangeLocks()
        self.scrubber = Scrubber(store, self.locks)
        self.domain = ""  # failure domain sent at registration ("": the host)
        # chain replication: version checks, forwarding writes, catch-up (chain.py)
        self.peers = Peers(self.own_auth, meta, self.limits)
        self.replicator = Replicator(store, self.locks, self.peers, forward_timeout)
        self.replicator.sid = self.sid
        # object repair from chain peers, lost data directories (repair.py)
        self.repairer = ObjectRepair(store, self.locks, self.replicator)
        self.scrubber.repair = self.repairer.repair
        self.load = metrics.Load()  # reported in each heartbeat (pfs admin status)

    async def connection_made(self, ctx: ConnContext) -> None:
        await super().connection_made(ctx)
        self.load.connections += 1

    def connection_lost(self, ctx: ConnContext) -> None:
        self.load.connections -= 1

    async def dispatch(self, ctx: ConnContext, req: Request) -> Reply | dict[str, Any]:
        n_in, out = len(req.payload) if req.payload is not None else 0, 0
        try:
            reply = await super().dispatch(ctx, req)
            if isinstance(reply, Reply):
                out = reply.file[2] if reply.file else len(reply.payload or b"")
            return reply
        finally:
            self.load.done(n_in, out)

    def is_inline(self, req: Request) -> bool:
        # a read answered with sendfile never waits before its reply, and replies on
        # one connection go out one after another anyway: no task of its own (a
        # checked read may wait for its blocks' lock first, which must not stall the
        # connection's reader: it runs in a task of its own, sendfile or not)
        if req.method == "read":
            return self.use_sendfile and not self.store.checksums
        # KV probes, misses, small blocks and cached ones never wait either (read, or
        # sent from the slab's mapping, in the loop): answered without a worker hop
        if req.method == "kv_get":
            return self.kv.answers_at_once(req.fields.get("ns"), req.fields.get("key"))
        return req.method == "kv_exists"

    # -- capabilities ----------------------------------------------------------
    def set_security(self, cap_key: bytes, floor: int, cap_ttl: float = 300.0,
                     data_keys: dict[str, bytes] | None = None,
                     cap_format: int | None = caps.VERSION) -> None:
        """What registration taught: the metaserver's public key, the generation floor,
        the data-plane keys clients authenticate with, and the capability format it signs
        (None: an older metaserver's unbound version 1, accepted until it is upgraded)."""
        legacy = cap_format is None
        if (self.verifier is None or self.verifier.public_bytes != cap_key
                or self.verifier.legacy != legacy):
            if legacy:
                log.warning("the metaserver signs unbound (version 1) capabilities: accepted "
                            "until it is upgraded (docs/security.md)")
            self.verifier = CapVerifier(cap_key, legacy)
        self.floor = max(self.floor, floor)
        self.cap_ttl = cap_ttl
        if data_keys is not None and self.auth is not None and self.auth.mode == "key":
            # the metaserver's list is the whole list: a key it no longer names (revoked
            # by ``pfs admin key revoke``) stops working here at the re-registration
            for name in [n for n in self.auth.keys if n != auth.CLUSTER]:
                if name not in data_keys:
                    del self.auth.keys[name]
            for name, key in data_keys.items():
                if name != auth.CLUSTER:
                    self.auth.keys[name] = (key, auth.Identity(name, "client"))

    def _cap(self, ctx: ConnContext, req: D.DataRequest, need: int, obj: tuple[int, int],
             writes: bool = False, end: int = 0) -> Capability | None:
        """The request's verified capability for ``obj`` with one of the ``need`` rights,
        naming this server for ``obj`` and issued to this connection's identity, reaching
        object offset ``end`` at most (caps.Capability.check); EACCES if it has none,
        ESTALE if it is too old to write."""
        if not self.verify_caps:
            return None
        cache: CapCache | None = ctx.state.get("caps")
        if cache is None or cache.verifier is not self.verifier:
            if self.verifier is None:
                raise OSError(errno.EACCES, "capability refused: this data server is not "
                                            "registered with a metaserver yet")
            cache = ctx.state["caps"] = CapCache(self.verifier)
        cap = cache.get(getattr(req, "cap", None))
        cap.check(req.method, need, obj, self.sid, ctx.identity, end)
        if writes:
            fence = self.fences.get(obj[0])
            if cap.gen < self.floor or (fence is not None and cap.gen < fence[0]):
                raise OSError(errno.ESTALE, "capability stale: the file was truncated or "
                                            "removed since (or this server restarted); renew it")
        return cap

    def _fence(self, ino: int, gen: int) -> None:
        old = self.fences.get(ino)
        if old is None or old[0] < gen:
            self.fences[ino] = (gen, time.monotonic())
        if len(self.fences) > MAX_FENCES:  # capabilities older than a lifetime are dead
            limit = time.monotonic() - 2 * self.cap_ttl - 60
            self.fences = {k: v for k, v in self.fences.items() if v[1] >= limit}

    # -- data methods ----------------------------------------------------------
    async def rpc_read(self, ctx: ConnContext, req: D.Read) -> Reply:
        obj, off, length = req.obj, req.off, req.len
        self._cap(ctx, req, caps.READ, obj)
        if self.replicator.restore_jumped(req.chain, req.ver):
            await self.replicator.learn(req.chain or 0)
        self.replicator.check_read(obj, req.chain, req.ver)
        self.store.check_readable(obj)
        if self.store.cuts.enforced:
            self._check_cut(obj, off, length)
        if length > self.limits.max_payload:
            raise OSError(errno.EINVAL, f"read: len {length} out of range "
                                        f"[0, {self.limits.max_payload}]")
        got = self.store.acquire_checked(obj)
        if got is None:
            self.store.check_absent(obj)
            if obj in self.store.tombs:  # deleted, not a hole (tombstones.py)
                raise deleted_error(obj)
            if self.store.checksums:
                self._check_missing(obj, off, length)
            return Reply(D.ReadReply(n=0))
        fd, cfd, release = got
        if cfd is not None:
            return await self._read_checked(obj, fd, cfd, off, length, release, req.copy)
        try:
            size = os.fstat(fd).st_size
            n = max(0, min(length, size - off))
            if n == 0:
                release()
                return Reply(D.ReadReply(n=0))
            if self.use_sendfile:
                return Reply(D.ReadReply(n=n), file=(fd, off, n), release=release)
            buf = bytearray(n)
            n = await self.engine.read_into(fd, off, memoryview(buf))
        except BaseException:
            release()
            raise
        release()
        return Reply(D.ReadReply(n=n), payload=memoryview(buf)[:n])

    def _check_cut(self, obj: tuple[int, int], off: int, length: int,
                   writes: bool = False) -> None:
        """EIO when a read of ``length`` bytes at ``off`` reaches into the range a
        truncation cut off after the metadata backup (cuts.py), or a write starts past
        the object's end while it has one (zeros would be left in it)."""
        gone = self.store.cuts.deleted_range(obj, self.store.size(obj))
        if gone is None:
            return
        lo, hi = gone
        if (off > lo) if writes else (off < hi and off + length > lo):
            raise cut_error(obj, max(off, lo) if not writes else lo, hi)

    def _check_missing(self, obj: tuple[int, int], off: int, length: int) -> None:
        """An absent object whose sidecar remains says data was written: EIO."""
        try:
            cfd = os.open(self.store.path(obj) + ck.SUFFIX, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            bl = ck.blocks(off, length)
            count = min(len(bl), os.fstat(cfd).st_size // ck.RECORD - bl.start)
            if count <= 0:
                return
            for blk, (_crc, end) in zip(bl, ck.read_records(cfd, bl.start, count),
                                        strict=False):
                if end:
                    raise ck.ChecksumError(obj, blk * ck.BLOCK, "missing object: its block "
                                                                "map says data was written")
        finally:
            os.close(cfd)

    async def _read_checked(self, obj: tuple[int, int], fd: int, cfd: int, off: int,
                            length: int, release: Callable[[], None],
                            copy: bool = False) -> Reply:
        """A read of a checksummed object under its blocks' shared lock (a writer cannot
        change a block between its checksum and its bytes). Owns ``release`` (the
        object's descriptors): run once the reply no longer needs them."""
        bl = ck.blocks(off, length)
        if not bl:
            release()
            return Reply(D.ReadReply(n=0))
        try:
            held = await self.locks.acquire(obj, bl.start, bl.stop - 1, exclusive=False)
        except BaseException:
            release()
            raise

        let_go = False

        def done() -> None:  # once: by the buffered path, after sendfile, or on error
            nonlocal let_go
            if not let_go:
                let_go = True
                self.locks.release(obj, held)
                release()

        try:
            reply = None if copy else self._read_sendfile(obj, fd, cfd, off, length)
            if reply is not None:  # the lock stays held until the file was sent
                reply.release = done
                reply.stable = True  # ... so no write or truncate reaches its range
                return reply
            return await self._read_buffered(obj, fd, cfd, off, length, done)
        except BaseException:
            done()
            raise

    def _read_sendfile(self, obj: tuple[int, int], fd: int, cfd: int, off: int,
                       length: int) -> Reply | None:
        """The reply of a read sent straight from the file: one covering whole blocks
        only (or ending at the object's end), every one written and within the object;
        the reader verifies the whole blocks with the checksums the reply carries, the
        server a partial last block. None: the buffered path decides. The blocks' lock
        is held until sendfile returned, yet sendfile does not copy: a block still queued
        in the socket may change under a later write, so the reader re-reads a mismatch
        once with ``copy`` (the buffered path) before calling it EIO."""
        if not self.use_sendfile or off % ck.BLOCK:
            return None
        size = os.fstat(fd).st_size
        n = max(0, min(length, size - off))
        if n == 0 or ((off + n) % ck.BLOCK and off + n != size):
            return None
        bl = ck.blocks(off, n)
        recs = ck.read_records(cfd, bl.start, len(bl))
        whole = ck.whole_blocks(off, n)
        crcs: list[int] = []
        for blk, rec in zip(bl, recs, strict=True):
            if not ck.check_map(obj, blk, rec, size):
                return None  # a hole reads as zeros, whatever the file holds
            if blk in whole:
                crcs.append(rec[0])
            else:  # the object's partial last block: nobody else verifies it
                ck.check(obj, blk, ck.read_block(fd, blk), rec, size)
        return Reply(D.ReadReply(n=n, crcs=crcs or None), file=(fd, off, n))

    async def _read_buffered(self, obj: tuple[int, int], fd: int, cfd: int, off: int,
                             length: int, done: Callable[[], None]) -> Reply:
        """Read the whole blocks covering the range (their lock held; ``done`` lets go
        of it and of the descriptors once read), verify the partial edge blocks against
        their checksums (EIO naming the object and offset), read holes as zeros, reply
        with the range and the checksums of the whole blocks."""
        bl = ck.blocks(off, length)
        try:
            size = os.fstat(fd).st_size
            ws = bl.start * ck.BLOCK
            we = min(bl.stop * ck.BLOCK, size)
            buf = bytearray(max(0, we - ws))
            view = memoryview(buf)
            if buf:
                got = await self.engine.read_into(fd, ws, view)
                we = ws + got
                view = view[:got]
            recs = ck.read_records(cfd, bl.start, len(bl))
        finally:
            done()
        n = max(0, min(length, size - off))
        whole = ck.whole_blocks(off, n)  # the reader verifies these: their checksums go
        crcs: list[int] = []
        for blk, rec in zip(bl, recs, strict=True):
            lo = blk * ck.BLOCK - ws
            part = view[lo:max(lo, min(lo + ck.BLOCK, we - ws))]
            if blk in whole:
                if not ck.check_map(obj, blk, rec, size):  # short or hole, no hashing
                    part[:] = bytes(len(part))
                    crcs.append(ck.HOLE_CRC)
                else:
                    crcs.append(rec[0])
            elif not ck.check(obj, blk, part, rec, size) and part:
                part[:] = bytes(len(part))  # a hole: zeros, whatever the file holds
        return Reply(D.ReadReply(n=n, crcs=crcs or None), payload=view[off - ws:off - ws + n])

    async def rpc_verify(self, ctx: ConnContext, req: D.Verify) -> D.VerifyReply:
        obj = req.obj
        self._cap(ctx, req, caps.READ | caps.ADMIN, obj)
        self.store.check_readable(obj)
        got = self.store.acquire_checked(obj)
        if got is None:
            return D.VerifyReply(blocks=0, bad=[], unchecked=False)
        fd, cfd, release = got
        try:
            if cfd is None:
                return D.VerifyReply(blocks=0, bad=[], unchecked=True)
            async with self.locks.hold(obj, 0, MAX_ID, exclusive=False):
                count = max(ck.n_blocks(os.fstat(fd).st_size),
                            os.fstat(cfd).st_size // ck.RECORD)
                bad = await trio.to_thread.run_sync(ck.verify_fd, obj, fd, cfd, 0, count,
                                                    os.fstat(fd).st_size)
        finally:
            release()
        if bad:
            log.error("verify: object %s has %d bad blocks, first at offset %d", list(obj),
                      len(bad), bad[0])
        return D.VerifyReply(blocks=count, bad=bad, unchecked=False)

    async def rpc_open_fd(self, ctx: ConnContext, req: D.OpenFd) -> Reply:
        """Short-circuit reads: a read-only descriptor of the object, passed to a client
        on this host over the local socket after the same capability check as a read."""
        if not ctx.local:
            raise OSError(errno.EPERM, "open_fd: descriptors are handed out only over the "
                                       "data server's local socket")
        obj = req.obj
        self._cap(ctx, req, caps.READ, obj)
        self.replicator.check_read(obj, None, None)
        self.store.check_readable(obj)
        if self.store.cuts.enforced:  # a reader past the end would see a hole
            self._check_cut(obj, 0, MAX_ID)
        if not self.meta_up and self.store.cuts.has(obj):
            # a restore's window may be unknown yet: over TCP, a read names its chain
            # version, and a restored one makes this server ask (restore_jumped)
            raise OSError(errno.EAGAIN, f"object {list(obj)}: read it over TCP until this "
                                        "server has registered with the metaserver again")
        got = self.store.acquire_checked(obj)
        if got is None:
            if obj in self.store.tombs:  # the client reads it over TCP: EIO there
                raise deleted_error(obj)
            if self.store.checksums:
                self._check_missing(obj, 0, MAX_ID - 1)
            raise OSError(errno.ENOENT, f"object {list(obj)} holds no data here")
        fd, cfd, release = got
        fds: list[int] = []
        try:  # new open file descriptions, read-only: the client cannot write through them
            for f in (fd, cfd):
                if f is not None:
                    fds.append(os.open(f"/proc/self/fd/{f}", os.O_RDONLY | os.O_CLOEXEC))
            size = os.fstat(fds[0]).st_size
        except OSError:
            for f in fds:
                os.close(f)
            raise
        finally:
            release()

        def close() -> None:
            for f in fds:
                os.close(f)

        return Reply(D.FdReply(size=size), fds=fds, release=close)

    async def serve_local(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
        """The local Unix socket for short-circuit reads; it is named after this server's
        id, so it opens once the id is known (registration)."""
        task_status.started()
        await self.sid_known.wait()
        assert self.sid is not None
        try:
            await self.serve_unix(local_socket_name(self.sid))
        except OSError as exc:  # e.g. another process of this id on the host: no fast path
            log.warning("no local socket for short-circuit reads: %s", exc)

    async def rpc_write(self, ctx: ConnContext, req: D.Write) -> D.CountReply:
        obj, off = req.obj, req.off
        data = req.payload
        if not (req.seq and ctx.identity is not None and ctx.identity.may_serve):
            # (a write forwarded down a chain was checked by its head, against a
            # placement the chain may have grown past since)
            self._cap(ctx, req, caps.WRITE, obj, writes=True, end=off + len(data or b""))
        if obj in self.store.tombs:  # it would be new bytes among zeros: truncate to 0 first
            raise deleted_error(obj)
        if self.replicator.restore_jumped(req.chain, req.ver):
            await self.replicator.learn(req.chain or 0)
        if self.store.cuts.enforced:
            self._check_cut(obj, off, 0, writes=True)
        if not data:
            return D.CountReply(n=0)
        if off + len(data) > MAX_ID:
            raise OSError(errno.EFBIG, f"write: {off}+{len(data)} beyond the largest object")
        if req.chain or req.fwd:  # the chain's order: under the blocks' lock, down the chain
            n, ver = await self.replicator.write(req, self._apply_locked)
            return D.CountReply(n=n, ver=ver)
        return D.CountReply(n=await self._apply(obj, off, data, locked=False))

    async def _apply_locked(self, obj: tuple[int, int], off: int, data: Any) -> int:
        return await self._apply(obj, off, data, locked=True)

    async def _apply(self, obj: tuple[int, int], off: int, data: Any, locked: bool) -> int:
        """Write ``data`` at ``off`` of ``obj`` and its checksums, under the blocks'
        exclusive lock (taken here unless the caller holds it). A full disk first takes
        back the KV store's space (its blocks are a cache) and tries once more."""
        for retry in (False, True):
            try:
                return await self._apply_once(obj, off, data, locked)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                first = exc
            if retry or not await self.kv.reclaim(len(data) + KV_RECLAIM_SLACK):
                break
        self.report_now.set()
        raise OSError(errno.ENOSPC, f"data server {self.sid}: its disk is full (object "
                                    f"{list(obj)}, {len(data)} bytes at {off})") from first

    async def _apply_once(self, obj: tuple[int, int], off: int, data: Any,
                          locked: bool) -> int:
        got = self.store.acquire_checked(obj, create=True)
        assert got is not None
        fd, cfd, release = got
        try:
            if cfd is None:
                n = await self.engine.write(fd, off, data)
            elif locked:
                n = await self.engine.write(fd, off, data)
                ck.update(fd, cfd, off, memoryview(data)[:n])
            else:
                bl = ck.blocks(off, len(data))
                async with self.locks.hold(obj, bl.start, bl.stop - 1, exclusive=True):
                    n = await self.engine.write(fd, off, data)
                    ck.update(fd, cfd, off, memoryview(data)[:n])
        finally:
            release()
        self.unsynced.add(obj)
        return n

    # -- KV-cache blocks (kvstore.py; docs/architecture.md "KV-cache tier") ----------
    def _kv_allowed(self, ctx: ConnContext, ns: str, method: str) -> None:
        """EACCES unless the connection's key may use namespace ``ns`` (one listed in
        ``kv_namespaces``: its node keys and the cluster key; any other: anyone the
        server let in)."""
        allowed = self.kv_namespaces.get(ns)
        if allowed is None:
            return
        ident = ctx.identity
        if ident is not None and (ident.role == "server" or ident.name in allowed):
            return
        who = ident.name if ident is not None else "?"
        raise OSError(errno.EACCES, f"{method}: namespace {ns!r} is restricted to node "
                                    f"keys {sorted(allowed)}; this connection is {who!r}")

    async def rpc_kv_put(self, ctx: ConnContext, req: K.KvPut) -> K.KvPutReply:
        self._kv_allowed(ctx, req.ns, "kv_put")
        data = req.payload
        if not data:
            raise OSError(errno.EINVAL, f"kv_put: an empty value (values are 1 to "
                                        f"{K.MAX_VALUE} bytes)")
        if len(data) > K.MAX_VALUE:
            raise OSError(errno.EMSGSIZE, f"kv_put: a value of {len(data)} bytes; at most "
                                          f"{K.MAX_VALUE}")
        return K.KvPutReply(n=await self.kv.put(req.ns, req.key, data, req.crc, req.pin))

    async def rpc_kv_get(self, ctx: ConnContext, req: K.KvGet) -> Reply | K.KvGetReply:
        self._kv_allowed(ctx, req.ns, "kv_get")
        got = await self.kv.get(req.ns, req.key, req.len)
        if got is None:
            return K.KvGetReply(found=False, n=0, crc=0)
        # sent from the store's buffer, which goes back to it once sent
        return Reply(K.KvGetReply(found=True, n=len(got.view), crc=got.crc),
                     payload=got.view, release=got.release)

    async def rpc_kv_exists(self, ctx: ConnContext, req: K.KvExists) -> K.KvExistsReply:
        self._kv_allowed(ctx, req.ns, "kv_exists")
        return K.KvExistsReply(present=self.kv.exists(req.ns, req.keys))

    async def rpc_kv_remove(self, ctx: ConnContext, req: K.KvRemove) -> K.KvRemoveReply:
        self._kv_allowed(ctx, req.ns, "kv_remove")
        return K.KvRemoveReply(n=await self.kv.remove(req.ns, req.keys))

    async def rpc_kv_open(self, ctx: ConnContext, req: K.KvOpen) -> Reply:
        """Short-circuit gets: the published index or a slab, read-only, to a client on
        this host that may read every namespace (a slab mixes them)."""
        if not ctx.local:
            raise OSError(errno.EPERM, "kv_open: descriptors are handed out only over the "
                                       "data server's local socket")
        self.kv.check_enabled()
        for ns in self.kv_namespaces:
            self._kv_allowed(ctx, ns, "kv_open")
        fds = self.kv.open_for_reader(req.slab)
        try:
            size = os.fstat(fds[0]).st_size
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        live = list(self.kv.slabs) if req.slab == 0 else []

        def release() -> None:
            for fd in fds:
                os.close(fd)

        return Reply(K.KvOpenReply(size=size, slabs=live), fds=fds, release=release)

    async def rpc_kv_stats(self, ctx: ConnContext, req: K.KvStats) -> K.KvStatsReply:
        st = self.kv.stats()
        return K.KvStatsReply(budget=st["budget"], used=st["used"], blocks=st["blocks"],
                              hits=st["hits"], misses=st["misses"],
                              evictions=st["evictions"], puts=st["puts"],
                              pinned=st["pinned"], corrupt=st["corrupt"])

    async def rpc_catch_up(self, ctx: ConnContext, req: D.CatchUp) -> D.CatchUpReply:
        cap = self._cap(ctx, req, caps.ADMIN, (0, 0))
        if cap is not None and cap.ino != 0:
            raise OSError(errno.EACCES, "capability refused: catch_up needs one for every "
                                        "object")
        n, nbytes = await self.replicator.catch_up(req.chain, req.ver, req.target,
                                                   req.rate or 0)
        return D.CatchUpReply(n=n, nbytes=nbytes)

    async def rpc_install(self, ctx: ConnContext, req: D.Install) -> D.CountReply:
        if self.verify_caps and (ctx.identity is None or not ctx.identity.may_serve):
            raise OSError(errno.EACCES, "install: only data servers copy objects here")
        n = await self.replicator.install(req, self._apply_locked)
        self.unsynced.add(req.obj)
        return D.CountReply(n=n)

    async def rpc_install_tombs(self, ctx: ConnContext, req: D.InstallTombs
                                ) -> D.CountReply:
        if self.verify_caps and (ctx.identity is None or not ctx.identity.may_serve):
            raise OSError(errno.EACCES, "install_tombs: only data servers copy tombstones "
                                        "here")
        new = [o for o in dict.fromkeys(req.objs) if o not in self.store.tombs]
        if new:
            await trio.to_thread.run_sync(self.store.tombs.write, new)
            self.store.tombs.add(new)
        # a replica of the chain the head deleted while this server was out of it
        left = [o for o in new if (rec := self.store.chain_record(o)) is not None
                and rec[0] == req.chain]
        self.unsynced.difference_update(left)
        for o in left:
            self.store.delete(o)
        if left:
            log.warning("chain %d: %d objects deleted on the head while this server was "
                        "out of the chain, deleted here too", req.chain, len(left))
        return D.CountReply(n=len(new))

    async def rpc_truncate(self, ctx: ConnContext, req: D.Truncate) -> Empty:
        obj, size = req.obj, req.size
        cap = self._cap(ctx, req, caps.ADMIN, obj, writes=True, end=size)
        if cap is not None:
            self._fence(obj[0], cap.gen)
        async with self.locks.hold(obj, 0, MAX_ID, exclusive=True):
            if obj in self.store.tombs:
                if size == 0:  # all of it defined again (nothing): no longer deleted data
                    await trio.to_thread.run_sync(self.store.tombs.write, [obj], True)
                    self.store.tombs.discard(obj)
                elif not self.store.exists(obj):
                    return Empty()  # what stays below ``size`` is still deleted data
            await self._cut(obj, size, req.at or time.time_ns())
        self.unsynced.add(obj)
        return Empty()

    async def _cut(self, obj: tuple[int, int], size: int, at: int) -> None:
        """Truncate ``obj`` to ``size`` (its lock held), recording first how far it
        reached when that cuts bytes off (cuts.py). A range cut off after the metadata
        backup is kept (its end lowered to ``size``) when the object would grow into
        it, and dropped when it is cut to its size or less: the namespace knows of this
        truncation, so what lies past the new end is a hole if the file grows again."""
        cuts = self.store.cuts
        now = self.store.size(obj)
        gone = cuts.deleted_range(obj, now)
        if gone is not None and size > now:  # not extended with zeros over deleted data
            await put_cuts(self.store, obj, [(cuts.window_at(obj), min(gone[1], size))], True)
            return
        marks: Marks = [(at, now)] if size < now else []
        if not marks and gone is None:
            self.store.truncate(obj, size)
            return
        try:
            await put_cuts(self.store, obj, marks, gone is not None)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # a full disk: truncating is how space is given back; the record goes
            # into the space it freed (as tombstones do)
            self.store.truncate(obj, size)
            try:
                await put_cuts(self.store, obj, marks, gone is not None)
            except OSError as again:
                log.error("object %s cut to %d without its truncation record (%s): "
                          "after a metadata restore the cut range reads as a hole",
                          list(obj), size, again)
            return
        self.store.truncate(obj, size)

    async def rpc_delete(self, ctx: ConnContext, req: D.Delete) -> D.DeletedReply:
        objs = req.objs  # all valid (the message checked them) before any is deleted
        for o in objs:
            cap = self._cap(ctx, req, caps.ADMIN, o, writes=True)
            if cap is not None:
                self._fence(o[0], cap.gen)
        return D.DeletedReply(deleted=await self._delete(objs, req.tomb))

    async def _delete(self, objs: list[tuple[int, int]], tomb: bool) -> int:
        """Delete ``objs``; with ``tomb`` (their file is gone from the namespace), each
        that exists gets a durable tombstone first (tombstones.py); how many existed.
        On a full disk the tombstones are written right after the deletes, in the space
        they freed: deleting is what gives a full disk its space back."""
        late: list[tuple[int, int]] = []
        if tomb:
            kept = [o for o in objs if o not in self.store.tombs and self.store.exists(o)]
            if kept:
                try:
                    await trio.to_thread.run_sync(self.store.tombs.write, kept)
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    late = kept
                self.store.tombs.add(kept)
        self.unsynced.difference_update(objs)
        deleted = sum(1 for o in objs if self.store.delete(o))
        cut = [o for o in objs if self.store.cuts.has(o)]
        if cut:  # their truncation records go with them (a tombstone speaks for them)
            try:
                await trio.to_thread.run_sync(self.store.cuts.write_cleared, cut)
            except OSError as e:  # kept on disk: back at a restart, where they are harmless
                log.warning("truncation records of %d deleted objects not cleared: %s",
                            len(cut), e)
            self.store.cuts.drop(cut)
        if late:
            try:
                await trio.to_thread.run_sync(self.store.tombs.write, late)
            except OSError as e:
                log.error("tombstones of %d deleted objects not recorded (%s): after a "
                          "metadata restore their files would read as holes", len(late), e)
        return deleted

    async def rpc_fsync(self, ctx: ConnContext, req: D.Fsync) -> Empty:
        obj = req.obj
        self._cap(ctx, req, caps.READ | caps.WRITE, obj)
        got = self.store.acquire_checked(obj)
        if got is None:
            return Empty()
        fd, cfd, release = got
        try:
            await self.engine.fsync(fd)
            if cfd is not None:
                await trio.to_thread.run_sync(os.fsync, cfd)
        finally:
            release()
        for d in self.store.take_unsynced_dirs(obj):
            await trio.to_thread.run_sync(_fsync_dir, d)
        return Empty()

    async def rpc_sync(self, ctx: ConnContext, req: D.Sync) -> D.SyncReply:
        """Every listed object's data to stable storage, each fdatasync in a thread of
        its own (a close lists every object it wrote here: they sync in parallel), then
        the directories that gained an entry. An object is synced whether or not this
        process saw it written: a write acknowledged before a restart may still sit in
        the page cache."""
        objs = list(dict.fromkeys(req.objs))
        for obj in objs:
            self._cap(ctx, req, caps.READ | caps.WRITE, obj)
        dirty = sum(1 for o in objs if o in self.unsynced)
        # forgotten before the sync starts: a write landing meanwhile marks it again
        self.unsynced.difference_update(objs)
        errors: list[OSError] = []
        # one object (a small file's close): its directories go in the same worker
        # thread right after its data, one hop instead of one per file
        alone = self.store.take_unsynced_dirs(objs[0]) if len(objs) == 1 else []

        async def one(obj: tuple[int, int]) -> None:
            got = self.store.acquire_checked(obj)
            if got is None and not alone:
                return
            try:
                await trio.to_thread.run_sync(_sync_files, got[:2] if got else (), alone)
            except OSError as exc:
                self.unsynced.add(obj)
                errors.append(exc)
            finally:
                if got is not None:
                    got[2]()

        if len(objs) == 1:
            await one(objs[0])
        else:
            async with trio.open_nursery() as nursery:
                for obj in objs:
                    nursery.start_soon(one, obj)
        if errors:
            self.store.dirs_unsynced(alone)  # still to sync: the next sync does them
            log.error("sync of objects %s failed: %s", objs, errors[0])
            raise errors[0]
        dirs = dict.fromkeys(d for o in objs for d in self.store.take_unsynced_dirs(o))
        for d in dirs:
            await trio.to_thread.run_sync(_fsync_dir, d)
        return D.SyncReply(dirty=dirty)

    async def rpc_stat_obj(self, ctx: ConnContext, req: D.StatObj) -> D.SizeReply:
        obj = req.obj
        self._cap(ctx, req, caps.READ | caps.WRITE, obj)
        return D.SizeReply(size=self.store.size(obj))

    async def rpc_statfs(self, ctx: ConnContext, req: D.Statfs) -> D.DataStatfsReply:
        cap = self.store.capacity()
        return D.DataStatfsReply(total=cap.total, free=cap.free, objects=cap.objects,
                                 scrubbed=self.scrubber.scrubbed,
                                 scrub_errors=self.scrubber.errors,
                                 repaired=self.repairer.repaired,
                                 repair_failed=self.repairer.failed,
                                 lost_dirs=sorted(self.store.lost) or None)

    # -- object repair (repair.py) ---------------------------------------------
    async def rpc_fetch(self, ctx: ConnContext, req: D.Fetch) -> Reply:
        if self.verify_caps and (ctx.identity is None or not ctx.identity.may_serve):
            raise OSError(errno.EACCES, "fetch: only data servers copy objects from here")
        self.replicator.check_read(req.obj, None, None)
        n = min(req.len, self.limits.max_payload)
        data, size, rec = await read_verified(self.store, req.obj, req.off, n)
        tomb = rec is None and not size and req.obj in self.store.tombs \
            and not self.store.exists(req.obj)
        cuts = [list(m) for m in self.store.cuts.marks(req.obj)] or None
        return Reply(D.FetchReply(n=len(data), size=size, rec=list(rec) if rec else None,
                                  tomb=tomb, cuts=cuts), payload=data)

    async def rpc_repair_object(self, ctx: ConnContext, req: D.RepairObject
                                ) -> D.CountReply:
        if not (ctx.identity is not None and ctx.identity.may_serve):
            cap = self._cap(ctx, req, caps.SCAN | caps.ADMIN, (0, 0))
            if cap is not None and cap.ino != 0:
                raise OSError(errno.EACCES, "capability refused: repair_object needs one "
                                            "for every object")
        n = await self.repairer.repair(req.obj, req.chain)
        self.unsynced.add(req.obj)
        return D.CountReply(n=n)

    async def rpc_remove_orphans(self, ctx: ConnContext, req: D.RemoveOrphans
                                 ) -> D.DeletedReply:
        cap = self._cap(ctx, req, caps.SCAN | caps.ADMIN, (0, 0))
        if cap is not None and cap.ino != 0:
            raise OSError(errno.EACCES, "capability refused: remove_orphans needs one for "
                                        "every object")
        # no file has their inode: another metadata backup may still name them
        deleted = await self._delete(req.objs, req.tomb)
        log.warning("removed %d orphan objects (pfs fsck --remove-orphans)", deleted)
        return D.DeletedReply(deleted=deleted)

    # -- checking (pfs fsck) ---------------------------------------------------
    async def rpc_list_objects(self, ctx: ConnContext, req: D.ListObjects
                               ) -> D.ListObjectsReply:
        """A page of the objects held here, in id order: what ``pfs fsck`` compares with
        the metaserver's files. Needs a capability with SCAN (or ADMIN) for inode 0."""
        cap = self._cap(ctx, req, caps.SCAN | caps.ADMIN, (0, 0))
        if cap is not None and (cap.ino != 0 or cap.stripes is not None):
            raise OSError(errno.EACCES, "capability refused: list_objects needs one for "
                                        "every object")
        objs, end = await trio.to_thread.run_sync(self.store.list_objects, req.after,
                                                  req.limit)
        return D.ListObjectsReply(objects=[list(o) for o in objs], end=end)

    # -- registration ----------------------------------------------------------
    def _kv_report(self) -> list[int] | None:
        """The KV store's budget, bytes used, blocks, hits, misses and evictions for the
        metaserver (None: no KV store here)."""
        if not self.kv.enabled:
            return None
        st = self.kv.stats()
        return [st[k] for k in ("budget", "used", "blocks", "hits", "misses", "evictions")]

    def space(self) -> tuple[int, int, list[Volume]]:
        """Total and free bytes (each filesystem once) and each data directory's. The
        KV store's slabs count as free: a file write takes them back (kvstore.py)."""
        # (a drive gone is left out until the directory check made it again)
        dirs = [d for d in self.store.dirs if os.path.isdir(d)] or self.store.dirs
        vols = capacity.with_reclaimable(capacity.volumes(dirs, self.free_override),
                                         self.kv.used_by_dir())
        total, free = capacity.space(vols)
        return total, free, vols

    async def keep_registered(self, meta: str, host: str, port: int, heartbeat: float, *,
                              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                              ) -> None:
        """Register with the metaserver at ``meta`` and heartbeat every ``heartbeat`` s,
        forever. Reports started after the first registration, or after the first failed
        attempt (the data path does not wait for the metaserver). On any failure it
        reconnects with backoff and registers again."""
        meta_host, meta_port = parse_addr(meta)
        heartbeat = max(heartbeat, 0.01)
        cap_backoff = min(MAX_BACKOFF, max(5 * heartbeat, 0.1))
        backoff = min(0.05, cap_backoff)
        started = False
        failures = 0
        while True:
            try:
                async with trio.open_nursery() as nursery:
                    client = await open_rpc(self.own_auth, nursery, meta_host, meta_port,
                                            timeout=max(5.0, 2 * heartbeat))
                    try:
                        await self._register(client, host, port)
                        if failures:
                            log.info("registered with the metaserver %s again as %s",
                                     meta, self.sid)
                        failures = 0
                        backoff = min(0.05, cap_backoff)
                        if not started:
                            started = True
                            task_status.started()
                        while True:
                            await self._between_beats(client, heartbeat)
                            self.report_now = trio.Event()
                            total, free, vols = self.space()
                            assert self.sid is not None
                            beat = await client.request(M.Heartbeat(
                                sid=self.sid, total=total, free=free, dirs=vols,
                                load=self.load.sample(), version=VERSION,
                                protocol=list(SUPPORTED), kv=self._kv_report()))
                            self.replicator.taken_out(beat.stale or [])
                    finally:
                        client.close()
            except* OSError as group:  # the nursery wraps what its body raised
                self.meta_up = False
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "metaserver %s: %s; retrying (serving data meanwhile)",
                        meta, _first(group))
            if not started:
                started = True
                task_status.started()
            await trio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, cap_backoff)

    async def _between_beats(self, client: RpcClient, heartbeat: float) -> None:
        """Until the next heartbeat is due (or a report is asked for). The metaserver
        closing the connection meanwhile (stopped, restarted, its metadata perhaps
        restored) raises at once, not at the next heartbeat: until this server registers
        again, ``meta_up`` says a restore's windows may be unknown here (cuts.py), which
        short-circuit descriptors (no chain version to check) depend on."""

        async def gone() -> None:
            await client.conn.wait_peer_gone()
            raise OSError(errno.ECONNRESET, "the metaserver closed the connection")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(gone)
            with trio.move_on_after(heartbeat):
                await self.report_now.wait()
                # many writes finding the disk full: one report for all
                await trio.sleep(min(heartbeat, MIN_REPORT_GAP))
            nursery.cancel_scope.cancel()

    async def _register(self, client: RpcClient, host: str, port: int) -> None:
        if host in ("", "0.0.0.0", "::"):  # advertise the address the metaserver sees us on
            host = client.conn.sock.getsockname()[0]
        total, free, vols = self.space()
        res: M.RegisterReply = await client.request(M.Register(
            sid=self.sid, host=host, port=port, total=total, free=free, dirs=vols,
            domain=self.domain or None, version=VERSION, protocol=list(SUPPORTED),
            kv=self._kv_report()))
        sid = res.sid
        if not sid:
            raise OSError(errno.EPROTO, f"register: the metaserver sent sid {sid!r}")
        key, gen, ttl = res.cap_key, res.gen, res.cap_ttl
        data_keys = res.data_keys or {}
        if key is not None and gen is not None:
            self.set_security(key, gen, float(ttl) if isinstance(ttl, (int, float)) else 300.0,
                              {k: v for k, v in data_keys.items()
                               if isinstance(k, str) and isinstance(v, bytes)},
                              res.cap_format)
        elif self.verify_caps:
            raise OSError(errno.EPROTO, "register: the metaserver sent no capability key")
        if sid != self.sid:
            if self.sid is not None:
                log.warning("the metaserver renamed this data server from %s to %s",
                            self.sid, sid)
            self.store.save_sid(sid)
            self.sid = sid
            self.replicator.sid = sid
            self.sid_known.set()
        self.replicator.taken_out(res.stale or [])
        self.store.cuts.set_windows((w[0], w[1]) for w in res.restores or [] if len(w) == 2)
        self.meta_up = True
        log.info("registered with the metaserver as %s (%s:%d)", sid, host, port)
        self.registrations += 1


def _first(group: BaseExceptionGroup[OSError]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def fd_cache_size(nofile: int) -> int:
    """Objects the descriptor cache keeps open, from the open-file limit: a quarter of
    what is left after the reserve (each holds two), at most the store's default."""
    return max(16, min(DEFAULT_MAX_OPEN, (nofile - FD_RESERVE) // 4))


def data_security(config: DataConfig) -> tuple[ServerAuth, ClientAuth]:
    """How peers authenticate to this data server and how it authenticates to the
    metaserver, from the config (no key and no TLS: unsecured)."""
    tls = auth.server_tls_from(config.tls_cert, config.tls_key, config.tls_ca)
    if tls is not None:
        return ServerAuth(tls=tls), auth.client_auth(
            tls_cert=config.tls_cert, tls_key=config.tls_key, tls_ca=config.tls_ca)
    if config.key_file:
        key = auth.read_secret_file(config.key_file)
        wire = auth.check_wire(config.wire_security, "data server")
        return (ServerAuth(keys={auth.CLUSTER: (key, auth.Identity(auth.CLUSTER, "server"))},
                           wire=wire),
                auth.client_auth(key_file=config.key_file, wire=wire))
    return ServerAuth(), ClientAuth()


async def serve_data(config: DataConfig, *, verify_caps: bool | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a data server until cancelled; ``nursery.start`` returns the bound port.

    Started once listening and registered with ``config.meta`` (or, when the metaserver
    cannot be reached, once listening; registration keeps retrying in the background).
    An empty ``config.meta`` runs without a metaserver.
    """
    server_auth, own_auth = data_security(config)
    if server_auth.mode == "open":
        log.warning("data server: no cluster key or TLS configured: UNSECURED, every peer "
                    "is trusted and no capability is checked (see docs/security.md)")
    if verify_caps is False:
        log.warning("data server: capability checks are OFF (a test-only switch)")
    nofile = nofile_limit()
    max_open = fd_cache_size(nofile)
    store = ObjectStore(config.dirs, max_open=max_open, checksums=config.checksums,
                        tomb_keep=config.tombstone_days * 86400.0)
    try:
        engine = get_engine(config.engine)
    except BaseException:
        store.close()
        raise
    budget = default_budget(config.dirs) if config.kv_budget < 0 else config.kv_budget
    kv = KvStore(config.dirs, budget)
    service = DataService(store, engine, auth=server_auth, own_auth=own_auth,
                          verify_caps=verify_caps, free_override=config.free_override,
                          meta=config.meta, forward_timeout=config.forward_timeout, kv=kv,
                          kv_namespaces={n.name: set(n.keys)
                                         for n in config.kv_namespaces})
    service.domain = config.domain
    # what the object cache may hold (two descriptors an object: data and checksums)
    # is not left to connections
    service.apply_limits(config.connections, nofile - FD_RESERVE - 2 * max_open)
    if metrics.serve(config.metrics_port, config.host):
        metrics.add_gauges("pfs_data_total_bytes", "a data directory's filesystem size",
                           "dir", lambda: {v.path: v.total for v in service.space()[2]})
        metrics.add_gauges("pfs_data_free_bytes", "a data directory's free bytes", "dir",
                           lambda: {v.path: v.free for v in service.space()[2]})
        if kv.enabled:
            metrics.add_gauges("pfs_kv_bytes", "KV-cache slabs: bytes of the budget, used, "
                               "in live blocks, of data given back to file writes", "kind",
                               lambda: {k: float(v) for k, v in kv.stats().items()
                                        if k in KV_BYTES})
            metrics.add_gauges("pfs_kv_events", "KV-cache blocks since the server started: "
                               "hits, misses, puts, evictions, corrupt; bytes in and out",
                               "event", lambda: {k: float(v) for k, v in kv.stats().items()
                                                 if k not in KV_BYTES})
    try:
        await kv.start()
        async with trio.open_nursery() as nursery:
            await nursery.start(service.peers.run)
            if kv.enabled:
                if config.local_socket:  # short-circuit gets for clients on this host
                    kv.publish()
                await nursery.start(kv.run)
            port: int = await nursery.start(service.serve, config.host, config.port)
            if config.meta:
                await nursery.start(service.keep_registered, config.meta, config.host, port,
                                    config.heartbeat)
            if config.local_socket:
                await nursery.start(service.serve_local)
            if len(config.dirs) > 1:
                nursery.start_soon(service.repairer.watch)
            if config.checksums and config.scrub_rate > 0:
                nursery.start_soon(service.scrubber.run, config.scrub_rate)
            task_status.started(port)
    finally:
        kv.close()
        engine.close()
        store.close()


def _sync_files(fds: tuple[int | None, ...], dirs: list[str]) -> None:
    """An object's data and checksums (``fds``), then ``dirs``, to stable storage (in a
    worker thread: one hop for all of them)."""
    for fd in fds:
        if fd is not None:
            os.fdatasync(fd)
    for d in dirs:
        _fsync_dir(d)
