"""The async pfs client: an os-like path API and open files, on one trio nursery.

The FUSE mount uses the same object: ``client.meta`` for inode-level namespace calls and
``open_ino`` / ``create_in`` for file handles, so no filesystem logic lives in ``fuse/``.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import posixpath
import stat as statmod
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from pfs.auth import client_auth
from pfs.client.data import DataClient
from pfs.client.direct import DirectData
from pfs.client.meta import MetaClient, fsname
from pfs.client.types import Cred, DirEntry, StatResult
from pfs.config import SMALL_READ_MAX, ClientConfig, client_config, profile_settings
from pfs.layout import Layout
from pfs.messages import meta as M
from pfs.messages.records import At, WireCred
from pfs.shortcircuit import HandleObjects, LocalServers

log = logging.getLogger(__name__)

ROOT = 1
READDIR_PAGE = 1024
CLOSE_GRACE = 10.0  # seconds an exiting client spends closing files left open
# a metaserver restarting or out of reach: a close with a size to commit retries these
RETRY_ERRNOS = frozenset({errno.ENOTCONN, errno.ECONNRESET, errno.ECONNREFUSED,
                          errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                          errno.EHOSTUNREACH})


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@dataclass
class _InodeState:
    """What this client knows about an open inode beyond the metaserver's record:
    bytes it wrote that the metaserver has not been told about yet."""

    size: int
    written_end: int = 0
    handles: int = 0
    # the sync client writes from its callers' threads as well as from its trio thread
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def wrote(self, end: int) -> None:
        with self.lock:
            self.written_end = max(self.written_end, end)

    @property
    def known_size(self) -> int:
        return max(self.size, self.written_end)


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


def open_flags(mode: str) -> int:
    """os.O_* flags for a Python ``open`` mode string."""
    base = mode.replace("b", "").replace("t", "")
    plus = "+" in base
    kind = base.replace("+", "")
    if len(kind) != 1 or kind not in "rwax" or len(base) > 2:
        raise ValueError(f"invalid mode: {mode!r}")
    flags = {"r": 0, "w": os.O_CREAT | os.O_TRUNC, "a": os.O_CREAT | os.O_APPEND,
             "x": os.O_CREAT | os.O_EXCL}[kind]
    if plus:
        return flags | os.O_RDWR
    return flags | (os.O_RDONLY if kind == "r" else os.O_WRONLY)


class FileHandle:
    """An open pfs file: positionless reads and writes straight into/from buffers."""

    def __init__(self, client: AsyncClient, ino: int, fh: int, flags: int,
                 layout: Layout, state: _InodeState, path: str = "",
                 attr: StatResult | None = None, cap: bytes | None = None,
                 cap_ttl: float = 0.0, cred: Cred | None = None) -> None:
        self.client = client
        self.cred = cred  # who opened it (a reopen after a lost handle uses it again)
        self.cap = cap  # the data capability (docs/rpc.md); renewed before it expires
        self._renew_at = math.inf
        self._cap_gen = 0  # capabilities set so far: concurrent renewals make one
        self._renewing = trio.Lock()
        self._set_cap(cap, cap_ttl)
        self.attr = attr  # the metaserver's attributes at open (FUSE replies with them)
        self.ino = ino
        self.fh = fh
        self.meta_gen = client.meta.generation  # the metadata connection fh belongs to
        self.flags = flags
        self.layout = layout
        self.state = state
        self.path = path
        self.closed = False
        self._dirty = False
        # a read-only handle reads local objects through descriptors (short circuit)
        self._objects = (HandleObjects(client.local) if client.local is not None
                         and flags & os.O_ACCMODE == os.O_RDONLY else None)

    # -- capabilities ------------------------------------------------------------
    def _set_cap(self, cap: bytes | None, ttl: float) -> None:
        self.cap = cap
        self._cap_gen += 1
        # renewed at 3/4 of its life, by this host's clock (no skew with the metaserver's);
        # time.monotonic, not trio's clock: the sync client opens files outside trio
        self._renew_at = time.monotonic() + 0.75 * ttl if cap is not None else math.inf

    async def renew(self) -> None:
        """Get a fresh capability; if the metaserver lost the handle (it restarted, or
        the connection broke), open the inode again (permissions are checked again)."""
        gen = self._cap_gen
        async with self._renewing:
            if self._cap_gen != gen:  # another task renewed (or reopened) meanwhile
                return
            try:
                r = await self.client.meta.renew(self.fh)
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise
                r = await self._reopen()
            self._set_cap(r.get("cap"), float(r.get("cap_ttl") or 0.0))

    async def _reopen(self) -> dict[str, Any]:
        """Open the inode again for a handle the metaserver lost (EBADF)."""
        r = await self.client.meta.open(
            self.ino, self.flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC),
            self.cred or self.client.cred)
        self.fh = r["fh"]
        self.meta_gen = self.client.meta.generation
        self._set_cap(r.get("cap"), float(r.get("cap_ttl") or 0.0))
        return r

    async def _data(self, fn: Any, *args: Any) -> Any:
        """A data-path call with this handle's capability; renewed when due, and once
        more when a data server refuses it (expired, or stale after a truncation)."""
        if time.monotonic() >= self._renew_at:
            await self.renew()
        try:
            return await fn(*args, cap=self.cap)
        except OSError as exc:
            if self.cap is None or exc.errno not in (errno.EACCES, errno.ESTALE):
                raise
        await self.renew()
        return await fn(*args, cap=self.cap)

    @property
    def readable(self) -> bool:
        return (self.flags & os.O_ACCMODE) in (os.O_RDONLY, os.O_RDWR)

    @property
    def writable(self) -> bool:
        return (self.flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)

    @property
    def size(self) -> int:
        return self.state.known_size

    def _check(self, want_write: bool) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if want_write and not self.writable:
            raise OSError(errno.EBADF, "file not open for writing")
        if not want_write and not self.readable:
            raise OSError(errno.EBADF, "file not open for reading")

    async def pread_into(self, buf: Any, off: int) -> int:
        """Read up to ``len(buf)`` bytes at ``off`` into ``buf``; returns bytes read.
        A GPU buffer (``__cuda_array_interface__``) is filled through pinned host staging
        (:mod:`pfs.gpu`)."""
        self._check(False)
        if hasattr(buf, "__cuda_array_interface__"):
            from pfs.gpu import pread_into_device

            return await pread_into_device(self, buf, off)
        if off < 0:
            raise OSError(errno.EINVAL, "negative offset")
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.state.known_size - off))
        if n:
            await self._data(partial(self.client.data.read_into, objects=self._objects),
                             self.ino, self.layout, off, view[:n])
        return n

    def pread_local(self, buf: Any, off: int) -> int | None:
        """A small read served in the calling thread from short-circuit descriptors this
        handle already holds: the sync client's fast path (no hop into its trio thread,
        a blocking ``preadv`` per stripe piece). None when it cannot be: no descriptor
        yet for a stripe, a remote stripe, a GPU buffer, or larger than the profile's
        ``direct_max`` (then the engine reads the stripes in parallel)."""
        objs = self._objects
        if objs is None or self.closed or off < 0 \
                or hasattr(buf, "__cuda_array_interface__"):
            return None
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.state.known_size - off))
        if n > self.client.direct_max:
            return None
        ops = []
        for p in self.layout.pieces(off, n):
            fd = objs.known_fd(p.stripe)
            if fd is None:
                return None
            start = p.file_off - off
            ops.append((fd, p.obj_off, view[start:start + p.length]))
        if ops:
            objs.read_now(ops)
        return n

    # -- the sync client's calling-thread paths (pfs/client/direct.py) ----------------
    def _direct_piece(self, off: int, n: int) -> Any:
        """The one stripe piece ``[off, off + n)`` is, if the direct path may take it."""
        if (self.client.direct is None or self.closed or off < 0
                or n > self.client.direct_max or time.monotonic() >= self._renew_at):
            return None
        pieces = list(self.layout.pieces(off, n))
        return pieces[0] if len(pieces) == 1 else None

    def pread_direct(self, buf: Any, off: int) -> int | None:
        """``pread_local``, else one request to a replica in this thread; None: take
        the trio path (``pread_into``)."""
        n = self.pread_local(buf, off)
        if n is not None or self.closed or not self.readable \
                or hasattr(buf, "__cuda_array_interface__"):
            return n  # a closed handle: pread_into raises, even with nothing to read
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.state.known_size - off))
        if n == 0:
            return None if off < 0 else 0
        p = self._direct_piece(off, n)
        direct = self.client.direct
        if p is None or direct is None:
            return None
        if self._objects is not None and not self._objects.tried(p.stripe):
            return None  # the trio path first asks a local server for a descriptor
        dest = view[:n]
        fields = {"obj": [self.ino, p.stripe], "off": p.obj_off, "len": n, "cap": self.cap}
        for sid in self.layout.servers[p.stripe]:
            try:
                r = direct.call(sid, "read", fields, into=dest)
            except OSError:
                continue  # as the trio path does: the next replica
            if r is not None:
                if r[1] < n:  # past the object's end: a hole up to the file size
                    dest[r[1]:] = bytes(n - r[1])
                return n
        return None

    def pwrite_direct(self, data: Any, off: int) -> int | None:
        """One request per replica in this thread; None: take the trio path
        (``pwrite``), which writes every replica again."""
        if not self.writable or self.closed:
            return None
        view = memoryview(data).cast("B")
        if self.flags & os.O_APPEND:
            off = self.state.known_size
        p = self._direct_piece(off, len(view))
        direct = self.client.direct
        if p is None or direct is None or not view:
            return None
        fields = {"obj": [self.ino, p.stripe], "off": p.obj_off, "cap": self.cap}
        for sid in self.layout.servers[p.stripe]:
            if direct.call(sid, "write", fields, payload=view) is None:
                return None
        self.state.wrote(off + len(view))
        self._dirty = True
        return len(view)

    async def pread(self, length: int, off: int) -> bytes:
        buf = bytearray(max(0, min(length, self.state.known_size - off)))
        n = await self.pread_into(buf, off)
        return bytes(buf[:n])

    async def pwrite(self, data: Any, off: int) -> int:
        self._check(True)
        if off < 0:
            raise OSError(errno.EINVAL, "negative offset")
        if self.flags & os.O_APPEND:
            off = self.state.known_size
        view = memoryview(data).cast("B")
        if view:
            await self._data(self.client.data.write, self.ino, self.layout, off, view)
            self.state.wrote(off + len(view))
            self._dirty = True
        return len(view)

    async def truncate(self, size: int) -> None:
        self._check(True)
        await self.commit()
        attr = await self.client.meta.setattr(self.ino, cred=self.client.cred, size=size)
        self.state.size = attr.st_size
        self.state.written_end = min(self.state.written_end, size)

    async def commit(self) -> None:
        """Tell the metaserver how far this client wrote (fsync, flush, close)."""
        if self._dirty:
            # cleared before the size is read: a write that ends while the metaserver
            # answers (another task or thread) marks the handle again, for the next one
            self._dirty = False
            end = self.state.written_end
            try:
                try:
                    attr = await self.client.meta.commit_size(self.fh, end, time.time_ns())
                except OSError as exc:
                    if exc.errno != errno.EBADF:
                        raise
                    await self._reopen()  # the metaserver lost the handle: open it again
                    attr = await self.client.meta.commit_size(self.fh, end, time.time_ns())
            except BaseException:
                self._dirty = True
                raise
            self.state.size = attr.st_size

    async def fsync(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if self.writable:
            await self._data(self.client.data.fsync, self.ino, self.layout)
        await self.commit()

    async def getattr(self) -> StatResult:
        attr = await self.client.meta.getattr(self.ino)
        return attr.with_size(max(attr.st_size, self.state.written_end))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            end = self.state.written_end if self._dirty else None
            self._dirty = False
            await self._close_on_server(end)
            if end is not None:
                self.state.size = max(self.state.size, end)
        finally:
            if self._objects is not None:
                self._objects.close()
            self.client._release_state(self.ino)
            self.client.handles.discard(self)

    async def _close_on_server(self, end: int | None) -> None:
        """Release the handle on the metaserver, committing ``end`` (bytes written
        past the size it knows). A close with bytes to commit outlasts a metaserver
        outage of up to ``timeout`` seconds, retrying as an NFS hard mount would: the
        writes were acknowledged, so giving up would lose them from the file's size."""
        if end is None and self.client.meta.defer_close(self.fh, self.meta_gen):
            return  # released with the next metadata request (sync client)
        deadline = time.monotonic() + self.client.config.timeout
        delay = 0.05
        lost = False  # the metaserver forgot the handle (restart, lost connection)
        while True:
            try:
                if lost:
                    await self._reopen()
                await self.client.meta.close(self.fh, end,
                                             time.time_ns() if end is not None else None)
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
                    log.warning("%s: metaserver unreachable while closing (%s); retrying "
                                "for up to %g s", self.path or f"inode {self.ino}", exc,
                                self.client.config.timeout)
            await self.client.pause(delay)
            delay = min(delay * 2, 1.0)


