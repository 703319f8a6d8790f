"""The directories path walks found, kept: every path-based create, stat or unlink in a
directory walks the same head (``/a/b`` of ``/a/b/f1``, ``/a/b/f2``...) component by
component, a record read, a decoding and a permission check each.

An entry maps (head, credentials) to the directory the walk reached, with every search
permission on the way checked for those credentials. What a successful walk depends on
changes only when an entry on the way is removed or replaced (``unlink`` of a symbolic
link, ``rmdir``, ``rename``) or a mode or owner changes (``setattr``): the namespace
drops every entry at each of those (:meth:`WalkCache.invalidate`), in the transaction
that makes the change, before it commits. New entries (create, mkdir, link, symlink)
cannot change a walk that succeeded. Entries are made only by walks in read
transactions, which see committed state; a change rolled back afterwards has only
dropped entries, never made a wrong one.
"""

from __future__ import annotations

from typing import Any

WALKS_CACHED = 1 << 12  # (head, credentials) pairs kept; all dropped when full


class WalkCache:
    __slots__ = ("_dirs",)

    def __init__(self) -> None:
        self._dirs: dict[tuple[bytes, Any], int] = {}

    def get(self, head: bytes, cred: Any) -> int | None:
        return self._dirs.get((head, cred))

    def put(self, head: bytes, cred: Any, ino: int) -> None:
        dirs = self._dirs
        if len(dirs) >= WALKS_CACHED:
            dirs.clear()
        dirs[(head, cred)] = ino

    def invalidate(self) -> None:
        self._dirs.clear()
