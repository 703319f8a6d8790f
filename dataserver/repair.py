"""Object repair: one replica replaced by a verified copy from another member of its
chain (docs/architecture.md "Object repair and lost drives").

The server holding the bad (corrupt, short, missing) replica *pulls*: under its own
whole-object lock it fetches the object from another member (``fetch``, each block
verified there against its checksums), writes it aside and renames it over the old
file with fresh checksums and the source's chain version (a copy that fails midway
changes nothing). Why pull, under the repaired replica's lock only: a write goes
down the chain holding each member's lock until the next one has it, so

- a repaired member below the head: a write in flight was applied by the members above
  and waits here for the lock; the copy has it or not (``fetch`` takes no lock), and it
  lands here after the copy either way (rewriting the same bytes): nothing is lost;
- a repaired head: no write is in flight below it while it holds its lock, so every
  other member holds exactly what the head acknowledged.

A source whose chain record is behind this replica's is skipped (it missed writes).
An object of an unreplicated file (no chain, or a chain of one) cannot be repaired:
``EIO`` naming it.

Lost drives: a data directory found gone or unreadable (``ObjectStore.check_dirs``) is
made again, empty, and its objects are refused to readers (``EIO``: the reader goes to
another replica) while this server has every chain it belongs to copy back to it: it
takes itself out of each (``chain_drop``), and the metaserver's catch-up
(metaserver/catchup.py) copies the chain's objects from the head and puts it back. That
copies every object of those chains, not only the lost ones, but needs no list of what
the lost drive held (which went with it) and reuses the one path that is already safe
against concurrent writes.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Any

import trio

from pfs.core.messages import data as D
from pfs.core.messages import meta as M
from pfs.dataserver import checksums as ck
from pfs.dataserver.chain import MAX_OBJ, Replicator, put_cuts, stale
from pfs.dataserver.objects import ChainRecord, ObjectStore

log = logging.getLogger(__name__)

FETCH_CHUNK = 4 << 20  # bytes per fetch (a multiple of the block)
FETCH_TRIES = 5  # a block torn by a write landing at the source: read it again
FETCH_TIMEOUT = 30.0
MAX_CHAIN_GAP = 16  # chain ids not found in a row before the walk over chains stops
WATCH_INTERVAL = 2.0  # seconds between checks of the data directories


def _read_checked(obj: tuple[int, int], fd: int, cfd: int | None, off: int, n: int
                  ) -> tuple[bytes, int]:
    """Up to ``n`` bytes at ``off`` and the object's size, each block checked against
    its checksum (ChecksumError, EIO), holes as zeros. In a thread."""
    size = os.fstat(fd).st_size
    n = max(0, min(n - n % ck.BLOCK if n >= ck.BLOCK else n, size - off))
    buf = bytearray(os.pread(fd, n, off))
    if cfd is not None and buf:
        bl = ck.blocks(off, len(buf))
        for blk, rec in zip(bl, ck.read_records(cfd, bl.start, len(bl)), strict=True):
            lo = blk * ck.BLOCK - off
            part = bytes(buf[lo:lo + ck.BLOCK])
            if not ck.check(obj, blk, part, rec, size):
                buf[lo:lo + len(part)] = bytes(len(part))
    return bytes(buf), size


async def read_verified(store: ObjectStore, obj: tuple[int, int], off: int, n: int
                        ) -> tuple[bytes, int, ChainRecord | None]:
    """What ``fetch`` answers: up to ``n`` bytes of ``obj`` at ``off`` (a block
    boundary), verified; the object's size and chain record. No lock (module doc)."""
    if off % ck.BLOCK:
        raise OSError(errno.EINVAL, f"fetch: offset {off} is not a multiple of {ck.BLOCK}")
    store.check_readable(obj)
    got = store.acquire_checked(obj)
    if got is None:
        return b"", 0, store.chain_record(obj)
    fd, cfd, release = got
    try:
        data, size = await trio.to_thread.run_sync(_read_checked, obj, fd, cfd, off, n)
    finally:
        release()
    return data, size, store.chain_record(obj)


