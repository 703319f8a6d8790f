"""The metaserver's RPCs: one request class and one reply class each (``docs/rpc.md``).

Every request may carry ``closes`` (handles to release first, see ``MetaRequest``).
Entry calls name their entry with an ``At`` field: ``parent`` + ``name`` or ``path``
(``newparent`` + ``newname`` or ``newpath`` for a rename's or link's destination).
"""
from __future__ import annotations

import errno
import os
from typing import Any

from pfs.core.messages.base import (
    Anything,
    Bool,
    Bytes,
    Empty,
    Int,
    List,
    Map,
    Registry,
    ReplyMessage,
    RequestMessage,
    Str,
)
from pfs.core.messages.records import (
    NAME_MAX,
    PATH_MAX,
    SYMLINK_MAX,
    XATTR_NAME_MAX,
    XATTR_SIZE_MAX,
    At,
    Attr,
    Cred,
    Entry,
    Layout,
    Time,
    Volumes,
    WireCred,
)

REGISTRY = Registry("metaserver")
MAX_CLOSES = 4096  # handles one request may release along with it ("closes")
RENAME_NOREPLACE = 1  # rename's flags
RENAME_EXCHANGE = 2
XATTR_CREATE = 1  # setxattr's flags
XATTR_REPLACE = 2


def _name() -> Any:
    return Bytes(max_len=NAME_MAX, len_code=errno.ENAMETOOLONG)


def _xname() -> Any:
    return Bytes(max_len=XATTR_NAME_MAX, len_code=errno.ERANGE)


class MetaRequest(RequestMessage, registry=REGISTRY):
    """Base of the metaserver's requests."""

    closes: list[int] | None = List(Int(), max_len=MAX_CLOSES, default=None,
                                    doc="handles released before the request")
    unwritten: list[int] | None = List(Int(), max_len=MAX_CLOSES, default=None,
                                       doc="those of `closes` (or a `close`'s handle) "
                                           "that sent nothing to a data server")


class EntryChange(MetaRequest):
    """A change of an entry of a directory (mkdir, mknod, create, unlink, rmdir,
    symlink); ``want_parent`` asks for the directory's new attributes in the reply."""

    at: At = Entry()
    want_parent: bool = Bool(default=False, sparse=True)  # sent only when asked


# ------------------------------------------------------------------ replies
class AttrReply(ReplyMessage):
    attr: dict[str, Any] = Attr()


class EntryReply(ReplyMessage):
    """An entry change: the entry's attributes (none for a removal) and, with
    ``want_parent``, the directory's."""

    attr: dict[str, Any] | None = Attr(default=None)
    parent_attr: dict[str, Any] | None = Attr(default=None)


class HelloReply(ReplyMessage):
    root: int = Int(doc="1")
    version: int = Int(doc="int, the protocol version negotiated on this connection")


class ResolveReply(ReplyMessage):
    attr: dict[str, Any] = Attr()
    parent: int = Int()
    name: bytes = Bytes()


class OpenedReply(ReplyMessage):
    """An open handle and a capability for its data."""

    attr: dict[str, Any] = Attr()
    fh: int = Int()
    layout: dict[str, Any] | None = Layout(default=None)
    cap: bytes = Bytes()
    cap_ttl: float = Anything()
    parent_attr: dict[str, Any] | None = Attr(default=None)
    created: bool = Bool(default=False, sparse=True, doc="the create made the file")


class CapReply(ReplyMessage):
    cap: bytes = Bytes()
    cap_ttl: float = Anything()


class TargetReply(ReplyMessage):
    target: bytes = Bytes(doc="bytes")


class ReaddirReply(ReplyMessage):
    entries: list[Any] = List(doc="[[name, ino, mode, cookie, attr-or-nil], ...]")
    eof: bool = Bool(doc="bool")


class StatfsReply(ReplyMessage):
    bsize: int = Int()
    frsize: int = Int()
    blocks: int = Int()
    bfree: int = Int()
    bavail: int = Int()
    files: int = Int()
    ffree: int = Int()
    namemax: int = Int()


