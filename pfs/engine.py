"""I/O engines: how bytes move between file descriptors and memory.

The data server does its disk I/O through an :class:`Engine`, and so will the native
client when it reads a local object's fd itself. One interface, several back ends:

- ``posix``: ``os.preadv``/``os.pwritev``; ops of at least :data:`INLINE_MAX` bytes run in
  worker threads (``trio.to_thread``) bounded by the engine's queue depth, smaller ones
  run inline (a page-cache hit costs less than a thread hop).
- ``uring`` (io_uring, liburing) and ``gds`` (GPUDirect Storage, kvikio) come later;
  the batch call :meth:`Engine.submit` and ``queue_depth`` are there for them.

Semantics every engine keeps:

- a read fills its buffer unless end of file comes first; the count says how much;
- a write writes all its bytes or raises;
- a batch returns one count per op, in order, after *every* op has finished (no buffer
  is still in flight when the call returns or raises); if any op failed, the first
  failure is raised.
"""
from __future__ import annotations

import errno
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

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
            out.append(exc)
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


ENGINES = ("posix", "uring", "gds")


def get_engine(name: str = "posix", **options: int) -> Engine:
    """The engine called ``name``; ``options`` go to its constructor (``queue_depth``)."""
    if name == "posix":
        return PosixEngine(**options)
    if name in ("uring", "io_uring"):
        raise OSError(errno.ENOTSUP, "the io_uring engine ('uring') is not implemented yet; "
                                     "it comes in a later change; use engine = \"posix\"")
    if name == "gds":
        raise OSError(errno.ENOTSUP, "the GPUDirect Storage engine ('gds') is not implemented "
                                     "yet; use engine = \"posix\"")
    raise OSError(errno.EINVAL, f"unknown I/O engine {name!r}; known: {', '.join(ENGINES)}")
