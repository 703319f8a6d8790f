"""The FUSE operations: kernel requests mapped onto the pfs async client.

A thin adapter. Each handler converts pyfuse3's arguments, calls ``client.meta`` (the
metaserver, by inode), the :class:`~pfs.client.aio.AsyncClient` or a
:class:`~pfs.client.aio.FileHandle`, and turns the ``OSError`` it raises into
``pyfuse3.FUSEError`` with the same errno. Permission checks, POSIX rules and errno values
all come from the metaserver; write-behind and the sizes written here from the client
(``FileHandle.write_behind``, :mod:`pfs.client.writeback`: its ``pread_into``, ``commit``,
``fsync`` and ``close`` see, wait for and report the writes in flight). What lives here is only what
the kernel protocol needs: credentials of the calling process, the tables of open file
and directory handles, lookup counts, the kernel cache hints (timeouts, ``keep_cache``)
two small caches that answer requests the kernel repeats (see ``getattr`` and
``getxattr``) and, with negative entries on, the directories whose names it knows
(:mod:`pfs.fuse.known_dirs`: ``lookup`` of a missing name with no call).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyfuse3
import trio

from pfs.client.aio import AsyncClient, FileHandle
from pfs.client.meta import MetaClient
from pfs.client.types import Cred, DirEntry, StatResult
from pfs.core import errors as E
from pfs.core import metrics
from pfs.core.messages.meta import RENAME_EXCHANGE, RENAME_NOREPLACE
from pfs.core.wire.rpc import HOLD
from pfs.fuse.attr_cache import AttrCache
from pfs.fuse.known_dirs import KnownDirs
from pfs.fuse.options import MountTuning
from pfs.fuse.workers import yield_reader

log = logging.getLogger(__name__)

READDIR_PAGE = 512
DOT_OFFSETS = 2  # kernel directory offsets 1 and 2 are '.' and '..'
GROUPS_TTL = 2.0
GROUPS_CACHE_MAX = 4096
# pyfuse3 turns UTIME_NOW into the kernel's current time; a time this close to ours
# is taken to mean "now" when the explicit form is refused (see ``setattr``).
NOW_SLACK_NS = 2_000_000_000
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND
CAPS_XATTR = b"security.capability"
CACHE_MAX = 65536  # inodes in each of the daemon's small caches (then all forgotten at once)
# a connection's errnos (what the client retried until its timeout) read as a dead mount
# (ENOTCONN: "Transport endpoint is not connected"): the mount says EIO (docs "Errors")
AS_EIO = E.errnos(E.Action.RECONNECT) - {errno.ETIMEDOUT}


def _os_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, or the first one inside an exception group
    (parallel stripe I/O raises from a nursery) if the group holds nothing else."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [_os_error_of(e) for e in exc.exceptions]
        if found and all(e is not None for e in found):
            return found[0]
    return None


class _FsErrors:
    """``with fs_errors():`` (a class, not a generator: it wraps every request)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None or not isinstance(exc, (OSError, BaseExceptionGroup)):
            return
        err = _os_error_of(exc)
        if err is None:
            return
        code = err.errno if isinstance(err.errno, int) and err.errno > 0 else errno.EIO
        if code == errno.ENOSYS or code in AS_EIO:
            code = errno.EIO  # ENOSYS: the kernel would stop sending this request for good
        if code not in (errno.ENOENT, errno.EEXIST, errno.ENODATA):
            log.debug("-> %s: %s", errno.errorcode.get(code, code), err)
        raise pyfuse3.FUSEError(code) from None


_FS_ERRORS = _FsErrors()


def fs_errors() -> _FsErrors:
    """Turn the client's ``OSError`` into ``FUSEError`` with the same errno, except
    those the kernel must not get (AS_EIO, ENOSYS): EIO."""
    return _FS_ERRORS


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _serving(fn: F) -> F:
    """For a request that may wait (the network, a lock): the worker serving it hands
    pyfuse3's read lock on first (``workers.yield_reader``), and it counts in
    ``self._active`` while served (a lookup or getattr alone may take the quick path)."""

    @functools.wraps(fn)
    async def serving(self: PfsOperations, *args: Any) -> Any:
        yield_reader()
        self._active += 1
        try:
            return await fn(self, *args)
        finally:
            self._active -= 1

    return serving  # type: ignore[return-value]


