"""The KV-cache client without servers: homes by rendezvous hashing, the node tier's
arena, and the API over in-memory block stores (a fake of KvServerClient)."""
from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import pytest
import trio

import pfs.client.device as device
from pfs.kvcache import api
from pfs.kvcache.api import AsyncKVCache, KVCache
from pfs.kvcache.arena import NAME as ARENA
from pfs.kvcache.arena import record_length
from pfs.kvcache.homes import Homes
from pfs.kvcache.nodetier import NodeTier, tmpfs_page_mode

NS = "model-a:tp8"


# -- homes ----------------------------------------------------------------------------
def test_homes_are_stable_when_servers_join_and_leave() -> None:
    keys = [os.urandom(16) for _ in range(2000)]
    ten = Homes(f"s{i}" for i in range(10))
    before = {k: ten.homes(NS, k)[0] for k in keys}
    assert len(set(before.values())) == 10  # every server is someone's home
    eleven = Homes(f"s{i}" for i in range(11))
    moved = [k for k in keys if eleven.homes(NS, k)[0] != before[k]]
    assert all(eleven.homes(NS, k)[0] == "s10" for k in moved)  # only to the newcomer
    assert len(moved) < len(keys) * 0.15  # about 1/11
    nine = Homes(s for s in ten.servers if s != "s3")
    for k in keys:
        if before[k] != "s3":
            assert nine.homes(NS, k)[0] == before[k]  # only s3's keys move
        else:
            assert nine.homes(NS, k)[0] == ten.ranked(NS, k)[1]  # to their next home


def test_the_pool_is_the_servers_with_a_kv_budget() -> None:
    from pfs.kvcache.pool import in_pool

    assert in_pool({"state": "up", "kv": {"budget": 1, "used": 0}})
    assert in_pool({"state": "suspect", "kv": {"budget": 1}})  # a hiccup moves no keys
    assert not in_pool({"state": "up"})  # no KV store
    assert not in_pool({"state": "up", "kv": {"budget": 0}})
    assert not in_pool({"state": "down", "kv": {"budget": 1}})
    assert not in_pool({"state": "draining", "kv": {"budget": 1}})


def test_homes_replicas_and_namespaces() -> None:
    h = Homes(["a", "b", "c"])
    k = b"key"
    assert h.homes(NS, k, 2) == h.ranked(NS, k)[:2]
    assert h.homes(NS, k, 5) == h.ranked(NS, k)  # fewer than asked: all
    assert h.homes(NS, k, 1) == h.ranked(NS, k)[:1]
    assert Homes([]).homes(NS, k) == []
    spread = {Homes([f"s{i}" for i in range(8)]).homes(f"ns{j}", k)[0] for j in range(40)}
    assert len(spread) > 3  # the namespace is part of the hash


# -- the node tier --------------------------------------------------------------------
@pytest.fixture
def tier(tmp_path: Path) -> NodeTier:
    return NodeTier(tmp_path / "tier", 1 << 20)


def test_node_tier_round_trip_and_checks(tier: NodeTier) -> None:
    value = os.urandom(5000)
    assert tier.put(NS, b"k1", memoryview(value))
    out = bytearray(5000)
    assert tier.get_into(NS, b"k1", memoryview(out)) == 5000 and out == value
    big = bytearray(8000)
    assert tier.get_into(NS, b"k1", memoryview(big)) == 5000 and big[:5000] == value
    with pytest.raises(OSError) as e:
        tier.get_into(NS, b"k1", memoryview(bytearray(10)))
    assert e.value.errno == errno.ERANGE
    assert tier.get_into(NS, b"k2", memoryview(out)) is None
    assert tier.get_into("other", b"k1", memoryview(out)) is None  # namespaces never mix
    assert tier.exists(NS, b"k1") and not tier.exists(NS, b"k2")
    assert not tier.exists("other", b"k1")
    assert tier.remove(NS, [b"k1", b"k2"]) == 1
    assert tier.get_into(NS, b"k1", memoryview(out)) is None