class ObjectRepair:
    """This server's repairs of its own replicas, and its lost drives."""

    def __init__(self, store: ObjectStore, locks: ck.RangeLocks, replicator: Replicator
                 ) -> None:
        self.store = store
        self.locks = locks
        self.replicator = replicator
        self.peers = replicator.peers
        self.repaired = 0  # replicas replaced by a good copy
        self.failed = 0  # repairs that found no good copy
        self.restoring: dict[str, set[int]] = {}  # lost dir -> chains being copied back

    # -- one object ----------------------------------------------------------------
    async def repair(self, obj: tuple[int, int], chain: int | None = None) -> int:
        """Replace this replica of ``obj`` with a verified copy from another member of
        its chain; the bytes copied."""
        try:
            n = await self._repair(obj, chain)
        except OSError:
            self.failed += 1
            raise
        self.repaired += 1
        return n

    async def _repair(self, obj: tuple[int, int], chain: int | None) -> int:
        rec = self.store.chain_record(obj)
        cid = chain or (rec[0] if rec else 0)
        if not cid:
            raise OSError(errno.EIO, f"object {list(obj)} belongs to no chain (an "
                                     "unreplicated file): it cannot be repaired")
        reply = await self.peers.meta_request(M.GetChain(chain=cid))
        _cid, ver, members = reply.chain
        sid = self.replicator.sid
        if sid not in members:
            raise stale(f"this server is not in chain {cid} (catch-up restores it)")
        others = [m for m in members if m != sid]
        if not others:
            raise OSError(errno.EIO, f"object {list(obj)}: chain {cid} has no other member "
                                     "(an unreplicated file): it cannot be repaired")
        last: OSError | None = None
        async with self.locks.hold(obj, 0, MAX_OBJ, exclusive=True):
            mine = self.store.chain_record(obj)
            for src in others:
                try:
                    n = await self._copy_from(obj, src, mine, cid)
                except OSError as exc:
                    log.warning("repair of object %s from %s failed: %s", list(obj), src, exc)
                    last = exc
                    continue
                self.replicator._saw(cid, int(ver))
                log.warning("object %s repaired from %s (chain %d, %d bytes)", list(obj),
                            src, cid, n)
                return n
        assert last is not None
        raise OSError(last.errno or errno.EIO,
                      f"object {list(obj)}: no good copy in chain {cid}: {last}")

    async def _fetch(self, src: str, obj: tuple[int, int], off: int
                     ) -> tuple[Any, bytes]:
        for attempt in range(FETCH_TRIES):
            try:
                return await self.peers.fetch(src, D.Fetch(obj=obj, off=off, len=FETCH_CHUNK),
                                              timeout=FETCH_TIMEOUT)
            except OSError as exc:
                if exc.errno != errno.EIO or attempt == FETCH_TRIES - 1:
                    raise
                await trio.sleep(0.05 * (attempt + 1))  # torn by a write: read again
        raise AssertionError("unreachable")

    async def _copy_from(self, obj: tuple[int, int], src: str, mine: ChainRecord | None,
                         cid: int) -> int:
        """Fetch ``obj`` whole from ``src`` into a staged file, then put it in place of
        this replica (ObjectStore.replace): a copy that fails midway changes nothing."""
        reply, data = await self._fetch(src, obj, 0)
        rec = tuple(reply.rec) if reply.rec else None
        if reply.tomb or (rec is None and not reply.size and obj in self.store.tombs):
            return await self._deleted(obj, src)
        if mine is not None and mine[0] == cid and (rec is None or rec[0] != cid
                                                    or rec[2] < mine[2]):
            raise OSError(errno.EAGAIN, f"{src} holds an older version of the object "
                                        f"({rec} < {mine})")
        staged = self.store.staging_path(obj)
        fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            off = 0
            while True:
                if data:
                    await trio.to_thread.run_sync(os.pwrite, fd, data, off)
                    off += len(data)
                if off >= reply.size or not data:
                    break
                reply, data = await self._fetch(src, obj, off)
            os.ftruncate(fd, reply.size)
            await trio.to_thread.run_sync(os.fsync, fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
            raise
        os.close(fd)
        final = (cid, int(rec[1]), int(rec[2])) if rec is not None else mine
        await trio.to_thread.run_sync(self.store.stage_checksums, staged)
        self.store.replace(obj, staged, final)
        marks = [(m[0], m[1]) for m in reply.cuts or [] if len(m) == 2]
        if marks or self.store.cuts.has(obj):  # the source's truncation records too
            await put_cuts(self.store, obj, marks, True)
        return int(reply.size)

    async def _deleted(self, obj: tuple[int, int], src: str) -> int:
        """``obj`` was deleted (its file unlinked): tombstoned at ``src`` or here. The
        replica is its tombstone, never an empty object (which would read as a hole,
        zeros, where the file's deleted data was); one left here goes."""
        tombs = self.store.tombs
        if obj not in tombs:
            await trio.to_thread.run_sync(tombs.write, [obj])
            tombs.add([obj])
            log.warning("object %s: deleted at %s; its tombstone recorded here",
                        list(obj), src)
        self.store.delete(obj)
        return 0

    # -- lost drives ---------------------------------------------------------------
    async def watch(self, interval: float = WATCH_INTERVAL, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check the data directories now and every ``interval`` s; restore a lost one."""
        task_status.started()
        while True:
            self.store.check_dirs()
            for d in self.store.lost:  # (found here, at start, or by a read)
                self.restoring.setdefault(d, set())
            for d in list(self.restoring):
                try:
                    await self._restore(d)
                except OSError as exc:
                    log.warning("data directory %s: restoring its objects: %s; trying "
                                "again", d, exc)
            await trio.sleep(interval)

    async def _restore(self, d: str) -> None:
        """Take this server out of every chain it is in (once), then wait until the
        metaserver says it is caught up in all of them: the directory serves again."""
        if not self.replicator.ready or self.replicator.sid is None:
            return  # not registered yet: the next pass
        pending = self.restoring[d]
        if not pending:
            pending.update(await self._drop_everywhere())
            pending.add(0)  # (marks the drops as done, even when there were none)
            log.warning("data directory %s lost: chains %s copy its objects back", d,
                        sorted(pending - {0}))
            return
        if pending & self.replicator.out:
            return
        del self.restoring[d]
        self.store.restored(d)
        log.warning("data directory %s: its objects are restored, serving again", d)

    async def _drop_everywhere(self) -> set[int]:
        """Take this server out of each chain it is a member of; their ids. Chain ids
        are handed out one after another: walked until ``MAX_CHAIN_GAP`` in a row are not
        found."""
        sid = self.replicator.sid
        assert sid is not None  # registered (the caller checked)
        dropped: set[int] = set()
        cid, gap = 0, 0
        while gap < MAX_CHAIN_GAP:
            cid += 1
            try:
                reply = await self.peers.meta_request(M.GetChain(chain=cid))
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                gap += 1
                continue
            gap = 0
            _cid, _ver, members = reply.chain
            if sid not in members:
                continue
            if len(members) == 1:
                log.error("chain %d has no other member: the objects it had on the lost "
                          "directory are lost", cid)
                continue
            await self.peers.meta_request(M.ChainDrop(chain=cid, sid=sid))
            dropped.add(cid)
        self.replicator.taken_out(sorted(self.replicator.out | dropped))
        return dropped
