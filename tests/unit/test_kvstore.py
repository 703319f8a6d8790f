"""The data server's KV block store without a server: records, the index rebuilt from
the slabs (torn tails cut, tombstones kept), corrupt records answered as misses,
eviction under a budget (pinned and hot blocks kept), space given back to file data."""
from __future__ import annotations

import errno
import mmap
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import crc32c
import pytest
import trio

from pfs.core.messages.records import Volume
from pfs.dataserver import kvslab, kvstore
from pfs.dataserver.capacity import with_reclaimable
from pfs.dataserver.kvstore import MAP_MIN, KvStore

NS = "ns"


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(60):
            await fn()

    trio.run(main)


@asynccontextmanager
async def store(dirs: list[Path], budget: int = 4 << 20, slab: int = 0
                ) -> AsyncIterator[KvStore]:
    kv = KvStore([str(d) for d in dirs], budget, slab_bytes=slab)
    try:
        await kv.start()
        yield kv
    finally:
        kv.close()


async def put(kv: KvStore, key: bytes, value: bytes, pin: bool = False) -> None:
    assert await kv.put(NS, key, value, crc32c.crc32c(value), pin) == len(value)


async def get(kv: KvStore, key: bytes, maxlen: int = 1 << 22) -> bytes | None:
    got = await kv.get(NS, key, maxlen)
    if got is None:
        return None
    value = bytes(got.view)
    got.release()
    return value


def slabs(d: Path) -> list[Path]:
    return sorted((d / kvslab.KV_DIR).glob("*.slab"))


def test_records_round_trip_and_survive_a_restart(tmp_path: Path) -> None:
    rng = random.Random(0)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    blocks = {rng.randbytes(rng.randrange(1, 257)): rng.randbytes(rng.randrange(1, 50_000))
              for _ in range(60)}
    keys = list(blocks)

    async def main() -> None:
        async with store(dirs, slab=256 << 10) as kv:
            for k, v in blocks.items():
                await put(kv, k, v)
            blocks[keys[0]] = b"newer value"
            await put(kv, keys[0], b"newer value")
            assert await kv.remove(NS, keys[1:4] + [b"absent"]) == 3
            for k in keys[1:4]:
                del blocks[k]
            assert len(slabs(dirs[0])) and len(slabs(dirs[1]))  # spread over both
            used = kv.used
        async with store(dirs, slab=256 << 10) as kv:
            assert kv.used == used
            assert len(kv.index) == len(blocks)
            for k in keys:
                assert await get(kv, k) == blocks.get(k)
            assert kv.exists(NS, keys[:5]) == [True, False, False, False, True]
            assert kv.exists("other", keys[:1]) == [False]

    run(main)


@pytest.mark.parametrize("tail", ["half_head", "short_value", "garbage", "zeros_value"])
def test_a_torn_tail_is_cut_never_served(tmp_path: Path, tail: str) -> None:
    async def main() -> None:
        async with store([tmp_path]) as kv:
            await put(kv, b"keep", b"K" * 1000)
        (slab,) = slabs(tmp_path)
        good = slab.stat().st_size
        head = kvslab.pack_head(NS.encode(), b"torn", 4000, 99, crc32c.crc32c(b"T" * 4000), 0)
        extra = {"half_head": head[:20], "short_value": head + b"T" * 3000,
                 "garbage": os.urandom(500), "zeros_value": head + bytes(4000)}[tail]
        with slab.open("ab") as f:
            f.write(extra)
        async with store([tmp_path]) as kv:
            assert await get(kv, b"torn") is None
            assert await get(kv, b"keep") == b"K" * 1000
            assert slab.stat().st_size == good
            await put(kv, b"after", b"A")  # appends go to a new slab
        async with store([tmp_path]) as kv:
            assert await get(kv, b"after") == b"A"

    run(main)


