"""The default (copying) ``load_safetensors`` from pfs with every stripe local: fresh
region buffers filled by ``UFFDIO_COPY`` from the objects' page cache
(:mod:`pfs.client.filled`), against real clusters: bit-exact private memory, verified,
the same with the kernel feature off, and checksum failures handled as by a read."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pfs.client import uffd
from pfs.core.checksums import BLOCK
from pfs.loader import pool
from pfs.loader.safetensors import load_safetensors
from tests.integration.test_checksums import _flip, _objects
from tests.integration.test_loader_zerocopy import (
    UNIT,
    address,
    check,
    make_checkpoint,
    object_maps,
    put,
    sc_client,
    write_holes,
)

pytestmark = pytest.mark.skipif(not uffd.available(), reason="no userfaultfd here")


def filled(c: Any) -> int:
    return int(c.aio.local.stats["filled_bytes"])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("fill-ckpt")
    return d, make_checkpoint(d)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_fresh_buffers_are_filled_private_and_writable(
    framework: str, ckpt: Any, workdir: str, client_toml: Path, cluster_dir: Path
) -> None:
    """A load into fresh buffers copies the whole blocks page for page: bit-exact,
    every tensor where its file offset says within a page (so aligned as the file),
    private memory (no mapping of an object file is left, writes stay in the
    process), and the buffers go back to the pool and serve the next load."""
    pytest.importorskip(framework)
    d, truth = ckpt
    pool.release()
    with sc_client(client_toml) as c:
        src = put(c, d, f"{workdir}/ck")
        out = load_safetensors(src, client=c, framework=framework)
        check(out, truth)
        assert filled(c) >= 8 * BLOCK
        assert not object_maps(cluster_dir / "data")  # the sources closed with the files
        for name, t in out.items():
            item = np.asarray(t).itemsize if framework == "numpy" else t.element_size()
            assert address(t) % item == 0, name
        big = out["q"]
        before = np.asarray(big).tobytes() if framework == "numpy" else big.numpy().tobytes()
        big[:] = 0
        again = load_safetensors(src, client=c, framework="numpy")  # fresh: q still held
        assert np.asarray(again["q"]).tobytes() == before
        del out, big, again
        n = filled(c)
        reused = pool.POOL.stats["reused_bytes"]
        third = load_safetensors(src, client=c, framework="numpy")  # into reused buffers
        check(third, truth)
        assert pool.POOL.stats["reused_bytes"] > reused and filled(c) == n
        del third


def test_without_userfaultfd_the_same_bytes(
    client_toml: Path, workdir: str, ckpt: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel refuses a userfaultfd the buffers are populated and read as
    before: nothing filled, the same tensors."""
    d, truth = ckpt
    monkeypatch.setattr(uffd, "ENABLED", False)
    pool.release()
    with sc_client(client_toml) as c:
        src = put(c, d, f"{workdir}/ck")
        out = load_safetensors(src, client=c, framework="numpy")
        check(out, truth)
        assert filled(c) == 0 and c.aio.local.stats["local_bytes"] > 0


def test_a_filled_block_that_does_not_verify_is_read_elsewhere_or_fails(
    client_toml: Path, cluster_dir: Path, workdir: str, ckpt: Any
) -> None:
    """A corrupted block in a filled chunk is never returned: with the other replica
    good, the chunk goes over the network into the same (now present) pages and the
    load is bit-exact; with both replicas bad the load fails with EIO naming the file."""
    d, truth = ckpt
    shard = "model-00002-of-00003.safetensors"
    pool.release()
    with sc_client(client_toml) as c:
        src = put(c, d, f"{workdir}/ck")
        ino = c.stat(f"{src}/{shard}").st_ino
        objs = _objects(cluster_dir, ino, 1)
        assert len(objs) == 2
        _flip(objs[0], 100)
        _flip(objs[1], BLOCK + 100)
        out = load_safetensors(src, client=c, framework="numpy")
        check(out, truth)
        assert filled(c) > 0
        del out
        pool.release()  # fresh buffers again
        _flip(objs[1], 100)
        with pytest.raises(OSError) as ei:
            load_safetensors(src, client=c, framework="numpy")
        assert ei.value.errno == errno.EIO and shard in str(ei.value)


def test_filled_bulk_reads_keep_holes_and_short_objects(client_toml: Path, workdir: str) -> None:
    """``pread_many(fill=True)`` into a registered fresh mapping of a file with a hole
    of several units and a tail inside a block, starting off a page boundary: the same
    bytes as a plain read, the whole blocks filled, the rest in pages made present."""
    import ctypes
    import mmap

    with sc_client(client_toml) as c:
        path, want = write_holes(c, workdir)
        off = 3000  # the buffer lies as the file does within pages
        size = -(-(len(want) - off + off % mmap.PAGESIZE) // mmap.PAGESIZE) * mmap.PAGESIZE
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert uffd.register(base, size)
        view = memoryview(mm)[off : off + len(want) - off]
        before = filled(c)
        try:
            with c.open(path, "rb") as f:
                c._run(f.handle.open_local)
                got = c._run(f.handle.pread_many, [(off, view)], None, 4 << 20, None, False, True)
        finally:
            uffd.unregister(base, size)
        assert got == [len(want) - off]
        assert bytes(view) == want[off:]
        assert filled(c) - before >= 30 * UNIT
        del view
        mm.close()


def test_a_cold_load_reads_what_is_not_cached(
    client_toml: Path, cluster_dir: Path, workdir: str, ckpt: Any
) -> None:
    """Objects dropped from the page cache: chunks not cached are read the read path's
    way into pages made present first, the rest filled; bit-exact either way."""
    from pfs.bench.loader import evict, object_files

    d, truth = ckpt
    pool.release()
    with sc_client(client_toml) as c:
        src = put(c, d, f"{workdir}/ck")
        evict(object_files(cluster_dir))
        before = c.aio.local.stats["local_bytes"]
        out = load_safetensors(src, client=c, framework="numpy")
        check(out, truth)
        assert c.aio.local.stats["local_bytes"] > before
