"""Metadata plans: the client-side logic of the path API and of file handles (open with
the O_CREAT fallback, commit and close with their retries, renew and reopen), written
once as plans (:mod:`pfs.client.plan`) that yield :class:`~pfs.client.plan.MetaCall`
and :class:`~pfs.client.plan.Sleep`. ``AsyncClient`` carries them out on the trio
driver, the sync client on the blocking driver in the caller's thread: neither runs the
other's coroutines, and a plan never waits by itself (a ``Sleep`` is an effect too).

Each metaserver operation is one plan here (``meta_*``: its typed request of
:mod:`pfs.core.messages.meta`, and how its reply is read), whoever runs it: the path API
below names entries with a path ``At`` (the metaserver resolves it in the same round
trip, docs/rpc.md), ``MetaClient``'s methods by inode with a parent + name ``At``.
"""
from __future__ import annotations

import errno
import logging
import os
import posixpath
import stat as statmod
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pfs.client.plan import DeferClose, MetaCall, Plan, Sleep
from pfs.client.plan import sync as sync_objects
from pfs.client.types import Cred, DirEntry, StatResult, fsname
from pfs.core import errors as E
from pfs.core.messages import meta as M
from pfs.core.messages.records import NOW, At, WireCred

if TYPE_CHECKING:  # types only: aio builds its methods on these plans
    from pfs.client.aio import AsyncClient, FileHandle

log = logging.getLogger(__name__)

READDIR_PAGE = 1024


def norm(path: str | bytes) -> str:
    p = os.fsdecode(path)
    if not p:
        raise OSError(errno.ENOENT, "empty path")
    if "\0" in p:
        raise OSError(errno.EINVAL, "path contains a NUL byte")
    return posixpath.normpath("/" + p) if not p.startswith("/") else p


_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def _path(path: str | bytes) -> bytes:
    """``fsname(norm(path))``; an absolute str path (what programs pass) in one step."""
    if type(path) is str and path[:1] == "/" and "\0" not in path:
        return path.encode(_FS_ENCODING, _FS_ERRORS)  # (what os.fsencode does)
    return fsname(norm(path))


# -- the metadata operations: each request built and its reply read once, run by the
# path API below, by ``MetaClient``'s methods (by inode, the mount's view) and by file
# handles, over either driver. An entry is an ``At``: parent + name, or a path.
def meta_resolve(path: bytes, follow: bool, cred: WireCred) -> Plan[tuple[StatResult, int, bytes]]:
    r = yield MetaCall(M.Resolve(path=path, follow=follow, cred=cred))
    return StatResult.from_wire(r.attr), r.parent, r.name


def meta_lookup(parent: int, name: bytes, cred: WireCred) -> Plan[StatResult]:
    return StatResult.from_wire((yield MetaCall(M.Lookup(parent=parent, name=name,
                                                         cred=cred))).attr)


def meta_getattr(ino: int) -> Plan[StatResult]:
    return StatResult.from_wire((yield MetaCall(M.Getattr(ino=ino))).attr)


def meta_setattr(ino: int, cred: WireCred, **changes: Any) -> Plan[StatResult]:
    """Change the attributes given (None: unchanged); a bad size is refused here."""
    size = changes.get("size")
    if size is not None:
        E.check_size(size, f"truncate of inode {ino}")
    r = yield MetaCall(M.Setattr(ino=ino, cred=cred, **changes))
    return StatResult.from_wire(r.attr)


def meta_access(ino: int, mask: int, cred: WireCred) -> Plan[None]:
    yield MetaCall(M.Access(ino=ino, mask=mask, cred=cred))


def _parent(r: Any) -> StatResult | None:
    """The directory's attributes after an entry change, when the request asked for them
    (``want_parent``, docs/rpc.md), else None."""
    pa = r.parent_attr
    return StatResult.from_wire(pa) if pa is not None else None


# The six entry changes take ``want_parent``: the parent's attributes after the change
# come back as the last value (None without it). Each is one plan, not a plan over a
# shared sub-plan: these are the hot paths, and a level of generators costs.
def meta_mkdir(at: At, mode: int, cred: WireCred, want_parent: bool = False
               ) -> Plan[tuple[StatResult, StatResult | None]]:
    r = yield MetaCall(M.Mkdir(at=at, mode=mode, cred=cred, want_parent=want_parent))
    return StatResult.from_wire(r.attr), _parent(r)


