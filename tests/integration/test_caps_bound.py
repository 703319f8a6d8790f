"""Capabilities bound to the file's layout and to the identity of the connection they
were issued to (docs/security.md, "Capabilities"): refused on another key's connection,
for a stripe outside the layout, on a server outside it, past the layout's limit."""
from __future__ import annotations

import errno
import functools
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pfs.client.aio import AsyncClient
from pfs.client.plan import read_request, write_request
from pfs.client.types import Cred
from pfs.core import auth
from pfs.core.config import ClientConfig, DataConfig, LayoutDefaults, MetaConfig, NodeKey
from pfs.dataserver.server import serve_data
from pfs.metaserver.server import serve_meta

TIMEOUT = 60
MAX_OBJECT = 1 << 30  # the test cluster's max_object_size


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TIMEOUT):
            await fn()

    trio.run(main)


async def expect(code: int, aw: Awaitable[Any], *words: str) -> OSError:
    with pytest.raises(OSError) as info:
        await aw
    assert info.value.errno == code, info.value
    for w in words:
        assert w in str(info.value), (w, info.value)
    return info.value


@asynccontextmanager
async def two_keys(tmp_path: Path) -> AsyncIterator[tuple[Callable[[str], ClientConfig],
                                                          list[Path]]]:
    """A key-mode cluster, files on one stripe of two data servers; node keys "alice"
    (an admin key) and "bob" (uids 1000-1999)."""
    kd = tmp_path / "keys"
    kd.mkdir(mode=0o700)
    for name in ("cluster", "alice", "bob"):
        auth.create_key(kd / f"{name}.key")
    mcfg = MetaConfig(db=str(tmp_path / "db"), port=0, map_size=1 << 28,
                      layout=LayoutDefaults(unit=4096, count=1, replicas=1),
                      key_file=str(kd / "cluster.key"),
                      max_object_size=MAX_OBJECT,
                      node_keys=[NodeKey("alice", str(kd / "alice.key"), allow_root=True),
                                 NodeKey("bob", str(kd / "bob.key"), [1000, 1999],
                                         [1000, 1999])])
    dirs = [tmp_path / f"ds{i}" for i in range(2)]
    async with trio.open_nursery() as n:
        mport = await n.start(functools.partial(serve_meta, mcfg))
        meta = f"127.0.0.1:{mport}"
        for d in dirs:
            await n.start(serve_data, DataConfig(dirs=[str(d)], port=0, meta=meta,
                                                 heartbeat=0.2, key_file=str(kd / "cluster.key"),
                                                 local_socket=False))

        def client(name: str) -> ClientConfig:
            return ClientConfig(meta=meta, key_file=str(kd / f"{name}.key"), key_name=name,
                                short_circuit=False)

        try:
            yield client, dirs
        finally:
            n.cancel_scope.cancel()


def objects_of(dirs: list[Path], ino: int) -> list[str]:
    return sorted(name for d in dirs for _root, _dirs, files in os.walk(d)
                  for name in files if name.split(".")[0] == str(ino))


def test_a_capability_replayed_from_another_key_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with two_keys(tmp_path) as (client, _dirs), \
                AsyncClient.connect(client("alice")) as alice, \
                AsyncClient.connect(client("bob"), cred=Cred(1000, 1000, ())) as bob:
            await alice.mkdir("/shared", 0o777)
            await alice.chmod("/shared", 0o777)
            f = await alice.open("/shared/f", "w+b")
            await f.pwrite(b"alice's", 0)
            sid = f.layout.servers[0][0]
            # bob, another authenticated client, captured alice's capability
            await expect(errno.EACCES, bob.data.send(sid, read_request(f.ino, 0, 0, 7, f.cap)),
                         "issued to 'alice'", "'bob'")
            await expect(errno.EACCES, bob.data.send(sid, write_request(f.ino, 0, 0, f.cap),
                                                     payload=b"bob's!!"), "issued to 'alice'")
            # on alice's own connections it still works, and nothing was changed
            r = await alice.data.send(sid, read_request(f.ino, 0, 0, 7, f.cap),
                                      into=memoryview(bytearray(7)))
            assert r.nbytes == 7
            assert await f.pread(7, 0) == b"alice's"
            # bob's own file works for bob
            g = await bob.open("/shared/g", "w+b")
            await g.pwrite(b"bob", 0)
            assert await g.pread(3, 0) == b"bob"
            await g.close()
            await f.close()

    run(main)


def test_capabilities_name_the_layout_and_its_limit(tmp_path: Path) -> None:
    async def main() -> None:
        async with two_keys(tmp_path) as (client, dirs), \
                AsyncClient.connect(client("alice")) as alice:
            f = await alice.open("/f", "w+b")
            await f.pwrite(b"x" * 100, 0)
            sid = f.layout.servers[0][0]
            servers = await alice.meta.servers()
            other = next(s for s in servers if s != sid)
            before = objects_of(dirs, f.ino)
            assert [n for n in before if not n.endswith(".crc")] == [f"{f.ino}.0"]
            await expect(errno.EACCES, alice.data.send(sid, write_request(f.ino, 999, 0, f.cap),
                                                       payload=b"evil"),
                         "stripe 999 is outside the file's layout")
            await expect(errno.EACCES, alice.data.send(other, write_request(f.ino, 0, 0, f.cap),
                                                       payload=b"evil"),
                         f"not placed on data server {other}")
            await expect(errno.EFBIG, alice.data.send(sid, write_request(f.ino, 0, 1 << 40,
                                                                         f.cap),
                                                      payload=b"evil"), "beyond the file's limit")
            # the largest offset the layout allows is still writable
            await alice.data.send(sid, write_request(f.ino, 0, MAX_OBJECT - 4, f.cap),
                                  payload=b"edge")
            await expect(errno.EFBIG, alice.data.send(sid, write_request(f.ino, 0, MAX_OBJECT - 3,
                                                                         f.cap),
                                                      payload=b"edge"))
            # no refused request made an object
            assert objects_of(dirs, f.ino) == before
            assert await f.pread(100, 0) == b"x" * 100
            await f.close()

    run(main)
