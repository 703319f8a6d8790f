"""I/O engines: how bytes move between file descriptors and memory.

The data server does its disk I/O through an :class:`Engine`, and so will the native
client when it reads a local object's fd itself. One interface, several back ends:

- ``posix``: ``os.preadv``/``os.pwritev``; ops of at least :data:`INLINE_MAX` bytes run in
  worker threads (``trio.to_thread``) bounded by the engine's queue depth, smaller ones
  run inline (a page-cache hit costs less than a thread hop).
- ``uring``: io_uring through liburing (:class:`UringEngine`): a batch is one
  submission of many SQEs, at most ``queue_depth`` in flight; completions arrive on an
  eventfd registered with the ring that the trio loop waits on, so the loop never blocks
  on a disk. Large ops are sent to the kernel's io-wq workers (``IOSQE_ASYNC``) so page
  copies run on kernel threads, outside the GIL. Registered files and buffers, and
  O_DIRECT with alignment checks, are options.
- ``gds`` (GPUDirect Storage through kvikio) reads into GPU memory: see :mod:`pfs.loader.gpu`;
  ``get_engine("gds")`` says what is missing where it cannot run.

Semantics every engine keeps:

- a read fills its buffer unless end of file comes first; the count says how much;
- a write writes all its bytes or raises;
- a batch returns one count per op, in order, after *every* op has finished (no buffer
  is still in flight when the call returns or raises); if any op failed, the first
  failure is raised.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import itertools
import logging
import mmap
import os
import sys
import tempfile
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import trio

log = logging.getLogger(__name__)

INLINE_MAX = 64 * 1024  # ops (and batches of small ops) below this run in the event loop
DEFAULT_QUEUE_DEPTH = 32

# what an op reads into or writes from (collections.abc.Buffer from Python 3.12)
Buffer = bytes | bytearray | memoryview


class Op(NamedTuple):
    """One I/O: ``length`` bytes at ``offset`` of ``fd``, into (read) or from (write)
    ``buf``. A plain ``(fd, offset, length, buf)`` tuple is a read."""

    fd: int
    offset: int
    length: int
    buf: Buffer
    write: bool = False


class Engine(ABC):
    """Asynchronous positional I/O on file descriptors (trio)."""

    name: str = "?"

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> None:
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, not {queue_depth}")
        self.queue_depth = queue_depth
        self.closed = False

    @abstractmethod
    async def submit(self, ops: Sequence[Op]) -> list[int]:
        """Run many ops at once (up to ``queue_depth`` in flight); counts in op order."""

    async def read_into(self, fd: int, offset: int, buf: memoryview) -> int:
        """Read up to ``len(buf)`` bytes at ``offset``; short only at end of file."""
        return (await self.submit([Op(fd, offset, len(buf), buf)]))[0]

    async def write(self, fd: int, offset: int, data: Buffer) -> int:
        """Write all of ``data`` at ``offset``; returns ``len(data)``."""
        view = memoryview(data)
        return (await self.submit([Op(fd, offset, view.nbytes, view, True)]))[0]

    async def readv(self, ops: Sequence[tuple[int, int, int, Buffer]]) -> list[int]:
        """Batch of reads ``(fd, offset, length, buf)``; counts in op order."""
        return await self.submit([Op(fd, off, n, buf) for fd, off, n, buf in ops])

    async def writev(self, ops: Sequence[tuple[int, int, int, Buffer]]) -> list[int]:
        """Batch of writes ``(fd, offset, length, buf)``; counts in op order."""
        return await self.submit([Op(fd, off, n, buf, True) for fd, off, n, buf in ops])

    @abstractmethod
    async def fsync(self, fd: int) -> None:
        """Make ``fd``'s data durable."""

    def close(self) -> None:
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise OSError(errno.EBADF, f"{self.name} engine is closed")


def _check(op: Op) -> memoryview:
    view = memoryview(op.buf).cast("B")
    if op.offset < 0 or op.length < 0:
        raise OSError(errno.EINVAL, f"negative offset or length in {op.offset}+{op.length}")
    if op.length > view.nbytes:
        raise OSError(errno.EINVAL,
                      f"op of {op.length} bytes on a buffer of {view.nbytes} bytes")
    if op.write is False and view.readonly:
        raise OSError(errno.EINVAL, "read into a read-only buffer")
    return view[:op.length]


