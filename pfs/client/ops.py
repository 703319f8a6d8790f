"""Metadata plans: the client-side logic of the path API and of file handles (open with
the O_CREAT fallback, commit and close with their retries, renew and reopen), written
once as plans (:mod:`pfs.client.plan`) that yield :class:`~pfs.client.plan.MetaCall`
and :class:`~pfs.client.plan.Sleep`. ``AsyncClient`` carries them out on the trio
driver, the sync client on the blocking driver in the caller's thread: neither runs the
other's coroutines, and a plan never waits by itself (a ``Sleep`` is an effect too).

Entry calls name their entry by path: the metaserver resolves it in the same round trip
(docs/rpc.md, "path" beside "parent" + "name").
"""
from __future__ import annotations

import errno
import logging
import os
import posixpath
import stat as statmod
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pfs.client.meta import fsname
from pfs.client.plan import DeferClose, MetaCall, Plan, Sleep
from pfs.client.types import Cred, DirEntry, StatResult

if TYPE_CHECKING:  # types only: aio builds its methods on these plans
    from pfs.client.aio import AsyncClient, FileHandle

log = logging.getLogger(__name__)

READDIR_PAGE = 1024
# a metaserver restarting or out of reach: a close with a size to commit retries these
RETRY_ERRNOS = frozenset({errno.ENOTCONN, errno.ECONNRESET, errno.ECONNREFUSED,
                          errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                          errno.EHOSTUNREACH})


def norm(path: str | bytes) -> str:
    p = os.fsdecode(path)
    if not p:
        raise OSError(errno.ENOENT, "empty path")
    if "\0" in p:
        raise OSError(errno.EINVAL, "path contains a NUL byte")
    return posixpath.normpath("/" + p) if not p.startswith("/") else p


def _path(path: str | bytes) -> bytes:
    return fsname(norm(path))


def call(method: str, **fields: Any) -> MetaCall:
    """The one place a metadata request of a plan is built."""
    return MetaCall(method, fields)


def open_request(ino: int, flags: int, cred: Cred) -> MetaCall:
    return call("open", ino=ino, flags=flags, cred=cred.to_wire())


# -- the path API -----------------------------------------------------------------------
def resolve(c: AsyncClient, path: str, follow: bool = True) -> Plan[StatResult]:
    r = yield call("resolve", path=fsname(path), follow=follow, cred=c.cred.to_wire())
    return StatResult.from_wire(r["attr"])


def stat(c: AsyncClient, path: str | bytes, follow_symlinks: bool = True) -> Plan[StatResult]:
    return c.merged_attr((yield from resolve(c, norm(path), follow_symlinks)))


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
        r = yield call("readdir", ino=attr.st_ino, cookie=cookie, limit=READDIR_PAGE,
                       plus=plus, cred=c.cred.to_wire())
        page = r["entries"]
        for raw, child, mode, ck, a in page:
            name = os.fsdecode(raw)
            out.append(DirEntry(name, posixpath.join(base, name), child, mode, ck,
                                StatResult.from_wire(a) if a else None))
        if r["eof"] or not page:
            return out
        cookie = page[-1][3]


def listdir(c: AsyncClient, path: str | bytes = "/") -> Plan[list[str]]:
    return [e.name for e in (yield from scandir(c, path))]


def mkdir(c: AsyncClient, path: str | bytes, mode: int = 0o777) -> Plan[None]:
    yield call("mkdir", path=_path(path), mode=mode & ~c.umask, cred=c.cred.to_wire())


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
    yield call("unlink", path=_path(path), cred=c.cred.to_wire())


def rmdir(c: AsyncClient, path: str | bytes) -> Plan[None]:
    yield call("rmdir", path=_path(path), cred=c.cred.to_wire())


def rename(c: AsyncClient, src: str | bytes, dst: str | bytes, flags: int = 0) -> Plan[None]:
    yield call("rename", path=_path(src), newpath=_path(dst), flags=flags,
               cred=c.cred.to_wire())


def link(c: AsyncClient, src: str | bytes, dst: str | bytes) -> Plan[None]:
    attr = yield from lstat(c, src)
    yield call("link", ino=attr.st_ino, newpath=_path(dst), cred=c.cred.to_wire())


