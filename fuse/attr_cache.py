"""Attributes the mount got from the metaserver, to answer the kernel's GETATTR again
within ``attr_timeout`` of getting them.

The kernel caches an inode's attributes for ``attr_timeout`` from the reply that carried
them, but drops them earlier for reasons of its own that do not make them wrong here:
after every read (it takes the server to keep atime; pfs sets atime only at create and
by an explicit ``utimensat``), at an open whose file changed (the mount tells it to,
``keep_cache`` off: the open's reply holds the new attributes), after an entry change in
a directory (``default_permissions`` then asks before the next lookup in it: the change's
reply holds the directory's attributes). Each of those GETATTRs was a metaserver call;
answered from what a reply carried at most ``attr_timeout`` ago, a change made on another
node shows here within the same bound as the kernel's own cache gives.

What is kept comes only from replies (lookup, getattr, open, create, the entry changes,
readdirplus) and is dropped at once when this mount changes an inode in a way the reply
does not cover: setattr, an xattr change, a write or commit (flush, fsync, release of a
handle that wrote), and every unlink, rmdir and rename (a link count or a ctime moves on
an inode not named in the reply: everything is forgotten).
"""
from __future__ import annotations

import time

from pfs.client.types import StatResult

MAX_INODES = 65536  # then everything is forgotten at once


class AttrCache:
    """Inode -> (until when, attributes); ``ttl`` 0 keeps nothing.

    ``gen`` moves at every drop: a read that started before a change here (a lookup, a
    getattr, an open racing a setattr of the same inode) may carry what was there
    before it, so its reply is kept only if no drop came between (``since``), as the
    kernel's ``attr_version`` does."""

    __slots__ = ("ttl", "gen", "_attrs")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.gen = 0
        self._attrs: dict[int, tuple[float, StatResult]] = {}

    def put(self, ino: int, attr: StatResult, since: int | None = None) -> None:
        """``attr`` of ``ino`` came in a metaserver reply just now; ``since``: the
        ``gen`` when its request was sent (None: the reply of a change made here)."""
        if self.ttl <= 0 or (since is not None and since != self.gen):
            return
        if len(self._attrs) >= MAX_INODES:
            self._attrs.clear()
        self._attrs[ino] = (time.monotonic() + self.ttl, attr)

    def get(self, ino: int) -> StatResult | None:
        """The attributes of ``ino`` if a reply carried them within ``ttl``."""
        hit = self._attrs.get(ino)
        if hit is None:
            return None
        if hit[0] <= time.monotonic():
            del self._attrs[ino]
            return None
        return hit[1]

    def drop(self, *inodes: int) -> None:
        """These inodes change (or changed) here: forget them, and any read in flight."""
        self.gen += 1
        for ino in inodes:
            self._attrs.pop(ino, None)

    def clear(self) -> None:
        """Something changed here whose inodes are not all known: forget everything."""
        self.gen += 1
        self._attrs.clear()
