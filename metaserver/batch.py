"""Batched metadata calls (``create_many``, ``stat_many``, ``unlink_many``): many paths in
one request, each path succeeding or failing alone.

The changes run inside one operation of the commit queue, so a whole batch shares one
commit (one fsync) and is acknowledged only once that commit is on disk; each path runs
in a nested transaction of its own, so a failing path undoes only its own records. The
result of each path is ``[0, attr]`` (``attr`` None for an unlink) or ``[errno,
message]``, the message naming the path.

Pure functions over :class:`~pfs.metaserver.namespace.Namespace` and a transaction: no
IO, no trio (the server runs them; the tests run them against both store engines).
"""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import Any

from pfs.metaserver.namespace import Cred, Namespace
from pfs.metaserver.store import Txn, WriteTxn

Result = list[Any]  # [0, attr-or-None] or [errno, message]


def _failed(path: bytes, exc: OSError) -> Result:
    code = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else errno.EIO
    return [code, f"{os.fsdecode(path)}: {exc.strerror or os.strerror(code)}"]


def _each(ns: Namespace, txn: WriteTxn, paths: list[bytes], fn: Callable[[WriteTxn, bytes], Any],
          full_aborts: bool = False) -> list[Result]:
    """``fn(sub, path)`` for each path in a nested transaction of its own.
    ``full_aborts``: a full store (ENOSPC) fails the whole batch instead of its path, so
    that the commit queue runs it again in the reserve kept for changes that free space
    (unlinks)."""
    out: list[Result] = []
    counters = ns.counters
    for path in paths:
        mark = counters.mark()
        try:
            with txn.nested() as sub:
                out.append([0, fn(sub, path)])
        except OSError as exc:
            counters.undo(mark)
            if full_aborts and exc.errno == errno.ENOSPC:
                raise
            out.append(_failed(path, exc))
    return out


def create_many(ns: Namespace, txn: WriteTxn, cred: Cred, paths: list[bytes], mode: int,
                exclusive: bool) -> list[Result]:
    """Create each path as an empty regular file, opened and closed at once (no handle
    is kept, no capability signed); without ``exclusive`` an existing file is left as
    it is and its attributes returned."""
    flags = os.O_CREAT | os.O_WRONLY | (os.O_EXCL if exclusive else 0)
    perm = stat.S_IFREG | (mode & 0o7777)

    def one(sub: WriteTxn, path: bytes) -> dict[str, Any]:
        parent, name = ns.entry_of(sub, cred, path)
        attr, _, _ = ns.create(sub, cred, parent, name, perm, flags)
        return attr

    return _each(ns, txn, paths, one)


def unlink_many(ns: Namespace, txn: WriteTxn, cred: Cred, paths: list[bytes]
                ) -> list[Result]:
    """Unlink each path (a file open elsewhere lives on as an orphan, as with unlink)."""
    def one(sub: WriteTxn, path: bytes) -> None:
        parent, name = ns.entry_of(sub, cred, path)
        ns.unlink(sub, cred, parent, name)

    return _each(ns, txn, paths, one, full_aborts=True)


def stat_many(ns: Namespace, txn: Txn, cred: Cred, paths: list[bytes], follow: bool
              ) -> list[Result]:
    """Each path's attributes, as ``resolve`` finds them (read-only: no nesting)."""
    out: list[Result] = []
    for path in paths:
        try:
            out.append([0, ns.resolve(txn, cred, path, follow, cache=True)["attr"]])
        except OSError as exc:
            out.append(_failed(path, exc))
    return out