class ValueReply(ReplyMessage):
    value: bytes = Bytes(doc="bytes")


class NamesReply(ReplyMessage):
    names: list[bytes] = List(doc="[bytes]")


class LayoutReply(ReplyMessage):
    layout: dict[str, Any] | None = Map("layout", nil=True)


class ServersReply(ReplyMessage):
    servers: dict[str, Any] = Map(doc='{sid: {"host", "port", "total", "free", "alive", '
                                      '"full", "dirs": [[path, fs, total, free], ...], '
                                      '"state", "draining", "domain", "age", "version", "protocol", '
                                      '"load": {"requests", "bytes_in", "bytes_out", '
                                      '"connections"}, "kv": {"budget", "used", "blocks", "hits", "misses", '
                                      '"evictions"}}}; '
                                      'version, protocol, load and kv: when the server '
                                      'reported them (kv: servers with a KV store)')


class RegisterReply(ReplyMessage):
    """What a data server needs to check clients (absent from a metaserver that checks
    no capabilities)."""

    sid: str = Str()
    cap_key: bytes | None = Bytes(default=None)
    gen: int | None = Int(default=None)
    cap_ttl: float | None = Anything(default=None)
    data_keys: dict[str, bytes] | None = Map(default=None,
                                             doc="{node key name: data-plane key}")
    cap_format: int | None = Int(default=None, doc="the capability format it signs (2: "
                                 "bound, pfs/core/caps.py); absent: 1, from an older "
                                 "metaserver")
    stale: list[int] | None = List(Int(), default=None,
                                   doc="the chains this server was taken out of and is "
                                       "not back in: it serves none of their objects")
    restores: list[Any] | None = List(List(Int(lo=0), max_len=2), default=None,
                                      doc="the store's restore windows [[from, to], ...] "
                                          "(ns): a truncation stamped within one may be "
                                          "unknown to the namespace (`dataserver/cuts.py`)")


class HeartbeatReply(ReplyMessage):
    stale: list[int] | None = List(Int(), default=None,
                                   doc="as in `register`'s reply (absent: none)")


class ChainReply(ReplyMessage):
    chain: list[Any] = List(doc="[chain id, version, [members, head first]]")
    restores: list[Any] | None = List(List(Int(lo=0), max_len=2), default=None,
                                      doc="as in `register`'s reply")


# ------------------------------------------------------------------ requests
class Hello(MetaRequest, method="hello", reply=HelloReply):
    client: str = Str(default="", max_len=256)


class Resolve(MetaRequest, method="resolve", reply=ResolveReply):
    path: bytes = Bytes(max_len=PATH_MAX - 1, len_code=errno.ENAMETOOLONG,
                        doc="bytes, absolute inside pfs, at most 4095 bytes, else ENAMETOOLONG")
    follow: bool = Bool(default=True)
    cred: WireCred = Cred()


class Lookup(MetaRequest, method="lookup", reply=AttrReply):
    parent: int = Int()
    name: bytes = _name()
    cred: WireCred = Cred()


class Getattr(MetaRequest, method="getattr", reply=AttrReply):
    ino: int = Int()


class Setattr(MetaRequest, method="setattr", reply=AttrReply):
    note = "only the attributes given change"
    ino: int = Int()
    cred: WireCred = Cred()
    mode: int | None = Int(default=None)
    uid: int | None = Int(default=None)
    gid: int | None = Int(default=None)
    size: int | None = Int(default=None)
    atime: int | str | None = Time()
    mtime: int | str | None = Time()


class Access(MetaRequest, method="access", reply=Empty):
    ino: int = Int()
    mask: int = Int(doc="R_OK/W_OK/X_OK bits")
    cred: WireCred = Cred()


class Mkdir(EntryChange, method="mkdir", reply=EntryReply):
    mode: int = Int()
    cred: WireCred = Cred()


class Mknod(EntryChange, method="mknod", reply=EntryReply):
    mode: int = Int()
    rdev: int = Int(default=0)
    cred: WireCred = Cred()


class Create(EntryChange, method="create", reply=OpenedReply):
    mode: int = Int()
    flags: int = Int(default=os.O_WRONLY, doc="os.O_* bits, default O_WRONLY")
    cred: WireCred = Cred()


