"""The data server's KV block store: blocks of the KV-cache tier (docs/architecture.md
"KV-cache tier"), packed into slab files under ``kv/`` of the data directories.

Records are appended to the current slab (the format is :mod:`pfs.dataserver.kvslab`);
an in-memory index maps ``(namespace, key)`` to the newest record of the key, and is
rebuilt by scanning the slabs when the server starts. A get of a value in the page
cache (64 KiB and up) checks and sends it from the slab's mapping (kvmap.py); any other
is read into a reused buffer (``BufferPool``: no allocation or page faults per get; the
reply is sent from it, then it goes back). Either way its CRC32C is checked before it
goes out (a mismatch is dropped, counted and answered as a miss); a put checks the CRC the client sent before
anything is stored (EIO), then writes head and value with one ``pwritev``.

Space: ``budget`` bytes of slab files at most (the sum of their sizes, dead records
included), and less when the filesystem is nearly full (the store stops growing while
less than ``low_water`` bytes are free there), so file data always comes first; a file
write that still meets ENOSPC calls :meth:`KvStore.reclaim`, which drops whole slabs.

Eviction takes the oldest slab (FIFO over slabs, the log-structured cache's order) and
gives its records a second chance, CLOCK-like: a record read since it was written (or
since its last move: by a request, or by a short-circuit reader, which sets the
record's reference byte in the published index) and a pinned one are copied forward to
the current slab with the reference bit cleared; the rest are dropped with the slab. A pinned record goes only
when nothing unpinned is left to evict. A removal appends a tombstone so that a restart
does not bring the key back.

Durability (it is a cache): a put is acknowledged once its record is in the page cache;
every slab written to is flushed (fdatasync) within ``SYNC_INTERVAL`` seconds. A
crashed process loses nothing acknowledged; a power loss loses at most the last
seconds of puts, and the torn tail it may leave is cut off at the next start, never
served.

Blocking work stays off the event loop as the I/O engine keeps it (pfs/core/engine.py),
where a thread hop costs more than the work is it done in the loop: a get first tries
``preadv`` with ``RWF_NOWAIT`` (the page cache only, never the disk) for values up to
``NOWAIT_MAX``, and checks the CRC there too (CRC32C runs at >10 GB/s); what is not
cached is read and checked in one worker-thread hop (at most ``QUEUE_DEPTH`` at once).
A put writes in the loop under ``WRITE_INLINE_MAX`` (a buffered write can wait on dirty
pages), else in a thread. Flushes run in threads, and so does the start-up scan
(:meth:`KvStore.open`, before the server serves).
"""
from __future__ import annotations

import errno
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from pfs.core import crcfast
from pfs.core.pinning import Pin
from pfs.dataserver import kvslab as fmt
from pfs.dataserver.kvindex import PublishedIndex
from pfs.dataserver.kvmap import SlabMap, resident

log = logging.getLogger(__name__)

DEFAULT_FRACTION = 0.10  # of the first data directory's filesystem, when not configured
DEFAULT_CAP = 64 << 30  # ... at most
MAX_SLAB = 64 << 20  # bytes of records a slab takes before the next one opens
MIN_SLAB = 256 << 10
SYNC_INTERVAL = 2.0  # seconds between flushes of the slabs written to
HEARTBEAT = 1.0  # seconds between two stamps of the published index's heartbeat
INLINE_MAX = 64 << 10  # I/O below this runs in the event loop; get buffers from it pooled
WRITE_INLINE_MAX = 256 << 10  # appends below this are written in the event loop
CRC_INLINE_MAX = 1 << 20  # values up to this are checksummed in the event loop
# gets up to this try the page cache from the event loop first: the read and CRC of a
# cached 4 MiB value stall the loop ~0.25 ms, a worker-thread hop costs ~0.1 ms of CPU
# more per get (a 2 MiB get: ~10 % of the server's CPU for it)
NOWAIT_MAX = 4 << 20
# cached values from this size are sent from the slab's mapping (kvmap.py); smaller ones
# are read into a pooled buffer by the probe itself: one system call where the mapping
# takes five (two probes, mlock2, a page-table read, munlock: the lock and unlock split
# and merge the mapping's VMA), and the send copies from a buffer still in the CPU's
# cache (a 256 KiB value read, checked, tagged and sent: ~30 us less; equal at 1 MiB)
MAP_MIN = 1 << 20
QUEUE_DEPTH = 32  # reads and writes in worker threads at once
POOL_BYTES = 256 << 20  # get buffers kept for reuse, at most
STATFS_EVERY = 1.0  # seconds a filesystem's free space is trusted
PRESSURE_HOLD = 30.0  # seconds free space is not cached after a file write met ENOSPC
Key = tuple[str, bytes]
T = TypeVar("T")


