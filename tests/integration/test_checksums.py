"""Block checksums against real servers: a flipped byte, a missing or short object is
EIO naming the file, never wrong bytes or zeros; holes stay holes; concurrent partial
writes leave matching checksums; ``verify`` and the scrubber find a bad block."""
from __future__ import annotations

import errno
import os
import random
import time
from pathlib import Path

import pytest

import pfs
from pfs.core.config import ClientConfig, load
from pfs.core.messages import data as D
from pfs.tools import cluster
from tests.conftest import run_threads

BLOCK = 64 << 10
UNIT = 1 << 20


def _client(client_toml: Path, short_circuit: bool = False):
    cfg = load(ClientConfig, client_toml)
    cfg.short_circuit = short_circuit
    return pfs.connect(config=cfg)


def _objects(cluster_dir: Path, ino: int, stripe: int = 0) -> list[Path]:
    """The object files of ``(ino, stripe)`` on every data server (replicas)."""
    return sorted((cluster_dir / "data").glob(f"ds*/objects/*/{ino}.{stripe}"))


def _flip(path: Path, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


def _verify(c, path: str, stripe: int = 0, replica: int = 0) -> dict:
    lay = c.get_layout(path)
    sid = lay["servers"][stripe][replica]
    ino = c.stat(path).st_ino
    with c.open(path, "rb") as f:
        cap = f.handle.cap

    async def call() -> dict:
        res = await c.aio.data.send(sid, D.Verify(obj=(ino, stripe), cap=cap))
        return res.fields

    return c._run(call)


def _expect_eio(c, path: str, off: int, n: int) -> OSError:
    with pytest.raises(OSError) as ei:
        with c.open(path, "rb") as f:
            f.pread(n, off)
    assert ei.value.errno == errno.EIO
    assert path in str(ei.value)
    return ei.value


@pytest.mark.parametrize("short_circuit", [False, True], ids=["network", "local"])
def test_flipped_byte_is_eio_naming_the_file(client_toml, cluster_dir, workdir,
                                             short_circuit: bool) -> None:
    with _client(client_toml, short_circuit) as c:
        c.set_layout(workdir, count=1, unit=UNIT, replicas=1)
        path = f"{workdir}/f"
        data = random.Random(1).randbytes(5 * BLOCK + 100)
        c.write_file(path, data)
        ino = c.stat(path).st_ino
        assert _verify(c, path) == {"blocks": 6, "bad": [], "unchecked": False}
        (obj,) = _objects(cluster_dir, ino)
        _flip(obj, 2 * BLOCK + 7)
        err = _expect_eio(c, path, 2 * BLOCK, 10)  # a small read (one step)
        assert "stripe 0" in str(err) and f"offset {2 * BLOCK}" in str(err)
        _expect_eio(c, path, 0, len(data))  # a large one
        # the blocks around it still read
        with c.open(path, "rb") as f:
            assert f.pread(BLOCK, 0) == data[:BLOCK]
            assert f.pread(100, 5 * BLOCK) == data[5 * BLOCK:]
        assert _verify(c, path)["bad"] == [2 * BLOCK]
        if short_circuit:
            assert c.aio.local is not None and c.aio.local.stats["local_bytes"] > 0


@pytest.mark.parametrize("short_circuit", [False, True], ids=["network", "local"])
def test_short_object_is_eio_not_zeros(client_toml, cluster_dir, workdir,
                                       short_circuit: bool) -> None:
    with _client(client_toml, short_circuit) as c:
        c.set_layout(workdir, count=1, unit=UNIT, replicas=1)
        path = f"{workdir}/short"
        data = random.Random(2).randbytes(4 * BLOCK)
        c.write_file(path, data)
        (obj,) = _objects(cluster_dir, c.stat(path).st_ino)
        os.truncate(obj, BLOCK + 10)
        _expect_eio(c, path, 3 * BLOCK, 100)  # wholly past the object's end
        _expect_eio(c, path, 0, len(data))
        with c.open(path, "rb") as f:
            assert f.pread(BLOCK, 0) == data[:BLOCK]


@pytest.mark.parametrize("short_circuit", [False, True], ids=["network", "local"])
def test_holes_and_sparse_files_read_right(client_toml, workdir, short_circuit: bool) -> None:
    with _client(client_toml, short_circuit) as c:
        c.set_layout(workdir, count=2, unit=4 * BLOCK)
        path = f"{workdir}/sparse"
        with c.open(path, "wb") as f:
            f.pwrite(b"a" * 100, 3 * BLOCK + 5)
            f.pwrite(b"b" * 50, 20 * BLOCK - 50)
            f.truncate(30 * BLOCK)
        want = bytearray(30 * BLOCK)
        want[3 * BLOCK + 5:3 * BLOCK + 105] = b"a" * 100
        want[20 * BLOCK - 50:20 * BLOCK] = b"b" * 50
        with c.open(path, "rb") as f:
            assert f.pread(len(want), 0) == want
            assert f.pread(BLOCK, 10 * BLOCK) == bytes(BLOCK)
        with c.open(path, "r+b") as f:  # cut inside a written block, then extend
            f.truncate(3 * BLOCK + 50)
            f.truncate(5 * BLOCK)
        want = want[:3 * BLOCK + 50] + bytes(5 * BLOCK - (3 * BLOCK + 50))
        with c.open(path, "rb") as f:
            assert f.pread(len(want) + 10, 0) == want
        assert _verify(c, path)["bad"] == []


@pytest.mark.parametrize("short_circuit", [False, True], ids=["network", "local"])
def test_large_reads_verified_in_steps(client_toml, cluster_dir, workdir,
                                       short_circuit: bool) -> None:
    """Reads large enough to be verified on worker threads (network replies in parts,
    short-circuit reads in steps beside the next read): bit-exact, holes in the middle
    of a step read as zeros, and a flipped byte in any step is EIO at its block."""
    big = 16 << 20
    with _client(client_toml, short_circuit) as c:
        c.set_layout(workdir, count=1, unit=big, replicas=1)
        path = f"{workdir}/large"
        data = bytearray(random.Random(4).randbytes(big - 3 * BLOCK - 5))
        with c.open(path, "wb") as f:
            f.pwrite(data[:5 << 20], 0)
            f.pwrite(data[(5 << 20) + 2 * BLOCK:], (5 << 20) + 2 * BLOCK)  # a 2-block hole
        data[5 << 20:(5 << 20) + 2 * BLOCK] = bytes(2 * BLOCK)
        with c.open(path, "rb") as f:
            assert f.pread(len(data), 0) == data
            buf = bytearray(len(data) - 777)
            assert f.readinto(memoryview(buf)) == len(buf)
            assert buf == data[:len(buf)]
        (obj,) = _objects(cluster_dir, c.stat(path).st_ino)
        for at in ((13 << 20) + 5, (1 << 20) + 3):  # a late step, then an early one
            _flip(obj, at)
            err = _expect_eio(c, path, 0, len(data))
            assert f"offset {at - at % BLOCK}" in str(err)
            _flip(obj, at)  # back: the file reads again
            with c.open(path, "rb") as f:
                assert f.pread(len(data), 0) == data
        if short_circuit:
            assert c.aio.local is not None and c.aio.local.stats["local_bytes"] > 0


def test_aligned_network_read_of_a_flip_is_eio(client_toml, cluster_dir, workdir) -> None:
    """A read of whole blocks is sent from the file (sendfile) with their checksums:
    the reader verifies them, so a flipped byte is still EIO."""
    with _client(client_toml) as c:
        c.set_layout(workdir, count=1, unit=UNIT, replicas=1)
        path = f"{workdir}/aligned"
        data = random.Random(3).randbytes(6 * BLOCK + 300)
        c.write_file(path, data)
        (obj,) = _objects(cluster_dir, c.stat(path).st_ino)
        _flip(obj, 3 * BLOCK + 1000)
        _expect_eio(c, path, 3 * BLOCK, BLOCK)  # the one block
        _expect_eio(c, path, 2 * BLOCK, 2 * BLOCK)  # blocks around it
        _expect_eio(c, path, 0, 6 * BLOCK)
        with c.open(path, "rb") as f:  # aligned reads of the good blocks still work
            assert f.pread(2 * BLOCK, 0) == data[:2 * BLOCK]
            assert f.pread(BLOCK + 300, 5 * BLOCK) == data[5 * BLOCK:]  # to the end
        _flip(obj, 6 * BLOCK + 10)  # the partial last block: the server checks it
        _expect_eio(c, path, 5 * BLOCK, BLOCK + 300)


def test_concurrent_writes_and_aligned_reads_never_eio(client_toml, workdir) -> None:
    """Readers sending blocks from the file hold them until sent: a writer of the same
    blocks never makes a checksum and the bytes sent disagree."""
    n = 8 * BLOCK
    with _client(client_toml) as c0, _client(client_toml) as c1:
        c0.set_layout(workdir, count=1, unit=UNIT, replicas=1)
        path = f"{workdir}/race"
        c0.write_file(path, b"\0" * n)
        deadline = time.monotonic() + 3

        def work(i: int) -> None:
            if i == 0:
                with c0.open(path, "r+b") as f:
                    k = 0
                    while time.monotonic() < deadline:
                        k += 1
                        f.pwrite(bytes([k % 251]) * n, 0)
            else:
                with c1.open(path, "rb") as f:
                    while time.monotonic() < deadline:
                        got = f.pread(n, 0)
                        assert len(got) == n
                        for b in range(0, n, BLOCK):  # each block one write's bytes
                            assert got[b:b + BLOCK] == got[b:b + 1] * BLOCK

        assert run_threads(work, 2) == []


def test_concurrent_partial_writes_to_one_block(client_toml, workdir) -> None:
    with _client(client_toml) as c0, _client(client_toml) as c1:
        c0.set_layout(workdir, count=1, unit=UNIT, replicas=1)
        path = f"{workdir}/shared"
        c0.write_file(path, b"")
        clients = (c0, c1)
        rounds = 40

        def writer(i: int) -> None:
            with clients[i].open(path, "r+b") as f:
                for r in range(rounds):
                    # both write into the same blocks: alternate 1000-byte pieces
                    off = (2 * r + i) * 1000
                    f.pwrite(bytes([65 + i]) * 1000, off)

        assert run_threads(writer, 2) == []
        want = b"".join(bytes([65 + (k % 2)]) * 1000 for k in range(2 * rounds))
        with c0.open(path, "rb") as f:
            assert f.pread(len(want), 0) == want
        assert _verify(c0, path)["bad"] == []


def test_interleaved_ior_hard_pattern(client_toml, workdir) -> None:
    """IO500 ior-hard: 47,008-byte segments interleaved between two writers."""
    seg, per = 47_008, 12
    with _client(client_toml) as c0, _client(client_toml) as c1:
        c0.set_layout(workdir, count=2, unit=UNIT)
        path = f"{workdir}/ior"
        c0.write_file(path, b"")
        clients = (c0, c1)

        def piece(k: int) -> bytes:
            return random.Random(k).randbytes(seg)

        def writer(i: int) -> None:
            with clients[i].open(path, "r+b") as f:
                for r in range(per):
                    k = 2 * r + i
                    f.pwrite(piece(k), k * seg)

        assert run_threads(writer, 2) == []
        want = b"".join(piece(k) for k in range(2 * per))
        with c1.open(path, "rb") as f:
            assert f.pread(len(want), 0) == want
        for stripe in range(2):
            assert _verify(c0, path, stripe)["bad"] == []


def test_replica_with_a_flipped_byte_reads_the_other(client_toml, cluster_dir,
                                                     workdir) -> None:
    with _client(client_toml) as c:
        c.set_layout(workdir, count=1, unit=UNIT, replicas=2)
        path = f"{workdir}/rep"
        data = random.Random(3).randbytes(3 * BLOCK)
        c.write_file(path, data)
        lay = c.get_layout(path)
        first = lay["servers"][0][0]
        ino = c.stat(path).st_ino
        objs = _objects(cluster_dir, ino)
        assert len(objs) == 2
        # flip a byte on the replica read first: the one whose server id file names it
        (bad,) = [o for o in objs
                  if (o.parents[2] / "server.id").read_text().strip() == first]
        _flip(bad, BLOCK + 1)
        with c.open(path, "rb") as f:
            assert f.pread(len(data), 0) == data
            assert f.pread(10, BLOCK) == data[BLOCK:BLOCK + 10]
        assert _verify(c, path, 0, 0)["bad"] == [BLOCK]
        assert _verify(c, path, 0, 1)["bad"] == []


@pytest.mark.parametrize("route", ["sync", "trio"])
def test_aligned_local_read_of_a_flipped_byte_reads_the_other(client_toml, cluster_dir,
                                                               workdir, route: str) -> None:
    """A short-circuit read of whole blocks (straight into the caller's buffer, verified
    there) that meets a flipped byte goes to the network, which reads the good replica:
    the bad byte never comes back."""
    with _client(client_toml, short_circuit=True) as c:
        c.set_layout(workdir, count=1, unit=UNIT, replicas=2)
        path = f"{workdir}/al-{route}"
        data = random.Random(4).randbytes(4 * BLOCK)
        c.write_file(path, data)
        ino = c.stat(path).st_ino
        for obj in _objects(cluster_dir, ino):  # every local descriptor is bad
            _flip(obj, 2 * BLOCK + 9)
        with c.open(path, "rb") as f:
            with pytest.raises(OSError) as ei:  # no good replica: EIO, never the byte
                f.pread(len(data), 0)
            assert ei.value.errno == errno.EIO
        _flip(_objects(cluster_dir, ino)[0], 2 * BLOCK + 9)  # one replica good again
        buf = bytearray(len(data))
        with c.open(path, "rb") as f:
            if route == "sync":  # the blocking driver, in this thread: whole blocks
                assert f.preadinto(memoryview(buf)[:BLOCK], 0) == BLOCK  # gets the fd
                for b in range(1, 4):
                    assert f.handle.pread_blocking(memoryview(buf)[b * BLOCK:(b + 1) * BLOCK],
                                                   b * BLOCK) == BLOCK
            else:
                assert f._run(f.handle.pread_into, memoryview(buf), 0) == len(data)
        assert buf == data
        assert c.aio.local is not None and c.aio.local.stats["fds"] > 0  # tried locally


def test_missing_object_is_eio_and_scrubber_finds_a_flip(private_cluster: Path) -> None:
    """A cluster of its own: the scrubber on at a high rate, and a restart so that the
    servers hold no descriptor of a deleted object."""
    cluster.up(private_cluster, data_servers=1, data_args=["--scrub-rate", str(64 << 20)])
    toml = private_cluster / "client.toml"
    with _client(toml) as c:
        c.makedirs("/d")
        c.set_layout("/d", count=1, unit=UNIT)
        c.write_file("/d/gone", random.Random(4).randbytes(2 * BLOCK))
        c.write_file("/d/flip", random.Random(5).randbytes(3 * BLOCK))
        gone = _objects(private_cluster, c.stat("/d/gone").st_ino)[0]
        flip = _objects(private_cluster, c.stat("/d/flip").st_ino)[0]
    cluster.down(private_cluster)
    gone.unlink()
    _flip(flip, 2 * BLOCK + 3)
    cluster.up(private_cluster, data_args=["--scrub-rate", str(64 << 20)])
    with _client(toml) as c:
        _expect_eio(c, "/d/gone", 0, 100)
        sid = c.get_layout("/d/flip")["servers"][0][0]

        async def statfs() -> dict:
            return (await c.aio.data.send(sid, D.Statfs())).fields

        deadline = time.monotonic() + 30
        while c._run(statfs)["scrub_errors"] < 1:
            assert time.monotonic() < deadline, "the scrubber found nothing"
            time.sleep(0.2)
        assert c._run(statfs)["scrub_errors"] == 1


def test_checksums_off_reads_unchecked(private_cluster: Path) -> None:
    """The measurement knob: a data server with ``--no-checksums`` keeps none (a flipped
    byte then reads as it is: what the checksums are for), ``verify`` says unchecked."""
    toml = cluster.up(private_cluster, data_servers=1, data_args=["--no-checksums"])
    with _client(toml) as c:
        c.makedirs("/d")
        c.set_layout("/d", count=1, unit=UNIT)
        data = random.Random(6).randbytes(2 * BLOCK)
        c.write_file("/d/f", data)
        assert _verify(c, "/d/f") == {"blocks": 0, "bad": [], "unchecked": True}
        (obj,) = _objects(private_cluster, c.stat("/d/f").st_ino)
        assert not obj.with_name(obj.name + ".crc").exists()
        _flip(obj, 10)
        with c.open("/d/f", "rb") as f:
            assert f.pread(20, 0) != data[:20]
