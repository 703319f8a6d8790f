"""pyfuse3's request workers on a cheaper lock.

pyfuse3 serves the kernel with a few worker tasks; one at a time holds a lock and waits
for /dev/fuse to be readable (trio lets one task wait per descriptor), then hands the lock
to the next and serves the request it read. That lock is a ``trio.Lock``: each handoff
goes through a ``ParkingLot`` with cancellation breakers and each uncontended acquire
yields to the scheduler once more. :class:`HandoffLock` does only what this use needs
(FIFO ownership handoff, cancellable waits, no extra checkpoint: the holder's next step
is ``wait_readable``, itself a checkpoint), which measured ~30% less daemon CPU per request
answered without the metaserver (71 → 49 µs under load: docs/benchmarks.md, section 15).

pyfuse3 looks its trio functions up in the module global ``pyfuse3.trio`` so that another
event loop can be put in (``pyfuse3.asyncio.enable`` does the same); :func:`install` puts
in trio itself with this lock.
"""
from __future__ import annotations

import types
from collections import deque
from typing import Any

import trio


class HandoffLock:
    """An async mutex for pyfuse3's workers: ``async with`` only, held by one task; a
    release hands it to the longest waiting task, which is woken already owning it."""

    def __init__(self) -> None:
        self._held = False
        self._waiters: deque[trio.lowlevel.Task] = deque()

    async def __aenter__(self) -> None:
        if not self._held:
            self._held = True
            return
        task = trio.lowlevel.current_task()
        self._waiters.append(task)

        def abort(_: Any) -> trio.lowlevel.Abort:
            # cancelled before a release chose it: it never owned the lock
            self._waiters.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def __aexit__(self, *exc: object) -> None:
        if self._waiters:
            trio.lowlevel.reschedule(self._waiters.popleft())  # it owns the lock now
        else:
            self._held = False

    def locked(self) -> bool:
        return self._held


def trio_for_pyfuse3() -> types.ModuleType:
    """A stand-in for the ``trio`` module as pyfuse3 uses it, with :class:`HandoffLock`."""
    m = types.ModuleType("pfs.fuse.workers.trio")
    m.Lock = HandoffLock  # type: ignore[attr-defined]
    m.__getattr__ = lambda name: getattr(trio, name)  # type: ignore[method-assign]  # the rest: trio's
    return m


def install(pyfuse3: Any) -> None:
    """Have pyfuse3's workers use :class:`HandoffLock` (before ``pyfuse3.main``)."""
    pyfuse3.trio = trio_for_pyfuse3()