def _direct_diag(exc: OSError, fd: int, offset: int, view: memoryview) -> OSError:
    """A clearer error for EINVAL on an O_DIRECT fd (the kernel says only 'Invalid
    argument'); any other error is returned unchanged."""
    if exc.errno != errno.EINVAL or not fd_is_direct(fd):
        return exc
    return direct_misalignment(offset, view) or exc


def _run_op(fd: int, offset: int, view: memoryview, write: bool) -> int:
    """Blocking: the whole op, looping over short transfers."""
    total = len(view)
    done = 0
    if write:
        while done < total:
            done += os.pwritev(fd, [view[done:]], offset + done)
        return done
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:  # end of file
            break
        done += n
    return done


def _run_many(items: list[tuple[int, int, memoryview, bool]]) -> list[int | OSError]:
    out: list[int | OSError] = []
    for fd, off, view, write in items:
        try:
            out.append(_run_op(fd, off, view, write))
        except OSError as exc:
            out.append(_direct_diag(exc, fd, off, view))
    return out


class PosixEngine(Engine):
    """``preadv``/``pwritev``; large ops in worker threads, at most ``queue_depth``."""

    name = "posix"

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 inline_max: int = INLINE_MAX) -> None:
        super().__init__(queue_depth)
        self.inline_max = inline_max
        self._limiter = trio.CapacityLimiter(queue_depth)

    async def submit(self, ops: Sequence[Op]) -> list[int]:
        self._check_open()
        items = [(op.fd, op.offset, _check(op), bool(op.write)) for op in ops]
        results: list[int | OSError] = [0] * len(items)
        small = [i for i, it in enumerate(items) if len(it[2]) < self.inline_max]
        large = [i for i, it in enumerate(items) if len(it[2]) >= self.inline_max]
        small_bytes = sum(len(items[i][2]) for i in small)

        async def in_thread(idx: list[int]) -> None:
            got = await trio.to_thread.run_sync(
                _run_many, [items[i] for i in idx], limiter=self._limiter)
            for i, r in zip(idx, got, strict=True):
                results[i] = r

        if small and small_bytes < self.inline_max and not large:
            # the common small case: no thread, no nursery
            await trio.lowlevel.checkpoint_if_cancelled()
            for i, r in zip(small, _run_many([items[i] for i in small]), strict=True):
                results[i] = r
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            async with trio.open_nursery() as nursery:
                if small:
                    nursery.start_soon(in_thread, small)
                for i in large:
                    nursery.start_soon(in_thread, [i])
        out: list[int] = []
        for r in results:
            if isinstance(r, OSError):
                raise r
            out.append(r)
        return out

    async def fsync(self, fd: int) -> None:
        self._check_open()
        await trio.to_thread.run_sync(os.fsync, fd, limiter=self._limiter)


# -- O_DIRECT -------------------------------------------------------------------
DIRECT_ALIGN = 4096  # buffer address, file offset and length of an O_DIRECT op


def buffer_address(buf: Buffer) -> int:
    """The address of the first byte of ``buf`` (any buffer, read-only too)."""
    import numpy as np  # a dependency of pfs; imported only where addresses are needed

    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def aligned_buffer(size: int, alignment: int = DIRECT_ALIGN) -> memoryview:
    """A zeroed writable buffer of ``size`` bytes at an address that is a multiple of
    ``alignment`` (an anonymous mapping: page aligned), for O_DIRECT."""
    if size < 0 or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"bad aligned_buffer({size}, {alignment})")
    extra = max(0, alignment - mmap.PAGESIZE)
    view = memoryview(mmap.mmap(-1, max(1, size + extra)))
    pad = (-buffer_address(view)) % alignment
    return view[pad:pad + size]


def fd_is_direct(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))
    except OSError:
        return False


def direct_misalignment(offset: int, buf: Buffer, alignment: int = DIRECT_ALIGN) -> OSError | None:
    """EINVAL naming what breaks O_DIRECT's alignment rules, or ``None`` if nothing does."""
    view = memoryview(buf)
    problems = []
    addr = buffer_address(view) if view.nbytes else 0
    if addr % alignment:
        problems.append(f"buffer address {addr:#x} is {addr % alignment} bytes past a "
                        f"multiple of {alignment}")
    if offset % alignment:
        problems.append(f"file offset {offset} is not a multiple of {alignment}")
    if view.nbytes % alignment:
        problems.append(f"length {view.nbytes} is not a multiple of {alignment}")
    if not problems:
        return None
    return OSError(errno.EINVAL, "O_DIRECT needs the buffer address, file offset and length "
                                 f"aligned to {alignment} bytes: " + "; ".join(problems)
                                 + " (pfs.core.engine.aligned_buffer() gives aligned buffers)")