def meta_mknod(at: At, mode: int, rdev: int, cred: WireCred, want_parent: bool = False
               ) -> Plan[tuple[StatResult, StatResult | None]]:
    r = yield MetaCall(M.Mknod(at=at, mode=mode, rdev=rdev, cred=cred,
                               want_parent=want_parent))
    return StatResult.from_wire(r.attr), _parent(r)


def meta_create(at: At, mode: int, flags: int, cred: WireCred, want_parent: bool = False
                ) -> Plan[tuple[M.OpenedReply, StatResult | None]]:
    r = yield MetaCall(M.Create(at=at, mode=mode, flags=flags, cred=cred,
                                want_parent=want_parent))
    return r, _parent(r)


def meta_open(ino: int, flags: int, cred: WireCred) -> Plan[M.OpenedReply]:
    return (yield MetaCall(M.Open(ino=ino, flags=flags, cred=cred)))  # type: ignore[no-any-return]


def meta_close(fh: int, written_end: int | None = None, mtime: int | None = None,
               unwritten: bool = False) -> Plan[None]:
    yield MetaCall(M.Close(fh=fh, written_end=written_end, mtime=mtime,
                           unwritten=[fh] if unwritten else None))


def meta_renew(fh: int) -> Plan[M.CapReply]:
    return (yield MetaCall(M.Renew(fh=fh)))  # type: ignore[no-any-return]


def meta_commit_size(fh: int, written_end: int | None, mtime: int | None = None
                     ) -> Plan[StatResult]:
    r = yield MetaCall(M.CommitSize(fh=fh, written_end=written_end, mtime=mtime))
    return StatResult.from_wire(r.attr)


def meta_unlink(at: At, cred: WireCred, want_parent: bool = False) -> Plan[StatResult | None]:
    return _parent((yield MetaCall(M.Unlink(at=at, cred=cred, want_parent=want_parent))))


def meta_rmdir(at: At, cred: WireCred, want_parent: bool = False) -> Plan[StatResult | None]:
    return _parent((yield MetaCall(M.Rmdir(at=at, cred=cred, want_parent=want_parent))))


def meta_rename(at: At, new: At, flags: int, cred: WireCred) -> Plan[None]:
    yield MetaCall(M.Rename(at=at, new=new, flags=flags, cred=cred))


def meta_link(ino: int, new: At, cred: WireCred) -> Plan[StatResult]:
    return StatResult.from_wire((yield MetaCall(M.Link(ino=ino, new=new, cred=cred))).attr)


def meta_symlink(at: At, target: bytes, cred: WireCred, want_parent: bool = False
                 ) -> Plan[tuple[StatResult, StatResult | None]]:
    r = yield MetaCall(M.Symlink(at=at, target=target, cred=cred, want_parent=want_parent))
    return StatResult.from_wire(r.attr), _parent(r)


def meta_readlink(ino: int) -> Plan[bytes]:
    return (yield MetaCall(M.Readlink(ino=ino))).target  # type: ignore[no-any-return]


def meta_readdir(ino: int, cookie: int, limit: int, plus: bool, cred: WireCred,
                 base: str = "") -> Plan[tuple[list[DirEntry], bool]]:
    """A page of entries (their ``path`` under ``base``; empty without it) and whether
    it is the last."""
    r = yield MetaCall(M.Readdir(ino=ino, cookie=cookie, limit=limit, plus=plus, cred=cred))
    out = []
    for raw, child, mode, ck, a in r.entries:
        name = os.fsdecode(raw)
        out.append(DirEntry(name, posixpath.join(base, name) if base else "", child, mode, ck,
                            StatResult.from_wire(a) if a else None))
    return out, bool(r.eof)


def meta_statfs() -> Plan[M.StatfsReply]:
    return (yield MetaCall(M.Statfs()))  # type: ignore[no-any-return]


def meta_getxattr(ino: int, name: bytes, cred: WireCred) -> Plan[bytes]:
    r = yield MetaCall(M.Getxattr(ino=ino, name=name, cred=cred))
    return r.value  # type: ignore[no-any-return]


def meta_setxattr(ino: int, name: bytes, value: bytes, flags: int, cred: WireCred) -> Plan[None]:
    yield MetaCall(M.Setxattr(ino=ino, name=name, value=value, flags=flags, cred=cred))


