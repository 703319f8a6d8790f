"""Short-circuit objects mapped into the caller's memory instead of read into it.

A bulk reader that opts in (``FileHandle.pread_many(..., mapped=True)``, the loader's
``zero_copy``) gives destinations that lie in a private anonymous mapping it owns. For
each chunk of a local object, the whole checksum blocks inside the object are mapped
over those destinations (``mmap(MAP_PRIVATE | MAP_FIXED)`` of the object's descriptor:
the page-cache pages themselves, copy-on-write, nothing zeroed, nothing copied), and
then verified in place against the object's sidecar, exactly as a read's bytes are
(:class:`pfs.core.checksums.VerifiedRead`: holes zeroed, a short object an error).
The partial blocks at a chunk's edges and anything past the object's end are read
(or zeroed) into the anonymous pages as before: a page past the end of a file must
never be mapped (touching it raises SIGBUS).

What the caller accepts: the mapped pages are the object's, verified when the call
returns; a later write of the file reaches them (in pages the process did not write
itself), and a truncation of the object below them makes touching them raise SIGBUS
(docs/architecture.md "Short-circuit reads").

A block that does not verify leaves anonymous pages where its chunk was mapped
(:class:`~pfs.core.checksums.ChecksumError`): the caller reads the chunk again the
general way. Where the kernel refuses a mapping (destinations or object offsets not
page-aligned, ``vm.max_map_count`` reached) the rest of the chunk is read with one
``preadv`` instead: the same bytes, copied.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from typing import Any

from pfs.core.checksums import ChecksumError, VerifiedRead

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # linux/mman.h; Python's mmap module lacks the name
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_POPULATE_READ = 22  # 5.14+: map what the page cache holds, read the rest

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        )
        lib.mmap.restype = ctypes.c_void_p
        lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc = lib
    return _libc


def address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _mmap(addr: int, length: int, flags: int, fd: int, off: int) -> None:
    got = _lib().mmap(addr, length, _PROT_RW, flags | _MAP_FIXED, fd, off)
    if got == MAP_FAILED or got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes at offset {off}: {os.strerror(err)}")


def map_object(addr: int, length: int, fd: int, off: int) -> None:
    """Object ``fd``'s bytes ``[off, off+length)`` copy-on-write at ``addr`` (replacing
    what was mapped there); ``addr``, ``off`` and ``length`` page-aligned."""
    _mmap(addr, length, mmap.MAP_PRIVATE, fd, off)


def map_zeros(addr: int, length: int) -> None:
    """Fresh anonymous pages at ``addr`` (replacing what was mapped there)."""
    _mmap(addr, length, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)


def populate(addr: int, length: int) -> None:
    """Map the pages of ``[addr, addr+length)`` now, reading those not cached (one
    call instead of a fault per 64 KiB); a hint: a kernel without it faults them in."""
    _lib().madvise(addr, length, MADV_POPULATE_READ)


def map_verified(
    obj: tuple[int, int], fd: int, cfd: int, off: int, dests: list[memoryview]
) -> tuple[list[int], int]:
    """:func:`pfs.core.checksums.read_verified` with the whole blocks mapped instead of
    read (``dests``: consecutive object bytes from ``off``, in a private anonymous
    mapping of the caller's). Returns the bytes there were for each destination and
    the bytes mapped; ChecksumError (EIO) on a mismatch or a short object, with every
    page this call mapped made anonymous again."""
    vr = VerifiedRead(obj, fd, cfd, off, dests)
    mapped: list[tuple[int, int]] = []
    at = vr.direct_off
    rest: list[memoryview] = []
    for i, d in enumerate(vr.direct):
        addr, n = address(d), len(d)
        if (addr | n | at) % PAGE:
            rest = vr.direct[i:]
            break
        try:
            map_object(addr, n, fd, at)
        except OSError as exc:  # ENOMEM: the process's mappings are at vm.max_map_count
            log.debug("object %s: %s; reading the rest of the chunk", list(obj), exc)
            rest = vr.direct[i:]
            break
        mapped.append((addr, n))
        at += n
    for addr, n in mapped:
        populate(addr, n)
    vr.got = at - vr.direct_off
    if rest:
        vr.got += os.preadv(fd, rest, at)
    try:
        return vr.finish(), sum(n for _a, n in mapped)
    except ChecksumError:
        for addr, n in mapped:
            map_zeros(addr, n)
        raise