def value_at(tier: NodeTier, key: bytes) -> int:
    """Where ``key``'s value lies in the arena file (tests damage it there)."""
    a = tier._arena
    h, nsk = tier._name(NS, key)
    found = tier._record(a, h, nsk)
    assert found is not None
    return a.data_off + found[1] + record_length(len(nsk), found[3])[0]


def test_node_tier_damage_is_a_miss(tier: NodeTier) -> None:
    value = os.urandom(4096)
    tier.put(NS, b"k", memoryview(value))
    arena = tier.root / ARENA
    at = value_at(tier, b"k")
    with open(arena, "r+b") as f:  # flip a byte of the value
        f.seek(at + 4000)
        b = f.read(1)
        f.seek(at + 4000)
        f.write(bytes([b[0] ^ 1]))
    assert tier.get_into(NS, b"k", memoryview(bytearray(4096))) is None
    assert not tier.exists(NS, b"k") and tier.corrupt == 1  # dropped
    # another key's record under this key's index entry (a hash collision): a miss
    tier.put(NS, b"k", memoryview(value))
    tier.put(NS, b"x", memoryview(value))
    a = tier._arena
    ik, ix = (tier._find(a, tier._name(NS, k)[0]) for k in (b"k", b"x"))
    assert ik is not None and ix is not None
    a.q[ik + 1], a.q[ik + 2] = a.q[ix + 1], a.q[ix + 2]
    assert tier.get_into(NS, b"k", memoryview(bytearray(4096))) is None
    assert tier.get_into(NS, b"x", memoryview(bytearray(4096))) == 4096  # x's: intact


def test_node_tier_evicts_least_recently_used(tier: NodeTier) -> None:
    """Clock: a block read since the sweep last passed gets a second chance, the
    others go oldest first; the arena never exceeds its budget."""
    block = memoryview(os.urandom(32 << 10))
    out = memoryview(bytearray(32 << 10))
    for i in range(20):  # 640 KiB
        tier.put(NS, b"k%d" % i, block)
    assert tier.get_into(NS, b"k0", out) == 32 << 10  # k0: hot
    for i in range(20, 40):  # 640 KiB more: over the 1 MiB budget
        tier.put(NS, b"k%d" % i, block)
    u = tier.usage()
    assert u.bytes <= tier.budget and os.path.getsize(tier.root / ARENA) <= tier.budget
    assert tier.evictions > 0
    assert tier.exists(NS, b"k0")  # hot: survived
    assert not tier.exists(NS, b"k1")  # oldest: gone
    assert tier.exists(NS, b"k39")
    assert tier.get_into(NS, b"k0", out) == 32 << 10 and out == block
    assert tier.trim(force=True).evicted > 0
    tier.clear()
    assert tier.usage().blocks == 0 and not tier.exists(NS, b"k39")


def test_node_tier_knows_a_tmpfs_without_huge_pages(tmp_path: Path) -> None:
    info = "\n".join([
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw",
        "23 22 0:5 / /dev/shm rw,relatime shared:2 - tmpfs tmpfs rw,size=1024k",
        "24 22 0:6 / /mnt/kv\\040tier rw shared:3 - tmpfs tmpfs rw,huge=within_size",
    ])
    assert tmpfs_page_mode("/dev/shm/pfs-kv-0/ab", info) == "never"
    assert tmpfs_page_mode("/mnt/kv tier/x", info) == "within_size"
    assert tmpfs_page_mode("/home/u", info) is None
    assert tmpfs_page_mode("/dev/shmx", info) is None  # a prefix is not a parent