def default_budget(dirs: list[str]) -> int:
    """A tenth of the first data directory's filesystem, at most DEFAULT_CAP."""
    try:
        st = os.statvfs(dirs[0])
    except OSError:
        return 0
    return min(DEFAULT_CAP, int(st.f_blocks * st.f_frsize * DEFAULT_FRACTION))


def low_water_of(total: int) -> int:
    """Free bytes the store leaves a filesystem of ``total`` bytes (file data's):
    2 %, at most 512 MiB."""
    return min(512 << 20, total // 50)


def _pread_checked(fd: int, off: int, view: memoryview, crc: int) -> bool:
    """Blocking: read ``view`` whole at ``off``; whether it matches ``crc``."""
    done, total = 0, len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], off + done)
        if n == 0:
            return False  # cut short
        done += n
    return bool(crcfast.crc32c(view) == crc)


def _pread_all(fd: int, off: int, buf: bytearray) -> None:
    """Blocking: fill ``buf`` from ``off`` (EIO if the file ends first)."""
    view, done = memoryview(buf), 0
    while done < len(buf):
        n = os.preadv(fd, [view[done:]], off + done)
        if n == 0:
            raise OSError(errno.EIO, "kv slab shorter than its index says")
        done += n


def _pread_cached(fd: int, off: int, view: memoryview) -> bool:
    """Non-blocking: fill ``view`` from the page cache alone; False when any of it is
    not there (or the filesystem cannot say): the caller reads it in a thread."""
    try:
        return bool(os.preadv(fd, [view], off, os.RWF_NOWAIT) == len(view))
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: no RWF_NOWAIT here
        return False


def _pwrite_all(fd: int, off: int, bufs: list[memoryview]) -> None:
    """Blocking: write ``bufs`` one after another at ``off``."""
    for buf in bufs:
        done = 0
        while done < len(buf):
            done += os.pwritev(fd, [buf[done:]], off + done)
        off += len(buf)


def _crc(view: memoryview) -> int:
    return int(crcfast.crc32c(view))


def _close(slab: Slab) -> None:
    """Close a dead slab's descriptor, once: closing a number twice would close
    whatever file took the number since."""
    slab.mapped.drop()
    if slab.fd >= 0:
        fd, slab.fd = slab.fd, -1
        os.close(fd)


class BufferPool:
    """Buffers for get replies, reused: a power-of-two size class from 64 KiB up, at
    most ``limit`` bytes kept (smaller values get a new buffer each)."""

    def __init__(self, limit: int = POOL_BYTES) -> None:
        self.limit = limit
        self.kept = 0
        self._free: dict[int, list[bytearray]] = {}

    def take(self, n: int) -> bytearray:
        if n < INLINE_MAX:
            return bytearray(n)
        size = 1 << (n - 1).bit_length()
        free = self._free.get(size)
        if free:
            self.kept -= size
            return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        size = len(buf)
        if size < INLINE_MAX or size & (size - 1) or self.kept + size > self.limit:
            return
        self._free.setdefault(size, []).append(buf)
        self.kept += size


class Value:
    """A value read by :meth:`KvStore.get`: its bytes, their CRC32C, and ``release``,
    to call once the bytes are no longer needed (sent): the buffer is reused. A value
    served from the slab's mapping (``buf`` None) has no buffer to give back, but its
    pages are locked until then (``pinned``)."""

    __slots__ = ("view", "crc", "_buf", "_pool", "_pinned")

    def __init__(self, view: memoryview, crc: int, buf: bytearray | None = None,
                 pool: BufferPool | None = None, pinned: Pin | None = None) -> None:
        self.view, self.crc, self._buf, self._pool = view, crc, buf, pool
        self._pinned = pinned

    def release(self) -> None:
        if self._buf is not None and self._pool is not None:
            self._pool.give(self._buf)
        if self._pinned is not None:
            self._pinned.release()
            self._pinned = None