def meta_listxattr(ino: int, cred: WireCred) -> Plan[list[bytes]]:
    return (yield MetaCall(M.Listxattr(ino=ino, cred=cred))).names  # type: ignore[no-any-return]


def meta_removexattr(ino: int, name: bytes, cred: WireCred) -> Plan[None]:
    yield MetaCall(M.Removexattr(ino=ino, name=name, cred=cred))


def meta_get_layout(ino: int) -> Plan[dict[str, Any]]:
    """The file's layout (None for symlinks and devices)."""
    return (yield MetaCall(M.GetLayout(ino=ino))).layout  # type: ignore[no-any-return]


def meta_set_layout(ino: int, unit: int, count: int, replicas: int, cred: WireCred,
                    durable: bool | None = None) -> Plan[dict[str, Any]]:
    r = yield MetaCall(M.SetLayout(ino=ino, unit=unit, count=count, replicas=replicas,
                                   durable=durable, cred=cred))
    return r.layout  # type: ignore[no-any-return]


def meta_servers() -> Plan[dict[str, dict[str, Any]]]:
    return (yield MetaCall(M.Servers())).servers  # type: ignore[no-any-return]


# -- the path API -----------------------------------------------------------------------
def _cred(c: AsyncClient) -> WireCred:
    return c.meta.wire_cred(c.cred)


def resolve(c: AsyncClient, path: str, follow: bool = True) -> Plan[StatResult]:
    return (yield from meta_resolve(fsname(path), follow, _cred(c)))[0]


def stat(c: AsyncClient, path: str | bytes, follow_symlinks: bool = True) -> Plan[StatResult]:
    # meta_resolve's request, not a plan over it: a hot path (see the entry changes)
    r = yield MetaCall(M.Resolve(path=_path(path), follow=follow_symlinks, cred=_cred(c)))
    return c.merged_attr(StatResult.from_wire(r.attr))


def lstat(c: AsyncClient, path: str | bytes) -> Plan[StatResult]:
    return (yield from stat(c, path, False))


def exists(c: AsyncClient, path: str | bytes) -> Plan[bool]:
    try:
        yield from stat(c, path)
    except FileNotFoundError:
        return False
    return True


def scandir(c: AsyncClient, path: str | bytes = "/", plus: bool = False) -> Plan[list[DirEntry]]:
    base = norm(path)
    attr = yield from stat(c, base)
    if not attr.is_dir():
        raise OSError(errno.ENOTDIR, f"{base}: not a directory")
    out: list[DirEntry] = []
    cookie = 0
    while True:
        page, eof = yield from meta_readdir(attr.st_ino, cookie, READDIR_PAGE, plus, _cred(c),
                                            base)
        out.extend(page)
        if eof or not page:
            return out
        cookie = page[-1].cookie


def listdir(c: AsyncClient, path: str | bytes = "/") -> Plan[list[str]]:
    return [e.name for e in (yield from scandir(c, path))]


def mkdir(c: AsyncClient, path: str | bytes, mode: int = 0o777) -> Plan[None]:
    yield from meta_mkdir(At.by_path(_path(path)), mode & ~c.umask, _cred(c))


def makedirs(c: AsyncClient, path: str | bytes, mode: int = 0o777,
             exist_ok: bool = False) -> Plan[None]:
    p = norm(path).rstrip("/")
    if not p:
        if exist_ok:
            return
        raise OSError(errno.EEXIST, "/ exists")
    head = posixpath.dirname(p)
    if head and head != "/" and not (yield from exists(c, head)):
        yield from makedirs(c, head, mode, exist_ok=True)
    try:
        yield from mkdir(c, p, mode)
    except FileExistsError:
        if not exist_ok or not (yield from stat(c, p)).is_dir():
            raise


def remove(c: AsyncClient, path: str | bytes) -> Plan[None]:
    yield MetaCall(M.Unlink(at=At.by_path(_path(path)), cred=_cred(c)))  # (as stat)


def rmdir(c: AsyncClient, path: str | bytes) -> Plan[None]:
    yield from meta_rmdir(At.by_path(_path(path)), _cred(c))


def rename(c: AsyncClient, src: str | bytes, dst: str | bytes, flags: int = 0) -> Plan[None]:
    yield from meta_rename(At.by_path(_path(src)), At.by_path(_path(dst)), flags, _cred(c))