def _changing(fn: F) -> F:
    """``_serving`` for a request made of one metaserver call (an entry change, an
    open): when nothing else of this mount waits (``_alone``) the worker keeps pyfuse3's
    read lock and the call waits for its reply holding the event loop, up to
    ``NOW_TIMEOUT`` (``MetaClient.holding``): no other worker woken to read /dev/fuse,
    no scheduler passes. A reply that takes longer is waited for the usual way, the
    read lock handed on first; the request is sent once either way."""

    @functools.wraps(fn)
    async def changing(self: PfsOperations, *args: Any) -> Any:
        alone = self._alone()
        if not alone:
            yield_reader()
        self._active += 1
        token = MetaClient.holding(yield_reader) if alone else None
        try:
            return await fn(self, *args)
        finally:
            self._active -= 1
            if token is not None:
                HOLD.reset(token)

    return changing  # type: ignore[return-value]


class _Waiting:
    """``with self._waiting:`` around what may wait in a request otherwise answered at
    once (as ``_serving`` does for a whole request)."""

    __slots__ = ("ops",)

    def __init__(self, ops: PfsOperations) -> None:
        self.ops = ops

    def __enter__(self) -> None:
        yield_reader()
        self.ops._active += 1

    def __exit__(self, *exc: object) -> None:
        self.ops._active -= 1


class _NameChange:
    """``with self._name_change(...)``: a name made (or removed) in directory ``parent``
    by a request here; on success the known name set follows, on any failure (refused,
    or not known to have happened: a timeout) the directory is dropped from it."""

    __slots__ = ("known", "parent", "name", "made")

    def __init__(self, known: KnownDirs, parent: int, name: bytes, made: bool) -> None:
        self.known, self.parent, self.name, self.made = known, parent, name, made

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is not None:
            self.known.drop(self.parent)
        elif self.made:
            self.known.added(self.parent, self.name)
        else:
            self.known.removed(self.parent, self.name)


