"""The node's shared host-memory tier: KV blocks in files under a directory on tmpfs
(``/dev/shm``), shared by every process of this user on the node.

The tensor-parallel workers of one engine all ask for the same blocks: one copy in the
page cache of tmpfs serves them all, where a per-process dictionary would keep one copy
per worker. A block is one file named by a hash of (namespace, key), written whole to a
temporary name and renamed in, so a reader sees an old block, the new one, or none, never
a torn one. The file starts with a header (magic, namespace, key, length, crc32c of the
value); a reader checks the namespace, key, length and crc, and anything that does not
match is a miss (and the file is dropped), never another key's bytes.

The tier is bounded (``budget`` bytes, all namespaces together) with LRU eviction by the
files' mtime, which a hit refreshes (each process at most once a second per block, by
its own clock: a hit on a block this process touched within the second costs no
system call beyond its open, read and close). No shared counter: each process counts the
bytes it wrote, and past ``slack`` of them it scans the directory and removes the least
recently used files down to 90% of the budget, under a lock file so one process trims at
a time. The tier may therefore overshoot by ``slack`` per writing process between scans;
a write that finds tmpfs full trims and is dropped (this tier is a cache: the block's
homes hold it).

The directory is private to its user (mode 0700, files 0600): blocks never leave the
cluster's credentials by way of this tier.

Speed: a hit is one ``open``, one ``preadv`` of header and value (the value straight into
the caller's buffer), the checks, one CRC32C of the value (:mod:`pfs.core.crcfast`:
about 60 GB/s where the CPU folds by VPCLMULQDQ, 30 by the crc32 instruction) and a
``close``. What bounds it is the kernel's copy out of tmpfs: a tmpfs mounted without
``huge=`` (``/dev/shm`` by default) holds files in 4 KiB pages and copies them out page
by page, about 3x slower than from a filesystem with large folios (ext4's page cache,
or a tmpfs mounted ``huge=within_size``). Point ``node_dir`` at such a tmpfs to read
at memory speed (the tier logs a hint at start when its folder is on tmpfs without it).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pfs.core import crcfast

log = logging.getLogger(__name__)

MAGIC = b"PKV1"
# magic, namespace length, key length, value length, crc32c of the value
_HEAD = struct.Struct("<4sBHQI")
TOUCH_EVERY = 1.0  # seconds: a hit refreshes a block's mtime at most this often
TOUCHED_KEPT = 1 << 16  # blocks whose last touch a process remembers (then it starts over)
PATHS_KEPT = 1 << 14  # blocks whose file name a process remembers (a hash each, ~0.7 us)
STALE_TMP = 60.0  # seconds: a temporary file older than this was left by a dead writer
LOW_WATER = 0.9  # a trim removes blocks down to this fraction of the budget


def default_dir() -> Path:
    """``/dev/shm/pfs-kv-UID`` (memory), or a folder under the temp dir without tmpfs."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get(
        "TMPDIR", "/tmp"))
    return base / f"pfs-kv-{os.getuid()}"


@dataclass
class TierUsage:
    """What a scan found: bytes and blocks held, and what the trim removed."""

    bytes: int = 0
    blocks: int = 0
    evicted: int = 0
    evicted_bytes: int = 0