def link(c: AsyncClient, src: str | bytes, dst: str | bytes) -> Plan[None]:
    attr = yield from lstat(c, src)
    yield from meta_link(attr.st_ino, At.by_path(_path(dst)), _cred(c))


def symlink(c: AsyncClient, target: str | bytes, path: str | bytes) -> Plan[None]:
    yield from meta_symlink(At.by_path(_path(path)), fsname(target), _cred(c))


def readlink(c: AsyncClient, path: str | bytes) -> Plan[str]:
    attr = yield from lstat(c, path)
    return os.fsdecode((yield from meta_readlink(attr.st_ino)))


def set_attr(ino: int, cred: Cred, **changes: Any) -> Plan[StatResult]:
    return (yield from meta_setattr(ino, (cred.uid, cred.gid, tuple(cred.groups)), **changes))


def chmod(c: AsyncClient, path: str | bytes, mode: int) -> Plan[None]:
    attr = yield from stat(c, path)
    yield from meta_setattr(attr.st_ino, _cred(c), mode=mode & 0o7777)


def chown(c: AsyncClient, path: str | bytes, uid: int, gid: int) -> Plan[None]:
    attr = yield from stat(c, path)
    yield from meta_setattr(attr.st_ino, _cred(c), uid=None if uid < 0 else uid,
                            gid=None if gid < 0 else gid)


def utime(c: AsyncClient, path: str | bytes, times: tuple[float, float] | None = None,
          ns: tuple[int, int] | None = None) -> Plan[None]:
    attr = yield from stat(c, path)
    at: Any
    mt: Any
    if ns is not None:
        at, mt = ns
    elif times is not None:
        at, mt = int(times[0] * 1e9), int(times[1] * 1e9)
    else:
        at = mt = NOW
    yield from meta_setattr(attr.st_ino, _cred(c), atime=at, mtime=mt)


def truncate(c: AsyncClient, path: str | bytes, size: int) -> Plan[None]:
    E.check_size(size, f"truncate of {os.fsdecode(path)}")
    attr = yield from stat(c, path)
    yield from meta_setattr(attr.st_ino, _cred(c), size=size)
    c.truncated(attr.st_ino, size)


def getxattr(c: AsyncClient, path: str | bytes, name: str | bytes) -> Plan[bytes]:
    attr = yield from stat(c, path)
    return (yield from meta_getxattr(attr.st_ino, fsname(name), _cred(c)))


def setxattr(c: AsyncClient, path: str | bytes, name: str | bytes, value: bytes,
             flags: int = 0) -> Plan[None]:
    attr = yield from stat(c, path)
    yield from meta_setxattr(attr.st_ino, fsname(name), bytes(value), flags, _cred(c))


def listxattr(c: AsyncClient, path: str | bytes) -> Plan[list[str]]:
    attr = yield from stat(c, path)
    return [os.fsdecode(n) for n in (yield from meta_listxattr(attr.st_ino, _cred(c)))]


def removexattr(c: AsyncClient, path: str | bytes, name: str | bytes) -> Plan[None]:
    attr = yield from stat(c, path)
    yield from meta_removexattr(attr.st_ino, fsname(name), _cred(c))


@dataclass(frozen=True, slots=True)
class StatVFS:
    f_bsize: int
    f_frsize: int
    f_blocks: int
    f_bfree: int
    f_bavail: int
    f_files: int
    f_ffree: int
    f_favail: int
    f_namemax: int


def statvfs(c: AsyncClient, path: str | bytes = "/") -> Plan[StatVFS]:
    s = yield from meta_statfs()
    return StatVFS(s.bsize, s.frsize, s.blocks, s.bfree, s.bavail, s.files, s.ffree,
                   s.ffree, s.namemax)


def get_layout(c: AsyncClient, path: str | bytes) -> Plan[dict[str, Any]]:
    attr = yield from stat(c, path)
    return (yield from meta_get_layout(attr.st_ino))


def set_layout(c: AsyncClient, path: str | bytes, count: int = 0, unit: int = 0,
               replicas: int = 0, durable: bool | None = None) -> Plan[dict[str, Any]]:
    """``durable`` False: close() of its (new) files skips the data sync (scratch data;
    fsync still syncs); None: unchanged."""
    attr = yield from stat(c, path)
    return (yield from meta_set_layout(attr.st_ino, unit, count, replicas, _cred(c),
                                       durable))


