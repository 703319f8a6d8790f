"""Short-circuit reads: descriptors handed over a local socket, against real servers."""
from __future__ import annotations

import errno
import logging
import os
import random

import pytest

import pfs
from pfs.client.plan import open_fd_request
from pfs.core.config import ClientConfig, load

UNIT = 64 * 1024


def _client(client_toml, short_circuit: bool):
    cfg = load(ClientConfig, client_toml)
    cfg.short_circuit = short_circuit
    return pfs.connect(config=cfg)


def test_on_and_off_read_the_same_bytes(client, client_toml, workdir) -> None:
    client.set_layout(workdir, count=4, unit=UNIT)
    data = os.urandom(37 * UNIT + 1234)
    client.write_file(f"{workdir}/f", data)
    with client.open(f"{workdir}/f", "r+b") as f:  # a hole, then data beyond it
        f.pwrite(b"tail", len(data) + 5 * UNIT)
    data = data + bytes(5 * UNIT) + b"tail"
    rng = random.Random(4)
    ranges = [(rng.randrange(0, len(data)), rng.randrange(0, 6 * UNIT)) for _ in range(40)]
    ranges += [(0, len(data))]
    got = {}
    for sc in (True, False):
        with _client(client_toml, sc) as c:
            with c.open(f"{workdir}/f", "rb") as f:
                got[sc] = [f.pread(n, off) for off, n in ranges]
            stats = c.aio.local.stats if c.aio.local is not None else None
        if sc:
            assert stats is not None and stats["fds"] == 4 and stats["local_bytes"] > 0
        else:
            assert stats is None
    assert got[True] == got[False] == [data[off:off + n] for off, n in ranges]


def test_handles_open_for_writing_stay_on_the_network(client, workdir) -> None:
    """Writes go through the servers; a read-write handle reads through them too, so it
    always sees its own writes."""
    path = f"{workdir}/rw"
    before = dict(client.aio.local.stats)
    with client.open(path, "w+b") as f:
        f.write(b"x" * 1000)
        assert f.pread(1000, 0) == b"x" * 1000
    assert client.aio.local.stats == before


def _local_channel(client, path: str):
    """The local channel to the server of ``path``'s first stripe, and its ino."""
    lay = client.get_layout(path)
    sid = lay["servers"][0][0]
    ino = client.stat(path).st_ino
    ch = client._run(client.aio.local.channel, sid)
    assert ch is not None, "the data server's local socket is not reachable"
    return ch, ino


def test_descriptor_needs_a_valid_capability(client, workdir) -> None:
    path = f"{workdir}/capped"
    client.write_file(path, b"secret" * 1000)
    ch, ino = _local_channel(client, path)
    for bad in (None, b"forged" * 20):
        with pytest.raises(OSError) as ei:
            client._run(ch.open_fd, ino, 0, bad)
        assert ei.value.errno == errno.EACCES
    # a real capability for another file is refused too
    other = f"{workdir}/other"
    client.write_file(other, b"o")
    with client.open(other, "rb") as f:
        cap = f.handle.cap
    with pytest.raises(OSError) as ei:
        client._run(ch.open_fd, ino, 0, cap)
    assert ei.value.errno == errno.EACCES


def test_descriptor_is_read_only(client, workdir) -> None:
    path = f"{workdir}/ro"
    client.write_file(path, b"abc" * 100)
    ch, ino = _local_channel(client, path)
    with client.open(path, "rb") as f:
        fd = client._run(ch.open_fd, ino, 0, f.handle.cap)
    try:
        assert os.pread(fd, 3, 0) == b"abc"
        with pytest.raises(OSError) as ei:
            os.pwrite(fd, b"zzz", 0)
        assert ei.value.errno == errno.EBADF
    finally:
        os.close(fd)
    assert client.read_file(path) == b"abc" * 100


def test_open_fd_is_refused_over_tcp(client, workdir) -> None:
    path = f"{workdir}/tcp"
    client.write_file(path, b"x")
    sid = client.get_layout(path)["servers"][0][0]
    with client.open(path, "rb") as f:
        cap = f.handle.cap

        async def ask():
            return await client.aio.data.send(sid, open_fd_request(f.handle.ino, 0, cap))

        with pytest.raises(OSError) as ei:
            client._run(ask)
    assert ei.value.errno == errno.EPERM


