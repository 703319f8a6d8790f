"""The node's shared host-memory tier: KV blocks in one shared-memory arena under a
directory on tmpfs (``/dev/shm``), mapped once by every process of this user on the node.

The tensor-parallel workers of one engine all ask for the same blocks: one copy in
shared memory serves them all, where a per-process dictionary would keep one copy per
worker. The arena (:mod:`pfs.kvcache.arena`: one file of the budget's size, ``MAP_SHARED``)
holds an index (buckets of 8 entries: a hash of (namespace, key), the record's offset,
its sequence number, a reference byte) and a ring of records (a head with the namespace,
key, length, CRC32C of the value and the sequence number, then the value).

A hit is a lookup in the index and one copy from the mapping into the caller's buffer:
no system call. Readers take no lock; each checks, in order, that the record's sequence
number is the index entry's and its hash, namespace and key are the ones asked for,
copies the value, checks its CRC32C on the copy, and reads the sequence number again.
Writers (puts, removals, eviction) serialize on ``flock`` of the arena (and a thread
lock within a process) and zero a record's sequence number before its bytes are reused,
so a reader whose copy raced a writer sees the number change: a miss, never another
key's bytes or a torn block (on x86 stores and loads are not reordered with their own
kind, which is all a seqlock needs; the CRC is the second line). A small put writes the
whole record (its number 0) past the ring's head with ``pwritev`` before the head moves
over it, then sets the number and the index entry: a writer killed at any step leaves a
record no entry names (a miss) and the lock released with its process. A large put
(COPY_OUTSIDE) holds the lock only to reserve its room (the record's head written,
flagged WRITING, held by an OFD lock on its first byte) and, after copying its value
outside the lock, to name it: writers copy in parallel. The sweep waits for a record a
live writer holds and passes one whose writer died (the kernel dropped its lock).

The ring is bounded by the budget; room is made by sweeping from its oldest end, clock
fashion: a record read since the sweep last passed (its reference byte set by a reader)
is moved to the head once, the others are dropped. A put is therefore never refused for
want of room (only a block larger than the arena, or a tmpfs out of memory). The
directory is private to its user (mode 0700, the arena 0600): blocks never leave the
cluster's credentials by way of this tier.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pfs.core import crcfast
from pfs.kvcache.arena import (
    ALIGN,
    ENTRY,
    PAGE,
    REC,
    REC_FLAGS_AT,
    REC_MAGIC,
    REC_SEQ_AT,
    WAYS,
    WRITING,
    Arena,
    State,
    open_arena,
    record_length,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

NAMES_KEPT = 1 << 14  # (namespace, key) -> hash a process remembers (~0.7 us each)
LOW_WATER = 0.9  # trim(force=True) frees the oldest tenth of the ring
# records this large are copied outside the writers' lock: below, the second trip
# through the lock costs more than the copy it takes out (256 KiB, 16 processes on 2
# cores: put p50 +40 us, CPU +30 us; 2 MiB: p50 1.8 ms against 8-10 ms)
COPY_OUTSIDE = 512 << 10
RESERVE_WAIT = 2.0  # seconds a put waits for other writers' copies to leave its way
_PAD = bytes(ALIGN)


def default_dir() -> Path:
    """``/dev/shm/pfs-kv-UID`` (memory), or a folder under the temp dir without tmpfs."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"pfs-kv-{os.getuid()}"


@dataclass
class TierUsage:
    """What a scan found: bytes and blocks held, and what the trim removed."""

    bytes: int = 0
    blocks: int = 0
    evicted: int = 0
    evicted_bytes: int = 0


