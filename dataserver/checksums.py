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
from collections.abc import Iterator
from dataclasses import dataclass, field

import crc32c
import trio

BLOCK = 64 << 10
RECORD = 8
SUFFIX = ".crc"
_REC = struct.Struct("<II")  # crc32c, end (0: never written)
_ZEROS = bytes(BLOCK)


def crc_padded(data: memoryview | bytes, crc: int = 0) -> int:
    """CRC32C of ``data`` zero-padded to a full block."""
    crc = crc32c.crc32c(data, crc)
    pad = BLOCK - len(data)
    return crc32c.crc32c(_ZEROS[:pad], crc) if pad > 0 else crc


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


def check(obj: tuple[int, int], blk: int, data: memoryview | bytes, rec: tuple[int, int],
          size: int) -> bool:
    """Raise ChecksumError when block ``blk`` (``data``: its bytes the file holds, short
    at the object's end) does not match ``rec``; False for a hole (read it as zeros)."""
    crc, end = rec
    if end == 0:
        return False
    start = blk * BLOCK
    if start + end > size:
        raise ChecksumError(obj, start, f"short object: the block map says data was "
                                        f"written up to {start + end}, the object ends at "
                                        f"{size}")
    if crc_padded(data) != crc:
        raise ChecksumError(obj, start, "checksum mismatch")
    return True


def verify_fd(obj: tuple[int, int], fd: int, cfd: int, first: int, count: int,
              size: int) -> list[int]:
    """Offsets of the bad blocks among ``first .. first+count-1`` (read here)."""
    bad: list[int] = []
    for blk, rec in zip(range(first, first + count), read_records(cfd, first, count),
                        strict=True):
        try:
            check(obj, blk, read_block(fd, blk) if rec[1] else b"", rec, size)
        except ChecksumError:
            bad.append(blk * BLOCK)
    return bad


def update(fd: int, cfd: int, off: int, data: memoryview) -> None:
    """The checksums of the blocks a write of ``data`` at ``off`` (already in the file)
    touched: a full block hashed from ``data``, a partial one read back from the file
    (merged with what it held), its ``end`` the furthest any write reached. The caller
    holds these blocks' lock."""
    bl = blocks(off, len(data))
    stop = off + len(data)
    out: list[tuple[int, int]] = []
    old: list[tuple[int, int]] | None = None
    for i, blk in enumerate(bl):
        start = blk * BLOCK
        lo, hi = max(off, start), min(stop, start + BLOCK)
        if hi - lo == BLOCK:
            out.append((crc32c.crc32c(data[lo - off:hi - off]), BLOCK))
            continue
        if old is None:
            old = read_records(cfd, bl.start, len(bl))
        out.append((crc_padded(read_block(fd, blk)), max(old[i][1], hi - start)))
    write_records(cfd, bl.start, out)


def n_blocks(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK


def compute(fd: int, cfd: int) -> int:
    """Write a sidecar for an object that has none (``pfs admin migrate --data``): every
    block up to the object's size counts as written. Returns the blocks hashed."""
    size = os.fstat(fd).st_size
    count = n_blocks(size)
    recs = []
    for blk in range(count):
        data = read_block(fd, blk)
        recs.append((crc_padded(data), len(data)))
    os.ftruncate(cfd, 0)
    if recs:
        write_records(cfd, 0, recs)
    return count


# -- locks --------------------------------------------------------------------------
@dataclass(slots=True)
class _Held:
    first: int
    last: int
    exclusive: bool
    done: trio.Event = field(default_factory=trio.Event)


class RangeLocks:
    """Block-range locks per object: a write holds its blocks exclusively while it
    writes the data and their checksums (so a partial block is merged, hashed and
    stored as one step, and two writers sharing a block leave a matching checksum); a
    read holds them shared (it never sees new data with an old checksum)."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], list[_Held]] = {}

    async def acquire(self, obj: tuple[int, int], first: int, last: int,
                      exclusive: bool) -> _Held:
        while True:
            held = self._held.get(obj, [])
            clash = next((h for h in held if h.first <= last and first <= h.last
                          and (exclusive or h.exclusive)), None)
            if clash is None:
                break
            await clash.done.wait()
        me = _Held(first, last, exclusive)
        self._held.setdefault(obj, []).append(me)
        return me

    def release(self, obj: tuple[int, int], me: _Held) -> None:
        held = self._held[obj]
        held.remove(me)
        if not held:
            del self._held[obj]
        me.done.set()

    def hold(self, obj: tuple[int, int], first: int, last: int,
             exclusive: bool) -> _Hold:
        return _Hold(self, obj, first, last, exclusive)


class _Hold:
    def __init__(self, locks: RangeLocks, obj: tuple[int, int], first: int, last: int,
                 exclusive: bool) -> None:
        self.args = (locks, obj, first, last, exclusive)
        self.me: _Held | None = None

    async def __aenter__(self) -> None:
        locks, obj, first, last, exclusive = self.args
        self.me = await locks.acquire(obj, first, last, exclusive)

    async def __aexit__(self, *exc: object) -> None:
        locks, obj = self.args[0], self.args[1]
        assert self.me is not None
        locks.release(obj, self.me)


def iter_objects(root: str) -> Iterator[tuple[str, tuple[int, int]]]:
    """``(path, id)`` of every object file under one data directory's ``objects/``."""
    with os.scandir(root) as fanouts:
        for fan in fanouts:
            if not fan.is_dir(follow_symlinks=False):
                continue
            with os.scandir(fan.path) as entries:
                for e in entries:
                    if e.name.endswith(SUFFIX) or not e.is_file(follow_symlinks=False):
                        continue
                    ino, _, stripe = e.name.partition(".")
                    if ino.isdigit() and stripe.isdigit():
                        yield e.path, (int(ino), int(stripe))
