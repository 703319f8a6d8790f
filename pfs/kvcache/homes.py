"""Where a KV block lives: rendezvous (highest-random-weight) hashing of its key over the
data servers of the pool.

Each server gets a score per key, a hash of (server id, namespace, key); a key's homes are
the ``r`` servers with the highest scores. Every client computes the same answer from the
same pool, with no table to share and no metaserver on the way. When a server joins it
takes over only the keys it now outscores (about 1/N of them); when one leaves, only its
keys move, each to its next-ranked server. Consistent hashing on a ring does the same
with virtual nodes to even the load out; rendezvous needs none and the pool is small
(tens of servers), so scoring all of them per key costs a few microseconds - a few
more than the rest of a short-circuit get of a small block, so the answers are kept
(``CACHED`` keys at most: a put's ranking serves the gets of the key after it). A
``Homes`` never changes: a new pool makes a new one, with an empty cache.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

CACHED = 1 << 14  # keys whose homes are kept (then the cache starts over)


class Homes:
    """The pool's servers (ids), ranked per key."""

    def __init__(self, servers: Iterable[str]) -> None:
        self.servers = tuple(sorted(set(servers)))
        # one keyed hasher per server, copied per key: the server id is hashed once
        self._base = {s: hashlib.blake2b(s.encode(), digest_size=8, person=b"pfs-kv")
                      for s in self.servers}
        self._cache: dict[tuple[str, bytes, int], list[str]] = {}

    def __len__(self) -> int:
        return len(self.servers)

    def __contains__(self, sid: object) -> bool:
        return sid in self._base

    def score(self, sid: str, ns: str, key: bytes) -> int:
        h = self._base[sid].copy()
        h.update(ns.encode())
        h.update(b"\0")
        h.update(key)
        return int.from_bytes(h.digest(), "big")

    def ranked(self, ns: str, key: bytes) -> list[str]:
        """Every server, best home first."""
        return sorted(self.servers, key=lambda s: self.score(s, ns, key), reverse=True)

    def homes(self, ns: str, key: bytes, r: int = 1) -> list[str]:
        """The ``r`` homes of ``key`` (fewer when the pool is smaller), best first (the
        caller must not change the list)."""
        got = self._cache.get((ns, key, r))
        if got is not None:
            return got
        if r == 1 and self.servers:  # the common case: a max, not a sort
            got = [max(self.servers, key=lambda s: self.score(s, ns, key))]
        else:
            got = self.ranked(ns, key)[:max(0, r)]
        if len(self._cache) >= CACHED:
            self._cache.clear()  # (from any thread: each call is one atomic dict step)
        self._cache[ns, key, r] = got
        return got
