"""Group commit: every metadata mutation goes through one queue and one writer task.

A handler hands :meth:`CommitQueue.mutate` a function of a write transaction and waits.
The writer takes every queued operation (up to ``MAX_BATCH``), runs each in its own
nested transaction (a failing one rolls back alone and its error goes to its caller),
commits the batch once and wakes the callers only once the batch is on stable storage.
An acknowledged mutation is therefore on disk, and concurrent callers share one commit.
A caller with no task to wait (:meth:`CommitQueue.then`: the server answering a change
from the writer) gets a completion called at that same point instead.

**One flush per batch.** A commit flushes the store once (its pages) and writes its
meta page unflushed (``LmdbStore``, "One flush per commit"); that meta page reaches the
disk with the next flush. So while operations keep coming, a batch's callers are woken
after the *next* batch's commit, whose flush made theirs durable; when none is waiting,
the writer flushes (``Store.sync``) and wakes them. Before it does, it lets the event
loop run a few passes (``SETTLE_PASSES``): requests the server has already received
reach the queue a pass or two later (the reader's, then the handler's), and one of
them makes the flush of its own unnecessary (8 clients creating or unlinking, 2 loaded
cores: 0.05-0.1 lone flushes per batch instead of 0.5-0.75; metaserver CPU per create
-6%, median of 5 A/B pairs; creates/s +23%, unlinks/s +70%). Under load each batch
costs one flush instead of two; a lone operation costs two, as before. Between its
commit and its flush a batch is visible to reads (stat, lookup) but not acknowledged:
what reads may see, a crash may undo, as with a local filesystem's page cache; an
acknowledged change never is. Actions outside the store that must not outrun
durability (deleting objects on data servers) wait for :meth:`CommitQueue.durable`
first.
"""
from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from pfs.metaserver.counters import Counters
from pfs.metaserver.store import Store, WriteTxn

log = logging.getLogger(__name__)

MAX_BATCH = 256  # operations per group commit (bounds how long one commit holds the loop)
# scheduler passes the writer lets run before it flushes a batch alone (see ``run``)
SETTLE_PASSES = 3

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Op:
    fn: Callable[[WriteTxn], Any]
    # the task waiting for it (woken with ``trio.lowlevel.reschedule``, cheaper than an
    # Event per operation); None once woken, cancelled, or for a background operation
    task: trio.lowlevel.Task | None
    background: bool = False  # nobody waits: a failure is logged
    result: Any = None
    error: BaseException | None = None
    frees: bool = False  # it frees space: on ENOSPC, run again in the store's reserve
    # called with the operation once it is durable (or failed), instead of waking a
    # task: the caller answers from there (see ``then``)
    then: Callable[[Op], None] | None = None