# -- batched calls: many paths per request (MAX_MANY), one commit per request for the
# changes; a result per path, in order: None or the attributes, or the path's OSError
def _chunks(paths: Sequence[str | bytes]) -> list[list[bytes]]:
    names = [_path(p) for p in paths]
    return [names[i:i + M.MAX_MANY] for i in range(0, len(names), M.MAX_MANY)]


def _result(r: list[Any]) -> Any:
    code, value = r
    return E.from_wire(code, value) if code else value


def create_many(c: AsyncClient, paths: Sequence[str | bytes], mode: int = 0o666,
                exclusive: bool = True) -> Plan[list[OSError | None]]:
    """Create each path as an empty file (and close it): None, or its error."""
    out: list[OSError | None] = []
    for chunk in _chunks(paths):
        r = yield MetaCall(M.CreateMany(paths=chunk, mode=mode & ~c.umask & 0o7777,
                                        exclusive=exclusive, cred=_cred(c)))
        out.extend(e if isinstance(e, OSError) else None for e in map(_result, r.results))
    return out


def stat_many(c: AsyncClient, paths: Sequence[str | bytes], follow_symlinks: bool = True
              ) -> Plan[list[StatResult | OSError]]:
    """Each path's attributes, or its error."""
    out: list[StatResult | OSError] = []
    for chunk in _chunks(paths):
        r = yield MetaCall(M.StatMany(paths=chunk, follow=follow_symlinks, cred=_cred(c)))
        for res in r.results:
            v = _result(res)
            out.append(v if isinstance(v, OSError)
                       else c.merged_attr(StatResult.from_wire(v)))
    return out


def unlink_many(c: AsyncClient, paths: Sequence[str | bytes]) -> Plan[list[OSError | None]]:
    """Unlink each path: None, or its error."""
    out: list[OSError | None] = []
    for chunk in _chunks(paths):
        r = yield MetaCall(M.UnlinkMany(paths=chunk, cred=_cred(c)))
        out.extend(e if isinstance(e, OSError) else None for e in map(_result, r.results))
    return out


def open_path(c: AsyncClient, path: str | bytes, flags: int, perm: int = 0o666) -> Plan[FileHandle]:
    """Open by path; with O_CREAT a create first, and an open of the existing file when
    it is there already (without O_EXCL)."""
    p = norm(path)
    if flags & os.O_CREAT:
        try:
            r = yield MetaCall(M.Create(at=At.by_path(_path(p)), mode=perm & ~c.umask,
                                        flags=flags, cred=_cred(c)))  # (as stat)
            return c._handle(r, flags, p)
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
    attr = yield from resolve(c, p)
    if statmod.S_ISDIR(attr.st_mode):
        # a file API: a directory is listed, not opened (Python's open() says the same)
        raise OSError(errno.EISDIR, "Is a directory", p)
    r = yield from meta_open(attr.st_ino, flags, _cred(c))
    return c._handle(r, flags, p)


# -- file handles -----------------------------------------------------------------------
def renew(h: FileHandle) -> Plan[M.CapReply | M.OpenedReply]:
    """A fresh capability; if the metaserver lost the handle (it restarted, or the
    connection broke), open the inode again (permissions are checked again)."""
    r: M.CapReply | M.OpenedReply
    try:
        r = yield from meta_renew(h.fh)
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise
        r = yield from reopen(h)
    h._set_cap(r.cap, float(r.cap_ttl or 0.0))
    return r


def reopen(h: FileHandle) -> Plan[M.OpenedReply]:
    """Open the inode again for a handle the metaserver lost (EBADF)."""
    meta = h.client.meta
    r = yield from meta_open(h.ino, h.flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC),
                             meta.wire_cred(h.cred or h.client.cred))
    h.fh = r.fh
    h.meta_gen = meta.generation
    h._set_cap(r.cap, float(r.cap_ttl or 0.0))
    return r


def _commit_size(h: FileHandle, end: int | None) -> Plan[StatResult]:
    return (yield from meta_commit_size(h.fh, end, time.time_ns()))


