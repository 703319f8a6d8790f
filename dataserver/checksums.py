"""The data server's side of block checksums (format: :mod:`pfs.core.checksums`): the
checksums a write leaves, whole-object verification (``verify``, the scrubber), the
sidecar of an object from before checksums (``pfs admin migrate --data``), and the
block-range locks writes and reads take."""
from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from pfs.core import crcfast
from pfs.core.checksums import (
    BLOCK,
    HOLE_CRC,
    RECORD,
    SUFFIX,
    ChecksumError,
    blocks,
    check,
    check_map,
    crc_padded,
    n_blocks,
    read_block,
    read_records,
    whole_blocks,
    write_records,
)

__all__ = ["BLOCK", "HOLE_CRC", "RECORD", "SUFFIX", "ChecksumError", "RangeLocks", "blocks", "check", "check_map",
           "compute", "crc_padded", "iter_objects", "map_summary", "parse_obj_name", "n_blocks", "read_block", "read_records",
           "update", "verify_fd", "whole_blocks", "write_records"]


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
            out.append((crcfast.crc32c(data[lo - off:hi - off]), BLOCK))
            continue
        if old is None:
            old = read_records(cfd, bl.start, len(bl))
        out.append((crc_padded(read_block(fd, blk)), max(old[i][1], hi - start)))
    write_records(cfd, bl.start, out)


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


def iter_objects(root: str, lost: bool = False) -> Iterator[tuple[str, tuple[int, int]]]:
    """``(path, id)`` of every object file under one data directory's ``objects/``;
    with ``lost``, also of every object whose file is gone but whose checksum sidecar
    (its block map) remains (``path`` then names the absent object file)."""
    with os.scandir(root) as fanouts:
        for fan in fanouts:
            if not fan.is_dir(follow_symlinks=False):
                continue
            with os.scandir(fan.path) as entries:
                for e in entries:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    if e.name.endswith(SUFFIX):
                        if not lost:
                            continue
                        path = e.path[:-len(SUFFIX)]
                        obj = parse_obj_name(e.name[:-len(SUFFIX)])
                        if obj is not None and not os.path.lexists(path):
                            yield path, obj
                        continue
                    obj = parse_obj_name(e.name)
                    if obj is not None:
                        yield e.path, obj


def map_summary(cpath: str) -> tuple[int, int]:
    """What an object's block map says (``pfs fsck``): how far into the object data was
    written (the end of its last written block's data; 0: nothing), and how many
    blocks before that were never written (holes). ``(-1, 0)`` without a sidecar."""
    try:
        with open(cpath, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return -1, 0
    n = len(raw) // RECORD
    ends = [end for _crc, end in struct.iter_unpack("<II", raw[:n * RECORD])]
    last = next((i for i in range(n - 1, -1, -1) if ends[i]), -1)
    if last < 0:
        return 0, 0
    holes = sum(1 for e in ends[:last] if not e)
    return last * BLOCK + ends[last], holes


def parse_obj_name(name: str) -> tuple[int, int] | None:
    """The id of an object file name ``<ino>.<stripe>``, or None for any other name."""
    ino, dot, stripe = name.partition(".")
    if dot and ino.isascii() and stripe.isascii() and ino.isdigit() and stripe.isdigit():
        return int(ino), int(stripe)
    return None
