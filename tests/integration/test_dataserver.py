"""The data server over real loopback sockets: data methods, limits, registration."""
from __future__ import annotations

import errno
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pfs.core.config import DataConfig
from pfs.core.engine import PosixEngine
from pfs.core.wire.protocol import Limits
from pfs.core.wire.rpc import ConnContext, Request, RpcClient, RpcService
from pfs.dataserver.objects import ObjectStore
from pfs.dataserver.server import DataService, serve_data

TIMEOUT = 30


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TIMEOUT):
            await fn()

    trio.run(main)


class FakeMeta(RpcService):
    """Just enough metaserver: register and heartbeat, recorded."""

    name = "fakemeta"

    def __init__(self) -> None:
        super().__init__()
        self.registers: list[dict[str, Any]] = []
        self.heartbeats: list[dict[str, Any]] = []
        self._changed = trio.Event()
        self._next = 1

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, pred: Callable[[], bool]) -> None:
        while not pred():
            await self._changed.wait()

    async def rpc_register(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        sid = req.any("sid")
        if sid is None:
            sid = f"ds-{self._next}"
            self._next += 1
        self.registers.append(dict(req.fields))
        self._poke()
        return {"sid": sid}

    async def rpc_heartbeat(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        self.heartbeats.append(dict(req.fields))
        self._poke()
        return {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def data_server(cfg: DataConfig) -> AsyncIterator[tuple[int, RpcClient]]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_data, cfg)
        client = await RpcClient.open(nursery, "127.0.0.1", port)
        try:
            yield port, client
        finally:
            client.close()
            nursery.cancel_scope.cancel()


def config(tmp_path: Path, *dirs: str, meta: str = "", heartbeat: float = 0.05) -> DataConfig:
    return DataConfig(dirs=[str(tmp_path / d) for d in (dirs or ("d0",))], host="127.0.0.1",
                      port=0, meta=meta, heartbeat=heartbeat)


async def read(c: RpcClient, obj: list[int], off: int, length: int) -> bytes:
    buf = bytearray(length)
    r = await c.call("read", {"obj": obj, "off": off, "len": length}, into=memoryview(buf))
    assert r.fields["n"] == r.nbytes
    return bytes(buf[:r.nbytes])


async def write(c: RpcClient, obj: list[int], off: int, data: bytes) -> None:
    r = await c.call("write", {"obj": obj, "off": off}, payload=data)
    assert r.fields == {"n": len(data)}


async def errno_of(c: RpcClient, method: str, fields: dict[str, Any], **kw: Any) -> int:
    with pytest.raises(OSError) as e:
        await c.call(method, fields, **kw)
    assert isinstance(e.value.errno, int)
    return e.value.errno


# ---------------------------------------------------------------------------
# data methods
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_round_trips(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    models: dict[int, bytearray] = {}

    async def main() -> None:
        async with data_server(config(tmp_path)) as (_port, c):
            for _ in range(150):
                ino = rng.randrange(4)
                obj = [ino, seed]
                model = models.setdefault(ino, bytearray())
                action = rng.random()
                if action < 0.45:
                    off = rng.randrange(300_000)
                    data = rng.randbytes(rng.choice([1, 17, 4096, 70_000, 300_000]))
                    await write(c, obj, off, data)
                    if len(model) < off:
                        model.extend(bytes(off - len(model)))
                    model[off:off + len(data)] = data
                elif action < 0.9:
                    off = rng.randrange(len(model) + 1000)
                    length = rng.randrange(400_000)
                    assert await read(c, obj, off, length) == model[off:off + length]
                elif action < 0.97:
                    size = rng.randrange(400_000)
                    await c.call("truncate", {"obj": obj, "size": size})
                    if size < len(model):
                        del model[size:]
                    else:
                        model.extend(bytes(size - len(model)))
                else:
                    assert (await c.call("stat_obj", {"obj": obj})).fields == {"size": len(model)}
            # many reads in flight on one connection at once
            got: dict[int, bytes] = {}

            async def one(ino: int) -> None:
                got[ino] = await read(c, [ino, seed], 0, 1 << 20)

            async with trio.open_nursery() as n:
                for ino in models:
                    n.start_soon(one, ino)
            for ino, model in models.items():
                assert got[ino] == model
                r = await c.call("stat_obj", {"obj": [ino, seed]})
                assert r.fields["size"] == len(model)

    run(main)


def test_absent_holes_short_reads(tmp_path: Path) -> None:
    async def main() -> None:
        async with data_server(config(tmp_path)) as (_port, c):
            assert await read(c, [5, 0], 0, 100) == b""  # absent: empty, no error
            assert (await c.call("stat_obj", {"obj": [5, 0]})).fields == {"size": 0}
            await write(c, [5, 0], 1 << 20, b"tail")
            assert await read(c, [5, 0], 0, 8) == bytes(8)  # a hole reads zeros
            assert await read(c, [5, 0], (1 << 20) - 2, 100) == b"\0\0tail"  # short at end
            assert await read(c, [5, 0], 1 << 30, 100) == b""  # past the end
            assert await read(c, [5, 0], 0, 0) == b""
            r = await c.call("write", {"obj": [6, 0], "off": 0})  # empty write: nothing made
            assert r.fields == {"n": 0}
            assert (await c.call("statfs")).fields["objects"] == 1
            big = random.Random(1).randbytes(8 << 20)  # one large request each way
            await write(c, [7, 3], 12345, big)
            assert await read(c, [7, 3], 12345, len(big)) == big
            await c.call("fsync", {"obj": [7, 3]})
            await c.call("fsync", {"obj": [8, 3]})  # absent: fine

    run(main)


def test_sync_of_several_objects_reports_what_was_unsynced(tmp_path: Path) -> None:
    async def main() -> None:
        async with data_server(config(tmp_path)) as (_port, c):
            for stripe in range(3):
                await write(c, [9, stripe], 0, b"x" * 1000)
            objs = [[9, 0], [9, 1], [9, 2], [10, 0]]  # the last is absent: skipped
            assert (await c.call("sync", {"objs": objs})).fields == {"dirty": 3}
            assert (await c.call("sync", {"objs": objs})).fields == {"dirty": 0}
            await write(c, [9, 1], 5, b"y")  # a write marks its object again
            assert (await c.call("sync", {"objs": objs})).fields == {"dirty": 1}
            assert await read(c, [9, 1], 4, 3) == b"xyx"
            assert (await c.call("sync", {"objs": []})).fields == {"dirty": 0}
            assert await errno_of(c, "sync", {"objs": [[9, -1]]}) == errno.EINVAL

    run(main)


def test_a_sync_makes_a_new_object_s_directories_durable_after_its_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new object's directory entries are synced after its data, in the same sync
    (one worker thread for a single object); a sync whose data failed leaves them to
    the next one."""
    from pfs.dataserver import server as server_mod

    synced: list[str] = []
    failing = [True]
    real_sync, real_dir = os.fdatasync, server_mod._fsync_dir

    def fdatasync(fd: int) -> None:
        if failing:
            failing.clear()
            raise OSError(errno.EIO, "injected")
        synced.append("data")
        real_sync(fd)

    def fsync_dir(d: str) -> None:
        synced.append(d)
        real_dir(d)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(server_mod, "_fsync_dir", fsync_dir)

    async def main() -> None:
        async with data_server(config(tmp_path)) as (_port, c):
            await write(c, [7, 0], 0, b"x" * 100)
            assert await errno_of(c, "sync", {"objs": [[7, 0]]}) == errno.EIO
            assert synced == []
            await c.call("sync", {"objs": [[7, 0]]})
            dirs = [d for d in synced if d != "data"]
            assert synced[0] == "data" and synced[-len(dirs):] == dirs and dirs
            assert all(str(tmp_path / "d0") in d for d in dirs)
            synced.clear()
            await c.call("sync", {"objs": [[7, 0]]})
            assert synced and "data" in synced and all(d == "data" for d in synced)

    run(main)


def test_truncate_delete_statfs(tmp_path: Path) -> None:
    async def main() -> None:
        async with data_server(config(tmp_path)) as (_port, c):
            await c.call("truncate", {"obj": [1, 0], "size": 0})  # absent, 0: nothing made
            assert (await c.call("statfs")).fields["objects"] == 0
            await c.call("truncate", {"obj": [1, 0], "size": 5000})  # absent, >0: made
            assert await read(c, [1, 0], 0, 10_000) == bytes(5000)
            await write(c, [2, 0], 0, b"abcdef")
            await c.call("truncate", {"obj": [2, 0], "size": 3})
            assert await read(c, [2, 0], 0, 100) == b"abc"
            st = (await c.call("statfs")).fields
            assert st["objects"] == 2 and st["total"] >= st["free"] > 0
            r = await c.call("delete", {"objs": [[1, 0], [2, 0], [3, 0]]})
            assert r.fields == {"deleted": 2}
            assert (await c.call("delete", {"objs": [[1, 0]]})).fields == {"deleted": 0}
            assert await read(c, [2, 0], 0, 100) == b""
            assert (await c.call("stat_obj", {"obj": [2, 0]})).fields == {"size": 0}
            assert (await c.call("statfs")).fields["objects"] == 0
            await write(c, [2, 0], 0, b"again")  # recreated after delete
            assert await read(c, [2, 0], 0, 100) == b"again"

    run(main)


def test_bad_requests_get_einval_and_server_keeps_serving(tmp_path: Path) -> None:
    bad_ids: list[Any] = [None, "x", [1], [1, 2, 3], [-1, 0], [0, -1], [2**63, 0],
                          [0, 2**63], ["a", 0], [True, 0], [1.0, 0], {"ino": 1}]

    async def main() -> None:
        async with data_server(config(tmp_path)) as (_port, c):
            await write(c, [1, 1], 0, b"still here")
            for obj in bad_ids:
                for method, extra in (("read", {"off": 0, "len": 1}), ("write", {"off": 0}),
                                      ("truncate", {"size": 1}), ("fsync", {}),
                                      ("stat_obj", {})):
                    payload = b"x" if method == "write" else None
                    assert await errno_of(c, method, {"obj": obj, **extra},
                                          payload=payload) == errno.EINVAL, (method, obj)
                # one bad id in a delete: nothing is deleted
                assert await errno_of(c, "delete", {"objs": [[1, 1], obj]}) == errno.EINVAL
            limit = Limits().max_payload
            assert await errno_of(c, "read", {"obj": [1, 1], "off": 0,
                                              "len": limit + 1}) == errno.EINVAL
            assert await errno_of(c, "read", {"obj": [1, 1], "off": -1,
                                              "len": 1}) == errno.EINVAL
            assert await errno_of(c, "read", {"obj": [1, 1], "off": 0,
                                              "len": -1}) == errno.EINVAL
            assert await errno_of(c, "read", {"obj": [1, 1], "off": "0",
                                              "len": 1}) == errno.EINVAL
            assert await errno_of(c, "read", {"obj": [1, 1], "len": 1}) == errno.EINVAL
            assert await errno_of(c, "write", {"obj": [1, 1], "off": -5},
                                  payload=b"x") == errno.EINVAL
            assert await errno_of(c, "truncate", {"obj": [1, 1], "size": -1}) == errno.EINVAL
            assert await errno_of(c, "delete", {"objs": "nope"}) == errno.EINVAL
            assert await errno_of(c, "frobnicate", {}) == errno.ENOSYS
            assert await read(c, [1, 1], 0, 100) == b"still here"
            # the largest allowed read is fine (short: the object is small)
            r = await c.call("read", {"obj": [1, 1], "off": 0, "len": limit})
            assert r.fields == {"n": 10}

    run(main)


def test_several_dirs_spread_and_survive_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path, "d0", "d1", "d2")
    objs = [[ino, stripe] for ino in range(1, 16) for stripe in range(4)]

    async def main() -> None:
        async with data_server(cfg) as (_port, c):
            for obj in objs:
                await write(c, obj, obj[1] * 100, f"{obj}".encode())
        async with data_server(cfg) as (_port, c):
            assert (await c.call("statfs")).fields["objects"] == len(objs)
            for obj in objs:
                assert await read(c, obj, obj[1] * 100, 100) == f"{obj}".encode()

    run(main)
    counts = [sum(len([f for f in files if not f.endswith(".crc")])  # not checksums
                  for _r, _d, files in os.walk(tmp_path / d / "objects"))
              for d in ("d0", "d1", "d2")]
    assert sum(counts) == len(objs)
    assert all(n >= 5 for n in counts), counts  # 60 objects over 3 dirs: all get some


def test_read_without_sendfile(tmp_path: Path) -> None:
    async def main() -> None:
        store = ObjectStore([str(tmp_path / "d")])
        svc = DataService(store, PosixEngine(), use_sendfile=False)
        async with trio.open_nursery() as n:
            port = await n.start(svc.serve, "127.0.0.1", 0)
            c = await RpcClient.open(n, "127.0.0.1", port)
            data = random.Random(2).randbytes(200_000)
            await write(c, [1, 0], 10, data)
            assert await read(c, [1, 0], 0, 300_000) == bytes(10) + data
            c.close()
            n.cancel_scope.cancel()
        store.close()

    run(main)


# ---------------------------------------------------------------------------
# the object store
# ---------------------------------------------------------------------------
def test_fd_cache_is_bounded_and_pins_survive_eviction(tmp_path: Path) -> None:
    store = ObjectStore([str(tmp_path / "d")], max_open=4)
    before = len(os.listdir("/proc/self/fd"))
    pinned = store.acquire((1, 0), create=True)
    assert pinned is not None
    fd, release = pinned
    os.pwrite(fd, b"pinned", 0)
    for ino in range(2, 30):
        got = store.acquire((ino, 0), create=True)
        assert got is not None
        got[1]()
    # the cache and the pinned one, each object with its checksum sidecar
    assert len(os.listdir("/proc/self/fd")) - before <= 2 * 5
    assert os.pread(fd, 6, 0) == b"pinned"  # evicted, still open while pinned
    release()
    release()  # idempotent
    assert store.size((1, 0)) == 6
    assert store.delete((1, 0)) and not store.delete((1, 0))
    assert store.objects == 28
    store.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_server_id_file(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = ObjectStore(dirs)
    assert store.load_sid() is None
    store.save_sid("ds-7")
    store.close()
    assert ObjectStore(dirs).load_sid() == "ds-7"
    (tmp_path / "b" / "server.id").write_text("ds-8\n")
    with pytest.raises(OSError) as e:
        ObjectStore(dirs).load_sid()
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError):
        ObjectStore(dirs + [dirs[0]])


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------
def test_register_heartbeat_and_sid_survives_restart(tmp_path: Path) -> None:
    meta = FakeMeta()

    async def main() -> None:
        async with trio.open_nursery() as mn:
            mport = await mn.start(meta.serve, "127.0.0.1", 0)
            cfg = config(tmp_path, "d0", "d1", meta=f"127.0.0.1:{mport}")
            async with data_server(cfg) as (port, _c):
                # started only once registered
                assert len(meta.registers) == 1
                reg = meta.registers[0]
                assert reg["sid"] is None and reg["host"] == "127.0.0.1" and reg["port"] == port
                assert reg["total"] >= reg["free"] > 0
                await meta.wait(lambda: len(meta.heartbeats) >= 2)
                hb = meta.heartbeats[-1]
                assert hb["sid"] == "ds-1" and hb["total"] > 0 and "free" in hb
            for d in ("d0", "d1"):
                assert (tmp_path / d / "server.id").read_text().strip() == "ds-1"
            async with data_server(cfg) as (port, _c):
                assert meta.registers[-1]["sid"] == "ds-1"
                assert meta.registers[-1]["port"] == port
            mn.cancel_scope.cancel()

    run(main)
    assert meta._next == 2  # one sid was ever handed out


def test_metaserver_down_then_up_then_restarted(tmp_path: Path) -> None:
    mport = free_port()
    cfg = config(tmp_path, meta=f"127.0.0.1:{mport}", heartbeat=0.02)

    async def main() -> None:
        async with data_server(cfg) as (_port, c):
            # no metaserver yet: the data path works anyway
            await write(c, [1, 0], 0, b"served")
            assert await read(c, [1, 0], 0, 10) == b"served"
            first = FakeMeta()
            async with trio.open_nursery() as mn:
                await mn.start(first.serve, "127.0.0.1", mport)
                await first.wait(lambda: len(first.heartbeats) >= 1)
                assert first.registers[0]["sid"] is None
                mn.cancel_scope.cancel()  # the metaserver goes away...
            second = FakeMeta()  # ...and comes back: the data server registers again
            async with trio.open_nursery() as mn:
                await mn.start(second.serve, "127.0.0.1", mport)
                await second.wait(lambda: len(second.heartbeats) >= 1)
                assert second.registers[0]["sid"] == "ds-1"
                mn.cancel_scope.cancel()
            assert await read(c, [1, 0], 0, 10) == b"served"

    run(main)


# ---------------------------------------------------------------------------
# as a process
# ---------------------------------------------------------------------------
def test_subprocess_ready_fd_and_sigterm(tmp_path: Path) -> None:
    meta = FakeMeta()
    log = tmp_path / "dataserver.log"

    async def start(mport: int) -> tuple[trio.Process, int]:
        r, w = os.pipe()
        err = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "pfs.dataserver", "--dir", str(tmp_path / "d0"),
                 "--dir", str(tmp_path / "d1"), "--host", "127.0.0.1", "--port", "0",
                 "--meta", f"127.0.0.1:{mport}", "--heartbeat", "0.05", "--ready-fd", str(w)],
                pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        finally:
            os.close(w)
            os.close(err)
        line = b""
        async with trio.lowlevel.FdStream(r) as stream:
            while not line.endswith(b"\n"):
                chunk = await stream.receive_some(64)
                if not chunk:
                    break
                line += chunk
        assert line.endswith(b"\n"), log.read_text()
        return proc, int(line)

    async def stop(proc: trio.Process) -> None:
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0, log.read_text()

    async def main() -> None:
        async with trio.open_nursery() as mn:
            mport = await mn.start(meta.serve, "127.0.0.1", 0)
            proc, port = await start(mport)
            try:
                assert meta.registers[-1]["port"] == port  # ready means registered
                async with trio.open_nursery() as n:
                    c = await RpcClient.open(n, "127.0.0.1", port)
                    await write(c, [9, 1], 3, b"process")
                    assert await read(c, [9, 1], 0, 100) == b"\0\0\0process"
                    c.close()
                await stop(proc)
                proc, port = await start(mport)
                assert meta.registers[-1]["sid"] == "ds-1"
                async with trio.open_nursery() as n:
                    c = await RpcClient.open(n, "127.0.0.1", port)
                    assert await read(c, [9, 1], 0, 100) == b"\0\0\0process"
                    c.close()
                await stop(proc)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            mn.cancel_scope.cancel()

    run(main)


def test_cli_rejects_bad_options(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pfs.dataserver", "--meta", "nocolon"],
                         capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert res.returncode == 2 and "HOST:PORT" in res.stderr
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        res = subprocess.run([sys.executable, "-m", "pfs.dataserver", "--dir", str(tmp_path / "d"),
                              "--meta", "", "--port", str(busy.getsockname()[1])],
                             capture_output=True, text=True, timeout=TIMEOUT)
    finally:
        busy.close()
    assert res.returncode == 1 and "failed" in res.stderr