def test_a_corrupt_record_is_a_miss(tmp_path: Path) -> None:
    async def main() -> None:
        async with store([tmp_path]) as kv:
            await put(kv, b"a", b"a" * 10_000)
            await put(kv, b"b", b"b" * 10_000)
            (slab,) = slabs(tmp_path)
            with slab.open("r+b") as f:  # rot in a's value while the server runs
                data = f.read()
                f.seek(data.index(b"a" * 64) + 5000)
                f.write(b"X")
            assert await get(kv, b"a") is None
            assert await get(kv, b"a") is None  # dropped: a plain miss now
            assert await get(kv, b"b") == b"b" * 10_000
            st = kv.stats()
            assert st["corrupt"] == 1 and st["misses"] == 2 and st["blocks"] == 1

    run(main)


def test_a_cached_value_is_checked_and_served_from_the_slab_mapping(tmp_path: Path) -> None:
    """A large value in the page cache comes from the slab's mapping (no copy), answered
    in the event loop; its checksum is checked there too (rot found after it was mapped
    is a miss), and a value being sent outlives its slab's removal."""
    async def main() -> None:
        async with store([tmp_path], budget=16 << 20, slab=4 << 20) as kv:
            a, b = os.urandom(MAP_MIN), os.urandom(MAP_MIN + (300 << 10))
            await put(kv, b"a", a)
            await put(kv, b"b", b)
            assert kv.answers_at_once(NS, b"a")
            got = await kv.get(NS, b"a", 1 << 20)
            assert got is not None and isinstance(got.view.obj, mmap.mmap)
            assert bytes(got.view) == a
            got.release()
            held = await kv.get(NS, b"b", 2 << 20)  # a reply still being sent
            assert held is not None
            (slab,) = slabs(tmp_path)
            with slab.open("r+b") as f:  # rot in a's value, now mapped
                data = f.read()
                f.seek(data.index(a[:64]) + 100_000)
                f.write(bytes([a[100_000] ^ 1]))
            assert await get(kv, b"a") is None
            assert kv.stats()["corrupt"] == 1
            assert await kv.reclaim(1 << 30) > 0 and not slabs(tmp_path)
            assert bytes(held.view) == b  # the mapping outlives the slab's file
            held.release()

    run(main)


def test_a_cached_value_under_map_min_is_read_checked_and_answered_at_once(
        tmp_path: Path) -> None:
    """A cached value under MAP_MIN is read into a pooled buffer (cheaper than locking
    its pages), in the event loop, and checked there: rot is a miss, never bytes."""
    async def main() -> None:
        async with store([tmp_path], budget=16 << 20, slab=4 << 20) as kv:
            a, b, c = os.urandom(256 << 10), os.urandom(200 << 10), os.urandom(MAP_MIN)
            await put(kv, b"a", a)
            await put(kv, b"b", b)
            await put(kv, b"c", c)
            assert kv.answers_at_once(NS, b"a")  # (read by the probe)
            got = await kv.get(NS, b"a", 1 << 20)
            assert got is not None and not isinstance(got.view.obj, mmap.mmap)
            assert bytes(got.view) == a
            got.release()
            assert kv.answers_at_once(NS, b"a")  # a probe whose get never came ...
            assert kv._probed is not None and kv._probed[1] is not None
            probe_buf = kv._probed[1]
            assert await get(kv, b"b") == b  # ... is not another key's value
            # and the buffer it read into is back in the pool, not dropped
            assert any(x is probe_buf for x in kv.buffers._free.get(len(probe_buf), []))
            assert await get(kv, b"a") == a
            assert kv.answers_at_once(NS, b"a") and kv.answers_at_once(NS, b"c")
            assert await get(kv, b"c") == c  # (mapped: a's bytes read are not its)
            assert kv.stats()["corrupt"] == 0
            (slab,) = slabs(tmp_path)
            with slab.open("r+b") as f:  # rot in a's value, in the page cache
                data = f.read()
                f.seek(data.index(a[:64]) + 100_000)
                f.write(bytes([a[100_000] ^ 1]))
            assert kv.answers_at_once(NS, b"a")
            assert await get(kv, b"a") is None
            assert kv.stats()["corrupt"] == 1

    run(main)


