"""Store counters kept in memory during a group-commit batch.

Inode numbers are handed out from a range held in memory: taking a range reads the
stored ``next_ino`` and, at the end of the batch, stores the range's end there, in the
batch's own transaction. Every number handed out is below a stored ``next_ino`` once its
batch is durable, so a number is never given twice, even after a crash (the rest of a
range is skipped then). The ``inodes`` count (statfs) is changed in memory per operation
and stored once per batch. Outside a batch (start-up, tools, tests writing the store
directly) both go to the store at once, as counters always did.

A batch's operations run in nested transactions that may roll back: :meth:`mark` before
one and :meth:`undo` after its failure take back its count; a failed batch
(:meth:`end` with ``committed`` False) forgets a range it took that was not stored.
"""

from __future__ import annotations

from pfs.metaserver import keys as K
from pfs.metaserver.store import Txn

INO_RANGE = 1024  # inode numbers taken from the store at once


def read(txn: Txn, name: bytes) -> int:
    v = txn.get(K.counter(name))
    return 0 if v is None else K.read_u64(v)


def write(txn: Txn, name: bytes, value: int) -> None:
    txn.put(K.counter(name), K.u64(value))


class Counters:
    def __init__(self) -> None:
        self._batch = False  # inside a group-commit batch: deferred
        self._next = 0  # the range in memory: [_next, _end)
        self._end = 0
        self._stored_end = True  # _end is (or will be, at flush) the stored next_ino
        self._inodes = 0  # change of the inode count not yet stored

    def begin(self) -> None:
        self._batch = True

    def new_ino(self, txn: Txn) -> int:
        """A fresh inode number (the inode count grows by one)."""
        if not self._batch:
            ino = read(txn, b"next_ino")
            write(txn, b"next_ino", ino + 1)
            self.add_inodes(txn, 1)
            return ino
        ino = self._next
        if ino >= self._end:
            ino = read(txn, b"next_ino")
            if not self._stored_end:
                # a batch that used up a range it took: the store does not have that
                # range's end yet (flush writes it), so the next range starts there
                ino = max(ino, self._end)
            self._end = ino + INO_RANGE
            self._stored_end = False
        self._next = ino + 1
        self._inodes += 1
        return ino

    def add_inodes(self, txn: Txn, delta: int) -> None:
        if self._batch:
            self._inodes += delta
        else:
            write(txn, b"inodes", read(txn, b"inodes") + delta)

    def mark(self) -> int:
        return self._inodes

    def undo(self, mark: int) -> None:
        """The operation begun at ``mark`` rolled back: its count change goes too (its
        inode numbers are skipped)."""
        self._inodes = mark

    def flush(self, txn: Txn) -> None:
        """Store what the batch changed, in its transaction (before its commit)."""
        if not self._stored_end:
            write(txn, b"next_ino", self._end)
        if self._inodes:
            write(txn, b"inodes", read(txn, b"inodes") + self._inodes)

    def end(self, committed: bool) -> None:
        """The batch is over; ``committed`` False: nothing of it was stored, so a range
        it took is forgotten (the next one is read from the store again)."""
        self._batch = False
        self._inodes = 0
        if committed:
            self._stored_end = True
        elif not self._stored_end:
            self._next = self._end = 0
            self._stored_end = True
