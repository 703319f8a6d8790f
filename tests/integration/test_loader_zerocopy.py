"""``load_safetensors(zero_copy=True)`` against real clusters: tensors mapped from the
data servers' object files, verified in place, and everything else read as before."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import pfs
from pfs.core.checksums import BLOCK
from pfs.core.config import ClientConfig, load
from pfs.loader.safetensors import load_safetensors
from pfs.tools import cluster
from tests.integration.test_checksums import _flip, _objects

UNIT = 64 * 1024  # a checksum block per stripe unit: several stripes and rows per shard
# per shard: name -> (dtype, elements); sizes off any block or page boundary
SHARDS: list[dict[str, tuple[str, int]]] = [
    {"embed": ("float32", 70_001), "norm": ("float32", 33), "mask": ("uint8", 5)},
    {"q": ("int16", 150_003), "k": ("int16", 99_999), "tiny": ("uint8", 1)},
    {"head": ("float32", 120_017), "bias": ("int64", 7)},
]


def make_checkpoint(d: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    truth: dict[str, np.ndarray] = {}
    for i, spec in enumerate(SHARDS):
        tensors = {n: rng.integers(-100, 100, size=k).astype(dt) for n, (dt, k) in spec.items()}
        save_file(tensors, str(d / f"model-{i + 1:05d}-of-{len(SHARDS):05d}.safetensors"))
        truth.update(tensors)
    return truth


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    d = tmp_path_factory.mktemp("zc-ckpt")
    return d, make_checkpoint(d)


def put(c: Any, d: Path, where: str, replicas: int = 0) -> str:
    c.makedirs(where, exist_ok=True)
    c.set_layout(where, count=4, unit=UNIT, replicas=replicas)
    for f in sorted(d.iterdir()):
        c.write_file(f"{where}/{f.name}", f.read_bytes())
    return where


def sc_client(client_toml: Path) -> Any:
    cfg = load(ClientConfig, client_toml)
    cfg.short_circuit = True
    return pfs.connect(config=cfg)


def check(out: dict[str, Any], truth: dict[str, np.ndarray]) -> None:
    assert set(out) == set(truth)
    for name, want in truth.items():
        got = np.asarray(out[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name


def object_maps(data_dir: Path) -> list[tuple[int, int, str]]:
    """This process's mappings of files under ``data_dir``: (start, end, path)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(str(data_dir)):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[5].strip()))
    return out


def address(t: Any) -> int:
    return int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.ctypes.data)


def mapped_bytes(c: Any) -> int:
    return int(c.aio.local.stats["mapped_bytes"])


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_tensors_are_verified_mappings_of_the_objects(
    client_toml: Path, cluster_dir: Path, workdir: str, ckpt: Any, framework: str
) -> None:
    """Every stripe local: the tensors' pages are the object files' (their addresses lie
    in mappings of files under the data directories), bit-exact, verified; the default
    load maps nothing; a write to a mapped tensor stays in the process."""
    pytest.importorskip(framework)
    d, truth = ckpt
    with sc_client(client_toml) as c:
        src = put(c, d, f"{workdir}/ck")
        out = load_safetensors(src, client=c, framework="numpy")
        check(out, truth)
        assert mapped_bytes(c) == 0 and not object_maps(cluster_dir / "data")
        del out
        out = load_safetensors(src, client=c, framework=framework, zero_copy=True)
        check(out, truth)
        assert mapped_bytes(c) >= 8 * BLOCK
        maps = object_maps(cluster_dir / "data")
        inside = [n for n, t in out.items() if any(lo <= address(t) < hi for lo, hi, _p in maps)]
        assert {"embed", "q", "k", "head"} <= set(inside), inside
        assert {p.rsplit("/", 1)[-1].split(".")[1] for _lo, _hi, p in maps} == {"0", "1", "2", "3"}
        big = out["q"]
        before = bytes(np.asarray(big).tobytes())
        big[:] = 0  # copy-on-write: the file keeps its bytes
        again = load_safetensors(src, client=c, framework="numpy", zero_copy=True)
        assert np.asarray(again["q"]).tobytes() == before
        del out, big, again
    assert not object_maps(cluster_dir / "data")  # unmapped with the tensors


