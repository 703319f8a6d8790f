"""The node tier's shared-memory arena: one file in the tier's folder, mapped once by
every process of the node (``MAP_SHARED``), laid out as

    [ header: 4 KiB ][ index: buckets of WAYS entries ][ data: a ring of records ]

This module knows the layout: it creates, validates, maps, replaces and resets arenas,
and reads and writes the header's ring state. The cache protocol on top (lookups,
puts, the clock) is :mod:`pfs.kvcache.nodetier`'s.

- The header names the format (magic, version), the file's size and geometry, a
  ``retired`` word (set on an arena that another has replaced: its users map the new
  one), and the ring's state (head, sweep, end, the next sequence number) with a CRC32C
  over it, written with one store under the writers' lock.
- An ``epoch`` word, counted up each time the ring is emptied after damage: a writer
  that reserved room before that does not name what it wrote.
- An index entry is four little-endian u64: the key's hash (0: empty), the record's
  offset in the data area, its sequence number, and the record's length << 8 | a
  reference byte that readers set on a hit (the clock's). A key's entry lies in one of
  two buckets (chosen by two parts of its hash), so the index fills evenly.
- A record, 64-byte aligned: a head (magic, namespace and key lengths, flags, value
  length, value CRC32C, sequence number, hash), the namespace and key, then the value
  from the next 64-byte boundary. Its sequence number is 0 while it is written and once
  it is evicted: readers trust a record only while its number is the index entry's.
  The ``WRITING`` flag marks a record whose writer copies its value outside the
  writers' lock; that writer holds an open-file-description lock on the record's first
  byte until it names the record or gives it up, so the sweep can tell a live writer's
  record (which it must not pass) from one a killed writer left (reclaimed).

An arena is never shrunk or truncated in place (a mapping past a file's end faults):
one of another size or version is built under a temporary name and renamed over it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pfs.core import crcfast

log = logging.getLogger(__name__)

MAGIC = b"PFSKVARN"
VERSION = 2
NAME = "arena"
PAGE = 4096
ALIGN = 64  # records start on a cache line; values too
WAYS = 8  # index entries per bucket
ENTRY = struct.Struct("<QQQQ")  # hash, offset, seq, length << 8 | reference byte
# magic, version, retired, file size, buckets, data offset, data size
HEAD = struct.Struct("<8sIIQQQQ")
RETIRED_AT = 12  # byte offset of the retired word (a u32; read as part of u64 word 1)
STATE_AT = 64
STATE = struct.Struct("<QQQQ")  # head, sweep, end, next sequence number
STATE_CRC = struct.Struct("<I")
EPOCH_Q = 16  # the epoch: u64 word 16 (byte 128, past the state and its CRC)
# magic, namespace length, flags, key length, value length, value crc32c, seq, hash
REC = struct.Struct("<4sBBHIIQQ")
REC_MAGIC = b"PKVR"
REC_FLAGS_AT = 5  # byte offset of a record's flags
REC_SEQ_AT = 16  # byte offset of a record's sequence number
WRITING = 1  # a record's flag: its value is being copied outside the writers' lock
# struct flock (x86-64 and aarch64 Linux): type, whence, start, len, pid
FLOCK = struct.Struct("hh4xqqi4x")
MIN_DATA = 64 << 10
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14
BYTES_PER_ENTRY = 1024  # index entries: one per this many bytes of budget (1 KiB blocks fit)


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def record_length(nsk: int, vlen: int) -> tuple[int, int]:
    """(where the value starts, the whole record's length) for ``nsk`` bytes of
    namespace and key and a ``vlen``-byte value."""
    vstart = align(REC.size + nsk)
    return vstart, vstart + align(vlen)


def geometry(budget: int) -> tuple[int, int, int, int]:
    """(buckets, data offset, data size, file size) of an arena for ``budget`` bytes:
    the file is the budget (at least MIN_DATA of data), index included."""
    entries = max(budget // BYTES_PER_ENTRY, 64 * WAYS)
    buckets = 1 << max(0, (entries // WAYS - 1).bit_length())
    data_off = PAGE + ((buckets * WAYS * ENTRY.size + PAGE - 1) & ~(PAGE - 1))
    data_size = max(MIN_DATA, (budget - data_off) & ~(ALIGN - 1))
    return buckets, data_off, data_size, data_off + data_size


@dataclass
class State:
    """The ring: records lie in [0, head) (the newest) and [sweep, end) (the oldest,
    next to be swept); [head, sweep) and [end, data size) are free."""

    head: int
    sweep: int
    end: int
    seq: int


class Arena:
    """One arena file, mapped. ``q``: the mapping as u64 words, ``mv``: as bytes."""

    def __init__(
        self,
        path: Path,
        fd: int,
        buckets: int,
        data_off: int,
        data_size: int,
        size: int,
    ) -> None:
        self.path = path
        self.fd = fd
        self.pid = os.getpid()
        self.buckets = buckets
        self.mask = buckets - 1
        self.data_off = data_off
        self.data_size = data_size
        self.size = size
        # mapped through an open file of its own (mmap keeps a duplicate of the one it
        # is given): a forked child holds no reference to ``fd``, whose locks are ours
        mfd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            self.mm = mmap.mmap(mfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(mfd)
        self.writing: set[int] = set()  # records this process's writers copy into
        self.closing = False  # closed when the last of them is done
        self.populating = True
        self.populate(0, data_off)
        self.mv = memoryview(self.mm)
        self.q = self.mv.cast("Q")
        self.idx_q = PAGE // 8  # the first index entry, in u64 words

    def populate(self, start: int, n: int) -> None:
        """Map the file's [start, start + n) in this process now (best effort). On a
        tmpfs of 4 KiB pages a first touch by page faults costs about as much as the
        copy: a writer maps what it wrote (pages just written map cheaply), so its own
        later hits take no fault; another process faults a page in once."""
        if not self.populating:
            return
        lo = start & ~(PAGE - 1)
        try:
            self.mm.madvise(MADV_POPULATE_READ, lo, min(self.size, start + n) - lo)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                self.populating = False  # an older kernel: pages fault in as touched

    # -- the header ----------------------------------------------------------------
    @property
    def retired(self) -> bool:
        return bool(self.q[1] >> 32)  # the u32 at byte 12

    def state(self) -> State | None:
        """The ring's state, or None when its CRC does not check out (a writer died
        in the middle of its store, or the file was damaged)."""
        raw = bytes(self.mv[STATE_AT : STATE_AT + STATE.size + STATE_CRC.size])
        (crc,) = STATE_CRC.unpack_from(raw, STATE.size)
        if crcfast.crc32c(raw[: STATE.size]) != crc:
            return None
        st = State(*STATE.unpack_from(raw))
        if not (
            st.head <= st.sweep <= st.end <= self.data_size
            and st.seq > 0
            and st.head % ALIGN == 0
            and st.sweep % ALIGN == 0
        ):
            return None
        return st

    def set_state(self, st: State) -> None:
        raw = STATE.pack(st.head, st.sweep, st.end, st.seq)
        self.mv[STATE_AT : STATE_AT + len(raw) + 4] = raw + STATE_CRC.pack(crcfast.crc32c(raw))

    @property
    def epoch(self) -> int:
        return int(self.q[EPOCH_Q])

    def forget(self) -> None:
        """Forget every block (writers' lock held): records' sequence numbers first,
        so a reader in the middle of a copy sees the change, then the index. The ring
        stays as it is (writers copying into it go on; their records die unnamed)."""
        q, idx = self.q, self.idx_q
        for e in range(self.buckets * WAYS):
            i = idx + 4 * e
            if q[i] and q[i + 2]:
                self.kill_record(q[i + 1], q[i + 2])
        self.mv[PAGE : self.data_off] = bytes(self.data_off - PAGE)

    def reset(self) -> State:
        """Forget every block and empty the ring (writers' lock held; after damage):
        the epoch moves on, so no reservation made before is named."""
        old = self.state()
        self.forget()
        self.q[EPOCH_Q] = self.q[EPOCH_Q] + 1
        st = State(0, self.data_size, self.data_size, old.seq if old else 1)
        self.set_state(st)
        return st

    def kill_record(self, off: int, seq: int) -> None:
        """Zero the sequence number of the record at ``off`` if it is still ``seq``."""
        if off % ALIGN == 0 and off + REC.size <= self.data_size:
            w = (self.data_off + off + REC_SEQ_AT) // 8
            if self.q[w] == seq:
                self.q[w] = 0

    # -- the writers' lock ----------------------------------------------------------
    def lock(self) -> None:
        if self.pid != os.getpid():  # a forked child: its own open file (flock is per file)
            self.reopen_fd()
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def reopen_fd(self) -> None:
        """A new open file of this arena's inode (the parent's stays the parent's: our
        copy is closed, so the parent's locks go when the parent does)."""
        old = self.fd
        self.fd = os.open(f"/proc/self/fd/{old}", os.O_RDWR | os.O_CLOEXEC)
        self.pid = os.getpid()
        os.close(old)
        self.writing = set()  # the parent's: held through its own open file

    # -- a writer's hold on the record it copies outside the lock ------------------
    def _ofd(self, cmd: int, kind: int, off: int) -> int:
        arg = FLOCK.pack(kind, os.SEEK_SET, self.data_off + off, 1, 0)
        return int(FLOCK.unpack(fcntl.fcntl(self.fd, cmd, arg))[0])

    def hold(self, off: int) -> bool:
        """Lock the first byte of the record at ``off`` for this open file; False when
        another holds it (a writer that reserved it before the ring was emptied)."""
        try:
            self._ofd(fcntl.F_OFD_SETLK, fcntl.F_WRLCK, off)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def release(self, off: int) -> None:
        self._ofd(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, off)

    def held_elsewhere(self, off: int) -> bool:
        """Whether another open file (a live writer's) holds the record at ``off``."""
        return self._ofd(fcntl.F_OFD_GETLK, fcntl.F_WRLCK, off) != fcntl.F_UNLCK

    def close(self) -> None:
        if self.writing:
            self.closing = True  # the last writer copying outside the lock closes it
            return
        try:
            os.close(self.fd)
        except OSError:
            pass


def open_arena(root: Path, budget: int, adopt: bool = False) -> Arena:
    """Map the arena in ``root``: the one there if its format and (unless ``adopt``)
    its budget's geometry match, else a new one put in its place."""
    path = root / NAME
    want = geometry(budget)
    for _ in range(16):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            _create(root, path, want, replace=None)
            continue
        try:
            got = _validate(fd)
            if got is not None and (adopt or got == want):
                return Arena(path, fd, *got)
            if got is not None and _retired(fd):
                os.close(fd)  # being replaced: open the new one
                continue
            log.info(
                "node tier %s: %s; making a new arena",
                path,
                "another budget" if got is not None else "no valid arena",
            )
            _create(root, path, want, replace=fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, f"{path}: the node tier's arena keeps changing")


def _validate(fd: int) -> tuple[int, int, int, int] | None:
    """The geometry in the header of the arena open on ``fd``, or None unless the header
    and the file's size agree with a format this code reads."""
    st = os.fstat(fd)
    raw = os.pread(fd, HEAD.size, 0)
    if len(raw) < HEAD.size:
        return None
    magic, version, _retired, size, buckets, data_off, data_size = HEAD.unpack(raw)
    if magic != MAGIC or version != VERSION or size != st.st_size:
        return None
    if (
        buckets <= 0
        or buckets & (buckets - 1)
        or data_off != PAGE + ((buckets * WAYS * ENTRY.size + PAGE - 1) & ~(PAGE - 1))
        or data_size < MIN_DATA
        or data_size % ALIGN
        or data_off + data_size != size
    ):
        return None
    return buckets, data_off, data_size, size


def _retired(fd: int) -> bool:
    return bool(struct.unpack("<I", os.pread(fd, 4, RETIRED_AT))[0])


def _create(root: Path, path: Path, geo: tuple[int, int, int, int], replace: int | None) -> None:
    """Build an arena under a temporary name and link it in: as ``path`` if there is
    none (``replace`` None; a racing creator's wins), else over the arena open on
    ``replace``, which is marked retired under its writers' lock first."""
    buckets, data_off, data_size, size = geo
    tmp = root / f".{NAME}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        # the header and index are stored into through the mapping: their memory now (a
        # store into a hole that a full tmpfs cannot fill would be a SIGBUS); the data
        # area takes memory as it is written (pwrite, which reports ENOSPC instead)
        try:
            os.posix_fallocate(fd, 0, data_off)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"{root}: no room for a node tier arena's index ({data_off} bytes): {exc.strerror}",
            ) from None
        head = HEAD.pack(MAGIC, VERSION, 0, size, buckets, data_off, data_size)
        raw = STATE.pack(0, data_size, data_size, 1)
        os.pwrite(fd, head, 0)
        os.pwrite(fd, raw + STATE_CRC.pack(crcfast.crc32c(raw)), STATE_AT)
        if replace is None:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            return
        fcntl.flock(replace, fcntl.LOCK_EX)
        try:
            if os.path.exists(path) and os.stat(path).st_ino != os.fstat(replace).st_ino:
                return  # someone replaced it already
            if os.fstat(replace).st_size >= HEAD.size:  # (the word's place in every version)
                os.pwrite(replace, struct.pack("<I", 1), RETIRED_AT)
            os.rename(tmp, path)
        finally:
            fcntl.flock(replace, fcntl.LOCK_UN)
    finally:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
