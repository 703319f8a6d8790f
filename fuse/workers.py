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
in trio itself with :class:`ReaderLock`, a :class:`HandoffLock` handed on lazily: a worker
that read a request keeps the lock while it serves it without waiting (a FLUSH or
RELEASE of a clean handle, an attribute or a "missing" the daemon knows, a quick
metaserver call: ``MetaClient.run_now``) and goes straight back to waiting for
/dev/fuse; the next worker is woken only when the request is about to wait
(:func:`yield_reader`, called by the FUSE operations before they wait). That saves a
task switch and a scheduler pass per request answered at once. A worker that leaves
pyfuse3's loop while it holds the lock (at unmount; too many idle workers) hands it on as
its task ends (an instrument's ``task_exited``): else nobody would read /dev/fuse again,
and at unmount the other workers would wait for the lock forever (the daemon would not
exit).

The worker holding the lock then waits for /dev/fuse with ``trio.lowlevel.wait_readable``:
an epoll registration, a park and a scheduler pass per request, though in a serial loop
(one caller: create, stat, unlink ...) nothing else of the daemon has anything to do.
:class:`QuickWait` waits in its place, in a ``poll()`` of /dev/fuse and of trio's own epoll
set, when no other task is runnable and no deadline is due: trio would sleep in that very
epoll set until one of those happens, so the loop sleeps the same while the worker reads
on at once. Anything else that wakes (another task's descriptor, a thread's or a
signal's wake-up, a deadline) sends the worker the usual way, through trio.
"""

from __future__ import annotations

import math
import select
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
        self._release()

    def _release(self) -> None:
        if self._waiters:
            trio.lowlevel.reschedule(self._waiters.popleft())  # it owns the lock now
        else:
            self._held = False

    def locked(self) -> bool:
        return self._held


class ReaderLock(HandoffLock):
    """pyfuse3's read lock, handed on lazily (the module doc): leaving ``async with``
    normally keeps it held by the task that leaves, which takes it again at once at its
    next ``async with``; :meth:`yield_lazy` hands it on for real."""

    def __init__(self) -> None:
        super().__init__()
        self._lazy: trio.lowlevel.Task | None = None  # holding it after leaving
        global _reader
        _reader = self

    async def __aenter__(self) -> None:
        if self._lazy is not None and self._lazy is trio.lowlevel.current_task():
            self._lazy = None  # still its own
            return
        await super().__aenter__()

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is None:
            self._lazy = trio.lowlevel.current_task()
        else:  # pyfuse3 stops reading (unmount): hand it on now
            self._lazy = None
            self._release()

    def yield_lazy(self) -> None:
        """The task that read the request is about to wait: another must read /dev/fuse."""
        if self._lazy is not None:
            self._lazy = None
            self._release()


_reader: ReaderLock | None = None  # pyfuse3's (it makes one, at its first read)


class _ExitGuard(trio.abc.Instrument):
    """A worker that leaves pyfuse3's loop holding the lock (the filesystem was
    unmounted: the session ends; too many idle workers) hands it on as its task ends,
    so the others wake, see the session over (or read on) and end too."""

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        if _reader is not None and _reader._lazy is task:
            _reader.yield_lazy()


def yield_reader() -> None:
    """Called by a request handler before it waits (the network, a lock, a thread):
    the worker serving it hands pyfuse3's read lock to the next one."""
    if _reader is not None:
        _reader.yield_lazy()


# the longest a quick wait sleeps before going trio's way (which looks at everything again)
MAX_QUICK_WAIT_MS = 1000
# tasks looked at for one runnable (more: the usual wait; a mount at rest has a dozen)
MAX_TASKS_SCANNED = 64


class LoopState:
    """What :class:`QuickWait` looks at in trio's run loop, read from its runner (trio
    offers ``current_statistics``, at ~3x the cost of the poll itself, and blind to the
    tasks of the batch being run): whether another task is runnable, the next deadline,
    and the epoll set that is readable when a descriptor some task waits on is ready or
    a thread or signal wakes the loop (``run_sync_soon`` writes the loop's wake-up
    socket, which is in it)."""

    __slots__ = ("runner", "fd")

    def __init__(self, runner: Any, fd: int) -> None:
        self.runner, self.fd = runner, fd

    @classmethod
    def current(cls) -> LoopState | None:
        """This trio run's (in ``trio.run``); None where trio's internals differ: then
        every wait goes trio's way."""
        try:
            from trio._core._run import GLOBAL_RUN_CONTEXT

            runner = GLOBAL_RUN_CONTEXT.runner
            fd = runner.io_manager._epoll.fileno()
            state = cls(runner, fd)
            state.busy(), float(state.left())
            _ = trio.lowlevel.current_task()._next_send_fn
        except (ImportError, AttributeError, TypeError, ValueError):
            return None
        return state if isinstance(fd, int) else None

    def busy(self) -> bool:
        """Whether another task is runnable: in the run queue, or later in the batch
        the scheduler is running now (taken off the queue, not yet stepped: its next
        send is set); with many tasks, taken to be so."""
        r = self.runner
        if r.runq or len(r.tasks) > MAX_TASKS_SCANNED:
            return True
        return any(t._next_send_fn is not None for t in r.tasks)

    def left(self) -> float:
        """Seconds to the next deadline (may be infinite, or past)."""
        r = self.runner
        return float(r.deadlines.next_deadline() - r.current_time())


class QuickWait:
    """``wait_readable`` for pyfuse3's /dev/fuse (the module doc): a ``poll()`` of the
    descriptor and of trio's epoll set when no other task is runnable and no deadline is
    due; trio's wait otherwise, or when anything but the descriptor woke the poll."""

    __slots__ = ("loop", "_polls")

    def __init__(self, loop: LoopState | None) -> None:
        self.loop = loop
        self._polls: dict[int, Any] = {}  # descriptor -> its select.poll with the loop's

    async def wait_readable(self, fd: int) -> None:
        if not self.ready(fd):
            await trio.lowlevel.wait_readable(fd)

    def ready(self, fd: int) -> bool:
        """Whether ``fd`` became readable while nothing else in the loop had to run."""
        loop = self.loop
        if loop is None or loop.busy():
            return False
        left = loop.left()
        if left <= 0:
            return False
        p = self._polls.get(fd)
        if p is None:
            p = self._polls[fd] = select.poll()
            p.register(fd, select.POLLIN)
            p.register(loop.fd, select.POLLIN)
        events = p.poll(math.ceil(min(MAX_QUICK_WAIT_MS, left * 1000)))
        return len(events) == 1 and events[0][0] == fd


def trio_for_pyfuse3(quick: QuickWait | None = None) -> types.ModuleType:
    """A stand-in for the ``trio`` module as pyfuse3 uses it, with :class:`ReaderLock`
    and, given ``quick``, its ``wait_readable`` for /dev/fuse."""
    m = types.ModuleType("pfs.fuse.workers.trio")
    m.Lock = ReaderLock  # type: ignore[attr-defined]
    if quick is not None:
        low = types.ModuleType("pfs.fuse.workers.trio.lowlevel")
        low.wait_readable = quick.wait_readable  # type: ignore[attr-defined]
        low.__getattr__ = lambda name: getattr(trio.lowlevel, name)  # type: ignore[method-assign]
        m.lowlevel = low  # type: ignore[attr-defined]
    m.__getattr__ = lambda name: getattr(trio, name)  # type: ignore[method-assign]  # the rest: trio's
    return m


def install(pyfuse3: Any) -> None:
    """Have pyfuse3's workers use :class:`ReaderLock` and :class:`QuickWait` (in trio,
    before ``pyfuse3.main``)."""
    pyfuse3.trio = trio_for_pyfuse3(QuickWait(LoopState.current()))
    trio.lowlevel.add_instrument(_ExitGuard())  # (called only as a task ends)