def _read_groups(pid: int) -> tuple[int, ...]:
    """Supplementary groups of process ``pid`` (its ``Groups:`` line in /proc)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except OSError:  # the process is gone: no supplementary groups
        pass
    return ()


class _GroupCache:
    """Credentials by (pid, uid, gid), each with the process's supplementary groups, kept
    for ``ttl`` seconds: the same ``Cred`` object while it lasts (the client keeps the
    wire form of the last one it saw)."""

    def __init__(self, ttl: float = GROUPS_TTL) -> None:
        self.ttl = ttl
        self._cache: dict[tuple[int, int, int], tuple[float, Cred]] = {}

    def cred(self, pid: int, uid: int, gid: int) -> Cred:
        key = (pid, uid, gid)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        c = Cred(uid, gid, _read_groups(pid) if pid > 0 else ())
        if len(self._cache) >= GROUPS_CACHE_MAX:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
            if len(self._cache) >= GROUPS_CACHE_MAX:
                self._cache.clear()
        self._cache[key] = (now + self.ttl, c)
        return c


@dataclass
class _DirHandle:
    ino: int
    cred: Cred
    pending: list[DirEntry] = field(default_factory=list)  # fetched, not yet returned
    pending_after: int = -1  # the cookie just before ``pending[0]``
    eof: bool = False
    # names returned so far by a listing read from its start (None: not one, or not
    # kept), when it started and the KnownDirs epoch then: a complete one is learned
    listing: list[bytes] | None = None
    listing_since: float = 0.0
    listing_epoch: int = -1
    since: int = -1  # the AttrCache generation when ``pending`` was fetched


class PfsOperations(pyfuse3.Operations):
    """pyfuse3 request handlers over one :class:`AsyncClient`."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, client: AsyncClient, tuning: MountTuning | None = None) -> None:
        super().__init__()
        self.client = client
        self.meta = client.meta
        self.tuning = tuning or MountTuning()
        self._groups = _GroupCache()
        self._active = 0  # requests being served that may wait (``_serving``)
        self._waiting = _Waiting(self)
        self._files: dict[int, FileHandle] = {}
        self._dirs: dict[int, _DirHandle] = {}
        self._next_fh = 1
        self._lookups: dict[int, int] = {}
        # (mtime, size) of each inode when this mount last opened it: unchanged at the
        # next open means the kernel's cached pages are still good (keep_cache)
        self._seen: dict[int, tuple[int, int]] = {}
        self._wrote: set[int] = set()  # handles that wrote (their inode's pages changed)
        self._no_caps: dict[int, float] = {}  # inode -> until when it has no CAPS_XATTR
        # attributes replies carried, to answer the kernel's GETATTR within attr_timeout
        self._attrs = AttrCache(self.tuning.attr_timeout)
        # entry changes ask the metaserver for their directory's new attributes
        self._want_parent = self.tuning.attr_timeout > 0
        # directories whose every name is known, within negative_timeout; only with
        # default_permissions (else the metaserver's check of search permission on the
        # directory must come before any "missing")
        self._known = KnownDirs(
            self.tuning.negative_timeout if self.tuning.kernel_permissions else 0.0
        )

    # -- helpers ---------------------------------------------------------------
    def _alone(self) -> bool:
        """Nothing of this mount waits on the network (no other request being served,
        no write in flight, no call of its own): a read-only metaserver call may then
        hold the event loop for its round trip (``MetaClient.run_now``), which delays
        no one and costs less than the trio round trip; a request that arrives meanwhile
        waits at most that long (NOW_TIMEOUT at worst)."""
        return self._active == 0 and self.client.writes.idle() and not self.meta.calls_pending()

    def cred(self, ctx: pyfuse3.RequestContext) -> Cred:
        return self._groups.cred(ctx.pid, ctx.uid, ctx.gid)

    def _check_writable(self) -> None:
        if self.tuning.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)

    def entry(self, attr: StatResult) -> pyfuse3.EntryAttributes:
        a = self.client.merged_attr(attr)  # sizes written here, in flight too
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.st_ino
        e.generation = 0
        e.entry_timeout = self.tuning.entry_timeout
        e.attr_timeout = self.tuning.attr_timeout
        e.st_mode = a.st_mode
        e.st_nlink = a.st_nlink
        e.st_uid = a.st_uid
        e.st_gid = a.st_gid
        e.st_rdev = a.st_rdev
        e.st_size = a.st_size
        e.st_blksize = a.st_blksize
        e.st_blocks = a.st_blocks
        e.st_atime_ns = a.st_atime_ns
        e.st_mtime_ns = a.st_mtime_ns
        e.st_ctime_ns = a.st_ctime_ns
        return e

    def _looked_up(self, attr: StatResult, since: int | None = None) -> pyfuse3.EntryAttributes:
        """An entry reply, counted: the kernel now holds one more reference. ``since``:
        as ``AttrCache.put`` (None: the reply of a change made here)."""
        self._lookups[attr.st_ino] = self._lookups.get(attr.st_ino, 0) + 1
        self._attrs.put(attr.st_ino, attr, since)
        return self.entry(attr)

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _file(self, fh: int) -> FileHandle:
        try:
            return self._files[fh]
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None

    @staticmethod
    def _invalidate_attrs(ino: int) -> None:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=True)
        except OSError as exc:  # not known to the kernel (yet): nothing cached
            if exc.errno not in (errno.ENOENT, errno.ENOSYS):
                log.warning("invalidating the attributes of inode %d: %s", ino, exc)

    def _name_change(self, parent: int, name: bytes, made: bool) -> _NameChange:
        return _NameChange(self._known, parent, name, made)

    @staticmethod
    def _missing(timeout: float) -> pyfuse3.EntryAttributes:
        """A negative entry: the kernel holds the name missing for ``timeout`` s."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = 0
        e.entry_timeout = timeout
        return e

    # -- names -----------------------------------------------------------------
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if self._known.enabled:
            left = self._known.absent(parent_inode, name)
            metrics.cache_lookup("absent", left is not None)
            if left is not None:  # cached by the kernel only for what is left of the bound
                return self._missing(min(left, self.tuning.negative_timeout))
        since = self._attrs.gen
        cred = self.cred(ctx)
        try:
            with fs_errors():
                attr = self.meta.lookup_now(parent_inode, name, cred) if self._alone() else None
                if attr is None:
                    with self._waiting:
                        attr = await self.meta.lookup(parent_inode, name, cred)
        except pyfuse3.FUSEError as exc:
            if exc.errno == errno.ENOENT and self.tuning.negative_timeout > 0:
                return self._missing(self.tuning.negative_timeout)
            raise
        self._known.found(parent_inode, name)
        return self._looked_up(attr, since)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            left = self._lookups.get(ino, 0) - n
            if left > 0:
                self._lookups[ino] = left
            else:
                self._lookups.pop(ino, None)
                self._seen.pop(ino, None)
                self._no_caps.pop(ino, None)
                self._attrs.drop(ino)
                self._known.forget(ino)

    def _parent_changed(self, ino: int, attr: StatResult | None) -> None:
        """A create, unlink, mkdir, ... here changed directory ``ino``: the kernel drops
        its cached attributes and (default_permissions) asks for them before the next
        operation in it. The metaserver's reply carried them (``want_parent``), as fresh
        as a GETATTR would be now: they answer it (:mod:`pfs.fuse.attr_cache`)."""
        if attr is None:
            self._attrs.drop(ino)
        else:
            self._attrs.put(ino, attr)

    def _changed_here(self, *inodes: int) -> None:
        """Inodes changed (or about to change) by a request whose reply does not give
        their new attributes."""
        self._attrs.drop(*inodes)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        attr = self._attrs.get(inode)
        metrics.cache_lookup("attr", attr is not None)
        if attr is None:
            since = self._attrs.gen
            with fs_errors():
                attr = self.meta.getattr_now(inode) if self._alone() else None
                if attr is None:
                    with self._waiting:
                        attr = await self.meta.getattr(inode)
            self._attrs.put(inode, attr, since)
        return self.entry(attr)  # with the sizes written here

    @_serving
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        self._check_writable()
        self._changed_here(inode)
        try:
            return await self._setattr_fields(inode, attr, fields, fh, self.cred(ctx))
        finally:
            self._changed_here(inode)  # reads that crossed it carry the old attributes

    async def _setattr_fields(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        cred: Cred,
    ) -> pyfuse3.EntryAttributes:
        result: StatResult | None = None
        with fs_errors():
            if fields.update_mtime or fields.update_size:
                # sizes and times written here reach the metaserver before the new
                # ones do, so a later close cannot overwrite them (cp -a, tar, rsync)
                await self.client.commit_writes(inode)
            if fields.update_size:
                via = self._files.get(fh) if fh is not None else None
                if fh is not None and via is not None and via.writable:
                    self._wrote.add(fh)  # an ftruncate: as a write through fh
                else:
                    self._seen.pop(inode, None)  # pages of the old size are stale
                result = await self.client.truncate_ino(inode, attr.st_size, cred, via)
            changes: dict[str, Any] = {}
            if fields.update_mode:
                changes["mode"] = attr.st_mode & 0o7777
            if fields.update_uid:
                changes["uid"] = attr.st_uid
            if fields.update_gid:
                changes["gid"] = attr.st_gid
            if fields.update_atime:
                changes["atime"] = attr.st_atime_ns
            if fields.update_mtime:
                changes["mtime"] = attr.st_mtime_ns
            if changes:
                result = await self._setattr(inode, cred, changes)
            if result is None:
                result = await self.client.getattr(inode)
        return self.entry(result)

    async def _setattr(self, ino: int, cred: Cred, changes: dict[str, Any]) -> StatResult:
        try:
            return await self.meta.setattr(ino, cred, **changes)
        except PermissionError:
            # utimensat(UTIME_NOW) by a non-owner who may write is allowed, explicit
            # times are not; pyfuse3 hands both over as explicit times. Times equal to
            # each other and to the clock are taken to be "now" and asked for as such.
            times = {k: v for k, v in changes.items() if k in ("atime", "mtime")}
            if (
                not times
                or len(times) != len(changes)
                or len(set(times.values())) != 1
                or abs(next(iter(times.values())) - time.time_ns()) > NOW_SLACK_NS
            ):
                raise
            return await self.meta.setattr(ino, cred, **{k: "now" for k in times})

    @_serving
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        with fs_errors():
            return await self.meta.readlink(inode)

    @_changing
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._check_writable()
        with self._name_change(parent_inode, name, True), fs_errors():
            attr, pa = await self.meta.mknod(
                parent_inode, name, mode & ~ctx.umask, rdev, self.cred(ctx), self._want_parent
            )
        self._parent_changed(parent_inode, pa)
        return self._looked_up(attr)

    @_changing
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._check_writable()
        since = time.monotonic()
        with self._name_change(parent_inode, name, True), fs_errors():
            attr, pa = await self.meta.mkdir(
                parent_inode, name, mode & ~ctx.umask, self.cred(ctx), self._want_parent
            )
        self._parent_changed(parent_inode, pa)
        self._known.learn(attr.st_ino, (), since)  # made here: empty when it was asked
        return self._looked_up(attr)

    @_changing
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        try:
            with self._name_change(parent_inode, name, False), fs_errors():
                pa = await self.meta.unlink(parent_inode, name, self.cred(ctx), self._want_parent)
        finally:
            self._attrs.clear()  # the unlinked inode's link count and ctime moved
        self._parent_changed(parent_inode, pa)

    @_changing
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        try:
            with self._name_change(parent_inode, name, False), fs_errors():
                pa = await self.meta.rmdir(parent_inode, name, self.cred(ctx), self._want_parent)
        finally:
            self._attrs.clear()
        self._parent_changed(parent_inode, pa)

    @_changing
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._check_writable()
        with self._name_change(parent_inode, name, True), fs_errors():
            attr, pa = await self.meta.symlink(
                parent_inode, name, target, self.cred(ctx), self._want_parent
            )
        self._parent_changed(parent_inode, pa)
        return self._looked_up(attr)

    @_changing
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        self._check_writable()
        wire = 0
        if flags & pyfuse3.RENAME_NOREPLACE:
            wire |= RENAME_NOREPLACE
        if flags & pyfuse3.RENAME_EXCHANGE:
            wire |= RENAME_EXCHANGE
        if flags & ~(pyfuse3.RENAME_NOREPLACE | pyfuse3.RENAME_EXCHANGE):
            raise pyfuse3.FUSEError(errno.EINVAL)
        # both directories change, and so do the moved inode (its ctime; a directory's
        # "..") and a replaced one (its link count), whose inodes are not known here:
        # forget them all
        self._attrs.clear()
        try:
            with fs_errors():
                await self.meta.rename(
                    parent_inode_old, name_old, parent_inode_new, name_new, wire, self.cred(ctx)
                )
        except BaseException:
            self._known.drop(parent_inode_old, parent_inode_new)
            raise
        finally:
            self._attrs.clear()
        if not wire & RENAME_EXCHANGE:  # exchanged: both names are there still
            self._known.removed(parent_inode_old, name_old)
        self._known.added(parent_inode_new, name_new)

    @_changing
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        self._check_writable()
        self._changed_here(inode, new_parent_inode)
        try:
            with self._name_change(new_parent_inode, new_name, True), fs_errors():
                attr = await self.meta.link(inode, new_parent_inode, new_name, self.cred(ctx))
        finally:
            self._changed_here(inode, new_parent_inode)
        return self._looked_up(attr)

    # -- files -----------------------------------------------------------------
    def _file_info(
        self, h: FileHandle, attr_key: tuple[int, int], since: int | None = None
    ) -> pyfuse3.FileInfo:
        """Register ``h`` and say whether the kernel may keep the inode's cached pages:
        only when the file is as this mount last saw it (close-to-open otherwise). The
        open's reply carried the inode's attributes: they answer the GETATTR that
        follows an invalidation (``since``: as ``AttrCache.put``)."""
        if h.attr is not None:
            self._attrs.put(h.ino, h.attr, since)
        fh = self._new_fh()
        self._files[fh] = h
        keep = self._seen.get(h.ino) == attr_key
        if not keep:  # cached size and times are stale too: have the kernel ask again
            self._invalidate_attrs(h.ino)
        self._seen[h.ino] = attr_key
        return pyfuse3.FileInfo(fh=fh, direct_io=False, keep_cache=keep, nonseekable=False)

    @staticmethod
    def _key(h: FileHandle) -> tuple[int, int]:
        a = h.attr
        return (a.st_mtime_ns, a.st_size) if a is not None else (-1, -1)

    @_changing
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS:
            self._check_writable()
        since: int | None = self._attrs.gen
        with fs_errors():
            h = await self.client.open_ino(inode, flags, self.cred(ctx))
        if flags & os.O_TRUNC:
            self._attrs.drop(inode)  # a change: reads that crossed it are stale
            since = None  # and the reply's attributes are after it
        return self._file_info(h, self._key(h), since)

    @_changing
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self._check_writable()
        with self._name_change(parent_inode, name, True), fs_errors():
            h, pa = await self.client.create_in(
                parent_inode, name, mode & ~ctx.umask, flags, self.cred(ctx), self._want_parent
            )
        self._parent_changed(parent_inode, pa)
        assert h.attr is not None
        key = self._key(h)
        # the kernel sends CREATE only for a name it holds nothing for, so it has no
        # stale attributes or pages of this inode: no invalidation (and no GETATTR after)
        self._seen[h.ino] = key
        if h.created:
            # a new file has no xattrs: the first write's security.capability question
            # is answered here, as a metaserver reply of this moment would be
            self._caps_absent(h.ino)
        return self._file_info(h, key), self._looked_up(h.attr)

    @_serving
    async def read(self, fh: int, off: int, size: int) -> Any:
        h = self._file(fh)
        buf = bytearray(size)
        with fs_errors():
            # bytes written here and still on their way are read back (and a read past
            # the size known so far waits for them: a short reply would make the kernel
            # shrink its i_size)
            n = await h.pread_into(buf, off)
        return memoryview(buf)[:n] if n < size else buf

    @_serving
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        """Write-behind (``FileHandle.write_behind``): the kernel gets its reply once the
        write is under way, so one writer keeps several requests in flight; an error is
        reported by the next write, flush (close) or fsync of the handle."""
        h = self._file(fh)
        self._wrote.add(fh)
        self._attrs.drop(h.ino)
        with fs_errors():
            return await h.write_behind(buf, off, self.tuning.write_behind)

    async def flush(self, fh: int) -> None:
        h = self._file(fh)
        if fh not in self._wrote:
            # nothing written (or truncated) through fh: no size to commit, no write
            # error of its own to report, no attributes gone stale: no call at all
            return
        try:
            with fs_errors(), self._waiting:
                await h.commit()  # after the writes in flight; raises their error
        finally:
            if fh in self._wrote:  # the commit set mtime and size: cached ones are stale
                self._attrs.drop(h.ino)
                self._invalidate_attrs(h.ino)

    async def release(self, fh: int) -> None:
        h = self._files.pop(fh, None)
        if h is None:
            return
        wrote = fh in self._wrote
        if wrote:
            self._wrote.discard(fh)
            self._seen.pop(h.ino, None)  # its mtime moved: next open refreshes
        # a handle that wrote nothing, with no write of its inode in flight, is released
        # along with the next metaserver request: nothing to wait for
        waits = wrote or self.client.writes.busy(h.ino)
        with fs_errors():
            try:
                if waits:
                    with self._waiting:
                        await h.close()
                else:
                    await h.close()
            except OSError as exc:  # the kernel drops release's reply: say it here
                log.warning("closing inode %d: %s", h.ino, exc)
                raise
            finally:
                if wrote:
                    self._attrs.drop(h.ino)
                    trio.lowlevel.spawn_system_task(self._drop_pages, h.ino)

    @staticmethod
    async def _drop_pages(ino: int) -> None:
        """Drop the pages a closed writer left in the kernel's cache, in a thread. Its
        mtime moved, so the kernel would drop them anyway, inside the next lookup or
        attribute refresh of the inode (libfuse's auto_inval_data) or at its next open
        (no keep_cache): in someone's ``stat``, ~20 ms per 128 MiB measured here. A
        thread, because the kernel waits for page locks that reads in flight hold until
        this loop answers them."""
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False)
        except OSError as exc:  # forgotten meanwhile, or unmounted: nothing cached
            if exc.errno not in (errno.ENOENT, errno.ENOSYS, errno.EBADF, errno.ENODEV):
                log.warning("dropping the cached pages of inode %d: %s", ino, exc)
        except Exception:  # a system task must not raise: the page cache is only a cache
            log.exception("dropping the cached pages of inode %d", ino)

    @_serving
    async def fsync(self, fh: int, datasync: bool) -> None:
        h = self._file(fh)
        try:
            with fs_errors():
                await h.fsync()
        finally:
            self._attrs.drop(h.ino)  # the size it committed

    # -- directories -----------------------------------------------------------
    @_serving
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        cred = self.cred(ctx)
        if not self.tuning.kernel_permissions:
            with fs_errors():
                await self.meta.access(inode, os.R_OK, cred)
        fh = self._new_fh()
        self._dirs[fh] = _DirHandle(inode, cred)
        return fh

    @_serving
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """Entries after kernel offset ``start_id``: 1 is '.', 2 is '..', and an entry's
        offset is its metaserver cookie + 2 (cookies stay valid while the directory
        changes, so a listing never repeats or skips an entry)."""
        try:
            d = self._dirs[fh]
        except KeyError:
            raise pyfuse3.FUSEError(errno.EBADF) from None
        if start_id == 0 and self._known.enabled:  # from the start: may list it all
            d.listing, d.listing_since = [], time.monotonic()
            d.listing_epoch = self._known.epoch
        for offset, name in ((1, b"."), (2, b"..")):
            if start_id < offset:
                if not pyfuse3.readdir_reply(token, name, await self._dot(d, name), offset):
                    return
                start_id = offset
        cookie = start_id - DOT_OFFSETS
        if d.pending_after != cookie:  # a new position (or a rewind): fetch afresh
            d.pending, d.pending_after, d.eof = [], cookie, False
            if cookie != 0:
                d.listing = None  # a seek: not a listing from the start
        while True:
            if not d.pending:
                if d.eof:
                    self._listed(d)
                    return
                d.since = self._attrs.gen
                with fs_errors():
                    d.pending, d.eof = await self.meta.readdir(
                        d.ino, d.pending_after, READDIR_PAGE, True, d.cred
                    )
                if not d.pending:
                    d.eof = True
                    self._listed(d)
                    return
            while d.pending:
                e = d.pending[0]
                attr = e.attr
                if attr is None:
                    d.since = self._attrs.gen
                    with fs_errors():
                        attr = await self.meta.getattr(e.inode_number)
                self._attrs.put(attr.st_ino, attr, d.since)
                bname = os.fsencode(e.name)
                if not pyfuse3.readdir_reply(
                    token, bname, self.entry(attr), e.cookie + DOT_OFFSETS
                ):
                    return
                if d.listing is not None:
                    d.listing.append(bname)
                self._lookups[attr.st_ino] = self._lookups.get(attr.st_ino, 0) + 1
                d.pending.pop(0)
                d.pending_after = e.cookie

    def _listed(self, d: _DirHandle) -> None:
        """The listing reached its end: if it was read from the start, with no change
        made here meanwhile, the directory held these names when it started."""
        if d.listing is not None and d.listing_epoch == self._known.epoch:
            self._known.learn(d.ino, d.listing, d.listing_since)
        d.listing = None

    async def _dot(self, d: _DirHandle, name: bytes) -> pyfuse3.EntryAttributes:
        """'.' or '..' for a listing: only the inode number and type reach the caller
        (the kernel neither caches these attributes nor counts a lookup)."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = d.ino
        e.st_mode = stat.S_IFDIR
        if name == b".." and d.ino != pyfuse3.ROOT_INODE:
            try:
                e.st_ino = (await self.meta.lookup(d.ino, b"..", d.cred)).st_ino
            except OSError as exc:  # e.g. no search permission: '..' as itself
                log.debug("'..' of inode %d: %s", d.ino, exc)
        return e

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        # every namespace change is durable when the metaserver answers it
        return None

    @_serving
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        with fs_errors():
            s = await self.meta.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize = s.bsize
        out.f_frsize = s.frsize
        out.f_blocks = s.blocks
        out.f_bfree = s.bfree
        out.f_bavail = s.bavail
        out.f_files = s.files
        out.f_ffree = s.ffree
        out.f_favail = s.ffree
        out.f_namemax = s.namemax
        return out

    # -- extended attributes ---------------------------------------------------
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # The kernel asks for security.capability before every write, to remove it: each
        # 1 MiB write of the mount waited for a metaserver round trip first. Its absence
        # is remembered for attr_timeout (as the kernel remembers attributes), and
        # forgotten at once when this mount changes an xattr of the file.
        cached = name == CAPS_XATTR
        if cached:
            hit = self._no_caps.get(inode, 0.0) > time.monotonic()
            metrics.cache_lookup("xattr", hit)
            if hit:
                raise pyfuse3.FUSEError(errno.ENODATA)
        try:
            with fs_errors(), self._waiting:
                return await self.meta.getxattr(inode, name, self.cred(ctx))
        except pyfuse3.FUSEError as exc:
            if cached and exc.errno == errno.ENODATA:
                self._caps_absent(inode)
            raise

    def _caps_absent(self, ino: int) -> None:
        """``ino`` has no security.capability as of now: remembered for attr_timeout."""
        if self.tuning.attr_timeout > 0:
            if len(self._no_caps) >= CACHE_MAX:
                self._no_caps.clear()
            self._no_caps[ino] = time.monotonic() + self.tuning.attr_timeout

    @_serving
    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        self._check_writable()
        self._no_caps.pop(inode, None)
        self._changed_here(inode)
        try:
            with fs_errors():
                await self.meta.setxattr(inode, name, value, 0, self.cred(ctx))
        finally:
            self._changed_here(inode)  # its ctime

    @_serving
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        with fs_errors():
            return await self.meta.listxattr(inode, self.cred(ctx))

    @_serving
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self._check_writable()
        self._no_caps.pop(inode, None)
        self._changed_here(inode)
        try:
            with fs_errors():
                await self.meta.removexattr(inode, name, self.cred(ctx))
        finally:
            self._changed_here(inode)

    @_serving
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        if mode & os.W_OK and self.tuning.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)
        with fs_errors():
            await self.meta.access(inode, mode, self.cred(ctx))
        return True

    # -- shutdown --------------------------------------------------------------
    async def close_all(self) -> None:
        """Close the handles the kernel left open (unmount): sizes reach the metaserver."""
        await self.client.writes.drain_all()
        files, self._files = self._files, {}
        for h in files.values():
            try:
                await h.close()
            except OSError as exc:
                log.warning("closing inode %d at unmount: %s", h.ino, exc)
