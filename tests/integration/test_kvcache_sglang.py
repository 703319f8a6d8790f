"""SGLang HiCache's storage backend on pfs (pfs.kvcache.adapters.sglang): the adapter
subclasses SGLang's real HiCacheStorage, SGLang's own factory loads it by module path,
and pages make the round trip through a real cluster, every byte checked."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import load

hicache = load("sglang.srt.mem_cache.hicache_storage", "sglang")
factory = load("sglang.srt.mem_cache.storage.backend_factory", "sglang")

from pfs.kvcache import KVCache  # noqa: E402
from pfs.kvcache.adapters.sglang import PfsHiCacheStorage, namespace_of  # noqa: E402

PAGE = (4, 2, 64)  # a flat page: 4 layers x (k, v) x 64 bf16 values


def config(tmp_path: Path, client_toml: Path, *, tp_rank: int = 0, mla: bool = False,
           **extra: Any) -> Any:
    return hicache.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="org/Model-7B-Instruct",
        extra_config={"backend_name": "pfs", "module_path": "pfs.kvcache.adapters.sglang",
                      "class_name": "PfsHiCacheStorage", "config": str(client_toml),
                      "node_dir": str(tmp_path / "tier"), **extra})


def keys_of(tag: str, n: int) -> list[str]:
    """A chain of page hashes as SGLang makes them (hex SHA-256)."""
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def page_of(key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(key[:8], 16))
    return torch.randn(PAGE, generator=g).to(torch.bfloat16)


@pytest.fixture
def storage(tmp_path: Path, client_toml: Path) -> Any:
    s = factory.StorageBackendFactory.create_backend(
        "dynamic", config(tmp_path, client_toml), None)
    try:
        yield s
    finally:
        s.close()


def test_the_backend_is_sglangs_own_kind_loaded_by_its_factory(storage: Any) -> None:
    assert issubclass(PfsHiCacheStorage, hicache.HiCacheStorage)
    assert type(storage) is PfsHiCacheStorage
    # pfs's namespace rules hold for a model name with a slash; ranks of a model whose
    # ranks hold different heads do not share pages, MLA ranks do
    assert storage.ns == "sglang:org_Model-7B-Instruct:tp0of2"
    cfg = config(Path("/x"), Path("/y"), tp_rank=1, mla=True)
    assert namespace_of(cfg) == "sglang:org_Model-7B-Instruct"


def test_pages_round_trip_every_byte_checked(storage: Any) -> None:
    keys = keys_of("rt", 12)
    pages = [page_of(k) for k in keys]
    assert storage.batch_set(keys, pages) is True
    assert storage.batch_exists(keys) == 12
    outs = [torch.zeros(PAGE, dtype=torch.bfloat16) for _ in keys]
    got = storage.batch_get(keys, outs)
    for k, page, out, g in zip(keys, pages, outs, got, strict=True):
        assert g is out and torch.equal(out.view(torch.uint8), page.view(torch.uint8)), k
    one = torch.zeros(PAGE, dtype=torch.bfloat16)
    assert storage.get(keys[3], one) is one and torch.equal(one, pages[3])
    assert storage.set(keys[0], pages[0]) is True  # a page put again is still one page
    assert storage.exists(keys[0])


def test_prefix_exists_and_a_miss_is_a_miss(storage: Any, tmp_path: Path,
                                           client_toml: Path) -> None:
    keys = keys_of("holes", 8)
    assert storage.batch_set(keys, [page_of(k) for k in keys])
    storage.cache.remove([keys[5].encode()])  # a hole: the chain counts up to it
    assert storage.batch_exists(keys) == 5
    assert storage.batch_exists(keys_of("never", 3)) == 0
    assert storage.exists(keys[5]) is False
    out = torch.full(PAGE, 7.0, dtype=torch.bfloat16)
    assert storage.get(keys[5], out) is None
    assert storage.batch_get(keys[4:6], [torch.zeros(PAGE, dtype=torch.bfloat16)] * 2)[1] \
        is None
    # a page of another size (a stale layout) is a miss (the target's bytes are then
    # the engine's to drop, as after any miss)
    assert storage.get(keys[0], torch.zeros((2, 2, 64), dtype=torch.bfloat16)) is None
    assert storage.get(keys[0], torch.zeros((8, 2, 64), dtype=torch.bfloat16)) is None
    # another rank's pages are not this rank's
    other = PfsHiCacheStorage(config(tmp_path, client_toml, tp_rank=1))
    try:
        assert other.batch_exists(keys) == 0
    finally:
        other.close()


class HostPool:
    """The part of SGLang's host KV pool the zero-copy path uses (the real one needs a
    GPU pool beside it): pages of ``page_size`` tokens, ``layers`` buffers per page in
    the layer-first layout, one in the page-first layout."""

    def __init__(self, pages: int, layers: int, token_bytes: int, layer_first: bool):
        self.page_size = 4
        self.layers, self.token_bytes, self.layer_first = layers, token_bytes, layer_first
        if layer_first:
            self.buf = torch.zeros((layers, pages, self.page_size * token_bytes),
                                   dtype=torch.uint8)
        else:
            self.buf = torch.zeros((pages, layers, self.page_size * token_bytes),
                                   dtype=torch.uint8)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        ptrs, sizes = [], []
        for p in indices[::self.page_size].tolist():
            page = p // self.page_size
            if self.layer_first:
                for layer in range(self.layers):
                    ptrs.append(self.buf[layer, page].data_ptr())
                    sizes.append(self.buf[layer, page].numel())
            else:
                ptrs.append(self.buf[page].data_ptr())
                sizes.append(self.buf[page].numel())
        return ptrs, sizes


@pytest.mark.parametrize("layer_first", [False, True])
def test_zero_copy_pages_from_and_into_the_host_pool(tmp_path: Path, client_toml: Path,
                                                     layer_first: bool) -> None:
    src = HostPool(6, 3, 32, layer_first)
    src.buf.copy_(torch.randint(0, 256, src.buf.shape, dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(int(layer_first))))
    dst = HostPool(6, 3, 32, layer_first)
    keys = keys_of(f"v1-{layer_first}", 4)
    pages = [5, 0, 3, 1]  # pool pages of the 4 keys, out of order
    indices = torch.tensor([p * 4 + t for p in pages for t in range(4)])
    with KVCache(client_toml, f"it-sglang-v1-{layer_first}",
                 node_dir=str(tmp_path / "tier")) as kv:
        writer = PfsHiCacheStorage(cache=kv)
        reader = PfsHiCacheStorage(cache=kv)
        writer.register_mem_pool_host(src)
        reader.register_mem_pool_host(dst)
        assert writer.batch_set_v1(keys, indices) == [True] * 4
        assert reader.batch_exists(keys) == 4
        assert reader.batch_get_v1(keys, indices) == [True] * 4
        for p in pages:
            if layer_first:
                assert torch.equal(dst.buf[:, p], src.buf[:, p])
            else:
                assert torch.equal(dst.buf[p], src.buf[p])
        assert not dst.buf[:, 2].any() if layer_first else not dst.buf[2].any()
        kv.remove([keys[2].encode()])
        assert reader.batch_get_v1(keys, indices)[2] is False
        writer.close()
        reader.close()


class StatePool:
    """The part of a hybrid model's side pool (a Mamba state pool) the v2 path uses."""

    page_size = 1

    def __init__(self, pages: int) -> None:
        self.buf = torch.zeros((pages, 96), dtype=torch.float32)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(96, dtype=torch.float32)

    def get_data_page(self, offset: int, flat: bool = True) -> torch.Tensor:
        return self.buf[offset]

    def set_from_flat_data_page(self, offset: int, page: torch.Tensor) -> None:
        self.buf[offset].copy_(page)


