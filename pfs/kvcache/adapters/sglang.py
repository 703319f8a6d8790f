"""SGLang HiCache's storage backend on pfs: ``PfsHiCacheStorage``, loaded by SGLang's
dynamic backend factory::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "pfs",
        "module_path": "pfs.kvcache.adapters.sglang", "class_name": "PfsHiCacheStorage",
        "config": "/etc/pfs/client.toml", "interface_v1": 1}'

Each HiCache page is one pfs block, its key the page's hash. The namespace holds the
model and, for models whose ranks hold different heads (not MLA), the rank, as SGLang's
own backends key them. ``batch_exists`` is pfs's prefix ``exists``; a page that is missing,
evicted, damaged or of another size is a miss (``None`` / ``False``), never an error to
the engine. Both of SGLang's data paths are served: the generic one (``batch_get`` /
``batch_set`` of flat page tensors) and the zero-copy one (``batch_get_v1`` /
``batch_set_v1`` on the host pool's own buffers, with ``"interface_v1": 1``), and
hybrid models' side pools (the v2 interface: Mamba, SWA... states stored beside their KV
page as ``<key>.<pool>``, as SGLang's file backend names them).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from pfs.kvcache.adapters.common import (
    address_view,
    block_key,
    namespace,
    nbytes,
    open_cache,
    sync_of,
    tensor_bytes,
)
from pfs.kvcache.api import KVCache

log = logging.getLogger(__name__)

WORKERS = 16  # pages of one batch fetched at once (each a blocking KVCache get)


def namespace_of(cfg: HiCacheStorageConfig | None, prefix: str = "sglang") -> str:
    """The pfs namespace of one rank's pages: the model, then the rank where ranks
    hold different data (SGLang's HiCacheFile and SeaweedFS key by the same rules)."""
    if cfg is None:
        return namespace(prefix)
    parts: list[str | None] = [prefix, cfg.model_name]
    if not cfg.is_mla_model:
        parts.append(f"tp{cfg.tp_rank}of{cfg.tp_size}")
    if cfg.pp_size > 1:
        parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
    if cfg.attn_cp_size > 1:
        parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
    if cfg.dcp_size > 1:
        parts.append(f"dcp{cfg.dcp_rank}of{cfg.dcp_size}page{cfg.logical_page_size}")
    return namespace(*parts)


class PfsHiCacheStorage(HiCacheStorage):
    """HiCache pages in pfs's KV-cache tier. SGLang's factory calls
    ``PfsHiCacheStorage(storage_config, kwargs)``; ``cache`` (tests, embedding) gives
    a KVCache to use instead of opening one from the extra config."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None,
                 kwargs: dict[str, Any] | None = None, *, cache: KVCache | None = None
                 ) -> None:
        extra = dict(storage_config.extra_config or {}) if storage_config else {}
        self.ns = (cache.ns if cache is not None else
                   extra.get("namespace") or namespace_of(storage_config))
        self.sync = sync_of(extra)
        # Mamba state is sharded by rank even where MLA ranks share their KV pages
        mla = storage_config is not None and storage_config.is_mla_model
        self._mamba_tag = (f".tp{storage_config.tp_rank}of{storage_config.tp_size}"
                           if storage_config is not None and mla else "")
        self._own = cache is None
        self.cache = cache if cache is not None else open_cache(extra, self.ns)
        self._workers = ThreadPoolExecutor(int(extra.get("workers", WORKERS)),
                                           thread_name_prefix="pfs-hicache")
        log.info("pfs HiCache storage: namespace %s, sync puts %s", self.ns, self.sync)

    # -- one page -------------------------------------------------------------------
    def _read(self, key: str, out: Any, size: int) -> bool:
        """Fill ``out`` (``size`` bytes) with the page of ``key``: False on a miss,
        and on a block of another size (a stale layout); after a miss ``out``'s bytes
        are undefined (SGLang drops the page, as it does after any miss)."""
        try:
            n = self.cache.get_into(block_key(key), out)
        except OSError as exc:  # ERANGE (a larger block), a failing cluster: a miss
            log.warning("pfs HiCache get %s: %s", key, exc)
            return False
        if n is None:
            return False
        if n != size:
            log.warning("pfs HiCache page %s is %d bytes, the page %d", key, n, size)
            return False
        return True

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        page = target_location if target_location is not None else self._flat_page()
        return page if self._read(key, tensor_bytes(page), nbytes(page)) else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        pages = target_locations or [None] * len(keys)
        return list(self._workers.map(self.get, keys, pages))

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        page = value if value is not None else target_location
        return self._put([key], [tensor_bytes(page.contiguous())])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        pages = values if values is not None else target_locations
        return self._put(keys, [tensor_bytes(p.contiguous()) for p in pages])

    def _put(self, keys: Sequence[str], bufs: list[Any]) -> bool:
        try:
            self.cache.put_batch([block_key(k) for k in keys], bufs, sync=self.sync)
        except OSError as exc:
            log.error("pfs HiCache put of %d pages: %s", len(keys), exc)
            return False
        return True

    # -- presence -------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of the chain ``keys`` are held (pfs's prefix exists)."""
        try:
            return self.cache.exists([block_key(k) for k in keys])
        except OSError as exc:
            log.warning("pfs HiCache exists of %d pages: %s", len(keys), exc)
            return 0

    # -- zero copy: the host pool's own buffers -------------------------------------
    def _page_buffers(self, host_indices: torch.Tensor) -> list[list[tuple[int, int]]]:
        """(address, bytes) of each host-pool buffer of every page, in page order."""
        pool = self.mem_pool_host
        addresses, sizes = pool.get_page_buffer_meta(host_indices)
        pages = len(host_indices) // pool.page_size
        per_page = len(addresses) // pages
        if isinstance(sizes, int):
            sizes = [sizes] * len(addresses)
        return [list(zip(addresses[i * per_page:(i + 1) * per_page],
                         sizes[i * per_page:(i + 1) * per_page], strict=True))
                for i in range(pages)]

    def _get_v1(self, key: str, buffers: list[tuple[int, int]]) -> bool:
        size = sum(n for _, n in buffers)
        if len(buffers) == 1:  # page-first layouts: straight into the pool
            return self._read(key, address_view(*buffers[0]), size)
        scratch = bytearray(size)
        if not self._read(key, scratch, size):
            return False
        at = 0
        for address, n in buffers:
            address_view(address, n)[:] = memoryview(scratch)[at:at + n]
            at += n
        return True

    @staticmethod
    def _gather(buffers: list[tuple[int, int]]) -> Any:
        if len(buffers) == 1:
            return address_view(*buffers[0])
        return b"".join(address_view(a, n) for a, n in buffers)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return list(self._workers.map(self._get_v1, keys, self._page_buffers(host_indices)))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        bufs = [self._gather(b) for b in self._page_buffers(host_indices)]
        return [self._put(keys, bufs)] * len(keys)

    # -- v2: hybrid models' side pools ----------------------------------------------
    def _component_key(self, key: str, pool: Any) -> str:
        name = getattr(pool, "value", pool)
        if name == PoolName.KV.value:
            return key
        if name == PoolName.MAMBA.value:
            return f"{key}.{name}{self._mamba_tag}"
        return f"{key}.{name}"

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> PoolTransferResult:
        """The KV prefix held, cut to the prefixes every side pool can restore: all of
        its pages (ALL_PAGES), or the window of pages that ends the prefix
        (TRAILING_PAGES), as SGLang's file backend decides."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            names = [self._component_key(k, transfer.name) for k in keys[:kv_pages]]
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = self.batch_exists(names)
                ok = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                present = list(self._workers.map(self.exists, names))
                window = max(1, len(transfer.keys or ()))
                ok = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window):n])}
                boundary = max(ok, default=0)
            else:
                raise ValueError(f"pfs HiCache: unsupported pool hit policy "
                                 f"{transfer.hit_policy}")
            if boundary:
                hits[transfer.name] = boundary
            restorable = [n for n in restorable if n in ok]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _read_v2(self, pool_name: Any, key: str, host_pool: Any, offset: int) -> bool:
        page = host_pool.get_dummy_flat_data_page()
        if self.get(self._component_key(key, pool_name), page) is None:
            return False
        host_pool.set_from_flat_data_page(offset, page)
        return True

    def _write_v2(self, pool_name: Any, key: str, host_pool: Any, offset: int) -> bool:
        page = host_pool.get_data_page(offset, flat=True)
        return self.set(self._component_key(key, pool_name), page)

    def _batch_v2(self, transfers: list[PoolTransfer], page_fn: Any) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        pools = getattr(self, "registered_pools", {})
        for transfer in transfers:
            keys = transfer.keys or []
            pool = pools.get(transfer.name)
            page_size = getattr(pool, "page_size", 1) or 1
            indices = transfer.host_indices
            if pool is None or indices is None or indices.numel() != len(keys) * page_size:
                log.error("pfs HiCache: pool %s not registered or %d keys for %s indices",
                          transfer.name, len(keys),
                          None if indices is None else indices.numel())
                results[transfer.name] = [False] * len(keys)
                continue
            offsets = [int(indices[i * page_size].item()) for i in range(len(keys))]
            results[transfer.name] = list(self._workers.map(
                lambda k, o, name=transfer.name, pool=pool: page_fn(name, k, pool, o),
                keys, offsets))
        return results

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, self._read_v2)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None
                     ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, self._write_v2)

    # -- the rest -------------------------------------------------------------------
    def _flat_page(self) -> torch.Tensor:
        pool = getattr(self, "mem_pool_host", None)
        if pool is None:
            raise ValueError("pfs HiCache get without a target: no host pool registered")
        page: torch.Tensor = pool.get_dummy_flat_data_page()
        return page

    # get_stats stays SGLang's (None): SGLang's metrics want its own StorageMetrics;
    # pfs's counters are in self.cache.stats(), pfs admin kv and /metrics

    def close(self) -> None:
        self._workers.shutdown(wait=True)
        if self._own:
            self.cache.close()
