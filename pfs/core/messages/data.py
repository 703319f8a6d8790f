"""The data server's RPCs: one request class and one reply class each (``docs/rpc.md``).

``obj`` is an object id ``[ino, stripe]``; offsets and sizes are in ``[0, 2**63)``
(``EINVAL`` otherwise). ``cap`` is the capability the metaserver signed; its checks
(and their ``EACCES``/``ESTALE``) are the server's, so any value passes here.
"""
from __future__ import annotations

import errno
from typing import Any

from pfs.core.messages.base import (
    Anything,
    Bool,
    Empty,
    Int,
    List,
    Payload,
    Registry,
    ReplyMessage,
    RequestMessage,
    Str,
)
from pfs.core.messages.records import MAX_ID, Obj, ObjId, ObjIdField

REGISTRY = Registry("dataserver")
MAX_DELETE = 1 << 16  # object ids in one delete request
MAX_SYNC = 1 << 16  # object ids in one sync request
MAX_CHAIN = 16  # members a forwarded write names after the receiver
# a chain version the data server does not agree with (the client's is older, or this
# server was taken out of the chain): refresh the layout (get_layout) and retry
CHAIN_STALE = errno.EREMCHG


def _offset(doc: str = "") -> Any:
    return Int(lo=0, hi=MAX_ID - 1, doc=doc or "int in [0, 2**63)")


def _cap(doc: str = "") -> Any:
    return Anything(default=None, doc=doc or "bytes")


class DataRequest(RequestMessage, registry=REGISTRY):
    """Base of the data server's requests."""


# ------------------------------------------------------------------ replies
class CountReply(ReplyMessage):
    n: int = Int()
    ver: int | None = Int(default=None, doc="a write's chain changed while it went down the "
                                          "chain (a member taken out): the version it "
                                          "finished under (the writer fetches the layout)")


class ReadReply(ReplyMessage):
    payload_doc = ("payload of `n <= len` bytes (short past the object's end: the "
                   "reader fills zeros up to the file size)")
    n: int = Int()
    crcs: list[int] | None = List(Int(), default=None,
                           doc="the checksums of the whole blocks inside the payload, "
                               "from the first block boundary at or after `off`: the "
                               "reader verifies them (`pfs/core/checksums.py`); absent "
                               "for an object without checksums")


class SizeReply(ReplyMessage):
    note = "0 when absent"
    size: int = Int()


class FdReply(ReplyMessage):
    payload_doc = ("as SCM_RIGHTS ancillary data on the reply's first byte, a read-only "
                   "descriptor of the object file, then one of its checksum sidecar when "
                   "it has one (the client verifies what it reads); only over the "
                   "server's local socket (`EPERM` over TCP), `ENOENT` when the object "
                   "holds no data, `EIO` when it is missing but its block map says data "
                   "was written")
    size: int = Int()


class DeletedReply(ReplyMessage):
    deleted: int = Int(doc="int")


class SyncReply(ReplyMessage):
    dirty: int = Int(doc="how many of the objects held writes not yet synced (as far as "
                         "this server process knows: a restart forgets)")


class DataStatfsReply(ReplyMessage):
    total: int = Int()
    free: int = Int()
    objects: int = Int()
    scrubbed: int = Int(default=0, doc="bytes the scrubber verified since the server started")
    scrub_errors: int = Int(default=0, doc="bad blocks the scrubber found since the server "
                                           "started")
    repaired: int = Int(default=0, doc="replicas replaced by a good copy from a chain peer "
                                       "(scrubber, `repair_object`) since it started")
    repair_failed: int = Int(default=0, doc="repairs that found no good copy")
    lost_dirs: list[str] | None = List(Str(), default=None,
                                       doc="data directories lost and not restored yet")


class VerifyReply(ReplyMessage):
    blocks: int = Int(doc="blocks checked")
    bad: list[int] = List(Int(), doc="offsets of the blocks whose checksum does not match "
                                     "(or that the object is too short for)")
    unchecked: bool = Bool(doc="the object has no checksums (written before them)")


# ------------------------------------------------------------------ requests
def _chain() -> Any:
    return Int(default=None, lo=0, hi=MAX_ID - 1,
               doc="the stripe's chain id (absent: a layout from before chains)")


def _ver() -> Any:
    return Int(default=None, lo=0, hi=MAX_ID - 1,
               doc="the chain's version the sender knows; an older one than the "
                   f"server's, or a chain it was taken out of: `EREMCHG` ({CHAIN_STALE})")