# -- io_uring -------------------------------------------------------------------
IOSQE_FIXED_FILE = 1 << 0  # the fd is an index into the ring's registered files
IOSQE_ASYNC = 1 << 4  # go straight to an io-wq worker: no inline attempt in io_uring_enter
URING_CHUNK = 1 << 20  # ops are cut into SQEs of at most this many bytes
ASYNC_MIN = 64 * 1024  # ops at least this large are flagged IOSQE_ASYNC
_READ, _WRITE, _FSYNC = 0, 1, 2
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 8)


def import_liburing() -> Any:
    """``import liburing``, safe when several processes start at once.

    liburing 2024.5.3 loads its modules through ``dynamic_import``, which deletes and
    rewrites a cache file in the installed package on import; two processes importing
    together can race on it (one gets FileNotFoundError). An exclusive lock on a file
    in the temp directory serialises the first import of each process."""
    if "liburing" in sys.modules:
        return sys.modules["liburing"]
    lock_path = os.path.join(tempfile.gettempdir(), "pfs-liburing-import.lock")
    try:
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError:  # no writable temp directory: import unlocked, retry a lost race
        lock_fd = -1
    try:
        if lock_fd >= 0:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        for attempt in range(3):
            try:
                import liburing

                return liburing
            except FileNotFoundError:  # another, unlocked importer removed the cache
                sys.modules.pop("liburing", None)
                if attempt == 2:
                    raise
            except PermissionError as exc:
                # that rewrite needs write access to the install: a user who does not
                # own it (a loader under a root-owned virtualenv) cannot import liburing
                sys.modules.pop("liburing", None)
                raise ImportError(f"liburing rewrites {exc.filename} when imported, which "
                                  f"uid {os.getuid()} may not") from exc
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=1)
def uring_unavailable() -> str | None:
    """Why io_uring cannot be used here, or ``None`` when it can (probed once)."""
    try:
        liburing = import_liburing()
    except ImportError as exc:  # pragma: no cover - liburing is a dependency
        return f"liburing cannot be imported ({exc}); pip install liburing==2024.5.3"
    ring = liburing.io_uring()
    try:
        liburing.io_uring_queue_init(2, ring)
    except OSError as exc:
        return (f"the kernel refused io_uring_setup ({exc.strerror or exc}; "
                "see /proc/sys/kernel/io_uring_disabled)")
    liburing.io_uring_queue_exit(ring)
    return None


class _Batch:
    """One submit() call: its ops cut into requests, and their results."""

    __slots__ = ("queue", "remaining", "parts", "errors")

    def __init__(self, nops: int) -> None:
        self.queue: deque[_Req] = deque()
        self.remaining = 0  # requests not finished
        self.parts: list[list[int]] = [[] for _ in range(nops)]  # bytes done per part
        self.errors: dict[int, OSError] = {}


class _Req:
    __slots__ = ("batch", "index", "part", "kind", "fd", "offset", "view", "want")

    def __init__(self, batch: _Batch, index: int, part: int, kind: int, fd: int,
                 offset: int, view: memoryview | None) -> None:
        self.batch, self.index, self.part, self.kind = batch, index, part, kind
        self.fd, self.offset, self.view = fd, offset, view
        self.want = len(view) if view is not None else 0