def test_a_block_that_does_not_verify_is_read_elsewhere_or_fails(
    client_toml: Path, cluster_dir: Path, workdir: str, ckpt: Any
) -> None:
    """Object files corrupted on disk under mapped tensors: a block that does not match
    its checksum is never returned. With the other replica good there, the chunk is
    read from it (bit-exact, less mapped); with both replicas bad at the same block the
    load fails with EIO naming the file."""
    d, truth = ckpt
    shard = "model-00002-of-00003.safetensors"
    with sc_client(client_toml) as c:
        src = put(c, d, f"{workdir}/ck")
        ino = c.stat(f"{src}/{shard}").st_ino
        clean = load_safetensors(src, client=c, framework="numpy", zero_copy=True)
        check(clean, truth)
        full = mapped_bytes(c)
        del clean
        # stripe 1 holds file units 1, 5, ...: its object's blocks 0 and 1
        objs = _objects(cluster_dir, ino, 1)
        assert len(objs) == 2
        _flip(objs[0], 100)  # block 0 bad in one replica,
        _flip(objs[1], BLOCK + 100)  # block 1 in the other: every unit has a good copy
        out = load_safetensors(src, client=c, framework="numpy", zero_copy=True)
        check(out, truth)
        assert 0 < mapped_bytes(c) - full < full
        del out
        _flip(objs[1], 100)  # now block 0 is bad in both
        with pytest.raises(OSError) as ei:
            load_safetensors(src, client=c, framework="numpy", zero_copy=True)
        assert ei.value.errno == errno.EIO and shard in str(ei.value)


def test_stripes_of_a_remote_server_are_read_into_the_same_mapping(
    tmp_path: Path, ckpt: Any
) -> None:
    """One data server of four serves no local socket (a server of another host, as
    far as a client can tell) and every stripe has one replica: its stripes go over
    TCP into anonymous pages of the shard's mapping, the other three are mapped, the
    tensors bit-exact either way, also those that span both kinds."""
    d, truth = ckpt
    cdir = tmp_path / "cluster"
    remote = tmp_path / "remote.toml"
    remote.write_text("local_socket = false\n")
    try:
        cluster.up(cdir, data_servers=3)
        toml = cluster.up(cdir, data_servers=4, data_args=["--config", str(remote)])
        with sc_client(toml) as c:
            src = put(c, d, "/ck", replicas=1)
            out = load_safetensors(src, client=c, framework="numpy", zero_copy=True)
            check(out, truth)
            stats = c.aio.local.stats
            total = sum(c.stat(f"{src}/{f.name}").st_size for f in d.iterdir())
            assert 0 < stats["mapped_bytes"] <= stats["local_bytes"] < total
            assert object_maps(cdir / "data")
    finally:
        cluster.down(cdir)


def write_holes(c: Any, workdir: str) -> tuple[str, bytes]:
    """A file with a hole of several units in the middle (sparse rows inside objects,
    objects shorter than others) and a tail that ends inside a block; its bytes."""
    import os

    path = f"{workdir}/holes"
    data = os.urandom(37 * UNIT + 1234)
    c.set_layout(workdir, count=4, unit=UNIT)
    c.write_file(path, data)
    with c.open(path, "r+b") as f:
        f.pwrite(b"tail", len(data) + 5 * UNIT)
    return path, data + bytes(5 * UNIT) + b"tail"


def test_mapped_bulk_reads_keep_holes_and_short_objects(
    client_toml: Path, cluster_dir: Path, workdir: str
) -> None:
    """``pread_many(mapped=True)`` of a file with a hole of several units in the middle
    (sparse rows inside objects, objects shorter than others) and a tail that ends
    inside a block: the same bytes as a plain read, mapped where whole written blocks
    lie in an object, zeros and partial blocks in anonymous pages."""
    import mmap

    with sc_client(client_toml) as c:
        path, want = write_holes(c, workdir)
        before = mapped_bytes(c)
        mm = mmap.mmap(-1, len(want), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(mm)
        with c.open(path, "rb") as f:
            c._run(f.handle.open_local)
            got = c._run(f.handle.pread_many, [(0, view)], None, 4 << 20, None, True)
        assert got == [len(want)]
        assert mm[:] == want
        assert mapped_bytes(c) - before >= 30 * UNIT  # the whole blocks of the data
        assert object_maps(cluster_dir / "data")
        del view
        mm.close()


def test_zero_copy_with_slices_names_and_on_tensor(
    client_toml: Path, workdir: str, ckpt: Any
) -> None:
    """Tensor-parallel slices keep buffers of their own beside the mapped regions;
    ``names`` maps only the units around the tensors asked for; ``on_tensor`` hands
    each tensor out once, after its blocks were verified."""
    d, truth = ckpt
    with sc_client(client_toml) as c:
        src = put(c, d, f"{workdir}/ck")
        seen: list[str] = []
        out = load_safetensors(
            src,
            client=c,
            framework="numpy",
            zero_copy=True,
            tp_rank=1,
            tp_size=2,
            split={"q": 0},
            on_tensor=lambda n, _t: seen.append(n),
        )
        assert sorted(seen) == sorted(out) == sorted(truth)
        assert np.asarray(out["q"]).tobytes() == np.array_split(truth["q"], 2)[1].tobytes()
        check(
            {k: v for k, v in out.items() if k != "q"}, {k: v for k, v in truth.items() if k != "q"}
        )
        before = mapped_bytes(c)
        part = load_safetensors(src, client=c, framework="numpy", zero_copy=True, names=["head"])
        check(part, {"head": truth["head"]})
        assert 0 < mapped_bytes(c) - before <= (len(truth["head"]) * 4 // UNIT + 2) * UNIT
