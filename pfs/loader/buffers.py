"""Host buffers a loader reads checkpoint bytes into: one anonymous mapping per region,
faulted in by the kernel, from the far end, while the reads fill it from the front.

Why not ``torch.empty`` / ``numpy.empty``: a fresh process gets fresh pages, and the
kernel faults each 4 KiB page in the first time a read writes it: 1.6 GiB is ~420,000
faults taken one by one inside the copies of the reads (in the io_uring workers, or the
threads of the pread path), and what they cost varied with what the allocator happened
to hold from a previous load. Here each buffer is its own ``mmap``, populated with
``MADV_POPULATE_WRITE`` (Linux 5.14+; one call per 4 MiB piece, the GIL dropped, the
last piece first) so most reads copy into memory that is already there. Huge
pages (``MADV_HUGEPAGE``) would cut the faults 512x but are off by default: see
:data:`HUGE_PAGES`. When the last tensor over a mapping is freed, it goes back to the
process's pool for the next load (:mod:`pfs.loader.pool`), which unmaps it later.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); Python's mmap module lacks the name
HUGE = 2 << 20
POPULATE_MIN = 64 << 20  # smaller buffers are populated in the calling thread
# The piece one thread populates at a time. Small: the kernel holds the process's mmap
# lock for a whole call, and every mmap/munmap meanwhile (a reader thread's stack, an
# allocator arena) waits for it, and every page fault queues behind that waiter: with
# 64 MiB pieces a fresh load's reads did not start for 120-200 ms (a piece took 70 ms
# on the loaded machine), with 4 MiB they start at once.
POPULATE_STEP = 4 << 20
# Huge pages: 512x fewer faults, but measured 0.17-1.50 CPU s to populate 1.6 GiB against
# a steady 0.69-0.77 s with 4 KiB pages on the (Firecracker) VM here: likely because its
# balloon reports free 2 MiB blocks to the host, which must fault them back in
# (docs/benchmarks.md, section 5c).
HUGE_PAGES = False

_libc: Any = None
_populate_ok = True


def _madvise(addr: int, length: int, advice: int) -> int:
    """``madvise`` through ctypes: it drops the GIL, so threads populate in parallel."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if _libc.madvise(addr, length, advice) != 0:
        return ctypes.get_errno()
    return 0


def anon_buffer(size: int, huge: bool | None = None) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes (huge-page advised with ``huge``,
    default :data:`HUGE_PAGES`)."""
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if (HUGE_PAGES if huge is None else huge) and size >= HUGE \
            and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # THP disabled ("never"): plain pages still work
            log.debug("MADV_HUGEPAGE refused: %s", exc)
    return mm


def populate(bufs: list[tuple[int, int]], threads: int | None = None,
             stop: threading.Event | None = None) -> bool:
    """Fault in ``(address, length)`` ranges for writing, in up to ``threads`` threads;
    False when the kernel lacks ``MADV_POPULATE_WRITE``: then the reads fault the pages
    in, except huge pages (:data:`HUGE_PAGES`), which get one byte each written here
    (left to the reads, several io workers would race on one 2 MiB page, each zeroing
    a page of its own of which one is kept). ``stop`` set: return after this piece."""
    global _populate_ok
    pieces = [(a + o, min(POPULATE_STEP, n - o)) for a, n in bufs
              for o in range(0, n, POPULATE_STEP)]
    if not pieces:
        return True
    if _populate_ok:
        err = _madvise(*pieces[0], MADV_POPULATE_WRITE)
        if err:  # EINVAL: a kernel before 5.14; asked once per process
            _populate_ok = False
            log.debug("MADV_POPULATE_WRITE unavailable: %s", os.strerror(err))
    if not _populate_ok:
        for a, n in pieces if HUGE_PAGES else ():
            for off in range(0, n, HUGE):
                ctypes.c_char.from_address(a + off).value = b"\0"
        return False
    rest = pieces[1:]  # popped from the end: the reads start at the front
    nthreads = min(threads or (os.cpu_count() or 1), len(rest))
    if sum(n for _a, n in bufs) < POPULATE_MIN or nthreads <= 1:
        while rest and not (stop is not None and stop.is_set()):
            _madvise(*rest.pop(), MADV_POPULATE_WRITE)
        return True
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not rest or (stop is not None and stop.is_set()):
                    return
                p = rest.pop()
            _madvise(*p, MADV_POPULATE_WRITE)

    pool = [threading.Thread(target=work, name="pfs-populate") for _ in range(nthreads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return True


def address(buf: mmap.mmap | memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))
