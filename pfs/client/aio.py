"""The async pfs client: an os-like path API and open files, on one trio nursery.

The FUSE mount uses the same object: ``client.meta`` for inode-level namespace calls and
``open_ino`` / ``create_in`` for file handles, so no filesystem logic lives in ``fuse/``.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import trio

from pfs.client import device, ops, plan
from pfs.client.blocking_driver import BlockingDriver
from pfs.client.data import DataClient, run_all
from pfs.client.direct import DirectData
from pfs.client.filled import settle_views
from pfs.client.health import Health
from pfs.client.meta import MetaClient
from pfs.client.ops import StatVFS
from pfs.client.plan import HandOver, Plan
from pfs.client.shortcircuit import HandleObjects, LocalServers
from pfs.client.trio_driver import TrioDriver
from pfs.client.types import Cred, DirEntry, StatResult
from pfs.client.writeback import WRITE_BEHIND, HandleWrites, WriteBack
from pfs.core import metrics
from pfs.core.auth import check_wire, client_auth
from pfs.core.config import SMALL_READ_MAX, ClientConfig, client_config, profile_settings
from pfs.core.layout import Layout
from pfs.core.messages.meta import OpenedReply

log = logging.getLogger(__name__)

ROOT = 1
CLOSE_GRACE = 10.0  # seconds an exiting client spends closing files left open


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
    # stripes written since their last sync: a commit of any handle syncs them before
    # it commits a size, which covers every handle's writes
    unsynced: set[int] = field(default_factory=set)
    # the sync client writes from its callers' threads as well as from its trio thread
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def wrote(self, end: int) -> None:
        with self.lock:
            self.written_end = max(self.written_end, end)

    @property
    def known_size(self) -> int:
        return max(self.size, self.written_end)


_FLAGS: dict[str, int] = {}  # open_flags of the modes seen so far (a handful)


def open_flags(mode: str) -> int:
    """os.O_* flags for a Python ``open`` mode string."""
    flags = _FLAGS.get(mode)
    if flags is None:
        flags = _open_flags(mode)
        if len(_FLAGS) < 64:
            _FLAGS[mode] = flags
    return flags


def _open_flags(mode: str) -> int:
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


def _chunk_done(done: Any, chunk: plan.LocalChunk) -> None:
    """``done(off, n)`` for each destination of a chunk read in bulk."""
    for off, d in zip(chunk.file_offs, chunk.dests, strict=True):
        done(off, len(d))


class FileHandle:
    """An open pfs file: positionless reads and writes straight into/from buffers."""

    def __init__(self, client: AsyncClient, ino: int, fh: int, flags: int,
                 layout: Layout | dict[str, Any], state: _InodeState, path: str = "",
                 attr: StatResult | dict[str, Any] | None = None, cap: bytes | None = None,
                 cap_ttl: float = 0.0, cred: Cred | None = None) -> None:
        self.client = client
        self.cred = cred  # who opened it (a reopen after a lost handle uses it again)
        self.cap = cap  # the data capability (docs/rpc.md); renewed before it expires
        self._renew_at = math.inf
        self._cap_gen = 0  # capabilities set so far: concurrent renewals make one
        self._renewing: trio.Lock | None = None  # made by the first renewal
        self._set_cap(cap, cap_ttl)
        # the layout and the attributes at open, as records or still as the reply's
        # maps: read at first use (a file created and closed, the commonest handle of
        # a metadata workload, never reads them)
        if isinstance(attr, dict):
            self._attr_wire = attr
        else:
            self.attr = attr
        if isinstance(layout, dict):
            self._layout_wire = layout
        else:
            self.layout = layout
        self.ino = ino
        self.fh = fh
        self.meta_gen = client.meta.generation  # the metadata connection fh belongs to
        self.flags = flags
        self.state = state
        self.path = path
        self.closed = False
        self._dirty = False  # written since the size was last committed
        # a write or sync went to a data server under this handle's capability (set
        # before it is sent): its close says when none did (metaserver/handles.py)
        self.sent = False
        self.created = False  # by a create that made the file (it has no xattrs)
        # a read-only handle reads local objects through descriptors (short circuit)
        self._objects = (HandleObjects(client.local) if client.local is not None
                         and flags & os.O_ACCMODE == os.O_RDONLY else None)

    @cached_property
    def layout(self) -> Layout:
        """The file's layout (decoded from the open's reply at first use)."""
        return Layout.from_wire(self._layout_wire)

    @cached_property
    def attr(self) -> StatResult | None:
        """The metaserver's attributes at open (FUSE replies with them)."""
        return StatResult.from_wire(self._attr_wire)

    # -- capabilities ------------------------------------------------------------
    def _set_cap(self, cap: bytes | None, ttl: float) -> None:
        self.cap = cap
        self._cap_gen += 1
        # renewed at 3/4 of its life, by this host's clock (no skew with the metaserver's);
        # time.monotonic, not trio's clock: the sync client opens files outside trio
        self._renew_at = time.monotonic() + 0.75 * ttl if cap is not None else math.inf

    async def renew(self) -> None:
        """Get a fresh capability (``ops.renew``: a lost handle is opened again);
        concurrent renewals of this handle make one."""
        gen = self._cap_gen
        if self._renewing is None:  # (trio: no other task runs before it is set)
            self._renewing = trio.Lock()
        async with self._renewing:
            if self._cap_gen == gen:  # else another task renewed (or reopened) meanwhile
                await self.client.driver.run(ops.renew(self))

    async def refresh_layout(self) -> Layout:
        """The layout again (a data server said a chain version is stale): its chains'
        members and versions now."""
        got = await self.client.driver.run(ops.meta_get_layout(self.ino))
        if got:
            self.layout = Layout.from_wire(got)
        return self.layout

    def renew_due(self) -> bool:
        return time.monotonic() >= self._renew_at

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

    # -- data: plans (pfs/client/plan.py) carried out by the trio driver, or by the
    # blocking driver in the sync client's calling thread --------------------------
    def _read_plan(self, view: memoryview, off: int) -> Plan[None]:
        return plan.read(self, self.ino, self.layout, off, view, self.cap,
                         renew_due=time.monotonic() >= self._renew_at, local=self._objects,
                         health=self.client.health)

    def _write_plan(self, view: memoryview, off: int) -> Plan[None]:
        self.sent = True
        return plan.write(self, self.ino, self.layout, off, view, self.cap,
                          renew_due=time.monotonic() >= self._renew_at)

    def _wrote(self, off: int, n: int) -> None:
        # the stripes the next commit (close, flush) syncs first (a set update under
        # the GIL: the sync client's threads write too), before the size that commit
        # reads: a size is committed only over stripes taken for its sync
        self.state.unsynced.update(plan.stripes_of(self.layout, off, n))
        self.state.wrote(off + n)
        self._dirty = True

    async def open_local(self, timeout: float = 30.0) -> int:
        """Short-circuit descriptors of all of this read-only file's stripes, asked for
        at once (:meth:`HandleObjects.open_all`); how many local ones it holds (0: none
        local, or short-circuit off)."""
        if self._objects is None:
            return 0
        return await self._objects.open_all(self.layout.servers, self.ino, self.cap, timeout)

    def local_stripes(self) -> int:
        """How many stripes this handle holds a short-circuit descriptor of."""
        if self._objects is None:
            return 0
        return sum(1 for s in range(self.layout.count) if self._objects.known_fd(s) is not None)

    async def pread_into(self, buf: Any, off: int) -> int:
        """Read up to ``len(buf)`` bytes at ``off`` into ``buf``; returns bytes read.
        Bytes this client wrote behind and still in flight are read back: the read
        waits for the writes over its range, or for all of the file's when it reaches
        past the size known so far (one in flight may extend the file). A GPU buffer
        (``__cuda_array_interface__``) is filled through pinned host staging
        (:mod:`pfs.client.device`)."""
        self._check(False)
        if self.client.writes.busy(self.ino):
            await self.client.writes.before_read(self.ino, off, device.buffer_size(buf),
                                                 self.state.known_size)
        if device.is_device_buffer(buf):
            if off < 0:
                raise OSError(errno.EINVAL, "negative offset")
            try:
                direct = await device.read_direct(self, buf, off)
                if direct is not None:  # local objects by kvikio, verified on the device
                    return direct
                return await self.client.driver.run(
                    device.read(buf, off, self.state.known_size, self._read_chunk))
            except OSError as exc:
                raise self._named(exc) from exc
        if off < 0:
            raise OSError(errno.EINVAL, "negative offset")
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self.state.known_size - off))
        if n:
            try:
                await self.client.driver.run(self._read_plan(view[:n], off))
            except OSError as exc:
                raise self._named(exc) from exc
        return n

    async def pread_many(self, reads: Sequence[tuple[int, Any]], done: Any = None,
                         chunk: int = 4 << 20, limiter: trio.CapacityLimiter | None = None,
                         mapped: bool = False, fill: bool = False) -> list[int]:
        """Many reads ``(offset, buffer)`` of this file at once (a loader's regions);
        each one's bytes read, as :meth:`pread_into` gives. Whatever lies in local
        objects this handle holds descriptors of (:meth:`open_local`) is read in bulk,
        regrouped by object into preadv's of about ``chunk`` bytes on worker threads,
        each verified as soon as it is read (:meth:`HandleObjects.read_chunks`); the
        rest, and a chunk that did not verify, through :meth:`pread_into`.
        ``done(off, n)``: called for the ``n`` file bytes at ``off`` once they are in
        their buffer (verified, holes zeroed), from a worker thread or this one. ``limiter``: the worker
        threads' (shared by the reads of several files: one pool for all). ``mapped``:
        the buffers lie in private anonymous mappings the caller owns, and the local
        objects' whole blocks are mapped into them copy-on-write instead of read
        (:mod:`pfs.client.mapping`: zero-copy, with the rule for later writes and
        truncations it says); the rest is read as without it. ``fill``: the buffers
        lie in fresh memory registered with :mod:`pfs.client.uffd`, and the local
        objects' whole blocks are copied into it from their page cache
        (:mod:`pfs.client.filled`); whatever is read otherwise has its pages made
        present first."""
        self._check(False)
        todo = []
        for off, buf in reads:
            if off < 0:
                raise OSError(errno.EINVAL, "negative offset")
            view = memoryview(buf).cast("B")
            todo.append((off, view[:max(0, min(len(view), self.state.known_size - off))]))
        out = [len(v) for _o, v in todo]
        rest: list[tuple[int, memoryview]] = todo
        if self._objects is not None and not self.client.writes.busy(self.ino) \
                and any(self._objects.known_fd(s) is not None
                        for s in range(self.layout.count)):
            chunks = plan.local_chunks(self.layout, todo, chunk)
            try:
                got = await self._objects.read_chunks(
                    chunks, done=None if done is None else partial(_chunk_done, done),
                    limiter=limiter, mapped=mapped, fill=fill)
            except OSError as exc:
                raise self._named(exc) from exc
            rest = [(o, d) for c, g in zip(chunks, got, strict=True) if g is None
                    for o, d in zip(c.file_offs, c.dests, strict=True)]
        if fill:  # written by the network path from the kernel: pages there first
            settle_views([d for _o, d in rest])

        limit = trio.CapacityLimiter(64)  # pieces of stripes with no local object

        async def one(off: int, view: memoryview) -> None:
            async with limit:
                await self.pread_into(view, off)
            if done is not None:
                done(off, len(view))

        await run_all([partial(one, o, v) for o, v in rest if len(v)])
        return out

    def _named(self, exc: OSError) -> OSError:
        """A data error (EIO: a checksum mismatch, a missing or short object;
        ETIMEDOUT: no replica answered) naming this file; other errors as they are."""
        if exc.errno not in (errno.EIO, errno.ETIMEDOUT):
            return exc
        return OSError(exc.errno, f"{self.path or f'inode {self.ino}'}: {exc.strerror}")

    def _read_chunk(self, view: memoryview, off: int) -> Plan[int]:
        yield from self._read_plan(view, off)  # a fresh capability for each chunk
        return len(view)

    def pread_blocking(self, buf: Any, off: int) -> int | None:
        """The sync client's read in the calling thread (the blocking driver: a
        ``preadv`` of a local object, a request over a blocking connection), for a
        request of at most the profile's ``direct_max``. None: run ``pread_into`` on
        the trio driver instead (a larger request, a GPU buffer, or an effect only the
        trio driver carries out)."""
        if self.closed or not self.readable:
            self._check(False)  # raises
        if off < 0 or hasattr(buf, "__cuda_array_interface__"):
            return None
        view = memoryview(buf).cast("B")
        n = min(len(view), self.state.known_size - off)
        if n <= 0:
            return 0
        if n > self.client.direct_max:
            return None
        if n < len(view):
            view = view[:n]
        # a small read is one step (plan.read_step): no generator, unless it fails
        step = plan.read_step(self.ino, self.layout, off, view, self.cap,
                              time.monotonic() >= self._renew_at, self._objects,
                              self.client.health)
        try:
            if step is None:
                self.client.blocking.run(self._read_plan(view, off))
            else:
                self.client.blocking.run_step(step, plan.read_step_done,
                                              self._read_plan, view, off)
        except HandOver:
            return None
        except OSError as exc:
            raise self._named(exc) from exc
        return n

    def pwrite_blocking(self, data: Any, off: int) -> int | None:
        """``pwrite`` in the calling thread, as ``pread_blocking``; None: run ``pwrite``
        on the trio driver (which writes every replica again)."""
        if self.closed or not self.writable or off < 0:
            return None  # pwrite raises
        view = memoryview(data).cast("B")
        if not view or len(view) > self.client.direct_max:
            return None
        if self.flags & os.O_APPEND:
            off = self.state.known_size
        self.sent = True
        step = plan.write_step(self.ino, self.layout, off, view, self.cap,
                               time.monotonic() >= self._renew_at)
        try:
            if step is None:
                self.client.blocking.run(self._write_plan(view, off))
            else:
                self.client.blocking.run_step(step, None, self._write_plan, view, off)
        except HandOver:
            return None
        self._wrote(off, len(view))
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
            try:
                await self.client.driver.run(self._write_plan(view, off))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise OSError(errno.ENOSPC, f"{self.path or f'inode {self.ino}'}: "
                                            f"{exc.strerror}") from exc
            self._wrote(off, len(view))
        return len(view)

    # -- metadata: plans of pfs/client/ops.py, after the writes in flight land --------
    async def truncate(self, size: int) -> None:
        """Set the file's size (ftruncate), after this client's writes of it in flight;
        an earlier write's error of this handle is raised first."""
        await self.drain()
        self._raise_deferred()
        await self.client.driver.run(ops.truncate_handle(self, size))

    async def commit(self) -> None:
        """Tell the metaserver how far this client wrote, once the writes in flight
        landed and what they wrote is on stable storage (``ops.commit``); then raise an earlier write's error of this handle (what close(2)
        reports: the mount's flush)."""
        await self.drain()
        await self.client.driver.run(ops.commit(self))
        self._raise_deferred()

    async def fsync(self) -> None:
        """The file's objects to stable storage and its size to the metaserver, after
        the writes in flight land; an earlier write's error of this handle first."""
        if self.closed:
            raise ValueError("I/O operation on closed file")
        await self.drain()
        self._raise_deferred()
        await self.client.driver.run(ops.fsync(self) if self.writable else ops.commit(self))

    async def getattr(self) -> StatResult:
        return await self.client.driver.run(ops.getattr_handle(self))

    async def close(self) -> None:
        """Close the handle after the writes in flight land and what this handle wrote
        is on stable storage on every replica (unless its layout opted out); only then
        is the size committed. An earlier write's error not yet reported is raised
        once the handle is closed (it is closed either way), else a failed sync's (the
        size is then left uncommitted)."""
        await self.drain()
        err = self._take_deferred()
        try:
            await self.client.driver.run(ops.close_handle(self))
        except OSError:
            if err is None:
                raise
        if err is not None:
            raise err

    def _released(self) -> None:
        """The handle is closed: its descriptors and its share of the inode's state go."""
        if self._objects is not None:
            self._objects.close()
        self.client._release_state(self.ino)
        self.client.handles.discard(self)

    # -- write-behind (pfs/client/writeback.py) ----------------------------------
    _writes: HandleWrites | None = None  # this handle's share, from its first write_behind

    def _take_deferred(self) -> OSError | None:
        """The first error of this handle's writes behind, if one is unreported."""
        if self._writes is None:
            return None
        return self._writes.take_error(self.path or f"inode {self.ino}")

    def _raise_deferred(self) -> None:
        err = self._take_deferred()
        if err is not None:
            raise err

    async def write_behind(self, data: Any, off: int, limit: int = WRITE_BEHIND) -> int:
        """Write ``data`` at ``off``, returning once the write is under way: it lands in
        the background, so one writer keeps several in flight. ``data`` is copied unless
        it is ``bytes``. Overlapping writes land in the order they were accepted; at
        most ``limit`` of this handle's are in flight (the first call's ``limit`` holds).
        ``pread_into`` sees them; ``commit``, ``fsync``, ``truncate`` and ``close`` wait
        for them, and a failure is raised by this handle's next ``write_behind`` or one
        of those. ``limit`` 0, or an O_APPEND handle (its offset is the size when the
        write runs): the write waits, after the writes in flight."""
        self._raise_deferred()
        if self.closed:
            raise ValueError("I/O operation on closed file")
        if not self.writable:
            raise OSError(errno.EBADF, "file not open for writing")
        if off < 0:
            raise OSError(errno.EINVAL, "negative offset")
        writes = self.client.writes
        if limit <= 0 or self.flags & os.O_APPEND:
            await writes.drain(self.ino)
            return await self.pwrite(data, off)
        buf = data if isinstance(data, bytes) else bytes(memoryview(data).cast("B"))
        if not buf:
            return 0
        if self._writes is None:
            self._writes = HandleWrites(limit)
        await writes.start(self.ino, self._writes, off, off + len(buf),
                           partial(self.pwrite, buf, off), self.path)
        return len(buf)

    async def drain(self) -> None:
        """Wait until every write of this file accepted so far (by any of this client's
        handles of it) has landed. Raises nothing: errors are each handle's to report."""
        await self.client.writes.drain(self.ino)


