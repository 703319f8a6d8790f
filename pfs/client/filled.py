"""Short-circuit chunks copied into fresh, registered memory by ``UFFDIO_COPY``.

A bulk reader that opts in (``FileHandle.pread_many(..., fill=True)``, the loader's
fresh buffers) gives destinations that lie in private anonymous mappings registered
with :mod:`pfs.client.uffd` and not touched yet. For each chunk of a local object, the
whole checksum blocks are copied from the object's page cache (a read-only mapping of
it, :class:`pfs.client.uffd.Source`) into the missing destination pages, then verified
in place exactly as a read's bytes are (:class:`pfs.core.checksums.VerifiedRead`):
a private copy, as ``preadv`` would give, without the kernel faulting in and zeroing
every destination page first. The partial blocks at a chunk's edges, and whatever
cannot be copied page for page (destinations not aligned as the object, a source that
fails), are read the usual way into pages made present first (:func:`uffd.settle`).
"""

from __future__ import annotations

import logging
import os

from pfs.client import uffd
from pfs.client.mapping import address
from pfs.core.checksums import VerifiedRead, slice_views

log = logging.getLogger(__name__)

PAGE = uffd.PAGE


def settle_views(views: list[memoryview]) -> None:
    """Every page under ``views`` present (see :func:`uffd.settle`)."""
    for v in views:
        if len(v):
            uffd.settle(address(v), len(v))


def fill_verified(
    obj: tuple[int, int],
    fd: int,
    cfd: int,
    off: int,
    dests: list[memoryview],
    source: uffd.Source | None,
) -> tuple[list[int], int]:
    """:func:`pfs.core.checksums.read_verified` with the whole blocks copied from
    ``source`` (the object mapped) into the missing pages of ``dests``; the bytes
    there were for each destination, and the bytes copied. ChecksumError (EIO) as a
    read's: every page of ``dests`` is present then, for the caller to read again
    the general way."""
    vr = VerifiedRead(obj, fd, cfd, off, dests)
    at = vr.direct_off
    rest: list[memoryview] = []
    for i, d in enumerate(vr.direct):
        addr, n = address(d), len(d)
        if source is None or (addr | n | at) % PAGE or at + n > source.length:
            rest = vr.direct[i:]
            break
        try:
            uffd.copy(addr, source.addr + at, n)
        except OSError as exc:  # EFAULT: the object shrank under the mapping
            log.debug("object %s: %s; reading the rest of the chunk", list(obj), exc)
            rest = vr.direct[i:]
            break
        finally:
            source.drop(at, n)
        at += n
    vr.got = at - vr.direct_off
    # what is read or written the usual way: the rest of the whole blocks, and the
    # partial blocks at the edges (VerifiedRead.finish writes them from scratch)
    settle_views(rest)
    edges = slice_views(dests, 0, vr.direct_off - off) if vr.direct else list(dests)
    if vr.direct:
        end = vr.direct_off + sum(len(d) for d in vr.direct)
        edges += slice_views(dests, end - off, vr.total)
    settle_views(edges)
    copied = vr.got
    if rest:
        vr.got += os.preadv(fd, rest, at)
    try:
        return vr.finish(), copied
    except BaseException:
        settle_views(dests)
        raise
