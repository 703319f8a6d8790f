"""The metadata key layout: every key the metaserver stores, in one table.

All integers in keys are 8-byte big-endian, so LMDB's byte order is numeric order and a
prefix scan walks one directory, one inode's xattrs or one queue in order. Values are
msgpack unless noted.

======  ==============================  ===========================================  =====
prefix  key                             value                                        notes
======  ==============================  ===========================================  =====
``I``   ``I`` ino                       inode record: ``mode uid gid size atime      [1]
                                        mtime ctime nlink rdev`` and, by type,
                                        ``layout`` (file: placed layout; dir: default
                                        layout, 0 = inherit), ``parent`` + ``nseq``
                                        (dir), ``target`` (symlink)
``D``   ``D`` parent ino, name          ``[child ino, seq]``                         [2]
``E``   ``E`` parent ino, seq           ``[name, child ino]``                        [2]
``X``   ``X`` ino, name                 raw xattr value bytes
``C``   ``C`` name                      8-byte counter: ``next_ino``, ``inodes``,
                                        ``qseq``; ``format``: the store's format   [5]
``R``   ``R`` sid (utf-8)               data server: ``host port total free``
``Q``   ``Q`` seq                       deletion queue entry: ``ino layout``          [3]
``O``   ``O`` ino                       b"": orphan, unlinked while open              [4]
``H``   ``H`` chain id                  replication chain: ``version``,             [6]
                                        ``members`` (head first), ``stale`` (taken
                                        out, not yet caught up)
``W``   ``W`` from (ns)                 8-byte end (ns) of a restore window: written  [7]
                                        by each restore
======  ==============================  ===========================================  =====

[1] The root is inode 1, created when an empty store is first opened.
[2] ``seq`` numbers a directory's entries in creation order (from the directory's
    ``nseq``); readdir walks ``E`` and a cookie is the last ``seq`` returned, so cookies
    stay valid while entries come and go. Rename over an existing name keeps that
    entry's ``seq``.
[3] Written in the same transaction that drops an inode's last link; the deleter sends
    ``delete`` to the data servers and removes the entry once they all answered.
[4] Set when the last link goes while the inode is open; the last close (or the
    connection's end, or the next start of the server) reclaims it.
[5] Written when the store is created (``pfs.core.versions.METADATA_FORMAT``); a store
    without it predates format numbers and is format 0 (metaserver/store.py).
[6] metaserver/chains.py; a file's layout names a chain per stripe (``chains``); ids
    come from the counter ``nchain``. A membership change bumps the version.
[7] metaserver/backup.py: from the backup's start (less a margin) to the restore; data
    servers enforce the truncation records stamped within one (dataserver/cuts.py).
"""
from __future__ import annotations

import struct

_Q = struct.Struct(">Q")

INODE = b"I"
DENTRY = b"D"
ENTRY_SEQ = b"E"
XATTR = b"X"
COUNTER = b"C"
SERVER = b"R"
DELQ = b"Q"
ORPHAN = b"O"
CHAIN = b"H"
RESTORE = b"W"

ROOT_INO = 1
FORMAT = COUNTER + b"format"  # the store's format number, u64 (pfs/core/versions.py)


def u64(n: int) -> bytes:
    return _Q.pack(n)


def read_u64(b: bytes, off: int = 0) -> int:
    return _Q.unpack_from(b, off)[0]


def restore_window(start: int) -> bytes:
    return RESTORE + _Q.pack(start)


def inode(ino: int) -> bytes:
    return INODE + _Q.pack(ino)


def dentry_prefix(parent: int) -> bytes:
    return DENTRY + _Q.pack(parent)


def dentry(parent: int, name: bytes) -> bytes:
    return DENTRY + _Q.pack(parent) + name


def entry_prefix(parent: int) -> bytes:
    return ENTRY_SEQ + _Q.pack(parent)


def entry(parent: int, seq: int) -> bytes:
    return ENTRY_SEQ + _Q.pack(parent) + _Q.pack(seq)


def xattr_prefix(ino: int) -> bytes:
    return XATTR + _Q.pack(ino)


def xattr(ino: int, name: bytes) -> bytes:
    return XATTR + _Q.pack(ino) + name


def counter(name: bytes) -> bytes:
    return COUNTER + name


def server(sid: str) -> bytes:
    return SERVER + sid.encode("utf-8")


def delq(seq: int) -> bytes:
    return DELQ + _Q.pack(seq)


def orphan(ino: int) -> bytes:
    return ORPHAN + _Q.pack(ino)


def chain(cid: int) -> bytes:
    return CHAIN + _Q.pack(cid)
