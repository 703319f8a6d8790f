"""The KV-cache API: blocks put once, fetched by every node (``AsyncKVCache`` on trio,
``KVCache`` its blocking twin).

A get looks in the node's shared memory tier (:mod:`pfs.kvcache.nodetier`), then at the
block's homes - a home on this host read by the client itself from the server's slabs
(short-circuit, :mod:`pfs.kvcache.local`), any other (:mod:`pfs.kvcache.homes` over :mod:`pfs.kvcache.pool`); a hit at a home
fills the node tier (read-through), so the next get on this node is local. A put writes
the node tier and, by default (``sync=True``), the block's homes before it returns: the
block is then visible to every node. ``sync=False`` returns once the node tier holds it
(and a copy is queued); :meth:`flush` waits for the homes. No call asks the metaserver:
the pool is refreshed on a timer and after a server fails to answer.

An evicted, lost or damaged block is a miss, never an error and never another key's
bytes; a home that does not answer is a miss too (the next-ranked home serves its keys
until it is back). Bad input raises at once: keys are 1..256 bytes, values 1 B..64 MiB,
namespaces 1..128 characters of ``[A-Za-z0-9._:-]``.
"""
from __future__ import annotations

import errno
import logging
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import trio

from pfs.client import device
from pfs.client.aio import AsyncClient
from pfs.client.data import run_all
from pfs.client.sync import _Loop
from pfs.core import crcfast, metrics
from pfs.core.auth import ClientAuth
from pfs.core.config import client_config
from pfs.kvcache.direct import DirectKv
from pfs.kvcache.local import ASK, MISS, LocalKv, NeedSlab, connect_local
from pfs.kvcache.nodetier import NodeTier
from pfs.kvcache.pool import SKIP, BlockStore, Connect, Lookup, Pool
from pfs.kvcache.remote import KvServerClient

T = TypeVar("T")
log = logging.getLogger(__name__)

MAX_KEY = 256
MAX_VALUE = 64 << 20
NODE_TIER_BYTES = 1 << 30  # the node tier's default budget
REFRESH = 30.0  # seconds between two reads of the pool from the metaserver
BACKGROUND_BYTES = 256 << 20  # bytes of sync=False puts queued before a put waits
PARALLEL = 32  # requests of one batch in flight at once
THREAD_BYTES = 1 << 20  # the async client moves node-tier blocks this large in a thread
LOCAL_RETRY = 5.0  # seconds before a home with no short-circuit is asked again
LOCAL_SETUP = 5.0  # seconds start() waits for the short-circuits to the pool's servers
_NS = re.compile(r"[A-Za-z0-9._:-]{1,128}")


# -- input checks ---------------------------------------------------------------------
def check_ns(ns: str) -> str:
    if not isinstance(ns, str) or not _NS.fullmatch(ns):
        raise OSError(errno.EINVAL, f"KV namespace {ns!r}: 1..128 characters of "
                                    "[A-Za-z0-9._:-]")
    return ns


def check_key(key: Any) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"a KV key is bytes, not {type(key).__name__}")
    key = bytes(key)
    if not 1 <= len(key) <= MAX_KEY:
        raise OSError(errno.EINVAL, f"KV key of {len(key)} bytes: keys are 1..{MAX_KEY} "
                                    "bytes")
    return key


def host_view(buf: Any, what: str) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"the {what} buffer ({type(buf).__name__}) is not a buffer") from None
    if not view.c_contiguous:
        raise OSError(errno.EINVAL, f"the {what} buffer is not contiguous")
    return view.cast("B")


def check_value(n: int, what: str) -> None:
    if not 1 <= n <= MAX_VALUE:
        raise OSError(errno.EMSGSIZE if n else errno.EINVAL,
                      f"KV {what} of {n} bytes: blocks are 1 B..{MAX_VALUE >> 20} MiB")


# -- the async client -----------------------------------------------------------------

def _whole_block(key: Any, n: int | None, out: Any) -> bool:
    """``get``'s answer from ``get_into``'s: a hit must fill ``out`` exactly (EINVAL
    otherwise: a layout mismatch between the writer and this reader)."""
    if n is None:
        return False
    size = device.buffer_size(out)
    if n != size:
        raise OSError(errno.EINVAL, f"KV block {bytes(check_key(key)).hex()[:32]} is {n} "
                                    f"bytes, the buffer {size}")
    return True