class Open(MetaRequest, method="open", reply=OpenedReply):
    ino: int = Int()
    flags: int = Int(default=os.O_RDONLY, doc="os.O_* bits, default O_RDONLY")
    cred: WireCred = Cred()


class Renew(MetaRequest, method="renew", reply=CapReply):
    note = "a fresh capability for an open handle"
    fh: int = Int()


class Close(MetaRequest, method="close", reply=Empty):
    fh: int = Int()
    written_end: int | None = Int(default=None, doc="int or nil", nil=True)
    mtime: int | None = Int(default=None, doc="int or nil", nil=True)


class Release(MetaRequest, method="release", reply=Empty):
    note = "only its `closes`, below"


class CommitSize(MetaRequest, method="commit_size", reply=AttrReply):
    fh: int = Int()
    written_end: int | None = Int(default=None, doc="int or nil", nil=True)
    mtime: int | None = Int(default=None, doc="int or nil", nil=True)


class Unlink(EntryChange, method="unlink", reply=EntryReply):
    cred: WireCred = Cred()


class Rmdir(EntryChange, method="rmdir", reply=EntryReply):
    cred: WireCred = Cred()


class Rename(MetaRequest, method="rename", reply=Empty):
    at: At = Entry()
    new: At = Entry(prefix="new")
    flags: int = Int(default=0, doc=f"0, RENAME_NOREPLACE={RENAME_NOREPLACE}, "
                                    f"RENAME_EXCHANGE={RENAME_EXCHANGE}")
    cred: WireCred = Cred()


class Link(MetaRequest, method="link", reply=AttrReply):
    ino: int = Int()
    new: At = Entry(prefix="new")
    cred: WireCred = Cred()


class Symlink(EntryChange, method="symlink", reply=EntryReply):
    target: bytes = Bytes(max_len=SYMLINK_MAX, len_code=errno.ENAMETOOLONG)
    cred: WireCred = Cred()


class Readlink(MetaRequest, method="readlink", reply=TargetReply):
    ino: int = Int()


class Readdir(MetaRequest, method="readdir", reply=ReaddirReply):
    ino: int = Int()
    cookie: int = Int(default=0, lo=0, doc="0 = start")
    limit: int = Int(default=1024)
    plus: bool = Bool(default=False)
    cred: WireCred = Cred()


class Statfs(MetaRequest, method="statfs", reply=StatfsReply):
    pass


class Getxattr(MetaRequest, method="getxattr", reply=ValueReply):
    ino: int = Int()
    name: bytes = _xname()
    cred: WireCred = Cred()


class Setxattr(MetaRequest, method="setxattr", reply=Empty):
    ino: int = Int()
    name: bytes = _xname()
    value: bytes = Bytes(max_len=XATTR_SIZE_MAX, len_code=errno.E2BIG)
    flags: int = Int(default=0, doc=f"XATTR_CREATE={XATTR_CREATE}, XATTR_REPLACE={XATTR_REPLACE}")
    cred: WireCred = Cred()


class Listxattr(MetaRequest, method="listxattr", reply=NamesReply):
    ino: int = Int()
    cred: WireCred = Cred()


class Removexattr(MetaRequest, method="removexattr", reply=Empty):
    ino: int = Int()
    name: bytes = _xname()
    cred: WireCred = Cred()


class GetLayout(MetaRequest, method="get_layout", reply=LayoutReply):
    ino: int = Int()


class SetLayout(MetaRequest, method="set_layout", reply=LayoutReply):
    ino: int = Int()
    unit: int = Int(default=0)
    count: int = Int(default=0)
    replicas: int = Int(default=0)
    durable: bool | None = Bool(default=None, doc="bool: false, close() does not sync the "
                                "data (scratch); absent: unchanged")
    cred: WireCred = Cred()


class Servers(MetaRequest, method="servers", reply=ServersReply):
    pass