def sync_data(h: FileHandle, every: bool = False) -> Plan[None]:
    """What this client wrote to ``h``'s inode since its last sync (through any of its
    handles: the size a commit sends covers them all), on every replica, to stable
    storage (or, ``every``, all the file's objects: fsync). A layout that opted out
    (scratch data) syncs only on fsync. On failure the stripes stay to sync: the next
    try redoes them."""
    if not every and not h.layout.durable:
        return
    st = h.state
    taken, st.unsynced = st.unsynced, set()
    stripes = range(len(h.layout.servers)) if every else taken
    if stripes:
        h.sent = True  # (a sync creates nothing, but says nothing it did not)
    try:
        yield from sync_objects(h, h.ino, h.layout, stripes, h.cap,
                                renew_due=h.renew_due())
    except BaseException:
        st.unsynced |= taken
        raise


def fsync(h: FileHandle) -> Plan[None]:
    """fsync(2): the data, then the size."""
    yield from sync_data(h, every=True)
    yield from commit(h)


def commit(h: FileHandle) -> Plan[None]:
    """Tell the metaserver how far this client wrote (fsync, flush, close), once what
    it wrote is on stable storage: a committed size never covers bytes a power loss
    could take back."""
    if not h._dirty:
        return
    # cleared before the size is read, and the size read before the stripes to sync are
    # taken: a write that ends meanwhile (another task or thread; it marks its stripes,
    # then the size, then the handle) marks the handle again, for the next commit
    h._dirty = False
    end = h.state.written_end
    try:
        yield from sync_data(h)
        try:
            attr = yield from _commit_size(h, end)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise
            yield from reopen(h)  # the metaserver lost the handle: open it again
            attr = yield from _commit_size(h, end)
    except BaseException:
        h._dirty = True
        raise
    h.state.size = attr.st_size


def truncate_handle(h: FileHandle, size: int) -> Plan[None]:
    h._check(True)
    E.check_size(size, f"truncate of {h.path or f'inode {h.ino}'}")
    yield from commit(h)
    attr = yield from set_attr(h.ino, h.client.cred, size=size)
    h.state.size = attr.st_size
    h.state.written_end = min(h.state.written_end, size)


def getattr_handle(h: FileHandle) -> Plan[StatResult]:
    attr = yield from meta_getattr(h.ino)
    return attr.with_size(max(attr.st_size, h.state.written_end))


def close_handle(h: FileHandle) -> Plan[None]:
    if h.closed:
        return
    end = h.state.written_end if h._dirty else None
    err: OSError | None = None
    if end is not None:
        # before the handle is marked closed: a driver that hands the sync over (a
        # capability to renew) runs the whole close again
        try:
            yield from sync_data(h)
        except OSError as exc:  # the data may not be stable: no size for it
            log.error("%s: syncing its data failed (%s); its size is not committed",
                      h.path or f"inode {h.ino}", exc)
            err, end = exc, None
    h.closed = True
    try:
        h._dirty = False
        yield from _close_on_server(h, end)
        if end is not None:
            h.state.size = max(h.state.size, end)
    finally:
        h._released()
    if err is not None:
        raise err


def _close_on_server(h: FileHandle, end: int | None) -> Plan[None]:
    """Release the handle on the metaserver, committing ``end`` (bytes written past the
    size it knows). A close with bytes to commit outlasts a metaserver outage of up to
    ``timeout`` seconds, retrying as an NFS hard mount would: the writes were
    acknowledged, so giving up would lose them from the file's size."""
    # a handle that sent nothing to a data server says so: a file it created then
    # needs no deletion of objects (metaserver/handles.py)
    unwritten = h.writable and not h.sent
    if end is None and (yield DeferClose(h.fh, h.meta_gen, unwritten)):
        return  # released with the next metadata request (sync client)
    timeout = h.client.config.timeout
    deadline = time.monotonic() + timeout
    delay = 0.05
    lost = False  # the metaserver forgot the handle (restart, lost connection)
    while True:
        try:
            if lost:
                yield from reopen(h)
            yield from meta_close(h.fh, end, time.time_ns() if end is not None else None,
                                  unwritten and end is None and not lost)
            return
        except OSError as exc:
            if exc.errno == errno.EBADF and not lost:
                if end is None:
                    return  # nothing left to release there
                lost = True
                continue
            # a metaserver restarting or out of reach (pfs.core.errors.transient)
            if end is None or not E.transient(exc) \
                    or time.monotonic() + delay > deadline:
                raise
            if delay == 0.05:
                log.warning("%s: metaserver unreachable while closing (%s); retrying for "
                            "up to %g s", h.path or f"inode {h.ino}", exc, timeout)
        yield Sleep(delay)
        delay = min(delay * 2, 1.0)