class AsyncKVCache:
    """KV blocks of one namespace. Make one with :meth:`open` (an async context)."""

    def __init__(self, nursery: trio.Nursery, namespace: str, lookup: Lookup,
                 connect: Connect, *, node_tier: NodeTier | None = None, replicas: int = 1,
                 pin: bool = False, refresh: float = REFRESH,
                 background_bytes: int = BACKGROUND_BYTES) -> None:
        self.ns = check_ns(namespace)
        if replicas < 1:
            raise OSError(errno.EINVAL, f"KV replicas must be at least 1, not {replicas}")
        self.replicas = replicas
        self.pin = pin
        self.node = node_tier
        self.pool = Pool(lookup, connect)
        self._nursery = nursery
        self._refresh = refresh
        self._bg_limit = background_bytes
        self._bg_bytes = 0
        self._bg_count = 0
        self._bg_changed = trio.Condition()
        self._bg_lock = threading.Lock()
        self._bg_errors: list[OSError] = []
        self._slots = trio.Semaphore(PARALLEL)
        self._copies: device.Copies | None = None
        self.on_close: list[Callable[[], None]] = []  # what else closes with the cache
        # the blocking twin's route to the homes from its callers' threads (None: through
        # the event loop only)
        self.direct: DirectKv | None = None
        # short-circuit gets from homes on this host (None: off; make_cache sets it)
        self.local_auth: ClientAuth | None = None
        self.locals: dict[str, LocalKv | None] = {}
        self._local_at: dict[str, float] = {}  # sid -> when it may be tried again
        self._local_lock = trio.Lock()
        self.counts: dict[str, int] = dict.fromkeys(
            ("puts", "put_bytes", "gets", "node_hits", "local_hits", "remote_hits",
             "misses", "get_bytes", "remote_errors", "background_failed"), 0)
        self.closed = False

    @classmethod
    @asynccontextmanager
    async def open(cls, config: Any = None, namespace: str = "default", *,
                   meta: str | None = None, **kw: Any) -> AsyncIterator[AsyncKVCache]:
        """A cache on the cluster of ``config`` (a client config, as :func:`pfs.connect`);
        options as :func:`make_cache`."""
        async with trio.open_nursery() as nursery:
            kv = make_cache(nursery, config, namespace, meta=meta, **kw)
            try:
                await kv.start()
                yield kv
            finally:
                with trio.move_on_after(30, shield=True):
                    await kv.aclose()
                nursery.cancel_scope.cancel()

    async def start(self) -> None:
        """Read the pool, and keep it fresh on a timer."""
        await self.pool.refresh()
        if not len(self.pool.addrs):
            log.warning("KV cache: no data server with a KV budget in the pool")
        if self.local_auth is not None:  # the first gets find them ready
            with trio.move_on_after(LOCAL_SETUP):
                async with trio.open_nursery() as nursery:
                    for sid in self.pool.addrs:
                        nursery.start_soon(self._setup_local, sid)
        if self._refresh > 0 and math.isfinite(self._refresh):
            self._nursery.start_soon(self._refresher, name="pfs-kv-refresh")

    async def _refresher(self) -> None:
        while not self.closed:
            await trio.sleep(self._refresh)
            await self.pool.refresh_soon()

    # -- put ------------------------------------------------------------------------
    async def put(self, key: Any, buf: Any, *, sync: bool = True,
                  pin: bool | None = None) -> None:
        """Store ``buf`` (host bytes, or a GPU buffer) under ``key``. ``sync=True``:
        returns once the block's homes hold it (visible to every node); ``sync=False``:
        once this node's tier holds it, the homes later (:meth:`flush` waits). ``pin``:
        the homes evict it only when nothing unpinned is left (a hot prefix; default:
        the cache's ``pin``)."""
        k, view = self._put_args(key, buf)
        if self.node is not None:
            await self._node_put(k, view)
        await self._put_after_node(k, view, sync, self.pin if pin is None else pin)

    async def _node_put(self, k: bytes, view: memoryview) -> None:
        assert self.node is not None
        if len(view) >= THREAD_BYTES:  # keep the event loop free of long copies
            await trio.to_thread.run_sync(self.node.put, self.ns, k, view)
        else:
            self.node.put(self.ns, k, view)

    def _put_args(self, key: Any, buf: Any) -> tuple[bytes, memoryview]:
        self._open()
        k = check_key(key)
        if device.is_device_buffer(buf):
            dev = _ro_buffer(buf) if _readonly(buf) else device.device_buffer(buf)
            check_value(dev.nbytes, "value")
            host = bytearray(dev.nbytes)
            self._device_copies().d2h(memoryview(host), dev.ptr)
            return k, memoryview(host)
        view = host_view(buf, "value")
        check_value(len(view), "value")
        return k, view

    async def _put_after_node(self, k: bytes, view: memoryview, sync: bool,
                              pin: bool) -> None:
        self.counts["puts"] += 1
        self.counts["put_bytes"] += len(view)
        if sync:
            await self._put_remote(k, view, pin)
            return
        data = bytes(view)  # the caller may reuse its buffer once put returns
        async with self._bg_changed:
            while not self._reserve(len(data)):
                await self._bg_changed.wait()
        self._nursery.start_soon(self._background, k, data, pin)

    def _reserve(self, n: int) -> bool:
        """Count ``n`` bytes into the background queue unless that would pass its bound
        (an empty queue takes any block). From any thread: the blocking twin queues
        from its callers' threads."""
        with self._bg_lock:
            if self._bg_bytes and self._bg_bytes + n > self._bg_limit:
                return False
            self._bg_bytes += n
            self._bg_count += 1
            return True

    async def _background(self, k: bytes, data: bytes, pin: bool) -> None:
        try:
            await self._put_remote(k, memoryview(data), pin)
        except OSError as exc:
            self.counts["background_failed"] += 1
            self._bg_errors.append(exc)
            log.warning("KV put of a %d-byte block (sync=False) failed: %s", len(data), exc)
        finally:
            with self._bg_lock:
                self._bg_bytes -= len(data)
                self._bg_count -= 1
            async with self._bg_changed:
                self._bg_changed.notify_all()

    async def _put_remote(self, k: bytes, view: memoryview, pin: bool) -> None:
        for attempt in range(2):
            homes = self._homes(k)
            if not homes:
                await self.pool.refresh_soon()
                homes = self._homes(k)
                if not homes:
                    raise OSError(errno.EHOSTUNREACH, "KV put: no data server with a KV "
                                                      "budget is up")
            failed: list[tuple[str, OSError]] = []
            await run_all([partial(self._put_home, s, k, view, pin, failed) for s in homes])
            if not failed:
                metrics.kv_op("put", "remote", "ok", len(view))
                return
            for sid, exc in failed:
                self.pool.mark_down(sid, exc)
            self.counts["remote_errors"] += len(failed)
            if len(failed) < len(homes):
                return  # stored at a home that answered; the others catch up on refill
            await self.pool.refresh_soon()
            if attempt:
                sid, exc = failed[0]
                raise OSError(exc.errno, f"KV put: home {sid} did not answer: "
                                         f"{exc.strerror or exc}")
        raise AssertionError("unreachable")

    async def _put_home(self, sid: str, k: bytes, view: memoryview, pin: bool,
                        failed: list[tuple[str, OSError]]) -> None:
        try:
            async with self._slots:
                await self.pool.store(sid).put(self.ns, k, view, pin=pin)
        except OSError as exc:
            if exc.errno not in SKIP:
                raise
            failed.append((sid, exc))

    async def put_batch(self, keys: Sequence[Any], bufs: Sequence[Any], *,
                        sync: bool = True, pin: bool | None = None) -> None:
        """Put each block (concurrently at their homes); as :meth:`put`."""
        if len(keys) != len(bufs):
            raise OSError(errno.EINVAL, f"put_batch: {len(keys)} keys, {len(bufs)} buffers")
        args = [self._put_args(k, b) for k, b in zip(keys, bufs, strict=True)]
        for k, view in args:
            if self.node is not None:
                await self._node_put(k, view)
        pinned = self.pin if pin is None else pin
        await _all([partial(self._put_after_node, k, v, sync, pinned) for k, v in args])

    async def flush(self) -> None:
        """Wait for every ``sync=False`` put so far to reach its homes; raises the
        first failure since the last flush (the blocks stay in the node tier)."""
        async with self._bg_changed:
            while self._bg_count:
                await self._bg_changed.wait()
        if self._bg_errors:
            errs, self._bg_errors = self._bg_errors, []
            raise OSError(errs[0].errno, f"{len(errs)} KV puts (sync=False) did not reach "
                                         f"their homes; first: {errs[0].strerror or errs[0]}")

    # -- get ------------------------------------------------------------------------
    async def get(self, key: Any, out: Any) -> bool:
        """Fill ``out`` (host or GPU buffer) with the block of ``key``: True on a hit.
        The block must be exactly ``out``'s size (EINVAL otherwise: a layout mismatch)."""
        return _whole_block(key, await self.get_into(key, out), out)

    async def get_into(self, key: Any, out: Any, *, node_checked: bool = False) -> int | None:
        """Fill the start of ``out`` with the block: its length, or None on a miss.
        ERANGE when the block is larger than ``out``."""
        self._open()
        k = check_key(key)
        if device.is_device_buffer(out):
            dev = device.device_buffer(out)
            host = bytearray(dev.nbytes)
            n = await self.get_into(k, host)
            if n is not None:
                self._device_copies().h2d(dev.ptr, memoryview(host)[:n])
            return n
        view = host_view(out, "output")
        if view.readonly:
            raise OSError(errno.EINVAL, "KV get into a read-only buffer")
        self.counts["gets"] += 1
        if self.node is not None and not node_checked:
            if len(view) >= THREAD_BYTES:  # keep the event loop free of long copies
                n = await trio.to_thread.run_sync(self.node.get_into, self.ns, k, view)
            else:
                n = self.node.get_into(self.ns, k, view)
            if n is not None:
                self.counts["node_hits"] += 1
                self.counts["get_bytes"] += n
                metrics.kv_op("get", "node", "hit", n)
                return n
        return await self._get_remote(k, view)

    async def _get_remote(self, k: bytes, view: memoryview) -> int | None:
        self.pool.expire_down()
        for sid in self._homes(k):
            got = await self._get_local(sid, k, view)
            if got > 0:
                if self.node is not None:
                    await self._node_put(k, view[:got])  # read-through: into DRAM
                return got
            if got == MISS:
                continue
            try:
                async with self._slots:
                    n = await self.pool.store(sid).get_into(self.ns, k, view)
            except OSError as exc:
                if exc.errno == errno.EIO:  # damaged on the way: a miss here, never bytes
                    log.warning("KV get from %s: %s", sid, exc)
                    self.counts["remote_errors"] += 1
                    continue
                if exc.errno not in SKIP:
                    raise
                self.counts["remote_errors"] += 1
                self.pool.mark_down(sid, exc)
                self._nursery.start_soon(self.pool.refresh_soon)
                continue
            if n is not None:
                self.counts["remote_hits"] += 1
                self.counts["get_bytes"] += n
                metrics.kv_op("get", "remote", "hit", n)
                if self.node is not None:
                    await self._node_put(k, view[:n])  # read-through
                return n
        self.counts["misses"] += 1
        metrics.kv_op("get", "remote", "miss")
        return None

    # -- short-circuit gets ---------------------------------------------------------
    def local_due(self, sid: str) -> bool:
        """Whether :meth:`local` should (re)connect to ``sid`` now."""
        lk = self.locals.get(sid)
        if lk is not None and not lk.dead:
            return False
        return self.local_auth is not None and time.monotonic() >= self._local_at.get(sid, 0)

    async def local(self, sid: str) -> LocalKv | None:
        """Short-circuit gets from home ``sid`` if it is on this host (and hands out its
        index), connected on first use, again after it died, and retried every
        LOCAL_RETRY seconds when it is not."""
        if not self.local_due(sid):
            lk = self.locals.get(sid)
            return lk if lk is not None and not lk.dead else None
        async with self._local_lock:
            if not self.local_due(sid):
                return self.locals.get(sid)
            old = self.locals.pop(sid, None)
            if old is not None:
                old.close()
            assert self.local_auth is not None
            lk = await connect_local(sid, self.local_auth)
            self.locals[sid] = lk
            self._local_at[sid] = time.monotonic() + LOCAL_RETRY
            return lk

    async def _setup_local(self, sid: str) -> None:
        lk = await self.local(sid)
        if lk is not None:
            await lk.prefetch()

    async def _get_local(self, sid: str, k: bytes, view: memoryview) -> int:
        """A short-circuit get from home ``sid``: the length (a hit), MISS, or ASK."""
        lk = await self.local(sid)
        if lk is None:
            return ASK
        nsb = self.ns.encode()
        for _ in range(2):
            if len(view) >= THREAD_BYTES:
                got = await trio.to_thread.run_sync(lk.get_into, nsb, k, view)
            else:
                got = lk.get_into(nsb, k, view)
            if not isinstance(got, NeedSlab):
                break
            await lk.open_slab(got.slab)
        else:
            return ASK
        return self.count_local(got)

    def count_local(self, got: int) -> int:
        if got > 0:
            self.counts["local_hits"] += 1
            self.counts["get_bytes"] += got
            metrics.kv_op("get", "local", "hit", got)
        return got

    async def get_batch(self, keys: Sequence[Any], outs: Sequence[Any]) -> list[bool]:
        if len(keys) != len(outs):
            raise OSError(errno.EINVAL, f"get_batch: {len(keys)} keys, {len(outs)} buffers")
        found = [False] * len(keys)

        async def one(i: int) -> None:
            found[i] = await self.get(keys[i], outs[i])

        await _all([partial(one, i) for i in range(len(keys))])
        return found

    # -- exists / remove ------------------------------------------------------------
    async def exists(self, keys: Sequence[Any]) -> int:
        """How many leading keys of the prefix chain ``keys`` are held (node tier or
        homes): a chain with a hole counts up to the hole."""
        self._open()
        ks = [check_key(k) for k in keys]
        i = 0
        if self.node is not None:
            while i < len(ks) and self.node.exists(self.ns, ks[i]):
                i += 1
        if i == len(ks):
            return i
        rest = ks[i:]
        present = await self._exists_remote(rest)
        for p in present:
            if not p:
                break
            i += 1
        return i

    async def _exists_remote(self, keys: list[bytes]) -> list[bool]:
        self.pool.expire_down()
        by_home: dict[str, list[int]] = {}
        present = [False] * len(keys)
        nsb = self.ns.encode()
        for i, k in enumerate(keys):
            homes = self._homes(k)
            if not homes:
                continue
            lk = await self.local(homes[0])
            if lk is not None:  # a home on this host: its published index answers
                got = lk.lookup(nsb, k)
                if got != ASK:
                    present[i] = got != MISS
                    continue
            by_home.setdefault(homes[0], []).append(i)

        async def ask(sid: str, idx: list[int]) -> None:
            try:
                async with self._slots:
                    got = await self.pool.store(sid).exists(self.ns, [keys[i] for i in idx])
            except OSError as exc:
                if exc.errno not in SKIP:
                    raise
                self.counts["remote_errors"] += 1
                self.pool.mark_down(sid, exc)
                return
            for i, p in zip(idx, got, strict=True):
                present[i] = bool(p)

        await _all([partial(ask, s, x) for s, x in by_home.items()])
        return present

    async def remove(self, keys: Sequence[Any]) -> int:
        """Remove blocks from this node's tier and from their homes; returns how many
        the homes held. Other nodes' tiers keep their copies until evicted (a key names
        one value: a copy left there is still that key's bytes)."""
        self._open()
        ks = [check_key(k) for k in keys]
        if self.node is not None:
            self.node.remove(self.ns, ks)
        by_home: dict[str, list[bytes]] = {}
        firsts: set[tuple[str, bytes]] = set()
        for k in ks:
            for j, sid in enumerate(self._homes(k)):
                by_home.setdefault(sid, []).append(k)
                if j == 0:
                    firsts.add((sid, k))
        removed = 0

        async def drop(sid: str, batch: list[bytes]) -> None:
            nonlocal removed
            try:
                n = await self.pool.store(sid).remove(self.ns, batch)
            except OSError as exc:
                if exc.errno not in SKIP:
                    raise
                self.pool.mark_down(sid, exc)
                return
            if all((sid, k) in firsts for k in batch):
                removed += n

        await _all([partial(drop, s, b) for s, b in by_home.items()])
        metrics.kv_op("remove", "remote", "ok")
        return removed

    async def server_stats(self) -> dict[str, dict[str, Any]]:
        """Each pool server's KV counters (its ``KvStats``)."""
        out: dict[str, dict[str, Any]] = {}

        async def ask(sid: str) -> None:
            try:
                out[sid] = dict(await self.pool.store(sid).stats())
            except OSError as exc:
                if exc.errno not in SKIP:
                    raise
                out[sid] = {"error": str(exc)}

        await _all([partial(ask, s) for s in self.pool.addrs])
        return out

    def stats(self) -> dict[str, Any]:
        """This client's counters, and its node tier's."""
        out: dict[str, Any] = dict(self.counts)
        if self.node is not None:
            out.update(node_puts=self.node.puts, node_evictions=self.node.evictions,
                       node_corrupt=self.node.corrupt)
        out["local_servers"] = sorted(s for s, lk in self.locals.items() if lk is not None)
        out["pool"] = len(self.pool.addrs)
        return out

    # -- plumbing -------------------------------------------------------------------
    def _homes(self, k: bytes) -> list[str]:
        return self.pool.homes.homes(self.ns, k, self.replicas)

    def _open(self) -> None:
        if self.closed:
            raise ValueError("KV cache is closed")

    def _device_copies(self) -> device.Copies:
        if self._copies is None:
            self._copies = device.Copies(device.require_staging())
        return self._copies

    async def aclose(self) -> None:
        """Wait for the queued puts (failures logged), then close the connections."""
        if self.closed:
            return
        try:
            await self.flush()
        except OSError as exc:
            log.warning("closing the KV cache: %s", exc)
        self.closed = True
        for lk in self.locals.values():
            if lk is not None:
                lk.close()
        self.locals.clear()
        self.pool.close()
        for close in self.on_close:
            close()


