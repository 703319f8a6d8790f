"""Short-circuit reads: objects of data servers on this host, read by the client itself.

A data server listens, besides TCP, on a local Unix socket named after its id
(``local_socket_name``, in Linux's abstract namespace: no file, no path-length limit, and
a name a server on another host cannot answer to). A client that opens a file read-only
asks each stripe's server there, once per handle, for the object: after authenticating
(the same data-plane key as over TCP) and the same capability check as a read, the server
answers with a read-only descriptor of the object file (SCM_RIGHTS). The client then
reads stripes straight from the page cache or the drive with its I/O engine into the
caller's buffer: no bytes through TCP, no copy in the data server.

Anything that does not work out — no local server of that id, an absent object, a refusal
— leaves that stripe on the network path, which gives the same bytes. A descriptor stays
valid after the capability that obtained it expires, as an open file stays readable
after a chmod; the client holds it only while its handle is open.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from pfs.client import uffd
from pfs.client.filled import fill_verified, settle_views
from pfs.client.mapping import map_verified
from pfs.client.plan import LocalChunk, open_fd_request, zero_unread
from pfs.client.verify import read_local
from pfs.core import metrics
from pfs.core.checksums import ChecksumError, VerifiedRead, read_verified
from pfs.core.errors import ProtocolError, from_wire
from pfs.core.wire.protocol import Kind
from pfs.core.wire.transport import Connection, local_socket_name, open_unix_connection

log = logging.getLogger(__name__)

# Bulk reads (:meth:`HandleObjects.read_chunks`, the loader's): threads that each read a
# chunk with one preadv and verify it at once, while its bytes are still in the cache.
BULK_THREADS = 4  # 2 would keep 2 cores busy warm; more give a cold drive a deeper queue
# Bytes of a file's chunks the kernel is asked to read ahead of its readers, by a thread
# of its own (:meth:`HandleObjects._prefetch`): the readers never wait in those calls
# (WILLNEED, the readers' own before, blocked 2-3.5 s of a cold 1.4 GB load, summed
# over threads, while it allocated pages and queued the reads).
BULK_WINDOW = 64 << 20
_STATS_LOCK = threading.Lock()


_PROBE = bytearray(1)  # the cache probe's destination (its byte is never used)
SCRATCH = 4 << 20  # what a prefetching read asks for at most (its bytes are never used)
_scratch: memoryview | None = None
_nowait_ok = True  # preadv RWF_NOWAIT works here (asked once per process)


def _cached(fd: int, off: int, n: int) -> bool:
    """Whether the first and last bytes of ``[off, off+n)`` are in the page cache (a
    1-byte ``RWF_NOWAIT`` read of each; past the end counts as cached). Where
    ``RWF_NOWAIT`` is refused: True."""
    try:
        for at in (off, off + max(n, 1) - 1):
            os.preadv(fd, [_PROBE], at, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    return True


class _Progress:
    """How far the readers of one :meth:`HandleObjects.read_chunks` call are: the
    chunks taken so far, and whether they are done (the prefetcher's cue)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.taken = 0
        self.stop = False


class _Channel:
    """One authenticated local connection; descriptor requests go one at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = trio.Lock()
        self.rid = 0

    async def open_fd(self, ino: int, stripe: int, cap: bytes | None) -> int | None:
        """A descriptor of the object (its sidecar's, if sent, closed); None: absent."""
        got = await self.open_fds(ino, stripe, cap)
        if got is None:
            return None
        if got[1] is not None:
            os.close(got[1])
        return got[0]

    async def open_fds(self, ino: int, stripe: int, cap: bytes | None
                       ) -> tuple[int, int | None] | None:
        """Descriptors of the object and of its checksum sidecar (None: an object
        without checksums); None when the object is absent."""
        async with self.lock:
            self.rid += 1
            try:
                await self.conn.send_frame(Kind.REQUEST, self.rid,
                                           open_fd_request(ino, stripe, cap).to_wire())
                head, fds = await self.conn.recv_frame_with_fds()
            except BaseException:  # a reply half-read (or never read) leaves the stream
                self.conn.close()  # out of step: this channel is done
                raise
        if head.kind == Kind.ERROR or not fds:
            for fd in fds:
                os.close(fd)
            err = from_wire(head.fields.get("errno"), head.fields.get("msg"))
            if err.errno == errno.ENOENT:
                return None
            raise err
        for extra in fds[2:]:
            os.close(extra)
        return fds[0], (fds[1] if len(fds) > 1 else None)


class LocalServers:
    """A client's local channels, by data server id (None: that server is not here)."""

    def __init__(self, auth: Any, engine: str = "auto") -> None:
        self._auth = auth
        self._engine_name = engine
        self._engine: Any = None
        self._channels: dict[str, _Channel | None] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self.handles: set[HandleObjects] = set()  # with descriptors; closed with us
        # local_bytes: read or mapped from local objects; mapped_bytes: of them, mapped
        # filled_bytes: of them, copied into fresh memory by UFFDIO_COPY (filled.py)
        self.stats = {"local_reads": 0, "local_bytes": 0, "fds": 0, "mapped_bytes": 0,
                      "filled_bytes": 0}

    @property
    def engine(self) -> Any:
        if self._engine is None:
            from pfs.core.engine import get_engine

            self._engine = get_engine(self._engine_name)
        return self._engine

    async def channel(self, sid: str) -> _Channel | None:
        if sid in self._channels:
            return self._channels[sid]
        async with self._connecting.setdefault(sid, trio.Lock()):
            if sid in self._channels:
                return self._channels[sid]
            ch: _Channel | None = None
            try:
                conn = await open_unix_connection(local_socket_name(sid))
            except OSError:  # no server of this id on this host
                conn = None
            if conn is not None:
                try:
                    await self._auth.hello(conn)
                    ch = _Channel(conn)
                except (OSError, ProtocolError, trio.TooSlowError) as exc:
                    log.info("local data server %s refused us (%s): reading over TCP", sid, exc)
                    conn.close()
                except BaseException:  # cancelled (a sibling read failed): nothing kept
                    conn.close()
                    raise
            self._channels[sid] = ch
            return ch

    async def open_fd(self, sid: str, ino: int, stripe: int, cap: bytes | None
                      ) -> tuple[int, int | None] | None:
        ch = await self.channel(sid)
        if ch is None:
            return None
        try:
            fd = await ch.open_fds(ino, stripe, cap)
        except (OSError, ProtocolError) as exc:
            log.debug("short-circuit open of [%d, %d] on %s refused: %s", ino, stripe, sid, exc)
            if ch.conn.closed:  # the channel broke: try a new one next time
                self._channels.pop(sid, None)
            return None
        if fd is not None:
            self.stats["fds"] += 1
        return fd

    def close(self) -> None:
        for h in list(self.handles):  # handles left open: their descriptors go now
            h.close()
        for ch in self._channels.values():
            if ch is not None:
                ch.conn.close()
        self._channels.clear()
        if self._engine is not None:
            self._engine.close()
            self._engine = None


class HandleObjects:
    """The descriptors one read-only handle obtained, by stripe (None: read over TCP)."""

    def __init__(self, servers: LocalServers) -> None:
        self.servers = servers
        self._fds: dict[int, int | None] = {}
        # an object's descriptor -> its sidecar's and its id: reads of it are verified
        self._crcs: dict[int, tuple[int, tuple[int, int]]] = {}
        self._locks: dict[int, trio.Lock] = {}
        self.closed = False
        # reads in flight: their descriptors are closed when the last one ends, never
        # under them (a number reused by another open would be read instead)
        self._busy = 0
        self._closing = threading.Lock()  # close may run in the sync client's thread
        # objects mapped read-only, the sources of filled chunks (:meth:`_fill_chunk`)
        self._sources: dict[int, uffd.Source | None] = {}

    def _check_open(self) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "file is closed")

    def _enter(self) -> None:
        """A read starts using the descriptors (from either thread of the sync client)."""
        with self._closing:
            self._check_open()
            self._busy += 1

    def _leave(self) -> None:
        with self._closing:
            self._busy -= 1
            last = self.closed and not self._busy
        if last:
            self._close_fds()

    def _count(self, n: int, mapped: int = 0, key: str = "mapped_bytes") -> None:
        with _STATS_LOCK:  # counted from many threads (read_chunks, the sync client's)
            self.servers.stats["local_reads"] += 1
            self.servers.stats["local_bytes"] += n
            self.servers.stats[key] += mapped

    def tried(self, stripe: int) -> bool:
        """Whether a descriptor of ``stripe`` was asked for (None if it was refused)."""
        return stripe in self._fds

    def known_fd(self, stripe: int) -> int | None:
        """The descriptor of ``stripe`` if this handle already holds one."""
        return self._fds.get(stripe)

    async def open_all(self, servers: Sequence[tuple[str, ...]], ino: int, cap: bytes | None,
                       timeout: float) -> int:
        """Ask for the descriptors of every stripe at once (``servers``: the layout's
        replicas by stripe), waiting up to ``timeout`` s in all; how many it holds.

        For a reader about to read whole files (the loader): the reads' own lookups
        give a local server LOCAL_FD_TIMEOUT (1 s) per stripe, which a busy host can
        miss, and each miss sends that stripe over TCP for good; asked here first, the
        reads find the descriptors held."""
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                for stripe, replicas in enumerate(servers):
                    if not self.tried(stripe):
                        nursery.start_soon(self.fd, tuple(replicas), ino, stripe, cap)
        return sum(1 for fd in self._fds.values() if fd is not None)

    def read_blocking(self, fd: int, obj_off: int, dests: list[memoryview]) -> list[int]:
        """Read consecutive object bytes into ``dests`` in the calling thread, one
        ``preadv`` (the blocking driver: the sync client's small reads); returns the
        bytes there were for each destination (the planner zero-fills the rest)."""
        self._enter()
        try:
            checked = self._crcs.get(fd)
            if checked is not None:
                try:
                    counts = read_verified(checked[1], fd, checked[0], obj_off, dests)
                except ChecksumError:
                    metrics.checksum_failure("local")
                    raise
                self._count(sum(counts))
                return counts
            total = os.preadv(fd, dests, obj_off)
        finally:
            self._leave()
        self._count(total)
        if len(dests) == 1:  # a small read's one destination holds what there was
            return [total]
        counts = []
        for d in dests:
            n = min(total, len(d))
            counts.append(n)
            total -= n
        return counts

    async def fd(self, replicas: tuple[str, ...], ino: int, stripe: int,
                 cap: bytes | None) -> int | None:
        self._check_open()
        if stripe in self._fds:
            metrics.cache_lookup("local_fd", True)
            return self._fds[stripe]
        metrics.cache_lookup("local_fd", False)
        async with self._locks.setdefault(stripe, trio.Lock()):
            if stripe not in self._fds:
                got = None
                for sid in replicas:
                    got = await self.servers.open_fd(sid, ino, stripe, cap)
                    if got is not None:
                        break
                fd, cfd = got if got is not None else (None, None)
                with self._closing:  # a close in another thread sees it, or we see it
                    kept = not self.closed
                    if kept:
                        self._fds[stripe] = fd
                        if fd is not None and cfd is not None:
                            self._crcs[fd] = (cfd, (ino, stripe))
                if not kept:  # closed while the descriptor was on its way
                    for f in (fd, cfd):
                        if f is not None:
                            os.close(f)
                    self._check_open()
                if fd is not None:
                    self.servers.handles.add(self)
        return self._fds.get(stripe)

    async def read(self, fd: int, obj_off: int, dests: list[memoryview]) -> list[int]:
        """Read consecutive object bytes into ``dests`` with the engine; returns the
        bytes there were for each destination (the planner zero-fills the rest)."""
        from pfs.core.engine import Op

        checked = self._crcs.get(fd)
        if checked is not None:  # whole blocks with the engine, verified in place after
            self._enter()
            try:
                vr = VerifiedRead(checked[1], fd, checked[0], obj_off, dests)
                if vr.direct:  # in steps, each verified on a thread beside the next read
                    await read_local(self.servers.engine, fd, vr)
                counts = vr.finish()
            except ChecksumError:
                metrics.checksum_failure("local")
                raise
            finally:
                self._leave()
            self._count(sum(counts))
            return counts
        ops, off = [], obj_off
        for d in dests:
            ops.append(Op(fd, off, len(d), d))
            off += len(d)
        self._enter()
        try:
            counts = await self.servers.engine.submit(ops)
        finally:
            self._leave()
        self._count(sum(counts))
        return list(counts)

    def _prefetch(self, c: LocalChunk) -> None:
        """Start the kernel reading a chunk ahead of the readers, unless its last page
        is cached already (a warm object: nothing to do). Both without waiting, with
        ``RWF_NOWAIT`` reads: a 1-byte probe of the last page returns it only if
        cached; a read of the chunk into scratch starts the file's own readahead and
        returns at once (EAGAIN). Readahead fills the cache with large folios, where
        ``POSIX_FADV_WILLNEED`` of 4 MiB pieces left 4 KiB pages behind, and later
        warm reads of those cost 2-3x the CPU (the kernel walks every page); WILLNEED
        is the fallback where RWF_NOWAIT is refused."""
        fd = self._fds.get(c.stripe)
        if fd is None or not c.length:
            return
        global _nowait_ok, _scratch
        if _nowait_ok:
            try:
                if os.preadv(fd, [_PROBE], c.obj_off + c.length - 1, os.RWF_NOWAIT) == 1:
                    return
            except BlockingIOError:  # not cached
                pass
            except OSError as exc:  # no RWF_NOWAIT here (kernel, filesystem)
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                _nowait_ok = False
        if _nowait_ok:
            if _scratch is None:  # bytes nobody reads: shared by every prefetcher
                _scratch = memoryview(bytearray(SCRATCH))
            try:
                os.preadv(fd, [_scratch[:min(c.length, SCRATCH)]], c.obj_off, os.RWF_NOWAIT)
            except BlockingIOError:  # the usual answer: the readahead is under way
                pass
            return
        os.posix_fadvise(fd, c.obj_off, c.length, os.POSIX_FADV_WILLNEED)

    def _advise_sequential(self, chunks: Sequence[LocalChunk]) -> None:
        """Tell the kernel that the objects of ``chunks`` are read front to back
        (``POSIX_FADV_SEQUENTIAL``): their readahead windows double (twice the drive's
        ``read_ahead_kb``), so a cold object comes in fewer, larger requests with more
        of it in flight, for a mapping's faults as for reads (a cold 1.4 GB load: a
        third fewer requests, 1.3-2x the GB/s and less CPU on a busy 2-core host). Each
        descriptor is this handle's own open file (the server opens one per request):
        nobody else's reads change. A hint: where it fails, the reads go on without."""
        for stripe in {c.stripe for c in chunks}:
            fd = self._fds.get(stripe)
            if fd is None:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError as exc:
                log.debug("SEQUENTIAL advice for stripe %d failed: %s", stripe, exc)

    def _prefetcher(self, chunks: Sequence[LocalChunk], progress: _Progress) -> None:
        """Keep the kernel reading :data:`BULK_WINDOW` bytes of ``chunks`` ahead of the
        readers (``progress.taken``: the chunks they took), until they are done."""
        ends = [0, *itertools.accumulate(c.length for c in chunks)]  # chunk j: [j, j+1)
        for j, c in enumerate(chunks):
            with progress.cond:
                while not progress.stop and ends[j + 1] - ends[progress.taken] > BULK_WINDOW:
                    progress.cond.wait()
                if progress.stop:
                    return
                if progress.taken > j:  # a reader has it already
                    continue
            try:
                self._prefetch(c)
            except OSError as exc:  # a hint only: the read itself reports real errors
                log.debug("WILLNEED of stripe %d at %d failed: %s", c.stripe, c.obj_off, exc)
                return

    def _read_chunk(self, c: LocalChunk) -> list[int] | None:
        """One chunk in the calling thread (:meth:`read_blocking`'s read: one preadv,
        verified in place right after), holes zeroed; None when this handle has no
        local descriptor of its stripe or a block did not verify (the network path
        decides, as :func:`pfs.client.plan.read_run` does)."""
        fd = self._fds.get(c.stripe)
        if fd is None:
            return None
        try:
            counts = self.read_blocking(fd, c.obj_off, c.dests)
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise
            log.info("short-circuit read of stripe %d at %d failed (%s): over the network",
                     c.stripe, c.obj_off, exc)
            return None
        zero_unread(c.dests, counts)
        return counts

    def _map_chunk(self, c: LocalChunk) -> list[int] | None:
        """:meth:`_read_chunk` with the whole blocks mapped from the object instead of
        read (:func:`pfs.client.mapping.map_verified`; ``c.dests`` lie in a private
        anonymous mapping of the caller's); an unchecked object is read."""
        return self._in_place(c, "mapping", lambda fd, cfd, obj: map_verified(
            obj, fd, cfd, c.obj_off, c.dests))

    def _fill_chunk(self, c: LocalChunk) -> list[int] | None:
        """:meth:`_read_chunk` into fresh registered memory (:mod:`pfs.client.uffd`):
        the whole blocks copied from the object's page cache into the missing pages
        and verified in place (:func:`pfs.client.filled.fill_verified`); an unchecked
        object is read, and so is a chunk not in the page cache (the read path is the
        one that reads a drive well). Whatever the chunk leaves to the network path
        (None) has its pages made present first: the network path writes them from
        the kernel."""
        fd = self._fds.get(c.stripe)
        if fd is not None and not _cached(fd, c.obj_off, c.length):
            settle_views(c.dests)  # cold: read the read path's way (the drive's queue)
            return self._read_chunk(c)
        return self._in_place(c, "copy", lambda fd, cfd, obj: fill_verified(
            obj, fd, cfd, c.obj_off, c.dests, self._source(fd)), "filled_bytes")

    def _in_place(self, c: LocalChunk, what: str, how: Any, key: str = "mapped_bytes"
                  ) -> list[int] | None:
        """A chunk of a checked object by ``how(fd, sidecar fd, object id)`` (its
        counts and the bytes mapped or filled, counted under ``key``), else read;
        None (EIO): over the network. Filled chunks have their pages made present
        before anything reads them otherwise."""
        settle = key == "filled_bytes"
        fd = self._fds.get(c.stripe)
        checked = self._crcs.get(fd) if fd is not None else None
        if fd is None or checked is None:
            if settle:
                settle_views(c.dests)
            return self._read_chunk(c)
        try:
            counts, mapped = how(fd, checked[0], checked[1])
        except OSError as exc:
            if settle:
                settle_views(c.dests)
            if exc.errno != errno.EIO:
                raise
            metrics.checksum_failure("local")
            log.info("short-circuit %s of stripe %d at %d failed (%s): over the network",
                     what, c.stripe, c.obj_off, exc)
            return None
        self._count(sum(counts), mapped, key)
        zero_unread(c.dests, counts)
        return counts

    def _source(self, fd: int) -> uffd.Source | None:
        """The object of ``fd`` mapped read-only (once per handle), or None where the
        kernel refuses."""
        with self._closing:
            if fd in self._sources:
                return self._sources[fd]
            try:
                src: uffd.Source | None = uffd.Source(fd, os.fstat(fd).st_size)
            except OSError as exc:
                log.debug("no mapping of a local object: %s", exc)
                src = None
            self._sources[fd] = src
            return src

    async def read_chunks(self, chunks: Sequence[LocalChunk], threads: int = BULK_THREADS,
                          done: Any = None, limiter: trio.CapacityLimiter | None = None,
                          mapped: bool = False, fill: bool = False
                          ) -> list[list[int] | None]:
        """Read many chunks (:func:`pfs.client.plan.local_chunks`) on ``threads`` worker
        threads, each taking the next chunk when it is done with one: no event-loop
        hop, no task per chunk, the GIL dropped in preadv and CRC32C, so reads and
        verification of different chunks run on every core. Per chunk: the bytes there
        were for each destination (holes zeroed), or None: read it the general way.
        ``done(chunk)`` is called (from a worker thread) with each chunk read.
        ``limiter``: shared with other such reads (of other files), so that all of
        them together run at most its number of threads. ``mapped``: the chunks'
        destinations lie in private anonymous mappings of the caller's, and the whole
        blocks of the objects are mapped there instead of read (:meth:`_map_chunk`).
        ``fill``: the destinations lie in fresh memory registered with
        :mod:`pfs.client.uffd`, filled by :meth:`_fill_chunk`."""
        out: list[list[int] | None] = [None] * len(chunks)
        one = self._map_chunk if mapped else self._fill_chunk if fill else self._read_chunk
        if not chunks:
            return out
        progress = _Progress()
        self._advise_sequential(chunks)

        def work() -> None:
            while True:
                with progress.cond:
                    i = progress.taken if progress.taken < len(chunks) else None
                    if i is not None:
                        progress.taken += 1
                        progress.cond.notify_all()
                if i is None:
                    return
                out[i] = got = one(chunks[i])
                if got is not None and done is not None:
                    done(chunks[i])

        self._enter()
        try:
            async with trio.open_nursery() as n:
                n.start_soon(partial(trio.to_thread.run_sync, self._prefetcher, chunks,
                                     progress))
                try:
                    async with trio.open_nursery() as readers:
                        for _ in range(max(1, min(threads, len(chunks)))):
                            readers.start_soon(partial(trio.to_thread.run_sync, work,
                                                       limiter=limiter))
                finally:  # the readers are done (or failed): so is the prefetcher
                    with progress.cond:
                        progress.stop = True
                        progress.cond.notify_all()
        finally:
            self._leave()
        return out

    async def read_device(self, fd: int, fn: Any, obj: tuple[int, int], *args: Any) -> int:
        """``fn(obj, fd, sidecar fd or None, *args)`` on a worker thread, the handle's
        descriptors held open meanwhile: a read of a local object into device memory
        (:func:`pfs.client.device.read_object`)."""
        self._enter()
        try:
            checked = self._crcs.get(fd)
            cfd = checked[0] if checked is not None else None
            n: int = await trio.to_thread.run_sync(fn, obj, fd, cfd, *args)
        finally:
            self._leave()
        self._count(n)
        return n

    def close(self) -> None:
        with self._closing:
            self.closed = True
            idle = not self._busy
        self.servers.handles.discard(self)
        if idle:
            self._close_fds()

    def _close_fds(self) -> None:
        with self._closing:
            fds, self._fds = self._fds, {}  # taken once: two closers cannot both close
            crcs, self._crcs = self._crcs, {}
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
        for cfd, _obj in crcs.values():
            os.close(cfd)
        with self._closing:
            sources, self._sources = self._sources, {}
        for src in sources.values():
            if src is not None:
                src.close()
