"""The KV block store's on-disk format: records appended to slab files, and the scan
that rebuilds the index from them at start.

The record's head is defined in :mod:`pfs.core.kvformat` (a client on the server's
host checks it too: short-circuit gets). A slab is a file ``DIR/kv/<id>.slab``
(``<id>``: 16 hex digits, increasing: the order slabs were opened in, which is the
order they are evicted in). It holds records one after another, each position-independent (a record copied to another slab is the same
bytes)::

    magic "PKV1" | flags u8 | ns_len u8 | key_len u16 | value_len u32 | seq u64
    | value_crc u32 (CRC32C of the value) | head_crc u32 (CRC32C of the 24 bytes
    before it, the namespace and the key) | namespace | key | value

``flags``: PINNED (evicted only when nothing unpinned is left), TOMBSTONE (a removal:
no value; it hides older records of its key). ``seq`` orders every record of the
store: at a rebuild, the highest sequence of a key wins (a record or a tombstone).

A record whose head does not check out ends the slab's scan: it is a torn tail (the
server stopped while appending) or garbage, and everything from it on is cut off the
file. The last record of a slab also has its value checked at the scan, since a power
loss can leave a file extended over bytes that never landed; every value is checked
again whenever it is read, so a record that rots later is a miss, never wrong bytes.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from pfs.core import crcfast
from pfs.core.kvformat import (  # noqa: F401 (the record format, re-exported)
    HEAD,
    HEAD_CRC_AT,
    MAGIC,
    MAX_KEY,
    MAX_NS,
    MAX_VALUE,
    PINNED,
    TOMBSTONE,
    head_crc,
    pack_head,
)

log = logging.getLogger(__name__)

SUFFIX = ".slab"
KV_DIR = "kv"
_PREFIX = HEAD.size + MAX_NS + MAX_KEY  # a head with the longest namespace and key
SCAN_CHUNK = 1 << 20  # bytes a scan reads at once among small records


def record_size(ns: bytes, key: bytes, vlen: int) -> int:
    return HEAD.size + len(ns) + len(key) + vlen


@dataclass(slots=True)
class Scanned:
    """One record found by :func:`scan`."""

    off: int  # where the record starts in its slab
    size: int  # head + namespace + key + value
    ns: str
    key: bytes
    vlen: int
    seq: int
    vcrc: int
    flags: int

    @property
    def head_len(self) -> int:
        return self.size - self.vlen


def parse_head(buf: bytes | memoryview, off: int, file_size: int) -> Scanned | None:
    """The record whose head starts ``buf`` (read at ``off`` of a slab of ``file_size``
    bytes), or None when it is not a whole, intact record head."""
    if len(buf) < HEAD.size:
        return None
    magic, flags, nlen, klen, vlen, seq, vcrc, hcrc = HEAD.unpack_from(buf)
    if magic != MAGIC or klen == 0 or nlen == 0 or klen > MAX_KEY or nlen > MAX_NS:
        return None
    if vlen > MAX_VALUE or len(buf) < HEAD.size + nlen + klen:
        return None
    ns = bytes(buf[HEAD.size:HEAD.size + nlen])
    key = bytes(buf[HEAD.size + nlen:HEAD.size + nlen + klen])
    if head_crc(bytes(buf[:HEAD_CRC_AT]), ns, key) != hcrc:
        return None
    size = HEAD.size + nlen + klen + vlen
    if off + size > file_size:
        return None  # the value was cut short: a torn tail
    try:
        name = ns.decode("ascii")
    except UnicodeDecodeError:
        return None
    return Scanned(off, size, name, key, vlen, seq, vcrc, flags)


def value_ok(fd: int, rec: Scanned) -> bool:
    """Whether ``rec``'s value reads back with its checksum."""
    data = os.pread(fd, rec.vlen, rec.off + rec.head_len)
    return len(data) == rec.vlen and crcfast.crc32c(data) == rec.vcrc


def scan(fd: int, path: str) -> tuple[list[Scanned], int]:
    """The records of an open slab and where its good part ends; a torn or garbled
    tail is cut off the file (logged), a last record whose value does not check out
    too. Small records are parsed from reads of SCAN_CHUNK bytes; past a large one,
    only the next head is read (its value is not needed)."""
    size = os.fstat(fd).st_size
    out: list[Scanned] = []
    off = 0
    buf, at = b"", 0  # file bytes [at, at + len(buf))
    small = True  # the last record was small: read ahead a chunk
    while off < size:
        want = min(_PREFIX, size - off)
        if not (at <= off and off + want <= at + len(buf)):
            buf, at = os.pread(fd, min(SCAN_CHUNK if small else _PREFIX, size - off), off), off
        rec = parse_head(memoryview(buf)[off - at:], off, size)
        if rec is None:
            break
        out.append(rec)
        off += rec.size
        small = rec.size < SCAN_CHUNK // 4
    if out and out[-1].vlen and not value_ok(fd, out[-1]):
        off = out.pop().off
    if off < size:
        log.warning("kv slab %s: dropping %d bytes of torn or unreadable records at "
                    "offset %d", path, size - off, off)
        os.ftruncate(fd, off)
    return out, off


def slab_name(sid: int) -> str:
    return f"{sid:016x}{SUFFIX}"


def slab_id(name: str) -> int | None:
    """The id of a slab file's name, None for any other file."""
    stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else ""
    if len(stem) != 16:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None
