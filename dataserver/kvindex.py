"""The KV store's index published in shared memory for short-circuit gets: where each
block's record lies, for clients on this host to read the slabs themselves (layout and
the reader's checks: :mod:`pfs.core.kvformat`).

One ``memfd`` per server process, mapped read-write here and handed read-only (with
slab descriptors) to local clients that may read every namespace (``kv_open``).
A key goes in a free way of its bucket; a full bucket leaves it out and counts it
``unpublished`` (while any is, a reader takes a key it does not find to the server
instead of answering a miss). A slot is written whole with its own CRC, and only after
the record it names has landed. Every second of the server's life the header's
heartbeat is stamped, and ``closed`` is set at a clean stop: a reader trusts neither
a closed index nor one whose heartbeat is older than ``LIVE_FOR``.

Beside it, a second memory file of one byte per slot, handed to the same readers
read-write: a reader that got a block through a slot sets its byte (a reference bit),
and the store's eviction reads it as it reads its own "read since written" mark, so a
block read only by short-circuit stays as hot as one read by request. A byte is cleared
whenever its slot is (re)written: it refers to the record the slot names now. A stray
write there (a reader racing a slot's reuse) can only keep a record one more round.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time

from pfs.core import kvformat as F

log = logging.getLogger(__name__)

MIN_SLOTS = 1 << 12
MAX_SLOTS = 1 << 21  # 64 MiB of shared memory at most (pages taken as slots fill)
BYTES_PER_SLOT = 8 << 10  # one slot per this much budget, twice over (load <= 1/2)


class PublishedIndex:
    def __init__(self, budget: int) -> None:
        want = max(MIN_SLOTS, min(MAX_SLOTS, 2 * budget // BYTES_PER_SLOT))
        self.buckets = 1 << max(0, (want // F.WAYS - 1).bit_length())
        self.size = F.index_size(self.buckets)
        self.fd = os.memfd_create("pfs-kv-index", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self.refs_fd = os.memfd_create("pfs-kv-refs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.refs_fd, self.buckets * F.WAYS)
        # readers may write the bytes, never resize the file under this map (SIGBUS)
        fcntl.fcntl(self.refs_fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self.refs = mmap.mmap(self.refs_fd, self.buckets * F.WAYS)
        self._used = bytearray(self.buckets * F.WAYS)  # 1: the slot holds a key
        self.unpublished = 0
        self.low = 0
        self._head()
        self.beat()

    def _head(self, closed: bool = False) -> None:
        F.INDEX_HEAD.pack_into(self.mm, 0, F.INDEX_MAGIC, F.INDEX_VERSION, self.buckets,
                               F.WAYS, time.monotonic(), self.unpublished, self.low,
                               int(closed))

    def beat(self) -> None:
        """Stamp the heartbeat (and the counters)."""
        self._head()

    def publish(self, ns: bytes, key: bytes, seq: int, slab: int, off: int,
                vlen: int) -> int:
        """A slot for a record: its number, or -1 (its bucket is full: counted)."""
        tag = F.tag_of(ns, key)
        first = (tag & (self.buckets - 1)) * F.WAYS
        for slot in range(first, first + F.WAYS):
            if not self._used[slot]:
                self._used[slot] = 1
                self._write(slot, tag, seq, slab, off, vlen)
                return slot
        self.unpublished += 1
        self._head()
        return -1

    def move(self, slot: int, ns: bytes, key: bytes, seq: int, slab: int, off: int,
             vlen: int) -> None:
        """The record of a published slot now lies elsewhere (or is a newer one)."""
        self._write(slot, F.tag_of(ns, key), seq, slab, off, vlen)

    def _write(self, slot: int, tag: int, seq: int, slab: int, off: int, vlen: int) -> None:
        if slab > 0xFFFFFFFF or off > 0xFFFFFFFF:  # never with 64 MiB slabs; be safe
            self.clear(slot)
            return
        at = F.INDEX_HEAD_SIZE + slot * F.SLOT.size
        self.mm[at:at + F.SLOT.size] = F.pack_slot(tag, seq, slab, off, vlen)
        self.refs[slot] = 0

    def clear(self, slot: int) -> None:
        at = F.INDEX_HEAD_SIZE + slot * F.SLOT.size
        self.mm[at:at + F.SLOT.size] = bytes(F.SLOT.size)
        self._used[slot] = 0
        self.refs[slot] = 0

    def referenced(self, slot: int | None) -> bool:
        """Whether a local reader got the record of ``slot`` since it was written."""
        return slot is not None and slot >= 0 and self.refs[slot] != 0

    def forget_unpublished(self) -> None:
        """An entry that had no slot is gone."""
        self.unpublished -= 1
        self._head()

    def set_low(self, low: int) -> None:
        """The lowest slab id still live: readers close descriptors of older ones."""
        if low != self.low:
            self.low = low
            self._head()

    def reader_fd(self) -> int:
        """A new read-only descriptor of the index, to hand to a client (it cannot
        write through it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def refs_fd_for_reader(self) -> int:
        """A new read-write descriptor of the reference bytes, to hand to a client."""
        return os.open(f"/proc/self/fd/{self.refs_fd}", os.O_RDWR | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd < 0:
            return
        self._head(closed=True)
        self.mm.close()
        self.refs.close()
        os.close(self.fd)
        os.close(self.refs_fd)
        self.fd = -1