def test_node_tier_folder_must_be_private(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(OSError) as e:
        NodeTier(d, 1 << 20)
    assert e.value.errno == errno.EACCES and "0700" in str(e.value)
    with pytest.raises(ValueError):
        NodeTier(tmp_path / "x", 0)


# -- the API over fake servers ------------------------------------------------------
class FakeStore:
    """One server's KV store in memory; ``down`` makes it refuse connections."""

    def __init__(self, sid: str, world: FakeWorld) -> None:
        self.sid = sid
        self.world = world

    @property
    def blocks(self) -> dict[tuple[str, bytes], bytes]:
        return self.world.blocks.setdefault(self.sid, {})

    def _check(self) -> None:
        self.world.calls += 1
        if self.sid in self.world.down:
            raise OSError(errno.ECONNREFUSED, "connection refused")

    async def put(self, ns: str, key: bytes, buf: Any, *, pin: bool = False) -> int:
        self._check()
        self.blocks[ns, key] = bytes(buf)
        if pin:
            self.world.pinned.add(key)
        return len(buf)

    async def get_into(self, ns: str, key: bytes, out: memoryview) -> int | None:
        self._check()
        v = self.blocks.get((ns, key))
        if v is None:
            return None
        if len(v) > len(out):
            raise OSError(errno.ERANGE, "too big")
        out[:len(v)] = v
        return len(v)

    async def exists(self, ns: str, keys: list[bytes]) -> list[bool]:
        self._check()
        return [(ns, k) in self.blocks for k in keys]

    async def remove(self, ns: str, keys: list[bytes]) -> int:
        self._check()
        return sum(self.blocks.pop((ns, k), None) is not None for k in keys)

    async def stats(self) -> dict[str, Any]:
        self._check()
        return {"blocks": len(self.blocks)}


class FakeWorld:
    def __init__(self, n: int) -> None:
        self.servers = {f"s{i}": {"host": "127.0.0.1", "port": 1000 + i, "state": "up",
                                  "kv": {"budget": 1 << 30}} for i in range(n)}
        self.blocks: dict[str, dict[tuple[str, bytes], bytes]] = {}
        self.down: set[str] = set()
        self.pinned: set[bytes] = set()
        self.calls = 0
        self.lookups = 0

    async def lookup(self) -> dict[str, dict[str, Any]]:
        self.lookups += 1
        return {k: dict(v) for k, v in self.servers.items()}

    def connect(self, sid: str, host: str, port: int) -> FakeStore:
        return FakeStore(sid, self)

    def cache(self, tmp_path: Path, node: bool = True, **kw: Any) -> Callable[[trio.Nursery],
                                                                               AsyncKVCache]:
        tier = NodeTier(tmp_path / "tier", 8 << 20) if node else None
        return lambda nursery: AsyncKVCache(nursery, NS, self.lookup, self.connect,
                                            node_tier=tier, refresh=0, **kw)


def tier_of_async(kv: AsyncKVCache) -> NodeTier:
    assert kv.node is not None
    return kv.node


def tier_of(kv: KVCache) -> NodeTier:
    assert kv.node is not None
    return kv.node


@pytest.fixture
def world() -> FakeWorld:
    return FakeWorld(4)


def test_put_get_through_homes_and_node_tier(world: FakeWorld, tmp_path: Path) -> None:
    with KVCache.over(world.cache(tmp_path)) as kv:
        lookups = world.lookups
        v = os.urandom(3000)
        kv.put(b"a", v)
        home = kv.aio.pool.homes.homes(NS, b"a")[0]
        assert world.blocks[home][NS, b"a"] == v  # sync: at its home on return
        out = bytearray(3000)
        calls = world.calls
        assert kv.get(b"a", out) and out == v
        assert world.calls == calls  # served by the node tier
        tier_of(kv).clear()
        out2 = bytearray(3000)
        assert kv.get(b"a", out2) and out2 == v  # from its home ...
        assert tier_of(kv).exists(NS, b"a")  # ... and filled the node tier (read-through)
        assert not kv.get(b"nope", out)
        assert world.lookups == lookups  # no metaserver on the hot path
        s = kv.stats()
        assert s["node_hits"] == 1 and s["remote_hits"] == 1 and s["misses"] == 1


def test_exists_counts_a_prefix_chain_up_to_its_hole(world: FakeWorld, tmp_path: Path) -> None:
    with KVCache.over(world.cache(tmp_path)) as kv:
        chain = [b"blk%d" % i for i in range(10)]
        for k in chain[:6] + chain[7:]:  # a hole at 6
            kv.put(k, b"x" * 100)
        assert kv.exists(chain) == 6
        tier_of(kv).remove(NS, chain[2:4])  # node tier misses: the homes answer
        assert kv.exists(chain) == 6
        assert kv.exists([b"nothing"] + chain) == 0
        assert kv.exists([]) == 0
        kv.put(chain[6], b"x" * 100)
        assert kv.exists(chain) == 10
        assert kv.remove(chain[:3]) == 3
        assert kv.exists(chain) == 0


def test_async_put_then_flush(world: FakeWorld, tmp_path: Path) -> None:
    with KVCache.over(world.cache(tmp_path)) as kv:
        blocks = {b"k%d" % i: os.urandom(1000) for i in range(50)}
        buf = bytearray(1000)
        for k, v in blocks.items():
            buf[:] = v
            kv.put(k, buf, sync=False)  # the buffer is reused at once
            assert tier_of(kv).exists(NS, k)
        kv.flush()
        for k, v in blocks.items():
            home = kv.aio.pool.homes.homes(NS, k)[0]
            assert world.blocks[home][NS, k] == v
        world.down = set(world.servers)
        kv.put(b"late", b"y" * 10, sync=False)
        with pytest.raises(OSError, match="did not reach their homes"):
            kv.flush()
        kv.flush()  # reported once


def test_a_dead_home_is_a_miss_then_its_keys_move(world: FakeWorld, tmp_path: Path) -> None:
    with KVCache.over(world.cache(tmp_path, node=False)) as kv:
        keys = [b"k%d" % i for i in range(40)]
        for k in keys:
            kv.put(k, k * 10)
        victim = kv.aio.pool.homes.homes(NS, keys[0])[0]
        world.down.add(victim)
        lost = [k for k in keys if kv.aio.pool.homes.homes(NS, k)[0] == victim]
        out = bytearray(len(keys[0]) * 10)
        assert not kv.get(keys[0], out)  # a miss, not an error
        assert victim not in kv.aio.pool.homes  # left out for a while
        for k in lost:
            assert kv.get_into(k, bytearray(100)) is None
            kv.put(k, k * 10)  # refilled at the next home
            assert kv.get_into(k, bytearray(100)) == len(k) * 10
        for k in set(keys) - set(lost):
            assert kv.get_into(k, bytearray(100)) == len(k) * 10  # the rest kept their homes


def test_replicas_serve_when_the_first_home_is_gone(world: FakeWorld, tmp_path: Path) -> None:
    with KVCache.over(world.cache(tmp_path, node=False, replicas=2)) as kv:
        kv.put(b"hot", b"v" * 64)
        first, second = kv.aio.pool.homes.homes(NS, b"hot", 2)
        assert world.blocks[first][NS, b"hot"] == world.blocks[second][NS, b"hot"]
        world.down.add(first)
        out = bytearray(64)
        assert kv.get(b"hot", out) and out == b"v" * 64


def test_bad_input_is_refused_clearly(world: FakeWorld, tmp_path: Path) -> None:
    with KVCache.over(world.cache(tmp_path)) as kv:
        for key, code in ((b"", errno.EINVAL), (b"k" * 257, errno.EINVAL)):
            with pytest.raises(OSError) as e:
                kv.put(key, b"v")
            assert e.value.errno == code and "keys are 1..256 bytes" in str(e.value)
        with pytest.raises(TypeError, match="bytes, not str"):
            kv.put("str-key", b"v")
        with pytest.raises(OSError) as e:
            kv.put(b"k", b"")
        assert e.value.errno == errno.EINVAL and "1 B..64 MiB" in str(e.value)
        with pytest.raises(OSError) as e:
            kv.put(b"k", memoryview(bytearray(api.MAX_VALUE + 1)))
        assert e.value.errno == errno.EMSGSIZE
        kv.put(b"k", b"v" * 100)
        with pytest.raises(OSError) as e:
            kv.get(b"k", bytearray(50))  # too small
        assert e.value.errno == errno.ERANGE
        with pytest.raises(OSError) as e:
            kv.get(b"k", bytearray(200))  # not the block's size
        assert e.value.errno == errno.EINVAL and "100 bytes, the buffer 200" in str(e.value)
        assert kv.get_into(b"k", bytearray(200)) == 100  # variable sizes: get_into
        with pytest.raises(OSError, match="read-only"):
            kv.get_into(b"k", b"x" * 100)
        with pytest.raises(OSError, match="2 keys, 1 buffers"):
            kv.put_batch([b"a", b"b"], [b"x"])
    for ns in ("", "a/b", "x" * 129, "sp ace"):
        with pytest.raises(OSError) as e:
            AsyncKVCache(None, ns, world.lookup, world.connect)  # type: ignore[arg-type]
        assert e.value.errno == errno.EINVAL and "namespace" in str(e.value)
    with pytest.raises(ValueError, match="closed"):
        kv.get(b"k", bytearray(100))


def test_batches(world: FakeWorld, tmp_path: Path) -> None:
    with KVCache.over(world.cache(tmp_path)) as kv:
        keys = [b"b%d" % i for i in range(20)]
        vals = [os.urandom(512) for _ in keys]
        kv.put_batch(keys, vals)
        tier_of(kv).clear()
        outs = [bytearray(512) for _ in keys]
        assert kv.get_batch(keys + [b"none"], outs + [bytearray(512)]) == [True] * 20 + [False]
        assert outs == vals


class FakeDeviceArray:
    """A device buffer for the mocked GPU route: its bytes live in ``MEMORY``."""

    def __init__(self, n: int, readonly: bool = False) -> None:
        self.ptr = 0x10000 * (len(MEMORY) + 1)
        MEMORY[self.ptr] = bytearray(n)
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "version": 3,
                                         "data": (self.ptr, readonly)}