def _readonly(buf: Any) -> bool:
    return bool(buf.__cuda_array_interface__["data"][1])


def _ro_buffer(buf: Any) -> device.DeviceBuffer:
    """A read-only device buffer is fine to put from (device_buffer refuses it for reads)."""
    cai = dict(buf.__cuda_array_interface__)
    cai["data"] = (cai["data"][0], False)

    class _View:
        __cuda_array_interface__ = cai

    return device.device_buffer(_View())


def make_cache(nursery: trio.Nursery, config: Any = None, namespace: str = "default", *,
               meta: str | None = None, node_tier_bytes: int = NODE_TIER_BYTES,
               node_dir: str | None = None, short_circuit: bool | None = None,
               **kw: Any) -> AsyncKVCache:
    """An AsyncKVCache in ``nursery`` (not started) on the cluster of ``config``: the
    pool from its metaserver, blocks over the data connections' credentials.
    ``node_tier_bytes=0``: no node tier; ``node_dir``: its folder (default
    ``/dev/shm/pfs-kv-UID``); ``short_circuit``: read blocks whose home is on this host
    from its slabs (default: the config's ``short_circuit``); ``replicas``, ``pin``, ``refresh``: as AsyncKVCache."""
    cfg = client_config(config, meta)
    check_ns(namespace)
    node = NodeTier(node_dir, node_tier_bytes) if node_tier_bytes > 0 else None
    fs = AsyncClient(cfg, nursery)

    def connect(sid: str, host: str, port: int) -> BlockStore:
        return KvServerClient(nursery, host, port, auth=fs.data_auth, timeout=cfg.timeout)

    kv = AsyncKVCache(nursery, namespace, fs.meta.servers, connect, node_tier=node, **kw)
    kv.direct = DirectKv(fs.data_auth, lambda sid: kv.pool.addrs.get(sid), cfg.timeout)
    if cfg.short_circuit if short_circuit is None else short_circuit:
        kv.local_auth = fs.data_auth
    kv.on_close += [fs.close, kv.direct.close]
    return kv