def symlink(c: AsyncClient, target: str | bytes, path: str | bytes) -> Plan[None]:
    yield call("symlink", path=_path(path), target=fsname(target), cred=c.cred.to_wire())


def readlink(c: AsyncClient, path: str | bytes) -> Plan[str]:
    attr = yield from lstat(c, path)
    return os.fsdecode((yield call("readlink", ino=attr.st_ino))["target"])


def set_attr(ino: int, cred: Cred, **changes: Any) -> Plan[StatResult]:
    fields = {k: v for k, v in changes.items() if v is not None}
    r = yield call("setattr", ino=ino, cred=cred.to_wire(), **fields)
    return StatResult.from_wire(r["attr"])


def chmod(c: AsyncClient, path: str | bytes, mode: int) -> Plan[None]:
    attr = yield from stat(c, path)
    yield from set_attr(attr.st_ino, c.cred, mode=mode & 0o7777)


def chown(c: AsyncClient, path: str | bytes, uid: int, gid: int) -> Plan[None]:
    attr = yield from stat(c, path)
    yield from set_attr(attr.st_ino, c.cred, uid=None if uid < 0 else uid,
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
        at = mt = "now"
    yield from set_attr(attr.st_ino, c.cred, atime=at, mtime=mt)


def truncate(c: AsyncClient, path: str | bytes, size: int) -> Plan[None]:
    attr = yield from stat(c, path)
    yield from set_attr(attr.st_ino, c.cred, size=size)
    c.truncated(attr.st_ino, size)


def getxattr(c: AsyncClient, path: str | bytes, name: str | bytes) -> Plan[bytes]:
    attr = yield from stat(c, path)
    r = yield call("getxattr", ino=attr.st_ino, name=fsname(name), cred=c.cred.to_wire())
    return r["value"]  # type: ignore[no-any-return]


def setxattr(c: AsyncClient, path: str | bytes, name: str | bytes, value: bytes,
             flags: int = 0) -> Plan[None]:
    attr = yield from stat(c, path)
    yield call("setxattr", ino=attr.st_ino, name=fsname(name), value=bytes(value),
               flags=flags, cred=c.cred.to_wire())


def listxattr(c: AsyncClient, path: str | bytes) -> Plan[list[str]]:
    attr = yield from stat(c, path)
    r = yield call("listxattr", ino=attr.st_ino, cred=c.cred.to_wire())
    return [os.fsdecode(n) for n in r["names"]]


def removexattr(c: AsyncClient, path: str | bytes, name: str | bytes) -> Plan[None]:
    attr = yield from stat(c, path)
    yield call("removexattr", ino=attr.st_ino, name=fsname(name), cred=c.cred.to_wire())


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
    s = yield call("statfs")
    return StatVFS(s["bsize"], s.get("frsize", s["bsize"]), s["blocks"], s["bfree"],
                   s["bavail"], s["files"], s["ffree"], s["ffree"], s["namemax"])


def get_layout(c: AsyncClient, path: str | bytes) -> Plan[dict[str, Any]]:
    attr = yield from stat(c, path)
    return (yield call("get_layout", ino=attr.st_ino))["layout"]  # type: ignore[no-any-return]


def set_layout(c: AsyncClient, path: str | bytes, count: int = 0, unit: int = 0,
               replicas: int = 0) -> Plan[dict[str, Any]]:
    attr = yield from stat(c, path)
    r = yield call("set_layout", ino=attr.st_ino, unit=unit, count=count, replicas=replicas,
                   cred=c.cred.to_wire())
    return r["layout"]  # type: ignore[no-any-return]


def open_path(c: AsyncClient, path: str | bytes, flags: int, perm: int = 0o666) -> Plan[FileHandle]:
    """Open by path; with O_CREAT a create first, and an open of the existing file when
    it is there already (without O_EXCL)."""
    p = norm(path)
    if flags & os.O_CREAT:
        try:
            r = yield call("create", path=fsname(p), mode=perm & ~c.umask, flags=flags,
                           cred=c.cred.to_wire())
            return c._handle(r, flags, p)
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
    attr = yield from resolve(c, p)
    if statmod.S_ISDIR(attr.st_mode) and (flags & os.O_ACCMODE) != os.O_RDONLY:
        raise OSError(errno.EISDIR, f"{p}: is a directory")
    r = yield open_request(attr.st_ino, flags, c.cred)
    return c._handle(r, flags, p)


# -- file handles -----------------------------------------------------------------------
def renew(h: FileHandle) -> Plan[dict[str, Any]]:
    """A fresh capability; if the metaserver lost the handle (it restarted, or the
    connection broke), open the inode again (permissions are checked again)."""
    try:
        r = yield call("renew", fh=h.fh)
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise
        r = yield from reopen(h)
    h._set_cap(r.get("cap"), float(r.get("cap_ttl") or 0.0))
    return r  # type: ignore[no-any-return]


def reopen(h: FileHandle) -> Plan[dict[str, Any]]:
    """Open the inode again for a handle the metaserver lost (EBADF)."""
    meta = h.client.meta
    r = yield open_request(h.ino, h.flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC),
                           h.cred or h.client.cred)
    h.fh = r["fh"]
    h.meta_gen = meta.generation
    h._set_cap(r.get("cap"), float(r.get("cap_ttl") or 0.0))
    return r  # type: ignore[no-any-return]