class NodeTier:
    """Blocks in the shared arena under ``root``, at most ``budget`` bytes (the arena's
    file, index included). ``adopt``: use the arena there whatever its budget (a
    different one is otherwise replaced by one of this budget)."""

    def __init__(
        self, root: str | os.PathLike[str] | None, budget: int, *, adopt: bool = False
    ) -> None:
        if budget <= 0:
            raise ValueError("a node tier needs a budget above 0 bytes")
        self.root = Path(root) if root is not None else default_dir()
        self.budget = budget
        self._names: dict[tuple[str, bytes], tuple[int, bytes]] = {}
        self._lock = threading.Lock()  # this process's writers (flock is per open file)
        self.hits = self.misses = self.puts = self.evictions = self.corrupt = 0
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.root.stat()
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise OSError(
                errno.EACCES,
                f"{self.root}: the node tier's folder must be this user's own, mode 0700",
            )
        self._arena = open_arena(self.root, budget, adopt)
        _drop_file_blocks(self.root)

    def close(self) -> None:
        with self._lock:
            self._arena.close()

    # -- names ------------------------------------------------------------------
    def _name(self, ns: str, key: bytes) -> tuple[int, bytes]:
        got = self._names.get((ns, key))
        if got is None:
            nsk = ns.encode() + key
            h = (
                int.from_bytes(
                    hashlib.blake2b(ns.encode() + b"\0" + key, digest_size=8).digest(), "little"
                )
                or 1
            )
            got = (h, nsk)
            if len(self._names) >= NAMES_KEPT:
                self._names.clear()  # (from any thread: each step is one atomic dict op)
            self._names[ns, key] = got
        return got

    def _mapped(self) -> Arena:
        """The arena, mapped again if another process replaced it (another budget)."""
        a = self._arena
        if a.retired:
            with self._lock:
                a = self._swap()
        return a

    def _swap(self) -> Arena:
        a = self._arena
        if a.retired:
            log.info("node tier %s: the arena was replaced; mapping the new one", self.root)
            self._arena = open_arena(self.root, self.budget, adopt=True)
            a.close()  # (writers hold self._lock: none is using its descriptor)
        return self._arena

    @staticmethod
    def _find(a: Arena, h: int) -> int | None:
        """The u64 index of ``h``'s entry in the mapping (in either of its buckets), or
        None."""
        q = a.q
        i = a.idx_q + (h & a.mask) * (WAYS * 4)
        for _ in range(WAYS):
            if q[i] == h:
                return i
            i += 4
        i = a.idx_q + _other_bucket(a, h) * (WAYS * 4)
        for _ in range(WAYS):
            if q[i] == h:
                return i
            i += 4
        return None

    def _record(self, a: Arena, h: int, nsk: bytes) -> tuple[int, int, int, int, int] | None:
        """(entry, offset, seq, value length, value crc) of the key's record as its
        index entry and head say now, or None."""
        i = self._find(a, h)
        if i is None:
            return None
        q = a.q
        off, seq, reclen = q[i + 1], q[i + 2], q[i + 3] >> 8
        if not seq or off % ALIGN or reclen < REC.size or off + reclen > a.data_size:
            return None
        p = a.data_off + off
        magic, nslen, _fl, keylen, vlen, crc, rseq, rh = REC.unpack_from(a.mv, p)
        if (
            rseq != seq
            or rh != h
            or magic != REC_MAGIC
            or nslen + keylen != len(nsk)
            or record_length(len(nsk), vlen)[1] != reclen
            or a.mv[p + REC.size : p + REC.size + len(nsk)] != nsk
        ):
            return None  # being rewritten, another key with this hash, or damage
        return i, off, seq, vlen, crc

    # -- blocks -----------------------------------------------------------------
    def get_into(self, ns: str, key: bytes, out: memoryview) -> int | None:
        """Copy the block into ``out``; its length, or None (a miss: absent, or what
        was there did not check out). A block longer than ``out``: ERANGE."""
        a = self._mapped()
        h, nsk = self._name(ns, key)
        found = self._record(a, h, nsk)
        if found is None:
            self.misses += 1
            return None
        i, off, seq, n, crc = found
        p = a.data_off + off
        seq_at = (p + REC_SEQ_AT) >> 3
        if n > len(out):
            if a.q[seq_at] != seq:
                self.misses += 1
                return None
            raise OSError(errno.ERANGE, f"KV block is {n} bytes, the buffer holds {len(out)}")
        vstart = p + record_length(len(nsk), n)[0]
        # the copy and its CRC in one pass (the CRC is of exactly the bytes copied)
        good = crcfast.crc32c_copy(out, a.mv[vstart : vstart + n]) == crc
        if a.q[seq_at] != seq:  # a writer took the record meanwhile: what we copied may mix
            self.misses += 1
            return None
        if not good:
            self._damaged(a, off, seq)
            self.misses += 1
            return None
        ref = (i + 3) << 3
        if not a.mv[ref]:
            a.mv[ref] = 1  # recently used: the clock's reference byte
        self.hits += 1
        return n

    def _damaged(self, a: Arena, off: int, seq: int) -> None:
        self.corrupt += 1
        log.warning("node tier %s: the block at %d failed its CRC; dropped", a.path, off)
        with self._lock:
            a.lock()
            try:
                a.kill_record(off, seq)
            finally:
                a.unlock()

    def exists(self, ns: str, key: bytes) -> bool:
        h, nsk = self._name(ns, key)
        return self._record(self._mapped(), h, nsk) is not None

    def put(self, ns: str, key: bytes, value: memoryview, crc: int | None = None) -> bool:
        """Store a block (``crc``: crc32c of ``value`` when the caller has it). False
        when it cannot be held (larger than the arena, or tmpfs out of memory)."""
        value = memoryview(value).cast("B")
        if crc is None:
            crc = crcfast.crc32c(value)
        h, nsk = self._name(ns, key)
        vstart, reclen = record_length(len(nsk), len(value))
        tail = _PAD[: reclen - vstart - len(value)]
        if reclen < COPY_OUTSIDE:
            head = REC.pack(REC_MAGIC, len(ns.encode()), 0, len(key), len(value), crc, 0, h)
            parts: list[bytes | memoryview] = [head, nsk, _PAD[: vstart - REC.size - len(nsk)]]
            parts += [value, tail]
            ok = self._put_whole(h, parts, reclen)
        else:
            head = REC.pack(REC_MAGIC, len(ns.encode()), WRITING, len(key), len(value), crc, 0, h)
            ok = self._put_parallel(h, head + nsk, vstart, [value, tail], reclen)
        if ok:
            self.puts += 1
        return ok

    def _put_whole(self, h: int, parts: list[bytes | memoryview], reclen: int) -> bool:
        """A small block: the whole record written and named in one hold of the lock
        (its copy costs less than the extra steps of copying outside)."""

        def write(a: Arena, st: State) -> bool:
            try:
                _pwrite_all(a.fd, parts, a.data_off + st.head)
            except OSError as exc:
                _tmpfs_full(a, exc)
                return False
            off, seq = st.head, st.seq
            a.populate(a.data_off + off, reclen)  # this process's own hits: no fault
            st.head += reclen
            st.seq += 1
            a.set_state(st)  # the record is in the ring (unnamed until published)
            self._publish(a, h, off, seq, reclen)
            return True

        return self._at_head(reclen, write) or False

    def _put_parallel(
        self, h: int, head: bytes, vstart: int, value: list[bytes | memoryview], reclen: int
    ) -> bool:
        """A large block: room reserved under the lock, the value copied outside it
        (other writers reserve, copy and publish meanwhile), the record named under the
        lock again."""
        got = self._at_head(reclen, lambda a, st: self._reserve(a, st, head, reclen))
        if got is None:
            return False
        a, off, epoch, seq = got
        named = False
        try:
            _pwrite_all(a.fd, value, a.data_off + off + vstart)
            a.populate(a.data_off + off, reclen)  # this process's own hits: no fault
        except OSError as exc:
            self._end_reservation(a, off, epoch)
            _tmpfs_full(a, exc)
            return False
        except BaseException:
            self._end_reservation(a, off, epoch)
            raise

        def name() -> None:
            nonlocal named
            if a.epoch == epoch:  # (else the ring was emptied meanwhile)
                self._publish(a, h, off, seq, reclen)
                named = True

        self._end_reservation(a, off, epoch, name)
        return named

    def _at_head(self, reclen: int, then: Callable[[Arena, State], _T]) -> _T | None:
        """``then(arena, state)`` under the writers' lock once ``reclen`` bytes lie free
        at the ring's head; None when they cannot (larger than the arena, or a live
        writer's copy in the sweep's way for RESERVE_WAIT: a ring smaller than the
        copies in flight)."""
        pause, deadline = 0.0002, time.monotonic() + RESERVE_WAIT
        while True:
            with self._lock:
                a = self._locked()
                try:
                    if reclen > a.data_size:
                        log.debug("node tier: a %d-byte block is larger than the arena", reclen)
                        return None
                    try:
                        st = self._room(a, self._state(a), reclen)
                    except _Busy:
                        pass
                    else:
                        return then(a, st)
                finally:
                    a.unlock()
            if time.monotonic() > deadline:
                log.info("node tier %s: a writer's copy held the ring too long", a.path)
                return None
            time.sleep(pause)  # (the writer in the way names its record meanwhile)
            pause = min(pause * 2, 0.005)

    def _reserve(
        self, a: Arena, st: State, head: bytes, reclen: int
    ) -> tuple[Arena, int, int, int] | None:
        """(arena, offset, epoch, sequence number) of ``reclen`` bytes at the ring's head
        reserved for this writer (writers' lock held): held (an OFD lock on its first
        byte, which the kernel drops with this process), the record's head written
        (flagged WRITING, its number 0), then the ring's head moved past it, the number
        it will be named with taken; None when it cannot be had."""
        off = st.head
        if not a.hold(off):
            return None  # a writer from before the ring was emptied still copies here
        try:
            os.pwrite(a.fd, head, a.data_off + off)
        except OSError as exc:
            a.release(off)
            _tmpfs_full(a, exc)
            return None
        seq = st.seq
        st.head += reclen
        st.seq += 1
        a.set_state(st)  # in the ring, flagged, held: the sweep waits for it
        a.writing.add(off)
        return a, off, a.epoch, seq

    def _end_reservation(
        self, a: Arena, off: int, epoch: int, name: Callable[[], None] | None = None
    ) -> None:
        """Under the writers' lock: ``name`` the record (publish it), or leave it dead
        (unnamed: the sweep passes it); either way no longer ours to write."""
        with self._lock:
            a.lock()
            try:
                if name is not None:
                    name()
                if a.epoch == epoch:  # (else the place may be another writer's now)
                    a.mv[a.data_off + off + REC_FLAGS_AT] = 0
                a.writing.discard(off)
                a.release(off)
            finally:
                a.unlock()
            if a.closing and not a.writing:
                a.close()

    def _locked(self) -> Arena:
        """The current arena with its writers' lock held (self._lock held)."""
        while True:
            a = self._swap()
            a.lock()
            if not a.retired:
                return a
            a.unlock()

    def _state(self, a: Arena) -> State:
        st = a.state()
        if st is None:
            self.corrupt += 1
            log.warning("node tier %s: the ring's state is damaged; emptying it", a.path)
            st = a.reset()
        return st

    def _publish(self, a: Arena, h: int, off: int, seq: int, reclen: int) -> None:
        """Name the record at ``off``: its sequence number, then the index entry (the
        key's old record, or the bucket's least useful entry, is dropped)."""
        q = a.q
        q[(a.data_off + off + REC_SEQ_AT) >> 3] = seq
        ways = [a.idx_q + (h & a.mask) * (WAYS * 4), a.idx_q + _other_bucket(a, h) * (WAYS * 4)]
        i = empty = None
        for base in ways:
            for j in range(base, base + WAYS * 4, 4):
                if q[j] == h:
                    i = j
                    break
                if empty is None and not q[j]:
                    empty = j  # the first empty way of the two buckets (the first's first)
            if i is not None:
                break
        if i is None:
            i = empty
        if i is None:  # both buckets full: their oldest unreferenced entry (then oldest)
            self.evictions += 1
            i = min(
                (j for b in ways for j in range(b, b + WAYS * 4, 4)),
                key=lambda j: (q[j + 3] & 0xFF, q[j + 2]),
            )
        if q[i] and q[i + 2]:
            a.kill_record(q[i + 1], q[i + 2])
        q[i + 2] = 0
        q[i] = h
        q[i + 1] = off
        q[i + 3] = reclen << 8
        q[i + 2] = seq

    def _room(self, a: Arena, st: State, n: int) -> State:
        """Sweep the ring until ``n`` bytes lie free at its head (writers' lock held):
        a record read since the sweep last passed moves to the head (once per lap), the
        rest are dropped. The state is stored before any byte it frees is reused."""
        q = a.q
        moved = 0
        while st.sweep - st.head < n:
            if st.sweep >= st.end:
                if a.data_size - st.head >= n:  # the tail past the ring's end is free
                    st.sweep = st.end = a.data_size
                else:  # wrap: the oldest records are at the start
                    st.end, st.head, st.sweep = st.head, 0, 0
                a.set_state(st)
                continue
            off = st.sweep
            p = a.data_off + off
            magic, nslen, flags, keylen, vlen, _crc, seq, h = REC.unpack_from(a.mv, p)
            reclen = record_length(nslen + keylen, vlen)[1]
            if magic != REC_MAGIC or off + reclen > st.end:
                self.corrupt += 1
                log.warning("node tier %s: a damaged record in the ring; emptying it", a.path)
                st = a.reset()
                continue
            if flags & WRITING and (off in a.writing or a.held_elsewhere(off)):
                a.set_state(st)
                raise _Busy(off)  # a live writer's copy: wait for it
            i = self._find(a, h) if seq else None
            if i is not None and (q[i + 1] != off or q[i + 2] != seq):
                i = None  # a dead record: its key was put again, removed or evicted
            if i is not None and q[i + 3] & 0xFF and moved + reclen <= a.data_size:
                rec = bytearray(a.mv[p : p + reclen])  # referenced: a second chance
                rec[REC_SEQ_AT : REC_SEQ_AT + 8] = bytes(8)  # written unnamed, as a put's
                a.kill_record(off, seq)
                st.sweep += reclen
                dest, new = st.head, st.seq
                a.set_state(st)
                _pwrite_all(a.fd, [rec], a.data_off + dest)
                a.populate(a.data_off + dest, reclen)
                st.head += reclen
                st.seq += 1
                a.set_state(st)
                q[(a.data_off + dest + REC_SEQ_AT) >> 3] = new
                q[i + 3] = reclen << 8
                q[i + 1] = dest
                q[i + 2] = new
                moved += reclen
                continue
            if i is not None:
                a.kill_record(off, seq)
                q[i + 2] = 0
                q[i] = 0
                self.evictions += 1
            st.sweep += reclen
        a.set_state(st)
        return st

    def remove(self, ns: str, keys: Iterable[bytes]) -> int:
        n = 0
        with self._lock:
            a = self._locked()
            try:
                for key in keys:
                    h, nsk = self._name(ns, key)
                    found = self._record(a, h, nsk)
                    if found is not None:
                        i, off, seq = found[:3]
                        a.kill_record(off, seq)
                        a.q[i + 2] = 0
                        a.q[i] = 0
                        n += 1
            finally:
                a.unlock()
        return n

    # -- the budget ---------------------------------------------------------------
    def usage(self) -> TierUsage:
        """Bytes (records, heads included) and blocks held now (a scan of the index)."""
        a = self._mapped()
        u = TierUsage()
        q = a.q
        for h, off, seq, lr in ENTRY.iter_unpack(a.mv[PAGE : a.data_off]):
            if (
                h
                and seq
                and off % ALIGN == 0
                and off + REC.size <= a.data_size
                and q[(a.data_off + off + REC_SEQ_AT) >> 3] == seq
            ):
                u.bytes += lr >> 8
                u.blocks += 1
        return u

    def trim(self, force: bool = False) -> TierUsage:
        """The arena never holds more than its budget: without ``force`` this only
        reports. ``force``: sweep the oldest tenth of the ring free (referenced blocks
        get their second chance)."""
        if force:
            before = self.evictions
            with self._lock:
                a = self._locked()
                try:
                    want = int(a.data_size * (1 - LOW_WATER)) & ~(ALIGN - 1)
                    try:
                        self._room(a, self._state(a), want)
                    except _Busy:
                        pass  # freed up to a writer's copy in progress
                finally:
                    a.unlock()
            u = self.usage()
            u.evicted = self.evictions - before
            return u
        return self.usage()

    def clear(self) -> None:
        """Remove every block (tests, ``pfs admin kv --clear-node``)."""
        with self._lock:
            a = self._locked()
            try:
                a.forget()
            finally:
                a.unlock()