class Read(DataRequest, method="read", reply=ReadReply):
    obj: ObjId = Obj()
    off: int = _offset()
    len: int = Int(lo=0, doc="at most Limits.max_payload")
    cap: Any = _cap()
    chain: int | None = _chain()
    ver: int | None = _ver()
    copy: bool = Bool(default=False, sparse=True,
                      doc="copy the bytes under the blocks' lock, never sendfile: the "
                          "re-read after a checksum mismatch (a block sent from the file "
                          "can change until the peer received it)")


class Write(DataRequest, method="write", reply=CountReply):
    note = ("to a chain's head, which applies it and forwards it down `fwd`; "
            "acknowledged once the tail has it (docs/architecture.md \"Replication\")")
    payload_doc = "the bytes"
    obj: ObjId = Obj()
    off: int = _offset()
    cap: Any = _cap()
    payload: Any = Payload(default=None)
    chain: int | None = _chain()
    ver: int | None = _ver()
    fwd: list[str] | None = List(Str(max_len=128), default=None, max_len=MAX_CHAIN,
                                 doc="the chain's members after the receiver, in order: "
                                     "it forwards the write to the first")
    seq: int | None = Int(default=None, lo=1, hi=MAX_ID - 1,
                          doc="the write's sequence number in its object, given by the "
                              "head (absent: from a client, the receiver is the head)")


class Truncate(DataRequest, method="truncate", reply=Empty):
    obj: ObjId = Obj()
    size: int = _offset()
    cap: Any = _cap("bytes, admin")
    at: int | None = Int(default=None, lo=0, nil=True,
                         doc="the metaserver's clock at the truncation (ns): what its "
                             "truncation record is stamped with (`dataserver/cuts.py`); "
                             "absent: the data server's")


class Delete(DataRequest, method="delete", reply=DeletedReply):
    objs: list[ObjId] = List(ObjIdField(), max_len=MAX_DELETE, doc="list of object ids, at most 65536")
    tomb: bool = Bool(default=False, sparse=True,
                      doc="their file was unlinked: keep a tombstone of each that existed "
                          "(a read of it after a metadata restore is EIO, not a hole)")
    cap: Any = _cap("bytes, admin")


class Fsync(DataRequest, method="fsync", reply=Empty):
    obj: ObjId = Obj()
    cap: Any = _cap()


class Sync(DataRequest, method="sync", reply=SyncReply):
    note = ("each object's data to stable storage (fdatasync, in parallel), and the "
            "directory entry of one created since; absent objects are skipped. A "
            "client's close and fsync send one per server, listing what it wrote there")
    objs: list[ObjId] = List(ObjIdField(), max_len=MAX_SYNC,
                             doc="list of object ids, at most 65536")
    cap: Any = _cap()


class StatObj(DataRequest, method="stat_obj", reply=SizeReply):
    obj: ObjId = Obj()
    cap: Any = _cap()


class Statfs(DataRequest, method="statfs", reply=DataStatfsReply):
    pass


class Verify(DataRequest, method="verify", reply=VerifyReply):
    note = ("re-read every block of the object and check it against its checksum "
            "(`pfs fsck`); an absent object checks 0 blocks")
    obj: ObjId = Obj()
    cap: Any = _cap("bytes, read or admin")


class OpenFd(DataRequest, method="open_fd", reply=FdReply):
    obj: ObjId = Obj()
    cap: Any = _cap("bytes, read")


# ------------------------------------------------------------------ checking (pfs fsck)
MAX_LIST = 16384  # objects in one list_objects reply


def _after() -> Any:
    return ObjIdField(default=None, doc="object id, or absent: from the start")


class ListObjectsReply(ReplyMessage):
    objects: list[Any] = List(doc="[[ino, stripe, size, allocated, written, holes], ...] "
                                  "in object id order (`allocated`: bytes of disk the "
                                  "file holds; `written`, `holes`: its block map's data "
                                  "end and unwritten blocks before it, -1: no map; size "
                                  "-1: the object is gone, its block map remains)")
    end: bool = Bool(doc="bool, no object after these")


class ListObjects(DataRequest, method="list_objects", reply=ListObjectsReply):
    note = ("the objects held here after `after`, a page at a time; a capability with "
            "SCAN (or ADMIN) for inode 0 (`pfs fsck`)")
    after: ObjId | None = _after()
    limit: int = Int(default=4096, lo=1, hi=MAX_LIST, doc=f"at most {MAX_LIST}")
    cap: Any = _cap("bytes, scan")


# ------------------------------------------------------------------ chains: catch-up
class CatchUpReply(ReplyMessage):
    n: int = Int(doc="objects copied")
    nbytes: int = Int(default=0, doc="bytes copied")