def test_put_refuses_a_wrong_crc_and_a_value_over_the_budget(tmp_path: Path) -> None:
    async def main() -> None:
        async with store([tmp_path], budget=1 << 20) as kv:
            with pytest.raises(OSError) as e:
                await kv.put(NS, b"k", b"value", 1234)
            assert e.value.errno == errno.EIO
            assert kv.exists(NS, [b"k"]) == [False]
            big = bytes(2 << 20)
            with pytest.raises(OSError) as e:
                await kv.put(NS, b"k", big, crc32c.crc32c(big))
            assert e.value.errno == errno.EFBIG
            await put(kv, b"k", b"x" * 11)
            with pytest.raises(OSError) as e:
                await kv.get(NS, b"k", 10)
            assert e.value.errno == errno.ERANGE and "11 bytes" in str(e.value)

    run(main)


def test_eviction_keeps_the_budget_pinned_and_hot_blocks(tmp_path: Path) -> None:
    rng = random.Random(1)
    budget = 1 << 20

    async def main() -> None:
        async with store([tmp_path], budget=budget) as kv:
            pinned = {b"p%d" % i: rng.randbytes(10_000) for i in range(5)}
            hot = {b"h%d" % i: rng.randbytes(10_000) for i in range(5)}
            for k, v in pinned.items():
                await put(kv, k, v, pin=True)
            for k, v in hot.items():
                await put(kv, k, v)
            cold = {}
            for i in range(1000):
                k, v = b"c%d" % i, rng.randbytes(rng.randrange(100, 20_000))
                cold[k] = v
                await put(kv, k, v)
                assert kv.used <= budget
                if i % 10 == 0:
                    for hk, hv in hot.items():
                        assert await get(kv, hk) == hv
            assert kv.counters.evictions > 500
            for k, v in (pinned | hot).items():
                assert await get(kv, k) == v
            for k, v in cold.items():
                assert await get(kv, k) in (None, v)
            assert kv.pinned == len(pinned)
            assert sum(s.size for s in kv.slabs.values()) == kv.used
            assert sum(e.size for e in kv.index.values()) == kv.live

    run(main)


def test_pinned_blocks_go_only_when_nothing_else_is_left(tmp_path: Path) -> None:
    async def main() -> None:
        async with store([tmp_path], budget=512 << 10) as kv:
            for i in range(200):  # pins alone, far past the budget: never refused
                await put(kv, b"p%d" % i, os.urandom(10_000), pin=True)
                assert kv.used <= 512 << 10
            assert 0 < kv.pinned < 200
            assert await get(kv, b"p199") is not None  # the newest stay

    run(main)


def test_concurrent_puts_and_gets_never_see_wrong_bytes(tmp_path: Path) -> None:
    rng = random.Random(2)
    values = {b"k%d" % i: rng.randbytes(rng.randrange(1, 60_000)) for i in range(100)}

    async def main() -> None:
        async with store([tmp_path], budget=1 << 20) as kv:
            async def worker(seed: int) -> None:
                r = random.Random(seed)
                for _ in range(200):
                    k = r.choice(list(values))
                    if r.random() < 0.5:
                        await put(kv, k, values[k], pin=r.random() < 0.05)
                    elif r.random() < 0.9:
                        assert await get(kv, k) in (None, values[k])
                    else:
                        await kv.remove(NS, [k])

            async with trio.open_nursery() as n:
                for s in range(8):
                    n.start_soon(worker, s)
            assert kv.used <= 1 << 20
        async with store([tmp_path], budget=1 << 20) as kv:
            for k, v in values.items():
                assert await get(kv, k) in (None, v)

    run(main)