def tmpfs_page_mode(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The ``huge=`` option of the tmpfs holding ``path`` ("never" when unset), or None
    when ``path`` is not on tmpfs (or the mount table cannot be read). ``mountinfo``:
    the text of ``/proc/self/mountinfo`` (read when not given)."""
    real = os.path.realpath(path)
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    best: tuple[int, str, str] | None = None
    for line in mountinfo.splitlines():
        pre, _sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mnt = fields[4].replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and (best is None or len(mnt) >= best[0]):
            best = (len(mnt), tail[0], tail[2])
    if best is None or best[1] != "tmpfs":
        return None
    for opt in best[2].split(","):
        if opt.startswith("huge="):
            return opt[len("huge=") :]
    return "never"


def _drop_file_blocks(root: Path) -> None:
    """Remove the blocks of the layout before the arena (a file per block in folders
    ``00``..``ff``), which nothing reads any more. The folders stay: a process of the
    old code still running puts into them (and bounds them itself)."""
    if not (root / "00").is_dir():
        return
    n = 0
    for i in range(256):
        try:
            entries = list(os.scandir(root / f"{i:02x}"))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            try:
                os.unlink(e.path)
                n += 1
            except (FileNotFoundError, IsADirectoryError):
                pass
    if n:
        log.info("node tier %s: removed %d blocks of the file-per-block layout", root, n)


def _other_bucket(a: Arena, h: int) -> int:
    """A key's second bucket: from the hash's high half (never the first one)."""
    b = (h >> 32) & a.mask
    return b if b != h & a.mask else b ^ 1


class _Busy(Exception):
    """The sweep met a record a live writer is still copying into."""


def _tmpfs_full(a: Arena, exc: OSError) -> None:
    """A write to the arena failed: tmpfs out of memory is a block not kept; else raise."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
        raise exc
    log.warning("node tier %s: tmpfs is full; block not kept", a.path)


def _pwrite_all(fd: int, parts: Sequence[bytes | bytearray | memoryview], off: int) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views, off)
        off += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
