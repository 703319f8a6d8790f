"""Block checksums of stripe objects: a sidecar file beside each object.

An object is cut into blocks of ``BLOCK`` bytes. Its sidecar ``<object>.crc`` holds one
record of ``RECORD`` bytes per block: the CRC32C of the block's bytes *zero-padded to a
full block*, and ``end``, how far into the block data was ever written (1..BLOCK); a
record of zeros (``end`` 0, also what a sparse or short sidecar reads as) is a block
never written, a *hole*. So:

- a hole reads as zeros because the map says so, whatever the object file holds there;
- a written block whose data the object file no longer reaches (``start + end`` past
  the object's size) is a *short* object: an error, never zeros;
- extending an object never changes an earlier block's checksum (the zero padding is
  what a file reads past its end), and truncating one rehashes only the new last block.

Why 64 KiB: a read smaller than a block still reads (and hashes) the whole block to
verify it, so the block must be small next to a typical read, and big enough that one
record per block and one hash call per block cost nothing next to the data (CRC32C of
64 KiB with SSE4.2 is ~3 µs here, ~20 GB/s; the sidecar is 1/8192 of the data). It is
MooseFS's choice too. IO500's 47,008-byte writes straddle at most two blocks, each
merged under its block's lock (:class:`RangeLocks`).

Objects without a sidecar (written before data directory format 2) are *unchecked*:
read as before, reported by ``verify`` as such, given one by ``pfs admin migrate --data``
(:func:`compute`).
"""
from __future__ import annotations

import errno
import os
import struct
from typing import Any

from pfs.core import crcfast

BLOCK = 64 << 10
RECORD = 8
SUFFIX = ".crc"
_REC = struct.Struct("<II")  # crc32c, end (0: never written)
_ZEROS = bytes(BLOCK)


def crc_padded(data: memoryview | bytes, crc: int = 0) -> int:
    """CRC32C of ``data`` zero-padded to a full block."""
    crc = crcfast.crc32c(data, crc)
    pad = BLOCK - len(data)
    return crcfast.crc32c(_ZEROS[:pad], crc) if pad > 0 else crc


HOLE_CRC = crc_padded(b"")