class Slab:
    __slots__ = ("sid", "path", "dir", "fd", "size", "keys", "refs", "writers", "idle",
                 "sealed", "dead", "dirty", "mapped")

    def __init__(self, sid: int, path: str, d: str, fd: int) -> None:
        self.sid, self.path, self.dir, self.fd = sid, path, d, fd
        self.size = 0  # bytes appended or reserved
        self.keys: set[Key] = set()  # the keys whose newest record is here
        self.refs = 0  # reads, flushes, evictions using ``fd``: closed after the last
        self.writers = 0  # appends in flight
        self.idle: trio.Event | None = None  # set when the last append lands
        self.sealed = False
        self.dead = False  # unlinked; ``fd`` closes with the last ref
        self.dirty = False  # written since its last flush
        self.mapped = SlabMap()  # gets of cached values read it (kvmap.py)


class Entry:
    """Where the newest record of a key lies, and its eviction state."""

    __slots__ = ("slab", "off", "hlen", "vlen", "crc", "seq", "pinned", "ref", "slot")

    def __init__(self, slab: Slab, off: int, hlen: int, vlen: int, crc: int, seq: int,
                 pinned: bool) -> None:
        self.slab, self.off, self.hlen, self.vlen = slab, off, hlen, vlen
        self.crc, self.seq, self.pinned = crc, seq, pinned
        self.ref = False  # read since written or moved: survives one eviction
        # its slot in the published index (-1: left out, counted; None: not published)
        self.slot: int | None = None

    @property
    def size(self) -> int:
        return self.hlen + self.vlen


@dataclass
class KvCounters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0  # records dropped to make room (moves not counted)
    corrupt: int = 0  # records whose value failed its checksum (or a read) when read
    bytes_in: int = 0  # value bytes stored
    bytes_out: int = 0  # value bytes served
    reclaimed: int = 0  # bytes given back to file writes (ENOSPC)