def _commit_size(h: FileHandle, end: int | None) -> Plan[StatResult]:
    r = yield call("commit_size", fh=h.fh, written_end=end, mtime=time.time_ns())
    return StatResult.from_wire(r["attr"])


def commit(h: FileHandle) -> Plan[None]:
    """Tell the metaserver how far this client wrote (fsync, flush, close)."""
    if not h._dirty:
        return
    # cleared before the size is read: a write that ends while the metaserver answers
    # (another task or thread) marks the handle again, for the next one
    h._dirty = False
    end = h.state.written_end
    try:
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
    yield from commit(h)
    attr = yield from set_attr(h.ino, h.client.cred, size=size)
    h.state.size = attr.st_size
    h.state.written_end = min(h.state.written_end, size)


def getattr_handle(h: FileHandle) -> Plan[StatResult]:
    r = yield call("getattr", ino=h.ino)
    attr = StatResult.from_wire(r["attr"])
    return attr.with_size(max(attr.st_size, h.state.written_end))


def close_handle(h: FileHandle) -> Plan[None]:
    if h.closed:
        return
    h.closed = True
    try:
        end = h.state.written_end if h._dirty else None
        h._dirty = False
        yield from _close_on_server(h, end)
        if end is not None:
            h.state.size = max(h.state.size, end)
    finally:
        h._released()


def _close_on_server(h: FileHandle, end: int | None) -> Plan[None]:
    """Release the handle on the metaserver, committing ``end`` (bytes written past the
    size it knows). A close with bytes to commit outlasts a metaserver outage of up to
    ``timeout`` seconds, retrying as an NFS hard mount would: the writes were
    acknowledged, so giving up would lose them from the file's size."""
    if end is None and (yield DeferClose(h.fh, h.meta_gen)):
        return  # released with the next metadata request (sync client)
    timeout = h.client.config.timeout
    deadline = time.monotonic() + timeout
    delay = 0.05
    lost = False  # the metaserver forgot the handle (restart, lost connection)
    while True:
        try:
            if lost:
                yield from reopen(h)
            yield call("close", fh=h.fh, written_end=end,
                       mtime=time.time_ns() if end is not None else None)
            return
        except OSError as exc:
            if exc.errno == errno.EBADF and not lost:
                if end is None:
                    return  # nothing left to release there
                lost = True
                continue
            if end is None or exc.errno not in RETRY_ERRNOS \
                    or time.monotonic() + delay > deadline:
                raise
            if delay == 0.05:
                log.warning("%s: metaserver unreachable while closing (%s); retrying for "
                            "up to %g s", h.path or f"inode {h.ino}", exc, timeout)
        yield Sleep(delay)
        delay = min(delay * 2, 1.0)
