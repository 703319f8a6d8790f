"""The striped data path: a file range split by its layout and sent to every stripe's
server in parallel, received straight into (and sent straight from) the caller's buffer."""
from __future__ import annotations

import errno
import itertools
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from pfs.auth import ClientAuth
from pfs.layout import Layout, Piece, stripe_extents
from pfs.shortcircuit import HandleObjects
from pfs.wire.connect import open_rpc
from pfs.wire.rpc import RpcClient

log = logging.getLogger(__name__)

# Largest single request; bigger pieces (huge stripe units) are cut to this.
MAX_REQUEST = 8 << 20
# Requests in flight per client, across all servers: bounds memory and socket queues.
MAX_IN_FLIGHT = 64


async def run_all(jobs: list[Callable[[], Awaitable[Any]]]) -> None:
    """Run jobs concurrently; if any fails, raise its OSError itself (not a group), so
    callers see the errno of the failure as for a single call."""
    if len(jobs) == 1:
        await jobs[0]()
        return
    try:
        async with trio.open_nursery() as n:
            for job in jobs:
                n.start_soon(job)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        first = next((e for e in leaves if isinstance(e, OSError)), None)
        if first is None or any(not isinstance(e, (OSError, trio.Cancelled)) for e in leaves):
            raise
        raise first from group


def _leaves(group: BaseExceptionGroup) -> Any:
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


