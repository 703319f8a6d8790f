"""Pages of a file mapping locked in memory (``mlock``) while C code reads them.

A page of a file mapping that the kernel reclaims after it was faulted in is read from
the disk again at its next touch; if that read fails (a bad sector, a drive gone) the
touch raises ``SIGBUS``, which kills the process, whatever C code touched it (a tag
computed over it, a CRC, a copy). ``MADV_POPULATE_READ`` only reports the errors of the
first fault-in: a clean page can go right after. A locked page cannot be reclaimed: the
range is locked on fault (``mlock2(MLOCK_ONFAULT)``, which reads nothing) and then
faulted in with ``MADV_POPULATE_READ``, which reports a page it could not read as
EFAULT; the caller then reads the bytes with ``preadv`` instead, which reports the error
as EIO. (A plain ``mlock`` reads the pages itself, and on Linux 6.x retries a read that
fails for ever: the call never returns.)

Locks do not nest (one ``munlock`` unlocks a page however often it was locked), so live
pins are kept here and a release unlocks only the pages no other live pin covers: two
gets of neighbouring KV values share a page of their slab's one mapping.

Without ``CAP_IPC_LOCK`` the process may lock ``RLIMIT_MEMLOCK`` bytes at most: a pin
that would pass that is refused (the caller copies), and a limit of 0 (EPERM) turns
pinning off; either is logged once.

``MADV_POPULATE_READ`` takes and drops a reference on every page it walks, mapped or not
(~130 ns a page: 65 us for 2 MiB), though a value sent again is nearly always mapped
already. The lock itself keeps every page that is mapped when it is taken, so the
page table is read first (``/proc/self/pagemap``, ~10 ns a page) and the range is
faulted in only where some page of it is not mapped.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
from typing import Any

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
CAP_IPC_LOCK = 14
MLOCK_ONFAULT = 1
MADV_POPULATE_READ = 22  # Linux 5.14
MADV_PAGEOUT = 21  # linux/mman.h (5.4); for the test hook below
PRESENT = 0x80  # bit 63 of a pagemap entry (the high byte of a little-endian u64)
# Test hook (fault tests only): reclaim a range right after it is pinned and again once
# it is released, as memory pressure may at any time: a range not truly locked is then
# read from the disk again at its next touch (and a failing disk raises SIGBUS there).
RECLAIM_AFTER_PIN = os.environ.get("PFS_TEST_RECLAIM_PINNED") == "1"


class _Buffer(ctypes.Structure):  # Py_buffer
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_Buffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_Buffer),)
_release_buffer.restype = None
_libc = ctypes.CDLL(None, use_errno=True)
_libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munlock.restype = ctypes.c_int
_libc.mlock2.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)
_libc.mlock2.restype = ctypes.c_int
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def address(buf: Any) -> int:
    """The address of the first byte of a (read-only too) buffer: a mapping, a view."""
    b = _Buffer()
    _get_buffer(buf, ctypes.byref(b), 0)
    try:
        return int(b.buf or 0)
    finally:
        _release_buffer(ctypes.byref(b))


def _capable() -> bool:
    """Whether this process has CAP_IPC_LOCK (no limit on what it locks)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def _pagemap() -> int | None:
    try:
        return os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _mapped(lo: int, hi: int) -> bool:
    """Whether every page of [lo, hi) is in this process's page table (its pagemap
    entry's "present" bit); False where that cannot be read."""
    fd = _state.pagemap
    if fd is None:
        return False
    n = (hi - lo) // PAGE * 8
    try:
        entries = os.pread(fd, n, lo // PAGE * 8)
    except OSError:
        return False
    return len(entries) == n and min(entries[7::8]) >= PRESENT


class _State:
    def __init__(self) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        self.budget = float("inf") if soft == resource.RLIM_INFINITY or _capable() else float(soft)
        self.locked = 0  # bytes of live pins (an overestimate where they overlap)
        self.off = False  # EPERM: this process may not lock at all
        self.warned = False
        self.live: set[Pin] = set()
        # what the caller took the copying path for instead: over the limit, read errors
        self.refused = 0
        self.failed = 0
        self.pagemap = _pagemap()


_state = _State()


def _reopen_pagemap() -> None:
    # /proc/self/pagemap names the process that opened it: a forked child would read
    # its parent's page table and skip faulting in pages that it lacks
    if _state.pagemap is not None:
        os.close(_state.pagemap)
    _state.pagemap = _pagemap()


os.register_at_fork(after_in_child=_reopen_pagemap)


class Pin:
    """A locked range; ``release`` once nothing reads it any more."""

    __slots__ = ("lo", "hi")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def release(self) -> None:
        if self in _state.live:
            _state.live.discard(self)
            _state.locked -= self.hi - self.lo
            _unlock(self.lo, self.hi)
            if RECLAIM_AFTER_PIN:
                _libc.madvise(self.lo, self.hi - self.lo, MADV_PAGEOUT)


def _unlock(lo: int, hi: int) -> None:
    """Unlock the pages of [lo, hi) that no live pin covers."""
    at = lo
    for a, b in sorted((p.lo, p.hi) for p in _state.live if p.lo < hi and p.hi > lo):
        if a > at:
            _libc.munlock(at, a - at)
        at = max(at, b)
    if at < hi:
        _libc.munlock(at, hi - at)


def _limited(why: str) -> None:
    if not _state.warned:
        _state.warned = True
        log.warning(
            "cannot lock mapped pages (%s): replies that would be sent from a "
            "file's mapping are copied instead",
            why,
        )


def pin(buf: Any) -> Pin | None:
    """Lock the pages under ``buf`` (a read-only view of a file mapping), reading those
    not in the page cache. None where this process cannot lock them: the caller reads
    the bytes some other way. EIO where a page could not be read (nothing is locked)."""
    n = memoryview(buf).nbytes
    start = address(buf)
    lo, hi = start - start % PAGE, -(-(start + n) // PAGE) * PAGE
    if _state.off or _state.locked + (hi - lo) > _state.budget:
        _state.refused += 1
        _limited(f"RLIMIT_MEMLOCK is {_state.budget:.0f} bytes")
        return None
    # locked on fault, then faulted in: a plain mlock reads what is missing itself,
    # and retries a read that fails for ever (it never returns); MADV_POPULATE_READ
    # reports one as EFAULT
    if _libc.mlock2(lo, hi - lo, MLOCK_ONFAULT) != 0:
        err = ctypes.get_errno()
        _unlock(lo, hi)
        _state.refused += 1
        if err == errno.EPERM:
            _state.off = True
        _limited(os.strerror(err))
        return None
    # a page mapped now is locked now: only a range with one missing is faulted in
    if not _mapped(lo, hi) and _libc.madvise(lo, hi - lo, MADV_POPULATE_READ) != 0:
        err = ctypes.get_errno()  # EFAULT: a page could not be read
        _unlock(lo, hi)
        if err in (errno.EINVAL, errno.ENOSYS):  # a kernel before 5.14: never mapped
            _state.off = True
            _state.refused += 1
            _limited("no MADV_POPULATE_READ")
            return None
        _state.failed += 1
        raise OSError(
            errno.EIO,
            f"{hi - lo} bytes of a file mapping could not be read "
            f"from the disk ({os.strerror(err)})",
        )
    p = Pin(lo, hi)
    _state.live.add(p)
    _state.locked += hi - lo
    if RECLAIM_AFTER_PIN:
        _libc.madvise(lo, hi - lo, MADV_PAGEOUT)  # EINVAL on a locked range: kept
    return p


def stats() -> dict[str, int]:
    """Pins live, and how many were refused (the limit) or failed (a read error)."""
    return {"live": len(_state.live), "refused": _state.refused, "failed": _state.failed}
