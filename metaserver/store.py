"""A narrow transaction interface over the metadata store, with two engines.

``store.read()`` and ``store.write()`` are context managers that yield a transaction
with ``get``, ``put``, ``delete`` and ``scan`` (prefix scan in key order). A write
transaction commits when its block ends normally and rolls back when it raises.
``txn.nested()`` opens a child transaction inside a write: if the child's block raises,
only the child's changes are undone. The metaserver's group commit runs many requests in
one write, each in its own child, and commits (one fsync) once for the whole batch.

**Full.** A full map (LMDB ``MapFullError``) or disk is ``ENOSPC``, never ``EIO``. Beyond
``map_size`` the store keeps a reserve (``RESERVE_FRACTION``, at least ``RESERVE_MIN``)
that only ``write(headroom=True)`` may use: the commit queue runs an operation that frees
space (unlink, rmdir, removexattr) again there when it failed full, so a full store can
be emptied.

Engines: :class:`LmdbStore` (durable: every commit is on disk when ``write()`` returns,
or, for group commit, when ``sync()`` does; see its doc) and :class:`MemoryStore` (a
sorted dict, for tests). The same metadata test suite runs against both.

**Format.** An LMDB store records its format (``pfs.core.versions.METADATA_FORMAT``) under
``C format`` when it is created. :class:`LmdbStore` refuses a format it does not know,
or an older one whose upgrade is more than an addition older servers ignore
(:class:`pfs.core.versions.FormatError`, naming ``pfs admin migrate --db``, which takes the
upgrade steps of ``_STEPS`` from the format found, in one transaction). A store without
the key was made before formats were recorded (format 0); it is stamped as format 1 on
open rather than refused: format 1 is format 0 plus that one key, which servers from
before ignore (no code scans the ``C`` prefix), so the stamp loses nothing, needs no
operator step in a rolling upgrade, and an older server still opens the store.
"""
from __future__ import annotations

import bisect
import errno
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import lmdb

from pfs.core.versions import METADATA_FORMAT, MIGRATE_DB, upgrade_steps
from pfs.metaserver import keys as K

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

    def write(self, headroom: bool = False) -> AbstractContextManager[WriteTxn]:
        """``headroom``: the write may use the reserve kept for operations that free
        space (unlink, rmdir), so a full store can still be emptied."""
        ...

    def sync(self) -> None:
        """Every commit so far on stable storage (see ``flush_on_commit``)."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------
# LMDB
# ---------------------------------------------------------------------------
# Space kept back beyond map_size for writes that free space (``write(headroom=True)``):
# an unlink writes too (the deletion queue, the parent's times), and must still run
# when ordinary writes have filled the map.
RESERVE_FRACTION = 1 / 64
RESERVE_MIN = 1 << 20


def _store_error(exc: lmdb.Error) -> OSError:
    """ENOSPC for a full map or a full disk (pfs.core.errors.FAILURES), EIO else."""
    if isinstance(exc, lmdb.MapFullError):
        return OSError(errno.ENOSPC, "metadata store is full (raise map_size, or unlink "
                                     "files to free space)")
    if any(os.strerror(code) in str(exc) for code in (errno.ENOSPC, errno.EDQUOT)):
        return OSError(errno.ENOSPC, f"metadata store: the disk is full ({exc})")
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

    def nested(self) -> _LmdbNested:
        return _LmdbNested(self)


class _LmdbNested:
    """``_LmdbTxn.nested()``: a child transaction, committed into its parent when the
    block ends normally, aborted when it raises. A class, not a generator context
    manager: the commit queue opens one per operation."""

    __slots__ = ("_parent", "_child")

    def __init__(self, parent: _LmdbTxn) -> None:
        self._parent = parent
        self._child: lmdb.Transaction | None = None

    def __enter__(self) -> _LmdbTxn:
        env = self._parent.env
        self._child = env.begin(write=True, parent=self._parent.txn)
        return _LmdbTxn(env, self._child)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        child, self._child = self._child, None
        assert child is not None
        if exc_type is not None:
            child.abort()
            return
        try:
            child.commit()
        except lmdb.Error as err:
            raise _store_error(err) from err


class _LmdbRead:
    """``LmdbStore.read()``: a read transaction, aborted at the end of the block. A class,
    not a generator context manager: every stat and lookup opens one (a few us less)."""

    __slots__ = ("_env", "_txn")

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env
        self._txn: lmdb.Transaction | None = None

    def __enter__(self) -> _LmdbTxn:
        self._txn = self._env.begin(write=False)
        return _LmdbTxn(self._env, self._txn)

    def __exit__(self, *exc: object) -> None:
        if self._txn is not None:
            self._txn.abort()
            self._txn = None


class LmdbStore:
    """LMDB in directory ``path``; commits are durable (fsync) before ``write`` returns,
    unless ``flush_on_commit`` is False: then a commit is durable once :meth:`sync`
    returns, or once the next commit's flush is done (what group commit uses: one flush
    per batch instead of two, see below).

    **One flush per commit.** The environment is opened with ``metasync=False``: a
    commit writes its pages, flushes the file (fdatasync), then writes its meta page
    (the page that makes it the current state) without a second flush. LMDB keeps the
    store consistent this way (a crash can only lose that meta page: the commit is
    undone, never half done); the commit becomes durable at the next flush of the file:
    :meth:`sync`, or the next commit's first flush, which covers the meta page written
    before it. With ``sync=True, metasync=True`` every commit cost two flushes."""

    threaded = True

    def __init__(self, path: str | os.PathLike[str], map_size: int = 1 << 30,
                 check_format: bool = True) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = os.fspath(path)
        self.map_size = map_size
        self.reserve = max(RESERVE_MIN, int(map_size * RESERVE_FRACTION))
        self.flush_on_commit = True
        self.flushes = 0  # commits that flushed the file (a commit that changed nothing does not)
        self.env = lmdb.open(self.path, map_size=map_size, subdir=True, sync=True,
                             metasync=False, max_dbs=0, readahead=False)
        if check_format:
            try:
                open_format(self, self.path)
            except BaseException:
                self.env.close()
                raise

    def read(self) -> _LmdbRead:
        return _LmdbRead(self.env)

    @contextmanager
    def write(self, headroom: bool = False) -> Iterator[_LmdbTxn]:
        # headroom: the map grows by the reserve for this write, then is set back (LMDB
        # keeps it at least as large as the pages in use); the writes run in one thread
        # and no transaction is open meanwhile, as set_mapsize requires
        if headroom:
            self.env.set_mapsize(self.map_size + self.reserve)
        try:
            txn = self.env.begin(write=True)
            try:
                yield _LmdbTxn(self.env, txn)
            except BaseException:
                txn.abort()
                raise
            tid = txn.id()
            try:
                txn.commit()
            except lmdb.Error as exc:
                raise _store_error(exc) from exc
            if self.env.info()["last_txnid"] == tid:  # it wrote: LMDB flushed the file
                self.flushes += 1
            if self.flush_on_commit:
                self.sync()
        finally:
            if headroom:
                self.env.set_mapsize(self.map_size)

    def sync(self) -> None:
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            raise _store_error(exc) from exc

    def close(self) -> None:
        self.env.close()


# ---------------------------------------------------------------------------
# format
# ---------------------------------------------------------------------------
def store_format(txn: Txn) -> int | None:
    """The store's recorded format: 0 for a store from before formats, None if empty."""
    v = txn.get(K.FORMAT)
    if v is not None:
        return K.read_u64(v)
    return None if next(iter(txn.scan(b"")), None) is None else 0