MEMORY: dict[int, bytearray] = {}


class FakeCopies:
    def __init__(self, lib: str) -> None:
        self.copied = 0

    def h2d(self, dst_ptr: int, src: memoryview) -> None:
        MEMORY[dst_ptr][:len(src)] = src

    def d2h(self, dst: memoryview, src_ptr: int) -> None:
        dst[:] = MEMORY[src_ptr][:len(dst)]


def test_gpu_route_through_the_mocked_device_path(world: FakeWorld, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "require_staging", lambda: "cupy")
    monkeypatch.setattr(device, "Copies", FakeCopies)
    with KVCache.over(world.cache(tmp_path)) as kv:
        src = FakeDeviceArray(4096, readonly=True)
        MEMORY[src.ptr][:] = os.urandom(4096)
        kv.put(b"gpu", src)
        dst = FakeDeviceArray(4096)
        assert kv.get(b"gpu", dst)  # node tier -> host -> device
        assert MEMORY[dst.ptr] == MEMORY[src.ptr]
        tier_of(kv).clear()
        dst2 = FakeDeviceArray(4096)
        assert kv.get(b"gpu", dst2) and MEMORY[dst2.ptr] == MEMORY[src.ptr]  # from the home
        assert crc32c.crc32c(MEMORY[dst2.ptr]) == crc32c.crc32c(MEMORY[src.ptr])
    monkeypatch.setattr(device, "libcuda_missing", lambda: "the CUDA driver (test)")
    monkeypatch.undo()
    monkeypatch.setattr(device, "libcuda_missing", lambda: "the CUDA driver (test)")
    with KVCache.over(world.cache(tmp_path)) as kv:
        with pytest.raises(device.GpuUnavailable, match="CUDA driver"):
            kv.get(b"gpu", FakeDeviceArray(4096))


