"""POSIX namespace logic over a store transaction: no IO, no trio, no threads.

Every operation is a method of :class:`Namespace` that takes the transaction first and
the caller's :class:`Cred`, checks POSIX rules and permissions, changes the records
described in :mod:`pfs.metaserver.keys`, and returns wire-ready dicts (see ``docs/rpc.md``).
Errors are raised as ``OSError`` with the errno Linux would give. The server runs these
inside its group-commit transactions; the tests run them against both store engines.

Hooks the server supplies:

* ``servers()`` -> ``{sid: free_bytes}`` of alive data servers that are not full (their
  free space above the reserve, ``registry.py``), for placement;
* ``opened(ino)`` -> True if the inode has open handles (then dropping its last link
  makes it an orphan instead of deleting it). The server's version also marks the
  inode so that an ``open`` racing with the deletion fails;
* ``is_open(ino)`` -> True if the inode has open handles, with no side effect (a file's
  layout cannot change under an open handle);
* ``deleting(ino)`` -> True while the deleter removes objects of an old layout of the
  inode (its layout cannot change then either; see ``deletion_plan``).
"""
from __future__ import annotations

import errno
import logging
import math
import os
import random
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import msgpack

from pfs.core.config import LayoutDefaults
from pfs.core.errors import check_size
from pfs.core.layout import check_geometry
from pfs.core.messages.meta import (  # the flags, defined once with the messages
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    XATTR_CREATE,
    XATTR_REPLACE,
)
from pfs.core.messages.records import (  # the POSIX limits, defined once with the messages
    NAME_MAX,
    NOW,
    PATH_MAX,
    SYMLINK_MAX,
    XATTR_NAME_MAX,
    XATTR_SIZE_MAX,
)
from pfs.metaserver import keys as K
from pfs.metaserver.chains import Chain, ChainTable
from pfs.metaserver.counters import Counters
from pfs.metaserver.store import Txn
from pfs.metaserver.walks import WalkCache

log = logging.getLogger(__name__)

R_OK, W_OK, X_OK = 4, 2, 1
_OPEN_MASK = {os.O_RDONLY: R_OK, os.O_WRONLY: W_OK, os.O_RDWR: R_OK | W_OK}  # by access mode

MAXSYMLINKS = 40
XATTR_LIST_MAX = 65536
READDIR_MAX = 4096
DIR_SIZE = 4096
FILES_MAX = 1 << 32
DIRS_CACHED = 1 << 14  # decoded directory records kept for path walks
PLACEMENTS_CACHED = 1 << 12  # stripe assignments kept by server order (place)
PLACEMENTS_KEPT_UP_TO = 8  # servers placeable: above this, orders rarely repeat
STATFS_BSIZE = 4096
XATTR_PREFIXES = (b"user.", b"trusted.", b"security.")


@dataclass(frozen=True, slots=True)
class Cred:
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @property
    def root(self) -> bool:
        return self.uid == 0

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups

    @classmethod
    def from_wire(cls, value: Any) -> Cred:
        if (not isinstance(value, (list, tuple)) or len(value) not in (2, 3)
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value[:2])):
            raise OSError(errno.EINVAL, "cred must be [uid, gid, [gids]]")
        groups: tuple[int, ...] = ()
        if len(value) == 3:
            g = value[2]
            if not isinstance(g, (list, tuple)) or len(g) > 65536 or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in g):
                raise OSError(errno.EINVAL, "cred groups must be a list of integers")
            groups = tuple(g)
        return cls(value[0], value[1], groups)


ROOT = Cred(0, 0)


def _err(code: int, detail: str = "") -> OSError:
    msg = os.strerror(code)
    return OSError(code, f"{msg}: {detail}" if detail else msg)


def _show(name: bytes) -> str:
    return name.decode("utf-8", "replace")


_local = threading.local()


def pack(obj: Any) -> bytes:
    # one Packer per thread, reused: ``packb`` makes (and allocates a buffer for) a new
    # one at every call, ~1 us of a create's four records each
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    out: bytes = packer.pack(obj)
    return out


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def check_name(name: bytes) -> None:
    if not isinstance(name, bytes) or not name:
        raise _err(errno.EINVAL, "empty name")
    if b"/" in name or b"\0" in name:
        raise _err(errno.EINVAL, f"name {name!r} contains '/' or NUL")
    if len(name) > NAME_MAX:
        raise _err(errno.ENAMETOOLONG, f"name of {len(name)} bytes")


def _plain_last(path: bytes, name: bytes) -> bool:
    """Whether ``name``, the last component of ``path``, is a plain name a directory
    holds (not ``.``, ``..``, empty or too long) in a path of valid length."""
    return (bool(name) and name != b"." and name != b".." and len(name) <= NAME_MAX
            and len(path) < PATH_MAX and b"\0" not in path)


def _is_dot(name: bytes) -> bool:
    return name in (b".", b"..")


Rec = dict[str, Any]


