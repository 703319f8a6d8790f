"""LMCache's remote storage on pfs (pfs.kvcache.adapters.lmcache): the connector
subclasses LMCache's real RemoteConnector, LMCache's own plugin framework makes it from
an engine config, and chunks (full and partial) make the round trip through a real
cluster with LMCache's real CPU allocator, every byte checked."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engines import load

base = load("lmcache.v1.storage_backend.connector.base_connector",
            "lmcache.v1.storage_backend")
connector = load("lmcache.v1.storage_backend.connector", "lmcache.v1.storage_backend")
local_cpu = load("lmcache.v1.storage_backend.local_cpu_backend", "lmcache.v1.storage_backend")
lmc_config = load("lmcache.v1.config", "lmcache.v1.storage_backend")
lmc_meta = load("lmcache.v1.metadata", "lmcache.v1.storage_backend")
lmc_utils = load("lmcache.utils", "lmcache.v1.storage_backend")

from pfs.kvcache.adapters.lmcache import PfsConnector, PfsConnectorAdapter  # noqa: E402

CHUNK = 16  # tokens per chunk
MODEL = "org/Model-7B-Instruct"


def engine(tmp_path: Path, client_toml: Path, **opts: Any) -> tuple[Any, Any, Any]:
    """LMCache's config, metadata and local CPU backend, as an engine makes them."""
    extra = {"remote_storage_plugin.pfs.module_path": "pfs.kvcache.adapters.lmcache",
             "remote_storage_plugin.pfs.class_name": "PfsConnectorAdapter",
             "remote_storage_plugin.pfs.config": str(client_toml),
             "remote_storage_plugin.pfs.node_dir": str(tmp_path / "tier")}
    extra.update({f"remote_storage_plugin.pfs.{k}": v for k, v in opts.items()})
    cfg = lmc_config.LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.02, remote_serde="naive",
        remote_storage_plugins=["pfs"], extra_config=extra)
    meta = lmc_meta.LMCacheMetadata(
        model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(2, 2, CHUNK, 4, 8), chunk_size=CHUNK)
    return cfg, meta, local_cpu.LocalCPUBackend(cfg, meta)


def key(i: int, tag: int) -> Any:
    return lmc_utils.CacheEngineKey(MODEL, 1, 0, tag * 1000 + i, torch.bfloat16)


def chunk(backend: Any, conn: Any, tokens: int, seed: int) -> Any:
    """A chunk of LMCache's own memory, filled with checkable bytes."""
    shape = list(conn.meta_shapes[0])
    shape[2] = tokens
    obj = backend.allocate([torch.Size(shape)], conn.meta_dtypes, conn.meta_fmt)
    data = torch.randint(0, 256, (len(memoryview(obj.byte_array)),), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    memoryview(obj.byte_array).cast("B")[:] = data.numpy().tobytes()
    return obj


def test_the_connector_is_lmcaches_own_kind_made_by_its_plugin_framework(
        tmp_path: Path, client_toml: Path) -> None:
    assert issubclass(PfsConnector, base.RemoteConnector)
    assert issubclass(PfsConnectorAdapter, connector.ConnectorAdapter)
    cfg, meta, backend = engine(tmp_path, client_toml)

    async def run() -> None:
        made = connector.CreateConnector("plugin://pfs", asyncio.get_running_loop(),
                                         backend, cfg, meta, plugin_name="pfs")
        inner = getattr(made, "getWrappedConnector", lambda: made)()
        assert isinstance(inner, PfsConnector)
        assert inner.cache.ns == "lmcache" and await inner.ping() == 0
        await inner.close()

    asyncio.run(run())


@pytest.mark.parametrize("chunk_meta", [True, False])
def test_chunks_round_trip_every_byte_checked(tmp_path: Path, client_toml: Path,
                                              chunk_meta: bool) -> None:
    cfg, meta, backend = engine(tmp_path, client_toml, namespace=f"it-lmcache-{chunk_meta}")
    cfg.extra_config["save_chunk_meta"] = chunk_meta
    tag = 1 + int(chunk_meta)

    async def run() -> None:
        conn = PfsConnector(asyncio.get_running_loop(), backend, cfg, "pfs")
        try:
            keys = [key(i, tag) for i in range(6)]
            # the last chunk of a prompt is partial: with chunk meta it keeps its shape
            objs = [chunk(backend, conn, CHUNK if i < 5 or not chunk_meta else 5, i)
                    for i in range(6)]
            want = [bytes(memoryview(o.byte_array)) for o in objs]
            await conn.batched_put(keys[:3], objs[:3])
            for k, o in zip(keys[3:], objs[3:], strict=True):
                await conn.put(k, o)
            assert await conn.batched_async_contains("q", keys) == 6
            assert conn.batched_contains(keys) == 6
            got = await conn.batched_get(keys)
            for i, (g, o) in enumerate(zip(got, objs, strict=True)):
                assert g is not None and bytes(memoryview(g.byte_array)) == want[i], i
                assert g.get_shapes() == o.get_shapes()
                g.ref_count_down()
            # a hole: the chain counts up to it; a missing chunk is a miss
            assert conn.remove_sync(keys[2]) is True
            assert await conn.batched_async_contains("q", keys) == 2
            assert await conn.exists(keys[2]) is False and conn.exists_sync(keys[1])
            assert await conn.get(keys[2]) is None
            assert await conn.get(key(99, tag)) is None
            for o in objs:
                o.ref_count_down()
        finally:
            await conn.close()

    asyncio.run(run())


def test_a_block_that_is_not_a_chunk_is_a_miss(tmp_path: Path, client_toml: Path) -> None:
    cfg, meta, backend = engine(tmp_path, client_toml, namespace="it-lmcache-foreign")

    async def run() -> None:
        conn = PfsConnector(asyncio.get_running_loop(), backend, cfg, "pfs")
        try:
            bad, big = key(1, 7), key(2, 7)
            conn.cache.put(conn._key(bad), b"\xff" * 200)  # no LMCache header
            conn.cache.put(conn._key(big), b"\x00" * (conn.full_chunk_size_bytes + 4096))
            assert await conn.get(bad) is None and await conn.get(big) is None
        finally:
            await conn.close()

    asyncio.run(run())
