"""Stripe objects as plain files under the data server's directories.

An object id is ``(ino, stripe)``; its file is ``DIR/objects/<fanout>/<ino>.<stripe>``
where ``DIR`` is one of the data directories (one per drive), chosen by a stable hash of
the id, and ``<fanout>`` is two hex digits of the same hash, so no directory grows huge.
The choice depends only on the id and on the *list* of directories: keep the list (and
its order) the same across restarts.

Open descriptors are kept in a bounded LRU cache so a read is not an open()+close().
A descriptor handed out with :meth:`ObjectStore.acquire` is pinned until its ``release``
is called (a reply may still be sending from it with ``sendfile``); one evicted or deleted
meanwhile is closed on release.

An absent object reads as empty (size 0): no error (unless it has a tombstone, tombstones.py:
its file was unlinked; the range a truncation cut off is checked likewise, cuts.py). Each data directory also holds
``server.id``, the id the metaserver gave this server, so a restart keeps its identity,
and ``FORMAT``, the directory's format (``pfs.core.versions.OBJECT_FORMAT``, as text), written
when the directory is first used. A directory in a format this pfs does not know, or in
an older one that needs more than a stamp, is refused (naming ``pfs admin migrate
--data``, which takes the steps of ``_STEPS``). One without ``FORMAT`` was made before
formats were recorded (format 0) and is stamped on open rather than refused: format 1 is
format 0 plus that file, which older servers ignore, so nothing is lost and an older
server still opens it. Objects themselves carry no format.

Each replica of a chained object records, in its extended attribute ``user.pfs.chain``,
the chain it belongs to, the chain version of the last write (or catch-up) it holds and
that write's sequence number (three little-endian u64): what tells a stale replica from
a current one (docs/architecture.md "Replication"). It lives with the file, so it
survives a restart and goes with a copy.
"""
from __future__ import annotations

import errno
import heapq
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pfs.core import checksums as ck
from pfs.core.durable import fsync_dir
from pfs.core.messages.records import ObjId  # checked off the wire by its message
from pfs.core.versions import MIGRATE_DATA, OBJECT_FORMAT, FormatError, upgrade_steps
from pfs.dataserver import checksums as dck
from pfs.dataserver.cuts import Cuts
from pfs.dataserver.tombstones import DEFAULT_KEEP, Tombstones

log = logging.getLogger(__name__)

DEFAULT_MAX_OPEN = 1024
SID_FILE = "server.id"
FORMAT_FILE = "FORMAT"
MAX_SID_LEN = 256
_OBJ_DIR = "objects"
_MASK64 = (1 << 64) - 1
CHAIN_XATTR = "user.pfs.chain"
_CHAIN_REC = struct.Struct("<QQQ")
ChainRecord = tuple[int, int, int]  # (chain id, version, write sequence)
_UNREAD: ChainRecord = (-1, -1, -1)


# -- format of a data directory ---------------------------------------------------
def dir_format(d: str) -> int | None:
    """The format recorded in data directory ``d``: 0 for one from before formats were
    recorded, None for a new (empty or absent) one."""
    try:
        with open(os.path.join(d, FORMAT_FILE), encoding="ascii") as f:
            text = f.read(32).strip()
    except FileNotFoundError:
        old = any(os.path.exists(os.path.join(d, n)) for n in (_OBJ_DIR, SID_FILE))
        return 0 if old else None
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(f"data directory {d}: unreadable {FORMAT_FILE} file: {exc}") from None
    if not text.isdigit():
        raise FormatError(f"data directory {d}: {FORMAT_FILE} holds {text!r}, not a format "
                          f"number")
    return int(text)


def _write_file(d: str, name: str, text: str) -> None:
    """Replace ``d/name`` with ``text`` durably: a temporary file, fsync, rename, and
    fsync of the directory (a crash leaves the old file or the new one)."""
    path = os.path.join(d, name)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(d)


def _write_format(d: str, fmt: int) -> None:
    _write_file(d, FORMAT_FILE, f"{fmt}\n")


def _to_1(d: str) -> None:
    _write_format(d, 1)  # format 1 is format 0 plus the FORMAT file