def _is_full(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


class _Undo(Exception):
    """Rolls back a nested transaction that only checked what an operation would do."""


def dry_run(txn: WriteTxn, fn: Callable[[WriteTxn], object]) -> None:
    """Raise what ``fn`` would raise in ``txn``; change nothing."""
    try:
        with txn.nested() as sub:
            fn(sub)
            raise _Undo
    except _Undo:
        pass


class CommitQueue:
    def __init__(self, store: Store, after_batch: Callable[[], None] = lambda: None,
                 counters: Counters | None = None) -> None:
        """``after_batch`` runs after each batch is committed (or failed), before its
        callers wake. ``counters``: store counters kept in memory during a batch and
        stored at its end (counters.py)."""
        self._store = store
        self._counters = counters or Counters()
        self._after_batch = after_batch
        # the queue: handlers append, the writer takes; a plain deque and a parked
        # writer task (no channel, no Event per operation: the commit path is hot)
        self._queue: deque[Op] = deque()
        self._writer: trio.lowlevel.Task | None = None  # parked, waiting for work
        self._closed = False
        # batches committed (visible) and batches made durable, counted; ``durable``
        # waits on the second to reach the first
        self._committed = 0
        self._synced = 0
        self._synced_event = trio.Event()
        # the writer flushes the store itself (one flush per batch, see above)
        if hasattr(store, "flush_on_commit"):
            store.flush_on_commit = False

    @property
    def closed(self) -> bool:
        """The service stopped: background operations are dropped from now on."""
        return self._closed

    def close(self) -> None:
        self._closed = True

    async def mutate(self, fn: Callable[[WriteTxn], T], frees: bool = False) -> T:
        """Run ``fn`` in the next batch; its result once the batch is on disk.
        ``frees``: ``fn`` frees space (unlink, rmdir): when the store is full it runs
        again in the reserve kept for that (``Store.write(headroom=True)``). A caller
        cancelled while it waits leaves the operation queued: it still runs."""
        op = Op(fn, trio.lowlevel.current_task(), frees=frees)
        self._enqueue(op)

        def abort(_: Any) -> trio.lowlevel.Abort:
            op.task = None  # nobody to wake
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        if op.error is not None:
            raise op.error
        result: T = op.result
        return result

    def submit(self, fn: Callable[[WriteTxn], object]) -> None:
        """Queue ``fn`` without waiting for it (a failure is logged); nothing once
        closed."""
        if not self._closed:
            self._enqueue(Op(fn, None, background=True))

    def then(self, fn: Callable[[WriteTxn], Any], done: Callable[[Op], None],
             frees: bool = False) -> None:
        """Run ``fn`` in the next batch and call ``done(op)`` once that batch is on disk
        (``op.result``) or failed (``op.error``), in the writer, right after the flush:
        what :meth:`mutate` does without a task waiting (a reply sent from there skips
        waking the handler's task and switching to it). ``done`` must not block; what
        it raises is logged."""
        self._enqueue(Op(fn, None, frees=frees, then=done))

    def _enqueue(self, op: Op) -> None:
        self._queue.append(op)
        writer = self._writer
        if writer is not None:
            self._writer = None
            trio.lowlevel.reschedule(writer)

    async def _next(self) -> Op:
        """The first queued operation, waiting for one."""
        while not self._queue:
            self._writer = trio.lowlevel.current_task()

            def abort(_: Any) -> trio.lowlevel.Abort:
                self._writer = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        return self._queue.popleft()

    async def write_alone(self, fn: Callable[[WriteTxn], T]) -> T:
        """Run ``fn`` in a write transaction of its own, in a worker thread where the
        store allows (for start-up work, before :meth:`run` takes over)."""
        def write() -> T:
            with self._store.write() as txn:
                result = fn(txn)
            self._store.sync()
            return result
        if self._store.threaded:
            return await trio.to_thread.run_sync(write)
        return write()

    async def durable(self) -> None:
        """Return once every batch committed so far is on stable storage."""
        target = self._committed
        while self._synced < target:
            await self._synced_event.wait()

    async def run(self) -> None:
        """The writer: batches until cancelled."""
        unsynced: list[Op] = []  # the last batch: committed, not yet flushed
        try:
            while True:
                queue = self._queue
                if unsynced and not queue:
                    # Requests already received may be a few scheduler passes from the
                    # queue (the reader's, then the handler's); let them join, so that
                    # the next commit's flush covers this batch instead of a flush of
                    # its own. Bounded: tasks that keep running cannot hold it back.
                    for _ in range(SETTLE_PASSES):
                        await trio.lowlevel.checkpoint()
                        if queue:
                            break
                    else:  # nothing waiting: flush, wake its callers
                        self._flush(unsynced)
                        unsynced = []
                        continue
                batch = [queue.popleft() if queue else await self._next()]
                while queue and len(batch) < MAX_BATCH:
                    batch.append(queue.popleft())
                # The batch runs and commits in the event loop's own thread: handing it
                # to a worker thread costs more (~300 us here) than the loop loses by
                # waiting for the flush, and requests arriving meanwhile simply join the
                # next batch. (Also tried: a dedicated thread that begins and commits
                # the transaction, the operations running here in between, and flushes
                # while the loop goes on: ~30 us of CPU per hand-over, 8-25% more
                # metaserver CPU per create with 8 clients on 2 cores, and creates/s
                # within the noise; the cores, not the waits, are the limit here.)
                flushed = self._run_batch(batch)
                again = [op for op in batch if op.frees and _is_full(op.error)]
                if again:
                    for op in again:
                        op.error = None
                    flushed = self._run_batch(again, headroom=True) and flushed
                if unsynced:
                    # this commit's flush made the previous batch durable (a failed
                    # commit may not have flushed: then flush for it now)
                    self._flush(unsynced, flushed)
                self._committed += 1
                unsynced = batch
                await trio.lowlevel.checkpoint()
        finally:
            if unsynced:  # cancelled (the service stops): flushed before anyone is told
                self._flush(unsynced)

    def _flush(self, batch: list[Op], flushed: bool = False) -> None:
        """``batch`` (committed) is made durable (``flushed``: it already is); wake its
        callers. A failed flush fails the batch's operations: they may be lost."""
        if not flushed:
            try:
                self._store.sync()
            except OSError as exc:
                log.error("metadata flush of %d operation(s) failed: %s", len(batch), exc)
                for op in batch:
                    if op.error is None:
                        op.error = exc
        self._synced = self._committed
        self._synced_event.set()
        self._synced_event = trio.Event()
        self._wake(batch)

    def _wake(self, batch: list[Op]) -> None:
        self._after_batch()
        reschedule = trio.lowlevel.reschedule
        for op in batch:
            task = op.task
            if task is not None:
                op.task = None
                reschedule(task)
            elif op.then is not None:
                try:
                    op.then(op)
                except Exception:  # noqa: BLE001 - one caller's bug must not stop the writer
                    log.exception("metadata completion failed")
            elif op.background and op.error is not None:
                log.warning("background metadata update failed: %s", op.error)

    def _run_batch(self, batch: list[Op], headroom: bool = False) -> bool:
        """Run and commit ``batch``; whether the commit flushed the store (False when
        it failed: nothing of the batch is stored, and earlier commits may not be
        flushed)."""
        before = getattr(self._store, "flushes", None)  # None: a store with nothing to flush
        counters = self._counters
        committed = False
        counters.begin()
        try:
            with (self._store.write(headroom=True) if headroom else self._store.write()) as txn:
                for op in batch:
                    mark = counters.mark()
                    try:
                        with txn.nested() as sub:
                            op.result = op.fn(sub)
                    except Exception as exc:  # noqa: BLE001 - re-raised in the op's handler
                        op.error = exc
                        counters.undo(mark)
                counters.flush(txn)
            committed = True
        except OSError as exc:  # the commit itself failed: nothing of the batch is stored
            log.error("metadata commit of %d operation(s) failed: %s", len(batch), exc)
            for op in batch:
                if op.error is None:
                    op.error = exc
            return False
        finally:
            counters.end(committed)
        # a commit that changed nothing (every operation failed) flushes nothing
        return before is None or getattr(self._store, "flushes", None) != before
