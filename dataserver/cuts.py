"""Truncation records: how far each object reached before a truncation cut it, and when.

A file truncated after a metadata backup was taken is, once the backup is restored,
back at the size the backup recorded while its objects stay cut: without more
knowledge the bytes past the cut read as a hole (zeros handed out as the file's
data). Tombstones (tombstones.py) tell a deleted object from a hole; these records do
the same for the cut-off end of an object that lives on. Unlike a deleted file, a file
that was cut is still named by the live namespace, which may extend it again (a genuine
hole past the cut), so a record is *enforced* only where the namespace may not know of
the cut: when it was made within a *restore window* ``[backup start - margin, restore
time)`` (metaserver/backup.py records one at each restore; a data server learns them
at registration, or sooner from ``get_chain`` when a request names a restored chain
version: chain.py ``restore_jumped``). There the object's *deleted range* is ``[size now, end)``, ``end``
the largest size it had before a cut in the window, and

- a read reaching into it is ``EIO`` (:func:`cut_error`), never zeros; a short-circuit
  descriptor of the object is refused (the reader goes over TCP);
- a write starting past the object's end is refused (it would leave zeros in the
  deleted range), one starting at or before it defines the bytes it writes;
- a truncation to the object's size or less drops the range (what the file holds past
  its new end is a hole if it grows again: the namespace knows of this cut); one to
  more does not extend the object into the range (the range ends at the new size).

Why time windows and not a version per file: the metaserver stamps each truncation
with its clock (``truncate``'s ``at``) and records the backup's time (its manifest)
on the same host, so no read has to carry anything new, and a backup taken after a cut
recorded the cut size (the metaserver cuts the objects, then commits the size: the
margin, ``CUT_MARGIN`` of metaserver/backup.py, covers that gap). A cut in the margin
before the backup is enforced though the backup may know of it: a read of its hole is
``EIO`` instead of zeros, never the other way round. The metaserver stamps the cuts it
makes after a restore past the window's end, so they are never enforced.

Each data directory keeps the records of its objects in ``cuts``, an append-only file
of 32-byte records ``(ino, stripe, end, at)`` (little-endian u64; ``at`` in metaserver
nanoseconds, 0: "cleared", every earlier record of the object dropped), fsynced before
the object is cut (recordlog.py). Only cuts that removed bytes are recorded, in memory a
short list per object (an earlier record whose ``end`` a later one reaches is dropped);
records older than ``keep`` (``tombstone_days``) and cleared ones are dropped at the next
start. Cost: 32 bytes on disk and ~300 of memory per object cut within ``keep`` (a
file overwritten with ``O_TRUNC`` cuts each of its objects), and one append and fsync
per truncation that removed bytes. Catch-up and object repair copy an object's records with
it.
"""

from __future__ import annotations

import errno
import logging
import struct
import time
from collections.abc import Callable, Iterable

from pfs.dataserver import recordlog

log = logging.getLogger(__name__)

FILE = "cuts"
RECORD = struct.Struct("<QQQQ")  # ino, stripe, end, at (metaserver ns; 0: cleared)
ObjId = tuple[int, int]
Marks = list[tuple[int, int]]  # (at, end), oldest first
MAX_MARKS = 16  # records kept per object (a copy carries them all)


def cut_error(obj: ObjId, lo: int, hi: int) -> OSError:
    """What a read of (or write into) an object's deleted range is told."""
    return OSError(
        errno.EIO,
        f"inode {obj[0]} (object [{obj[0]}, {obj[1]}], bytes {lo} to "
        f"{hi}): its data was cut by a truncation after the metadata "
        f"backup the namespace was restored from; truncate the file "
        f"to its valid size or overwrite it whole",
    )


def _key(obj: ObjId) -> int:
    return obj[0] << 64 | obj[1]


def _add(marks: Marks, at: int, end: int) -> None:
    marks[:] = [m for m in marks if m[1] > end]  # a later record reaching as far covers them
    marks.append((at, end))
    while len(marks) > MAX_MARKS:  # the oldest two as one: enforced over more, never less
        marks[0:2] = [(marks[1][0], marks[0][1])]


