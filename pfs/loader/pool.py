"""Host buffers handed back when their tensors are freed, and handed out again to the
next load of the process, already faulted in.

Why: a load into fresh memory pays the kernel to fault in and zero every 4 KiB page
(~146,000 faults and ~0.19 CPU s per 570 MB here, half a warm load's CPU), and what that
costs moves a lot from one load to the next: memory a process unmaps goes back to the
kernel, and on a VM that reports free memory to its host (virtio-balloon free page
reporting) the next load's pages may have to be faulted in by the host again (measured:
the same 570 MB populate took 0.19 s, then 0.9 s, seconds apart). A process that frees
one load's tensors and loads again (a server swapping checkpoints, a benchmark's
consecutive loads) gets its buffers back from here instead: no faults, no zeroing.

How: a buffer is an anonymous ``mmap`` (:func:`pfs.loader.buffers.anon_buffer`); what a
tensor holds is a ctypes array over its first ``n`` bytes (:class:`Lease`). When the
last tensor over it is freed, the array dies and a ``weakref.finalize`` puts the
mapping back in the pool. A mapping is handed out only while no array of it is alive,
so no tensor of an earlier load can see the new load's bytes, nor the new load the old
ones: the loader reads every byte of every buffer it asks for (a region's gaps, holes
zero-filled), and a buffer is sized exactly (a larger free one is used only when it
wastes at most a quarter). Freed buffers are unmapped after :data:`KEEP_SECONDS`, when
more than :data:`KEEP_BYTES` are free, or on :func:`release`.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
import weakref
from typing import Any

from pfs.loader.buffers import anon_buffer

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
KEEP_SECONDS = 30.0  # a freed buffer not used again within this is unmapped
KEEP_BYTES = 64 << 30  # at most this much freed memory is kept (the oldest goes first)
SLACK = 4  # a free buffer up to 1/SLACK larger than asked may be used


class Lease:
    """One buffer handed out: ``array`` (what the tensor holds: its death hands the
    mapping back), ``view`` (a writable memoryview of its ``n`` bytes, for the reads)
    and ``fresh`` (True: never written, the caller should fault it in)."""

    __slots__ = ("array", "view", "fresh")

    def __init__(self, array: Any, view: memoryview, fresh: bool) -> None:
        self.array = array
        self.view = view
        self.fresh = fresh


class BufferPool:
    """Free mappings by capacity, thread-safe (a tensor can die in any thread, or in
    the garbage collector while this pool's lock is held by the same thread: an
    RLock, and the callback only appends)."""

    def __init__(self, keep_seconds: float | None = None, keep_bytes: int | None = None
                 ) -> None:
        self._keep_seconds = keep_seconds
        self._keep_bytes = keep_bytes
        self._lock = threading.RLock()
        self._free: list[tuple[float, int, mmap.mmap]] = []  # (freed at, capacity, map)
        self._timer: threading.Timer | None = None
        self._dying: list[mmap.mmap] = []  # to unmap once their last export is gone
        self._taking = False  # take() is choosing from the free list (the lock held)
        self.stats = {"taken": 0, "reused": 0, "reused_bytes": 0, "returned": 0,
                      "unmapped": 0}

    @property
    def keep_seconds(self) -> float:
        return KEEP_SECONDS if self._keep_seconds is None else self._keep_seconds

    @property
    def keep_bytes(self) -> int:
        return KEEP_BYTES if self._keep_bytes is None else self._keep_bytes

    def free_bytes(self) -> int:
        with self._lock:
            return sum(cap for _t, cap, _m in self._free)

    def take(self, n: int, pad: int = 0) -> Lease:
        """A buffer of ``n`` bytes (n > 0): a freed one of about that size, else fresh;
        it starts ``pad`` bytes (< a page) into its mapping, so that a buffer for file
        bytes from offset ``f`` can lie in pages as the file does (``pad = f % PAGE``)."""
        cap = -(-(n + pad) // PAGE) * PAGE
        mm: mmap.mmap | None = None
        if self._dying:
            self._unmap([])
        with self._lock:
            # a tensor freed by the collector in here (this thread) only appends
            self._taking = True
            try:
                self.stats["taken"] += 1
                best = -1
                for i, (_t, have, _m) in enumerate(self._free):
                    if cap <= have <= cap + cap // SLACK and (
                            best < 0 or have < self._free[best][1]):
                        best = i
                if best >= 0:
                    _t, cap, mm = self._free.pop(best)
                    self.stats["reused"] += 1
                    self.stats["reused_bytes"] += n
            finally:
                self._taking = False
        fresh = mm is None
        if mm is None:
            mm = anon_buffer(cap)
        array = (ctypes.c_ubyte * n).from_buffer(mm, pad)
        fin = weakref.finalize(array, self._returned, mm, cap)
        fin.atexit = False  # at exit the mapping goes with the process
        return Lease(array, memoryview(array).cast("B"), fresh)

    def _returned(self, mm: mmap.mmap, cap: int) -> None:
        """The last holder of a lease's array is gone: keep its mapping for reuse."""
        if self.keep_seconds <= 0 or cap > self.keep_bytes:
            self._unmap([mm])
            return
        with self._lock:
            self.stats["returned"] += 1
            self._free.append((time.monotonic(), cap, mm))
            over = [] if self._taking else self._over_budget()  # (else: the next return)
            if self._timer is None:
                self._timer = threading.Timer(self.keep_seconds, self._expire)
                self._timer.daemon = True
                self._timer.start()
        self._unmap(over)

    def _over_budget(self) -> list[mmap.mmap]:
        """The oldest free mappings beyond :attr:`keep_bytes` (lock held)."""
        out = []
        total = sum(cap for _t, cap, _m in self._free)
        self._free.sort(key=lambda e: e[0])
        while self._free and total > self.keep_bytes:
            _t, cap, mm = self._free.pop(0)
            total -= cap
            out.append(mm)
        return out

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._timer = None
            old = [e for e in self._free if now - e[0] >= self.keep_seconds]
            self._free = [e for e in self._free if now - e[0] < self.keep_seconds]
            if self._free:  # the rest expire later
                wait = self.keep_seconds - (now - min(e[0] for e in self._free))
                self._timer = threading.Timer(max(wait, 0.01), self._expire)
                self._timer.daemon = True
                self._timer.start()
        self._unmap([mm for _t, _c, mm in old])

    def release(self) -> int:
        """Unmap every free buffer now; the bytes given back to the kernel."""
        with self._lock:
            free, self._free = self._free, []
        self._unmap([mm for _t, _c, mm in free])
        return sum(cap for _t, cap, _m in free)

    def _unmap(self, maps: list[mmap.mmap]) -> None:
        """Close these mappings, and any an earlier call could not: in the callback of
        a dying array, the array still holds its export of the mapping (weakref
        callbacks run before an object lets go of what it holds)."""
        with self._lock:
            maps, self._dying = maps + self._dying, []
        left = []
        for mm in maps:
            try:
                mm.close()
            except BufferError:
                left.append(mm)
        with self._lock:
            self._dying += left
            self.stats["unmapped"] += len(maps) - len(left)


POOL = BufferPool()


def take(n: int, pad: int = 0) -> Lease:
    """A buffer of ``n`` bytes from the process's pool (:data:`POOL`)."""
    return POOL.take(n, pad)


def release() -> int:
    """Give every freed loader buffer back to the kernel now (they go by themselves
    :data:`KEEP_SECONDS` after their tensors were freed); the bytes released."""
    return POOL.release()