class Register(MetaRequest, method="register", reply=RegisterReply):
    note = "data servers only"
    sid: str | None = Str(default=None, max_len=128, doc="str or nil, at most 128",
                          nil=True)
    host: str = Str(max_len=1024)
    port: int = Int(lo=1, hi=65535)
    total: int = Int(lo=0)
    free: int = Int(lo=0)
    dirs: list[Any] | None = Volumes()
    domain: str | None = Str(default=None, max_len=256,
                             doc="its failure domain (a rack label); absent: its host")
    version: str | None = Str(default=None, max_len=64,
                              doc="its package version (absent: an older server)")
    protocol: list[int] | None = List(Int(lo=0), default=None, max_len=2,
                                      doc="[lowest, highest] wire protocol version it "
                                          "speaks (absent: an older server)")
    kv: list[int] | None = List(Int(lo=0), default=None, max_len=8,
                                doc="its KV-cache blocks: [budget, used (bytes), blocks, "
                                    "hits, misses, evictions (since it started)] (absent: "
                                    "no KV store, or an older server)")


class ChainDrop(MetaRequest, method="chain_drop", reply=ChainReply):
    note = ("a chain member could not forward a write to `sid` (dead, or no answer "
            "within the deadline), or a client could not reach the head `sid` (the "
            "metaserver checks: `EAGAIN` when it answers): take it out of the chain (a "
            "new version; it becomes stale). Idempotent; the chain as it is now")
    chain: int = Int(lo=1)
    sid: str = Str(max_len=128)


class GetChain(MetaRequest, method="get_chain", reply=ChainReply):
    note = ("data servers only: a chain as it is now (a client named a version newer than "
            "the server had seen)")
    chain: int = Int(lo=1)


class Heartbeat(MetaRequest, method="heartbeat", reply=HeartbeatReply):
    note = "data servers only"
    sid: str = Str(max_len=128)
    total: int = Int()
    free: int = Int()
    dirs: list[Any] | None = Volumes()
    load: list[int] | None = List(Int(lo=0), default=None, max_len=4,
                                  doc="[requests/s, bytes in/s, bytes out/s, open "
                                      "connections] over the last heartbeat interval "
                                      "(absent: an older server)")
    version: str | None = Str(default=None, max_len=64, doc="as in `register` (a "
                                                            "metaserver restarted since "
                                                            "learns it here)")
    protocol: list[int] | None = List(Int(lo=0), default=None, max_len=2,
                                      doc="as in `register`")
    kv: list[int] | None = List(Int(lo=0), default=None, max_len=8, doc="as in `register`")


# ------------------------------------------------------------------ admin scans (pfs fsck)
MAX_SCAN = 4096  # records one scan request reads


class ScanInodesReply(ReplyMessage):
    inodes: list[Any] = List(doc="[[ino, size, layout-or-nil], ...]: the regular files "
                                 "among the inodes read, in inode order")
    next: int = Int(doc="int, the `after` of the next page")
    end: bool = Bool(doc="bool, no inode after these")


class ScanDeletingReply(ReplyMessage):
    entries: list[Any] = List(doc="[[seq, ino, layout], ...] in queue order")
    next: int = Int(doc="int, the `start` of the next page")
    end: bool = Bool(doc="bool")


class ScanInodes(MetaRequest, method="scan_inodes", reply=ScanInodesReply):
    note = "root only (`EPERM`): every inode after `after`, a page at a time (pfs fsck)"
    after: int = Int(default=0, lo=0, hi=(1 << 63) - 1, doc="int, 0 = from the start")
    limit: int = Int(default=1024, lo=1, hi=MAX_SCAN, doc=f"inodes read, at most {MAX_SCAN}")
    cred: WireCred = Cred()


class ScanDeleting(MetaRequest, method="scan_deleting", reply=ScanDeletingReply):
    note = "root only (`EPERM`): the deletion queue from sequence number `start`"
    start: int = Int(default=0, lo=0, hi=(1 << 63) - 1, doc="int, 0 = from the start")
    limit: int = Int(default=1024, lo=1, hi=MAX_SCAN, doc=f"entries, at most {MAX_SCAN}")
    cred: WireCred = Cred()


