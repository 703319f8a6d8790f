"""Short-circuit KV gets (``pfs.kvcache.local``): a client on a data server's host reads
blocks from the server's slabs through the index it publishes in shared memory. Every
read is checked; a slot that is stale, torn or names another record, a slab evicted
meanwhile and damaged bytes cost a fallback to the server or a miss, never wrong bytes;
descriptors only over the local socket, to a key that may read every namespace."""
from __future__ import annotations

import errno
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from pfs.core import auth
from pfs.core import kvformat as F
from pfs.core.engine import PosixEngine
from pfs.core.messages import kv as K
from pfs.core.wire.connect import open_rpc
from pfs.core.wire.transport import local_socket_name
from pfs.dataserver.kvstore import KvStore
from pfs.dataserver.objects import ObjectStore
from pfs.dataserver.server import DataService
from pfs.kvcache import KVCache
from pfs.kvcache.local import ASK, MISS, LocalKv, NeedSlab, connect_local
from pfs.kvcache.remote import KvServerClient
from tests.conftest import run_threads

NS = "model-local"
NSB = NS.encode()


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(60):
            await fn()

    trio.run(main)


class Server:
    def __init__(self, service: DataService, kvs: KvStore, port: int, sid: str) -> None:
        self.service, self.kvs, self.port, self.sid = service, kvs, port, sid


@asynccontextmanager
async def server(tmp_path: Path, budget: int = 8 << 20, *, slab_bytes: int = 0,
                 server_auth: auth.ServerAuth | None = None,
                 kv_namespaces: dict[str, set[str]] | None = None) -> AsyncIterator[Server]:
    store = ObjectStore([str(tmp_path / "d0")])
    engine = PosixEngine()
    kvs = KvStore(store.dirs, budget, slab_bytes=slab_bytes)
    kvs.publish()
    service = DataService(store, engine, auth=server_auth, kv=kvs,
                          kv_namespaces=kv_namespaces)
    service.sid = f"kvtest-{uuid.uuid4().hex[:12]}"
    service.sid_known.set()
    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(service.serve, "127.0.0.1", 0)
            await nursery.start(service.serve_unix, local_socket_name(service.sid))
            yield Server(service, kvs, port, service.sid)
            nursery.cancel_scope.cancel()
    finally:
        kvs.close()
        engine.close()
        store.close()


async def local_get(lk: LocalKv, key: bytes, out: memoryview) -> int:
    """A short-circuit get, descriptors fetched as met: length, MISS or ASK."""
    for _ in range(2):
        got = lk.get_into(NSB, key, out)
        if not isinstance(got, NeedSlab):
            return got
        await lk.open_slab(got.slab)
    return ASK


