"""pfs.load_safetensors against the safetensors package: local disk and a real cluster.

Checkpoints are written by ``safetensors.serialize_file`` from raw bytes, so every dtype
(bf16, fp8 included) can be made with or without torch; the loader runs with torch and
with numpy (the path taken where torch is not installed)."""
from __future__ import annotations

import errno
import json
import math
import random
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
from safetensors import safe_open

import pfs
from pfs.loader.safetensors import DTYPES, CheckpointError, LoadStats, load_safetensors

try:
    import torch
except ImportError:  # the numpy path is tested either way
    torch = None  # type: ignore[assignment]

FRAMEWORKS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(
    torch is None, reason="torch not installed"))]

# name -> (dtype, shape): odd shapes, a scalar, an empty tensor, every common dtype
SPECS: list[dict[str, tuple[str, tuple[int, ...]]]] = [
    {"embed.weight": ("BF16", (97, 64)), "norm.weight": ("F32", (64,)),
     "empty": ("F16", (0, 7)), "scalar": ("F32", ())},
    {"layers.0.q_proj.weight": ("BF16", (48, 64)), "layers.0.o_proj.weight": ("BF16", (64, 48)),
     "layers.0.mask": ("BOOL", (13,)), "layers.0.idx": ("I64", (5, 3)),
     "layers.0.fp8": ("F8_E4M3", (16, 24))},
    {"layers.1.q_proj.weight": ("BF16", (48, 64)), "layers.1.o_proj.weight": ("BF16", (64, 48)),
     "layers.1.fp8b": ("F8_E5M2", (7, 9, 3)), "layers.1.h": ("F16", (33, 31)),
     "layers.1.d": ("F64", (3, 1, 5)), "layers.1.i8": ("I8", (17,)),
     "layers.1.u8": ("U8", (2, 2, 2, 3)), "layers.1.i16": ("I16", (11,))},
    {"lm_head.weight": ("BF16", (97, 64)), "layers.2.i32": ("I32", (6, 10)),
     "layers.2.u16": ("U16", (9,)), "layers.2.u32": ("U32", (4,)), "layers.2.u64": ("U64", (3,))},
]


def serialize(tensors: dict[str, dict[str, Any]], path: Path, metadata: dict[str, str]) -> None:
    """safetensors.serialize_file from raw bytes, on the old (dict) and new (TensorSpec) API."""
    if not hasattr(safetensors, "TensorSpec"):  # safetensors < 0.8
        safetensors.serialize_file(tensors, str(path), metadata=metadata)  # type: ignore[arg-type]
        return
    keep = []
    specs = {}
    for name, t in tensors.items():
        arr = np.frombuffer(t["data"] or b"\0", dtype=np.uint8)
        keep.append(arr)
        specs[name] = safetensors.TensorSpec(dtype=DTYPES[t["dtype"]][2], shape=t["shape"],
                                             data_ptr=arr.ctypes.data, data_len=len(t["data"]))
    safetensors.serialize_file(specs, str(path), metadata=metadata)