class AsyncClient:
    def __init__(self, config: ClientConfig, nursery: trio.Nursery,
                 cred: Cred | None = None, direct_meta: bool = False) -> None:
        self.config = config
        self.cred = cred or _config_cred(config)
        self.umask = _current_umask()
        host, port = config.meta_addr
        creds = client_auth(config.key_file, config.key_name, config.tls_cert,
                            config.tls_key, config.tls_ca)
        self.meta = MetaClient(nursery, host, port, timeout=config.timeout, cred=self.cred,
                               auth=creds, direct=direct_meta)
        self.data = DataClient(nursery, self.meta.servers,
                               connections_per_server=config.connections_per_server,
                               timeout=config.timeout, auth=creds.for_data())
        # short-circuit reads of objects on this host's data servers (pfs/shortcircuit.py)
        self.local = LocalServers(creds.for_data()) if config.short_circuit else None
        # the sync client's small data requests from its callers' threads
        self.direct = (DirectData(creds.for_data(), self.data.known_address, config.timeout)
                       if direct_meta else None)
        self._inodes: dict[int, _InodeState] = {}
        # the sync client opens and closes handles in its callers' threads as well
        self._inodes_lock = threading.Lock()
        self.handles: set[FileHandle] = set()  # open; closed (sizes committed) by aclose
        # requests up to this size may be served in the sync client's calling thread
        # (FileHandle.pread_local, pread_direct, pwrite_direct): latency-bound ones
        self.direct_max = direct_max(config.profile)

    @classmethod
    @asynccontextmanager
    async def connect(cls, config: Any = None, meta: str | None = None,
                      cred: Cred | None = None) -> AsyncIterator[AsyncClient]:
        cfg = client_config(config, meta)
        async with trio.open_nursery() as nursery:
            client = cls(cfg, nursery, cred)
            try:
                await client.meta.call("hello", client="pfs")
                yield client
            finally:
                # files left open are closed so what they wrote reaches the metaserver;
                # shielded (this may run while cancelled) but bounded
                with trio.move_on_after(CLOSE_GRACE, shield=True):
                    await client.aclose()
                client.close()
                nursery.cancel_scope.cancel()

    async def aclose(self) -> None:
        """Close the handles still open (what they wrote reaches the metaserver), then
        the connections."""
        for h in list(self.handles):
            try:
                await h.close()
            except OSError as exc:
                log.warning("closing %s (inode %d): %s", h.path or "a file", h.ino, exc)
        self.close()

    async def pause(self, seconds: float) -> None:
        """Wait between retries; in the caller's thread when metadata calls run there
        (``direct_meta``: the sync client drives these coroutines without trio)."""
        if self.meta.direct:
            time.sleep(seconds)  # noqa: ASYNC251 - run outside trio (see the doc above)
        else:
            await trio.sleep(seconds)

    def close(self) -> None:
        self.data.close()
        if self.direct is not None:
            self.direct.close()
        self.meta.shutdown()
        if self.local is not None:
            self.local.close()

    # -- inode state shared by this client's handles ---------------------------
    def _acquire_state(self, ino: int, size: int) -> _InodeState:
        with self._inodes_lock:
            st = self._inodes.get(ino)
            if st is None:
                st = self._inodes[ino] = _InodeState(size)
            else:
                st.size = size  # the metaserver's word at open wins (close-to-open)
            st.handles += 1
            return st

    def _release_state(self, ino: int) -> None:
        with self._inodes_lock:
            st = self._inodes.get(ino)
            if st is not None:
                st.handles -= 1
                if st.handles <= 0:
                    del self._inodes[ino]

    def merged_attr(self, attr: StatResult) -> StatResult:
        """An attribute record with sizes this client wrote but has not committed."""
        st = self._inodes.get(attr.st_ino)
        if st is not None and st.written_end > attr.st_size:
            return attr.with_size(st.written_end)
        return attr

    # -- handles by inode (FUSE) -------------------------------------------------
    def _handle(self, r: dict[str, Any], flags: int, path: str = "",
                cred: Cred | None = None) -> FileHandle:
        attr = StatResult.from_wire(r["attr"])
        state = self._acquire_state(attr.st_ino, attr.st_size)
        h = FileHandle(self, attr.st_ino, r["fh"], flags, Layout.from_wire(r["layout"]),
                       state, path, attr, r.get("cap"), float(r.get("cap_ttl") or 0.0), cred)
        self.handles.add(h)
        return h

    async def open_ino(self, ino: int, flags: int, cred: Cred | None = None) -> FileHandle:
        return self._handle(await self.meta.open(ino, flags, cred), flags, cred=cred)

    async def create_in(self, parent: int, name: str | bytes, mode: int, flags: int,
                        cred: Cred | None = None) -> FileHandle:
        r = await self.meta.create(parent, name, mode, flags | os.O_CREAT, cred)
        return self._handle(r, flags, cred=cred)

    async def getattr(self, ino: int) -> StatResult:
        return self.merged_attr(await self.meta.getattr(ino))

    # -- paths -----------------------------------------------------------------
    @staticmethod
    def _norm(path: str | bytes) -> str:
        p = os.fsdecode(path)
        if not p:
            raise OSError(errno.ENOENT, "empty path")
        if "\0" in p:
            raise OSError(errno.EINVAL, "path contains a NUL byte")
        return posixpath.normpath("/" + p) if not p.startswith("/") else p

    async def stat(self, path: str | bytes, follow_symlinks: bool = True) -> StatResult:
        attr, _, _ = await self.meta.resolve(self._norm(path), follow_symlinks, self.cred)
        return self.merged_attr(attr)

    async def lstat(self, path: str | bytes) -> StatResult:
        return await self.stat(path, follow_symlinks=False)

    async def exists(self, path: str | bytes) -> bool:
        try:
            await self.stat(path)
        except FileNotFoundError:
            return False
        return True

    async def scandir(self, path: str | bytes = "/", plus: bool = False) -> list[DirEntry]:
        base = self._norm(path)
        attr = await self.stat(base)
        if not attr.is_dir():
            raise OSError(errno.ENOTDIR, f"{base}: not a directory")
        out: list[DirEntry] = []
        cookie = 0
        while True:
            page, eof = await self.meta.readdir(attr.st_ino, cookie, READDIR_PAGE, plus, self.cred)
            for e in page:
                out.append(DirEntry(e.name, posixpath.join(base, e.name), e.inode_number,
                                    e.mode, e.cookie, e.attr))
            if eof or not page:
                return out
            cookie = page[-1].cookie

    async def listdir(self, path: str | bytes = "/") -> list[str]:
        return [e.name for e in await self.scandir(path)]

    # Entry calls name their entry by path: the metaserver resolves it in the same
    # round trip (docs/rpc.md, "path" beside "parent" + "name").
    def _path(self, path: str | bytes) -> bytes:
        return fsname(self._norm(path))

    def _at(self, path: str | bytes) -> At:
        return At.by_path(self._path(path))

    def _wcred(self) -> WireCred:
        return self.meta.wire_cred(self.cred)

    async def mkdir(self, path: str | bytes, mode: int = 0o777) -> None:
        await self.meta.request(M.Mkdir(at=self._at(path), mode=mode & ~self.umask,
                                        cred=self._wcred()))

    async def makedirs(self, path: str | bytes, mode: int = 0o777, exist_ok: bool = False) -> None:
        p = self._norm(path).rstrip("/")
        if not p:
            if exist_ok:
                return
            raise OSError(errno.EEXIST, "/ exists")
        head = posixpath.dirname(p)
        if head and head != "/" and not await self.exists(head):
            await self.makedirs(head, mode, exist_ok=True)
        try:
            await self.mkdir(p, mode)
        except FileExistsError:
            if not exist_ok or not (await self.stat(p)).is_dir():
                raise

    async def remove(self, path: str | bytes) -> None:
        await self.meta.request(M.Unlink(at=self._at(path), cred=self._wcred()))

    unlink = remove

    async def rmdir(self, path: str | bytes) -> None:
        await self.meta.request(M.Rmdir(at=self._at(path), cred=self._wcred()))

    async def rename(self, src: str | bytes, dst: str | bytes, flags: int = 0) -> None:
        await self.meta.request(M.Rename(at=self._at(src), new=self._at(dst), flags=flags,
                                         cred=self._wcred()))

    replace = rename

    async def link(self, src: str | bytes, dst: str | bytes) -> None:
        attr = await self.lstat(src)
        await self.meta.request(M.Link(ino=attr.st_ino, new=self._at(dst),
                                       cred=self._wcred()))

    async def symlink(self, target: str | bytes, path: str | bytes) -> None:
        await self.meta.request(M.Symlink(at=self._at(path), target=fsname(target),
                                          cred=self._wcred()))

    async def readlink(self, path: str | bytes) -> str:
        attr = await self.lstat(path)
        return os.fsdecode(await self.meta.readlink(attr.st_ino))

    async def chmod(self, path: str | bytes, mode: int) -> None:
        attr = await self.stat(path)
        await self.meta.setattr(attr.st_ino, self.cred, mode=mode & 0o7777)

    async def chown(self, path: str | bytes, uid: int, gid: int) -> None:
        attr = await self.stat(path)
        await self.meta.setattr(attr.st_ino, self.cred, uid=None if uid < 0 else uid,
                                gid=None if gid < 0 else gid)

    async def utime(self, path: str | bytes, times: tuple[float, float] | None = None, *,
                    ns: tuple[int, int] | None = None) -> None:
        attr = await self.stat(path)
        if ns is not None:
            at, mt = ns
        elif times is not None:
            at, mt = int(times[0] * 1e9), int(times[1] * 1e9)
        else:
            at = mt = "now"  # type: ignore[assignment]
        await self.meta.setattr(attr.st_ino, self.cred, atime=at, mtime=mt)

    async def truncate(self, path: str | bytes, size: int) -> None:
        attr = await self.stat(path)
        await self.meta.setattr(attr.st_ino, self.cred, size=size)
        st = self._inodes.get(attr.st_ino)
        if st is not None:
            st.size, st.written_end = size, min(st.written_end, size)

    async def getxattr(self, path: str | bytes, name: str | bytes) -> bytes:
        return await self.meta.getxattr((await self.stat(path)).st_ino, name, self.cred)

    async def setxattr(self, path: str | bytes, name: str | bytes, value: bytes,
                       flags: int = 0) -> None:
        await self.meta.setxattr((await self.stat(path)).st_ino, name, value, flags, self.cred)

    async def listxattr(self, path: str | bytes) -> list[str]:
        names = await self.meta.listxattr((await self.stat(path)).st_ino, self.cred)
        return [os.fsdecode(n) for n in names]

    async def removexattr(self, path: str | bytes, name: str | bytes) -> None:
        await self.meta.removexattr((await self.stat(path)).st_ino, name, self.cred)

    async def statvfs(self, path: str | bytes = "/") -> StatVFS:
        s = await self.meta.statfs()
        return StatVFS(s["bsize"], s.get("frsize", s["bsize"]), s["blocks"], s["bfree"],
                       s["bavail"], s["files"], s["ffree"], s["ffree"], s["namemax"])

    async def get_layout(self, path: str | bytes) -> dict[str, Any]:
        return await self.meta.get_layout((await self.stat(path)).st_ino)

    async def set_layout(self, path: str | bytes, count: int = 0, unit: int = 0,
                         replicas: int = 0) -> dict[str, Any]:
        ino = (await self.stat(path)).st_ino
        return await self.meta.set_layout(ino, unit, count, replicas, self.cred)

    async def open(self, path: str | bytes, mode: str | int = "rb", perm: int = 0o666) -> FileHandle:
        flags = open_flags(mode) if isinstance(mode, str) else mode
        p = self._norm(path)
        if flags & os.O_CREAT:
            try:
                r = await self.meta.request(M.Create(at=self._at(p), mode=perm & ~self.umask,
                                                     flags=flags, cred=self._wcred()))
                return self._handle(r.to_wire(), flags, p)
            except FileExistsError:
                if flags & os.O_EXCL:
                    raise
        attr, _, _ = await self.meta.resolve(p, True, self.cred)
        if statmod.S_ISDIR(attr.st_mode) and (flags & os.O_ACCMODE) != os.O_RDONLY:
            raise OSError(errno.EISDIR, f"{p}: is a directory")
        return self._handle(await self.meta.open(attr.st_ino, flags, self.cred), flags, p)

    async def read_file(self, path: str | bytes) -> bytes:
        f = await self.open(path, "rb")
        try:
            buf = bytearray(f.size)
            n = await f.pread_into(buf, 0)
            return bytes(buf[:n])
        finally:
            await f.close()

    async def write_file(self, path: str | bytes, data: Any) -> None:
        f = await self.open(path, "wb")
        try:
            await f.pwrite(data, 0)
        finally:
            await f.close()


def direct_max(profile: str) -> int:
    """Largest request the sync client serves in the caller's thread (from local object
    descriptors, or as one request to a data server): a latency-bound one (``inference``:
    its largest op; ``auto``: up to SMALL_READ_MAX); never under ``load``, whose reads
    go to the engine and the servers in parallel."""
    if profile == "load":
        return 0
    return profile_settings(profile, 1).chunk if profile == "inference" else SMALL_READ_MAX


def _config_cred(config: ClientConfig) -> Cred:
    cur = Cred.current()
    uid = cur.uid if config.uid < 0 else config.uid
    gid = cur.gid if config.gid < 0 else config.gid
    return Cred(uid, gid, cur.groups if config.uid < 0 else ())
