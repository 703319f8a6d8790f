"""Deleting objects in the background. Unlinked files' objects (and an old layout's,
when an empty file gets a new one) are queued (key ``Q``) in the transaction that
drops them; the deleter sends the queued deletions to the data servers in rounds and
removes each entry once every server it names has done its part. A server that
refuses or is down keeps its entries queued; they are sent again ``DELETE_RETRY``
seconds later, and do not hold back the entries behind them."""
from __future__ import annotations

import logging
import threading
from typing import Protocol

import trio

from pfs.metaserver.commit import CommitQueue
from pfs.metaserver.namespace import Namespace
from pfs.metaserver.store import Store, WriteTxn

log = logging.getLogger(__name__)

DELETE_BATCH = 256  # queue entries per deletion round
DELETE_RETRY = 2.0  # seconds before retrying deletions that failed
DELETE_COALESCE = 0.25  # seconds queued deletions wait to be sent together
IDLE_CHECK = 30.0  # seconds between rounds when nothing wakes the deleter


class ObjectDeletion(Protocol):
    """What the deleter needs of the data plane (:class:`pfs.metaserver.dataplane.DataPlane`)."""

    async def delete_objects(self, objs: dict[str, list[list[int]]],
                             live: set[int]) -> dict[str, OSError]:
        """Delete ``{sid: [[ino, stripe], ...]}``; the servers that failed, with why.
        Objects of inodes not in ``live`` (unlinked) are tombstoned there."""
        ...


class Deleter:
    def __init__(self, store: Store, ns: Namespace, commit: CommitQueue,
                 objects: ObjectDeletion) -> None:
        self._store = store
        self._ns = ns
        self._commit = commit
        self._objects = objects
        self._wake = trio.Event()
        self._from = 0  # deletion queue sequence number the next round starts at
        # live inodes whose old layout's objects are being deleted (read by the
        # namespace during a commit, hence the lock)
        self._lock = threading.Lock()
        self._deleting: set[int] = set()

    def wake(self) -> None:
        """Something may have been queued: look soon."""
        self._wake.set()

    def deleting(self, ino: int) -> bool:
        """Namespace hook: whether objects of an old layout of ``ino`` are being deleted
        right now (its layout must not change meanwhile)."""
        with self._lock:
            return ino in self._deleting

    async def run(self) -> None:
        while True:
            with trio.move_on_after(IDLE_CHECK):
                await self._wake.wait()
            # let deletions pile up a moment: one round (a delete per data server and
            # one commit) then serves many unlinks instead of costing each its own
            await trio.sleep(DELETE_COALESCE)
            self._wake = trio.Event()
            try:
                failed = await self._round()
            except OSError as exc:  # its commit failed: the entries stay queued
                log.warning("deletion round failed, will retry: %s", exc)
                failed = True
            if failed:
                await trio.sleep(DELETE_RETRY)
                self._wake.set()  # retry then, not when some change next wakes us

    async def _round(self) -> bool:
        """Send one round of queued deletions; True if some must be retried."""
        with self._store.read() as txn:
            entries = self._ns.delq_entries(txn, DELETE_BATCH, self._from)
            if not entries and self._from:
                self._from = 0
                entries = self._ns.delq_entries(txn, DELETE_BATCH)
        if not entries:
            return False
        # the next round goes on after this one's entries, so a round's worth that one
        # server keeps refusing cannot hold back the ones behind them
        self._from = entries[-1][0] + 1 if len(entries) >= DELETE_BATCH else 0
        with self._store.read() as txn:
            objs, needs, live = self._ns.deletion_plan(txn, entries)
        # the entries may be committed but not yet flushed (commit.py, "One flush per
        # batch"): a crash could still undo the unlink, so no object goes before
        await self._commit.durable()
        # the plan spared the objects of these inodes' current layouts: until the
        # deletes are done, a new layout could take back one of those being deleted
        with self._lock:
            self._deleting |= live
        try:
            errors = await self._objects.delete_objects(objs, live)
        finally:
            with self._lock:
                self._deleting -= live
        for sid, exc in errors.items():
            log.debug("deletion on data server %s deferred: %s", sid, exc)
        done = [seq for seq, sids in needs.items() if not sids & errors.keys()]
        if done:
            def finish(txn: WriteTxn) -> None:
                for seq in done:
                    self._ns.delq_done(txn, seq)
            await self._commit.mutate(finish)
        if self._from and not errors:
            self._wake.set()  # more queued than one round takes
        return bool(errors)