def _to_2(d: str) -> None:
    _write_format(d, 2)  # format 2 adds checksum sidecars, written as objects are


# step f brings a directory from format f to f + 1
_STEPS: dict[int, Callable[[str], None]] = {0: _to_1, 1: _to_2}
# steps a server takes when it opens a directory (each only adds what older servers
# ignore); any other needs ``pfs admin migrate --data``, run on a stopped server
_AT_OPEN = frozenset({0, 1})


def _upgrade_dir(d: str, at_open: bool) -> int | None:
    """Bring ``d`` to OBJECT_FORMAT; the format it was in (None: new, now stamped).
    FormatError when this pfs cannot (see :func:`pfs.core.versions.upgrade_steps`)."""
    found = dir_format(d)
    if found is None:
        _write_format(d, OBJECT_FORMAT)
        return None
    for step in upgrade_steps("data directory", d, found, OBJECT_FORMAT, _STEPS,
                              _AT_OPEN if at_open else None, MIGRATE_DATA):
        _STEPS[step](d)
    return found


def open_dir_format(d: str) -> None:
    """At open: record a new directory's format, take the upgrade steps that are safe
    at open (format 0 -> 1, module doc), refuse anything else."""
    found = _upgrade_dir(d, at_open=True)
    if found is not None and found != OBJECT_FORMAT:
        log.info("data directory %s: format %d upgraded to %d", d, found, OBJECT_FORMAT)


def migrate_dir(d: str) -> tuple[int, int]:
    """``pfs admin migrate --data``: upgrade data directory ``d`` in place to
    OBJECT_FORMAT; (format before, format after). Idempotent."""
    if not os.path.isdir(d) or dir_format(d) is None:  # a typo must not get a FORMAT file
        raise OSError(errno.ENOENT, f"no data directory in {d} (no {_OBJ_DIR}/, "
                                    f"{SID_FILE} or {FORMAT_FILE})")
    found = _upgrade_dir(d, at_open=False)
    assert found is not None
    made = add_sidecars(d)
    if made:
        log.info("data directory %s: checksums computed for %d objects", d, made)
    return found, OBJECT_FORMAT


