"""The metadata service over the wire: in-process with ``nursery.start`` and as a
process killed with SIGKILL."""
from __future__ import annotations

import errno
import functools
import os
import select
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from pfs.core.config import LayoutDefaults, MetaConfig
from pfs.core.messages import meta as M
from pfs.core.wire.rpc import ConnContext, Request, RpcClient, RpcService
from pfs.metaserver import deleter
from pfs.metaserver.server import MetaService, serve_meta
from pfs.metaserver.store import LmdbStore

ROOTC = [0, 0, []]
USERC = [1000, 1000, [1000]]
UNIT = 4096


def trio_test(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> None:
        trio.run(functools.partial(fn, *args, **kw))
    return wrapper


class FakeData(RpcService):
    """Records what the metaserver asks of a data server."""

    name = "fakedata"

    def __init__(self) -> None:
        super().__init__()
        self.truncates: list[tuple[list[int], int]] = []
        self.deleted: list[list[int]] = []
        self.changed = trio.Event()

    def _poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def rpc_truncate(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        self.truncates.append((req.list("obj"), req.int("size")))
        self._poke()
        return {}

    async def rpc_delete(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        objs = req.list("objs")
        self.deleted.extend(objs)
        self._poke()
        return {"deleted": len(objs)}


@dataclass
class Env:
    nursery: trio.Nursery
    port: int
    client: RpcClient
    data: dict[str, FakeData] = field(default_factory=dict)
    clients: list[RpcClient] = field(default_factory=list)

    async def call(self, method: str, **fields: Any) -> dict[str, Any]:
        return (await self.client.call(method, fields)).fields

    async def connect(self) -> RpcClient:
        c = await RpcClient.open(self.nursery, "127.0.0.1", self.port)
        self.clients.append(c)
        return c

    async def wait_for(self, cond: Callable[[], bool]) -> None:
        """Wait until a fake data server saw what ``cond`` checks."""
        with trio.fail_after(10):
            while not cond():
                events = [d.changed for d in self.data.values()]
                async with trio.open_nursery() as n:
                    for ev in events:
                        async def wait(ev: trio.Event = ev) -> None:
                            await ev.wait()
                            n.cancel_scope.cancel()
                        n.start_soon(wait)


def config(tmp_path: Path, **kw: Any) -> MetaConfig:
    return MetaConfig(db=str(tmp_path / "db"), port=0, map_size=1 << 28,
                      layout=LayoutDefaults(unit=UNIT, count=2, replicas=1), **kw)


@asynccontextmanager
async def running(tmp_path: Path, servers: int = 2, **kw: Any) -> AsyncIterator[Env]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_meta, config(tmp_path, **kw)))
        env = Env(nursery, port, await RpcClient.open(nursery, "127.0.0.1", port))
        assert await env.call("hello", client="test") == {"root": 1, "version": 1}
        for _ in range(servers):
            fake = FakeData()
            dport = await nursery.start(fake.serve, "127.0.0.1", 0)
            sid = (await env.call("register", sid=None, host="127.0.0.1", port=dport,
                                  total=1 << 30, free=1 << 29))["sid"]
            env.data[sid] = fake
        env.clients.append(env.client)
        try:
            yield env
        finally:
            for c in env.clients:
                c.close()
            nursery.cancel_scope.cancel()


async def expect(code: int, aw: Awaitable[Any]) -> None:
    with pytest.raises(OSError) as info:
        await aw
    assert info.value.errno == code, info.value


@trio_test
async def test_namespace_over_the_wire(tmp_path: Path) -> None:
    async with running(tmp_path) as env:
        d = (await env.call("mkdir", parent=1, name=b"d", mode=0o755, cred=ROOTC))["attr"]
        assert stat.S_ISDIR(d["mode"])
        await expect(errno.EEXIST, env.call("mkdir", parent=1, name=b"d", mode=0o755, cred=ROOTC))
        await expect(errno.EINVAL, env.call("mkdir", parent=1, name=b"d"))  # no cred
        await expect(errno.ENOSYS, env.call("no_such_method"))
        r = await env.call("create", parent=d["ino"], name="f", mode=0o644,
                           flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
        f, fh, layout = r["attr"], r["fh"], r["layout"]
        assert layout["count"] == 2 and sorted(s[0] for s in layout["servers"]) == sorted(env.data)
        assert (await env.call("commit_size", fh=fh, written_end=3 * UNIT, mtime=None))["attr"]["size"] == 3 * UNIT
        await env.call("close", fh=fh, written_end=5 * UNIT, mtime=123)
        await expect(errno.EBADF, env.call("close", fh=fh))
        a = (await env.call("getattr", ino=f["ino"]))["attr"]
        assert a["size"] == 5 * UNIT and a["mtime"] == 123
        got = await env.call("resolve", path=b"/d/f", follow=True, cred=ROOTC)
        assert got["attr"]["ino"] == f["ino"] and got["parent"] == d["ino"] and got["name"] == b"f"
        assert (await env.call("lookup", parent=d["ino"], name=b"f", cred=ROOTC))["attr"] == a
        rd = await env.call("readdir", ino=d["ino"], cookie=0, limit=10, plus=True, cred=ROOTC)
        assert rd["eof"] and [e[0] for e in rd["entries"]] == [b"f"] and rd["entries"][0][4] == a
        await env.call("symlink", parent=1, name=b"s", target=b"d/f", cred=ROOTC)
        s = await env.call("resolve", path="/s", follow=False, cred=ROOTC)
        assert (await env.call("readlink", ino=s["attr"]["ino"]))["target"] == b"d/f"
        await env.call("link", ino=f["ino"], newparent=1, newname=b"hard", cred=ROOTC)
        await env.call("rename", parent=1, name=b"hard", newparent=d["ino"], newname=b"g",
                       flags=0, cred=ROOTC)
        await env.call("setxattr", ino=f["ino"], name=b"user.k", value=b"v", flags=0, cred=ROOTC)
        assert (await env.call("getxattr", ino=f["ino"], name=b"user.k", cred=ROOTC))["value"] == b"v"
        assert (await env.call("listxattr", ino=f["ino"], cred=ROOTC))["names"] == [b"user.k"]
        await env.call("removexattr", ino=f["ino"], name=b"user.k", cred=ROOTC)
        await env.call("access", ino=f["ino"], mask=os.R_OK, cred=USERC)
        await expect(errno.EACCES, env.call("access", ino=f["ino"], mask=os.W_OK, cred=USERC))
        await expect(errno.EACCES, env.call("open", ino=f["ino"], flags=os.O_WRONLY, cred=USERC))
        lay = await env.call("set_layout", ino=d["ino"], unit=2 * UNIT, count=1, replicas=1,
                             cred=ROOTC)
        assert lay["layout"]["count"] == 1
        assert (await env.call("get_layout", ino=d["ino"]))["layout"]["unit"] == 2 * UNIT
        st = await env.call("statfs")
        assert st["blocks"] == 2 * (1 << 30) // 4096 and st["namemax"] == 255
        servers = (await env.call("servers"))["servers"]
        assert set(servers) == set(env.data) and all(s["alive"] for s in servers.values())
        sid = next(iter(env.data))
        await env.call("heartbeat", sid=sid, total=1 << 30, free=1 << 20)
        assert (await env.call("servers"))["servers"][sid]["free"] == 1 << 20
        await expect(errno.ENOENT, env.call("heartbeat", sid="nope", total=1, free=1))
        fifo = await env.call("mknod", parent=1, name=b"fifo", mode=stat.S_IFIFO | 0o644,
                              rdev=0, cred=ROOTC)
        assert stat.S_ISFIFO(fifo["attr"]["mode"])
        await expect(errno.ENOTEMPTY, env.call("rmdir", parent=1, name=b"d", cred=ROOTC))
        await expect(errno.EISDIR, env.call("unlink", parent=1, name=b"d", cred=ROOTC))


@trio_test
async def test_truncate_and_delete_reach_data_servers(tmp_path: Path) -> None:
    async with running(tmp_path) as env:
        r = await env.call("create", parent=1, name=b"f", mode=0o644,
                           flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
        ino, layout = r["attr"]["ino"], r["layout"]
        await env.call("close", fh=r["fh"], written_end=10 * UNIT, mtime=None)
        # shrink: every object is cut before the reply
        a = (await env.call("setattr", ino=ino, size=3 * UNIT + 5, cred=ROOTC))["attr"]
        assert a["size"] == 3 * UNIT + 5
        cuts = sorted((tuple(o), s) for d in env.data.values() for o, s in d.truncates)
        assert cuts == [((ino, 0), 2 * UNIT), ((ino, 1), UNIT + 5)]
        # growing does not touch the data servers
        await env.call("setattr", ino=ino, size=20 * UNIT, cred=ROOTC)
        assert sum(len(d.truncates) for d in env.data.values()) == 2
        # O_TRUNC cuts to zero first
        r2 = await env.call("open", ino=ino, flags=os.O_RDWR | os.O_TRUNC, cred=ROOTC)
        assert r2["attr"]["size"] == 0
        assert sorted(s for d in env.data.values() for _, s in d.truncates[-1:]) == [0, 0]
        await env.call("close", fh=r2["fh"], written_end=None, mtime=None)
        # unlink queues the objects for deletion; the deleter sends them
        await env.call("unlink", parent=1, name=b"f", cred=ROOTC)
        want = sorted([ino, i] for i in range(len(layout["servers"])))
        await env.wait_for(lambda: sorted(o for d in env.data.values() for o in d.deleted) == want)


@trio_test
async def test_unlinked_while_open(tmp_path: Path) -> None:
    async with running(tmp_path) as env:
        r = await env.call("create", parent=1, name=b"f", mode=0o644,
                           flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
        ino = r["attr"]["ino"]
        other = await env.connect()
        r2 = (await other.call("open", {"ino": ino, "flags": os.O_RDONLY, "cred": ROOTC})).fields
        await env.call("unlink", parent=1, name=b"f", cred=ROOTC)
        a = (await env.call("getattr", ino=ino))["attr"]
        assert a["nlink"] == 0  # still there while open
        await expect(errno.ENOENT, env.call("open", ino=ino, flags=os.O_RDONLY, cred=ROOTC))
        await env.call("close", fh=r["fh"], written_end=UNIT, mtime=None)
        assert (await env.call("getattr", ino=ino))["attr"]["size"] == UNIT
        assert r2["fh"]
        other.close()  # the last handle goes with its connection
        await env.wait_for(lambda: any(d.deleted for d in env.data.values()))
        await expect(errno.ENOENT, env.call("getattr", ino=ino))


@trio_test
async def test_group_commit_concurrent_creates(tmp_path: Path) -> None:
    commits = 0

    class Counting(LmdbStore):
        def write(self, headroom: bool = False):  # type: ignore[no-untyped-def]
            nonlocal commits
            commits += 1
            return super().write(headroom)

    store = Counting(tmp_path / "db", 1 << 28)
    n = 400
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_meta, config(tmp_path), store=store))
        service_clients = [await RpcClient.open(nursery, "127.0.0.1", port) for _ in range(4)]
        c0 = service_clients[0]
        fake = FakeData()
        dport = await nursery.start(fake.serve, "127.0.0.1", 0)
        await c0.call("register", {"sid": "s1", "host": "127.0.0.1", "port": dport,
                                   "total": 1 << 30, "free": 1 << 29})
        d = (await c0.call("mkdir", {"parent": 1, "name": b"d", "mode": 0o777,
                                     "cred": ROOTC})).fields["attr"]["ino"]
        before = commits
        results: list[Any] = []

        async def make(i: int) -> None:
            c = service_clients[i % 4]
            try:
                r = await c.call("mkdir" if i % 3 == 0 else "mknod",
                                 {"parent": d, "name": b"e%d" % i, "mode": 0o644 | (
                                     stat.S_IFDIR if i % 3 == 0 else stat.S_IFREG),
                                  "rdev": 0, "cred": ROOTC})
                results.append(r.fields["attr"]["ino"])
            except OSError as exc:
                results.append(exc)

        async with trio.open_nursery() as burst:
            for i in range(n):
                burst.start_soon(make, i)
            # one duplicate name fails alone, inside a batch of good ones
            burst.start_soon(make, 0)
        errors = [r for r in results if isinstance(r, OSError)]
        assert len(errors) == 1 and errors[0].errno == errno.EEXIST
        # grouped: fewer commits than creates, by at least half. (A commit no longer waits
        # for its meta page's flush, so the writer turns round sooner and a burst from 4
        # connections packs about 4 creates per commit here, rather than n/4 in all.)
        assert commits - before < n / 2, "creates were not grouped into shared commits"
        names: list[bytes] = []
        cookie = 0
        while True:
            rd = (await c0.call("readdir", {"ino": d, "cookie": cookie, "limit": 100,
                                            "cred": ROOTC})).fields
            names += [e[0] for e in rd["entries"]]
            if rd["eof"]:
                break
            cookie = rd["entries"][-1][3]
        assert sorted(names) == sorted(b"e%d" % i for i in range(n))
        attr = (await c0.call("getattr", {"ino": d})).fields["attr"]
        assert attr["nlink"] == 2 + len(range(0, n, 3))
        for c in service_clients:
            c.close()
        nursery.cancel_scope.cancel()


@trio_test
async def test_no_servers_and_dead_servers(tmp_path: Path) -> None:
    async with running(tmp_path, servers=0) as env:
        await expect(errno.ENOSPC, env.call("create", parent=1, name=b"f", mode=0o644,
                                            flags=os.O_CREAT | os.O_WRONLY, cred=ROOTC))
        assert (await env.call("statfs"))["blocks"] == 0
    async with running(tmp_path, servers=1, heartbeat_timeout=0.0) as env:
        servers = (await env.call("servers"))["servers"]
        assert len(servers) == 1 and not next(iter(servers.values()))["alive"]
        await expect(errno.ENOSPC, env.call("mknod", parent=1, name=b"f", mode=0o644, rdev=0,
                                            cred=ROOTC))


# ---------------------------------------------------------------------------
# a real process, killed with SIGKILL
# ---------------------------------------------------------------------------
def start_process(db: Path) -> tuple[subprocess.Popen[bytes], int]:
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pfs.metaserver", "--db", str(db), "--host", "127.0.0.1",
         "--port", "0", "--ready-fd", str(wfd), "--log-level", "WARNING"],
        pass_fds=(wfd,), stdin=subprocess.DEVNULL)
    os.close(wfd)
    try:
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([rfd], [], [], 60)
            assert ready, "metaserver did not report readiness"
            chunk = os.read(rfd, 64)
            assert chunk, f"metaserver exited with {proc.wait()}"
            line += chunk
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        os.close(rfd)
    return proc, int(line)