def test_client_close_releases_descriptors_of_files_left_open(client_toml, workdir) -> None:
    import gc

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with pfs.connect(config=client_toml) as c:
        c.set_layout(workdir, count=4, unit=64 * 1024)
        c.write_file(f"{workdir}/f", os.urandom(1 << 20))
    gc.collect()  # descriptors of earlier tests' garbage must not go during the count
    before = fds()
    c = pfs.connect(config=client_toml)
    f = c.open(f"{workdir}/f", "rb")
    f.read()
    assert c.aio.local is not None and c.aio.local.stats["fds"] > 0  # it read through short-circuit descriptors
    c.close()  # f is left open
    f.close()
    del f
    gc.collect()
    assert fds() == before


def test_closing_during_a_read_keeps_its_descriptor_until_the_read_ends(tmp_path) -> None:
    """A handle closed while a short-circuit read is in flight (another thread of the
    sync client): the descriptor must stay until that read is done, or the read could
    land on whatever file reuses its number."""
    import collections

    import trio
    import trio.testing

    from pfs.client.shortcircuit import HandleObjects

    obj = tmp_path / "obj"
    obj.write_bytes(b"abcdef")

    class Engine:
        def __init__(self) -> None:
            self.release = trio.Event()

        async def submit(self, ops):
            await self.release.wait()
            return [os.preadv(op.fd, [op.buf], op.offset) for op in ops]

    class Servers:
        def __init__(self) -> None:
            self.handles: set = set()
            self.stats: collections.Counter = collections.Counter()
            self.engine = Engine()

        async def open_fd(self, sid, ino, stripe, cap):
            return os.open(obj, os.O_RDONLY), None  # an object without checksums

    async def main() -> None:
        servers = Servers()
        objs = HandleObjects(servers)  # type: ignore[arg-type]
        fd = await objs.fd(("ds0",), 7, 0, None)
        assert fd is not None
        buf = bytearray(6)
        async with trio.open_nursery() as n:
            n.start_soon(objs.read, fd, 0, [memoryview(buf)])
            await trio.testing.wait_all_tasks_blocked()
            objs.close()
            os.fstat(fd)  # still open: the read in flight uses it
            servers.engine.release.set()
        assert bytes(buf) == b"abcdef"
        with pytest.raises(OSError) as err:
            os.fstat(fd)
        assert err.value.errno == errno.EBADF
        with pytest.raises(OSError) as err:
            await objs.fd(("ds0",), 7, 1, None)
        assert err.value.errno == errno.EBADF

    trio.run(main)


def test_small_reads_of_local_objects_stay_in_the_calling_thread(client_toml, workdir) -> None:
    """Once a handle holds its stripes' descriptors, the sync client serves small reads
    in the calling thread (no trio hop), bit-exact across stripes and at the file's end;
    large reads still go to the engine."""
    data = os.urandom(3 * UNIT + 1234)
    with pfs.connect(config=client_toml) as c:
        assert c.aio.direct_max == 64 << 10  # the auto profile's small reads
        c.set_layout(workdir, count=4, unit=UNIT)
        c.write_file(f"{workdir}/f", data)
        with c.open(f"{workdir}/f", "rb") as f:
            assert f.read() == data  # the engine path; it obtains the descriptors
            hops: list[object] = []
            real = c._loop.run
            c._loop.run = lambda fn, *a: hops.append(fn) or real(fn, *a)  # type: ignore
            assert c.aio.local is not None
            before = c.aio.local.stats["local_reads"]
            rng = random.Random(5)
            for _ in range(300):
                off = rng.randrange(0, len(data) + 100)
                n = rng.choice([1, 100, 4096, 5000, UNIT])
                assert f.pread(n, off) == data[off:off + n], (off, n)
            buf = bytearray(8192)
            f.seek(len(data) - 100)
            assert f.readinto(buf) == 100 and buf[:100] == data[-100:]
            assert f.readinto(buf) == 0
            assert hops == []
            assert c.aio.local.stats["local_reads"] > before
            big = bytearray(len(data))
            assert f.preadinto(big, 0) == len(data) and big == data
            assert len(hops) == 1  # larger than direct_max: stripes in parallel
    cfg = load(ClientConfig, client_toml)
    cfg.profile = "load"
    with pfs.connect(config=cfg) as c:
        assert c.aio.direct_max == 0