def _compute_sidecar(path: str, out: str) -> None:
    """The checksums of object file ``path`` written to ``out`` and synced."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        cfd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            dck.compute(fd, cfd)
            os.fsync(cfd)
        finally:
            os.close(cfd)
    finally:
        os.close(fd)


def add_sidecars(d: str) -> int:
    """A checksum sidecar for every object of ``d`` without one (written before
    checksums); the number made. For a stopped server: a write meanwhile would race."""
    root = os.path.join(d, _OBJ_DIR)
    if not os.path.isdir(root):
        return 0
    made = 0
    for path, _obj in dck.iter_objects(root):
        cpath = path + ck.SUFFIX
        if os.path.exists(cpath):
            continue
        tmp = cpath + ".tmp"
        _compute_sidecar(path, tmp)
        os.replace(tmp, cpath)  # a crash leaves no half sidecar under the real name
        made += 1
    return made


def _mix(ino: int, stripe: int) -> int:
    """A stable 64-bit hash of an object id (splitmix64 finaliser; not Python's hash,
    which is salted per process)."""
    z = (ino * 0x9E3779B97F4A7C15 + stripe * 0xC2B2AE3D27D4EB4F + 0x165667B19E3779F9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class _Open:
    fd: int
    cfd: int | None = None  # the checksum sidecar (None: an unchecked object)
    pins: int = 0
    dropped: bool = False  # evicted or deleted: close when the last pin goes
    chain: ChainRecord | None = _UNREAD  # the replica's chain record, read once

    def close(self) -> None:
        os.close(self.fd)
        if self.cfd is not None:
            os.close(self.cfd)


@dataclass(frozen=True, slots=True)
class Capacity:
    total: int  # bytes, summed over distinct filesystems
    free: int  # bytes available to us
    objects: int


class ObjectStore:
    """Objects under ``dirs`` (one per drive); synchronous, owned by one event loop."""

    def __init__(self, dirs: list[str], max_open: int = DEFAULT_MAX_OPEN,
                 checksums: bool = True, tomb_keep: float = DEFAULT_KEEP) -> None:
        if not dirs:
            raise OSError(errno.EINVAL, "a data server needs at least one data directory")
        if max_open < 1:
            raise ValueError("max_open must be at least 1")
        self.dirs = [os.path.abspath(d) for d in dirs]
        if len(set(self.dirs)) != len(self.dirs):
            raise OSError(errno.EINVAL, f"data directories listed twice: {dirs}")
        self.max_open = max_open
        # keep block checksums (dataserver/checksums.py); off only to measure their cost
        self.checksums = checksums
        self._open: OrderedDict[ObjId, _Open] = OrderedDict()
        self._made: set[str] = set()  # fanout directories known to exist
        self._unsynced: set[str] = set()  # directories with entries added since their fsync
        self._warned_xattr = False
        # data directories lost (gone, emptied, unreadable): made again empty, their
        # objects refused to readers until restored from chain peers (dataserver/repair.py)
        self.lost: set[str] = set()
        fresh = [d for d in self.dirs if dir_format(d) is None]
        if fresh and len(fresh) < len(self.dirs):  # a drive replaced among used ones
            for d in fresh:
                log.error("data directory %s is empty while the others hold data: lost "
                          "(its objects are restored from chain peers)", d)
            self.lost.update(fresh)
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
            open_dir_format(d)
            os.makedirs(os.path.join(d, _OBJ_DIR), exist_ok=True)
        self.objects = self._count()
        # objects deleted because their file was unlinked (tombstones.py): never a hole
        self.tombs = Tombstones(self.dirs, self._dir, tomb_keep)
        # how far objects reached before truncations cut them (cuts.py): after a restore
        # the cut-off range is EIO, never a hole
        self.cuts = Cuts(self.dirs, self._dir, tomb_keep)
        log.info("object store on %s: %d objects", ", ".join(self.dirs), self.objects)

    # -- placement -----------------------------------------------------------
    def path(self, obj: ObjId) -> str:
        h = _mix(*obj)
        d = self.dirs[h % len(self.dirs)]
        return os.path.join(d, _OBJ_DIR, f"{(h >> 32) & 0xFF:02x}", f"{obj[0]}.{obj[1]}")

    def _dir(self, obj: ObjId) -> str:
        return self.dirs[_mix(*obj) % len(self.dirs)]

    # -- directory health ------------------------------------------------------
    def check_readable(self, obj: ObjId) -> None:
        """EIO when ``obj`` lives on a lost data directory not restored yet: a reader
        must go to another replica, never read it as a hole."""
        if self.lost and self._dir(obj) in self.lost:
            raise OSError(errno.EIO, f"object {list(obj)}: its data directory "
                                     f"{self._dir(obj)} was lost and is being restored")

    def check_absent(self, obj: ObjId) -> None:
        """``obj`` is absent: EIO when its directory's marker is gone too (the drive was
        lost since the last check: it must not read as a hole meanwhile)."""
        d = self._dir(obj)
        if d not in self.lost and not os.path.exists(os.path.join(d, FORMAT_FILE)):
            self.check_dirs()
        self.check_readable(obj)

    def _healthy(self, d: str) -> bool:
        """The directory's marker (its FORMAT file) reads back and its objects/ lists."""
        try:
            with open(os.path.join(d, FORMAT_FILE), encoding="ascii") as f:
                if not f.read(32).strip().isdigit():
                    return False
            with os.scandir(os.path.join(d, _OBJ_DIR)):
                pass
        except OSError:
            return False
        return True

    def check_dirs(self) -> list[str]:
        """Check every data directory (cheap: a marker read and a directory opened each);
        the ones newly found lost, now made again, empty, when the drive allows. Run in
        the event loop: it drops cached descriptors."""
        found: list[str] = []
        for d in self.dirs:
            if d in self.lost or self._healthy(d):
                continue
            log.error("data directory %s is gone or unreadable: lost; serving the others",
                      d)
            self.lost.add(d)
            found.append(d)
            for obj in [o for o in self._open if self._dir(o) == d]:
                self._drop(self._open.pop(obj))  # descriptors of files no longer there
            self._made = {m for m in self._made if not m.startswith(d + os.sep)}
            self._unsynced = {u for u in self._unsynced if not u.startswith(d + os.sep)}
            try:
                os.makedirs(os.path.join(d, _OBJ_DIR), exist_ok=True)
                _write_format(d, OBJECT_FORMAT)
                sid = self.load_sid()
                if sid is not None:
                    _write_file(d, SID_FILE, sid + "\n")
                self.tombs.rewrite_dir(d)
                self.cuts.rewrite_dir(d)
            except OSError as exc:
                log.error("data directory %s cannot be made again: %s", d, exc)
        return found

    def restored(self, d: str) -> None:
        """Every object of lost directory ``d`` was copied back: serve it again."""
        self.lost.discard(d)

    def _count(self) -> int:
        n = 0
        for d in self.dirs:
            with os.scandir(os.path.join(d, _OBJ_DIR)) as fanouts:
                for fan in fanouts:
                    if fan.is_dir(follow_symlinks=False):
                        self._made.add(fan.path)
                        with os.scandir(fan.path) as entries:
                            n += sum(1 for e in entries if e.is_file(follow_symlinks=False)
                                     and not e.name.endswith(ck.SUFFIX))
        return n

    # -- descriptors ---------------------------------------------------------
    def _fd(self, obj: ObjId, create: bool) -> _Open | None:
        """The cached open object; ``create``: it is about to be written (made when
        absent; its checksums kept, or dropped when checksums are off)."""
        entry = self._open.get(obj)
        if entry is not None:
            self._open.move_to_end(obj)
            if create and (entry.cfd is None) == self.checksums:
                self._writable_sidecar(obj, entry)
            return entry
        path = self.path(obj)
        flags = os.O_RDWR | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not create:
                return None
            parent = os.path.dirname(path)
            if parent not in self._made:
                os.makedirs(parent, exist_ok=True)
                self._made.add(parent)
                self._unsynced.add(os.path.dirname(parent))
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            self.objects += 1
            self._unsynced.add(parent)
        entry = _Open(fd)
        if self.checksums:
            try:
                entry.cfd = os.open(path + ck.SUFFIX, flags)
            except FileNotFoundError:
                pass  # new, or from before checksums: unchecked until written
        self._open[obj] = entry
        self._evict()
        if create and (entry.cfd is None) == self.checksums:
            self._writable_sidecar(obj, entry)
        return entry

    def _writable_sidecar(self, obj: ObjId, entry: _Open) -> None:
        """Before a write: an object without a sidecar gets one (an object from before
        checksums is hashed whole, once); with checksums off a sidecar is removed (it
        would go stale: the object reads unchecked)."""
        cpath = self.path(obj) + ck.SUFFIX
        if not self.checksums:
            try:
                os.unlink(cpath)
            except FileNotFoundError:
                pass
            if entry.cfd is not None and not entry.pins:
                os.close(entry.cfd)
                entry.cfd = None
            return
        cfd = os.open(cpath, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(entry.fd).st_size:
                dck.compute(entry.fd, cfd)
        except BaseException:
            os.close(cfd)
            raise
        entry.cfd = cfd

    def _evict(self) -> None:
        while len(self._open) > self.max_open:
            _obj, entry = self._open.popitem(last=False)
            self._drop(entry)

    @staticmethod
    def _drop(entry: _Open) -> None:
        if entry.pins:
            entry.dropped = True
        else:
            entry.close()

    def acquire(self, obj: ObjId, create: bool = False) -> tuple[int, Callable[[], None]] | None:
        """A pinned descriptor of ``obj`` (read-write) and the callable that unpins it;
        None when the object is absent and ``create`` is false."""
        got = self.acquire_checked(obj, create)
        return None if got is None else (got[0], got[2])

    def acquire_checked(self, obj: ObjId, create: bool = False
                        ) -> tuple[int, int | None, Callable[[], None]] | None:
        """As :meth:`acquire`, with the descriptor of the object's checksum sidecar
        (None: an unchecked object)."""
        entry = self._fd(obj, create)
        if entry is None:
            return None
        entry.pins += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            entry.pins -= 1
            if entry.dropped and not entry.pins:
                entry.close()

        return entry.fd, entry.cfd, release

    # -- chain records -------------------------------------------------------
    def chain_record(self, obj: ObjId) -> ChainRecord | None:
        """``(chain, version, sequence)`` of the last write this replica holds; None for
        an absent object or one never written through a chain."""
        entry = self._fd(obj, False)
        if entry is None:
            return None
        if entry.chain == _UNREAD:
            try:
                raw = os.getxattr(entry.fd, CHAIN_XATTR)
                entry.chain = _CHAIN_REC.unpack(raw) if len(raw) == _CHAIN_REC.size else None
            except OSError as exc:
                if exc.errno not in (errno.ENODATA, errno.ENOTSUP):
                    raise
                entry.chain = None
        return entry.chain

    def set_chain_record(self, obj: ObjId, rec: ChainRecord) -> None:
        """Record ``rec`` on the (existing) object; one ``fsetxattr`` when it changed."""
        entry = self._fd(obj, True)
        assert entry is not None
        if entry.chain == rec:
            return
        try:
            os.setxattr(entry.fd, CHAIN_XATTR, _CHAIN_REC.pack(*rec))
        except OSError as exc:
            if exc.errno != errno.ENOTSUP:
                raise
            if not self._warned_xattr:
                self._warned_xattr = True
                log.warning("data directories without user xattrs: chain versions are "
                            "kept in memory only (lost at a restart)")
        entry.chain = rec

    # -- operations ----------------------------------------------------------
    def size(self, obj: ObjId) -> int:
        entry = self._fd(obj, False)
        return 0 if entry is None else os.fstat(entry.fd).st_size

    def truncate(self, obj: ObjId, size: int) -> None:
        if size < 0:
            raise OSError(errno.EINVAL, f"negative size {size}")
        entry = self._fd(obj, size > 0)
        if entry is None:
            return
        if entry.cfd is not None:  # the new last block rehashed, blocks past the end dropped
            keep = ck.n_blocks(size)
            os.ftruncate(entry.cfd, keep * ck.RECORD)
            last = keep - 1
            if size % ck.BLOCK and last >= 0:
                (_crc, end), = ck.read_records(entry.cfd, last, 1)
                if end:
                    data = ck.read_block(entry.fd, last)[:size - last * ck.BLOCK]
                    write = min(end, size - last * ck.BLOCK)
                    ck.write_records(entry.cfd, last, [(ck.crc_padded(data), write)])
        os.ftruncate(entry.fd, size)

    def dirs_unsynced(self, dirs: list[str]) -> None:
        """``dirs`` taken by :meth:`take_unsynced_dirs` were not synced after all."""
        self._unsynced.update(dirs)

    def take_unsynced_dirs(self, obj: ObjId) -> list[str]:
        """Directories on ``obj``'s path that gained entries since they were last synced
        (outermost first); the caller fsyncs them so a new object survives a crash."""
        fanout = os.path.dirname(self.path(obj))
        out = [d for d in (os.path.dirname(fanout), fanout) if d in self._unsynced]
        self._unsynced.difference_update(out)
        return out

    def staging_path(self, obj: ObjId) -> str:
        """Where a repaired copy of ``obj`` is written before :meth:`replace` (a name no
        listing takes for an object); its fanout directory made."""
        path = self.path(obj)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path + ".repair"

    def stage_checksums(self, staged: str) -> None:
        """The checksums of the staged copy, beside it (synced). Touches no shared
        state: run it in a thread, then :meth:`replace` in the event loop."""
        if not self.checksums:
            return
        _compute_sidecar(staged, staged + "-map")

    def replace(self, obj: ObjId, staged: str, rec: ChainRecord | None) -> None:
        """Put the complete copy at ``staged`` (synced, its checksums staged) in place
        of ``obj`` with chain record ``rec``: renamed over the old files, so a reader sees
        the old replica or the new one, never a part (the caller holds its lock)."""
        path = self.path(obj)
        entry = self._open.pop(obj, None)
        if entry is not None:
            self._drop(entry)  # its descriptors name the old file
        if self.checksums:
            os.replace(staged + "-map", path + ck.SUFFIX)
        else:
            try:
                os.unlink(path + ck.SUFFIX)
            except FileNotFoundError:
                pass
        existed = os.path.lexists(path)
        os.replace(staged, path)
        if not existed:
            self.objects += 1
        self._unsynced.add(os.path.dirname(path))
        if rec is not None:
            self.set_chain_record(obj, rec)

    def exists(self, obj: ObjId) -> bool:
        """Whether ``obj`` has a file here (or the checksum map of a lost one)."""
        path = self.path(obj)
        return obj in self._open or os.path.lexists(path) or os.path.lexists(path + ck.SUFFIX)

    def delete(self, obj: ObjId) -> bool:
        """Remove ``obj``; False when it was absent."""
        entry = self._open.pop(obj, None)
        if entry is not None:
            self._drop(entry)
        path = self.path(obj)
        try:
            os.unlink(path + ck.SUFFIX)
        except FileNotFoundError:
            pass
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        self.objects -= 1
        return True

    def list_objects(self, after: ObjId | None, limit: int
                     ) -> tuple[list[tuple[int, int, int, int, int, int]], bool]:
        """The first ``limit`` objects after ``after`` in id order, as ``(ino, stripe,
        size, allocated bytes, written, holes)`` (the block map's summary,
        :func:`dck.map_summary`; size -1: the object file is gone, its map remains),
        and whether they were the last. Object files are placed by hash, so each page reads
        every directory's names (no stat but the page's): O(objects) a page, for
        ``pfs fsck``. Files not named ``<ino>.<stripe>`` (anything else kept beside
        the objects) are skipped. Synchronous: run it in a thread."""
        ids: list[tuple[ObjId, str]] = []  # where each was found (a misplaced one too)
        for d in self.dirs:
            for path, obj in dck.iter_objects(os.path.join(d, _OBJ_DIR), lost=True):
                if after is None or obj > after:
                    ids.append((obj, path))
                    if len(ids) > 2 * limit:  # bounded: keep the smallest as we go
                        ids = heapq.nsmallest(limit, ids)
        ids = heapq.nsmallest(limit, ids)
        out: list[tuple[int, int, int, int, int, int]] = []
        for obj, path in ids:
            written, holes = dck.map_summary(path + ck.SUFFIX)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # deleted since it was listed, or lost (map kept)
                if written < 0:
                    continue
                out.append((obj[0], obj[1], -1, 0, written, holes))
                continue
            out.append((obj[0], obj[1], st.st_size, st.st_blocks * 512, written, holes))
        return out, len(ids) < limit

    def capacity(self) -> Capacity:
        total = free = 0
        seen: set[int] = set()
        for d in self.dirs:
            dev = os.stat(d).st_dev
            if dev in seen:
                continue
            seen.add(dev)
            st = os.statvfs(d)
            total += st.f_blocks * st.f_frsize
            free += st.f_bavail * st.f_frsize
        return Capacity(total, free, self.objects)

    # -- identity ------------------------------------------------------------
    def load_sid(self) -> str | None:
        """The server id saved by :meth:`save_sid`, or None for a new server."""
        found: dict[str, str] = {}
        for d in self.dirs:
            path = os.path.join(d, SID_FILE)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read(MAX_SID_LEN + 1).strip()
            except FileNotFoundError:
                continue
            if text:
                found[d] = text
        sids = set(found.values())
        if len(sids) > 1:
            raise OSError(errno.EINVAL, f"data directories disagree on the server id: {found}; "
                                        f"they belong to different data servers")
        return sids.pop() if sids else None

    def save_sid(self, sid: str) -> None:
        """Write ``sid`` to every data directory (atomically: temporary file + rename)."""
        if not sid or len(sid) > MAX_SID_LEN or "\n" in sid:
            raise OSError(errno.EINVAL, f"unusable server id {sid!r}")
        for d in self.dirs:
            _write_file(d, SID_FILE, sid + "\n")

    def close(self) -> None:
        """Close every cached descriptor (pinned ones close on release)."""
        while self._open:
            _obj, entry = self._open.popitem(last=False)
            self._drop(entry)
