"""Checked reads without long stalls of the event loop.

CRC32C (the ``crc32c`` package) releases the GIL for each 64 KiB block, so a block hashed
on a worker thread runs beside the trio thread, which meanwhile receives the next reply or
submits the next read. Verifying a whole large reply inline after its receive instead
stalls every other transfer of the client for as long as the hash takes (~100 µs per
MiB, cold): that was most of the checksum cost of large reads. A network reply is now
hashed piece by piece as it lands instead (each piece still in cache: a short stall per
receive, and less CPU than either); a short-circuit read still verifies on threads.

- :func:`streamed`: a large network reply's whole blocks checked as they land, while they
  are in cache (:class:`~pfs.core.checksums.StreamCheck`): one pass in the event loop's
  thread, ~30 µs per MiB, instead of a cold pass on worker threads after the receive
  (~0.08 CPU s per GiB more on the benchmark machine, thread hand-offs included);
- :func:`verify_read`: a network reply's whole blocks after the receive, in parts of
  :data:`PART` bytes on threads when the reply is large (small replies inline: a thread
  hop costs more) — replies :func:`streamed` could not check.
- :func:`read_local`: a short-circuit read of whole blocks in steps of :data:`STEP`
  bytes, each step verified on a thread while the engine reads the next.

Nothing is returned as success before its bytes are verified: a failure raises
``ChecksumError`` (EIO), and on the short-circuit route the bad bytes are zeroed first.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import trio

from pfs.client.data import run_all
from pfs.core.checksums import BLOCK, StreamCheck, VerifiedRead, slice_views, verify_reply

THREAD_MIN = 1 << 20  # smaller replies are verified inline
PART = 4 << 20  # bytes of one verification job on a worker thread
STEP = 4 << 20  # bytes of one short-circuit read step


def streamed(msg: Any, into: Any) -> StreamCheck | None:
    """A check of read request ``msg``'s reply as it is received into ``into`` (large
    reads only: a small reply is verified inline after, for less). Give
    :meth:`StreamCheck.on_reply` to the call; once it returned, :meth:`StreamCheck.finish`
    if the check ``started``, else :func:`verify_read`."""
    if into is None or msg.method != "read" or msg.len < THREAD_MIN:
        return None
    return StreamCheck(tuple(msg.obj), msg.off)


async def verify_read(msg: Any, n: int, into: Any, crcs: list[int]) -> None:
    """Verify the reply of read request ``msg`` (``n`` bytes received into ``into``)
    against ``crcs``: ChecksumError (EIO) on a mismatch."""
    obj = tuple(msg.obj)
    if n < THREAD_MIN:
        verify_reply(obj, msg.off, n, into, crcs)
        return
    verify_reply(obj, msg.off, n, into, crcs, range(0))  # the count of checksums
    per = PART // BLOCK
    jobs: list[Any] = [partial(trio.to_thread.run_sync, verify_reply, obj, msg.off, n, into, crcs,
                               range(i, min(i + per, len(crcs))))
                       for i in range(0, len(crcs), per)]
    await run_all(jobs)


async def read_local(engine: Any, fd: int, vr: VerifiedRead) -> None:
    """Read ``vr.direct`` (whole blocks of object ``fd``) with ``engine`` in steps,
    verifying each step on a worker thread while the next is read; sets ``vr.got``.
    The edge blocks and anything left are :meth:`VerifiedRead.finish`'s."""
    from pfs.core.engine import Op

    nblk = len(vr.mid)
    per = STEP // BLOCK
    vr.records()  # the block map in one read, before the steps use it
    pending: tuple[int, int] | None = None
    got = 0
    for lo in range(0, nblk, per):
        hi = min(lo + per, nblk)
        ops, off = [], vr.direct_off + lo * BLOCK
        for d in slice_views(vr.direct, lo * BLOCK, hi * BLOCK):
            ops.append(Op(fd, off, len(d), d))
            off += len(d)
        step = [0]

        async def read_step(ops: list[Any] = ops, step: list[int] = step) -> None:
            step[0] = sum(await engine.submit(ops))

        jobs: list[Any] = [read_step]
        if pending is not None:
            jobs.append(partial(trio.to_thread.run_sync, vr.verify_mid, *pending))
        await run_all(jobs)
        got += step[0]
        if step[0] < (hi - lo) * BLOCK:  # the object shrank: finish() says so
            pending = None
            break
        pending = (lo, hi)
    if pending is not None:
        if pending[1] - pending[0] >= THREAD_MIN // BLOCK:
            await trio.to_thread.run_sync(vr.verify_mid, *pending)
        else:
            vr.verify_mid(*pending)
    vr.got = got
