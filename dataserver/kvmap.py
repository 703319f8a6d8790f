"""A KV slab mapped into the data server, so that a get checks and sends a value straight
from the page cache: its CRC32C, the connection's tag and the socket's copy all read the
mapping, where reading it into a buffer first cost as much again (a 2 MiB value: ~0.4 ms
of copy and check against ~0.08 ms from the mapping). Only values of ``kvstore.MAP_MIN``
(1 MiB) and up: a smaller one is read into a pooled buffer for less than locking its
pages costs, and is then sent from the CPU's cache.

Safe because a record is never written again once indexed (slabs are append-only) and a
slab is only ever unlinked, never shortened while the server runs: the bytes checked are
the bytes tagged and sent, and a mapping outlives the unlink (the views of a reply in
flight keep it). Only values whose pages are in the page cache are read this way, and
their pages are locked (faulted in and kept from reclaim, pfs/core/pinning.py) until
the reply was sent: a page the kernel dropped and could not read again would raise
``SIGBUS`` in the CRC or the send, killing the server. A page that cannot be read fails
the pin instead, and so does a process that may not lock memory: the caller then takes
the ``preadv`` path, which counts an unreadable block as such.
"""

from __future__ import annotations

import mmap
import os

from pfs.core.pinning import Pin, pin

_probe = bytearray(1)


def resident(fd: int, off: int, n: int) -> bool:
    """Whether the first and last byte of ``n`` bytes at ``off`` are in the page cache
    (two reads that never wait for the disk; what lies between came with them, or with
    the readahead, nearly always)."""
    try:
        return (
            os.preadv(fd, [_probe], off, os.RWF_NOWAIT) == 1
            and os.preadv(fd, [_probe], off + n - 1, os.RWF_NOWAIT) == 1
        )
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: the filesystem cannot say
        return False


class SlabMap:
    """One slab's mapping, grown (mapped again) when a value lies past its end: the
    current slab grows as puts append to it."""

    __slots__ = ("mapped", "view")

    def __init__(self) -> None:
        self.mapped: mmap.mmap | None = None
        self.view: memoryview | None = None  # of the whole mapping

    def value(self, fd: int, off: int, n: int) -> tuple[memoryview, Pin] | None:
        """The ``n`` bytes at ``off``, mapped and locked (release the pin once they are
        sent); None when they cannot be (the caller reads them instead)."""
        end = off + n
        view, mapped = self.view, self.mapped
        if view is None or mapped is None or len(view) < end:
            mapped = self._remap(fd, end)
            if mapped is None:
                return None
            view = self.view = memoryview(mapped)
        got = view[off:end]
        try:
            pinned = pin(got)
        except OSError:  # a page could not be read: the read reports it
            pinned = None
        if pinned is None:
            got.release()
            return None
        return got, pinned

    def _remap(self, fd: int, end: int) -> mmap.mmap | None:
        try:
            size = os.fstat(fd).st_size
            if size < end:
                return None
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        # the old mapping goes once the last reply sent from it is (its views keep it)
        self.mapped = mapped
        return mapped

    def drop(self) -> None:
        """Forget the mapping (the slab is gone); replies in flight keep theirs."""
        self.mapped = self.view = None