def test_pinning_per_call_and_per_cache(world: FakeWorld, tmp_path: Path) -> None:
    with KVCache.over(world.cache(tmp_path)) as kv:
        kv.put(b"hot", b"h" * 10, pin=True)
        kv.put(b"cold", b"c" * 10)
        kv.put(b"later", b"l" * 10, sync=False, pin=True)
        kv.put_batch([b"b1", b"b2"], [b"x", b"y"], pin=True)
        kv.flush()
        assert world.pinned == {b"hot", b"later", b"b1", b"b2"}
    with KVCache.over(world.cache(tmp_path, pin=True)) as kv:
        kv.put(b"cold", b"c" * 10)
        kv.put(b"unpinned", b"u" * 10, pin=False)
        assert b"cold" in world.pinned and b"unpinned" not in world.pinned


def test_many_threads_share_one_cache(world: FakeWorld, tmp_path: Path) -> None:
    from tests.conftest import run_threads

    with KVCache.over(world.cache(tmp_path)) as kv:
        def work(i: int) -> None:
            for j in range(30):
                k = b"t%d" % ((i + j) % 40)  # overlapping keys
                v = k * 50
                kv.put(k, v, sync=bool(j % 2))
                out = bytearray(len(v))
                assert kv.get(k, out) and out == v

        assert run_threads(work, 8) == []
        kv.flush()
        assert kv.exists([b"t%d" % i for i in range(37)]) == 37  # t0..t36 were put


