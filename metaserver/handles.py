"""Open files: the handles of each connection and the open count of each inode.

A handle (``fh``) belongs to the connection that opened it; its number means nothing on
another connection. When a connection ends, its handles are released. Each inode counts
its open handles, which decides what dropping its last link does: an open inode is kept
as an orphan (key ``O``) until its last handle is released, then reclaimed (deleted)
through the commit queue; orphans left by a crash are reclaimed at start (the service's
start-up). An inode whose deletion is in the batch being committed is *dying*: an open
racing with that deletion fails with ``ENOENT`` instead of counting a deleted inode.

**Files no data server saw.** A file created here and never written has no objects, so
its deletion needs no data server (the deleter's round, a delete per server, the queue
entry: half the servers' work of a ``touch`` + ``rm``). Only a write capability lets
bytes reach a data server, and a new file's only one is its create's handle's (none
after ``mknod`` or ``create_many``) until another open for writing. So a regular file
is *unwritten* from the commit that makes it (:meth:`OpenFiles.made`) until any of: an
open for writing other than the create's own, a truncation the metaserver sends to the
data servers, or the release of the create's handle without the client's word that it
sent nothing (``unwritten``: a close or ``closes`` of a handle that never wrote or
synced; a lost connection or an older client gives no such word). The set lives in
memory only (a restart or a restored backup knows none: every file counts as written)
and is bounded (the oldest are forgotten, i.e. counted as written).

:meth:`OpenFiles.opened`, :meth:`OpenFiles.is_open`, :meth:`OpenFiles.made` and
:meth:`OpenFiles.unwritten` are the namespace's hooks, called during a commit, hence
the lock.
"""
from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pfs.core import caps
from pfs.core.messages.meta import MAX_CLOSES
from pfs.core.wire.rpc import ConnContext
from pfs.metaserver import keys as K
from pfs.metaserver.commit import CommitQueue
from pfs.metaserver.store import Store, WriteTxn

_RIGHTS = {os.O_RDONLY: caps.READ, os.O_WRONLY: caps.WRITE}
MAX_UNWRITTEN = 1 << 18  # unwritten inodes remembered (~100 bytes each)


def rights_of(flags: int) -> int:
    """The capability rights an open with ``flags`` gives."""
    return _RIGHTS.get(flags & os.O_ACCMODE, caps.READ | caps.WRITE)


@dataclass(slots=True)  # not frozen: a frozen dataclass costs ~1 us more per open
class Handle:
    ino: int
    rights: int  # caps.READ / caps.WRITE, from the open flags
    root: bool  # opened by root: its size commits keep setuid/setgid (Namespace.commit_size)
    # the create's handle of an unwritten inode, with write rights: its release keeps
    # the inode unwritten only with the client's word that it sent nothing
    fresh: bool = False