def value_of(key: bytes, n: int) -> bytes:
    return (key * (n // len(key) + 1))[:n]


def test_local_gets_read_the_slabs_and_check_every_block(tmp_path: Path) -> None:
    sizes = [1, 5000, 16 << 10, 300_000, 2 << 20]

    async def main() -> None:
        async with server(tmp_path) as srv, \
                KvServerClient.connect("127.0.0.1", srv.port) as kv:
            keys = [b"blk-%d" % i for i in range(len(sizes))]
            for k, n in zip(keys, sizes, strict=True):
                await kv.put(NS, k, value_of(k, n))
            lk = await connect_local(srv.sid, auth.ClientAuth())
            assert lk is not None
            hits_before = srv.kvs.counters.hits
            out = memoryview(bytearray(4 << 20))
            for k, n in zip(keys, sizes, strict=True):
                assert await local_get(lk, k, out) == n
                assert out[:n] == value_of(k, n)
            assert srv.kvs.counters.hits == hits_before  # no request reached the server
            assert await local_get(lk, b"absent", out) == MISS
            assert lk.get_into(b"other-ns", keys[0], out) == MISS  # namespaces apart
            # a put of a key and its removal are seen at once (the reply follows them)
            await kv.put(NS, b"late", b"L" * 100)
            assert await local_get(lk, b"late", out) == 100
            await kv.remove(NS, [b"late"])
            assert await local_get(lk, b"late", out) == MISS
            # a buffer too small: the server's answer (ERANGE) decides
            assert lk.get_into(NSB, keys[-1], out[:10]) == ASK
            lk.close()

    run(main)


def test_a_slot_that_names_another_record_never_gives_its_bytes(tmp_path: Path) -> None:
    """Slots rewritten under the reader (reused for another key, stale, torn): the
    record read is checked against the key, length, sequence and CRCs."""
    async def main() -> None:
        async with server(tmp_path) as srv, \
                KvServerClient.connect("127.0.0.1", srv.port) as kv:
            await kv.put(NS, b"a", value_of(b"a", 8192))
            await kv.put(NS, b"b", value_of(b"b", 8192))
            lk = await connect_local(srv.sid, auth.ClientAuth())
            assert lk is not None
            out = memoryview(bytearray(8192))
            assert await local_get(lk, b"a", out) == 8192
            ea, eb = srv.kvs.index[(NS, b"a")], srv.kvs.index[(NS, b"b")]
            pub = srv.kvs.published
            assert pub is not None and ea.slot is not None and ea.slot >= 0
            # a's slot now says b's record (as if reused for b between lookup and read)
            pub.move(ea.slot, NSB, b"a", eb.seq, eb.slab.sid, eb.off, eb.vlen)
            assert lk.get_into(NSB, b"a", out) == ASK
            # the right place, another sequence (a newer record of the key elsewhere)
            pub.move(ea.slot, NSB, b"a", ea.seq + 1, ea.slab.sid, ea.off, ea.vlen)
            assert lk.get_into(NSB, b"a", out) == ASK
            # the middle of a value
            pub.move(ea.slot, NSB, b"a", ea.seq, ea.slab.sid, ea.off + 100, ea.vlen)
            assert lk.get_into(NSB, b"a", out) == ASK
            # a torn slot (its CRC does not match): never trusted, not a miss either
            pub.move(ea.slot, NSB, b"a", ea.seq, ea.slab.sid, ea.off, ea.vlen)
            at = F.INDEX_HEAD_SIZE + ea.slot * F.SLOT.size + 12
            pub.mm[at] ^= 0xFF
            assert lk.get_into(NSB, b"a", out) == ASK
            pub.mm[at] ^= 0xFF
            assert await local_get(lk, b"a", out) == 8192 and out == value_of(b"a", 8192)
            lk.close()

    run(main)


def test_a_slab_evicted_between_lookup_and_read(tmp_path: Path) -> None:
    """The reader looked the key up, then the server evicted its slab (the file gone,
    the slot cleared or moved): the old descriptor still reads that record's bytes, a
    slab not held yet is a fallback, and a get after it is a miss or the right bytes."""
    async def main() -> None:
        async with server(tmp_path, budget=1 << 20, slab_bytes=256 << 10) as srv, \
                KvServerClient.connect("127.0.0.1", srv.port) as kv:
            await kv.put(NS, b"victim", value_of(b"victim", 60_000))
            await kv.put(NS, b"cold", value_of(b"cold", 60_000))
            lk = await connect_local(srv.sid, auth.ClientAuth())
            assert lk is not None
            out = memoryview(bytearray(60_000))
            assert await local_get(lk, b"victim", out) == 60_000
            slot = lk.lookup(NSB, b"victim")
            cold = lk.lookup(NSB, b"cold")
            assert not isinstance(slot, int) and not isinstance(cold, int)
            first = slot[2]
            for i in range(40):  # the budget turns over: the first slab goes
                await kv.put(NS, b"fill-%d" % i, value_of(b"fill-%d" % i, 60_000))
            assert first not in srv.kvs.slabs
            out[:] = bytes(60_000)
            got = lk.read(slot, NSB, b"victim", out)  # the slot read before the eviction
            assert got in (60_000, ASK)
            if got == 60_000:
                assert out == value_of(b"victim", 60_000)
            # a reader that never held the slab: it is gone, the server's answer decides
            lk2 = await connect_local(srv.sid, auth.ClientAuth())
            assert lk2 is not None
            got = lk2.read(cold, NSB, b"cold", out)
            assert isinstance(got, NeedSlab) and got.slab == first
            await lk2.open_slab(first)
            assert isinstance(lk2.read(cold, NSB, b"cold", out), NeedSlab)  # still none
            lk2.close()
            for key in (b"victim", b"cold"):
                out[:] = bytes(60_000)
                got2 = await local_get(lk, key, out)
                assert got2 in (MISS, ASK, 60_000)
                if got2 == 60_000:
                    assert out == value_of(key, 60_000)
            for i in range(40):  # the live ones read right
                k = b"fill-%d" % i
                got3 = await local_get(lk, k, out)
                assert got3 in (MISS, 60_000)
                if got3 == 60_000:
                    assert out == value_of(k, 60_000)
            lk._reap(srv.kvs.published.low if srv.kvs.published else 0)
            assert all(s >= min(srv.kvs.slabs) for s in lk.fds)  # old descriptors closed
            lk.close()

    run(main)


def test_blocks_read_only_by_short_circuit_stay_hot(tmp_path: Path) -> None:
    """A block read again and again by short-circuit alone (no request reaches the
    server) survives the evictions that take the cold blocks written beside it: the
    reader sets the slot's reference byte, which the eviction reads. Readers may write
    those bytes, never resize them under the server's map."""
    async def main() -> None:
        async with server(tmp_path, budget=1 << 20, slab_bytes=256 << 10) as srv, \
                KvServerClient.connect("127.0.0.1", srv.port) as kv:
            await kv.put(NS, b"hot", value_of(b"hot", 60_000))
            for i in range(3):
                await kv.put(NS, b"cold-%d" % i, value_of(b"cold-%d" % i, 60_000))
            lk = await connect_local(srv.sid, auth.ClientAuth())
            assert lk is not None and lk.refs is not None
            first = srv.kvs.index[(NS, b"hot")].slab.sid
            out = memoryview(bytearray(60_000))
            hits = srv.kvs.counters.hits
            for i in range(60):  # the budget turns over about three times
                assert await local_get(lk, b"hot", out) == 60_000
                assert out == value_of(b"hot", 60_000)
                await kv.put(NS, b"fill-%d" % i, value_of(b"fill-%d" % i, 60_000))
            assert first not in srv.kvs.slabs and srv.kvs.counters.evictions > 0
            assert srv.kvs.counters.hits == hits  # every read was short-circuit
            assert (NS, b"hot") in srv.kvs.index
            assert not any((NS, b"cold-%d" % i) in srv.kvs.index for i in range(3))
            pub = srv.kvs.published
            assert pub is not None
            fd = pub.refs_fd_for_reader()
            try:
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 0)
            finally:
                os.close(fd)
            lk.close()

    run(main)


def test_a_server_gone_is_noticed_within_a_poll_interval(tmp_path: Path) -> None:
    """The local connection is polled at most every POLL_EVERY (not per get); once it
    reports the server gone, every get asks (the request path decides)."""
    async def main() -> None:
        async with server(tmp_path) as srv, \
                KvServerClient.connect("127.0.0.1", srv.port) as kv:
            await kv.put(NS, b"a", value_of(b"a", 4096))
            lk = await connect_local(srv.sid, auth.ClientAuth())
            assert lk is not None
            out = memoryview(bytearray(4096))
            assert await local_get(lk, b"a", out) == 4096
            assert lk._poll_at > 0  # polled, and not again until then
            # the connection ends as a server's death ends it
            peer = socket.socket(fileno=os.dup(lk._sock))
            peer.shutdown(socket.SHUT_RDWR)
            peer.close()
            lk._poll_at = 0.0  # POLL_EVERY later
            assert lk.get_into(NSB, b"a", out) == ASK and lk.dead
            assert lk.get_into(NSB, b"a", out) == ASK
            lk.close()

    run(main)


def test_corrupt_slab_bytes_are_never_served(tmp_path: Path) -> None:
    async def main() -> None:
        async with server(tmp_path) as srv, \
                KvServerClient.connect("127.0.0.1", srv.port) as kv:
            value = value_of(b"rot", 100_000)
            await kv.put(NS, b"rot", value)
            lk = await connect_local(srv.sid, auth.ClientAuth())
            assert lk is not None
            e = srv.kvs.index[(NS, b"rot")]
            fd = os.open(e.slab.path, os.O_RDWR)  # flip a byte of the value on disk
            at = e.off + e.hlen + 77_777
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 1]), at)
            os.close(fd)
            out = memoryview(bytearray(100_000))
            assert await local_get(lk, b"rot", out) == ASK  # the server decides...
            assert await kv.get_into(NS, b"rot", out) is None  # ... a miss, dropped
            assert await local_get(lk, b"rot", out) == MISS
            lk.close()

    run(main)