class NodeTier:
    """Blocks in files under ``root``, at most about ``budget`` bytes."""

    def __init__(self, root: str | os.PathLike[str] | None, budget: int,
                 slack: int | None = None) -> None:
        if budget <= 0:
            raise ValueError("a node tier needs a budget above 0 bytes")
        self.root = Path(root) if root is not None else default_dir()
        self.budget = budget
        self.slack = slack if slack is not None else max(1 << 20, min(budget // 8, 64 << 20))
        self._written = 0  # bytes this process wrote since its last scan
        self._touched: dict[str, float] = {}  # path -> when this process last touched it
        self._paths: dict[tuple[str, bytes], str] = {}  # (namespace, key) -> its file
        self._lock = threading.Lock()  # the sync API is called from many threads
        self.hits = self.misses = self.puts = self.evictions = self.corrupt = 0
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.root.stat()
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise OSError(errno.EACCES, f"{self.root}: the node tier's folder must be this "
                                        "user's own, mode 0700")
        for i in range(256):
            (self.root / f"{i:02x}").mkdir(mode=0o700, exist_ok=True)
        _hint_if_small_pages(self.root)

    # -- names ------------------------------------------------------------------
    def path(self, ns: str, key: bytes) -> str:
        got = self._paths.get((ns, key))
        if got is None:
            h = hashlib.blake2b(ns.encode() + b"\0" + key, digest_size=16).hexdigest()
            got = f"{self.root}/{h[:2]}/{h}"
            if len(self._paths) >= PATHS_KEPT:
                self._paths.clear()  # (from any thread: each step is one atomic dict op)
            self._paths[ns, key] = got
        return got

    @staticmethod
    def header(ns: str, key: bytes, length: int, crc: int) -> bytes:
        nsb = ns.encode()
        return _HEAD.pack(MAGIC, len(nsb), len(key), length, crc) + nsb + key

    # -- blocks -----------------------------------------------------------------
    def put(self, ns: str, key: bytes, value: memoryview, crc: int | None = None) -> bool:
        """Store a block (``crc``: crc32c of ``value`` when the caller has it). False
        when tmpfs is full (the block is not held; nothing else changes)."""
        if crc is None:
            crc = crcfast.crc32c(value)
        path = self.path(ns, key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        head = self.header(ns, key, len(value), crc)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, [head, value])
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as exc:
            _unlink(tmp)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.warning("node tier %s is full: trimming, block not kept", self.root)
            self.trim(force=True)
            return False
        self.puts += 1
        with self._lock:
            self._written += len(head) + len(value)
            due = self._written >= self.slack
        if due:
            self.trim()
        return True

    def get_into(self, ns: str, key: bytes, out: memoryview) -> int | None:
        """Read the block into ``out``; its length, or None (a miss: absent, or what
        was there did not check out). A block longer than ``out``: ERANGE."""
        path = self.path(ns, key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self.misses += 1
            return None
        try:
            head = bytearray(_HEAD.size + len(ns.encode()) + len(key))
            got = os.preadv(fd, [head, out], 0)
            found = self._check(fd, path, ns, key, head, got, len(out))
            if found is None:
                self.misses += 1
                return None
            n, crc = found
            if crcfast.crc32c(out[:n]) != crc:
                self._drop(fd, path, "crc mismatch")
                self.misses += 1
                return None
            now = time.monotonic()
            touched = self._touched
            if now - touched.get(path, -TOUCH_EVERY) > TOUCH_EVERY:
                os.utime(fd)  # recently used: the LRU's clock
                if len(touched) >= TOUCHED_KEPT:
                    touched.clear()  # (from any thread: each step is one atomic dict op)
                touched[path] = now
        finally:
            os.close(fd)
        self.hits += 1
        return n

    def _check(self, fd: int, path: str, ns: str, key: bytes, head: bytearray, got: int,
               room: int) -> tuple[int, int] | None:
        if got < len(head):
            self._drop(fd, path, "short header")
            return None
        magic, nslen, keylen, length, crc = _HEAD.unpack_from(head)
        nsb = ns.encode()
        if (magic != MAGIC or nslen != len(nsb) or keylen != len(key)
                or head[_HEAD.size:_HEAD.size + nslen] != nsb
                or head[_HEAD.size + nslen:] != key):
            # another (namespace, key) with the same hash, or a damaged header: a miss
            # (not dropped: a colliding block is some other key's to keep)
            return None
        if length > room:
            raise OSError(errno.ERANGE, f"KV block is {length} bytes, the buffer holds "
                                          f"{room}")
        if got - len(head) < length:
            self._drop(fd, path, "short value")
            return None
        return int(length), int(crc)

    def _drop(self, fd: int, path: str, why: str) -> None:
        """Remove a damaged block, unless a writer replaced it meanwhile."""
        self.corrupt += 1
        log.warning("node tier: %s: %s; dropped", path, why)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except FileNotFoundError:
            pass

    def exists(self, ns: str, key: bytes) -> bool:
        return os.path.exists(self.path(ns, key))

    def remove(self, ns: str, keys: Iterable[bytes]) -> int:
        n = 0
        for key in keys:
            n += _unlink(self.path(ns, key))
        return n

    # -- the budget ---------------------------------------------------------------
    def usage(self) -> TierUsage:
        """Bytes and blocks held now (a scan)."""
        u = TierUsage()
        for _mtime, size, _path in self._scan(time.time()):
            u.bytes += size
            u.blocks += 1
        return u

    def trim(self, force: bool = False) -> TierUsage:
        """Scan, and remove the least recently used blocks while over the budget (down
        to LOW_WATER of it; ``force``: down to LOW_WATER of what is held). One process
        trims at a time; the others skip."""
        with self._lock:
            self._written = 0
        u = TierUsage()
        lock = os.open(self.root / ".trim", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return u  # another process is trimming
            files = self._scan(time.time())
            u.bytes = sum(f[1] for f in files)
            u.blocks = len(files)
            limit = self.budget if not force else min(self.budget, u.bytes)
            if u.bytes <= limit and not force:
                return u
            target = int(limit * LOW_WATER)
            files.sort()
            for _mtime, size, path in files:
                if u.bytes <= target:
                    break
                if _unlink(path):
                    u.bytes -= size
                    u.blocks -= 1
                    u.evicted += 1
                    u.evicted_bytes += size
            self.evictions += u.evicted
            if u.evicted:
                log.debug("node tier: evicted %d blocks (%d bytes)", u.evicted, u.evicted_bytes)
            return u
        finally:
            os.close(lock)

    def _scan(self, now: float) -> list[tuple[float, int, str]]:
        out = []
        for i in range(256):
            try:
                entries = list(os.scandir(self.root / f"{i:02x}"))
            except FileNotFoundError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if e.name.endswith(".tmp"):
                    if now - st.st_mtime > STALE_TMP:
                        _unlink(e.path)
                    continue
                out.append((st.st_mtime, st.st_size, e.path))
        return out

    def clear(self) -> None:
        """Remove every block (tests, ``pfs admin kv --clear-node``)."""
        for _mtime, _size, path in self._scan(time.time()):
            _unlink(path)


def tmpfs_page_mode(path: str | os.PathLike[str], mountinfo: str | None = None
                    ) -> str | None:
    """The ``huge=`` option of the tmpfs holding ``path`` ("never" when unset), or None
    when ``path`` is not on tmpfs (or the mount table cannot be read). ``mountinfo``:
    the text of ``/proc/self/mountinfo`` (read when not given)."""
    real = os.path.realpath(path)
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    best: tuple[int, str, str] | None = None
    for line in mountinfo.splitlines():
        pre, _sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mnt = fields[4].replace("\\040", " ")
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and (best is None or len(mnt) >= best[0]):
            best = (len(mnt), tail[0], tail[2])
    if best is None or best[1] != "tmpfs":
        return None
    for opt in best[2].split(","):
        if opt.startswith("huge="):
            return opt[len("huge="):]
    return "never"


def _hint_if_small_pages(root: Path) -> None:
    if tmpfs_page_mode(root) in ("never", "deny"):
        log.info("node tier %s is on a tmpfs without huge pages: hits copy 4 KiB pages one "
                 "by one (about 3x slower than a tmpfs mounted huge=within_size)", root)


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