class DataClient:
    """Connections to data servers and the parallel read/write of stripe pieces."""

    def __init__(self, nursery: trio.Nursery,
                 lookup_servers: Callable[[], Awaitable[dict[str, dict[str, Any]]]], *,
                 connections_per_server: int = 2, timeout: float = 60.0,
                 auth: ClientAuth | None = None) -> None:
        self._nursery = nursery
        self._auth = auth or ClientAuth()
        self._lookup_servers = lookup_servers
        self._per_server = max(1, connections_per_server)
        self.timeout = timeout
        self._addrs: dict[str, tuple[str, int]] = {}
        self._conns: dict[str, list[RpcClient]] = {}
        self._rr = itertools.count()
        self._locks: dict[str, trio.Lock] = {}
        self._slots = trio.Semaphore(MAX_IN_FLIGHT)

    def known_address(self, sid: str) -> tuple[str, int] | None:
        """Where server ``sid`` was last seen, without asking the metaserver."""
        return self._addrs.get(sid)

    async def _address(self, sid: str) -> tuple[str, int]:
        if sid not in self._addrs:
            servers = await self._lookup_servers()
            self._addrs = {k: (v["host"], int(v["port"])) for k, v in servers.items()}
            if sid not in self._addrs:
                raise OSError(errno.EIO, f"data server {sid} is not registered")
        return self._addrs[sid]

    async def connection(self, sid: str) -> RpcClient:
        conns = self._conns.get(sid)
        if conns and len(conns) >= self._per_server:
            c = conns[next(self._rr) % len(conns)]
            if c.alive:
                return c
        lock = self._locks.setdefault(sid, trio.Lock())
        async with lock:
            conns = [c for c in self._conns.get(sid, []) if c.alive]
            if len(conns) < self._per_server:
                host, port = await self._address(sid)
                try:
                    conns.append(await open_rpc(self._auth, self._nursery, host, port,
                                                timeout=self.timeout))
                except OSError as first:
                    err = first
                    self._addrs.pop(sid, None)  # it may have moved: ask again next time
                    if not conns:
                        # ... and now, once: a server that restarted registered anew,
                        # usually on another port
                        try:
                            moved = await self._address(sid)
                        except OSError:
                            moved = (host, port)
                        if moved != (host, port):
                            host, port = moved
                            try:
                                conns.append(await open_rpc(
                                    self._auth, self._nursery, host, port, timeout=self.timeout))
                            except OSError as again:
                                self._addrs.pop(sid, None)
                                err = again
                    if not conns:
                        raise OSError(err.errno or errno.EIO,
                                      f"data server {sid} at {host}:{port}: {err.strerror}") from None
            self._conns[sid] = conns
            return conns[next(self._rr) % len(conns)]

    async def call(self, sid: str, method: str, fields: dict[str, Any], **kw: Any):
        async with self._slots:
            conn = await self.connection(sid)
            return await conn.call(method, fields, **kw)

    async def call_replicas(self, replicas: tuple[str, ...], method: str,
                            fields: dict[str, Any], **kw: Any):
        """Try each replica in turn; the last error is raised if all fail."""
        err: OSError | None = None
        for sid in replicas:
            try:
                return await self.call(sid, method, fields, **kw)
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.ESTALE, errno.EINVAL, errno.ENOSPC):
                    raise
                err = exc
        assert err is not None
        raise err

    # -- bulk ----------------------------------------------------------------
    # A range is cut into per-stripe runs that are contiguous in the object (the pieces
    # of one stripe inside the range follow each other in it); each run is one request
    # whose payload is scattered into / gathered from the caller's buffer piece by piece.
    # ``cap`` is the capability the metaserver gave with the open (docs/rpc.md); it
    # rides on every request.
    async def read_into(self, ino: int, layout: Layout, off: int, buf: memoryview,
                        cap: bytes | None = None, objects: HandleObjects | None = None) -> None:
        """Fill ``buf`` with file bytes from ``off``; holes and short objects read zeros.
        With ``objects`` (a read-only handle's short-circuit descriptors), stripes whose
        server is on this host are read from the object file directly."""
        await run_all([partial(self._read_run, ino, layout, off, buf, run, cap, objects)
                       for run in _runs(layout, off, len(buf))])

    async def _read_run(self, ino: int, layout: Layout, base: int, buf: memoryview,
                        run: list[Piece], cap: bytes | None = None,
                        objects: HandleObjects | None = None) -> None:
        dests = [buf[p.file_off - base:p.file_off - base + p.length] for p in run]
        if objects is not None:
            stripe = run[0].stripe
            fd = await objects.fd(layout.servers[stripe], ino, stripe, cap)
            if fd is not None:
                await objects.read(fd, run[0].obj_off, dests)
                return
        total = sum(p.length for p in run)
        r = await self.call_replicas(
            layout.servers[run[0].stripe], "read",
            {"obj": [ino, run[0].stripe], "off": run[0].obj_off, "len": total, "cap": cap},
            into=dests[0] if len(dests) == 1 else dests)
        if r.nbytes < total:  # past the object's end: a hole up to the file size
            skip = r.nbytes
            for d in dests:
                if skip >= len(d):
                    skip -= len(d)
                    continue
                d[skip:] = bytes(len(d) - skip)
                skip = 0

    async def write(self, ino: int, layout: Layout, off: int, data: memoryview,
                    cap: bytes | None = None) -> None:
        await run_all([partial(self._write_run, ino, layout, off, data, run, cap)
                       for run in _runs(layout, off, len(data))])

    async def _write_run(self, ino: int, layout: Layout, base: int, data: memoryview,
                         run: list[Piece], cap: bytes | None = None) -> None:
        srcs = [data[p.file_off - base:p.file_off - base + p.length] for p in run]
        payload = srcs[0] if len(srcs) == 1 else srcs
        fields = {"obj": [ino, run[0].stripe], "off": run[0].obj_off, "cap": cap}
        replicas = layout.servers[run[0].stripe]
        # every replica must hold an acknowledged write
        await run_all([partial(self.call, sid, "write", fields, payload=payload)
                       for sid in replicas])

    async def fsync(self, ino: int, layout: Layout, cap: bytes | None = None) -> None:
        await run_all([partial(self.call, sid, "fsync", {"obj": [ino, stripe], "cap": cap})
                       for stripe, replicas in enumerate(layout.servers) for sid in replicas])

    def close(self) -> None:
        for conns in self._conns.values():
            for c in conns:
                c.close()
        self._conns.clear()


def _runs(layout: Layout, off: int, length: int) -> list[list[Piece]]:
    """Per-stripe runs of pieces, each contiguous in its object and at most MAX_REQUEST."""
    out: list[list[Piece]] = []
    for ext in stripe_extents(layout.unit, layout.count, off, length):
        run: list[Piece] = []
        size = 0
        for p in _split(ext.pieces):
            if run and size + p.length > MAX_REQUEST:
                out.append(run)
                run, size = [], 0
            run.append(p)
            size += p.length
        if run:
            out.append(run)
    return out


def _split(pieces: Any) -> Any:
    for p in pieces:
        if p.length <= MAX_REQUEST:
            yield p
            continue
        for start in range(0, p.length, MAX_REQUEST):
            n = min(MAX_REQUEST, p.length - start)
            yield Piece(p.stripe, p.obj_off + start, p.file_off + start, n)