class HandleTable:
    """One connection's open handles."""

    __slots__ = ("_handles", "_next")

    def __init__(self) -> None:
        self._handles: dict[int, Handle] = {}
        self._next = 1

    def add(self, handle: Handle) -> int:
        fh = self._next
        self._next += 1
        self._handles[fh] = handle
        return fh

    def get(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise OSError(errno.EBADF, f"no open file handle {fh}")
        return h

    def pop(self, fh: int) -> Handle:
        h = self._handles.pop(fh, None)
        if h is None:
            raise OSError(errno.EBADF, f"no open file handle {fh}")
        return h

    def discard(self, fh: int) -> Handle | None:
        return self._handles.pop(fh, None)

    def drain(self) -> list[Handle]:
        out = list(self._handles.values())
        self._handles.clear()
        return out


class OpenFiles:
    def __init__(self, store: Store, commit: CommitQueue,
                 reclaim: Callable[[WriteTxn, int], object]) -> None:
        """``reclaim(txn, ino)`` deletes orphan ``ino`` (if it still is one and is no
        longer open); it runs in the commit queue."""
        self._store = store
        self._commit = commit
        self._reclaim = reclaim
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}  # ino -> open handles, all connections
        self._dying: set[int] = set()  # deleted in the batch being committed
        # inodes whose last link went while open (perhaps in a batch that then failed:
        # a hint, checked against the store when their last handle closes)
        self._orphan_hint: set[int] = set()
        # inodes no data server can hold objects of (the module doc), oldest first
        self._unwritten: OrderedDict[int, None] = OrderedDict()

    # ------------------------------------------------------------------ per connection
    @staticmethod
    def _table(ctx: ConnContext) -> HandleTable:
        table = ctx.state.get("handles")
        if table is None:
            table = ctx.state["handles"] = HandleTable()
        assert isinstance(table, HandleTable)
        return table

    def new_handle(self, ctx: ConnContext, ino: int, flags: int, root: bool,
                   created: bool = False) -> int:
        """A handle on ``ctx``'s connection for ``ino`` (already counted by :meth:`ref`);
        ``created``: the handle of the create that made the file (:meth:`ref`)."""
        rights = rights_of(flags)
        fresh = False
        if rights & caps.WRITE:
            with self._lock:
                if created:
                    fresh = ino in self._unwritten
                else:  # a second write capability: bytes may reach the data servers
                    self._unwritten.pop(ino, None)
        return self._table(ctx).add(Handle(ino, rights, root, fresh))

    def handle(self, ctx: ConnContext, fh: int) -> Handle:
        """Handle ``fh`` of ``ctx``'s connection (``EBADF`` if it has none)."""
        return self._table(ctx).get(fh)

    def close_handle(self, ctx: ConnContext, fh: int) -> Handle:
        """Take ``fh`` off its connection; its inode stays counted until
        :meth:`release`."""
        return self._table(ctx).pop(fh)

    def release_closed(self, ctx: ConnContext, fhs: list[Any],
                       unwritten: list[int] | None = None) -> None:
        """Handles the client closed with nothing to commit, sent along with its next
        request (docs/rpc.md, ``closes``) and released before it: a close without a
        round trip of its own. Unknown handles are skipped (already released).
        ``unwritten``: those of them that sent nothing to a data server."""
        if len(fhs) > MAX_CLOSES:
            raise OSError(errno.EINVAL, f"closes: {len(fhs)} handles, at most {MAX_CLOSES}")
        if not all(isinstance(fh, int) and not isinstance(fh, bool) for fh in fhs):
            raise OSError(errno.EINVAL, "closes: handles must be integers")
        table = self._table(ctx)
        for fh in fhs:
            h = table.discard(fh)
            if h is not None:
                self.closed(h, unwritten is not None and fh in unwritten)
                self.release_later(h.ino)

    def closed(self, h: Handle, unwritten: bool) -> None:
        """Handle ``h`` is closed (before its release): the client's word whether it
        sent anything to a data server decides whether its inode stays unwritten."""
        if h.fresh and not unwritten:
            self.written(h.ino)

    def connection_lost(self, ctx: ConnContext) -> None:
        table = ctx.state.pop("handles", None)
        if isinstance(table, HandleTable):
            for h in table.drain():
                self.closed(h, False)  # a client gone mid-write gives no word
                self.release_later(h.ino)

    # ------------------------------------------------------------------ per inode
    def ref(self, ino: int) -> None:
        """One more open handle of ``ino``; ``ENOENT`` if it is being deleted."""
        with self._lock:
            if ino in self._dying:
                raise OSError(errno.ENOENT, f"inode {ino} is being removed")
            self._open[ino] = self._open.get(ino, 0) + 1

    def made(self, ino: int) -> None:
        """Namespace hook (in the commit that makes regular file ``ino``, before any
        other client can see it): ``ino`` is unwritten (the module doc)."""
        with self._lock:
            self._unwritten[ino] = None
            if len(self._unwritten) > MAX_UNWRITTEN:  # forgotten: counted as written
                self._unwritten.popitem(last=False)

    def written(self, ino: int) -> None:
        """Bytes of ``ino`` may have reached a data server (or its objects were cut)."""
        with self._lock:
            self._unwritten.pop(ino, None)

    def unwritten(self, ino: int) -> bool:
        """Namespace hook (during a commit): whether no data server can hold objects of
        ``ino``, so deleting it queues no deletion; it is forgotten here then."""
        with self._lock:
            if ino not in self._unwritten:
                return False
            del self._unwritten[ino]
            return True

    async def release(self, ino: int) -> None:
        """One handle of ``ino`` fewer; the last one of an orphan reclaims it (and
        returns once that is committed)."""
        if self._unref(ino):
            await self._commit.mutate(lambda t: self._reclaim(t, ino))

    def release_later(self, ino: int) -> None:
        """:meth:`release` without waiting for the reclaim."""
        if self._unref(ino):
            self._commit.submit(lambda t: self._reclaim(t, ino))

    def release_then(self, ino: int, done: Callable[[BaseException | None], None]) -> None:
        """:meth:`release` for a caller answering from the group commit: ``done(error)``
        is called at once, or, for the last handle of an orphan, once its reclaim is
        durable (or failed)."""
        if self._unref(ino):
            self._commit.then(lambda t: self._reclaim(t, ino), lambda o: done(o.error))
        else:
            done(None)

    def _unref(self, ino: int) -> bool:
        """One handle fewer; True when that was the last one and ``ino`` is an orphan."""
        with self._lock:
            n = self._open.get(ino, 0) - 1
            if n > 0:
                self._open[ino] = n
                return False
            self._open.pop(ino, None)
            if ino not in self._orphan_hint:
                return False  # never made an orphan while open: no store read per close
            self._orphan_hint.discard(ino)
        if self._commit.closed:  # stopped: the store may be closed, nothing is reclaimed
            return False
        with self._store.read() as txn:
            return txn.get(K.orphan(ino)) is not None

    def opened(self, ino: int) -> bool:
        """Namespace hook (during a commit): keep ``ino`` as an orphan if open; else
        mark it dying so an ``open`` racing with its deletion fails."""
        with self._lock:
            if self._open.get(ino, 0) > 0:
                self._orphan_hint.add(ino)
                return True
            self._dying.add(ino)
            return False

    def is_open(self, ino: int) -> bool:
        """Namespace hook: whether ``ino`` has open handles; unlike :meth:`opened` it
        marks nothing."""
        with self._lock:
            return self._open.get(ino, 0) > 0

    def batch_committed(self) -> None:
        """The batch that deleted the dying inodes is over: they are gone (or, if it
        failed, back), so opens go by the store again."""
        with self._lock:
            self._dying.clear()