class Cuts:
    """The truncation records of the data directories ``dirs``; ``where(obj)`` names the
    directory an object lives in. Owned by the data server's event loop, except
    :meth:`write`."""

    def __init__(
        self,
        dirs: list[str],
        where: Callable[[ObjId], str],
        keep: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._where = where
        self._marks: dict[int, Marks] = {}
        self._windows: list[tuple[int, int]] = []
        self.enforced: dict[int, int] = {}  # object -> end of its deleted range
        horizon = int((clock() - keep) * 1e9)
        for d in dirs:
            self._load(d, horizon)

    def __len__(self) -> int:
        return len(self._marks)

    def _load(self, d: str, horizon: int) -> None:
        recs, size = recordlog.read(d, FILE, RECORD)
        got: dict[int, Marks] = {}
        for ino, stripe, end, at in recs:
            k = ino << 64 | stripe
            if at == 0:
                got.pop(k, None)
            elif at >= horizon:
                _add(got.setdefault(k, []), at, end)
        self._marks.update(got)
        n = sum(len(m) for m in got.values())
        if n * RECORD.size != size:  # something dropped: compact the file
            recordlog.rewrite(
                d,
                FILE,
                b"".join(
                    RECORD.pack(k >> 64, k & ((1 << 64) - 1), end, at)
                    for k, marks in got.items()
                    for at, end in marks
                ),
            )
            log.info(
                "truncation records of %s: %d kept, %d bytes reclaimed",
                d,
                n,
                size - n * RECORD.size,
            )

    # -- restore windows -------------------------------------------------------
    def set_windows(self, windows: Iterable[tuple[int, int]]) -> None:
        """The metaserver's restore windows (at registration): which records to enforce."""
        self._windows = sorted((int(lo), int(hi)) for lo, hi in windows)
        self.enforced = {}
        for k in self._marks:
            self._enforce(k)
        if self.enforced:
            log.warning(
                "%d objects were cut after the metadata backup the namespace was "
                "restored from: their cut ranges read EIO",
                len(self.enforced),
            )

    def _enforce(self, k: int) -> None:
        ends = [end for at, end in self._marks.get(k, ()) if self._in_window(at)]
        if ends:
            self.enforced[k] = max(ends)
        else:
            self.enforced.pop(k, None)

    def _in_window(self, at: int) -> bool:
        return any(lo <= at < hi for lo, hi in self._windows)

    # -- per object ------------------------------------------------------------
    def deleted_range(self, obj: ObjId, size: int) -> tuple[int, int] | None:
        """``obj``'s enforced deleted range, given its size now; None when it has none."""
        end = self.enforced.get(_key(obj)) if self.enforced else None
        return (size, end) if end is not None and size < end else None

    def marks(self, obj: ObjId) -> Marks:
        """``obj``'s records (a copy), for a copy of it to carry."""
        return list(self._marks.get(_key(obj), ()))

    def window_at(self, obj: ObjId) -> int:
        """The time of a record of ``obj`` inside a restore window (its deleted range
        kept with a new end); 0: none."""
        return next((at for at, _end in self._marks.get(_key(obj), ()) if self._in_window(at)), 0)

    def has(self, obj: ObjId) -> bool:
        return bool(self._marks) and _key(obj) in self._marks

    def write(self, obj: ObjId, marks: Marks, clear: bool = False) -> None:
        """Append (and fsync) ``obj``'s records ``marks``, after a "cleared" one with
        ``clear``. Touches no shared state: run it in a thread, then :meth:`put`."""
        ino, stripe = obj
        data = RECORD.pack(ino, stripe, 0, 0) if clear else b""
        data += b"".join(RECORD.pack(ino, stripe, end, at) for at, end in marks)
        if data:
            recordlog.append(self._where(obj), FILE, data, RECORD.size)

    def put(self, obj: ObjId, marks: Marks, clear: bool = False) -> None:
        """What :meth:`write` wrote, in memory."""
        k = _key(obj)
        if clear:
            self._marks.pop(k, None)
        for at, end in marks:
            _add(self._marks.setdefault(k, []), at, end)
        self._enforce(k)

    def write_cleared(self, objs: list[ObjId]) -> None:
        """Append (and fsync) a "cleared" record of each of ``objs`` (deleted: a
        tombstone, or nothing, speaks for them now). In a thread, then :meth:`drop`."""
        by_dir: dict[str, list[bytes]] = {}
        for ino, stripe in objs:
            by_dir.setdefault(self._where((ino, stripe)), []).append(RECORD.pack(ino, stripe, 0, 0))
        for d, recs in by_dir.items():
            recordlog.append(d, FILE, b"".join(recs), RECORD.size)

    def drop(self, objs: list[ObjId]) -> None:
        for obj in objs:
            self._marks.pop(_key(obj), None)
            self.enforced.pop(_key(obj), None)

    def rewrite_dir(self, d: str) -> None:
        """Directory ``d`` was lost and made again empty: write back the records of its
        objects that this process still knows (the file went with the drive)."""
        mask = (1 << 64) - 1
        recordlog.rewrite(
            d,
            FILE,
            b"".join(
                RECORD.pack(k >> 64, k & mask, end, at)
                for k, marks in self._marks.items()
                if self._where((k >> 64, k & mask)) == d
                for at, end in marks
            ),
        )