def _to_1(txn: WriteTxn) -> None:
    txn.put(K.FORMAT, K.u64(1))  # format 1 is format 0 plus this key


# step f brings a store from format f to f + 1, inside one write transaction
_STEPS: dict[int, Callable[[WriteTxn], None]] = {0: _to_1}
# steps a server takes when it opens a store (each only adds what older servers ignore);
# any other needs ``pfs admin migrate --db``, run by an operator on a stopped server
_AT_OPEN = frozenset({0})


def _upgrade(txn: WriteTxn, path: str, at_open: bool) -> int | None:
    """Bring the store in ``txn`` to METADATA_FORMAT; the format it was in (None: it
    was empty, and is now stamped). FormatError when this pfs cannot (see
    :func:`pfs.core.versions.upgrade_steps`)."""
    found = store_format(txn)
    if found is None:
        txn.put(K.FORMAT, K.u64(METADATA_FORMAT))
        return None
    for step in upgrade_steps("metadata store", path, found, METADATA_FORMAT, _STEPS,
                              _AT_OPEN if at_open else None, MIGRATE_DB):
        _STEPS[step](txn)
    return found


def open_format(store: Store, path: str) -> None:
    """At open: record the format of a new store, take the upgrade steps that are safe
    at open (format 0 -> 1, see the module doc), refuse anything else."""
    with store.read() as txn:
        if store_format(txn) == METADATA_FORMAT:
            return
    with store.write() as wtxn:
        found = _upgrade(wtxn, path, at_open=True)
    if found is not None:
        log.info("metadata store %s: format %d upgraded to %d", path, found, METADATA_FORMAT)


def migrate(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``pfs admin migrate --db``: upgrade the store in ``path`` in place to
    METADATA_FORMAT, in one transaction; (format before, format after). Idempotent."""
    p = os.fspath(path)
    if not os.path.exists(os.path.join(p, "data.mdb")):
        raise OSError(errno.ENOENT, f"no metadata store in {p}")
    store = LmdbStore(p, check_format=False)
    try:
        with store.write() as txn:
            found = _upgrade(txn, p, at_open=False)
    finally:
        store.close()
    return (METADATA_FORMAT if found is None else found), METADATA_FORMAT


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

    def sync(self) -> None:
        pass  # nothing to make durable

    @contextmanager
    def read(self) -> Iterator[_MemTxn]:
        yield _MemTxn(self, writable=False)

    @contextmanager
    def write(self, headroom: bool = False) -> Iterator[_MemTxn]:
        txn = _MemTxn(self, writable=True)
        try:
            yield txn
        except BaseException:
            txn.rollback()
            raise

    def close(self) -> None:
        pass