def test_async_twin(world: FakeWorld, tmp_path: Path) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            kv = world.cache(tmp_path)(nursery)
            await kv.start()
            await kv.put(b"a", b"1" * 10)
            await kv.put(b"b", b"2" * 10, sync=False)
            big = os.urandom(api.THREAD_BYTES)  # node tier in a worker thread
            await kv.put(b"big", big)
            await kv.flush()
            out = bytearray(10)
            assert await kv.get(b"b", out) and out == b"2" * 10
            got = bytearray(len(big))
            assert await kv.get(b"big", got) and got == big
            tier_of_async(kv).clear()
            assert await kv.get(b"big", got) and got == big  # from the home, filled again
            assert tier_of_async(kv).exists(NS, b"big")
            assert await kv.exists([b"a", b"b", b"c"]) == 2
            await kv.aclose()

    trio.run(main)


# -- the direct route's checks ----------------------------------------------------------
@pytest.mark.parametrize("authenticated", [False, True])
def test_direct_get_checks_the_crc_only_where_the_connection_does_not(
        authenticated: bool) -> None:
    """The home checked the value's CRC as it read it; a MAC'd (or TLS) connection
    proves the bytes received are the ones it checked, so only a plain connection's
    are checked again (a mismatch there: EIO, never the bytes)."""
    from pfs.kvcache.direct import DirectKv

    value = os.urandom(1000)
    wrong = crc32c.crc32c(value) ^ 1  # what a plain connection's damage looks like

    class Data:
        def exchange(self, sid: str, msg: Any, *, into: memoryview, **kw: Any
                     ) -> tuple[dict[str, Any], int, bool]:
            into[:len(value)] = value
            return {"found": True, "n": len(value), "crc": wrong}, len(value), authenticated

    kv = DirectKv.__new__(DirectKv)
    kv.data = Data()  # type: ignore[assignment]
    out = bytearray(2000)
    if authenticated:
        assert kv.get_into("s0", NS, b"k", memoryview(out)) == len(value)
        assert out[:len(value)] == value
    else:
        with pytest.raises(OSError) as err:
            kv.get_into("s0", NS, b"k", memoryview(out))
        assert err.value.errno == errno.EIO