class UringEngine(Engine):
    """io_uring through liburing, completions on an eventfd the trio loop waits on.

    - ``queue_depth``: SQEs in flight at once across all callers (the ring's size);
    - ``chunk``: ops longer than this are cut into several SQEs, which the kernel runs in
      parallel;
    - ``async_min``: ops at least this long carry ``IOSQE_ASYNC``: io-wq kernel threads do
      the copy, so ``io_uring_enter`` returns at once and the GIL is not held during it;
      smaller ops are tried inline first (a page-cache hit completes in the submit call);
    - ``direct``: :meth:`open` adds ``O_DIRECT`` and every op on an O_DIRECT fd is checked
      for alignment (``alignment`` bytes) before it is submitted;
    - :meth:`register_files` and :meth:`register_buffers` register fds and bytearrays with
      the ring; ops on them then use fixed files / ``READ_FIXED``/``WRITE_FIXED``.

    One engine serves one trio run (the thread that first submits); many tasks of that run
    may submit at once. Waiting for completions is shielded from cancellation: the kernel
    owns the buffers until their ops complete, and the engine's contract is that none is
    in flight when ``submit`` returns or raises.
    """

    name = "uring"

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH, *, chunk: int = URING_CHUNK,
                 async_min: int = ASYNC_MIN, direct: bool = False,
                 alignment: int = DIRECT_ALIGN) -> None:
        super().__init__(queue_depth)
        why = uring_unavailable()
        if why is not None:
            raise OSError(errno.ENOTSUP, f"io_uring engine unavailable: {why}; "
                                         "use engine = \"posix\"")
        liburing = import_liburing()
        if chunk < 4096 or chunk > 0x7FFFF000:
            raise ValueError(f"chunk must be in [4096, 2 GiB), not {chunk}")
        self._L = liburing
        self.chunk = chunk
        self.async_min = async_min
        self.direct = direct
        self.alignment = alignment
        self._ring = liburing.io_uring()
        liburing.io_uring_queue_init(max(2, queue_depth), self._ring)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            liburing.io_uring_register_eventfd(self._ring, self._efd)
        except OSError:
            os.close(self._efd)
            liburing.io_uring_queue_exit(self._ring)
            raise
        self._cqes = liburing.io_uring_cqe()
        self._ids = itertools.count(1)
        self._reqs: dict[int, _Req] = {}
        self._inflight = 0
        self._reaping = False
        self._lot = trio.lowlevel.ParkingLot()
        self._fixed_files: dict[int, int] = {}
        self._fixed_bufs: dict[int, tuple[int, int, int, bytearray]] = {}  # id -> idx, addr, n
        self._torn_down = False

    # -- registration ---------------------------------------------------------------
    def register_files(self, fds: Sequence[int]) -> None:
        """Register ``fds`` with the ring (replacing any registered before); ops on them
        then skip the kernel's per-op file lookup. Unregister before closing them."""
        self._check_open()
        self.unregister_files()
        if fds:
            self._L.io_uring_register_files(self._ring, list(fds))
            self._fixed_files = {fd: i for i, fd in enumerate(fds)}

    def unregister_files(self) -> None:
        if self._fixed_files:
            self._L.io_uring_unregister_files(self._ring)
            self._fixed_files = {}

    def register_buffers(self, bufs: Sequence[bytearray]) -> None:
        """Pin ``bufs`` (bytearrays, not to be resized) as the ring's fixed buffers: a read
        into (or write from) one of them, starting at its first byte, uses
        ``READ_FIXED``/``WRITE_FIXED`` and skips the per-op page pinning."""
        self._check_open()
        self.unregister_buffers()
        if not bufs:
            return
        if not all(isinstance(b, bytearray) and len(b) for b in bufs):
            raise TypeError("register_buffers takes non-empty bytearrays")
        self._L.io_uring_register_buffers(self._ring, self._L.iovec(list(bufs)), len(bufs))
        self._fixed_bufs = {id(b): (i, buffer_address(b), len(b), b) for i, b in enumerate(bufs)}

    def unregister_buffers(self) -> None:
        if self._fixed_bufs:
            self._L.io_uring_unregister_buffers(self._ring)
            self._fixed_bufs = {}

    def open(self, path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
        """``os.open`` plus ``O_DIRECT`` when the engine is ``direct``."""
        if self.direct:
            flags |= os.O_DIRECT
        return os.open(path, flags | os.O_CLOEXEC, mode)

    # -- the batch ------------------------------------------------------------------
    async def submit(self, ops: Sequence[Op]) -> list[int]:
        self._check_open()
        if len(ops) == 1 and not ops[0].write and 0 < ops[0].length < self.async_min:
            # the latency path: one small read that the page cache holds is done inline
            # with preadv2(RWF_NOWAIT), which never blocks on a disk (EAGAIN instead);
            # anything else - a miss, a short read, O_DIRECT - goes through the ring
            op = ops[0]
            view = _check(op)
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                n = os.preadv(op.fd, [view], op.offset, _RWF_NOWAIT) if op.fd >= 0 else -1
            except OSError:
                n = -1
            if n == op.length:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return [n]
        batch = _Batch(len(ops))
        direct_fds: dict[int, bool] = {}
        lengths: list[int] = []
        for i, op in enumerate(ops):
            view = _check(op)
            if op.fd < 0:
                raise OSError(errno.EBADF, f"bad file descriptor {op.fd}")
            lengths.append(view.nbytes)
            if self.direct:  # check before submitting; otherwise EINVAL is explained after
                d = direct_fds.get(op.fd)
                if d is None:
                    d = direct_fds[op.fd] = fd_is_direct(op.fd)
                if d:
                    err = direct_misalignment(op.offset, view, self.alignment)
                    if err is not None:
                        raise err
            kind = _WRITE if op.write else _READ
            n = view.nbytes
            starts = range(0, n, self.chunk) if n > self.chunk else ((0,) if n else ())
            parts = batch.parts[i]
            for p, start in enumerate(starts):
                parts.append(0)
                batch.queue.append(_Req(batch, i, p, kind, op.fd, op.offset + start,
                                        view[start:start + self.chunk]))
        batch.remaining = len(batch.queue)
        await trio.lowlevel.checkpoint_if_cancelled()
        if batch.remaining:  # page-cache hits often complete inside the submit call
            self._submit_some(batch)
            self._reap()
        if batch.remaining:
            with trio.CancelScope(shield=True):
                await self._run(batch)
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        if batch.errors:
            raise batch.errors[min(batch.errors)]
        out: list[int] = []
        for i, parts in enumerate(batch.parts):
            total = 0
            for p, got in enumerate(parts):
                total += got
                want = min(self.chunk, lengths[i] - p * self.chunk)
                if got < want:  # end of file: what follows does not count
                    break
            out.append(total)
        return out

    async def fsync(self, fd: int) -> None:
        self._check_open()
        batch = _Batch(1)
        batch.parts[0].append(0)
        batch.queue.append(_Req(batch, 0, 0, _FSYNC, fd, 0, None))
        batch.remaining = 1
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.CancelScope(shield=True):
            await self._run(batch)
        if batch.errors:
            raise batch.errors[0]

    async def _run(self, batch: _Batch) -> None:
        """Submit ``batch``'s requests as slots free up; reap until all have completed.
        One waiting task at a time sleeps on the eventfd (the reaper); the others park
        and are woken after each reap."""
        while True:
            self._submit_some(batch)
            self._reap()
            if not batch.remaining:
                return
            if self._reaping:
                await self._lot.park()
                continue
            self._reaping = True
            try:
                await trio.lowlevel.wait_readable(self._efd)
            finally:
                self._reaping = False
            try:
                os.eventfd_read(self._efd)
            except BlockingIOError:
                pass
            self._reap()
            self._lot.unpark_all()

    def _submit_some(self, batch: _Batch) -> None:
        L, ring, queue = self._L, self._ring, batch.queue
        n = 0
        while queue and self._inflight < self.queue_depth:
            sqe = L.io_uring_get_sqe(ring)
            if not sqe:
                break
            req = queue.popleft()
            fd, flags = req.fd, 0
            fixed = self._fixed_files.get(fd)
            if fixed is not None:
                fd, flags = fixed, IOSQE_FIXED_FILE
            view = req.view
            if req.kind == _FSYNC:
                L.io_uring_prep_fsync(sqe, fd, 0)
            else:
                assert view is not None
                nbytes = len(view)
                if nbytes >= self.async_min:
                    flags |= IOSQE_ASYNC
                reg = self._fixed_bufs.get(id(view.obj)) if self._fixed_bufs else None
                if reg is not None and buffer_address(view) == reg[1]:
                    if req.kind == _READ:
                        L.io_uring_prep_read_fixed(sqe, fd, reg[3], nbytes, req.offset, reg[0])
                    else:
                        L.io_uring_prep_write_fixed(sqe, fd, reg[3], nbytes, req.offset, reg[0])
                elif req.kind == _READ:
                    L.io_uring_prep_read(sqe, fd, view, nbytes, req.offset)
                else:
                    L.io_uring_prep_write(sqe, fd, view, nbytes, req.offset)
            if flags:
                L.io_uring_sqe_set_flags(sqe, flags)
            uid = next(self._ids)
            L.io_uring_sqe_set_data64(sqe, uid)
            self._reqs[uid] = req
            self._inflight += 1
            n += 1
        if n:
            L.io_uring_submit(ring)

    def _reap(self) -> None:
        # one CQE at a time: this liburing build's peek_batch_cqe writes its array of
        # pointers over a single field, so it must not be given a count above one
        L, ring, cqe = self._L, self._ring, self._cqes
        while L.io_uring_peek_cqe(ring, cqe) == 0:
            uid, res = cqe.user_data, cqe.res
            L.io_uring_cqe_seen(ring, cqe)
            self._complete(uid, res)
        if self.closed and not self._inflight:
            self._teardown()

    def _complete(self, uid: int, res: int) -> None:
        req = self._reqs.pop(uid)
        self._inflight -= 1
        batch = req.batch
        if res < 0:
            err = -res
            if err in (errno.EAGAIN, errno.EINTR):
                batch.queue.append(req)
                return
            what = ("read", "write", "fsync")[req.kind]
            exc = OSError(err, f"{os.strerror(err)}: io_uring {what} of {req.want} bytes at "
                               f"{req.offset} (fd {req.fd})")
            if req.view is not None:
                exc = _direct_diag(exc, req.fd, req.offset, req.view)
            batch.errors.setdefault(req.index, exc)
            batch.remaining -= 1
            return
        if req.kind == _FSYNC:
            batch.remaining -= 1
            return
        assert req.view is not None
        batch.parts[req.index][req.part] += res
        if res == 0 or res >= len(req.view):
            if res == 0 and req.kind == _WRITE:
                batch.errors.setdefault(req.index, OSError(
                    errno.EIO, f"io_uring write at {req.offset} (fd {req.fd}) wrote nothing"))
            batch.remaining -= 1
            return
        # short transfer: the rest goes again (a read that then gets 0 is at end of file)
        req.view = req.view[res:]
        req.offset += res
        batch.queue.append(req)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self._inflight:
            self._teardown()

    def _teardown(self) -> None:
        if self._torn_down:
            return
        self._torn_down = True
        try:
            self._L.io_uring_unregister_eventfd(self._ring)
        except OSError:
            pass
        self._L.io_uring_queue_exit(self._ring)
        os.close(self._efd)
        self._fixed_bufs = {}
        self._fixed_files = {}


ENGINES = ("posix", "uring", "gds")


def default_engine() -> str:
    """The engine ``auto`` means: ``uring`` where the kernel has io_uring, else ``posix``.

    Measured on the development machine (``pfs bench iops``/``sweep`` and data-server-shaped
    A/B runs, page cache, 2 cores, medians of 5-7 interleaved rounds): 1 MiB reads into
    fresh buffers 1.4-2.5 GB/s (uring) vs 0.9-1.8 (posix); 1 MiB writes 1.55 vs 1.07 GB/s
    from one task and a tie from 8 tasks on one file; large batched reads 8-9 vs 3-5 GB/s;
    4 KiB reads at queue depth 1: p50 10-15 us (RWF_NOWAIT inline path) vs 20-50 us."""
    return "uring" if uring_unavailable() is None else "posix"


# Engines that live outside this module (``gds``, in pfs.loader.gpu), by name: registered by their
# module, so this one never imports them.
_REGISTERED: dict[str, Callable[..., Engine]] = {}


def register_engine(name: str, factory: Callable[..., Engine]) -> None:
    """Make ``get_engine(name)`` return ``factory(**options)``."""
    _REGISTERED[name] = factory


def get_engine(name: str = "posix", **options: Any) -> Engine:
    """The engine called ``name``; ``options`` go to its constructor (``queue_depth``...).

    ``auto`` is :func:`default_engine`. ``uring`` raises ``OSError(ENOTSUP)`` saying why
    where the kernel (or the sandbox) has no io_uring. ``gds`` is not a host-memory engine:
    GPU destinations go through :mod:`pfs.loader.gpu`; here it raises a clear error when kvikio or
    CUDA is missing and otherwise returns that module's engine (registered when pfs.loader.gpu is
    imported)."""
    if name == "auto":
        name = default_engine()
    if name == "posix":
        return PosixEngine(**options)
    if name in ("uring", "io_uring"):
        return UringEngine(**options)
    factory = _REGISTERED.get(name)
    if factory is not None:
        return factory(**options)
    if name == "gds":
        raise OSError(errno.ENOTSUP, "the gds engine reads into GPU memory: it comes with "
                                     "pfs.loader.gpu (import it; needs pip install 'pfs[gpu]')")
    raise OSError(errno.EINVAL, f"unknown I/O engine {name!r}; known: auto, {', '.join(ENGINES)}")