class ScanCap(MetaRequest, method="scan_cap", reply=CapReply):
    note = ("root only (`EPERM`): a read-only capability for every object on every data "
            "server (rights READ and SCAN, inode 0): what `list_objects` and `verify` take")
    cred: WireCred = Cred()


# ------------------------------------------------------------------ failure detection
class ServerStateReply(ReplyMessage):
    state: str = Str(doc='"up", "suspect", "down", "draining" or "full"')


class ReportServer(MetaRequest, method="report_server", reply=ServerStateReply):
    note = ("a client could not reach data server `sid` (`errno`: what it saw); the "
            "metaserver probes it itself (at most once a second per server) before "
            "taking it out of placement")
    sid: str = Str(max_len=128)
    errno: int = Int(lo=0, hi=4095)


class Drain(MetaRequest, method="drain", reply=ServerStateReply):
    note = ("root only (`EPERM`): mark data server `sid` draining (placement skips it; "
            "durable) or, with `on` false, not; `ENOENT` for an unknown server")
    sid: str = Str(max_len=128)
    on: bool = Bool(default=True)
    cred: WireCred = Cred()


class RepairReply(ReplyMessage):
    status: dict[str, Any] = Map(doc='{"chains", "short", "joining": [{"chain", "members", '
                                     '"joining", "leaving"}], "copying": [{"chain", '
                                     '"target", "seconds"}], "stale": {chain: [sid, ...] '
                                     'not caught up},  "objects_copied", '
                                     '"bytes_copied", "copy_rate" (bytes/s while '
                                     'copying), "chains_copied", "rate" (the bound), "draining": {sid: '
                                     'memberships}, "memberships", "down", "lost_after", '
                                     '"lost", "rebalancing"}')


class RepairStatus(MetaRequest, method="repair_status", reply=RepairReply):
    note = "repair's progress (docs/architecture.md \"Repair\")"


class Lost(MetaRequest, method="lost", reply=RepairReply):
    note = ("root only (`EPERM`): data server `sid` is lost for good: out of every chain "
            "(never put back), which get new members; `ENOENT` for an unknown server")
    sid: str = Str(max_len=128)
    cred: WireCred = Cred()


class Rebalance(MetaRequest, method="rebalance", reply=RepairReply):
    note = ("root only (`EPERM`): move chain memberships from the most loaded data "
            "servers to the least loaded (a new one), at the repair rate")
    cred: WireCred = Cred()


# ------------------------------------------------------------------ batched calls
# Many entries in one request, for callers that have many (the native API's
# create_many, stat_many, unlink_many): one round trip, and for the changes one commit
# (one fsync) for them all. Each entry succeeds or fails alone; the reply has a result
# per path, in order.
MAX_MANY = 1024  # paths in one batched request (a batch's commit holds the writer)


def _paths() -> Any:
    return List(Bytes(max_len=PATH_MAX - 1, len_code=errno.ENAMETOOLONG),
                max_len=MAX_MANY, doc=f"[absolute path, ...], at most {MAX_MANY}")


class ManyReply(ReplyMessage):
    results: list[Any] = List(doc="per path, in order: [0, attr] (attr nil for an unlink) "
                                  "or [errno, message]")


class CreateMany(MetaRequest, method="create_many", reply=ManyReply):
    note = ("create each path as an empty regular file (O_CREAT, with `exclusive` "
            "O_EXCL; an existing file is then left as it is) and close it; all in one "
            "commit, each path failing alone")
    paths: list[bytes] = _paths()
    mode: int = Int(lo=0, hi=0o7777)
    exclusive: bool = Bool(default=True)
    cred: WireCred = Cred()


class StatMany(MetaRequest, method="stat_many", reply=ManyReply):
    note = "resolve each path (as `resolve` does): its attributes or its error"
    paths: list[bytes] = _paths()
    follow: bool = Bool(default=True)
    cred: WireCred = Cred()


class UnlinkMany(MetaRequest, method="unlink_many", reply=ManyReply):
    note = "unlink each path (as `unlink` does); all in one commit, each path failing alone"
    paths: list[bytes] = _paths()
    cred: WireCred = Cred()
