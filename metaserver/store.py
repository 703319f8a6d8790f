"""A narrow transaction interface over the metadata store, with two engines.

``store.read()`` and ``store.write()`` are context managers that yield a transaction
with ``get``, ``put``, ``delete`` and ``scan`` (prefix scan in key order). A write
transaction commits when its block ends normally and rolls back when it raises.
``txn.nested()`` opens a child transaction inside a write: if the child's block raises,
only the child's changes are undone. The metaserver's group commit runs many requests in
one write, each in its own child, and commits (one fsync) once for the whole batch.

Engines: :class:`LmdbStore` (durable: ``sync=True``, every commit is on disk when
``write()`` returns) and :class:`MemoryStore` (a sorted dict, for tests). The same
metadata test suite runs against both.
"""
from __future__ import annotations

import bisect
import errno
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import lmdb

log = logging.getLogger(__name__)


class Txn(Protocol):
    def get(self, key: bytes) -> bytes | None: ...

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs whose key starts with ``prefix``, from ``start`` (a full key,
        inclusive) on, in key order. Do not write while iterating: take a list first."""
        ...

    def put(self, key: bytes, value: bytes) -> None: ...

    def delete(self, key: bytes) -> bool: ...


class WriteTxn(Txn, Protocol):
    def nested(self) -> AbstractContextManager[WriteTxn]: ...


class Store(Protocol):
    #: True when a write may run in a worker thread while reads go on in another
    threaded: bool

    def read(self) -> AbstractContextManager[Txn]: ...

    def write(self) -> AbstractContextManager[WriteTxn]: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------
# LMDB
# ---------------------------------------------------------------------------
def _store_error(exc: lmdb.Error) -> OSError:
    if isinstance(exc, lmdb.MapFullError):
        return OSError(errno.ENOSPC, "metadata store is full (raise map_size)")
    return OSError(errno.EIO, f"metadata store error: {exc}")


class _LmdbTxn:
    __slots__ = ("env", "txn")

    def __init__(self, env: lmdb.Environment, txn: lmdb.Transaction) -> None:
        self.env = env
        self.txn = txn

    def get(self, key: bytes) -> bytes | None:
        return self.txn.get(key)  # type: ignore[return-value]  # bytes: buffers=False

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        with self.txn.cursor() as cur:
            if not cur.set_range(start if start is not None and start > prefix else prefix):
                return
            for key, value in cur:
                if not bytes(key).startswith(prefix):
                    return
                yield bytes(key), bytes(value)

    def put(self, key: bytes, value: bytes) -> None:
        try:
            self.txn.put(key, value)
        except lmdb.Error as exc:
            raise _store_error(exc) from exc

    def delete(self, key: bytes) -> bool:
        try:
            return bool(self.txn.delete(key))
        except lmdb.Error as exc:
            raise _store_error(exc) from exc

    @contextmanager
    def nested(self) -> Iterator[_LmdbTxn]:
        child = self.env.begin(write=True, parent=self.txn)
        try:
            yield _LmdbTxn(self.env, child)
        except BaseException:
            child.abort()
            raise
        try:
            child.commit()
        except lmdb.Error as exc:
            raise _store_error(exc) from exc


class LmdbStore:
    """LMDB in directory ``path``; commits are durable (fsync) before ``write`` returns."""

    threaded = True

    def __init__(self, path: str | os.PathLike[str], map_size: int = 1 << 30) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = os.fspath(path)
        self.env = lmdb.open(self.path, map_size=map_size, subdir=True, sync=True,
                             metasync=True, max_dbs=0, readahead=False)

    @contextmanager
    def read(self) -> Iterator[_LmdbTxn]:
        txn = self.env.begin(write=False)
        try:
            yield _LmdbTxn(self.env, txn)
        finally:
            txn.abort()

    @contextmanager
    def write(self) -> Iterator[_LmdbTxn]:
        txn = self.env.begin(write=True)
        try:
            yield _LmdbTxn(self.env, txn)
        except BaseException:
            txn.abort()
            raise
        try:
            txn.commit()
        except lmdb.Error as exc:
            raise _store_error(exc) from exc

    def close(self) -> None:
        self.env.close()


# ---------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------
class _MemTxn:
    __slots__ = ("store", "undo", "writable")

    def __init__(self, store: MemoryStore, writable: bool) -> None:
        self.store = store
        self.writable = writable
        self.undo: list[tuple[bytes, bytes | None]] = []

    def get(self, key: bytes) -> bytes | None:
        return self.store._data.get(key)

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        keys, data = self.store._keys, self.store._data
        i = bisect.bisect_left(keys, start if start is not None and start > prefix else prefix)
        while i < len(keys):
            key = keys[i]
            if not key.startswith(prefix):
                return
            yield key, data[key]
            i = bisect.bisect_right(keys, key)  # robust to changes between yields

    def put(self, key: bytes, value: bytes) -> None:
        assert self.writable, "put in a read transaction"
        s = self.store
        old = s._data.get(key)
        if old is None:
            bisect.insort(s._keys, key)
        s._data[key] = bytes(value)
        self.undo.append((key, old))

    def delete(self, key: bytes) -> bool:
        assert self.writable, "delete in a read transaction"
        s = self.store
        old = s._data.pop(key, None)
        if old is None:
            return False
        del s._keys[bisect.bisect_left(s._keys, key)]
        self.undo.append((key, old))
        return True

    def rollback(self, mark: int = 0) -> None:
        s = self.store
        while len(self.undo) > mark:
            key, old = self.undo.pop()
            present = key in s._data
            if old is None:
                if present:
                    del s._data[key]
                    del s._keys[bisect.bisect_left(s._keys, key)]
            else:
                if not present:
                    bisect.insort(s._keys, key)
                s._data[key] = old

    @contextmanager
    def nested(self) -> Iterator[_MemTxn]:
        mark = len(self.undo)
        try:
            yield self
        except BaseException:
            self.rollback(mark)
            raise


class MemoryStore:
    """Sorted in-memory store. Writes apply in place with an undo log; there is no
    isolation between a write and concurrent reads, so writes run in the caller's
    thread (``threaded = False``)."""

    threaded = False

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._keys: list[bytes] = []

    @contextmanager
    def read(self) -> Iterator[_MemTxn]:
        yield _MemTxn(self, writable=False)

    @contextmanager
    def write(self) -> Iterator[_MemTxn]:
        txn = _MemTxn(self, writable=True)
        try:
            yield txn
        except BaseException:
            txn.rollback()
            raise

    def close(self) -> None:
        pass