def test_acknowledged_changes_survive_kill9(tmp_path: Path) -> None:
    db = tmp_path / "db"
    proc, port = start_process(db)
    expected: dict[bytes, int] = {}
    state: dict[str, Any] = {}

    async def phase1() -> None:
        async with trio.open_nursery() as nursery:
            c = await RpcClient.open(nursery, "127.0.0.1", port)

            async def call(method: str, **f: Any) -> dict[str, Any]:
                return (await c.call(method, f)).fields

            await call("register", sid="s1", host="127.0.0.1", port=9, total=1 << 30, free=1 << 29)
            d = (await call("mkdir", parent=1, name=b"d", mode=0o755, cred=ROOTC))["attr"]["ino"]
            state["d"] = d

            async def make(i: int) -> None:
                r = await call("create", parent=d, name=b"f%d" % i, mode=0o644,
                               flags=os.O_CREAT | os.O_WRONLY, cred=ROOTC)
                await call("close", fh=r["fh"], written_end=i, mtime=None)
                expected[b"f%d" % i] = r["attr"]["ino"]

            async with trio.open_nursery() as burst:
                for i in range(60):
                    burst.start_soon(make, i)
            await call("rename", parent=d, name=b"f1", newparent=1, newname=b"moved",
                       flags=0, cred=ROOTC)
            state["moved"] = expected.pop(b"f1")
            await call("unlink", parent=d, name=b"f2", cred=ROOTC)
            state["gone"] = expected.pop(b"f2")
            await call("setxattr", ino=d, name=b"user.x", value=b"y", flags=0, cred=ROOTC)
            # an orphan: unlinked while open, then the process dies with it open
            r = await call("create", parent=d, name=b"orphan", mode=0o644,
                           flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
            state["orphan"] = r["attr"]["ino"]
            await call("unlink", parent=d, name=b"orphan", cred=ROOTC)
            assert (await call("getattr", ino=state["orphan"]))["attr"]["nlink"] == 0
            proc.send_signal(signal.SIGKILL)  # right after the last acknowledgement
            proc.wait()
            c.close()
            nursery.cancel_scope.cancel()

    try:
        trio.run(phase1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    proc, port = start_process(db)

    async def phase2() -> None:
        async with trio.open_nursery() as nursery:
            c = await RpcClient.open(nursery, "127.0.0.1", port)

            async def call(method: str, **f: Any) -> dict[str, Any]:
                return (await c.call(method, f)).fields

            d = state["d"]
            names: dict[bytes, int] = {}
            cookie = 0
            while True:
                rd = await call("readdir", ino=d, cookie=cookie, limit=16, cred=ROOTC)
                names.update({e[0]: e[1] for e in rd["entries"]})
                if rd["eof"]:
                    break
                cookie = rd["entries"][-1][3]
            assert names == expected
            for name, ino in expected.items():
                assert (await call("getattr", ino=ino))["attr"]["size"] == int(name[1:])
            moved = await call("lookup", parent=1, name=b"moved", cred=ROOTC)
            assert moved["attr"]["ino"] == state["moved"]
            await expect(errno.ENOENT, call("getattr", ino=state["gone"]))
            await expect(errno.ENOENT, call("getattr", ino=state["orphan"]))  # reclaimed
            assert (await call("getxattr", ino=d, name=b"user.x", cred=ROOTC))["value"] == b"y"
            assert "s1" in (await call("servers"))["servers"]
            c.close()
            nursery.cancel_scope.cancel()

    try:
        trio.run(phase2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_service_on_memory_store() -> None:
    from pfs.metaserver.store import MemoryStore

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            svc = MetaService(MemoryStore(), MetaConfig(port=0))
            port = await nursery.start(svc.serve_all, "127.0.0.1", 0)
            c = await RpcClient.open(nursery, "127.0.0.1", port)
            async with trio.open_nursery() as burst:
                for i in range(50):
                    burst.start_soon(c.call, "mkdir",
                                     {"parent": 1, "name": b"d%d" % i, "mode": 0o755,
                                      "cred": ROOTC})
            assert (await c.call("getattr", {"ino": 1})).fields["attr"]["nlink"] == 52
            c.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_cancelled_open_handlers_leave_no_open_count() -> None:
    """A create or O_TRUNC open whose handler is cancelled (its connection reset) while
    the operation waits in the group-commit queue must not leave the inode counted as
    open: unlinking it later deletes it instead of keeping an orphan forever."""
    from pfs.metaserver.store import MemoryStore

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            svc = MetaService(MemoryStore(), MetaConfig(port=0))
            await nursery.start(svc.run)
            svc.registry.register("s1", "127.0.0.1", 1, 1 << 30, 1 << 29)
            ctx = ConnContext(None, "test")  # type: ignore[arg-type]
            flags = os.O_CREAT | os.O_RDWR
            with trio.CancelScope() as scope:
                scope.cancel()
                await svc.rpc_create(ctx, M.Create.from_wire({
                    "parent": 1, "name": b"f", "mode": 0o644, "flags": flags, "cred": ROOTC}))
            await svc.commit.mutate(lambda t: None)  # the queued create has run
            got = await svc.rpc_lookup(ctx, M.Lookup.from_wire({
                "parent": 1, "name": b"f", "cred": ROOTC}))
            ino = got.attr["ino"]
            assert not svc.handles.is_open(ino)
            with trio.CancelScope() as scope:
                scope.cancel()
                await svc.rpc_open(ctx, M.Open.from_wire({
                    "ino": ino, "flags": os.O_RDWR | os.O_TRUNC, "cred": ROOTC}))
            await svc.commit.mutate(lambda t: None)
            assert not svc.handles.is_open(ino)
            await svc.rpc_unlink(ctx, M.Unlink.from_wire({"parent": 1, "name": b"f",
                                                          "cred": ROOTC}))
            await expect(errno.ENOENT, svc.rpc_getattr(ctx, M.Getattr(ino=ino)))
            nursery.cancel_scope.cancel()

    trio.run(main)


class _RecordingConn:
    """A connection's stand-in for ``MetaService.take``: records the frames sent."""

    _raw = None  # no plain socket: replies go through ``send_frame`` in a task

    def __init__(self) -> None:
        self.closed = False
        self.frames: list[tuple[int, int, dict[str, Any]]] = []

    async def send_frame(self, kind: int, rid: int, fields: dict[str, Any],
                         payload: Any = None) -> None:
        self.frames.append((kind, rid, fields))


async def _taking_service(nursery: trio.Nursery
                          ) -> tuple[MetaService, _RecordingConn, ConnContext]:
    """A running service with one data server, and a recorded connection to take from."""
    from pfs.core.auth import OPEN
    from pfs.metaserver.store import MemoryStore

    svc = MetaService(MemoryStore(), MetaConfig(port=0))
    await nursery.start(svc.run)
    svc.registry.register("s1", "127.0.0.1", 1, 1 << 30, 1 << 29)
    conn = _RecordingConn()
    ctx = ConnContext(conn, "test", identity=OPEN)  # type: ignore[arg-type]
    ctx.tasks = nursery
    return svc, conn, ctx


def test_taken_creates_answer_after_the_commit_or_drop_their_open_count() -> None:
    """A create (or another entry change) the reader hands straight to the group
    commit (``take``) is answered from the writer once durable, with a handle; if its
    connection closed before that,
    nobody gets the handle, so its open count is dropped: an unlink then deletes the
    file instead of keeping an orphan forever."""
    from pfs.core.wire.protocol import Kind

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            svc, conn, ctx = await _taking_service(nursery)
            flags = os.O_CREAT | os.O_EXCL | os.O_RDWR

            def create(rid: int, name: bytes) -> None:
                ctx.inflight.add(rid)
                assert svc.take(ctx, rid, Request("create", {
                    "parent": 1, "name": name, "mode": 0o644, "flags": flags,
                    "cred": ROOTC}, None))

            create(1, b"kept")
            create(2, b"kept")  # EEXIST, answered as an error
            await svc.commit.mutate(lambda t: None)  # both ran and were answered
            await trio.testing.wait_all_tasks_blocked()
            replies = {rid: (kind, fields) for kind, rid, fields in conn.frames}
            assert replies[1][0] == Kind.REPLY and replies[1][1]["fh"] and replies[1][1]["cap"]
            assert replies[2][0] == Kind.ERROR and not ctx.inflight
            kept = replies[1][1]["attr"]["ino"]
            assert svc.handles.is_open(kept)
            ctx.inflight.add(4)  # another entry change, taken the same way
            assert svc.take(ctx, 4, Request("mkdir", {
                "parent": 1, "name": b"d", "mode": 0o755, "cred": ROOTC, "want_parent": True},
                None))
            await svc.commit.mutate(lambda t: None)
            await trio.testing.wait_all_tasks_blocked()
            kind, _, made = conn.frames[-1]
            assert kind == Kind.REPLY and stat.S_ISDIR(made["attr"]["mode"])
            assert made["parent_attr"]["nlink"] == 3
            create(3, b"lost")
            conn.closed = True  # the connection ends before the commit
            await svc.commit.mutate(lambda t: None)
            assert 3 not in {rid for _, rid, _ in conn.frames}
            lost = (await svc.rpc_lookup(ctx, M.Lookup.from_wire({
                "parent": 1, "name": b"lost", "cred": ROOTC}))).attr["ino"]
            assert not svc.handles.is_open(lost)
            await svc.rpc_unlink(ctx, M.Unlink.from_wire({"parent": 1, "name": b"lost",
                                                          "cred": ROOTC}))
            await expect(errno.ENOENT, svc.rpc_getattr(ctx, M.Getattr(ino=lost)))
            svc.connection_lost(ctx)
            assert not svc.handles.is_open(kept)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_taken_closes_setattrs_renames_and_links_answer_after_the_commit() -> None:
    """A close with a size to commit, a setattr that cuts no object, a rename and a
    link are taken by the reader too and answered from the writer once durable. The
    closed handle leaves its connection at once, so a close whose connection died
    before its commit still drops the open count: the file unlinked while open is
    reclaimed. A truncation that must reach data servers first is not taken."""
    from pfs.core.wire.protocol import Kind

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            svc, conn, ctx = await _taking_service(nursery)
            rids = iter(range(1, 100))

            async def take(method: str, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
                rid = next(rids)
                ctx.inflight.add(rid)
                assert svc.take(ctx, rid, Request(method, {**fields, "cred": ROOTC}, None))
                await svc.commit.mutate(lambda t: None)  # its batch is durable
                await svc.commit.mutate(lambda t: None)  # and a reclaim it queued
                await trio.testing.wait_all_tasks_blocked()
                sent = {r: (k, f) for k, r, f in conn.frames}
                assert rid in sent and rid not in ctx.inflight, method
                return sent[rid]

            flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
            kind, made = await take("create", {"parent": 1, "name": b"f", "mode": 0o644,
                                               "flags": flags})
            ino, fh = made["attr"]["ino"], made["fh"]
            kind, _ = await take("close", {"fh": fh, "written_end": 3901, "mtime": 7})
            assert kind == Kind.REPLY and not svc.handles.is_open(ino)
            assert (await svc.rpc_getattr(ctx, M.Getattr(ino=ino))).attr["size"] == 3901
            kind, got = await take("setattr", {"ino": ino, "mode": 0o600})
            assert kind == Kind.REPLY and got["attr"]["mode"] & 0o777 == 0o600
            kind, _ = await take("rename", {"parent": 1, "name": b"f", "newparent": 1,
                                            "newname": b"g"})
            assert kind == Kind.REPLY
            kind, got = await take("link", {"ino": ino, "newparent": 1, "newname": b"h"})
            assert kind == Kind.REPLY and got["attr"]["nlink"] == 2
            kind, _ = await take("close", {"fh": fh, "written_end": 1})
            assert kind == Kind.ERROR  # closed already: EBADF, answered
            # cutting a written file reaches the data servers first: the handler's way
            assert not svc.take(ctx, 99, Request("setattr", {"ino": ino, "size": 1,
                                                              "cred": ROOTC}, None))

            # a close whose connection is gone before its commit: no open count left
            _, made = await take("create", {"parent": 1, "name": b"o", "mode": 0o644,
                                            "flags": flags})
            ino, fh = made["attr"]["ino"], made["fh"]
            await svc.rpc_unlink(ctx, M.Unlink.from_wire({"parent": 1, "name": b"o",
                                                          "cred": ROOTC}))
            assert svc.handles.is_open(ino)  # an orphan while open
            rid = next(rids)
            ctx.inflight.add(rid)
            assert svc.take(ctx, rid, Request("close", {"fh": fh, "written_end": 10,
                                                        "cred": ROOTC}, None))
            conn.closed = True
            svc.connection_lost(ctx)
            await svc.commit.mutate(lambda t: None)
            await svc.commit.mutate(lambda t: None)
            assert rid not in {r for _, r, _ in conn.frames}
            assert not svc.handles.is_open(ino)
            await expect(errno.ENOENT, svc.rpc_getattr(ctx, M.Getattr(ino=ino)))
            nursery.cancel_scope.cancel()

    trio.run(main)


class FlakyData(FakeData):
    """Refuses its first delete request."""

    refusals = 1

    async def rpc_delete(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        if self.refusals:
            self.refusals -= 1
            self._poke()
            raise OSError(errno.EIO, "disk hiccup")
        return await super().rpc_delete(ctx, req)


@trio_test
async def test_failed_deletion_is_retried_soon(tmp_path: Path) -> None:
    """A deletion a data server refused is sent again after DELETE_RETRY seconds, not
    only when some later change happens to wake the deleter (or after 30 s)."""
    async with running(tmp_path, servers=0) as env:
        fake = FlakyData()
        dport = await env.nursery.start(fake.serve, "127.0.0.1", 0)
        sid = (await env.call("register", sid=None, host="127.0.0.1", port=dport,
                              total=1 << 30, free=1 << 29))["sid"]
        env.data[sid] = fake
        r = await env.call("create", parent=1, name=b"f", mode=0o644,
                           flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
        await env.call("close", fh=r["fh"], written_end=UNIT, mtime=None)
        await env.call("unlink", parent=1, name=b"f", cred=ROOTC)
        await env.wait_for(lambda: fake.refusals == 0)
        await env.wait_for(lambda: fake.deleted != [])  # fails after 10 s


@trio_test
async def test_deletions_stuck_on_one_server_do_not_block_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full round's worth of queued deletions that one data server keeps refusing
    (a failed disk, a server gone for good) must not stop deletions on the others."""
    monkeypatch.setattr(deleter, "DELETE_BATCH", 2)
    async with running(tmp_path, servers=0) as env:
        await env.call("set_layout", ino=1, unit=UNIT, count=1, replicas=1, cred=ROOTC)
        bad = FlakyData()
        bad.refusals = 1 << 30
        good = FakeData()
        sids = []
        for fake in (bad, good):
            dport = await env.nursery.start(fake.serve, "127.0.0.1", 0)
            sid = (await env.call("register", sid=None, host="127.0.0.1", port=dport,
                                  total=1 << 30, free=1 << 29))["sid"]
            env.data[sid] = fake
            sids.append(sid)
            for i in range(3 if fake is bad else 1):
                r = await env.call("create", parent=1, name=b"f%d" % len(env.data) + b"%d" % i,
                                   mode=0o644, flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
                await env.call("close", fh=r["fh"], written_end=UNIT, mtime=None)
                if fake is bad:
                    assert r["layout"]["servers"] == [[sids[0]]]
            if fake is bad:
                await env.call("heartbeat", sid=sid, total=1 << 30, free=0)  # place on good
        assert r["layout"]["servers"] == [[sids[1]]]
        for name in (b"f10", b"f11", b"f12", b"f20"):
            await env.call("unlink", parent=1, name=name, cred=ROOTC)
        await env.wait_for(lambda: good.deleted != [])  # fails after 10 s


@trio_test
async def test_truncate_with_a_replica_down_cuts_no_replica(tmp_path: Path) -> None:
    """A shrink that fails (EIO) because one replica's data server is unreachable must
    not have cut the other replicas first: the size stays, so reads of the surviving
    copy would return zeros for data the file still has."""
    async with running(tmp_path, servers=0) as env:
        await env.call("set_layout", ino=1, unit=UNIT, count=1, replicas=2, cred=ROOTC)
        fakes = [FakeData(), FakeData()]
        down = trio.CancelScope()
        for fake in fakes:
            async def serve(fake: FakeData = fake, *,
                            task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
                            ) -> None:
                with down if fake is fakes[1] else trio.CancelScope():
                    await fake.serve("127.0.0.1", 0, task_status=task_status)
            dport = await env.nursery.start(serve)
            sid = (await env.call("register", sid=None, host="127.0.0.1", port=dport,
                                  total=1 << 30, free=1 << 29))["sid"]
            env.data[sid] = fake
        r = await env.call("create", parent=1, name=b"f", mode=0o644,
                           flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
        assert sorted(r["layout"]["servers"][0]) == sorted(env.data)
        await env.call("close", fh=r["fh"], written_end=10 * UNIT, mtime=None)
        down.cancel()  # the second replica's server goes away (not yet timed out)
        await trio.sleep(0.05)
        await expect(errno.EIO, env.call("setattr", ino=r["attr"]["ino"], size=0, cred=ROOTC))
        await expect(errno.EIO, env.call("open", ino=r["attr"]["ino"],
                                         flags=os.O_RDWR | os.O_TRUNC, cred=ROOTC))
        assert (await env.call("getattr", ino=r["attr"]["ino"]))["attr"]["size"] == 10 * UNIT
        assert fakes[0].truncates == []


@trio_test
async def test_deleter_survives_a_failed_commit(tmp_path: Path) -> None:
    """The commit that drops finished deletions from the queue can fail (disk full, I/O
    error) like any other; the metaserver must go on serving and retry, not crash."""
    failing = [False]

    class Failing(LmdbStore):
        def write(self, headroom: bool = False):  # type: ignore[no-untyped-def]
            if failing[0]:
                failing[0] = False
                raise OSError(errno.EIO, "disk trouble")
            return super().write(headroom)

    class Tripping(FakeData):
        async def rpc_delete(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
            if not self.deleted:
                failing[0] = True  # the commit after this round fails
            return await super().rpc_delete(ctx, req)

    store = Failing(tmp_path / "db", 1 << 28)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_meta, config(tmp_path), store=store))
        client = await RpcClient.open(nursery, "127.0.0.1", port)
        fake = Tripping()
        dport = await nursery.start(fake.serve, "127.0.0.1", 0)
        await client.call("register", {"sid": "s1", "host": "127.0.0.1", "port": dport,
                                       "total": 1 << 30, "free": 1 << 29})
        r = (await client.call("create", {"parent": 1, "name": b"f", "mode": 0o644,
                                          "flags": os.O_CREAT | os.O_RDWR,
                                          "cred": ROOTC})).fields
        await client.call("close", {"fh": r["fh"], "written_end": UNIT})
        await client.call("unlink", {"parent": 1, "name": b"f", "cred": ROOTC})
        with trio.fail_after(10):
            while len(fake.deleted) < 2:  # sent again: the first round's commit failed
                await fake.changed.wait()
        with trio.fail_after(10):
            while True:  # and the queue empties
                with store.read() as txn:
                    if not list(txn.scan(b"Q")):
                        break
                await trio.sleep(0.05)
        assert (await client.call("getattr", {"ino": 1})).fields["attr"]["ino"] == 1
        client.close()
        nursery.cancel_scope.cancel()


@trio_test
async def test_refused_setattr_cuts_no_data(tmp_path: Path) -> None:
    """A setattr that shrinks the file and also asks for something the caller may not
    do (chmod by a non-owner) is refused as a whole: no object is cut first."""
    async with running(tmp_path) as env:
        r = await env.call("create", parent=1, name=b"f", mode=0o666,
                           flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
        ino = r["attr"]["ino"]
        await env.call("close", fh=r["fh"], written_end=10 * UNIT, mtime=None)
        await expect(errno.EPERM, env.call("setattr", ino=ino, size=0, mode=0o777, cred=USERC))
        await expect(errno.EPERM, env.call("setattr", ino=ino, size=0, mtime=5, cred=USERC))
        assert (await env.call("getattr", ino=ino))["attr"]["size"] == 10 * UNIT
        assert all(d.truncates == [] for d in env.data.values())
        a = (await env.call("setattr", ino=ino, size=UNIT, cred=USERC))["attr"]  # allowed
        assert a["size"] == UNIT and any(d.truncates for d in env.data.values())


@trio_test
async def test_entry_changes_can_answer_with_the_parents_new_attributes(tmp_path: Path) -> None:
    """``want_parent``: the reply carries the directory's attributes after the change (the
    mount answers the kernel's next GETATTR of the directory from them)."""
    async with running(tmp_path) as env:
        d = (await env.call("mkdir", parent=1, name=b"d", mode=0o755, cred=ROOTC))["attr"]
        r = await env.call("create", parent=d["ino"], name=b"f", mode=0o644,
                           flags=os.O_CREAT | os.O_WRONLY, cred=ROOTC, want_parent=True)
        now = (await env.call("getattr", ino=d["ino"]))["attr"]
        assert r["parent_attr"] == now and now["mtime"] > d["mtime"]
        await env.call("close", fh=r["fh"])
        r = await env.call("mkdir", parent=d["ino"], name=b"sub", mode=0o755, cred=ROOTC,
                           want_parent=True)
        assert r["parent_attr"] == (await env.call("getattr", ino=d["ino"]))["attr"]
        assert r["parent_attr"]["nlink"] == 3 and r["attr"]["nlink"] == 2
        r = await env.call("unlink", parent=d["ino"], name=b"f", cred=ROOTC, want_parent=True)
        assert r == {"parent_attr": (await env.call("getattr", ino=d["ino"]))["attr"]}
        r = await env.call("rmdir", parent=d["ino"], name=b"sub", cred=ROOTC)
        assert r == {}  # not asked for


@trio_test
async def test_closes_ride_on_the_next_request(tmp_path: Path) -> None:
    """``closes``: handles released along with any request, before it; an orphan's last
    handle going that way is reclaimed; unknown handles are skipped; bad ones refused."""
    async with running(tmp_path) as env:
        r = await env.call("create", parent=1, name=b"f", mode=0o644,
                           flags=os.O_CREAT | os.O_RDWR, cred=ROOTC)
        await env.call("close", fh=r["fh"], written_end=UNIT, mtime=None)
        o = await env.call("open", ino=r["attr"]["ino"], flags=os.O_RDONLY, cred=ROOTC)
        await env.call("unlink", parent=1, name=b"f", cred=ROOTC)  # open: an orphan
        await env.call("getattr", ino=1, closes=[o["fh"], 999])
        await expect(errno.EBADF, env.call("close", fh=o["fh"]))
        await env.wait_for(lambda: any(d.deleted for d in env.data.values()))
        await expect(errno.EINVAL, env.call("release", closes=["x"]))
        assert await env.call("release", closes=[]) == {}