class CatchUp(DataRequest, method="catch_up", reply=CatchUpReply):
    note = ("the metaserver to a chain's head: copy every object of chain `chain` held "
            "here to `target` (a member joining the chain again), each under its "
            "whole-object lock; `n`: objects copied. A capability with ADMIN for inode 0")
    chain: int = Int(lo=1, hi=MAX_ID - 1)
    ver: int = Int(lo=0, hi=MAX_ID - 1, doc="the chain's version with `target` in it: "
                                          "writes naming an older one are refused from now")
    target: str = Str(max_len=128)
    cap: Any = _cap("bytes, admin")
    rate: int | None = Int(default=None, lo=0, nil=True,
                           doc="bytes per second at most (repair's bound); nil: unbounded")


class Install(DataRequest, method="install", reply=CountReply):
    note = ("data servers only (the head of a catch-up): a piece of a whole object's "
            "copy. `off` 0 empties the object first; `last` cuts it to `size` and "
            "records the chain version")
    payload_doc = "the bytes at `off`"
    obj: ObjId = Obj()
    off: int = _offset()
    size: int = _offset()
    chain: int = Int(lo=1, hi=MAX_ID - 1)
    ver: int = Int(lo=0, hi=MAX_ID - 1)
    seq: int = Int(lo=0, hi=MAX_ID - 1)
    last: bool = Bool(default=False)
    crc: int | None = Int(default=None, lo=0, hi=(1 << 32) - 1, nil=True,
                          doc="CRC32C of the payload (the target checks it, `EIO`)")
    cuts: list[Any] | None = List(List(Int(lo=0), max_len=2), default=None, max_len=64,
                                  doc="with `last`: the object's truncation records "
                                      "[[at, end], ...] (`dataserver/cuts.py`), which "
                                      "replace the target's")
    payload: Any = Payload(default=None)


class InstallTombs(DataRequest, method="install_tombs", reply=CountReply):
    note = ("data servers only (the head of a catch-up, after its objects): tombstones "
            "the head holds (`dataserver/tombstones.py`), so a member that joined after "
            "a deletion answers `EIO` for it too; a replica of chain `chain` held here "
            "whose object the head tombstoned (a delete it missed) is deleted. `n`: "
            "tombstones new here")
    chain: int = Int(lo=1, hi=MAX_ID - 1)
    objs: list[ObjId] = List(ObjIdField(), max_len=MAX_DELETE,
                             doc=f"list of object ids, at most {MAX_DELETE}")


# ------------------------------------------------------------------ object repair
class FetchReply(ReplyMessage):
    payload_doc = "the object's bytes at `off`, every block verified against its checksum"
    n: int = Int()
    size: int = Int(doc="the object's size now")
    rec: list[int] | None = List(Int(), default=None,
                                 doc="its chain record [chain, version, sequence]; absent: "
                                     "none")
    tomb: bool = Bool(default=False, sparse=True,
                      doc="the object is absent and tombstoned here (its file was "
                          "unlinked): the repairer records the tombstone, copies nothing")
    cuts: list[Any] | None = List(List(Int(lo=0), max_len=2), default=None, max_len=64,
                                  doc="its truncation records [[at, end], ...] "
                                      "(`dataserver/cuts.py`), which the repaired "
                                      "replica takes")


class Fetch(DataRequest, method="fetch", reply=FetchReply):
    note = ("data servers only (object repair, `repair_object`): a piece of an object "
            "replica, verified here against its checksums (`EIO` on a mismatch: the "
            "repairer tries again or another member). Takes no block lock: a write "
            "landing meanwhile reaches the repairer after the copy, in the chain's order")
    obj: ObjId = Obj()
    off: int = _offset()
    len: int = Int(lo=0, doc="at most Limits.max_payload")


class RepairObject(DataRequest, method="repair_object", reply=CountReply):
    note = ("replace this server's replica of `obj` with a verified copy from another "
            "member of its chain, under the object's whole lock (`pfs fsck --repair`, the "
            "scrubber); `n`: bytes copied. `EIO` for an object of an unreplicated file "
            "(no other member). A capability with SCAN or ADMIN for inode 0")
    obj: ObjId = Obj()
    chain: int | None = Int(default=None, lo=1, hi=MAX_ID - 1,
                            doc="the stripe's chain (from its layout); absent: the "
                                "replica's own record")
    cap: Any = _cap("bytes, scan or admin")


class RemoveOrphans(DataRequest, method="remove_orphans", reply=DeletedReply):
    note = ("`pfs fsck --repair --remove-orphans`: delete objects no file references. A "
            "capability with SCAN or ADMIN for inode 0 (root's `scan_cap`)")
    objs: list[ObjId] = List(ObjIdField(), max_len=MAX_DELETE,
                             doc="list of object ids, at most 65536")
    tomb: bool = Bool(default=False, sparse=True,
                      doc="no file has their inode: keep a tombstone of each (as `delete`)")
    cap: Any = _cap("bytes, scan or admin")