def test_open_local_asks_for_every_stripe_at_once(client_toml, workdir) -> None:
    """A loader's ``open_local``: every stripe's descriptor held before any read, and the
    reads that follow are all short-circuit; off, or for a writer, it holds none."""
    data = os.urandom(9 * UNIT + 5)
    for sc in (True, False):
        with _client(client_toml, sc) as c:
            path = f"{workdir}/all-{sc}"
            c.set_layout(workdir, count=4, unit=UNIT)
            c.write_file(path, data)

            async def go(c=c, path=path) -> tuple[int, bytes, int]:
                f = await c.aio.open(path, "rb")
                try:
                    held = await f.open_local()
                    again = await f.open_local()  # nothing left to ask for
                    assert again == held
                    buf = bytearray(len(data))
                    await f.pread_into(buf, 0)
                    w = await c.aio.open(path, "r+b")
                    try:
                        assert await w.open_local() == 0
                    finally:
                        await w.close()
                    return held, bytes(buf), c.aio.local.stats["fds"] if c.aio.local else 0
                finally:
                    await f.close()

            held, got, fds = c._run(go)
            assert got == data
            if sc:
                assert held == 4 and fds == 4  # asked once each, by open_local
                assert c.aio.local.stats["local_bytes"] >= len(data)
            else:
                assert held == 0


def test_pread_many_reads_local_objects_in_bulk(client_toml, cluster_dir, workdir,
                                                caplog) -> None:
    """A loader's ``pread_many``: many reads of one file, local objects read by object
    on threads; bit-exact with the network path (holes, odd edges, the file's end), and
    a block that does not verify is read from the other replica, or is EIO naming the
    file when there is none."""
    unit = 4 * UNIT
    data = bytearray(os.urandom(41 * unit + 777))
    data[9 * unit + 5:13 * unit] = bytes(4 * unit - 5)  # zeros the writer leaves a hole
    rng = random.Random(7)
    reads = [(0, 3 * unit + 13), (3 * unit + 13, 20 * unit), (23 * unit + 13, len(data)),
             (rng.randrange(len(data)), 5000), (len(data) + 10, 10), (5 * UNIT + 3, 0)]
    reads += [(rng.randrange(len(data)), rng.randrange(3 * unit)) for _ in range(12)]
    want = [bytes(data[o:o + n]) for o, n in reads]
    for sc, replicas in ((True, 2), (False, 2), (True, 1)):
        with _client(client_toml, sc) as c:
            path = f"{workdir}/many-{sc}-{replicas}"
            c.set_layout(workdir, count=3, unit=unit, replicas=replicas)
            with c.open(path, "wb") as f:  # written around the hole
                f.pwrite(bytes(data[:9 * unit + 5]), 0)
                f.pwrite(bytes(data[13 * unit:]), 13 * unit)

            async def go(c=c, path=path) -> tuple[list[int], list[bytes], list[int]]:
                f = await c.aio.open(path, "rb")
                try:
                    await f.open_local()
                    bufs = [bytearray(n) for _o, n in reads]
                    seen: list[int] = []
                    got = await f.pread_many([(o, b) for (o, _n), b in zip(reads, bufs, strict=True)],
                                             done=lambda _off, n: seen.append(n))
                    return got, [bytes(b) for b in bufs], seen
                finally:
                    await f.close()

            got, bufs, seen = c._run(go)
            assert got == [len(w) for w in want]
            assert [b[:len(w)] for b, w in zip(bufs, want, strict=True)] == want
            assert sum(seen) == sum(got)
            if sc:
                assert c.aio.local is not None
                assert c.aio.local.stats["local_bytes"] >= sum(got)
                ino = c.stat(path).st_ino
                objs = sorted((cluster_dir / "data").glob(f"ds*/objects/*/{ino}.1"))
                assert len(objs) == replicas
                # each replica bad at another unit (the reads cover the whole file):
                # whichever is local, a unit of its fails and the other replica has it
                for k, obj in enumerate(objs):
                    with open(obj, "r+b") as fo:
                        at = (1 + 9 * k) * unit + 7
                        fo.seek(at)
                        b = fo.read(1)
                        fo.seek(at)
                        fo.write(bytes([b[0] ^ 0x40]))
                caplog.clear()
                if replicas > 1:  # the bad units' bytes from the other replica
                    with caplog.at_level(logging.INFO, logger="pfs.client.shortcircuit"):
                        got, bufs, _seen = c._run(go)
                    assert [b[:len(w)] for b, w in zip(bufs, want, strict=True)] == want
                    assert "over the network" in caplog.text
                else:
                    with pytest.raises(OSError) as ei:
                        c._run(go)
                    assert ei.value.errno == errno.EIO and path in str(ei.value)