class KvStore:
    def __init__(self, dirs: list[str], budget: int, *, slab_bytes: int = 0) -> None:
        self.dirs = list(dirs)
        self.budget = max(0, budget)
        self.buffers = BufferPool()
        self._limiter = trio.CapacityLimiter(QUEUE_DEPTH)
        self.slab_bytes = slab_bytes or max(MIN_SLAB, min(MAX_SLAB, self.budget // 8))
        self.index: dict[Key, Entry] = {}
        self.slabs: OrderedDict[int, Slab] = OrderedDict()  # oldest first
        self.current: Slab | None = None
        self.used = 0  # bytes of slab files
        self.live = 0  # bytes of indexed records
        self.pinned = 0  # indexed pinned records
        self.pinned_bytes = 0
        self.seq = 1
        self.next_sid = 1
        self.counters = KvCounters()
        self._evicting = trio.Lock()
        self._free_at: dict[str, tuple[float, int, int]] = {}  # dir -> (when, free, total)
        self._pressure_until = 0.0
        # the index in shared memory for short-circuit gets (kvindex.py); None: off
        self.published: PublishedIndex | None = None
        # the entry ``answers_at_once`` found cached just now, and the bytes of a value
        # under MAP_MIN that it read (the read was the probe; None: one to map); the
        # get that follows at once takes them
        self._probed: tuple[Entry, bytearray | None] | None = None

    def publish(self) -> PublishedIndex:
        """Publish the index in shared memory from now on (the server's local socket
        hands it out); every key indexed so far goes in."""
        if self.published is None:
            self.published = PublishedIndex(self.budget)
            for key, e in self.index.items():
                self._publish(key, e)
            self._low()
        return self.published

    def _publish(self, key: Key, e: Entry) -> None:
        pub = self.published
        if pub is not None:
            e.slot = pub.publish(key[0].encode("ascii"), key[1], e.seq, e.slab.sid,
                                 e.off, e.vlen)

    def _unpublish(self, e: Entry) -> None:
        pub = self.published
        if pub is not None:
            if e.slot is not None and e.slot >= 0:
                pub.clear(e.slot)
            elif e.slot is not None:
                pub.forget_unpublished()
            e.slot = None

    def _read_locally(self, e: Entry) -> bool:
        """Whether a short-circuit reader got ``e`` since it was written or moved (its
        reference byte in the published index: kvindex.py)."""
        return self.published is not None and self.published.referenced(e.slot)

    def _low(self) -> None:
        if self.published is not None:
            self.published.set_low(next(iter(self.slabs), self.next_sid))

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    # -- start and stop ------------------------------------------------------------
    def open(self) -> None:
        """Rebuild the index from the slabs on disk (blocking: run it in a thread
        before serving). The newest record of each key wins; a tombstone hides it."""
        found: list[tuple[int, str, str]] = []
        for d in self.dirs:
            kvd = os.path.join(d, fmt.KV_DIR)
            try:
                names = os.listdir(kvd)
            except FileNotFoundError:
                continue
            except OSError as exc:  # a drive gone: its blocks are misses
                log.error("kv: cannot list %s: %s", kvd, exc)
                continue
            for name in names:
                sid = fmt.slab_id(name)
                if sid is not None:
                    found.append((sid, os.path.join(kvd, name), d))
        found.sort()
        best: dict[Key, tuple[fmt.Scanned, Slab]] = {}
        for sid, path, d in found:
            self.next_sid = max(self.next_sid, sid + 1)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                log.error("kv slab %s cannot be opened, skipped: %s", path, exc)
                continue
            try:
                recs, end = fmt.scan(fd, path)
            except OSError as exc:
                log.error("kv slab %s unreadable, skipped: %s", path, exc)
                os.close(fd)
                continue
            if end == 0:
                os.close(fd)
                os.unlink(path)
                continue
            slab = Slab(sid, path, d, fd)
            slab.size, slab.sealed = end, True
            self.slabs[sid] = slab
            self.used += end
            for rec in recs:
                key = (rec.ns, rec.key)
                old = best.get(key)
                if old is None or rec.seq > old[0].seq:
                    best[key] = (rec, slab)
                self.seq = max(self.seq, rec.seq + 1)
        for key, (rec, slab) in best.items():
            if not rec.flags & fmt.TOMBSTONE:
                self._index(key, Entry(slab, rec.off, rec.head_len, rec.vlen, rec.vcrc,
                                       rec.seq, bool(rec.flags & fmt.PINNED)))
        if found:
            log.info("kv store: %d blocks in %d slabs (%d bytes) after the scan",
                     len(self.index), len(self.slabs), self.used)

    async def start(self) -> None:
        """Open (in a thread) and trim to the budget (it may have been lowered)."""
        await trio.to_thread.run_sync(self.open)
        if self.used > self.budget:
            await self._make_room(0)

    def close(self) -> None:
        if self.published is not None:
            self.published.close()
            self.published = None
        for slab in self.slabs.values():
            slab.dead = True
            if slab.refs == 0:
                _close(slab)
        self.slabs.clear()
        self.index.clear()
        self.current = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Flush the slabs written to, every SYNC_INTERVAL seconds, until cancelled."""
        task_status.started()
        beats = max(1, round(SYNC_INTERVAL / HEARTBEAT))
        while True:
            for _ in range(beats):
                await trio.sleep(SYNC_INTERVAL / beats)
                if self.published is not None:
                    self.published.beat()
            await self.sync()

    async def sync(self) -> None:
        """fdatasync every slab written to since its last flush."""
        for slab in [s for s in self.slabs.values() if s.dirty]:
            if slab.dead:  # evicted while an earlier one was flushed: its fd is gone
                continue
            slab.dirty = False
            slab.refs += 1
            try:
                await trio.to_thread.run_sync(os.fdatasync, slab.fd)
            except OSError as exc:
                log.error("kv slab %s: flush failed: %s", slab.path, exc)
            finally:
                self._unref(slab)

    async def _io(self, nbytes: int, fn: Callable[..., T], *args: object,
                  inline_max: int = INLINE_MAX) -> T:
        """``fn(*args)``, blocking work on ``nbytes``: in the event loop below
        ``inline_max``, else in a worker thread."""
        if nbytes < inline_max:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                return fn(*args)
            finally:
                await trio.lowlevel.cancel_shielded_checkpoint()
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    # -- the index -----------------------------------------------------------------
    def _index(self, key: Key, e: Entry) -> None:
        """Index ``e`` (published too: into the slot it inherited, or a new one)."""
        self.index[key] = e
        e.slab.keys.add(key)
        if e.slot is not None and e.slot >= 0 and self.published is not None:
            self.published.move(e.slot, key[0].encode("ascii"), key[1], e.seq, e.slab.sid,
                                e.off, e.vlen)
        else:
            self._publish(key, e)
        self.live += e.size
        if e.pinned:
            self.pinned += 1
            self.pinned_bytes += e.size

    def _drop(self, key: Key, e: Entry) -> None:
        del self.index[key]
        e.slab.keys.discard(key)
        self._unpublish(e)
        self.live -= e.size
        if e.pinned:
            self.pinned -= 1
            self.pinned_bytes -= e.size

    # -- slabs ---------------------------------------------------------------------
    def _new_slab(self) -> Slab:
        sid = self.next_sid
        self.next_sid += 1
        first: OSError | None = None
        for i in range(len(self.dirs)):  # the directories in turn; one gone is skipped
            d = self.dirs[(sid + i) % len(self.dirs)]
            kvd = os.path.join(d, fmt.KV_DIR)
            path = os.path.join(kvd, fmt.slab_name(sid))
            try:
                os.makedirs(kvd, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except OSError as exc:
                first = first or exc
        else:
            assert first is not None
            raise first
        slab = Slab(sid, path, d, fd)
        self.slabs[sid] = slab
        self.current = slab
        return slab

    def _seal(self, slab: Slab) -> None:
        slab.sealed = True
        if self.current is slab:
            self.current = None

    def _reserve(self, size: int) -> tuple[Slab, int]:
        """Room for a record of ``size`` bytes at the end of the current slab (a new one
        when it is full); the caller writes it, then calls :meth:`_written`."""
        slab = self.current
        if slab is None or (slab.size and slab.size + size > self.slab_bytes):
            if slab is not None:
                self._seal(slab)
            slab = self._new_slab()
        off = slab.size
        slab.size += size
        self.used += size
        slab.writers += 1
        return slab, off

    async def _append(self, slab: Slab, off: int, bufs: list[memoryview]) -> None:
        """Write a reserved record, whatever happens: a cancelled or failed append
        would leave a hole, which ends the slab's scan at the next start (so a failed
        one seals the slab: nothing more goes after it)."""
        try:
            with trio.CancelScope(shield=True):
                await self._io(sum(len(b) for b in bufs), _pwrite_all, slab.fd, off, bufs,
                               inline_max=WRITE_INLINE_MAX)
        except OSError:
            self._seal(slab)
            raise
        finally:
            self._written(slab)

    def _written(self, slab: Slab) -> None:
        slab.writers -= 1
        slab.dirty = True
        if slab.writers == 0 and slab.idle is not None:
            slab.idle.set()
            slab.idle = None

    def _unref(self, slab: Slab) -> None:
        slab.refs -= 1
        if slab.dead and slab.refs == 0:
            _close(slab)

    def _delete(self, slab: Slab) -> None:
        """The slab's file goes (its records must be out of the index)."""
        assert not slab.keys
        del self.slabs[slab.sid]
        if self.current is slab:
            self.current = None
        self.used -= slab.size
        slab.dead = True
        self._low()
        try:
            os.unlink(slab.path)
        except FileNotFoundError:
            pass
        if slab.refs == 0:
            _close(slab)

    async def _quiet(self, slab: Slab) -> None:
        """Wait for the appends in flight to ``slab`` (sealed: no new ones come)."""
        while slab.writers:
            if slab.idle is None:
                slab.idle = trio.Event()
            await slab.idle.wait()

    # -- space ---------------------------------------------------------------------
    def _fs_room(self) -> int:
        """Bytes the store may grow by before its filesystems get below low water."""
        now = time.monotonic()
        fresh = now < self._pressure_until  # a file write met ENOSPC lately: ask each time
        room = None
        for d in self.dirs:
            cached = self._free_at.get(d)
            if cached is None or fresh or now - cached[0] > STATFS_EVERY:
                try:
                    st = os.statvfs(d)
                except OSError:
                    continue
                cached = (now, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)
                self._free_at[d] = cached
            r = cached[1] - low_water_of(cached[2])
            room = r if room is None else min(room, r)
        return max(0, room) if room is not None else 0

    def cap(self) -> int:
        """The bytes of slabs the store may hold now."""
        return min(self.budget, self.used + self._fs_room())

    async def _make_room(self, n: int) -> None:
        """Evict until ``n`` more bytes fit the cap; ENOSPC if they cannot (the disk is
        full of file data)."""
        if self.used + n <= self.cap():
            return
        async with self._evicting:
            futile = 0
            while self.used + n > self.cap() and self.slabs:
                victim = next(iter(self.slabs.values()))
                self._seal(victim)
                take_pinned = futile > len(self.slabs) or self.pinned_bytes >= self.live
                freed = await self._evict(victim, take_pinned)
                futile = futile + 1 if freed <= 0 else 0
                self._free_at.clear()
            if self.used + n > self.cap():
                raise OSError(errno.ENOSPC, f"kv store: no room for a {n}-byte record "
                                            f"(the data disk is nearly full)")

    async def _evict(self, victim: Slab, take_pinned: bool) -> int:
        """Drop the oldest slab; its referenced (and, unless ``take_pinned``, pinned)
        records move to the current slab first. The bytes it freed."""
        await self._quiet(victim)
        victim.refs += 1
        try:
            keep: list[tuple[Key, Entry]] = []
            for key in list(victim.keys):
                e = self.index[key]
                if e.ref or self._read_locally(e) or (e.pinned and not take_pinned):
                    keep.append((key, e))
                else:
                    self._drop(key, e)
                    self.counters.evictions += 1
            bufs: list[bytearray] = []
            for key, e in list(keep):
                buf = bytearray(e.size)
                try:
                    await self._io(e.size, _pread_all, victim.fd, e.off, buf)
                except OSError as exc:  # unreadable: it cannot move; a miss from now
                    log.error("kv slab %s: block at %d unreadable, dropped: %s",
                              victim.path, e.off, exc)
                    keep.remove((key, e))
                    if self.index.get(key) is e:
                        self._drop(key, e)
                    continue
                bufs.append(buf)
            # the kept records stay readable where they are (the victim's descriptor
            # is held) until their copy lands
            victim.keys.clear()
            self._delete(victim)
            moved = 0
            try:
                for (key, e), buf in zip(keep, bufs, strict=True):
                    if self.index.get(key) is not e:  # removed or put again meanwhile
                        continue
                    slab, off = self._reserve(len(buf))
                    await self._append(slab, off, [memoryview(buf)])
                    if self.index.get(key) is not e:
                        continue
                    e.slab, e.off, e.ref = slab, off, False
                    slab.keys.add(key)
                    if e.slot is not None and e.slot >= 0 and self.published is not None:
                        self.published.move(e.slot, key[0].encode("ascii"), key[1], e.seq,
                                            slab.sid, off, e.vlen)
                    moved += len(buf)
            finally:  # a copy failed (the disk is full): the rest go with the victim
                for key, e in keep:
                    if e.slab is victim and self.index.get(key) is e:
                        self._drop(key, e)
            return victim.size - moved
        finally:
            self._unref(victim)

    async def reclaim(self, nbytes: int) -> int:
        """Give ``nbytes`` of disk back to file data (a file write met ENOSPC): drop the
        oldest slabs, pinned records included; for a while, every put looks at the free
        space afresh. The bytes freed (0: the store held nothing)."""
        freed = 0
        self._pressure_until = time.monotonic() + PRESSURE_HOLD
        async with self._evicting:
            while freed < nbytes and self.slabs:
                victim = next(iter(self.slabs.values()))
                self._seal(victim)
                await self._quiet(victim)
                for key in list(victim.keys):
                    self._drop(key, self.index[key])
                    self.counters.evictions += 1
                freed += victim.size
                self._delete(victim)
        self.counters.reclaimed += freed
        if freed:
            log.warning("kv store: gave %d bytes back to file data (the disk was full)",
                        freed)
        return freed

    # -- operations ----------------------------------------------------------------
    def open_for_reader(self, slab: int) -> list[int]:
        """New descriptors for a local client (short-circuit gets): of the published
        index (read-only) and its reference bytes (read-write), for ``slab`` 0; else
        of a live slab (read-only). ENOENT: gone or not published."""
        if slab == 0:
            if self.published is None:
                raise OSError(errno.ENOENT, "kv: no index published (no local socket)")
            fd = self.published.reader_fd()
            try:
                return [fd, self.published.refs_fd_for_reader()]
            except OSError:
                os.close(fd)
                raise
        s = self.slabs.get(slab)
        if s is None or s.dead or self.published is None:
            raise OSError(errno.ENOENT, f"kv slab {slab} is gone")
        return [os.open(f"/proc/self/fd/{s.fd}", os.O_RDONLY | os.O_CLOEXEC)]

    def check_enabled(self) -> None:
        if not self.enabled:
            raise OSError(errno.EOPNOTSUPP, "this data server keeps no KV blocks "
                                            "(kv_budget 0)")

    async def put(self, ns: str, key: bytes, value: bytes | bytearray | memoryview,
                  crc: int, pin: bool = False) -> int:
        """Store ``value`` under ``(ns, key)`` (replacing an older one): EIO when it
        does not match ``crc``; EFBIG when the record exceeds the whole budget."""
        self.check_enabled()
        view = memoryview(value)
        n = view.nbytes
        got = await self._io(n, _crc, view, inline_max=CRC_INLINE_MAX + 1)
        if got != crc:
            raise OSError(errno.EIO, f"kv_put {ns}/{key.hex()}: the value's CRC32C is "
                                     f"{got:#010x}, not {crc:#010x} as sent: not stored")
        nsb = ns.encode("ascii")
        size = fmt.record_size(nsb, key, n)
        if size > self.budget:
            raise OSError(errno.EFBIG, f"kv_put: a {n}-byte value exceeds this server's "
                                       f"whole KV budget of {self.budget} bytes")
        await self._make_room(size)
        seq = self.seq
        self.seq += 1
        flags = fmt.PINNED if pin else 0
        head = fmt.pack_head(nsb, key, n, seq, crc, flags)
        slab, off = self._reserve(size)
        await self._append(slab, off, [memoryview(head), view])
        k = (ns, key)
        new = Entry(slab, off, len(head), n, crc, seq, pin)
        old = self.index.get(k)
        if old is not None:
            if old.seq > seq:  # a later put of the key landed first
                return n
            # the new record takes the old one's published slot: a local reader never
            # finds the key absent in between
            if old.slot is not None and old.slot >= 0:
                new.slot, old.slot = old.slot, None
            self._drop(k, old)
        self._index(k, new)
        self.counters.puts += 1
        self.counters.bytes_in += n
        return n

    async def get(self, ns: str, key: bytes, maxlen: int) -> Value | None:
        """The value of ``(ns, key)``, checked against its CRC32C; None for a miss
        (absent, or its record failed its checksum: dropped). ERANGE when the value is
        longer than ``maxlen``. The caller releases the value once sent."""
        k = (ns, key)
        e = self.index.get(k)
        found, read = self._take_probe(e)
        if e is None:
            self.counters.misses += 1
            return None
        if e.vlen > maxlen:
            if read is not None:
                self.buffers.give(read)
            raise OSError(errno.ERANGE, f"kv_get {ns}/{key.hex()}: the value is {e.vlen} "
                                        f"bytes, the buffer {maxlen}")
        slab = e.slab
        why = "failed its checksum"
        if read is not None:  # read by the probe (a record never changes once indexed)
            view = memoryview(read)[:e.vlen]
            if _crc(view) == e.crc:
                return self._hit(e, Value(view, e.crc, read, self.buffers))
            self.buffers.give(read)
            self._corrupt(k, e, why)
            return None
        if MAP_MIN <= e.vlen <= NOWAIT_MAX and (
                found or resident(slab.fd, e.off + e.hlen, e.vlen)):
            # in the page cache: checked and sent from the slab's mapping, no copy (a
            # smaller value is read more cheaply than it is mapped: MAP_MIN). No
            # checkpoint: the connection's reader yields between requests (recv_head)
            got = slab.mapped.value(slab.fd, e.off + e.hlen, e.vlen)
            if got is not None:
                view, pinned = got
                if _crc(view) == e.crc:
                    return self._hit(e, Value(view, e.crc, pinned=pinned))
                view.release()
                pinned.release()
                self._corrupt(k, e, why)
                return None
        buf = self.buffers.take(e.vlen)
        view = memoryview(buf)[:e.vlen]
        slab.refs += 1
        try:
            if e.vlen <= NOWAIT_MAX and _pread_cached(slab.fd, e.off + e.hlen, view):
                ok = _crc(view) == e.crc  # all in the page cache: no thread hop
            else:
                ok = await self._io(e.vlen, _pread_checked, slab.fd, e.off + e.hlen, view,
                                    e.crc)
        except OSError as exc:  # a bad sector, a drive gone: a miss, not an error
            ok, why = False, f"unreadable ({exc.strerror})"
        except BaseException:
            self.buffers.give(buf)
            raise
        finally:
            self._unref(slab)
        if not ok:
            self.buffers.give(buf)
            self._corrupt(k, e, why)
            return None
        return self._hit(e, Value(view, e.crc, buf, self.buffers))

    def _hit(self, e: Entry, value: Value) -> Value:
        e.ref = True
        self.counters.hits += 1
        self.counters.bytes_out += e.vlen
        return value

    def _corrupt(self, k: Key, e: Entry, why: str) -> None:
        """A record that failed its checksum or its read: dropped, a miss."""
        self.counters.corrupt += 1
        self.counters.misses += 1
        log.error("kv block %s/%s in slab %s at %d %s; dropped", k[0], k[1].hex(),
                  e.slab.path, e.off, why)
        if self.index.get(k) is e:
            self._drop(k, e)

    def _take_probe(self, e: Entry | None) -> tuple[bool, bytearray | None]:
        """What :meth:`answers_at_once` found just now, taken: whether it probed ``e``,
        and the bytes it read of it (None: none, or a value to map). A probe of another
        entry (its get never came) gives its buffer back to the pool."""
        probed, self._probed = self._probed, None
        if probed is None:
            return False, None
        if probed[0] is e:
            return True, probed[1]
        if probed[1] is not None:
            self.buffers.give(probed[1])
        return False, None

    def answers_at_once(self, ns: object, key: object) -> bool:
        """Whether a get of ``(ns, key)`` (as they came off the wire, unchecked) never
        waits: a miss, a value small enough to read in the event loop, or one in the
        page cache (read from it, or sent from the slab's mapping: MAP_MIN)."""
        self._take_probe(None)  # an earlier probe whose get never came
        if not isinstance(ns, str) or not isinstance(key, bytes):
            return False
        e = self.index.get((ns, key))
        if e is None or e.vlen < INLINE_MAX:
            return True
        if e.vlen < MAP_MIN:
            # read from the page cache alone: the read is the probe (one system call,
            # not two probes and a read), its bytes kept for the get that follows
            buf = self.buffers.take(e.vlen)
            if _pread_cached(e.slab.fd, e.off + e.hlen, memoryview(buf)[:e.vlen]):
                self._probed = (e, buf)
                return True
            self.buffers.give(buf)
            return False
        if e.vlen <= NOWAIT_MAX and resident(e.slab.fd, e.off + e.hlen, e.vlen):
            self._probed = (e, None)  # the get that follows at once need not probe again
            return True
        return False

    def exists(self, ns: str, keys: list[bytes]) -> list[bool]:
        return [(ns, k) in self.index for k in keys]

    async def remove(self, ns: str, keys: list[bytes]) -> int:
        """Forget the keys present (a tombstone each, so that a restart does not bring
        them back); how many were."""
        gone: list[tuple[bytes, Entry]] = []
        for key in dict.fromkeys(keys):
            e = self.index.get((ns, key))
            if e is not None:
                self._drop((ns, key), e)
                gone.append((key, e))
        if not gone:
            return 0
        nsb = ns.encode("ascii")
        heads = []
        for key, _e in gone:
            heads.append(fmt.pack_head(nsb, key, 0, self.seq, 0, fmt.TOMBSTONE))
            self.seq += 1
        blob = b"".join(heads)
        try:
            await self._make_room(len(blob))
        except OSError as exc:  # no room for tombstones: a restart may bring them back
            log.warning("kv remove: tombstones not written: %s", exc)
            return len(gone)
        slab, off = self._reserve(len(blob))
        await self._append(slab, off, [memoryview(blob)])
        return len(gone)

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {"budget": self.budget, "used": self.used, "blocks": len(self.index),
                "hits": c.hits, "misses": c.misses, "evictions": c.evictions,
                "puts": c.puts, "pinned": self.pinned, "corrupt": c.corrupt,
                "bytes_in": c.bytes_in, "bytes_out": c.bytes_out, "live": self.live,
                "reclaimed": c.reclaimed}

    def used_by_dir(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for slab in self.slabs.values():
            out[slab.dir] = out.get(slab.dir, 0) + slab.size
        return out