def test_reclaim_gives_slabs_back(tmp_path: Path) -> None:
    async def main() -> None:
        async with store([tmp_path], budget=4 << 20, slab=256 << 10) as kv:
            for i in range(40):
                await put(kv, b"k%d" % i, os.urandom(50_000), pin=i % 2 == 0)
            before = kv.used
            freed = await kv.reclaim(1 << 20)
            assert freed >= 1 << 20 and kv.used == before - freed
            assert kv.counters.reclaimed == freed
            assert sum(s.size for s in kv.slabs.values()) == kv.used
            left = kv.used
            assert await kv.reclaim(1 << 40) == left  # pinned blocks too
            assert kv.used == 0 and not kv.index and kv.pinned == 0
            await put(kv, b"again", b"v")  # it grows again

    run(main)


def test_a_lowered_budget_trims_at_start(tmp_path: Path) -> None:
    async def main() -> None:
        async with store([tmp_path], budget=4 << 20, slab=256 << 10) as kv:
            for i in range(60):
                await put(kv, b"k%d" % i, os.urandom(50_000))
        async with store([tmp_path], budget=1 << 20, slab=256 << 10) as kv:
            assert kv.used <= 1 << 20 and kv.index
            assert await get(kv, b"k59") is not None

    run(main)


def test_a_directory_that_cannot_take_slabs_is_skipped(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    (bad / kvslab.KV_DIR).write_text("not a directory")

    async def main() -> None:
        async with store([good, bad], slab=256 << 10) as kv:
            for i in range(20):
                await put(kv, b"k%d" % i, os.urandom(50_000))
            assert len(slabs(good)) == len(kv.slabs) > 1
        async with store([good, bad], slab=256 << 10) as kv:  # and the scan skips it
            assert len(kv.index) == 20

    run(main)


def test_kv_slabs_count_as_free_space_per_filesystem() -> None:
    vols = [Volume("/a", "fs1", 1000, 100), Volume("/b", "fs1", 1000, 100),
            Volume("/c", "fs2", 1000, 950)]
    out = with_reclaimable(vols, {"/a": 200, "/c": 100})
    assert [v.free for v in out] == [300, 300, 1000]  # a disk shared: once; capped
    assert with_reclaimable(vols, {}) is vols


def test_flushes_beside_evictions_keep_every_descriptor_its_own(tmp_path: Path) -> None:
    """A slab evicted while the flusher was busy with another is skipped, not closed
    twice (which would close whatever slab took its descriptor number since)."""
    rng = random.Random(4)

    async def main() -> None:
        async with store([tmp_path], budget=1 << 20, slab=64 << 10) as kv:
            values = {b"k%d" % i: rng.randbytes(rng.randrange(1000, 30_000))
                      for i in range(200)}
            done = trio.Event()

            async def flusher() -> None:
                while not done.is_set():
                    await kv.sync()
                    await trio.lowlevel.checkpoint()

            async with trio.open_nursery() as n:
                n.start_soon(flusher)
                for k, v in values.items():
                    await put(kv, k, v)
                    assert await get(kv, k) == v
                done.set()
            for slab in kv.slabs.values():
                assert os.readlink(f"/proc/self/fd/{slab.fd}") == slab.path
            for k, v in values.items():
                assert await get(kv, k) in (None, v)
            assert kv.counters.corrupt == 0

    run(main)


def test_the_scan_reads_small_records_in_chunks_and_skips_large_values(tmp_path: Path) -> None:
    rng = random.Random(6)
    path = tmp_path / kvslab.slab_name(1)
    written = []
    with path.open("wb") as f:
        off = 0
        for i in range(1500):  # heads straddle chunk boundaries somewhere
            v = rng.randbytes(rng.choice([1, 100, 3000, 20_000]) if i % 40 else 400_000)
            key = b"k%d" % i
            rec = kvslab.pack_head(b"ns", key, len(v), i + 1, crc32c.crc32c(v), 0) + v
            f.write(rec)
            written.append((off, key, len(v)))
            off += len(rec)
    fd = os.open(path, os.O_RDWR)
    try:
        recs, end = kvslab.scan(fd, str(path))
    finally:
        os.close(fd)
    assert end == off and [(r.off, r.key, r.vlen) for r in recs] == written


def test_a_failed_move_during_eviction_leaves_no_entry_on_a_dropped_slab(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = kvstore._pwrite_all
    full = False

    def pwrite(fd: int, off: int, bufs: list[memoryview]) -> None:
        if full and len(bufs) == 1:  # a moved record (a put writes head and value)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, off, bufs)

    monkeypatch.setattr(kvstore, "_pwrite_all", pwrite)

    async def main() -> None:
        nonlocal full
        async with store([tmp_path], budget=512 << 10, slab=64 << 10) as kv:
            values = {b"h%d" % i: os.urandom(20_000) for i in range(25)}
            for k, v in values.items():
                await put(kv, k, v)
            for k, v in values.items():  # all hot: an eviction moves them
                assert await get(kv, k) == v
            full = True
            with pytest.raises(OSError) as e:
                for i in range(40):
                    await put(kv, b"c%d" % i, os.urandom(20_000))
            assert e.value.errno == errno.ENOSPC
            full = False
            assert all(not e.slab.dead for e in kv.index.values())
            assert sum(e.size for e in kv.index.values()) == kv.live
            for k, v in values.items():
                assert await get(kv, k) in (None, v)
            await put(kv, b"after", b"ok")
            assert await get(kv, b"after") == b"ok"

    run(main)


def _published_matches_the_index(kv: KvStore) -> None:
    """Every indexed key is in its published slot (or counted as left out), and no
    slot names anything else."""
    from pfs.core import kvformat as F

    pub = kv.published
    assert pub is not None
    seen = set()
    left_out = 0
    for (ns, key), e in kv.index.items():
        assert e.slot is not None
        if e.slot < 0:
            left_out += 1
            continue
        at = F.INDEX_HEAD_SIZE + e.slot * F.SLOT.size
        assert F.slot_ok(memoryview(pub.mm), at)
        tag, seq, slab, off, vlen, _ = F.SLOT.unpack_from(pub.mm, at)
        assert (tag, seq, slab, off, vlen) == (F.tag_of(ns.encode(), key), e.seq,
                                               e.slab.sid, e.off, e.vlen)
        assert e.slot // F.WAYS == tag & (pub.buckets - 1)
        seen.add(e.slot)
    assert left_out == pub.unpublished
    used = {i for i in range(pub.buckets * F.WAYS)
            if F.SLOT.unpack_from(pub.mm, F.INDEX_HEAD_SIZE + i * F.SLOT.size)[0]}
    assert used == seen
    head = F.INDEX_HEAD.unpack_from(pub.mm)
    assert head[5] == pub.unpublished and head[6] == next(iter(kv.slabs), kv.next_sid)


def test_the_published_index_follows_puts_removals_evictions_and_restarts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pfs.dataserver import kvindex

    monkeypatch.setattr(kvindex, "MIN_SLOTS", 64)  # 8 buckets: some fill up
    monkeypatch.setattr(kvindex, "MAX_SLOTS", 64)
    rng = random.Random(7)

    async def main() -> None:
        async with store([tmp_path], budget=1 << 20, slab=64 << 10) as kv:
            kv.publish()
            for _ in range(400):
                key = b"k%d" % rng.randrange(120)
                op = rng.random()
                if op < 0.6:
                    await put(kv, key, rng.randbytes(rng.choice([10, 3000, 20_000])),
                              pin=rng.random() < 0.1)
                elif op < 0.8:
                    await get(kv, key)
                else:
                    await kv.remove(NS, [key])
                _published_matches_the_index(kv)
            assert kv.counters.evictions > 0 and kv.published is not None
            assert kv.published.unpublished > 0  # full buckets were met
        async with store([tmp_path], budget=1 << 20, slab=64 << 10) as kv:
            kv.publish()  # after a restart: the rebuilt index, published whole
            _published_matches_the_index(kv)
            fds = kv.open_for_reader(0)  # the index, and its reference bytes
            assert len(fds) == 2
            for fd in fds:
                os.close(fd)
            with pytest.raises(OSError) as e:
                kv.open_for_reader(10 ** 9)
            assert e.value.errno == errno.ENOENT

    run(main)
