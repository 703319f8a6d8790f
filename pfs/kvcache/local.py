"""Short-circuit gets: blocks whose home is a data server on this host, read by the
client itself from the server's slab files, with no request per get.

The server publishes its KV index in shared memory (``dataserver/kvindex.py``; layout in
:mod:`pfs.core.kvformat`). Over the server's local Unix socket (as short-circuit file
reads, the same authentication) a client obtains, once, a read-only descriptor of that
index, and then of each slab as it first meets one (``kv_open``, SCM_RIGHTS). A get
hashes its key to a bucket of the index, and reads the record its slot names straight
into the caller's buffer (``preadv``), checking the record's head (magic, namespace, key,
length, sequence, the head's CRC) and the value's CRC32C. A hit sets the slot's byte
in a second shared map, the server's reference bits (its eviction keeps a record read
since it was written a round more, as it does for one read by request). Whatever does
not check out - a slot being rewritten, a slab evicted since (its descriptor still
reads the old, intact record, or is gone), a damaged record - asks the server
(``ASK``), which answers with the truth; a key absent from a complete index is a miss
(``MISS``). So a reader gets the key's bytes, a miss, or a round trip: never
another key's bytes or a torn block.

The index is trusted only while the server lives: its heartbeat must be under
``LIVE_FOR`` seconds old, its ``closed`` flag clear, and the local connection open (a
``poll``, at most every ``POLL_EVERY``: a server killed is noticed within a
millisecond). The server refuses ``kv_open`` over TCP and to a key that may not use
every namespace (a slab mixes namespaces).
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import select
import struct
import threading
import time

import trio

from pfs.core import kvformat as F
from pfs.core.auth import ClientAuth
from pfs.core.errors import ProtocolError, from_wire
from pfs.core.messages import kv as K
from pfs.core.messages.base import parse_reply
from pfs.core.wire.protocol import Kind
from pfs.core.wire.transport import Connection, local_socket_name, open_unix_connection

log = logging.getLogger(__name__)

MISS = 0  # get_into: the key is not at this server
ASK = -1  # get_into: ask the server (the index could not answer for sure)
_DEAD = select.POLLIN | select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
_BUCKET = F.WAYS * F.SLOT.size
MAX_FDS = 256  # slab descriptors held per server at most (the oldest go first)
PREFETCH = 16  # slab descriptors taken at connect time (the newest: the likeliest read)
POLL_EVERY = 0.001  # seconds: how stale "the connection is open" may be at a get
# the header's heartbeat, unpublished entries, lowest live slab and closed flag
_STATE = struct.Struct("<dQQI")
Slot = tuple[int, int, int, int, int]  # slot number, seq, slab id, offset, value length


class NeedSlab:
    """get_into: the record lies in a slab this client holds no descriptor of yet."""

    __slots__ = ("slab",)

    def __init__(self, slab: int) -> None:
        self.slab = slab


class LocalKv:
    """Short-circuit gets from one data server on this host; ``get_into`` is called
    from any thread, ``open_slab`` and ``close`` from the event loop's."""

    def __init__(self, sid: str, conn: Connection, index_fd: int,
                 live: list[int] | None = None, refs_fd: int = -1) -> None:
        self.sid = sid
        self.live = list(live or [])  # the server's slabs when the index was handed out
        self.conn = conn
        self.refs: mmap.mmap | None = None  # a byte per slot: set on a hit (kvindex.py)
        try:
            size = os.fstat(index_fd).st_size
            self.mm = mmap.mmap(index_fd, size, prot=mmap.PROT_READ)
            magic, version, buckets, ways, *_ = F.INDEX_HEAD.unpack_from(self.mm)
            if (magic != F.INDEX_MAGIC or version != F.INDEX_VERSION or ways != F.WAYS
                    or buckets & (buckets - 1) or F.index_size(buckets) > size):
                self.mm.close()
                raise OSError(errno.EPROTO, f"data server {sid}: a KV index of another "
                                            "format")
            if refs_fd >= 0:
                self.refs = _map_refs(refs_fd, buckets * F.WAYS)
        finally:
            os.close(index_fd)
            if refs_fd >= 0:
                os.close(refs_fd)
        self.mask = buckets - 1
        self.fds: dict[int, int] = {}  # slab id -> descriptor
        self._lock = threading.Lock()  # fds and _busy, from the callers' threads
        self._busy = 0  # reads in flight: descriptors are closed only when none is
        self._ask_lock = trio.Lock()
        self._asking = False  # a kv_open in flight: its reply makes the socket readable
        self._rid = 0
        self._sock = conn.sock.fileno()
        self._polls = threading.local()  # a poll object per thread (one is not shared)
        self._oldest = 0  # the lowest slab id held (0: none)
        self.dead = False
        self._complete = False  # no key left out of the index: an absent key is a miss
        self._poll_at = 0.0  # when the connection is polled next (monotonic seconds)
        self.counts = {"hits": 0, "misses": 0, "asks": 0, "slabs": 0}

    # -- liveness ------------------------------------------------------------------
    def _alive(self) -> bool:
        beat, unpublished, low, closed = _STATE.unpack_from(self.mm, F.HEARTBEAT_AT)
        now = time.monotonic()
        if closed or now - beat > F.LIVE_FOR or self.conn.closed:
            self.dead = True
        elif now >= self._poll_at and not self._asking:
            # the connection, at most every POLL_EVERY (a system call per get cost more
            # than the rest of a small get's bookkeeping)
            self._poll_at = now + POLL_EVERY
            if self._poller().poll(0):
                self.dead = True  # the server closed the connection: it stopped or died
        if self.dead:
            return False
        if 0 < self._oldest < low:
            self._reap(low)
        self._complete = not unpublished
        return True

    def _poller(self) -> select.poll:
        p: select.poll | None = getattr(self._polls, "p", None)
        if p is None:
            p = self._polls.p = select.poll()
            p.register(self._sock, _DEAD)
        return p

    def _held(self) -> None:
        """(under the lock) note the lowest slab id held."""
        self._oldest = min(self.fds) if self.fds else 0

    def _reap(self, low: int) -> None:
        """Close the descriptors of slabs the server evicted (their disk space is held
        while a descriptor is open), unless a read is using one now."""
        with self._lock:
            if self._busy:
                return
            old = [s for s in self.fds if s < low]
            fds = [self.fds.pop(s) for s in old]
            self._held()
        for fd in fds:
            os.close(fd)

    # -- the get -------------------------------------------------------------------
    def get_into(self, ns: bytes, key: bytes, out: memoryview) -> int | NeedSlab:
        """The value's length on a hit (read and checked into ``out``), ``MISS``,
        ``ASK`` (the server must answer), or ``NeedSlab`` (call :meth:`open_slab`)."""
        slot = self.lookup(ns, key)
        if isinstance(slot, int):
            return slot
        if slot[4] > len(out):
            return self._ask()  # the server's answer: ERANGE
        return self.read(slot, ns, key, out)

    def lookup(self, ns: bytes, key: bytes) -> int | Slot:
        """The key's slot in the index (a tuple: tag, seq, slab, offset, length), or
        MISS (absent from a complete index), or ASK."""
        if self.dead or not self._alive():
            return ASK
        tag = F.tag_of(ns, key)
        bucket = tag & self.mask
        base = F.INDEX_HEAD_SIZE + bucket * _BUCKET
        want = tag.to_bytes(8, "little")
        for _attempt in range(3):
            raw = self.mm[base:base + _BUCKET]
            torn = False
            at = raw.find(want)
            while at >= 0:
                if at % F.SLOT.size == 0:
                    if F.slot_ok(raw, at):
                        _tag, seq, slab, off, vlen, _crc = F.SLOT.unpack_from(raw, at)
                        return bucket * F.WAYS + at // F.SLOT.size, seq, slab, off, vlen
                    torn = True  # being rewritten: read the bucket again
                at = raw.find(want, at + 1)
            if not torn:
                break
        if torn or not self._complete:
            return self._ask()
        self.counts["misses"] += 1
        return MISS

    def read(self, slot: Slot, ns: bytes, key: bytes, out: memoryview) -> int | NeedSlab:
        """Read the record ``slot`` names into ``out`` and check it: its length, or
        ASK (it did not check out), or NeedSlab."""
        slotno, seq, slab, off, vlen = slot
        with self._lock:
            fd = self.fds.get(slab)
            if fd is None:
                return NeedSlab(slab)
            self._busy += 1
        try:
            ok = F.read_record(fd, off, ns, key, vlen, seq, out)
        except OSError as exc:  # a bad sector: the server decides (and drops it)
            log.debug("short-circuit read of slab %d at %d: %s", slab, off, exc)
            ok = False
        finally:
            with self._lock:
                self._busy -= 1
        if not ok:
            return self._ask()
        refs = self.refs
        if refs is not None and not refs[slotno]:
            refs[slotno] = 1  # referenced: the server's eviction keeps it a round more
        self.counts["hits"] += 1
        return vlen

    def _ask(self) -> int:
        self.counts["asks"] += 1
        return ASK

    # -- descriptors (event loop) --------------------------------------------------
    async def open_slab(self, slab: int) -> None:
        """Obtain the descriptor of ``slab`` (nothing if the server no longer has it:
        the next get of a key there asks the server)."""
        async with self._ask_lock:
            if slab in self.fds or self.dead:
                return
            try:
                fd = await self._open(slab)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.info("data server %s: slab %d not handed out (%s)", self.sid, slab,
                             exc)
                    self.dead = True
                return
            with self._lock:
                if len(self.fds) >= MAX_FDS and not self._busy:
                    oldest = min(self.fds)
                    os.close(self.fds.pop(oldest))
                kept = len(self.fds) < MAX_FDS
                if kept:
                    self.fds[slab] = fd
                self._held()
            if not kept:  # reads in flight: gets of keys there ask the server meanwhile
                os.close(fd)
                return
            self.counts["slabs"] += 1

    async def prefetch(self, n: int = PREFETCH) -> None:
        """Take the descriptors of the ``n`` newest slabs now, so that the first gets
        there need no round trip."""
        for slab in self.live[-n:]:
            await self.open_slab(slab)

    async def _open(self, slab: int) -> int:
        self._asking = True
        try:
            return (await kv_open(self.conn, self._next_rid(), slab))[0]
        except BaseException:
            self.dead = True  # a reply half-read leaves the stream out of step
            raise
        finally:
            self._asking = False

    def _next_rid(self) -> int:
        self._rid += 1
        return self._rid

    def close(self) -> None:
        self.dead = True
        with self._lock:
            fds, self.fds = list(self.fds.values()), {}
            self._held()
        for fd in fds:
            os.close(fd)
        self.mm.close()
        if self.refs is not None:
            self.refs.close()
        self.conn.close()


