"""The data server's KV-block methods (docs/architecture.md "KV-cache tier"): blocks
put, fetched, probed and removed by ``(namespace, key)``, with no capability (the
connection's authentication is the gate; a namespace may be restricted to node keys).

Registered into the data server's registry (``pfs.core.messages.data.REGISTRY``).
"""
from __future__ import annotations

import errno
import re
from typing import Any

from pfs.core.messages.base import (
    Bool,
    BytesField,
    Int,
    List,
    Payload,
    ReplyMessage,
    StrField,
    violation,
)
from pfs.core.messages.data import DataRequest

MAX_NS = 128  # characters of a namespace
MAX_KEY = 256  # bytes of a key
MAX_VALUE = 64 << 20  # bytes of a value (one frame's payload)
MAX_KEYS = 4096  # keys in one exists or remove request
NS_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")
CRC_MAX = (1 << 32) - 1


class NsField(StrField):
    """A namespace: 1 to 128 characters of ``[A-Za-z0-9._:-]``."""

    type_doc = "str"

    def limits(self) -> str:
        return f"1 to {MAX_NS} characters of [A-Za-z0-9._:-]"

    def quick(self, v: str) -> str:
        return "False"  # always the full check (a pattern)

    def check(self, v: Any, method: str) -> Any:
        if not isinstance(v, str) or not NS_PATTERN.match(v):
            raise violation(errno.EINVAL, f"{method}: namespace {v!r} must be 1 to "
                                          f"{MAX_NS} characters of [A-Za-z0-9._:-]")
        return v


class KeyField(BytesField):
    """A block's key: 1 to 256 bytes."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(max_len=MAX_KEY, **kw)

    def limits(self) -> str:
        return f"1 to {MAX_KEY} bytes"

    def quick(self, v: str) -> str:
        return f"type({v}) is bytes and 0 < len({v}) <= {MAX_KEY}"

    def check(self, v: Any, method: str) -> Any:
        if not isinstance(v, (bytes, bytearray, memoryview)):
            raise self.fail(method, "bytes")
        if not 0 < len(v) <= MAX_KEY:
            raise violation(errno.EINVAL, f"{method}: a key of {len(v)} bytes: keys are "
                                          f"1 to {MAX_KEY} bytes")
        return bytes(v)


def Ns() -> Any:  # noqa: N802
    return NsField()


def Key() -> Any:  # noqa: N802
    return KeyField()


def _keys() -> Any:
    return List(KeyField(), max_len=MAX_KEYS, doc=f"list of keys, at most {MAX_KEYS}")


# ------------------------------------------------------------------ replies
class KvPutReply(ReplyMessage):
    n: int = Int(doc="value bytes stored")


class KvGetReply(ReplyMessage):
    payload_doc = "the value (`n` bytes) when found"
    found: bool = Bool()
    n: int = Int(doc="the value's length (0: not found)")
    crc: int = Int(doc="CRC32C of the value (0: not found): a reader on a plain "
                       "connection checks it")


class KvExistsReply(ReplyMessage):
    present: list[bool] = List(Bool(), doc="a bool per key, in order")


class KvRemoveReply(ReplyMessage):
    n: int = Int(doc="keys that were present")


class KvStatsReply(ReplyMessage):
    budget: int = Int(doc="bytes of KV slabs this server may hold (0: no KV store)")
    used: int = Int(doc="bytes of KV slabs it holds")
    blocks: int = Int()
    hits: int = Int()
    misses: int = Int()
    evictions: int = Int(doc="blocks dropped to make room, since the server started")
    puts: int = Int()
    pinned: int = Int(doc="pinned blocks held")
    corrupt: int = Int(default=0, doc="blocks whose value failed its CRC when read "
                                      "(dropped, answered as misses)")


# ------------------------------------------------------------------ requests
class KvPut(DataRequest, method="kv_put", reply=KvPutReply):
    note = ("store a block (replacing the key's older value), evicting others when the "
            "budget is spent (never ENOSPC for that: `ENOSPC` only when the data disk is "
            "full of file data); `EIO` when the value does not match `crc` (nothing "
            "stored), `EFBIG` beyond the whole budget, `EOPNOTSUPP` on a server with no "
            "KV budget, `EACCES` for a namespace the connection's key may not use")
    payload_doc = f"the value, 1 byte to {MAX_VALUE} bytes (`EMSGSIZE` beyond)"
    ns: str = Ns()
    key: bytes = Key()
    crc: int = Int(lo=0, hi=CRC_MAX, doc="CRC32C of the value")
    pin: bool = Bool(default=False, sparse=True, doc="evicted only when nothing unpinned "
                                                     "is left")
    payload: Any = Payload(default=None)


class KvGet(DataRequest, method="kv_get", reply=KvGetReply):
    note = ("a block, its CRC checked by the server as read (a corrupt record is dropped "
            "and answered as a miss), and again by the reader where the connection does "
            "not authenticate its frames (no MAC, no TLS: the tag proves the bytes are "
            "the ones the server checked); `ERANGE` when the value is longer than `len`")
    ns: str = Ns()
    key: bytes = Key()
    len: int = Int(lo=1, hi=MAX_VALUE, doc=f"the most bytes the caller's buffer takes, 1 "
                                           f"to {MAX_VALUE}")


class KvExists(DataRequest, method="kv_exists", reply=KvExistsReply):
    ns: str = Ns()
    keys: list[bytes] = _keys()


class KvRemove(DataRequest, method="kv_remove", reply=KvRemoveReply):
    ns: str = Ns()
    keys: list[bytes] = _keys()


class KvStats(DataRequest, method="kv_stats", reply=KvStatsReply):
    pass


class KvOpenReply(ReplyMessage):
    payload_doc = ("as SCM_RIGHTS ancillary data: for `slab` 0, a read-only descriptor of "
                   "the published index and a read-write one of its reference bytes (one "
                   "per slot, set by a reader that got the slot's record); else a "
                   "read-only descriptor of the slab asked for")
    size: int = Int(doc="the index's bytes, or the slab's")
    slabs: list[int] = List(Int(), default=[], max_len=1 << 16,
                            doc="with the index: the ids of the live slabs, oldest first")


class KvOpen(DataRequest, method="kv_open", reply=KvOpenReply):
    note = ("short-circuit gets: the KV index this server publishes in shared memory, or "
            "one slab file, handed to a client on this host (only over the server's local "
            "socket: `EPERM` over TCP) whose key may use every namespace (`EACCES` while "
            "some namespace is restricted to other node keys); `ENOENT` for a slab gone, "
            "`EOPNOTSUPP` without a KV store")
    slab: int = Int(lo=0, hi=(1 << 63) - 1, default=0,
                    doc="0: the index; else the slab (its id, from an index slot)")