def blocks(off: int, length: int) -> range:
    """The blocks covering ``[off, off+length)`` (empty for length 0)."""
    if length <= 0:
        return range(0)
    return range(off // BLOCK, (off + length - 1) // BLOCK + 1)


def read_records(cfd: int, first: int, count: int) -> list[tuple[int, int]]:
    """Records of blocks ``first .. first+count-1``; past the sidecar's end: holes."""
    raw = os.pread(cfd, count * RECORD, first * RECORD)
    raw += bytes(count * RECORD - len(raw))
    return [_REC.unpack_from(raw, i * RECORD) for i in range(count)]


def write_records(cfd: int, first: int, recs: list[tuple[int, int]]) -> None:
    buf = bytearray(len(recs) * RECORD)
    for i, (crc, end) in enumerate(recs):
        _REC.pack_into(buf, i * RECORD, crc, end)
    os.pwrite(cfd, buf, first * RECORD)


def read_block(fd: int, blk: int) -> bytes:
    """Block ``blk`` of the object as the file holds it (short at its end)."""
    return os.pread(fd, BLOCK, blk * BLOCK)


class ChecksumError(OSError):
    """A block that does not match its checksum, or that the object is too short for."""

    def __init__(self, obj: tuple[int, int], off: int, what: str) -> None:
        super().__init__(errno.EIO, f"object [{obj[0]}, {obj[1]}] (inode {obj[0]}, stripe "
                                    f"{obj[1]}) at offset {off}: {what}")
        self.obj = obj
        self.off = off


def check_map(obj: tuple[int, int], blk: int, rec: tuple[int, int], size: int) -> bool:
    """What the block map alone says of block ``blk``: False for a hole, ChecksumError
    for a short object, True for data to verify."""
    end = rec[1]
    if end == 0:
        return False
    start = blk * BLOCK
    if start + end > size:
        raise ChecksumError(obj, start, f"short object: the block map says data was "
                                        f"written up to {start + end}, the object ends at "
                                        f"{size}")
    return True


def check(obj: tuple[int, int], blk: int, data: memoryview | bytes, rec: tuple[int, int],
          size: int) -> bool:
    """Raise ChecksumError when block ``blk`` (``data``: its bytes the file holds, short
    at the object's end) does not match ``rec``; False for a hole (read it as zeros)."""
    if not check_map(obj, blk, rec, size):
        return False
    if crc_padded(data) != rec[0]:
        raise ChecksumError(obj, blk * BLOCK, "checksum mismatch")
    return True


def n_blocks(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK




def read_verified(obj: tuple[int, int], fd: int, cfd: int, off: int,
                  dests: list[memoryview]) -> list[int]:
    """Read consecutive object bytes at ``off`` into ``dests`` from ``fd`` verified
    against sidecar ``cfd`` (a short-circuit read, in the calling thread): whole blocks
    straight into ``dests`` with one ``preadv``, verified in place; partial edge blocks
    through a scratch buffer. Returns the bytes there were for each destination;
    ChecksumError (EIO) on a mismatch or a short object."""
    if len(dests) == 1:
        n = len(dests[0])
        if n and off // BLOCK == (off + n - 1) // BLOCK:  # the latency path: one block
            return [_read_in_block(obj, fd, cfd, off, dests[0])]
    vr = VerifiedRead(obj, fd, cfd, off, dests)
    if vr.direct:
        vr.got = os.preadv(fd, vr.direct, vr.direct_off)
    return vr.finish()


def _read_in_block(obj: tuple[int, int], fd: int, cfd: int, off: int,
                   dest: memoryview) -> int:
    """:func:`read_verified` of a read inside one block (the sync client's small
    reads): the block through a scratch buffer, checked, the asked part copied out."""
    blk = off // BLOCK
    ws = blk * BLOCK
    raw = os.pread(cfd, RECORD, blk * RECORD)
    rec = _REC.unpack(raw) if len(raw) == RECORD else (0, 0)
    data = os.pread(fd, BLOCK, ws)
    size = ws + len(data)  # the object's end, or past what this read needs
    if not check(obj, blk, data, rec, size):
        data = _ZEROS[:len(data)]  # a hole: zeros, whatever the file holds
    k = max(0, min(len(dest), size - off))
    dest[:k] = data[off - ws:off - ws + k]
    return k


def slice_views(dests: list[memoryview], lo: int, hi: int) -> list[memoryview]:
    """The parts of ``dests`` (consecutive) holding bytes ``[lo, hi)`` of them."""
    out, base = [], 0
    for d in dests:
        end = base + len(d)
        if end > lo and base < hi:
            out.append(d[max(lo, base) - base:min(hi, end) - base])
        base = end
    return out


class VerifiedRead:
    """One verified short-circuit read, split for its driver: ``direct`` (the views of
    the caller's destinations holding the whole blocks, consecutive object bytes from
    ``direct_off``) is read by the caller, which sets ``got``; :meth:`finish` then reads
    the partial edge blocks through a scratch buffer and verifies everything. A read
    inside one block (the small reads) has no ``direct`` part: all of it is scratch."""

    __slots__ = ("obj", "fd", "cfd", "off", "dests", "total", "size", "bl", "mid",
                 "direct", "direct_off", "got", "recs", "checked")

    def __init__(self, obj: tuple[int, int], fd: int, cfd: int, off: int,
                 dests: list[memoryview]) -> None:
        self.obj, self.fd, self.cfd, self.off = obj, fd, cfd, off
        self.dests = dests
        self.total = total = len(dests[0]) if len(dests) == 1 else sum(len(d) for d in dests)
        self.size = size = os.fstat(fd).st_size
        self.bl = blocks(off, total)
        # the whole blocks both asked for and inside the object: read in place
        self.mid = mid = whole_blocks(off, max(0, min(total, size - off)))
        self.direct_off = mid.start * BLOCK
        self.direct: list[memoryview] = []
        if len(mid) > 0:
            self.direct = slice_views(dests, self.direct_off - off, mid.stop * BLOCK - off)
        self.got = 0
        self.recs: list[tuple[int, int]] | None = None  # of ``bl``, read once
        self.checked = 0  # the leading ``mid`` blocks verified already (verify_mid)

    def records(self) -> list[tuple[int, int]]:
        if self.recs is None:
            self.recs = read_records(self.cfd, self.bl.start, len(self.bl))
        return self.recs

    def verify_mid(self, lo: int, hi: int) -> None:
        """Verify ``mid`` blocks ``lo .. hi-1`` (indexes into ``mid``) in place, once
        their bytes are in ``direct``: a driver that reads ``direct`` in steps verifies
        one step while the next is read (:meth:`finish` verifies what is left)."""
        recs = self.records()
        first = self.mid.start - self.bl.start
        self._verify_in_place(range(self.mid.start + lo, self.mid.start + hi),
                              recs[first + lo:first + hi],
                              slice_views(self.direct, lo * BLOCK, hi * BLOCK))
        self.checked = max(self.checked, hi)

    def finish(self) -> list[int]:
        obj, off, total, bl, mid = self.obj, self.off, self.total, self.bl, self.mid
        dests = self.dests
        if not bl:
            return [0] * len(dests)
        recs = self.records()
        size = self.size
        if not mid:
            size = self._scratch(bl, recs, off, dests, size)
        else:
            want = len(mid) * BLOCK
            if self.got < want:  # the object shrank under us: the network path decides
                raise ChecksumError(obj, self.direct_off + self.got,
                                    "short object: it shrank while being read")
            first = bl.start
            if mid.start > first:
                size = self._scratch(range(first, mid.start), recs[:mid.start - first],
                                     off, slice_views(dests, 0, mid.start * BLOCK - off), size)
            if bl.stop > mid.stop:
                lo = mid.stop * BLOCK
                size = self._scratch(range(mid.stop, bl.stop), recs[mid.stop - first:],
                                     lo, slice_views(dests, lo - off, total), size)
            lo = mid.start + self.checked
            self._verify_in_place(range(lo, mid.stop), recs[lo - first:mid.stop - first],
                                  slice_views(self.direct, self.checked * BLOCK, len(mid) * BLOCK))
        left = max(0, min(total, size - off))
        counts = []
        for d in dests:
            k = min(len(d), left)
            left -= k
            counts.append(k)
        return counts

    def _verify_in_place(self, bl: range, recs: list[tuple[int, int]],
                         views: list[memoryview]) -> None:
        """Verify blocks ``bl`` held, in order, by ``views``."""
        if all(len(v) % BLOCK == 0 for v in views):
            self._verify_whole(bl, recs, views)
            return
        vi, base = 0, 0  # the view holding ``at``, its place
        at = 0
        for blk, rec in zip(bl, recs, strict=True):
            parts = []
            need = BLOCK
            while need:
                while at >= base + len(views[vi]):
                    base += len(views[vi])
                    vi += 1
                v = views[vi]
                k = min(need, base + len(v) - at)
                parts.append(v[at - base:at - base + k])
                at += k
                need -= k
            if not check_map(self.obj, blk, rec, self.size):
                for p in parts:  # a hole: zeros, whatever the file holds
                    p[:] = _ZEROS[:len(p)]
                continue
            crc = 0
            for p in parts:
                crc = crcfast.crc32c(p, crc)
            if crc != rec[0]:
                for p in parts:  # the bad bytes never stay in the caller's buffer
                    p[:] = _ZEROS[:len(p)]
                raise ChecksumError(self.obj, blk * BLOCK, "checksum mismatch")

    def _verify_whole(self, bl: range, recs: list[tuple[int, int]],
                      views: list[memoryview]) -> None:
        """:meth:`_verify_in_place` where no block straddles two views (the bulk
        reads' pieces are whole stripe units): a slice per block, and a block fully
        written inside the object (almost all) is one CRC and one comparison."""
        size, obj = self.size, self.obj
        pairs = zip(bl, recs, strict=True)
        for v in views:
            for at in range(0, len(v), BLOCK):
                blk, (crc, end) = next(pairs)
                part = v[at:at + BLOCK]
                if end == BLOCK and (blk + 1) * BLOCK <= size:
                    if crcfast.crc32c(part) == crc:
                        continue
                elif not check_map(obj, blk, (crc, end), size):
                    part[:] = _ZEROS  # a hole: zeros, whatever the file holds
                    continue
                elif crcfast.crc32c(part) == crc:
                    continue
                part[:] = _ZEROS  # the bad bytes never stay in the caller's buffer
                raise ChecksumError(obj, blk * BLOCK, "checksum mismatch")

    def _scratch(self, bl: range, recs: list[tuple[int, int]], off: int,
                 dests: list[memoryview], size: int) -> int:
        """Read blocks ``bl`` into a scratch buffer, check them, copy the bytes at
        ``off`` (up to the object's end) into ``dests``; the object's size as read."""
        ws = bl.start * BLOCK
        scratch = bytearray(max(0, min(bl.stop * BLOCK, size) - ws))
        got = os.preadv(self.fd, [scratch], ws) if scratch else 0
        size = min(size, ws + got) if got < len(scratch) else size
        view = memoryview(scratch)[:got]
        for blk, rec in zip(bl, recs, strict=True):
            lo = blk * BLOCK - ws
            part = view[lo:max(lo, min(lo + BLOCK, got))]
            if not check(self.obj, blk, part, rec, size) and part:
                part[:] = bytes(len(part))  # a hole: zeros, whatever the file holds
        total = sum(len(d) for d in dests)
        left = max(0, min(total, size - off))
        pos = off - ws
        for d in dests:
            k = min(len(d), left)
            d[:k] = view[pos:pos + k]
            pos += k
            left -= k
        return size


def whole_blocks(off: int, n: int) -> range:
    """The blocks lying wholly inside ``[off, off+n)``: those a network reply carries
    checksums for (the server verifies the partial ones at its edges itself)."""
    return range(-(-off // BLOCK), (off + n) // BLOCK)


def verify_reply(obj: tuple[int, int], off: int, n: int, into: Any,
                 crcs: list[int], part: range | None = None) -> None:
    """Check the whole blocks of a read reply of ``n`` bytes at ``off`` (received into
    ``into``: a buffer or a list of buffers filled in order) against ``crcs``;
    ChecksumError (EIO) on a mismatch. ``part``: only these indexes into ``crcs`` (the
    whole blocks in order), so a large reply can be checked in pieces on threads."""
    bl = whole_blocks(off, n)
    if len(crcs) != len(bl):
        raise ChecksumError(obj, off, f"the reply carries {len(crcs)} checksums for "
                                      f"{len(bl)} blocks")
    idx = range(len(crcs)) if part is None else part
    if not idx:
        return
    views = into if isinstance(into, list) else [into]
    pos = (bl.start + idx.start) * BLOCK - off  # the first block's place in the reply
    if len(views) == 1:  # one buffer: a slice per block, no walk over views
        v = views[0]
        for i in idx:
            if crcfast.crc32c(v[pos:pos + BLOCK]) != crcs[i]:
                raise ChecksumError(obj, (bl.start + i) * BLOCK,
                                    "checksum mismatch in the bytes received")
            pos += BLOCK
        return
    vi, base = 0, 0  # the view holding ``pos`` and its place in the reply
    for i in idx:
        crc, need, at = 0, BLOCK, pos
        while need:
            while at >= base + len(views[vi]):
                base += len(views[vi])
                vi += 1
            v = views[vi]
            k = min(need, base + len(v) - at)
            crc = crcfast.crc32c(v[at - base:at - base + k], crc)
            at += k
            need -= k
        if crc != crcs[i]:
            raise ChecksumError(obj, (bl.start + i) * BLOCK,
                                "checksum mismatch in the bytes received")
        pos += BLOCK


class StreamCheck:
    """:func:`verify_reply` over a read reply fed in order as it is received, each block
    hashed while it is still in the cache (no second pass over the buffer, no worker
    thread). :meth:`update` never raises (it runs inside the transport's receive, where
    an exception would leave the connection half-way through a frame): a mismatch is
    remembered, and :meth:`finish` raises it once the payload is all in (and, on a
    sealed connection, its tag checked)."""

    __slots__ = ("obj", "off", "crcs", "started", "_blocks", "_pos", "_i", "_crc", "_have",
                 "bad")

    def __init__(self, obj: tuple[int, int], off: int) -> None:
        self.obj = obj
        self.off = off
        self.crcs: list[int] = []
        self.started = False  # :meth:`start` took a reply's checksums: :meth:`finish` it
        self._blocks = range(0)
        self._pos = 0  # payload bytes fed so far
        self._i = 0  # the next whole block to complete (index into ``crcs``)
        self._crc = 0  # ... its CRC so far
        self._have = 0  # ... and how many of its bytes were fed
        self.bad: int | None = None  # the first block found not to match

    def start(self, crcs: Any, n: int) -> bool:
        """Check a reply of ``n`` bytes against ``crcs`` (as the reply's map carries
        them, unchecked): False when they do not fit (not a list of ints, one per whole
        block): the caller verifies after the receive (:func:`verify_reply` says why)."""
        bl = whole_blocks(self.off, n)
        if type(crcs) is not list or len(crcs) != len(bl) \
                or not all(type(c) is int for c in crcs):
            return False
        self.crcs, self._blocks = crcs, bl
        self.started = True
        return True

    def on_reply(self, fields: dict[str, Any], n: int) -> Any:
        """An RPC call's ``on_reply``: :meth:`update` as the sink of a reply whose map
        carries fitting checksums, else None."""
        crcs = fields.get("crcs")
        return self.update if crcs is not None and self.start(crcs, n) else None

    def update(self, view: memoryview) -> None:
        """The next ``len(view)`` bytes of the payload."""
        pos, k = self._pos, len(view)
        self._pos = pos + k
        if self.bad is not None or self._i >= len(self.crcs):
            return
        first = self._blocks.start * BLOCK - self.off  # the first whole block's place
        at = max(0, first - pos)  # bytes of ``view`` before it
        crcs = self.crcs
        while at < k and self._i < len(crcs):
            take = min(BLOCK - self._have, k - at)
            self._crc = crcfast.crc32c(view[at:at + take], self._crc)
            self._have += take
            at += take
            if self._have == BLOCK:
                if self._crc != crcs[self._i]:
                    self.bad = self._i
                    return
                self._i += 1
                self._crc = self._have = 0

    def finish(self) -> None:
        """ChecksumError (EIO) unless every whole block was fed and matched."""
        if self.bad is not None:
            raise ChecksumError(self.obj, (self._blocks.start + self.bad) * BLOCK,
                                "checksum mismatch in the bytes received")
        if self._i != len(self.crcs):
            raise ChecksumError(self.obj, (self._blocks.start + self._i) * BLOCK,
                                "the reply ended before the blocks it has checksums for")


def copied(msg: Any) -> Any:
    """The re-read of read request ``msg`` whose reply did not match its checksums:
    copied under the blocks' lock by the server (a block it sent from the file with
    sendfile may have been rewritten before it left); None when ``msg`` was one."""
    if msg.copy:
        return None
    return type(msg)(obj=msg.obj, off=msg.off, len=msg.len, cap=msg.cap, copy=True)


def verify_read(msg: Any, n: int, into: Any, crcs: list[int]) -> None:
    """:func:`verify_reply` for the reply to read request ``msg`` (the drivers)."""
    verify_reply(tuple(msg.obj), msg.off, n, into, crcs)
