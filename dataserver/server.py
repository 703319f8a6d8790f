"""The data server: stripe objects on local drives, served over the pfs RPC framing.

``DataService`` answers the "Data server" methods of ``docs/rpc.md``. A read replies
with the object's bytes sent by ``sendfile`` straight from the object file; a write hands
the received payload to the I/O engine. ``serve_data`` listens, registers with the
metaserver and heartbeats; the data path serves whether or not the metaserver is up.
"""
from __future__ import annotations

import errno
import logging
import os
import random
from typing import Any

import trio

from dataserver.objects import MAX_ID, ObjectStore, check_obj
from pfs.config import DataConfig, parse_addr
from pfs.engine import Engine, get_engine
from pfs.wire.protocol import Limits
from pfs.wire.rpc import ConnContext, Reply, Request, RpcClient, RpcService

log = logging.getLogger(__name__)

MAX_DELETE = 1 << 16  # object ids in one delete request
MAX_BACKOFF = 10.0  # seconds between registration attempts, at most


def _offset(req: Request, key: str) -> int:
    value: int = req.int(key)
    if not 0 <= value < MAX_ID:
        raise OSError(errno.EINVAL, f"{req.method}: {key} {value} out of range [0, 2**63)")
    return value


class DataService(RpcService):
    """Serves objects from ``store`` through ``engine``."""

    name = "dataserver"

    def __init__(self, store: ObjectStore, engine: Engine, limits: Limits | None = None,
                 *, use_sendfile: bool = True) -> None:
        super().__init__(limits)
        self.store = store
        self.engine = engine
        self.use_sendfile = use_sendfile
        self.sid: str | None = store.load_sid()
        self.registrations = 0  # successful registrations so far

    # -- data methods ----------------------------------------------------------
    async def rpc_read(self, ctx: ConnContext, req: Request) -> Reply:
        obj = check_obj(req.any("obj"))
        off = _offset(req, "off")
        length: int = req.int("len")
        if not 0 <= length <= self.limits.max_payload:
            raise OSError(errno.EINVAL, f"read: len {length} out of range "
                                        f"[0, {self.limits.max_payload}]")
        got = self.store.acquire(obj)
        if got is None:
            return Reply({"n": 0})
        fd, release = got
        try:
            size = os.fstat(fd).st_size
            n = max(0, min(length, size - off))
            if n == 0:
                release()
                return Reply({"n": 0})
            if self.use_sendfile:
                return Reply({"n": n}, file=(fd, off, n), release=release)
            buf = bytearray(n)
            n = await self.engine.read_into(fd, off, memoryview(buf))
        except BaseException:
            release()
            raise
        release()
        return Reply({"n": n}, payload=memoryview(buf)[:n])

    async def rpc_write(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        obj = check_obj(req.any("obj"))
        off = _offset(req, "off")
        data = req.payload
        if not data:
            return {"n": 0}
        if off + len(data) > MAX_ID:
            raise OSError(errno.EFBIG, f"write: {off}+{len(data)} beyond the largest object")
        got = self.store.acquire(obj, create=True)
        assert got is not None
        fd, release = got
        try:
            n = await self.engine.write(fd, off, data)
        finally:
            release()
        return {"n": n}

    async def rpc_truncate(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        obj = check_obj(req.any("obj"))
        size = _offset(req, "size")
        self.store.truncate(obj, size)
        return {}

    async def rpc_delete(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        raw = req.list("objs")
        if len(raw) > MAX_DELETE:
            raise OSError(errno.EINVAL, f"delete: {len(raw)} objects, at most {MAX_DELETE}")
        objs = [check_obj(o) for o in raw]  # all valid before any is deleted
        deleted = sum(1 for o in objs if self.store.delete(o))
        return {"deleted": deleted}

    async def rpc_fsync(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        obj = check_obj(req.any("obj"))
        got = self.store.acquire(obj)
        if got is None:
            return {}
        fd, release = got
        try:
            await self.engine.fsync(fd)
        finally:
            release()
        for d in self.store.take_unsynced_dirs(obj):
            await trio.to_thread.run_sync(_fsync_dir, d)
        return {}

    async def rpc_stat_obj(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        obj = check_obj(req.any("obj"))
        return {"size": self.store.size(obj)}

    async def rpc_statfs(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cap = self.store.capacity()
        return {"total": cap.total, "free": cap.free, "objects": cap.objects}

    # -- registration ----------------------------------------------------------
    async def keep_registered(self, meta: str, host: str, port: int, heartbeat: float, *,
                              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                              ) -> None:
        """Register with the metaserver at ``meta`` and heartbeat every ``heartbeat`` s,
        forever. Reports started after the first registration, or after the first failed
        attempt (the data path does not wait for the metaserver). On any failure it
        reconnects with backoff and registers again."""
        meta_host, meta_port = parse_addr(meta)
        heartbeat = max(heartbeat, 0.01)
        cap_backoff = min(MAX_BACKOFF, max(5 * heartbeat, 0.1))
        backoff = min(0.05, cap_backoff)
        started = False
        failures = 0
        while True:
            try:
                async with trio.open_nursery() as nursery:
                    client = await RpcClient.open(nursery, meta_host, meta_port,
                                                  timeout=max(5.0, 2 * heartbeat))
                    try:
                        await self._register(client, host, port)
                        if failures:
                            log.info("registered with the metaserver %s again as %s",
                                     meta, self.sid)
                        failures = 0
                        backoff = min(0.05, cap_backoff)
                        if not started:
                            started = True
                            task_status.started()
                        while True:
                            await trio.sleep(heartbeat)
                            cap = self.store.capacity()
                            await client.call("heartbeat", {"sid": self.sid, "total": cap.total,
                                                            "free": cap.free})
                    finally:
                        client.close()
            except* OSError as group:  # the nursery wraps what its body raised
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "metaserver %s: %s; retrying (serving data meanwhile)",
                        meta, _first(group))
            if not started:
                started = True
                task_status.started()
            await trio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, cap_backoff)

    async def _register(self, client: RpcClient, host: str, port: int) -> None:
        if host in ("", "0.0.0.0", "::"):  # advertise the address the metaserver sees us on
            host = client.conn.sock.getsockname()[0]
        cap = self.store.capacity()
        res = await client.call("register", {"sid": self.sid, "host": host, "port": port,
                                             "total": cap.total, "free": cap.free})
        sid = res.fields.get("sid")
        if not isinstance(sid, str) or not sid:
            raise OSError(errno.EPROTO, f"register: the metaserver sent sid {sid!r}")
        if sid != self.sid:
            if self.sid is not None:
                log.warning("the metaserver renamed this data server from %s to %s",
                            self.sid, sid)
            self.store.save_sid(sid)
            self.sid = sid
        log.info("registered with the metaserver as %s (%s:%d)", sid, host, port)
        self.registrations += 1


def _first(group: BaseExceptionGroup[OSError]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def serve_data(config: DataConfig, *,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a data server until cancelled; ``nursery.start`` returns the bound port.

    Started once listening and registered with ``config.meta`` (or, when the metaserver
    cannot be reached, once listening; registration keeps retrying in the background).
    An empty ``config.meta`` runs without a metaserver.
    """
    store = ObjectStore(config.dirs)
    try:
        engine = get_engine(config.engine)
    except BaseException:
        store.close()
        raise
    service = DataService(store, engine)
    try:
        async with trio.open_nursery() as nursery:
            port: int = await nursery.start(service.serve, config.host, config.port)
            if config.meta:
                await nursery.start(service.keep_registered, config.meta, config.host, port,
                                    config.heartbeat)
            task_status.started(port)
    finally:
        engine.close()
        store.close()