class AsyncClient:
    def __init__(self, config: ClientConfig, nursery: trio.Nursery,
                 cred: Cred | None = None, direct_meta: bool = False) -> None:
        self.config = config
        self.cred = cred or _config_cred(config)
        self.umask = _current_umask()
        # the mount's, or a long-running program's, /metrics (0: off; once per process)
        metrics.serve(config.metrics_port)
        host, port = config.meta_addr
        creds = client_auth(config.key_file, config.key_name, config.tls_cert,
                            config.tls_key, config.tls_ca,
                            check_wire(config.wire_security, "client") if config.key_file
                            else config.wire_security)
        self.meta = MetaClient(nursery, host, port, timeout=config.timeout, cred=self.cred,
                               auth=creds, direct=direct_meta,
                               connect_timeout=config.connect_timeout)
        self.data_auth = creds.for_data()  # what other data-server clients connect with
        self.data = DataClient(nursery, self.meta.servers,
                               connections_per_server=config.connections_per_server,
                               timeout=config.timeout, auth=creds.for_data())
        # short-circuit reads of objects on this host's data servers (pfs/client/shortcircuit.py)
        self.local = LocalServers(creds.for_data()) if config.short_circuit else None
        # plans carried out in the trio thread, and in the sync client's callers' threads
        # what this client measured of each data server: hedge deadlines, replica order
        self.health = Health(hedge_min=config.hedge_min, hedge_max=config.hedge_max,
                             penalty=config.slow_penalty)
        self.driver = TrioDriver(self.data, self.meta, self.health, nursery)
        self.blocking = BlockingDriver(
            DirectData(creds.for_data(), self.data.known_address, config.timeout)
            if direct_meta else None, self.meta, self.health)
        self._inodes: dict[int, _InodeState] = {}
        # the sync client opens and closes handles in its callers' threads as well
        self._inodes_lock = threading.Lock()
        self.handles: set[FileHandle] = set()  # open; closed (sizes committed) by aclose
        # requests up to this size may be served in the sync client's calling thread
        # (FileHandle.pread_blocking, pwrite_blocking): latency-bound ones
        self.direct_max = direct_max(config.profile)
        self.writes = WriteBack(nursery)  # writes in flight (FileHandle.write_behind)

    @classmethod
    @asynccontextmanager
    async def connect(cls, config: Any = None, meta: str | None = None,
                      cred: Cred | None = None) -> AsyncIterator[AsyncClient]:
        cfg = client_config(config, meta)
        async with trio.open_nursery() as nursery:
            client = cls(cfg, nursery, cred)
            try:
                await client.meta.hello("pfs")
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
        await self.writes.drain_all()
        for h in list(self.handles):
            try:
                await h.close()
            except OSError as exc:
                log.warning("closing %s (inode %d): %s", h.path or "a file", h.ino, exc)
        self.close()

    def close(self) -> None:
        self.data.close()
        if self.blocking.data is not None:
            self.blocking.data.close()
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

    def truncated(self, ino: int, size: int) -> None:
        """``ino`` was cut to ``size`` (by path): what was written past it is gone."""
        st = self._inodes.get(ino)
        if st is not None:
            st.size, st.written_end = size, min(st.written_end, size)

    def merged_attr(self, attr: StatResult) -> StatResult:
        """An attribute record with sizes this client wrote but has not committed,
        writes still in flight included."""
        st = self._inodes.get(attr.st_ino)
        end = max(st.written_end if st is not None else 0, self.writes.end(attr.st_ino))
        if end > attr.st_size:
            return attr.with_size(end)
        return attr

    # -- handles by inode (FUSE) -------------------------------------------------
    def _handle(self, r: OpenedReply, flags: int, path: str = "",
                cred: Cred | None = None) -> FileHandle:
        a = r.attr  # (a map: the handle makes its StatResult when asked)
        ino = a["ino"]
        state = self._acquire_state(ino, a["size"])
        h = FileHandle(self, ino, r.fh, flags, r.layout, state, path,  # type: ignore[arg-type]
                       a, r.cap, float(r.cap_ttl or 0.0), cred)
        h.created = r.created
        self.handles.add(h)
        return h

    async def open_ino(self, ino: int, flags: int, cred: Cred | None = None) -> FileHandle:
        return self._handle(await self.meta.open(ino, flags, cred), flags, cred=cred)

    async def create_in(self, parent: int, name: str | bytes, mode: int, flags: int,
                        cred: Cred | None = None, want_parent: bool = False
                        ) -> tuple[FileHandle, StatResult | None]:
        """Create and open ``name`` in directory ``parent``; with ``want_parent``, also
        the directory's attributes after the change (else None)."""
        r, parent_attr = await self.meta.create(parent, name, mode, flags | os.O_CREAT, cred,
                                                want_parent)
        return self._handle(r, flags, cred=cred), parent_attr

    async def getattr(self, ino: int) -> StatResult:
        return self.merged_attr(await self.meta.getattr(ino))

    async def commit_writes(self, ino: int) -> None:
        """Land this client's writes of ``ino`` in flight and commit the sizes its
        handles wrote: before a size or times set explicitly, which a later commit
        (a close) must not overwrite (cp -a, tar, rsync set mtime after writing)."""
        await self.writes.drain(ino)
        for h in [h for h in self.handles if h.ino == ino]:
            # the size only: each handle's write error is its own close's to report
            await self.driver.run(ops.commit(h))

    async def truncate_ino(self, ino: int, size: int, cred: Cred | None = None,
                           handle: FileHandle | None = None) -> StatResult:
        """Set the size of inode ``ino``, after the sizes this client wrote (see
        ``commit_writes``); through ``handle`` if it is open for writing (ftruncate: the
        write access was checked at open), else as ``cred``. The new attributes."""
        await self.commit_writes(ino)
        if handle is not None and handle.writable:
            await handle.truncate(size)
            return await self.getattr(ino)
        attr = await self.meta.setattr(ino, cred or self.cred, size=size)
        self.truncated(ino, attr.st_size)
        return attr


    # -- paths: plans of pfs/client/ops.py on the trio driver ---------------------------
    _norm = staticmethod(ops.norm)

    async def stat(self, path: str | bytes, follow_symlinks: bool = True) -> StatResult:
        return await self.driver.run(ops.stat(self, path, follow_symlinks))

    async def lstat(self, path: str | bytes) -> StatResult:
        return await self.driver.run(ops.lstat(self, path))

    async def exists(self, path: str | bytes) -> bool:
        return await self.driver.run(ops.exists(self, path))

    async def scandir(self, path: str | bytes = "/", plus: bool = False) -> list[DirEntry]:
        return await self.driver.run(ops.scandir(self, path, plus))

    async def listdir(self, path: str | bytes = "/") -> list[str]:
        return await self.driver.run(ops.listdir(self, path))

    async def mkdir(self, path: str | bytes, mode: int = 0o777) -> None:
        return await self.driver.run(ops.mkdir(self, path, mode))

    async def makedirs(self, path: str | bytes, mode: int = 0o777, exist_ok: bool = False) -> None:
        return await self.driver.run(ops.makedirs(self, path, mode, exist_ok))

    async def remove(self, path: str | bytes) -> None:
        return await self.driver.run(ops.remove(self, path))

    unlink = remove

    async def rmdir(self, path: str | bytes) -> None:
        return await self.driver.run(ops.rmdir(self, path))

    async def rename(self, src: str | bytes, dst: str | bytes, flags: int = 0) -> None:
        return await self.driver.run(ops.rename(self, src, dst, flags))

    replace = rename

    async def link(self, src: str | bytes, dst: str | bytes) -> None:
        return await self.driver.run(ops.link(self, src, dst))

    async def symlink(self, target: str | bytes, path: str | bytes) -> None:
        return await self.driver.run(ops.symlink(self, target, path))

    async def readlink(self, path: str | bytes) -> str:
        return await self.driver.run(ops.readlink(self, path))

    async def chmod(self, path: str | bytes, mode: int) -> None:
        return await self.driver.run(ops.chmod(self, path, mode))

    async def chown(self, path: str | bytes, uid: int, gid: int) -> None:
        return await self.driver.run(ops.chown(self, path, uid, gid))

    async def utime(self, path: str | bytes, times: tuple[float, float] | None = None, *,
                    ns: tuple[int, int] | None = None) -> None:
        return await self.driver.run(ops.utime(self, path, times, ns))

    async def truncate(self, path: str | bytes, size: int) -> None:
        return await self.driver.run(ops.truncate(self, path, size))

    async def getxattr(self, path: str | bytes, name: str | bytes) -> bytes:
        return await self.driver.run(ops.getxattr(self, path, name))

    async def setxattr(self, path: str | bytes, name: str | bytes, value: bytes,
                       flags: int = 0) -> None:
        return await self.driver.run(ops.setxattr(self, path, name, value, flags))

    async def listxattr(self, path: str | bytes) -> list[str]:
        return await self.driver.run(ops.listxattr(self, path))

    async def removexattr(self, path: str | bytes, name: str | bytes) -> None:
        return await self.driver.run(ops.removexattr(self, path, name))

    # -- batched: one request per MAX_MANY paths, one commit for each; a result per path
    async def create_many(self, paths: Sequence[str | bytes], mode: int = 0o666,
                          exclusive: bool = True) -> list[OSError | None]:
        """Create each path as an empty file (and close it): None, or the path's
        OSError (``FileExistsError`` when it exists and ``exclusive``)."""
        return await self.driver.run(ops.create_many(self, paths, mode, exclusive))

    async def stat_many(self, paths: Sequence[str | bytes], follow_symlinks: bool = True
                        ) -> list[StatResult | OSError]:
        """Each path's attributes, or its OSError."""
        return await self.driver.run(ops.stat_many(self, paths, follow_symlinks))

    async def unlink_many(self, paths: Sequence[str | bytes]) -> list[OSError | None]:
        """Unlink each path: None, or the path's OSError."""
        return await self.driver.run(ops.unlink_many(self, paths))

    async def statvfs(self, path: str | bytes = "/") -> StatVFS:
        return await self.driver.run(ops.statvfs(self, path))

    async def get_layout(self, path: str | bytes) -> dict[str, Any]:
        return await self.driver.run(ops.get_layout(self, path))

    async def set_layout(self, path: str | bytes, count: int = 0, unit: int = 0,
                         replicas: int = 0, durable: bool | None = None) -> dict[str, Any]:
        return await self.driver.run(ops.set_layout(self, path, count, unit, replicas,
                                                    durable))

    async def open(self, path: str | bytes, mode: str | int = "rb", perm: int = 0o666) -> FileHandle:
        flags = open_flags(mode) if isinstance(mode, str) else mode
        return await self.driver.run(ops.open_path(self, path, flags, perm))

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