def test_descriptors_only_over_the_local_socket(tmp_path: Path) -> None:
    async def main() -> None:
        async with server(tmp_path) as srv, trio.open_nursery() as nursery:
            rpc = await open_rpc(auth.ClientAuth().for_data(), nursery, "127.0.0.1", srv.port)
            with pytest.raises(OSError) as e:
                await rpc.request(K.KvOpen(slab=0))
            assert e.value.errno == errno.EPERM
            rpc.close()
            assert await connect_local("no-such-server-" + uuid.uuid4().hex, auth.ClientAuth()
                                       ) is None
            nursery.cancel_scope.cancel()

    run(main)


def test_restricted_namespaces_keep_slabs_from_other_keys(tmp_path: Path) -> None:
    cluster_key, key_a, key_b = os.urandom(32), os.urandom(32), os.urandom(32)
    server_auth = auth.ServerAuth(keys={
        auth.CLUSTER: (cluster_key, auth.Identity(auth.CLUSTER, "server")),
        "node-a": (key_a, auth.Identity("node-a", "client")),
        "node-b": (key_b, auth.Identity("node-b", "client"))})
    creds = {name: auth.ClientAuth(name=name, key=key) for name, key in
             (("node-a", key_a), ("node-b", key_b), (auth.CLUSTER, cluster_key))}

    async def main() -> None:
        async with server(tmp_path, server_auth=server_auth,
                          kv_namespaces={"secret": {"node-a"}}) as srv:
            async with KvServerClient.connect("127.0.0.1", srv.port, creds["node-a"]) as kv:
                await kv.put("secret", b"k", b"classified")
            # node-b may not read "secret": no descriptor of a slab that holds it
            assert await connect_local(srv.sid, creds["node-b"]) is None
            for name in ("node-a", auth.CLUSTER):
                lk = await connect_local(srv.sid, creds[name])
                assert lk is not None
                out = memoryview(bytearray(10))
                for _ in range(2):
                    got = lk.get_into(b"secret", b"k", out)
                    if isinstance(got, NeedSlab):
                        await lk.open_slab(got.slab)
                assert got == 10 and out == b"classified"
                lk.close()

    run(main)