async def _all(jobs: list[Callable[[], Awaitable[Any]]]) -> None:
    if jobs:
        await run_all(jobs)


# -- the blocking client --------------------------------------------------------------
class KVCache:
    """The blocking KV cache: node-tier hits are served in the calling thread (no hop to
    the event loop); whatever needs the network runs on a private trio thread."""

    def __init__(self, config: Any = None, namespace: str = "default", *,
                 meta: str | None = None, **kw: Any) -> None:
        """As :func:`make_cache` (``node_tier_bytes``, ``node_dir``, ``replicas``, ...)."""
        self._start(lambda nursery: make_cache(nursery, config, namespace, meta=meta, **kw))

    @classmethod
    def over(cls, make: Callable[[trio.Nursery], AsyncKVCache]) -> KVCache:
        """A blocking cache over the AsyncKVCache ``make(nursery)`` builds (tests, other
        pools)."""
        self = cls.__new__(cls)
        self._start(make)
        return self

    def _start(self, make: Callable[[trio.Nursery], AsyncKVCache]) -> None:
        self._loop = _Loop()
        try:
            async def build() -> AsyncKVCache:
                assert self._loop.nursery is not None
                kv = make(self._loop.nursery)
                try:
                    await kv.start()
                except BaseException:
                    await kv.aclose()
                    raise
                return kv

            self.aio = self._run(build)
        except BaseException:
            self._loop.stop()
            raise
        self.node = self.aio.node
        self.ns = self.aio.ns
        self._nsb = self.ns.encode()

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if getattr(self, "aio", None) is not None:
            self.aio._open()
        return self._loop.run(fn, *args)

    def put(self, key: Any, buf: Any, *, sync: bool = True, pin: bool | None = None) -> None:
        """As AsyncKVCache.put; with ``sync=False`` under the queue's bound, the block is
        handed to the event loop without waiting for it (no thread round trip)."""
        aio = self.aio
        k, view = aio._put_args(key, buf)
        pinned = aio.pin if pin is None else pin
        crc = crcfast.crc32c(view)
        if self.node is not None:
            self.node.put(self.ns, k, view, crc)
        if sync and aio.direct is not None and self._put_direct(k, view, crc, pinned):
            return
        if not sync and self._loop.token is not None:
            data = bytes(view)
            if aio._reserve(len(data)):
                aio.counts["puts"] += 1
                aio.counts["put_bytes"] += len(data)
                self._loop.token.run_sync_soon(aio._nursery.start_soon, aio._background, k,
                                               data, pinned)
                return
        self._run(aio._put_after_node, k, view, sync, pinned)

    def _put_direct(self, k: bytes, view: memoryview, crc: int, pin: bool) -> bool:
        """Store at the homes from this thread; False: take the event loop's path."""
        aio = self.aio
        assert aio.direct is not None
        aio.pool.expire_down()
        homes = aio._homes(k)
        if not homes:
            return False
        try:
            for sid in homes:
                aio.direct.put(sid, self.ns, k, view, crc, pin)
        except OSError as exc:
            if exc.errno in SKIP or exc.errno == errno.ENOTCONN:
                return False  # the loop's path puts again (a put is idempotent)
            raise
        aio.counts["puts"] += 1
        aio.counts["put_bytes"] += len(view)
        metrics.kv_op("put", "remote", "ok", len(view))
        return True

    def get(self, key: Any, out: Any) -> bool:
        return _whole_block(key, self.get_into(key, out), out)

    def get_into(self, key: Any, out: Any) -> int | None:
        """As AsyncKVCache.get_into; a node-tier hit is served in this thread."""
        self.aio._open()
        if device.is_device_buffer(out):
            return self._run(self.aio.get_into, key, out)
        k = check_key(key)
        view = self._out_view(out)
        if self.node is None:
            return self._get_remote(k, view)
        n = self._node_get(k, view)
        if n is None:
            return self._get_remote(k, view)
        return n

    def _get_remote(self, k: bytes, view: memoryview) -> int | None:
        """From the homes in this thread (the direct route); through the event loop
        when that route cannot serve (no address yet, a server that does not answer:
        the loop's path marks it down and refreshes the pool)."""
        aio = self.aio
        direct = aio.direct
        if direct is None:
            return self._run(partial(aio.get_into, k, view, node_checked=True))
        aio.pool.expire_down()
        counts = aio.counts
        counts["gets"] += 1
        for sid in aio._homes(k):
            got = self._get_local(sid, k, view) if aio.local_auth is not None else ASK
            if got > 0:
                if self.node is not None:
                    self.node.put(self.ns, k, view[:got])  # read-through: into DRAM
                return got
            if got == MISS:
                continue
            try:
                n = direct.get_into(sid, self.ns, k, view)
            except OSError as exc:
                if exc.errno == errno.EIO:  # damaged on the way: a miss here
                    log.warning("KV get from %s: %s", sid, exc)
                    counts["remote_errors"] += 1
                    continue
                if exc.errno in SKIP or exc.errno == errno.ENOTCONN:
                    counts["gets"] -= 1  # counted again there
                    return self._run(partial(aio.get_into, k, view, node_checked=True))
                raise
            if n is not None:
                counts["remote_hits"] += 1
                counts["get_bytes"] += n
                metrics.kv_op("get", "remote", "hit", n)
                if self.node is not None:
                    self.node.put(self.ns, k, view[:n])  # read-through
                return n
        self._count_miss()
        return None

    def _get_local(self, sid: str, k: bytes, view: memoryview) -> int:
        """A short-circuit get from home ``sid`` in this thread (the event loop only to
        connect, or for a slab's descriptor met for the first time): the length (a
        hit), MISS, or ASK."""
        aio = self.aio
        lk = aio.locals.get(sid)
        if lk is None or lk.dead:
            if not aio.local_due(sid):
                return ASK
            lk = self._run(aio.local, sid)
            if lk is None:
                return ASK
        got = lk.get_into(self._nsb, k, view)
        if isinstance(got, NeedSlab):
            self._run(lk.open_slab, got.slab)
            got = lk.get_into(self._nsb, k, view)
            if isinstance(got, NeedSlab):
                return ASK
        return aio.count_local(got)

    def exists(self, keys: Sequence[Any]) -> int:
        """As AsyncKVCache.exists; a chain held whole by the node tier is answered in
        this thread."""
        self.aio._open()
        if self.node is not None:
            ks = [check_key(k) for k in keys]
            if all(self.node.exists(self.ns, k) for k in ks):
                return len(ks)
        return self._run(self.aio.exists, keys)

    def put_batch(self, keys: Sequence[Any], bufs: Sequence[Any], *,
                  sync: bool = True, pin: bool | None = None) -> None:
        self._run(partial(self.aio.put_batch, keys, bufs, sync=sync, pin=pin))

    def get_batch(self, keys: Sequence[Any], outs: Sequence[Any]) -> list[bool]:
        """As AsyncKVCache.get_batch. Into host buffers it runs in this thread: node-tier
        hits and short-circuit gets, then the rest pipelined to their first homes (one
        round trip per home for up to ``direct.PIPELINE`` gets); a key that leaves
        (a home that did not answer, a miss where another replica may hold the block)
        takes the single get's path."""
        aio = self.aio
        if len(keys) != len(outs):
            raise OSError(errno.EINVAL, f"get_batch: {len(keys)} keys, {len(outs)} buffers")
        aio._open()
        if aio.direct is None or any(device.is_device_buffer(o) for o in outs):
            return self._run(aio.get_batch, keys, outs)
        ks = [check_key(k) for k in keys]
        views = [self._out_view(o) for o in outs]
        found = [False] * len(ks)
        by_home: dict[str, list[int]] = {}
        rest: list[int] = []  # for the single get's path
        aio.pool.expire_down()
        for i, (k, view) in enumerate(zip(ks, views, strict=True)):
            n = self._node_get(k, view) if self.node is not None else None
            if n is not None:
                found[i] = _whole_block(k, n, outs[i])
                continue
            homes = aio._homes(k)
            if not homes:
                rest.append(i)
                continue
            if aio.local_auth is not None:  # a home on this host: read by the client
                n = self._get_local(homes[0], k, view)
                if n > 0:
                    aio.counts["gets"] += 1
                    if self.node is not None:
                        self.node.put(self.ns, k, view[:n])  # read-through
                    found[i] = _whole_block(k, n, outs[i])
                    continue
                if n == MISS:
                    if len(homes) > 1:
                        rest.append(i)
                    else:
                        aio.counts["gets"] += 1
                        self._count_miss()
                    continue
            by_home.setdefault(homes[0], []).append(i)
        for sid, idx in by_home.items():
            rest += self._pipelined(sid, idx, ks, views, outs, found)
        for i in sorted(rest):
            found[i] = _whole_block(ks[i], self._get_remote(ks[i], views[i]), outs[i])
        return found

    def _pipelined(self, sid: str, idx: list[int], ks: list[bytes], views: list[memoryview],
                   outs: Sequence[Any], found: list[bool]) -> list[int]:
        """The gets ``idx`` pipelined to home ``sid``, results into ``found``; the keys
        left for the single get's path."""
        aio = self.aio
        assert aio.direct is not None
        try:
            got = aio.direct.get_batch(sid, self.ns, [ks[i] for i in idx],
                                       [views[i] for i in idx])
        except OSError as exc:
            if exc.errno in SKIP or exc.errno == errno.ENOTCONN:
                return idx  # the single path marks the home down and goes on
            raise
        more = len(aio._homes(ks[idx[0]])) > 1 if idx else False
        rest = []
        counts = aio.counts
        for i, n in zip(idx, got, strict=True):
            if isinstance(n, OSError):
                if n.errno == errno.EIO:  # damaged on the way: a miss here
                    log.warning("KV get from %s: %s", sid, n)
                    counts["remote_errors"] += 1
                    n = None
                elif n.errno in SKIP or n.errno == errno.ENOTCONN:
                    rest.append(i)
                    continue
                else:
                    raise n
            if n is None:
                if more:
                    rest.append(i)
                else:
                    counts["gets"] += 1
                    self._count_miss()
                continue
            counts["gets"] += 1
            counts["remote_hits"] += 1
            counts["get_bytes"] += n
            metrics.kv_op("get", "remote", "hit", n)
            if self.node is not None:
                self.node.put(self.ns, ks[i], views[i][:n])  # read-through
            found[i] = _whole_block(ks[i], n, outs[i])
        return rest

    def _out_view(self, out: Any) -> memoryview:
        view = host_view(out, "output")
        if view.readonly:
            raise OSError(errno.EINVAL, "KV get into a read-only buffer")
        return view

    def _node_get(self, k: bytes, view: memoryview) -> int | None:
        """A node-tier hit (counted), or None."""
        assert self.node is not None
        n = self.node.get_into(self.ns, k, view)
        if n is not None:
            counts = self.aio.counts
            counts["gets"] += 1
            counts["node_hits"] += 1
            counts["get_bytes"] += n
            metrics.kv_op("get", "node", "hit", n)
        return n

    def _count_miss(self) -> None:
        self.aio.counts["misses"] += 1
        metrics.kv_op("get", "remote", "miss")

    def remove(self, keys: Sequence[Any]) -> int:
        return self._run(self.aio.remove, keys)

    def flush(self) -> None:
        self._run(self.aio.flush)

    def stats(self) -> dict[str, Any]:
        return self.aio.stats()

    def server_stats(self) -> dict[str, dict[str, Any]]:
        return self._run(self.aio.server_stats)

    def close(self) -> None:
        if self.aio.closed:
            return

        try:
            self._loop.run(self.aio.aclose)
        finally:
            self._loop.stop()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