def make_checkpoint(d: Path, seed: int = 0) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Write SPECS as 4 shards + index into ``d``; return name -> (dtype, shape, raw)."""
    rng = random.Random(seed)
    d.mkdir(parents=True, exist_ok=True)
    truth: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    weight_map: dict[str, str] = {}
    n = len(SPECS)
    for i, spec in enumerate(SPECS):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for name, (dtype, shape) in spec.items():
            nbytes = math.prod(shape) * DTYPES[dtype][0]
            raw = rng.randbytes(nbytes)
            if dtype == "BOOL":
                raw = bytes(b & 1 for b in raw)
            tensors[name] = {"dtype": dtype, "shape": list(shape), "data": raw}
            truth[name] = (dtype, shape, raw)
            weight_map[name] = fname
        serialize(tensors, d / fname, {"shard": str(i)})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return truth


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    d = tmp_path_factory.mktemp("ckpt")
    return d, make_checkpoint(d)


def raw_bytes(t: Any) -> bytes:
    if torch is not None and isinstance(t, torch.Tensor):
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(t).tobytes()


def shape_of(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


def check_full(out: dict[str, Any], truth: dict[str, Any], framework: str) -> None:
    assert set(out) == set(truth)
    for name, (dtype, shape, raw) in truth.items():
        t = out[name]
        assert shape_of(t) == shape, name
        assert raw_bytes(t) == raw, name
        if framework == "torch":
            assert isinstance(t, torch.Tensor)
            assert t.dtype == getattr(torch, DTYPES[dtype][2])
        else:
            assert isinstance(t, np.ndarray)
            assert t.dtype.itemsize == DTYPES[dtype][0]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_directory_bit_exact_with_safetensors(ckpt: tuple[Path, Any], framework: str) -> None:
    d, truth = ckpt
    stats = LoadStats()
    out = load_safetensors(d, framework=framework, stats=stats)
    check_full(out, truth, framework)
    assert stats.files == 4 and stats.tensors == len(truth)
    assert stats.bytes == sum(len(r) for _d, _s, r in truth.values())
    assert stats.requests == 4  # one merged region per shard
    # and against safe_open itself
    for shard in sorted(d.glob("*.safetensors")):
        fw = "pt" if framework == "torch" else "numpy"
        with safe_open(str(shard), framework=fw) as f:
            for name in f.keys():
                if fw == "numpy" and truth[name][0] in ("BF16", "F8_E4M3", "F8_E5M2"):
                    continue  # safetensors' numpy side has no such dtypes
                ref = f.get_tensor(name)
                assert raw_bytes(ref) == raw_bytes(out[name]), name
                if fw == "pt":
                    assert ref.dtype == out[name].dtype


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_views_share_one_buffer_per_region(ckpt: tuple[Path, Any], framework: str) -> None:
    d, _ = ckpt
    out = load_safetensors(d / "model-00002-of-00004.safetensors", framework=framework)
    a, b = out["layers.0.q_proj.weight"], out["layers.0.o_proj.weight"]
    if framework == "torch":
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    else:
        assert a.base is not None and np.shares_memory(a.base, b.base)


def test_sources_file_index_and_plain_directory(ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    d, truth = ckpt
    shard = d / "model-00003-of-00004.safetensors"
    out = load_safetensors(str(shard), framework="numpy")
    assert set(out) == set(SPECS[2])
    out = load_safetensors(d / "model.safetensors.index.json", framework="numpy")
    assert set(out) == set(truth)
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in d.glob("*.safetensors"):
        (plain / f.name).write_bytes(f.read_bytes())
    check_full(load_safetensors(plain, framework="numpy"), truth, "numpy")
    out = load_safetensors(d, framework="numpy", names=["norm.weight", "layers.2.u16"])
    assert set(out) == {"norm.weight", "layers.2.u16"}
    with pytest.raises(KeyError):
        load_safetensors(d, framework="numpy", names=["no.such.tensor"])


def test_merge_gap_changes_requests_not_bytes(ckpt: tuple[Path, Any]) -> None:
    d, truth = ckpt
    s0, s1 = LoadStats(), LoadStats()
    a = load_safetensors(d, framework="numpy", merge_gap=-1, stats=s0)  # never merge
    b = load_safetensors(d, framework="numpy", merge_gap=1 << 30, stats=s1)
    assert s0.requests == len(truth) - 1  # the empty tensor needs no read
    assert s1.requests == 4
    for name in truth:
        assert raw_bytes(a[name]) == raw_bytes(b[name])


def test_without_torch_numpy_is_the_default(ckpt: tuple[Path, Any],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    d, truth = ckpt
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    out = load_safetensors(d)
    check_full(out, truth, "numpy")
    bf16 = out["embed.weight"]
    try:
        import ml_dtypes
    except ImportError:
        assert bf16.dtype == np.uint16  # raw bits, documented
    else:
        assert bf16.dtype == ml_dtypes.bfloat16
    with pytest.raises(ValueError, match="needs torch"):
        load_safetensors(d, device="cuda:0")


# -- tensor parallelism ---------------------------------------------------------------
def full_array(truth: dict[str, Any], name: str) -> np.ndarray:
    """A numpy array with the same bits and shape (uint views for bf16/fp8)."""
    dtype, shape, raw = truth[name]
    size = DTYPES[dtype][0]
    npdt = {"BF16": "uint16", "F8_E4M3": "uint8", "F8_E5M2": "uint8"}.get(dtype,
                                                                         DTYPES[dtype][1])
    assert np.dtype(npdt).itemsize == size
    return np.frombuffer(raw, dtype=npdt).reshape(shape)


def explicit_rows(name: str, shape: tuple[int, ...], rank: int, size: int) -> tuple[int, int, int]:
    return (0, rank, rank + 1)  # rank r gets row r of dim 0


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("tp_size", [2, 3])
def test_tp_slices_equal_slices_of_full(ckpt: tuple[Path, Any], framework: str,
                                        tp_size: int) -> None:
    d, truth = ckpt
    split: dict[str, Any] = {"*.q_proj.weight": 0, "*.o_proj.weight": 1, "embed.weight": -1,
             "layers.1.fp8b": 1, "layers.1.d": 2, "layers.2.i32": explicit_rows,
             "lm_head.weight": lambda n, s, r, k: None}
    dims = {"layers.0.q_proj.weight": 0, "layers.1.q_proj.weight": 0,
            "layers.0.o_proj.weight": 1, "layers.1.o_proj.weight": 1, "embed.weight": 1,
            "layers.1.fp8b": 1, "layers.1.d": 2}
    for rank in range(tp_size):
        stats = LoadStats()
        out = load_safetensors(d, framework=framework, tp_rank=rank, tp_size=tp_size,
                               split=split, stats=stats)
        assert set(out) == set(truth)
        for name in truth:
            full = full_array(truth, name)
            if name in dims:
                want = np.array_split(full, tp_size, axis=dims[name])[rank]
            elif name == "layers.2.i32":
                want = full[rank:rank + 1]
            else:
                want = full
            assert shape_of(out[name]) == want.shape, name
            assert raw_bytes(out[name]) == want.tobytes(), (name, rank)
        if framework == "torch":  # and the same bits as torch's own split (NaNs: bytes)
            ref = load_safetensors(d, framework="torch")
            for name, dim in dims.items():
                want_t = torch.tensor_split(ref[name], tp_size, dim)[rank]
                assert raw_bytes(out[name]) == raw_bytes(want_t), name


def test_tp_reads_only_the_slice(ckpt: tuple[Path, Any]) -> None:
    d, truth = ckpt
    shard = d / "model-00002-of-00004.safetensors"
    for name, dim in (("layers.0.q_proj.weight", 0), ("layers.0.o_proj.weight", 1)):
        stats = LoadStats()
        out = load_safetensors(shard, framework="numpy", names=[name], tp_rank=1, tp_size=4,
                               split={name: dim}, stats=stats)
        assert stats.read_bytes == stats.bytes == out[name].nbytes == len(truth[name][2]) // 4
        rows = truth[name][1][0]
        assert stats.requests == (1 if dim == 0 else rows)


def test_tp_argument_errors(ckpt: tuple[Path, Any]) -> None:
    d, _ = ckpt
    with pytest.raises(ValueError, match="tp_rank"):
        load_safetensors(d, tp_rank=2, tp_size=2, framework="numpy")
    with pytest.raises(ValueError, match="both"):
        load_safetensors(d, tp_rank=0, framework="numpy")
    with pytest.raises(ValueError, match="cannot split"):
        load_safetensors(d, tp_rank=0, tp_size=2, split={"norm.weight": 1}, framework="numpy")


# -- broken checkpoints ---------------------------------------------------------------
def _shard_copy(ckpt: tuple[Path, Any], tmp_path: Path) -> Path:
    d, _ = ckpt
    p = tmp_path / "s.safetensors"
    p.write_bytes((d / "model-00001-of-00004.safetensors").read_bytes())
    return p


def _rewrite_header(p: Path, fn: Any) -> None:
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


@pytest.mark.parametrize("case,match", [
    ("json", "not valid JSON"),
    ("length", "exceeds"),
    ("past_end", "runs past the end"),
    ("offsets", "needs"),
    ("dtype", "unknown dtype"),
    ("overlap", "overlaps"),
    ("tiny", "too small"),
])
def test_corrupt_headers(ckpt: tuple[Path, Any], tmp_path: Path, case: str, match: str) -> None:
    p = _shard_copy(ckpt, tmp_path)
    data = p.read_bytes()
    if case == "json":
        p.write_bytes(data[:8] + b"{not json" + data[17:])
    elif case == "length":
        p.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    elif case == "past_end":
        p.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    elif case == "offsets":
        _rewrite_header(p, lambda h: h["norm.weight"].update(data_offsets=[0, 3]))
    elif case == "dtype":
        _rewrite_header(p, lambda h: h["norm.weight"].update(dtype="F128"))
    elif case == "overlap":
        def overlap(h: dict[str, Any]) -> None:
            a, b = h["norm.weight"]["data_offsets"]
            e = h["embed.weight"]
            e["data_offsets"] = [a, a + (e["data_offsets"][1] - e["data_offsets"][0])]
        _rewrite_header(p, overlap)
    elif case == "tiny":
        p.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=match) as e:
        load_safetensors(p, framework="numpy")
    assert str(p) in str(e.value) and e.value.filename == str(p)
    assert isinstance(e.value, ValueError)


def test_truncated_shard(ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    p = _shard_copy(ckpt, tmp_path)
    data = p.read_bytes()
    p.write_bytes(data[:-5])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_safetensors(p, framework="numpy")
    assert str(p) in str(e.value) and "5 missing" in str(e.value)


def test_index_errors(ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    d, _ = ckpt
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"a": "model-00009-of-00009.safetensors"}}))
    with pytest.raises(FileNotFoundError) as e:
        load_safetensors(tmp_path, framework="numpy")
    assert e.value.errno == errno.ENOENT
    assert "model-00009-of-00009.safetensors" in str(e.value) and str(idx) in str(e.value)
    idx.write_text("{broken")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_safetensors(tmp_path, framework="numpy")
    idx.write_text(json.dumps({"weight_map": {"a": "../etc/passwd"}}))
    with pytest.raises(CheckpointError, match="plain file name"):
        load_safetensors(idx, framework="numpy")
    with pytest.raises(FileNotFoundError):
        load_safetensors(tmp_path / "nothing.safetensors", framework="numpy")
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors.index.json"):
        load_safetensors(empty, framework="numpy")


def test_duplicate_tensor_across_shards(ckpt: tuple[Path, Any], tmp_path: Path) -> None:
    d, _ = ckpt
    for i in (1, 2):
        (tmp_path / f"s{i}.safetensors").write_bytes(
            (d / "model-00001-of-00004.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="also in"):
        load_safetensors(tmp_path, framework="numpy")


def test_cli_load_local(ckpt: tuple[Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from pfs.tools.cli import main

    d, truth = ckpt
    main(["load", str(d), "--local", "--framework", "numpy"])
    line = capsys.readouterr().out
    assert f"loaded {len(truth)} tensors" in line and "GB/s" in line
    main(["load", str(d), "--local", "--framework", "numpy", "--tp-rank", "1", "--tp-size", "2",
          "--split", "*.q_proj.weight=0"])
    assert "loaded" in capsys.readouterr().out
    main(["load", str(d), "--local", "--framework", "numpy", "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert rec["tensors"] == len(truth) and rec["source"] == "local" and rec["bytes"] > 0


def test_lazy_export() -> None:
    assert callable(pfs.load_safetensors)
    assert "load_safetensors" in pfs.__all__


# -- through a real cluster -------------------------------------------------------------
@pytest.fixture
def pfs_ckpt(client: Any, workdir: str, ckpt: tuple[Path, Any]) -> str:
    d, _ = ckpt
    client.set_layout(workdir, count=4, unit=64 * 1024)  # several stripes per shard
    for f in sorted(d.iterdir()):
        client.write_file(f"{workdir}/{f.name}", f.read_bytes())
    return workdir


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_pfs_bit_exact_and_tp(client: Any, pfs_ckpt: str, ckpt: tuple[Path, Any],
                              framework: str) -> None:
    _, truth = ckpt
    stats = LoadStats()
    out = load_safetensors(pfs_ckpt, client=client, framework=framework, stats=stats)
    check_full(out, truth, framework)
    assert stats.engine == "pfs" and stats.files == 4
    split: dict[str, Any] = {"*.q_proj.weight": 0, "*.o_proj.weight": 1}
    for rank in range(2):
        part = load_safetensors(pfs_ckpt, client=client, framework=framework, tp_rank=rank,
                                tp_size=2, split=split)
        for name in ("layers.0.q_proj.weight", "layers.1.o_proj.weight"):
            dim = 0 if "q_proj" in name else 1
            want = np.array_split(full_array(truth, name), 2, axis=dim)[rank]
            assert raw_bytes(part[name]) == want.tobytes()


def test_pfs_url_with_config(client_toml: Path, pfs_ckpt: str, ckpt: tuple[Path, Any]) -> None:
    _, truth = ckpt
    out = load_safetensors("pfs://" + pfs_ckpt + "/model.safetensors.index.json",
                           config=client_toml, framework="numpy")
    check_full(out, truth, "numpy")


def test_pfs_errors(client: Any, workdir: str, ckpt: tuple[Path, Any]) -> None:
    d, _ = ckpt
    client.write_file(f"{workdir}/model.safetensors.index.json",
                      json.dumps({"weight_map": {"x": "gone.safetensors"}}).encode())
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_safetensors(workdir, client=client, framework="numpy")
    data = (d / "model-00001-of-00004.safetensors").read_bytes()
    client.write_file(f"{workdir}/cut.safetensors", data[:-100])
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_safetensors(f"{workdir}/cut.safetensors", client=client, framework="numpy")
    assert "cut.safetensors" in str(e.value)


def test_cli_load_pfs(client_toml: Path, pfs_ckpt: str, ckpt: tuple[Path, Any],
                      capsys: pytest.CaptureFixture[str]) -> None:
    from pfs.tools.cli import main

    _, truth = ckpt
    main(["load", pfs_ckpt, "--config", str(client_toml), "--framework", "numpy"])
    out = capsys.readouterr().out
    assert f"loaded {len(truth)} tensors" in out and "[pfs," in out


def test_cli_load_finds_the_users_config(client_toml: Path, pfs_ckpt: str,
                                        ckpt: tuple[Path, Any], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """No cluster named: a PATH that is not on local disk is read from pfs with the
    config every other command would find (here the user's); one that is stays local."""
    from pfs.tools.cli import main

    _, truth = ckpt
    monkeypatch.delenv("PFS_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "pfs").mkdir(parents=True)
    (tmp_path / "xdg" / "pfs" / "client.toml").write_text(client_toml.read_text())
    main(["load", pfs_ckpt, "--framework", "numpy"])
    out = capsys.readouterr().out
    assert f"loaded {len(truth)} tensors" in out and "[pfs," in out
    local, _ = ckpt
    main(["load", str(local), "--framework", "numpy"])
    assert "[local " in capsys.readouterr().out


class _Recorder:
    """What a progress bar is told: the planned bytes, then each read's."""

    def __init__(self) -> None:
        self.total: int | None = None
        self.added: list[int] = []

    def set_total(self, n: int) -> None:
        self.total = n

    def add(self, n: int) -> None:
        self.added.append(n)


def test_progress_is_told_every_byte_read(client: Any, pfs_ckpt: str,
                                          ckpt: tuple[Path, Any]) -> None:
    """``LoadStats.progress`` (``pfs load``'s bar) learns the bytes to read, then each
    read's bytes as it completes: from pfs as each piece lands (at least one call per
    read), locally one per batch."""
    for source, kw in ((ckpt[0], {}), (pfs_ckpt, {"client": client})):
        rec = _Recorder()
        stats = LoadStats(progress=rec)
        load_safetensors(source, framework="numpy", stats=stats, **kw)
        assert rec.total == stats.read_bytes > 0
        assert sum(rec.added) == stats.read_bytes
    assert len(rec.added) >= stats.requests  # the pfs source: as pieces land


@pytest.mark.parametrize("short_circuit", [True, False], ids=["local", "network"])
def test_on_tensor_hands_out_each_tensor_once(client_toml: Path, pfs_ckpt: str,
                                              ckpt: tuple[Path, Any],
                                              short_circuit: bool) -> None:
    """``on_tensor`` gets every tensor once, bit-exact, the very object the result
    holds, before the load returns: from pfs short-circuit as their chunks land (in the
    loader's worker threads), otherwise when the reads are done; tensor-parallel
    slices and empty tensors too."""
    import threading

    from pfs.core.config import ClientConfig, load

    _, truth = ckpt
    cfg = load(ClientConfig, client_toml)
    cfg.short_circuit = short_circuit
    split: dict[str, Any] = {"*.q_proj.weight": 0}
    with pfs.connect(config=cfg) as c:
        for source, kw in ((ckpt[0], {}), (pfs_ckpt, {"client": c}),
                           (pfs_ckpt, {"client": c, "tp_rank": 1, "tp_size": 2,
                                       "split": split})):
            got: list[tuple[str, Any, bytes, str]] = []

            def seen(name: str, t: Any, got: list[Any] = got) -> None:
                got.append((name, t, raw_bytes(t), threading.current_thread().name))

            out = load_safetensors(source, framework="numpy", on_tensor=seen, **kw)
            names = [g[0] for g in got]
            assert sorted(names) == sorted(out) and len(set(names)) == len(names)
            for name, t, data, _thread in got:
                assert t is out[name] and data == raw_bytes(out[name])
            if "tp_rank" not in kw:
                check_full(out, truth, "numpy")
            if source == pfs_ckpt and short_circuit and "tp_rank" not in kw:
                assert c.aio.local is not None and c.aio.local.stats["local_bytes"] > 0
                assert any(th != "pfs-trio" for *_x, th in got)  # handed out by a reader


def test_pfs_reused_buffers_never_hold_wrong_bytes(client_toml: Path, cluster_dir: Path,
                                                   pfs_ckpt: str, ckpt: tuple[Path, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Consecutive short-circuit loads from pfs read into the buffers the previous load
    handed back (the client's trio thread keeps no reference to a result); a block that
    does not verify is read from the other replica, and with both replicas bad the load
    fails with EIO: never wrong bytes, nor bytes a reused buffer held before."""
    from pfs.core.config import ClientConfig, load
    from pfs.loader import pool as poolmod

    p = poolmod.BufferPool(keep_seconds=60)
    monkeypatch.setattr(poolmod, "POOL", p)
    _, truth = ckpt
    cfg = load(ClientConfig, client_toml)
    cfg.short_circuit = True
    shard = f"{pfs_ckpt}/model-00003-of-00004.safetensors"
    with pfs.connect(config=cfg) as c:
        out = load_safetensors(pfs_ckpt, client=c, framework="numpy")
        check_full(out, truth, "numpy")
        del out
        assert p.free_bytes() > 0  # handed back at once
        size = c.stat(shard).st_size
        objs = sorted((cluster_dir / "data").glob(f"ds*/objects/*/{c.stat(shard).st_ino}.0"))
        assert len(objs) == 2  # the shard is smaller than a unit: stripe 0, 2 replicas
        for k, obj in enumerate(objs):
            with open(obj, "r+b") as fo:  # a byte of the last tensor's data
                fo.seek(size - 5)
                b = fo.read(1)
                fo.seek(size - 5)
                fo.write(bytes([b[0] ^ 0x10]))
            reused = p.stats["reused"]
            if k == 0:  # the other replica has it
                out = load_safetensors(pfs_ckpt, client=c, framework="numpy")
                check_full(out, truth, "numpy")
                assert p.stats["reused"] > reused
                assert c.aio.local is not None and c.aio.local.stats["local_bytes"] > 0
                del out
            else:
                with pytest.raises(OSError) as ei:
                    load_safetensors(pfs_ckpt, client=c, framework="numpy")
                assert ei.value.errno == errno.EIO