def test_hybrid_side_pools_beside_their_kv_pages(storage: Any) -> None:
    keys = keys_of("hybrid", 6)
    assert storage.batch_set(keys, [page_of(k) for k in keys])
    mamba, swa = hicache.PoolName.MAMBA, hicache.PoolName.SWA
    src = StatePool(8)
    src.buf.copy_(torch.randn(src.buf.shape, generator=torch.Generator().manual_seed(3)))
    storage.register_mem_host_pool_v2(src, mamba)
    # states of the prefixes of 3 and of 5 pages only
    put = hicache.PoolTransfer(name=mamba, host_indices=torch.tensor([6, 7]),
                               keys=[keys[2], keys[4]])
    assert storage.batch_set_v2([put]) == {mamba: [True, True]}
    trailing = hicache.PoolTransfer(name=mamba, keys=[keys[-1]],
                                    hit_policy=hicache.PoolHitPolicy.TRAILING_PAGES)
    hit = storage.batch_exists_v2(keys, [trailing])
    assert isinstance(hit, hicache.PoolTransferResult)
    assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (5, [3, 5])
    assert hit.extra_pool_hit_pages == {hicache.PoolName.KV: 6, mamba: 5}
    # a pool that must hold every page and holds none: nothing restorable
    every = hicache.PoolTransfer(name=swa, keys=keys)
    assert storage.batch_exists_v2(keys, [every]).kv_hit_pages == 0
    dst = StatePool(8)
    storage.register_mem_host_pool_v2(dst, mamba)
    get = hicache.PoolTransfer(name=mamba, host_indices=torch.tensor([0, 1, 2]),
                               keys=[keys[2], keys[4], keys[0]])
    assert storage.batch_get_v2([get]) == {mamba: [True, True, False]}
    assert torch.equal(dst.buf[0], src.buf[6]) and torch.equal(dst.buf[1], src.buf[7])
    assert not dst.buf[2].any()