def kill_priv(mode: int) -> int:
    """``mode`` without the privilege bits a write or truncate by a non-root caller drops."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


def _assign(order: tuple[str, ...], doms: tuple[str, ...], count: int, replicas: int
            ) -> tuple[tuple[tuple[str, ...], ...], bool]:
    """The servers of each of ``count`` stripes, given the random ``order`` of the
    servers and each one's failure domain (``doms``, in that order): each stripe's head
    the first of the least used non-heads from its place in the ring, then replicas in
    domains not yet in the stripe, least used first; and whether some stripe had to
    share a domain (fewer domains than replicas)."""
    n = len(order)
    dom = dict(zip(order, doms, strict=True))
    used = dict.fromkeys(order, 0)
    heads: set[str] = set()
    servers: list[tuple[str, ...]] = []
    short = False
    for i in range(count):
        ring = order[i % n:] + order[:i % n]
        head = min(ring, key=lambda sid: (sid in heads, used[sid]))  # first of the least
        heads.add(head)
        members, seen = [head], {dom[head]}
        rest = sorted((sid for sid in ring if sid != head), key=used.__getitem__)
        for sid in rest:
            if len(members) == replicas:
                break
            if dom[sid] not in seen:
                members.append(sid)
                seen.add(dom[sid])
        if len(members) < replicas:  # fewer domains than replicas: distinct servers
            short = True
            members += [sid for sid in rest if sid not in members][:replicas - len(members)]
        for sid in members:
            used[sid] += 1
        servers.append(tuple(members))
    return tuple(servers), short


class Namespace:
    def __init__(self, layout: LayoutDefaults | None = None, *,
                 servers: Callable[[], dict[str, int]] = dict,
                 opened: Callable[[int], bool] = lambda ino: False,
                 is_open: Callable[[int], bool] = lambda ino: False,
                 deleting: Callable[[int], bool] = lambda ino: False,
                 unwritten: Callable[[int], bool] = lambda ino: False,
                 made: Callable[[int], None] = lambda ino: None,
                 clock: Callable[[], int] = time.time_ns,
                 rng: random.Random | None = None,
                 counters: Counters | None = None) -> None:
        self.default = layout or LayoutDefaults()
        check_geometry(self.default.unit, self.default.count, self.default.replicas)
        self.servers = servers
        self.opened = opened
        self.is_open = is_open
        self.deleting = deleting
        self.unwritten = unwritten  # no data server can hold objects of this inode
        self.made = made  # a new regular file: no data server holds objects of it yet
        self.clock = clock
        self.rng = rng or random.Random()
        self.chains = ChainTable()
        # each data server's failure domain (its host, or the rack its config names),
        # from registrations; placement keeps a chain's replicas in distinct ones
        self.domains: dict[str, str] = {}
        self.placement_note = ""  # why the last placement could not separate domains
        # decoded directory records by inode, each with the stored bytes it was decoded
        # from, for path walks: a hit is a read of the record and a comparison of bytes
        # instead of a decoding. Never stale (the record is read each time); shared, so
        # only read-only callers (the walk) use it.
        self._dirs: dict[int, tuple[bytes, Rec]] = {}
        # the directories path walks in read transactions reached (walks.py); every
        # change that could alter a walk drops them all
        self.walks = WalkCache()
        # next_ino and the inode count, kept in memory within a group-commit batch
        self.counters = counters or Counters()
        # placement's stripe assignments by (server order, domains, count, replicas)
        self._placements: dict[tuple[Any, ...],
                               tuple[tuple[tuple[str, ...], ...], bool]] = {}

    # ------------------------------------------------------------------ records
    def format(self, txn: Txn) -> bool:
        """Create the root directory in an empty store; False if it exists."""
        if txn.get(K.inode(K.ROOT_INO)) is not None:
            return False
        now = self.clock()
        rec = {"mode": stat.S_IFDIR | 0o755, "uid": 0, "gid": 0, "size": DIR_SIZE,
               "atime": now, "mtime": now, "ctime": now, "nlink": 2, "rdev": 0,
               "parent": K.ROOT_INO, "nseq": 1,
               "layout": {"unit": 0, "count": 0, "replicas": 0, "servers": []}}
        txn.put(K.inode(K.ROOT_INO), pack(rec))
        self._set_counter(txn, b"next_ino", K.ROOT_INO + 1)
        self._set_counter(txn, b"inodes", 1)
        return True

    @staticmethod
    def _counter(txn: Txn, name: bytes) -> int:
        v = txn.get(K.counter(name))
        return 0 if v is None else K.read_u64(v)

    @staticmethod
    def _set_counter(txn: Txn, name: bytes, value: int) -> None:
        txn.put(K.counter(name), K.u64(value))

    def _bump(self, txn: Txn, name: bytes, delta: int = 1) -> int:
        """Add ``delta`` to a counter; returns the value before."""
        v = self._counter(txn, name)
        self._set_counter(txn, name, v + delta)
        return v

    @staticmethod
    def _rec(txn: Txn, ino: int) -> Rec:
        if not isinstance(ino, int) or ino <= 0:
            raise _err(errno.EINVAL, f"bad inode number {ino!r}")
        v = txn.get(K.inode(ino))
        if v is None:
            raise _err(errno.ENOENT, f"inode {ino}")
        return unpack(v)

    @staticmethod
    def _save(txn: Txn, ino: int, rec: Rec) -> None:
        txn.put(K.inode(ino), pack(rec))

    def _rec_shared(self, txn: Txn, ino: int) -> Rec:
        """:meth:`_rec` for a caller that does not change it: a directory's comes from
        the decoded cache (see ``_dirs``)."""
        if not isinstance(ino, int) or ino <= 0:
            raise _err(errno.EINVAL, f"bad inode number {ino!r}")
        v = txn.get(K.inode(ino))
        if v is None:
            raise _err(errno.ENOENT, f"inode {ino}")
        hit = self._dirs.get(ino)
        if hit is not None and hit[0] == v:
            return hit[1]
        rec: Rec = unpack(v)
        if stat.S_ISDIR(rec["mode"]):
            if len(self._dirs) >= DIRS_CACHED:
                self._dirs.clear()
            self._dirs[ino] = (bytes(v), rec)
        return rec

    def _dir(self, txn: Txn, ino: int) -> Rec:
        rec = self._rec(txn, ino)
        if not stat.S_ISDIR(rec["mode"]):
            raise _err(errno.ENOTDIR, f"inode {ino}")
        return rec

    def _dir_copy(self, txn: Txn, ino: int) -> Rec:
        """:meth:`_dir` from the decoded cache, as a shallow copy: for a caller that
        sets the record's own fields (times, ``nseq``, ``nlink``) but never changes its
        nested values (``layout``) in place."""
        rec = self._rec_shared(txn, ino)
        if not stat.S_ISDIR(rec["mode"]):
            raise _err(errno.ENOTDIR, f"inode {ino}")
        return dict(rec)

    def _new_inode(self, txn: Txn, rec: Rec) -> int:
        ino = self.counters.new_ino(txn)
        self._save(txn, ino, rec)
        return ino

    @staticmethod
    def attr(ino: int, rec: Rec) -> dict[str, Any]:
        size = rec["size"]
        layout = rec.get("layout")
        blksize = layout["unit"] if stat.S_ISREG(rec["mode"]) and layout else 4096
        return {"ino": ino, "mode": rec["mode"], "nlink": rec["nlink"], "uid": rec["uid"],
                "gid": rec["gid"], "size": size, "atime": rec["atime"],
                "mtime": rec["mtime"], "ctime": rec["ctime"], "rdev": rec.get("rdev", 0),
                "blksize": blksize, "blocks": (size + 511) // 512}

    # ------------------------------------------------------------------ permissions
    @staticmethod
    def check_perm(cred: Cred, rec: Rec, mask: int) -> None:
        if not mask:
            return
        mode = rec["mode"]
        if cred.root:
            if mask & X_OK and not stat.S_ISDIR(mode) and not mode & 0o111:
                raise _err(errno.EACCES, "no execute bit set")
            return
        if cred.uid == rec["uid"]:
            bits = (mode >> 6) & 7
        elif cred.in_group(rec["gid"]):
            bits = (mode >> 3) & 7
        else:
            bits = mode & 7
        if mask & ~bits:
            raise _err(errno.EACCES)

    @staticmethod
    def _sticky(cred: Cred, parent: Rec, rec: Rec) -> None:
        if (parent["mode"] & stat.S_ISVTX and not cred.root
                and cred.uid != parent["uid"] and cred.uid != rec["uid"]):
            raise _err(errno.EPERM, "sticky directory")

    # ------------------------------------------------------------------ entries
    @staticmethod
    def _entry(txn: Txn, parent: int, name: bytes) -> tuple[int, int] | None:
        v = txn.get(K.dentry(parent, name))
        if v is None:
            return None
        ino, seq = unpack(v)
        return ino, seq

    @staticmethod
    def _link_entry(txn: Txn, parent: int, name: bytes, ino: int, seq: int) -> None:
        txn.put(K.dentry(parent, name), pack([ino, seq]))
        txn.put(K.entry(parent, seq), pack([name, ino]))

    def _add_entry(self, txn: Txn, parent: int, prec: Rec, name: bytes, ino: int) -> None:
        seq = prec["nseq"]
        prec["nseq"] = seq + 1
        self._link_entry(txn, parent, name, ino, seq)

    @staticmethod
    def _remove_entry(txn: Txn, parent: int, name: bytes, seq: int) -> None:
        txn.delete(K.dentry(parent, name))
        txn.delete(K.entry(parent, seq))

    @staticmethod
    def _scan(txn: Txn, prefix: bytes, start: bytes | None = None,
              limit: int | None = None) -> list[tuple[bytes, bytes]]:
        it = txn.scan(prefix, start)
        try:
            return list(islice(it, limit))
        finally:
            it.close()  # type: ignore[attr-defined]

    def _has_entries(self, txn: Txn, ino: int) -> bool:
        return bool(self._scan(txn, K.entry_prefix(ino), limit=1))

    def _child(self, txn: Txn, cred: Cred, parent: int, name: bytes) -> tuple[int, Rec, int]:
        """(ino, rec, seq) of an existing entry; ENOENT if missing."""
        ent = self._entry(txn, parent, name)
        if ent is None:
            raise _err(errno.ENOENT, f"{name!r} in inode {parent}")
        return ent[0], self._rec(txn, ent[0]), ent[1]

    def _drop_link(self, txn: Txn, ino: int, rec: Rec, now: int) -> None:
        """One link fewer; the last one deletes the inode or makes it an orphan."""
        rec["nlink"] = 0 if stat.S_ISDIR(rec["mode"]) else rec["nlink"] - 1
        rec["ctime"] = now
        if rec["nlink"] > 0:
            self._save(txn, ino, rec)
        elif self.opened(ino):
            self._save(txn, ino, rec)
            txn.put(K.orphan(ino), b"")
        else:
            self._destroy(txn, ino, rec, orphan=False)

    def _destroy(self, txn: Txn, ino: int, rec: Rec, orphan: bool = True) -> None:
        """Delete ``ino`` and queue its objects' deletion. ``orphan`` False: it cannot
        have an orphan mark (its last link went just now), none to delete."""
        txn.delete(K.inode(ino))
        if orphan:
            txn.delete(K.orphan(ino))
        for key, _ in self._scan(txn, K.xattr_prefix(ino)):
            txn.delete(key)
        self.counters.add_inodes(txn, -1)
        layout = rec.get("layout")
        if stat.S_ISREG(rec["mode"]) and layout and layout.get("servers") \
                and not self.unwritten(ino):
            self._queue_delete(txn, ino, self.chains.holders(txn, layout))

    def _queue_delete(self, txn: Txn, ino: int, layout: dict[str, Any]) -> None:
        """Queue the objects of ``layout`` (``[ino, stripe]`` on each of its servers)."""
        seq = self._bump(txn, b"qseq")
        txn.put(K.delq(seq), pack({"ino": ino, "layout": layout}))

    def reclaim(self, txn: Txn, ino: int) -> bool:
        """Delete orphan ``ino`` if it is no longer open; True if it was deleted."""
        if txn.get(K.orphan(ino)) is None:
            return False
        v = txn.get(K.inode(ino))
        if v is None:
            txn.delete(K.orphan(ino))
            return False
        rec = unpack(v)
        if rec["nlink"] > 0:  # linked again (cannot happen today), keep it
            txn.delete(K.orphan(ino))
            return False
        if self.opened(ino):
            return False
        self._destroy(txn, ino, rec)
        return True

    def orphans(self, txn: Txn) -> list[int]:
        return [K.read_u64(k, 1) for k, _ in self._scan(txn, K.ORPHAN)]

    def _owner_gid(self, cred: Cred, prec: Rec) -> int:
        return prec["gid"] if prec["mode"] & stat.S_ISGID else cred.gid

    def _new_entry_checks(self, txn: Txn, cred: Cred, parent: int, name: bytes,
                          prec: Rec | None = None) -> Rec:
        """The parent's record, once a new entry ``name`` may be made in it. ``prec``:
        that record, read in this transaction by a caller that found ``name`` missing and
        ``parent`` searchable (then neither is checked again)."""
        if prec is None:
            check_name(name)
            prec = self._dir(txn, parent)
            self.check_perm(cred, prec, X_OK)
            if _is_dot(name) or self._entry(txn, parent, name) is not None:
                raise _err(errno.EEXIST, f"{name!r}")
        self.check_perm(cred, prec, W_OK | X_OK)
        if prec["nlink"] == 0:
            raise _err(errno.ENOENT, "directory was removed")
        return prec

    def _make(self, txn: Txn, cred: Cred, parent: int, prec: Rec, name: bytes,
              mode: int, now: int, extra: dict[str, Any]) -> tuple[int, Rec]:
        gid = self._owner_gid(cred, prec)
        if (not stat.S_ISDIR(mode) and mode & stat.S_ISGID and not cred.root
                and not cred.in_group(gid)):
            mode &= ~stat.S_ISGID
        rec = {"mode": mode, "uid": cred.uid, "gid": gid, "size": 0, "atime": now,
               "mtime": now, "ctime": now, "nlink": 1, "rdev": 0}
        rec.update(extra)
        ino = self._new_inode(txn, rec)
        self._add_entry(txn, parent, prec, name, ino)
        prec["mtime"] = prec["ctime"] = now
        self._save(txn, parent, prec)
        return ino, rec

    # ------------------------------------------------------------------ placement
    def inherited(self, txn: Txn, dir_ino: int, unit: int = 0, count: int = 0,
                  replicas: int = 0) -> tuple[int, int, int]:
        """Fill each 0 from the nearest directory (``dir_ino``, then its ancestors) that
        sets it, else from the cluster default."""
        node = dir_ino
        for _ in range(1 << 16):
            if unit and count and replicas:
                break
            rec = self._rec(txn, node)
            d = rec.get("layout") or {}
            unit = unit or d.get("unit", 0)
            count = count or d.get("count", 0)
            replicas = replicas or d.get("replicas", 0)
            if node == K.ROOT_INO:
                break
            node = rec.get("parent", K.ROOT_INO)
        return (unit or self.default.unit, count or self.default.count,
                replicas or self.default.replicas)

    def file_layout(self, txn: Txn, dir_ino: int | None, unit: int = 0, count: int = 0,
                    replicas: int = 0, what: str = "", dir_rec: Rec | None = None
                    ) -> dict[str, Any]:
        """A placed layout: explicit values, else the nearest directory default, else
        the cluster's. ``what`` names the file in an ENOSPC; ``dir_rec``: the record of
        ``dir_ino`` when the caller has read it."""
        return self._file_layout(txn, dir_ino, unit, count, replicas, what, dir_rec)[0]

    def _file_layout(self, txn: Txn, dir_ino: int | None, unit: int = 0, count: int = 0,
                     replicas: int = 0, what: str = "", dir_rec: Rec | None = None
                     ) -> tuple[dict[str, Any], list[Chain]]:
        """:meth:`file_layout`, and the chains of its stripes (read or made here)."""
        durable = True
        if dir_ino is not None:
            unit, count, replicas, durable = self._dir_defaults(txn, dir_ino, dir_rec, unit,
                                                                count, replicas)
        unit = unit or self.default.unit
        count = count or self.default.count
        replicas = replicas or self.default.replicas
        check_geometry(unit, count, replicas)
        layout, chains = self._place(unit, count, replicas, what, txn)
        if not durable:
            layout["durable"] = False  # absent: durable (what older records mean)
        assert chains is not None  # placed with a transaction
        return layout, chains

    def _dir_defaults(self, txn: Txn, dir_ino: int, rec: Rec | None, unit: int, count: int,
                      replicas: int) -> tuple[int, int, int, bool]:
        """:meth:`inherited` and :meth:`durable` in one walk up the ancestors (each
        record read once; a create runs this)."""
        durable: bool | None = None
        node = dir_ino
        for _ in range(1 << 16):
            if unit and count and replicas and durable is not None:
                break
            if rec is None:
                rec = self._rec_shared(txn, node)  # read only: an ancestor directory
            d = rec.get("layout") or {}
            unit = unit or d.get("unit", 0)
            count = count or d.get("count", 0)
            replicas = replicas or d.get("replicas", 0)
            if durable is None and d.get("durable") is not None:
                durable = bool(d["durable"])
            if node == K.ROOT_INO:
                break
            node = rec.get("parent", K.ROOT_INO)
            rec = None
        return unit, count, replicas, True if durable is None else durable

    def durable(self, txn: Txn, dir_ino: int) -> bool:
        """Whether close() syncs the data of new files in ``dir_ino``: the nearest
        directory (it, then its ancestors) that says, else yes."""
        node = dir_ino
        for _ in range(1 << 16):
            rec = self._rec(txn, node)
            said = (rec.get("layout") or {}).get("durable")
            if said is not None:
                return bool(said)
            if node == K.ROOT_INO:
                break
            node = rec.get("parent", K.ROOT_INO)
        return True

    def place(self, unit: int, count: int, replicas: int, what: str = "",
              txn: Txn | None = None) -> dict[str, Any]:
        """Choose servers: ``count`` distinct stripes (fewer if fewer servers are alive
        and not full), heads picked at random weighted by free space; a stripe's replicas
        on distinct servers in distinct failure domains (distinct servers only, with a
        note, when there are fewer domains than replicas), the least used first so that
        stripes stay apart while there are enough servers. With ``txn`` each stripe gets
        the chain of its servers (made or reused). ENOSPC only when no server can take
        a stripe."""
        return self._place(unit, count, replicas, what, txn)[0]

    def _place(self, unit: int, count: int, replicas: int, what: str, txn: Txn | None
               ) -> tuple[dict[str, Any], list[Chain] | None]:
        """:meth:`place`, and the chains it made or reused (with ``txn``)."""
        alive = self.servers()
        if not alive:
            raise _err(errno.ENOSPC, f"{what + ': ' if what else ''}no data server can take "
                       "its data (all are full or down; see `pfs df`)")
        n = len(alive)
        count = min(count, n)
        replicas = min(replicas, n)
        top = max(max(alive.values()), 0) + 1
        rand, log_ = self.rng.random, math.log
        # Efraimidis-Spirakis in log form: log(u) / w, w = (free + 1) / top
        keys = {sid: log_(1.0 - rand()) * top / (max(alive[sid], 0) + 1)
                for sid in sorted(alive)}
        order = tuple(sorted(keys, key=keys.__getitem__, reverse=True))
        known = self.domains.get
        doms = tuple([known(sid) or self._domain(txn, sid) for sid in order])
        # the random part is the order; what follows depends on nothing else, so it is
        # kept per order while there are few servers (few orders; a large cluster's
        # orders rarely repeat, so it is computed each time there)
        ckey = (order, doms, count, replicas)
        kept = self._placements.get(ckey) if n <= PLACEMENTS_KEPT_UP_TO else None
        if kept is None:
            kept = _assign(order, doms, count, replicas)
            if n <= PLACEMENTS_KEPT_UP_TO:
                if len(self._placements) >= PLACEMENTS_CACHED:
                    self._placements.clear()
                self._placements[ckey] = kept
        members_of, short = kept
        self._note(short, replicas)
        out: dict[str, Any] = {"unit": unit, "count": count, "replicas": replicas,
                               "servers": [list(m) for m in members_of]}
        if txn is None:
            return out, None
        chains = [self.chains.make_or_reuse(txn, m) for m in members_of]
        out["chains"] = [c.cid for c in chains]
        return out, chains

    def _domain(self, txn: Txn | None, sid: str) -> str:
        dom = self.domains.get(sid)
        if dom is None and txn is not None:
            raw = txn.get(K.server(sid))
            if raw is not None:
                rec = unpack(raw)
                dom = rec.get("domain") or rec.get("host")
                if dom:
                    self.domains[sid] = dom
        return dom or sid

    def _note(self, short: bool, replicas: int) -> None:
        note = (f"fewer failure domains than {replicas} replicas among the data servers "
                "up: some replicas share a host (or rack)") if short else ""
        if note and note != self.placement_note:
            log.warning("placement: %s", note)
        self.placement_note = note

    # ------------------------------------------------------------------ lookups
    def getattr(self, txn: Txn, ino: int) -> dict[str, Any]:
        return self.attr(ino, self._rec(txn, ino))

    def lookup(self, txn: Txn, cred: Cred, parent: int, name: bytes) -> dict[str, Any]:
        check_name(name)
        prec = self._dir(txn, parent)
        self.check_perm(cred, prec, X_OK)
        if name == b".":
            return self.attr(parent, prec)
        if name == b"..":
            up = prec.get("parent", K.ROOT_INO)
            return self.attr(up, self._rec(txn, up))
        ino, rec, _ = self._child(txn, cred, parent, name)
        return self.attr(ino, rec)

    def access(self, txn: Txn, cred: Cred, ino: int, mask: int) -> None:
        if mask & ~7:
            raise _err(errno.EINVAL, f"access mask {mask}")
        self.check_perm(cred, self._rec(txn, ino), mask)

    def _walk(self, txn: Txn, cred: Cred, start: int, path: bytes, follow: bool
              ) -> tuple[int, bytes, int | None]:
        """Walk ``path`` from directory ``start`` (or the root if absolute), following
        symlinks in intermediate components (and the last one if ``follow``).
        Returns (parent ino, last name, ino or None if the last component is missing)."""
        parent, name, ino, _ = self._walk_rec(txn, cred, start, path, follow)
        return parent, name, ino

    def _walk_rec(self, txn: Txn, cred: Cred, start: int, path: bytes, follow: bool
                  ) -> tuple[int, bytes, int | None, Rec | None]:
        """:meth:`_walk`, with the record of the inode found (None if missing). Each
        record is read once: a directory's record, read as the child of the step before,
        is the one the next step searches (the hot path of every path-based call)."""
        if len(path) >= PATH_MAX:
            raise _err(errno.ENAMETOOLONG, "path")
        if b"\0" in path:
            raise _err(errno.EINVAL, "path contains NUL")
        if not path:
            raise _err(errno.ENOENT, "empty path")
        cur = K.ROOT_INO if path.startswith(b"/") else start
        stack = [c for c in reversed(path.split(b"/")) if c]
        must_dir = path.endswith(b"/")
        links = 0
        cur_rec: Rec | None = None  # the record of ``cur`` when already read
        while stack:
            comp = stack.pop()
            last = not stack
            if cur_rec is None:
                crec_dir = self._rec_shared(txn, cur)
                if not stat.S_ISDIR(crec_dir["mode"]):
                    raise _err(errno.ENOTDIR, f"inode {cur}")
            else:
                crec_dir, cur_rec = cur_rec, None  # a directory: checked below
            self.check_perm(cred, crec_dir, X_OK)
            if len(comp) > NAME_MAX:
                raise _err(errno.ENAMETOOLONG, f"component {comp[:32]!r}...")
            if comp == b".":
                child: int | None = cur
            elif comp == b"..":
                child = crec_dir.get("parent", K.ROOT_INO)
            else:
                ent = self._entry(txn, cur, comp)
                child = ent[0] if ent else None
            if child is None:
                if last:
                    return cur, comp, None, None
                raise _err(errno.ENOENT, f"{comp!r}")
            crec = crec_dir if child == cur else self._rec_shared(txn, child)
            if stat.S_ISLNK(crec["mode"]) and (not last or follow or must_dir):
                links += 1
                if links > MAXSYMLINKS:
                    raise _err(errno.ELOOP, "too many levels of symbolic links")
                target: bytes = crec["target"]
                if target.startswith(b"/"):
                    cur = K.ROOT_INO
                else:
                    cur_rec = crec_dir  # the walk goes on from the link's directory
                stack.extend(c for c in reversed(target.split(b"/")) if c)
                continue
            if last:
                if must_dir and not stat.S_ISDIR(crec["mode"]):
                    raise _err(errno.ENOTDIR, f"{comp!r}")
                return cur, comp, child, crec
            if not stat.S_ISDIR(crec["mode"]):
                raise _err(errno.ENOTDIR, f"{comp!r}")
            cur, cur_rec = child, crec
        rec = cur_rec if cur_rec is not None else self._dir(txn, cur)
        return rec.get("parent", K.ROOT_INO), b"", cur, rec

    def resolve(self, txn: Txn, cred: Cred, path: bytes, follow: bool, cache: bool = False
                ) -> dict[str, Any]:
        """``path``'s attributes, directory and name. ``cache``: ``txn`` is a read
        transaction, and its directory may come from (and go to) the walk cache."""
        if not path.startswith(b"/"):
            raise _err(errno.EINVAL, "path must be absolute inside pfs")
        if cache:
            head, _, name = path.rpartition(b"/")
            if _plain_last(path, name):
                parent = self._dir_of(txn, cred, head or b"/", True)
                ent = self._entry(txn, parent, name)
                if ent is None:
                    raise _err(errno.ENOENT, path.decode("utf-8", "replace"))
                found = self._rec_shared(txn, ent[0])
                if not (follow and stat.S_ISLNK(found["mode"])):
                    return {"attr": self.attr(ent[0], found), "parent": parent, "name": name}
        parent, name, ino, rec = self._walk_rec(txn, cred, K.ROOT_INO, path, follow)
        if ino is None or rec is None:
            raise _err(errno.ENOENT, path.decode("utf-8", "replace"))
        return {"attr": self.attr(ino, rec), "parent": parent, "name": name}

    def entry_of(self, txn: Txn, cred: Cred, path: bytes, cache: bool = False
                 ) -> tuple[int, bytes]:
        """The directory and name of ``path``'s last component (not followed), for
        path-based calls; the directories on the way need search permission.
        ``cache``: ``txn`` is a read transaction, and the directory may come from (and
        go to) the walk cache."""
        if not path.startswith(b"/"):
            raise _err(errno.EINVAL, "path must be absolute inside pfs")
        head, _, name = path.rpartition(b"/")
        if (name and name != b"." and name != b".." and len(path) < PATH_MAX
                and b"\0" not in path):
            # the common case: only the directories are walked; the last component is
            # the caller's to look up (its change reads it again in the write anyway)
            parent = self._dir_of(txn, cred, head or b"/", cache)
            if len(name) > NAME_MAX:
                raise _err(errno.ENAMETOOLONG, f"component {name[:32]!r}...")
            return parent, name
        # a trailing slash must not make the walk follow a symlink in the last component
        # (rmdir "link/" would remove the directory it points to): it only asks for a
        # directory
        stripped = path.rstrip(b"/") or b"/"
        parent, name, ino = self._walk(txn, cred, K.ROOT_INO, stripped, False)
        if (ino is not None and name and stripped != path
                and not stat.S_ISDIR(self._rec(txn, ino)["mode"])):
            raise _err(errno.ENOTDIR, f"{name!r}")
        if not name:
            raise _err(errno.EBUSY, "the root directory has no parent entry")
        return parent, name

    def _dir_of(self, txn: Txn, cred: Cred, head: bytes, cache: bool = False) -> int:
        """:meth:`entry_of`'s directory for a last component that is a plain name:
        ``head`` walked (symlinks followed, as on the way to any component), with the
        checks the full walk makes before it looks a name up in the directory.
        ``cache``: ``txn`` is a read transaction; use and fill the walk cache."""
        if cache:
            hit = self.walks.get(head, cred)
            if hit is not None:
                return hit
        _, comp, ino, rec = self._walk_rec(txn, cred, K.ROOT_INO, head, True)
        if ino is None or rec is None:
            raise _err(errno.ENOENT, f"{comp!r}")
        if not stat.S_ISDIR(rec["mode"]):
            raise _err(errno.ENOTDIR, f"{comp!r}" if comp else f"inode {ino}")
        self.check_perm(cred, rec, X_OK)
        if cache:
            self.walks.put(head, cred, ino)
        return ino

    def readlink(self, txn: Txn, ino: int) -> bytes:
        rec = self._rec(txn, ino)
        if not stat.S_ISLNK(rec["mode"]):
            raise _err(errno.EINVAL, "not a symbolic link")
        return rec["target"]

    def readdir(self, txn: Txn, cred: Cred, ino: int, cookie: int = 0, limit: int = 1024,
                plus: bool = False) -> tuple[list[list[Any]], bool]:
        rec = self._dir(txn, ino)
        self.check_perm(cred, rec, R_OK)
        if cookie < 0:
            raise _err(errno.EINVAL, "negative cookie")
        limit = max(1, min(limit, READDIR_MAX))
        rows = self._scan(txn, K.entry_prefix(ino), K.entry(ino, cookie + 1), limit + 1)
        out = []
        for key, val in rows[:limit]:
            name, child = unpack(val)
            v = txn.get(K.inode(child))
            if v is None:
                continue
            crec = unpack(v)
            out.append([name, child, crec["mode"], K.read_u64(key, 9),
                        self.attr(child, crec) if plus else None])
        return out, len(rows) <= limit

    def statfs(self, txn: Txn, total: int, free: int) -> dict[str, int]:
        used = self._counter(txn, b"inodes")
        return {"bsize": STATFS_BSIZE, "frsize": STATFS_BSIZE,
                "blocks": total // STATFS_BSIZE, "bfree": free // STATFS_BSIZE,
                "bavail": free // STATFS_BSIZE, "files": FILES_MAX,
                "ffree": max(FILES_MAX - used, 0), "namemax": NAME_MAX}

    # ------------------------------------------------------------------ setattr
    def setattr(self, txn: Txn, cred: Cred, ino: int, *, mode: int | None = None,
                uid: int | None = None, gid: int | None = None, size: int | None = None,
                atime: int | str | None = None, mtime: int | str | None = None
                ) -> dict[str, Any]:
        rec = self._rec(txn, ino)
        now = self.clock()
        ftype = stat.S_IFMT(rec["mode"])
        is_dir = ftype == stat.S_IFDIR
        owner = cred.root or cred.uid == rec["uid"]
        changed = False
        if uid == -1:
            uid = None
        if gid == -1:
            gid = None
        if mode is not None or uid is not None or gid is not None:
            self.walks.invalidate()  # a directory's search permission may change
        if uid is not None or gid is not None:
            if not cred.root:
                if uid is not None and (cred.uid != rec["uid"] or uid != rec["uid"]):
                    raise _err(errno.EPERM, "only root changes the owner")
                if gid is not None and (cred.uid != rec["uid"] or (
                        gid != rec["gid"] and not cred.in_group(gid))):
                    raise _err(errno.EPERM, "chgrp to a group the caller is not in")
            if uid is not None:
                rec["uid"] = uid
            if gid is not None:
                rec["gid"] = gid
            if not is_dir:
                m = rec["mode"] & ~stat.S_ISUID
                if m & stat.S_IXGRP:
                    m &= ~stat.S_ISGID
                rec["mode"] = m
            changed = True
        if mode is not None:
            m = mode & 0o7777
            if not owner and not self._drops_set_id(cred, rec, m):
                raise _err(errno.EPERM, "only the owner changes the mode")
            if not cred.root and not cred.in_group(rec["gid"]):
                m &= ~stat.S_ISGID
            rec["mode"] = ftype | m
            changed = True
        if size is not None:
            if is_dir:
                raise _err(errno.EISDIR)
            if ftype != stat.S_IFREG:
                raise _err(errno.EINVAL, "size of a non-regular file")
            check_size(size, f"truncate of inode {ino}")
            self.check_perm(cred, rec, W_OK)
            rec["size"] = size
            rec["mtime"] = now
            if not cred.root:
                rec["mode"] = kill_priv(rec["mode"])
            changed = True
        for field, value in (("atime", atime), ("mtime", mtime)):
            if value is None:
                continue
            if value == NOW:
                if not owner:
                    self.check_perm(cred, rec, W_OK)
                value = now
            elif not isinstance(value, int) or isinstance(value, bool):
                raise _err(errno.EINVAL, f"{field} must be an integer or 'now'")
            elif not owner:
                raise _err(errno.EPERM, f"only the owner sets {field}")
            rec[field] = value
            changed = True
        if changed:
            rec["ctime"] = now
            self._save(txn, ino, rec)
        return self.attr(ino, rec)

    @staticmethod
    def _drops_set_id(cred: Cred, rec: Rec, mode: int) -> bool:
        """Whether a non-owner's mode change of ``rec`` to ``mode`` only drops its
        set-user-ID / set-group-ID bits and the caller may write the file. A write or
        truncate by a caller without CAP_FSETID drops them (Linux ``file_remove_privs``);
        a FUSE kernel that leaves that to itself (no ``handle_killpriv``) asks for it as
        a SETATTR of the mode in the writer's name. It grants nothing a write does not."""
        old = rec["mode"] & 0o7777
        set_id = stat.S_ISUID | stat.S_ISGID
        if (not stat.S_ISREG(rec["mode"]) or not old & set_id or mode & ~old
                or (old & ~mode) & ~set_id):
            return False
        try:
            Namespace.check_perm(cred, rec, W_OK)
        except OSError:
            return False
        return True

    def truncate_plan(self, txn: Txn, cred: Cred, ino: int, size: int
                      ) -> tuple[dict[str, Any], int] | None:
        """Check that ``cred`` may set ``ino``'s size; if that shrinks a file with data
        objects, return (layout, old size) so the caller can cut the objects first."""
        check_size(size, f"truncate of inode {ino}")  # before any data server sees it
        rec = self._rec(txn, ino)
        if stat.S_ISDIR(rec["mode"]):
            raise _err(errno.EISDIR)
        if not stat.S_ISREG(rec["mode"]):
            return None
        self.check_perm(cred, rec, W_OK)
        if size < rec["size"] and rec.get("layout") and rec["layout"].get("servers"):
            return self.chains.resolve(txn, rec["layout"]) or {}, rec["size"]
        return None

    def commit_size(self, txn: Txn, ino: int, written_end: int | None,
                    mtime: int | None, writer_is_root: bool = True) -> dict[str, Any]:
        """Record data a client wrote: size = max(size, written_end), its mtime; a write
        by anyone but root drops setuid (and setgid of a group-executable file), as the
        kernel does for local filesystems."""
        if written_end is not None:
            check_size(written_end, f"size commit of inode {ino}")
        rec = self._rec(txn, ino)
        changed = False
        if (written_end is not None or mtime is not None) and not writer_is_root:
            m = kill_priv(rec["mode"])
            changed = m != rec["mode"]
            rec["mode"] = m
        if written_end is not None and written_end > rec["size"]:
            rec["size"] = written_end
            changed = True
        if mtime is not None:
            rec["mtime"] = mtime
            changed = True
        if changed:
            rec["ctime"] = max(self.clock(), rec["mtime"])
            self._save(txn, ino, rec)
        return self.attr(ino, rec)

    # ------------------------------------------------------------------ creation
    def mkdir(self, txn: Txn, cred: Cred, parent: int, name: bytes, mode: int
              ) -> dict[str, Any]:
        prec = self._new_entry_checks(txn, cred, parent, name)
        now = self.clock()
        perm = mode & 0o1777
        if prec["mode"] & stat.S_ISGID:
            perm |= stat.S_ISGID
        dl = dict(prec.get("layout") or {"unit": 0, "count": 0, "replicas": 0})
        dl["servers"] = []
        ino, rec = self._make(txn, cred, parent, prec, name, stat.S_IFDIR | perm, now,
                              {"nlink": 2, "size": DIR_SIZE, "parent": parent, "nseq": 1,
                               "layout": dl})
        prec["nlink"] += 1
        self._save(txn, parent, prec)
        return self.attr(ino, rec)

    def mknod(self, txn: Txn, cred: Cred, parent: int, name: bytes, mode: int,
              rdev: int = 0) -> dict[str, Any]:
        ftype = stat.S_IFMT(mode) or stat.S_IFREG
        if ftype == stat.S_IFDIR:
            raise _err(errno.EPERM, "mknod of a directory")
        if ftype not in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR,
                         stat.S_IFBLK):
            raise _err(errno.EINVAL, f"mknod of file type {ftype:o}")
        prec = self._new_entry_checks(txn, cred, parent, name)
        if ftype in (stat.S_IFCHR, stat.S_IFBLK):
            if not cred.root:
                raise _err(errno.EPERM, "only root creates device nodes")
        else:
            rdev = 0
        extra: dict[str, Any] = {"rdev": rdev}
        if ftype == stat.S_IFREG:
            extra["layout"] = self.file_layout(txn, parent, what=_show(name))
        now = self.clock()
        ino, rec = self._make(txn, cred, parent, prec, name, ftype | (mode & 0o7777), now,
                              extra)
        if ftype == stat.S_IFREG:
            self.made(ino)
        return self.attr(ino, rec)

    def symlink(self, txn: Txn, cred: Cred, parent: int, name: bytes, target: bytes
                ) -> dict[str, Any]:
        if not target:
            raise _err(errno.ENOENT, "empty symlink target")
        if len(target) > SYMLINK_MAX:
            raise _err(errno.ENAMETOOLONG, "symlink target")
        if b"\0" in target:
            raise _err(errno.EINVAL, "symlink target contains NUL")
        prec = self._new_entry_checks(txn, cred, parent, name)
        now = self.clock()
        ino, rec = self._make(txn, cred, parent, prec, name, stat.S_IFLNK | 0o777, now,
                              {"size": len(target), "target": target})
        return self.attr(ino, rec)

    def link(self, txn: Txn, cred: Cred, ino: int, newparent: int, newname: bytes
             ) -> dict[str, Any]:
        rec = self._rec(txn, ino)
        check_name(newname)
        if stat.S_ISDIR(rec["mode"]):
            raise _err(errno.EPERM, "hard link to a directory")
        prec = self._new_entry_checks(txn, cred, newparent, newname)
        if rec["nlink"] == 0:
            raise _err(errno.ENOENT, "inode was removed")
        now = self.clock()
        rec["nlink"] += 1
        rec["ctime"] = now
        self._save(txn, ino, rec)
        self._add_entry(txn, newparent, prec, newname, ino)
        prec["mtime"] = prec["ctime"] = now
        self._save(txn, newparent, prec)
        return self.attr(ino, rec)

    def _open_inode(self, txn: Txn, cred: Cred, ino: int, rec: Rec, flags: int, now: int
                    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        acc = flags & os.O_ACCMODE
        mask = _OPEN_MASK.get(acc)
        if mask is None:
            raise _err(errno.EINVAL, "bad access mode")
        trunc = bool(flags & os.O_TRUNC)
        if trunc:
            mask |= W_OK
        mode = rec["mode"]
        if stat.S_ISDIR(mode):
            if acc != os.O_RDONLY or trunc:
                raise _err(errno.EISDIR)
        elif flags & os.O_DIRECTORY:
            raise _err(errno.ENOTDIR)
        if stat.S_ISLNK(mode):
            raise _err(errno.ELOOP, "open of a symbolic link")
        self.check_perm(cred, rec, mask)
        if trunc and stat.S_ISREG(mode):
            rec["size"] = 0
            rec["mtime"] = rec["ctime"] = now
            self._save(txn, ino, rec)
        layout = rec.get("layout") if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else None
        return self.attr(ino, rec), self.chains.resolve(txn, layout)

    def open(self, txn: Txn, cred: Cred, ino: int, flags: int
             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        rec = self._rec(txn, ino)
        if rec["nlink"] == 0:
            raise _err(errno.ENOENT, f"inode {ino} was removed")
        return self._open_inode(txn, cred, ino, rec, flags, self.clock())

    def _create_target(self, txn: Txn, cred: Cred, parent: int, name: bytes, flags: int
                       ) -> tuple[int, bytes, int | None]:
        """Where ``create`` lands: (parent, name, existing ino or None), following a
        symlink in the last component unless O_EXCL/O_NOFOLLOW."""
        return self._create_target_rec(txn, cred, parent, name, flags)[:3]

    def _create_target_rec(self, txn: Txn, cred: Cred, parent: int, name: bytes, flags: int
                           ) -> tuple[int, bytes, int | None, Rec | None]:
        """:meth:`_create_target`, with the parent's record when the entry is missing
        (a new file's create reads it once)."""
        check_name(name)
        if _is_dot(name):
            raise _err(errno.EEXIST if flags & os.O_EXCL else errno.EISDIR, f"{name!r}")
        for _ in range(MAXSYMLINKS + 1):
            prec = self._dir_copy(txn, parent)  # a new entry changes only its own fields
            self.check_perm(cred, prec, X_OK)
            ent = self._entry(txn, parent, name)
            if ent is None:
                return parent, name, None, prec
            if flags & os.O_EXCL:
                raise _err(errno.EEXIST, f"{name!r}")
            rec = self._rec(txn, ent[0])
            if not stat.S_ISLNK(rec["mode"]):
                return parent, name, ent[0], None
            if flags & os.O_NOFOLLOW:
                raise _err(errno.ELOOP, f"{name!r} is a symbolic link")
            parent, name, ino = self._walk(txn, cred, parent, rec["target"], True)
            if ino is not None:
                return parent, name, ino, None
            check_name(name)
        raise _err(errno.ELOOP)

    def create_plan(self, txn: Txn, cred: Cred, parent: int, name: bytes, flags: int
                    ) -> tuple[int, dict[str, Any], int] | None:
        """For ``create`` with O_TRUNC: (ino, layout, old size) of the existing file it
        would truncate, after checking permissions; None if nothing to cut."""
        _, _, ino = self._create_target(txn, cred, parent, name, flags)
        if ino is None:
            return None
        rec = self._rec(txn, ino)
        self._open_inode(txn, cred, ino, dict(rec), flags & ~os.O_TRUNC, 0)
        plan = self.truncate_plan(txn, cred, ino, 0)
        return None if plan is None else (ino, *plan)

    def create(self, txn: Txn, cred: Cred, parent: int, name: bytes, mode: int, flags: int
               ) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        """Create (or, without O_EXCL, open) a regular file: (attr, layout, created)."""
        now = self.clock()
        parent, name, ino, prec = self._create_target_rec(txn, cred, parent, name, flags)
        if ino is not None:
            attr, layout = self._open_inode(txn, cred, ino, self._rec(txn, ino), flags, now)
            return attr, layout, False
        prec = self._new_entry_checks(txn, cred, parent, name, prec)
        layout, chains = self._file_layout(txn, parent, what=_show(name), dir_rec=prec)
        ino, rec = self._make(txn, cred, parent, prec, name, stat.S_IFREG | (mode & 0o7777),
                              now, {"layout": layout})
        self.made(ino)
        return self.attr(ino, rec), self.chains.resolved(layout, chains), True

    # ------------------------------------------------------------------ removal
    def unlink(self, txn: Txn, cred: Cred, parent: int, name: bytes) -> None:
        check_name(name)
        if _is_dot(name):
            raise _err(errno.EISDIR, f"{name!r}")
        prec = self._dir_copy(txn, parent)  # only its times change
        self.check_perm(cred, prec, X_OK)
        ino, rec, seq = self._child(txn, cred, parent, name)
        if stat.S_ISDIR(rec["mode"]):
            raise _err(errno.EISDIR, f"{name!r}")
        self.check_perm(cred, prec, W_OK | X_OK)
        self._sticky(cred, prec, rec)
        if not stat.S_ISREG(rec["mode"]):
            self.walks.invalidate()  # a symlink a walk may have followed
        now = self.clock()
        self._remove_entry(txn, parent, name, seq)
        self._drop_link(txn, ino, rec, now)
        prec["mtime"] = prec["ctime"] = now
        self._save(txn, parent, prec)

    def rmdir(self, txn: Txn, cred: Cred, parent: int, name: bytes) -> None:
        check_name(name)
        if name == b".":
            raise _err(errno.EINVAL, "rmdir of '.'")
        if name == b"..":
            raise _err(errno.ENOTEMPTY, "rmdir of '..'")
        prec = self._dir(txn, parent)
        self.check_perm(cred, prec, X_OK)
        ino, rec, seq = self._child(txn, cred, parent, name)
        if not stat.S_ISDIR(rec["mode"]):
            raise _err(errno.ENOTDIR, f"{name!r}")
        self.check_perm(cred, prec, W_OK | X_OK)
        self._sticky(cred, prec, rec)
        if self._has_entries(txn, ino):
            raise _err(errno.ENOTEMPTY, f"{name!r}")
        self.walks.invalidate()
        now = self.clock()
        self._remove_entry(txn, parent, name, seq)
        self._drop_link(txn, ino, rec, now)
        prec["nlink"] -= 1
        prec["mtime"] = prec["ctime"] = now
        self._save(txn, parent, prec)

    def _check_not_within(self, txn: Txn, moved: int, dest: int) -> None:
        """EINVAL if directory ``dest`` is ``moved`` or inside it."""
        node = dest
        for _ in range(1 << 16):
            if node == moved:
                raise _err(errno.EINVAL, "cannot move a directory into itself")
            if node == K.ROOT_INO:
                return
            node = self._rec(txn, node).get("parent", K.ROOT_INO)
        raise _err(errno.ELOOP, "directory tree too deep")

    def rename(self, txn: Txn, cred: Cred, parent: int, name: bytes, newparent: int,
               newname: bytes, flags: int = 0) -> None:
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (
                RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise _err(errno.EINVAL, f"rename flags {flags}")
        self.walks.invalidate()  # entries on some walk's way may move or be replaced
        check_name(name)
        check_name(newname)
        if _is_dot(name) or _is_dot(newname):
            raise _err(errno.EEXIST if flags & RENAME_NOREPLACE else errno.EBUSY,
                       "rename of '.' or '..'")
        same_dir = parent == newparent
        sp = self._dir(txn, parent)
        dp = sp if same_dir else self._dir(txn, newparent)
        self.check_perm(cred, sp, X_OK)
        self.check_perm(cred, dp, X_OK)
        sino, srec, sseq = self._child(txn, cred, parent, name)
        dent = self._entry(txn, newparent, newname)
        if dent is None and flags & RENAME_EXCHANGE:
            raise _err(errno.ENOENT, f"{newname!r}")
        if dent is not None and flags & RENAME_NOREPLACE:
            raise _err(errno.EEXIST, f"{newname!r}")
        self.check_perm(cred, sp, W_OK | X_OK)
        self.check_perm(cred, dp, W_OK | X_OK)
        self._sticky(cred, sp, srec)
        dino = dseq = 0
        drec: Rec = {}
        if dent is not None:
            dino, dseq = dent
            drec = srec if dino == sino else self._rec(txn, dino)
            self._sticky(cred, dp, drec)
            if dino == sino:
                return  # two links to one inode: POSIX says do nothing
        sdir = stat.S_ISDIR(srec["mode"])
        now = self.clock()
        if sdir and not same_dir:
            self._check_not_within(txn, sino, newparent)
            self.check_perm(cred, srec, W_OK)  # its '..' changes
        if flags & RENAME_EXCHANGE:
            ddir = stat.S_ISDIR(drec["mode"])
            if ddir and not same_dir:
                self._check_not_within(txn, dino, parent)
                self.check_perm(cred, drec, W_OK)
            self._link_entry(txn, parent, name, dino, sseq)
            self._link_entry(txn, newparent, newname, sino, dseq)
            if not same_dir:
                if sdir:
                    srec["parent"] = newparent
                    sp["nlink"] -= 1
                    dp["nlink"] += 1
                if ddir:
                    drec["parent"] = parent
                    dp["nlink"] -= 1
                    sp["nlink"] += 1
            drec["ctime"] = now
            self._save(txn, dino, drec)
        else:
            if dent is not None:
                ddir = stat.S_ISDIR(drec["mode"])
                if sdir and not ddir:
                    raise _err(errno.ENOTDIR, f"{newname!r} is not a directory")
                if ddir and not sdir:
                    raise _err(errno.EISDIR, f"{newname!r} is a directory")
                if ddir and self._has_entries(txn, dino):
                    raise _err(errno.ENOTEMPTY, f"{newname!r}")
                if ddir:
                    dp["nlink"] -= 1
                self._drop_link(txn, dino, drec, now)
                self._link_entry(txn, newparent, newname, sino, dseq)
            else:
                if dp["nlink"] == 0:
                    raise _err(errno.ENOENT, "target directory was removed")
                self._add_entry(txn, newparent, dp, newname, sino)
            self._remove_entry(txn, parent, name, sseq)
            if sdir and not same_dir:
                srec["parent"] = newparent
                sp["nlink"] -= 1
                dp["nlink"] += 1
        srec["ctime"] = now
        self._save(txn, sino, srec)
        sp["mtime"] = sp["ctime"] = now
        dp["mtime"] = dp["ctime"] = now
        self._save(txn, parent, sp)
        if not same_dir:
            self._save(txn, newparent, dp)

    # ------------------------------------------------------------------ xattrs
    @staticmethod
    def _xname(name: bytes) -> None:
        if not isinstance(name, bytes) or not name or len(name) > XATTR_NAME_MAX:
            raise _err(errno.ERANGE, "xattr name empty or longer than 255 bytes")
        if b"\0" in name:
            raise _err(errno.EINVAL, "xattr name contains NUL")
        if not name.startswith(XATTR_PREFIXES):
            raise _err(errno.EOPNOTSUPP, f"xattr namespace of {name[:32]!r}")

    def _xattr_read_ok(self, cred: Cred, rec: Rec, name: bytes) -> bool:
        if name.startswith(b"trusted.") and not cred.root:
            return False
        if name.startswith(b"user."):
            if not (stat.S_ISREG(rec["mode"]) or stat.S_ISDIR(rec["mode"])):
                return False
            self.check_perm(cred, rec, R_OK)
        return True

    def _xattr_write_check(self, cred: Cred, rec: Rec, name: bytes) -> None:
        if name.startswith(b"trusted."):
            if not cred.root:
                raise _err(errno.EPERM, "trusted.* xattrs need root")
        elif name.startswith(b"user."):
            if not (stat.S_ISREG(rec["mode"]) or stat.S_ISDIR(rec["mode"])):
                raise _err(errno.EPERM, "user.* xattrs only on files and directories")
            if stat.S_ISDIR(rec["mode"]) and rec["mode"] & stat.S_ISVTX and not (
                    cred.root or cred.uid == rec["uid"]):
                raise _err(errno.EPERM, "user.* xattr on a sticky directory")
            self.check_perm(cred, rec, W_OK)
        elif not (cred.root or cred.uid == rec["uid"]):
            raise _err(errno.EPERM, "only the owner sets security.* xattrs")

    def getxattr(self, txn: Txn, cred: Cred, ino: int, name: bytes) -> bytes:
        self._xname(name)
        rec = self._rec(txn, ino)
        if not self._xattr_read_ok(cred, rec, name):
            raise _err(errno.ENODATA, f"{name!r}")
        v = txn.get(K.xattr(ino, name))
        if v is None:
            raise _err(errno.ENODATA, f"{name!r}")
        return v

    def setxattr(self, txn: Txn, cred: Cred, ino: int, name: bytes, value: bytes,
                 flags: int = 0) -> None:
        if flags & ~(XATTR_CREATE | XATTR_REPLACE) or flags == XATTR_CREATE | XATTR_REPLACE:
            raise _err(errno.EINVAL, f"setxattr flags {flags}")
        self._xname(name)
        if len(value) > XATTR_SIZE_MAX:
            raise _err(errno.E2BIG, f"xattr value of {len(value)} bytes")
        rec = self._rec(txn, ino)
        self._xattr_write_check(cred, rec, name)
        key = K.xattr(ino, name)
        exists = txn.get(key) is not None
        if flags & XATTR_CREATE and exists:
            raise _err(errno.EEXIST, f"{name!r}")
        if flags & XATTR_REPLACE and not exists:
            raise _err(errno.ENODATA, f"{name!r}")
        txn.put(key, bytes(value))
        rec["ctime"] = self.clock()
        self._save(txn, ino, rec)

    def listxattr(self, txn: Txn, cred: Cred, ino: int) -> list[bytes]:
        rec = self._rec(txn, ino)
        names = []
        for key, _ in self._scan(txn, K.xattr_prefix(ino)):
            name = key[9:]
            if name.startswith(b"trusted.") and not cred.root:
                continue
            names.append(name)
        if sum(len(n) + 1 for n in names) > XATTR_LIST_MAX:
            raise _err(errno.E2BIG, "xattr list too long")
        del rec
        return names

    def removexattr(self, txn: Txn, cred: Cred, ino: int, name: bytes) -> None:
        self._xname(name)
        rec = self._rec(txn, ino)
        self._xattr_write_check(cred, rec, name)
        if not txn.delete(K.xattr(ino, name)):
            raise _err(errno.ENODATA, f"{name!r}")
        rec["ctime"] = self.clock()
        self._save(txn, ino, rec)

    # ------------------------------------------------------------------ layouts
    def get_layout(self, txn: Txn, ino: int) -> dict[str, Any] | None:
        rec = self._rec(txn, ino)
        if stat.S_ISREG(rec["mode"]) or stat.S_ISDIR(rec["mode"]):
            return self.chains.resolve(txn, rec.get("layout"))
        return None

    def set_layout(self, txn: Txn, cred: Cred, ino: int, unit: int = 0, count: int = 0,
                   replicas: int = 0, durable: bool | None = None) -> dict[str, Any]:
        """Set a directory's default layout (0: inherit) or an empty file's; ``durable``
        False opts out of the sync on close (scratch data), True opts back in, None
        keeps what it said before; given alone, the flag leaves a directory's striping
        as it was."""
        rec = self._rec(txn, ino)
        if not (cred.root or cred.uid == rec["uid"]):
            raise _err(errno.EPERM, "only the owner sets the layout")
        if min(unit, count, replicas) < 0:
            raise _err(errno.EINVAL, "negative layout value")
        if stat.S_ISDIR(rec["mode"]):
            if durable is not None and not (unit or count or replicas):
                # the flag alone (setstripe --no-sync): the striping stays as it was
                had = rec.get("layout") or {}
                unit, count = had.get("unit", 0), had.get("count", 0)
                replicas = had.get("replicas", 0)
            check_geometry(unit or self.default.unit, count or self.default.count,
                           replicas or self.default.replicas)
            layout: dict[str, Any] = {"unit": unit, "count": count, "replicas": replicas,
                                      "servers": []}
            if durable is None:
                durable = (rec.get("layout") or {}).get("durable")
            if durable is not None:
                layout["durable"] = bool(durable)
        elif stat.S_ISREG(rec["mode"]):
            if rec["size"] != 0:
                raise _err(errno.EBUSY, "the layout of a file with data cannot change")
            if self.is_open(ino):  # its handles would go on writing to the old objects
                raise _err(errno.EBUSY, f"inode {ino} is open: close it before changing "
                           "its layout")
            if self.deleting(ino):  # see deletion_plan
                raise _err(errno.EBUSY, f"inode {ino}: objects of its previous layout are "
                           "being deleted; try again in a moment")
            layout = self.file_layout(txn, None, unit, count, replicas, f"inode {ino}")
            if durable is None:  # what it had (from its directory, at create)
                durable = (rec.get("layout") or {}).get("durable", True)
            if not durable:
                layout["durable"] = False
            old = rec.get("layout")
            if old and old.get("servers"):
                # an empty file may still have objects (truncated to 0, or written by a
                # handle that never committed its size). An object id is [ino, stripe],
                # so one the new layout puts on the same server is its object too: only
                # the others are queued, else the deleter would remove the new data.
                new = layout["servers"]
                held = self.chains.holders(txn, old)
                stale = [[sid for sid in sids if s >= len(new) or sid not in new[s]]
                         for s, sids in enumerate(held["servers"])]
                if any(stale) and not self.unwritten(ino):
                    self._queue_delete(txn, ino, {**held, "servers": stale})
        else:
            raise _err(errno.EINVAL, "layouts are for files and directories")
        rec["layout"] = layout
        rec["ctime"] = self.clock()
        self._save(txn, ino, rec)
        return self.chains.resolve(txn, layout) or layout

    # ------------------------------------------------------------------ registry, queue
    def register_server(self, txn: Txn, sid: str, host: str, port: int, total: int,
                        free: int, domain: str = "") -> None:
        """Record data server ``sid``; its failure domain is ``domain`` (a rack label
        from its config) or else its host. A draining mark (the operator's) is kept
        across registrations."""
        rec: dict[str, Any] = {"host": host, "port": port, "total": total, "free": free}
        if domain:
            rec["domain"] = domain
        old = txn.get(K.server(sid))
        if old is not None and unpack(old).get("draining"):
            rec["draining"] = True
        txn.put(K.server(sid), pack(rec))
        self.domains[sid] = domain or host

    @staticmethod
    def set_draining(txn: Txn, sid: str, on: bool) -> None:
        """Mark server ``sid`` draining (placement skips it) or not; ENOENT if unknown."""
        raw = txn.get(K.server(sid))
        if raw is None:
            raise _err(errno.ENOENT, f"unknown data server {sid!r}")
        rec = unpack(raw)
        if on:
            rec["draining"] = True
        else:
            rec.pop("draining", None)
        txn.put(K.server(sid), pack(rec))

    def list_servers(self, txn: Txn) -> dict[str, dict[str, Any]]:
        return {k[1:].decode("utf-8"): unpack(v) for k, v in self._scan(txn, K.SERVER)}

    def delq_entries(self, txn: Txn, limit: int = 256, start: int = 0
                     ) -> list[tuple[int, dict[str, Any]]]:
        """Up to ``limit`` queued deletions, in order, from sequence number ``start``."""
        return [(K.read_u64(k, 1), unpack(v))
                for k, v in self._scan(txn, K.DELQ, K.delq(start), limit)]

    def deletion_plan(self, txn: Txn, entries: list[tuple[int, dict[str, Any]]]
                      ) -> tuple[dict[str, list[list[int]]], dict[int, set[str]], set[int]]:
        """What queued ``entries`` ask of each data server: ``{sid: [[ino, stripe]]}``,
        the servers each entry needs, and the inodes still alive among them. An entry of
        a live inode (its layout was replaced) skips the objects its *current* layout
        uses: an object id is [ino, stripe], so a later layout that put a stripe back on
        a server owns that object again."""
        objs: dict[str, list[list[int]]] = {}
        needs: dict[int, set[str]] = {}
        live: set[int] = set()
        for seq, ent in entries:
            ino, layout = ent["ino"], ent["layout"]
            raw = txn.get(K.inode(ino))
            current = (unpack(raw).get("layout") or {}).get("servers", []) if raw else []
            if raw is not None:
                live.add(ino)
            needs[seq] = set()
            for stripe, sids in enumerate(layout["servers"]):
                for sid in sids:
                    if stripe < len(current) and sid in current[stripe]:
                        continue
                    objs.setdefault(sid, []).append([ino, stripe])
                    needs[seq].add(sid)
        return objs, needs, live

    def scan_files(self, txn: Txn, after: int, limit: int
                   ) -> tuple[list[list[Any]], int, bool]:
        """Up to ``limit`` inodes after ``after``, in order: the regular files among them
        as ``[ino, size, layout]``, the last inode read, and whether none follows."""
        rows = self._scan(txn, K.INODE, K.inode(after + 1), limit + 1)
        files: list[list[Any]] = []
        last = after
        for k, v in rows[:limit]:
            last = K.read_u64(k, 1)
            rec = unpack(v)
            if stat.S_ISREG(rec["mode"]):
                files.append([last, rec["size"],
                              self.chains.resolve(txn, rec.get("layout")) or None])
        return files, last, len(rows) <= limit

    def scan_deleting(self, txn: Txn, start: int, limit: int
                      ) -> tuple[list[list[Any]], int, bool]:
        """Queued deletions from sequence number ``start``: ``[seq, ino, layout]``, the
        ``start`` of the next page, and whether none follows."""
        rows = self.delq_entries(txn, limit + 1, start)
        out = [[seq, e["ino"], e["layout"]] for seq, e in rows[:limit]]
        return out, out[-1][0] + 1 if out else start, len(rows) <= limit

    @staticmethod
    def delq_done(txn: Txn, seq: int) -> None:
        txn.delete(K.delq(seq))
