"""Replies sent from file mappings on a disk that fails its reads (a real EIO from the
block layer: tests/faultydisk.py): a MAC'd read of a large object and a KV get of a
cached value. A page reclaimed between its fault-in and the tag, CRC or send would be
read again from the failing disk and raise SIGBUS, killing the data server; the pages
stay locked instead (pfs/core/pinning.py). The servers run with a test hook that
reclaims a range right after it is pinned (``PFS_TEST_RECLAIM_PINNED``), as memory
pressure may at any time; without the locks that reclaim takes the pages.

Then a read whose pages are not cached fails on the disk: an error (a miss for KV) the
client takes to another replica, never a dead server."""

from __future__ import annotations

import os
import random
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import pfs
from pfs.core import auth
from pfs.core.config import ClientConfig, load
from pfs.core.messages import data as D
from pfs.kvcache.remote import KvServerClient
from pfs.tools import cluster
from tests.faultydisk import Disk, faulty_disks

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not (
        shutil.which("losetup")
        and shutil.which("mkfs.ext4")
        and shutil.which("filefrag")
        and os.path.exists("/dev/fuse")
    ),
    reason="needs root, loop devices, mkfs.ext4, filefrag and FUSE",
)

MIB = 1 << 20
NS = "faults"
PAGE = 4096


@pytest.fixture
def disks_cluster(
    private_cluster: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, list[Disk]]]:
    """Two data servers, each keeping its data on a faulty disk; the servers reclaim
    every range right after pinning it."""
    monkeypatch.setenv("PFS_TEST_RECLAIM_PINNED", "1")
    mounts = [private_cluster / "data" / f"ds{i}" for i in range(2)]
    with faulty_disks(tmp_path / "disks", mounts) as disks:
        try:
            cluster.up(
                private_cluster,
                data_servers=2,
                data_args=["--heartbeat", "0.2", "--kv-budget", str(64 * MIB)],
            )
            yield private_cluster, disks
        finally:
            cluster.down(private_cluster)


def _index(d: Path, sid: str) -> int:
    (i,) = [i for i in range(2) if (d / "data" / f"ds{i}" / "server.id").read_text().strip() == sid]
    return i


def _dead(d: Path, i: int) -> str:
    """Empty while data server ``i`` runs, else how it ended (and its log's end)."""
    pid = int((d / "run" / f"data{i}.pid").read_text())
    done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        return ""
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    how = f"killed by {signal.Signals(sig).name}" if sig else f"exit {status >> 8}"
    return f"data server {i} {how}; its log ends:\n{_log(d, i)[-2000:]}"


def _cache(path: Path, off: int = 0, n: int = -1) -> None:
    """Read ``path``'s range into the page cache."""
    with open(path, "rb") as f:
        f.seek(off)
        f.read(n)


def _evict(path: Path, off: int = 0, n: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _log(d: Path, i: int) -> str:
    return (d / "logs" / f"data{i}.log").read_text()


def test_a_large_read_from_a_failing_disk_never_kills_the_server(
    disks_cluster: tuple[Path, list[Disk]],
) -> None:
    d, disks = disks_cluster
    cfg = load(ClientConfig, d / "client.toml")
    cfg.short_circuit = False  # over TCP, MAC'd: the mapped path
    rnd = random.Random(7)
    with pfs.connect(config=cfg) as c:
        c.makedirs("/f")
        c.set_layout("/f", count=1, unit=4 * MIB, replicas=2)
        data, other = rnd.randbytes(4 * MIB), rnd.randbytes(4 * MIB)
        c.write_file("/f/victim", data)
        c.write_file("/f/other", other)
        x = _index(d, c.get_layout("/f/victim")["servers"][0][0])  # read first
        ino = c.stat("/f/victim").st_ino
        (obj,) = (d / "data" / f"ds{x}").glob(f"objects/*/{ino}.0")
        os.sync()
        sectors = disks[x].extents(obj)

        # cached, then the disk fails: served from the locked pages, though the hook
        # reclaims the range between its fault-in and the tag (without the lock, the
        # tag's read of a reclaimed page gets EIO from the disk: SIGBUS)
        _cache(obj)
        disks[x].fail(sectors)
        with c.open("/f/victim", "rb") as f:
            assert f.pread(len(data), 0) == data
        assert not (dead := _dead(d, x)), dead

        # not cached: the server answers EIO, the client reads the other replica
        _evict(obj)
        with c.open("/f/victim", "rb") as f:
            assert f.pread(len(data), 0) == data
        assert not (dead := _dead(d, x)), dead
        assert "could not be read from the disk" in _log(d, x)

        # the server still serves its other objects (verified from its disk)
        lay = c.get_layout("/f/other")
        sid = [s for s in lay["servers"][0] if _index(d, s) == x][0]
        with c.open("/f/other", "rb") as f:
            cap = f.handle.cap

        async def verify() -> Any:
            return (
                await c.aio.data.send(sid, D.Verify(obj=(c.stat("/f/other").st_ino, 0), cap=cap))
            ).fields

        assert c._run(verify)["bad"] == []
        with c.open("/f/other", "rb") as f:
            assert f.pread(len(other), 0) == other
        assert not (dead := _dead(d, x)), dead


def test_a_kv_get_from_a_failing_disk_never_kills_the_server(
    disks_cluster: tuple[Path, list[Disk]],
) -> None:
    d, disks = disks_cluster
    cfg = load(ClientConfig, d / "client.toml")
    creds = auth.client_auth(cfg.key_file, cfg.key_name, wire=cfg.wire_security)
    with pfs.connect(config=cfg) as c:
        servers = c._run(c.aio.meta.servers)
    sid, srv = next(iter(servers.items()))
    x = _index(d, sid)
    rnd = random.Random(8)
    values = {b"victim": rnd.randbytes(MIB), b"other": rnd.randbytes(MIB)}

    async def put() -> None:
        async with KvServerClient.connect(srv["host"], srv["port"], creds) as kv:
            for k, v in values.items():
                assert await kv.put(NS, k, v) == len(v)

    async def get(key: bytes) -> bytes | None:
        out = memoryview(bytearray(2 * MIB))
        async with KvServerClient.connect(srv["host"], srv["port"], creds) as kv:
            n = await kv.get_into(NS, key, out)
        return None if n is None else bytes(out[:n])

    trio.run(put)
    os.sync()
    (slab,) = [
        p
        for p in (d / "data" / f"ds{x}" / "kv").rglob("*")
        if p.is_file() and values[b"victim"][:64] in p.read_bytes()
    ]
    off = slab.read_bytes().index(values[b"victim"])
    # the value's middle fails; its first and last pages stay cached, so the server
    # takes it for cached and maps it
    mid_lo, mid_hi = -(-(off + 1) // PAGE) * PAGE, (off + MIB - 1) // PAGE * PAGE
    sectors = disks[x].extents(slab, mid_lo, mid_hi - mid_lo)

    _cache(slab, off, MIB)  # all cached: served from the locked pages
    disks[x].fail(sectors)
    assert trio.run(get, b"victim") == values[b"victim"]
    assert not (dead := _dead(d, x)), dead

    # the hook reclaimed the value as it was released: its first and last pages are
    # read again (they are readable), its middle fails: a miss, the server lives
    _cache(slab, off, 1)
    _cache(slab, off + MIB - 1, 1)
    assert trio.run(get, b"victim") is None
    assert not (dead := _dead(d, x)), dead
    assert "unreadable" in _log(d, x)

    _evict(slab)  # another value, read from the disk
    assert trio.run(get, b"other") == values[b"other"]
    assert not (dead := _dead(d, x)), dead
