"""Tombstones: the objects this data server deleted because their file was unlinked.

Inode numbers are never reused (a metadata restore moves ``next_ino`` past every number
handed out), so once a file is unlinked no namespace names its objects again — except a
metadata backup taken before the unlink and restored after the deleter reached them
(docs/architecture.md, "What restore cannot undo"). Such a file is back in the
namespace while its objects are gone, and an absent object otherwise reads as a hole:
zeros handed out as the file's bytes. A tombstone tells the two apart: a read of an
absent object that has one is ``EIO`` (:func:`deleted_error`), never a hole, and a write
to one is refused (it would make a file that is partly its new bytes and partly zeros
where deleted data was); a truncation of the object to 0 (``O_TRUNC``, a file
overwritten whole) defines all of it again and drops the tombstone.

Only objects that existed get one (a never-written stripe of a sparse file stays a
hole), and only deletions of unlinked files' objects (and orphans ``pfs fsck`` removes):
the objects of an *old layout* of a live file (an empty file given a new one) are not
tombstoned, since a later layout may legitimately place the same stripe here again.

Each data directory keeps the tombstones of its objects in ``tombstones``, an
append-only file of 24-byte records ``(ino, stripe, time)`` (little-endian u64; time in
Unix seconds, 0: "cleared", a later truncation to 0), appended and fsynced before the
objects are unlinked, so a crash never leaves a deleted object without one. At start
the file is read into a set (an int per object); records older than ``keep`` seconds
(``tombstone_days`` in the data server's config, default 365: the oldest backup one
would still restore), cleared ones and a torn last record are dropped, and the file is
rewritten when that removed anything. Cost: 24 bytes on disk and about 80 bytes of
memory per deleted object within ``keep``. Catch-up hands the head's tombstones on
(dataserver/chain.py ``send_tombstones``) and object repair copies one (repair.py), so a
replica that joined the chain after the deletion answers ``EIO`` too.
"""
from __future__ import annotations

import errno
import logging
import struct
import time
from collections.abc import Callable, Iterable

from pfs.dataserver import recordlog

log = logging.getLogger(__name__)

FILE = "tombstones"
RECORD = struct.Struct("<QQQ")  # ino, stripe, deletion time (0: cleared)
DEFAULT_KEEP = 365 * 86400.0
_MASK64 = (1 << 64) - 1
ObjId = tuple[int, int]


def deleted_error(obj: ObjId) -> OSError:
    """What a read of (or write to) a tombstoned object is told."""
    return OSError(errno.EIO, f"inode {obj[0]} (object [{obj[0]}, {obj[1]}]): its data was "
                              f"deleted after the metadata backup the namespace was "
                              f"restored from (the file was unlinked and the data server "
                              f"deleted its objects); remove the file (pfs fsck lists it "
                              f"as missing) or overwrite it whole")


def _key(obj: ObjId) -> int:
    return obj[0] << 64 | obj[1]


class Tombstones:
    """The tombstones of the data directories ``dirs``; ``where(obj)`` names the directory
    an object lives in (its tombstone goes there too: lost with that drive, as the
    object would be). Owned by the data server's event loop, except :meth:`write`."""

    def __init__(self, dirs: list[str], where: Callable[[ObjId], str],
                 keep: float = DEFAULT_KEEP, clock: Callable[[], float] = time.time) -> None:
        self._where = where
        self._keep = keep
        self._clock = clock
        self._set: set[int] = set()
        for d in dirs:
            self._load(d)

    def __len__(self) -> int:
        return len(self._set)

    def __contains__(self, obj: ObjId) -> bool:
        return bool(self._set) and _key(obj) in self._set

    def _load(self, d: str) -> None:
        recs, size = recordlog.read(d, FILE, RECORD)
        horizon = self._clock() - self._keep
        live: dict[int, tuple[int, ...]] = {}
        for ino, stripe, t in recs:
            k = ino << 64 | stripe
            if t == 0 or t < horizon:
                live.pop(k, None)
            else:
                live[k] = (ino, stripe, t)
        self._set.update(live)
        if len(live) * RECORD.size != size:  # something dropped: compact the file
            self._rewrite(d, list(live.values()))
            log.info("tombstones of %s: %d kept, %d bytes reclaimed", d, len(live),
                     size - len(live) * RECORD.size)

    @staticmethod
    def _rewrite(d: str, recs: list[tuple[int, ...]]) -> None:
        recordlog.rewrite(d, FILE, b"".join(RECORD.pack(*r) for r in recs))

    def write(self, objs: Iterable[ObjId], cleared: bool = False) -> None:
        """Append (and fsync) the records of ``objs``: deleted now, or ``cleared``.
        Touches no shared state: run it in a thread, then :meth:`add` or
        :meth:`discard` in the event loop."""
        t = 0 if cleared else max(1, int(self._clock()))
        by_dir: dict[str, list[bytes]] = {}
        for obj in objs:
            by_dir.setdefault(self._where(obj), []).append(RECORD.pack(obj[0], obj[1], t))
        for d, recs in by_dir.items():
            recordlog.append(d, FILE, b"".join(recs), RECORD.size)

    def add(self, objs: Iterable[ObjId]) -> None:
        self._set.update(_key(o) for o in objs)

    def discard(self, obj: ObjId) -> None:
        self._set.discard(_key(obj))

    def objects(self) -> list[ObjId]:
        """The tombstoned objects (a copy), for a catch-up to hand on."""
        return [(k >> 64, k & _MASK64) for k in self._set]

    def rewrite_dir(self, d: str) -> None:
        """Directory ``d`` was lost and made again empty: write back the tombstones of
        its objects that this process still knows (the file went with the drive)."""
        now = max(1, int(self._clock()))
        recs: list[tuple[int, ...]] = [(k >> 64, k & _MASK64, now) for k in self._set]
        self._rewrite(d, [r for r in recs if self._where((r[0], r[1])) == d])