def _map_refs(fd: int, size: int) -> mmap.mmap | None:
    """The server's reference bytes, mapped read-write (None: of another size)."""
    try:
        if os.fstat(fd).st_size == size:
            return mmap.mmap(fd, size)
    except OSError as exc:
        log.info("KV reference bytes not mapped: %s", exc)
    return None


async def kv_open(conn: Connection, rid: int, slab: int) -> tuple[int, K.KvOpenReply]:
    """One ``kv_open`` over a local connection: the descriptor it hands out, and the
    reply."""
    fds, reply = await kv_open_all(conn, rid, slab)
    for extra in fds[1:]:
        os.close(extra)
    return fds[0], reply


async def kv_open_all(conn: Connection, rid: int, slab: int) -> tuple[list[int],
                                                                       K.KvOpenReply]:
    """One ``kv_open``: every descriptor it hands out (for the index: the index, and
    its reference bytes where the server has them), and the reply."""
    msg = K.KvOpen(slab=slab)
    await conn.send_frame(Kind.REQUEST, rid, msg.to_wire())
    head, fds = await conn.recv_frame_with_fds()
    if head.kind == Kind.ERROR or not fds:
        for fd in fds:
            os.close(fd)
        raise from_wire(head.fields.get("errno"), head.fields.get("msg"))
    try:
        reply: K.KvOpenReply = parse_reply(msg, head.fields)
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return fds, reply


async def connect_local(sid: str, auth: ClientAuth) -> LocalKv | None:
    """Short-circuit gets from data server ``sid`` if it runs on this host and hands its
    index to this client; None otherwise (not here, no index, refused)."""
    try:
        conn = await open_unix_connection(local_socket_name(sid))
    except OSError:  # no server of this id on this host
        return None
    try:
        await auth.hello(conn)
        fds, reply = await kv_open_all(conn, 1, 0)
    except (OSError, ProtocolError, trio.TooSlowError) as exc:
        conn.close()
        log.info("data server %s: no short-circuit KV gets (%s)", sid, exc)
        return None
    except BaseException:
        conn.close()
        raise
    try:
        for extra in fds[2:]:
            os.close(extra)
        local = LocalKv(sid, conn, fds[0], reply.slabs, fds[1] if len(fds) > 1 else -1)
    except OSError as exc:
        conn.close()
        log.info("data server %s: no short-circuit KV gets (%s)", sid, exc)
        return None
    local._rid = 1
    return local