def test_kvcache_uses_the_local_server_and_only_when_allowed(client_toml: Path) -> None:
    """On the test cluster every data server is on this host: gets are short-circuit,
    and with ``short_circuit=False`` never."""
    keys = [b"sc-" + os.urandom(8) for _ in range(8)]
    with KVCache(client_toml, NS, node_tier_bytes=0) as kv:
        for k in keys:
            kv.put(k, value_of(k, 40_000))
        out = bytearray(40_000)
        for k in keys:
            assert kv.get(k, out) and out == value_of(k, 40_000)
        assert not kv.get(b"sc-absent", out)
        def reader(_i: int) -> None:  # threads at once, as an engine's I/O threads call
            buf = bytearray(40_000)
            for _ in range(20):
                for k in keys:
                    assert kv.get(k, buf) and buf == value_of(k, 40_000)

        assert run_threads(reader, 4) == []
        assert kv.exists(keys) == len(keys)  # from the published indexes
        assert kv.exists(keys[:3] + [b"sc-absent"] + keys[3:]) == 3
        st = kv.stats()
        assert st["local_hits"] > len(keys) and st["remote_hits"] == 0  # (threads: approx.)
        assert st["local_servers"]
    with KVCache(client_toml, NS, node_tier_bytes=0, short_circuit=False) as kv:
        for k in keys:
            assert kv.get(k, out) and out == value_of(k, 40_000)
        st = kv.stats()
        assert st["local_hits"] == 0 and st["remote_hits"] == len(keys)
        assert kv.remove(keys[:1]) == 1
    with KVCache(client_toml, NS, node_tier_bytes=0) as kv:
        assert kv.exists(keys) == 0  # the removal is in the index at once
        assert kv.exists(keys[1:]) == len(keys) - 1
        kv.remove(keys)


def test_descriptors_are_prefetched_and_capped(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from pfs.kvcache import local

    monkeypatch.setattr(local, "MAX_FDS", 2)

    async def main() -> None:
        async with server(tmp_path, budget=8 << 20, slab_bytes=256 << 10) as srv, \
                KvServerClient.connect("127.0.0.1", srv.port) as kv:
            keys = [b"cap-%d" % i for i in range(12)]
            for k in keys:  # about 5 slabs
                await kv.put(NS, k, value_of(k, 100_000))
            lk = await connect_local(srv.sid, auth.ClientAuth())
            assert lk is not None and lk.live == sorted(srv.kvs.slabs)
            await lk.prefetch()
            assert set(lk.fds) == set(lk.live[-2:])  # the newest, within the cap
            out = memoryview(bytearray(100_000))
            for k in keys:
                assert await local_get(lk, k, out) == 100_000 and out == value_of(k, 100_000)
                assert len(lk.fds) <= 2
            lk.close()

    run(main)
