"""What the data server's KV store and a client on its host share: the slab record's
head (written by the server, checked by any reader) and the layout of the index the
server publishes in shared memory for short-circuit gets (docs/architecture.md,
"KV-cache tier": "Short-circuit gets").

A record (``dataserver/kvslab.py`` appends and scans them)::

    magic "PKV1" | flags u8 | ns_len u8 | key_len u16 | value_len u32 | seq u64
    | value_crc u32 | head_crc u32 (CRC32C of the 24 bytes before it, namespace, key)
    | namespace | key | value

The published index is a memory file (``memfd``) the server maps read-write and hands
to local clients read-only: a header, then ``buckets`` x ``WAYS`` slots of 32 bytes.
A key's slot lies in bucket ``tag % buckets`` (``tag``: a keyed 64-bit hash of the
namespace and key, never 0); a slot holds the tag, the record's sequence, slab id,
offset and value length, and a CRC32C of those, so a slot read while the server
rewrites it is detected. A slot only says where to look: a reader then checks the
record it reads there (magic, namespace, key, length, sequence, the head's CRC, then
the value's CRC), so a slot that is stale, torn or reused can cost a fallback, never
another key's bytes.
"""
from __future__ import annotations

import hashlib
import os
import struct

import crc32c

from pfs.core import crcfast

MAGIC = b"PKV1"
HEAD = struct.Struct("<4sBBHIQII")
HEAD_CRC_AT = HEAD.size - 4  # the head's own checksum covers the bytes before it
PINNED = 1
TOMBSTONE = 2
MAX_NS = 128
MAX_KEY = 256
MAX_VALUE = 64 << 20


def head_crc(body: bytes | memoryview, ns: bytes, key: bytes) -> int:
    return int(crc32c.crc32c(key, crc32c.crc32c(ns, crc32c.crc32c(body))))


def pack_head(ns: bytes, key: bytes, vlen: int, seq: int, vcrc: int, flags: int) -> bytes:
    """The head, namespace and key of a record (its value follows)."""
    body = HEAD.pack(MAGIC, flags, len(ns), len(key), vlen, seq, vcrc, 0)[:HEAD_CRC_AT]
    return body + struct.pack("<I", head_crc(body, ns, key)) + ns + key


def read_record(fd: int, off: int, ns: bytes, key: bytes, vlen: int, seq: int,
                out: memoryview) -> bool:
    """Read the value of the record of ``(ns, key)`` with ``vlen`` and ``seq`` at ``off``
    of a slab into ``out[:vlen]`` (head and value in one ``preadv``, the value straight
    into ``out``); whether everything checked out: head, key, length, sequence, the
    head's CRC and the value's CRC. False leaves ``out`` with unchecked bytes.

    One read and one CRC over the whole value: reading and checking in steps, to check
    each while in cache, measured slower (a system call per step costs more than the
    CRC gains from a warm cache)."""
    nk = ns + key
    hlen = HEAD.size + len(nk)
    head = bytearray(hlen)
    view = out[:vlen]
    if os.preadv(fd, [head, view], off) != hlen + vlen:
        return False
    magic, flags, nlen, klen, n, s, vcrc, hcrc = HEAD.unpack_from(head)
    if (magic != MAGIC or flags & TOMBSTONE or n != vlen or s != seq or nlen != len(ns)
            or klen != len(key) or head[HEAD.size:] != nk
            or crc32c.crc32c(nk, crc32c.crc32c(memoryview(head)[:HEAD_CRC_AT])) != hcrc):
        return False
    return bool(crcfast.crc32c(view) == vcrc)


# -- the published index --------------------------------------------------------------
INDEX_MAGIC = b"PKVX"
INDEX_VERSION = 1
# magic, version, buckets, ways, heartbeat (CLOCK_MONOTONIC seconds), unpublished
# entries, the lowest live slab id, closed
INDEX_HEAD = struct.Struct("<4sIIIdQQI")
INDEX_HEAD_SIZE = 64
HEARTBEAT_AT = 16  # offset of the heartbeat in the header
SLOT = struct.Struct("<QQIIII")  # tag, seq, slab, off, vlen, slot crc
SLOT_CRC_AT = SLOT.size - 4
WAYS = 8
LIVE_FOR = 10.0  # seconds without a heartbeat after which the index is not trusted
_PERSON = b"pfs-kv-index"


def tag_of(ns: bytes, key: bytes) -> int:
    """The 64-bit tag of ``(ns, key)`` in the index (never 0: 0 is an empty slot)."""
    h = hashlib.blake2b(ns, digest_size=8, person=_PERSON)
    h.update(b"\0")
    h.update(key)
    return int.from_bytes(h.digest(), "little") or 1


def pack_slot(tag: int, seq: int, slab: int, off: int, vlen: int) -> bytes:
    body = SLOT.pack(tag, seq, slab, off, vlen, 0)[:SLOT_CRC_AT]
    return body + struct.pack("<I", crc32c.crc32c(body))


def slot_ok(raw: bytes | memoryview, at: int) -> bool:
    """Whether the slot at ``raw[at:]`` is whole (its CRC matches)."""
    crc = int.from_bytes(raw[at + SLOT_CRC_AT:at + SLOT.size], "little")
    return bool(crc32c.crc32c(raw[at:at + SLOT_CRC_AT]) == crc)


def index_size(buckets: int) -> int:
    return INDEX_HEAD_SIZE + buckets * WAYS * SLOT.size
