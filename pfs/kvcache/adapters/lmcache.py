"""LMCache's remote storage on pfs: ``PfsConnector`` (a RemoteConnector) and
``PfsConnectorAdapter``, loaded by LMCache's remote storage plugin framework::

    remote_storage_plugins: ["pfs"]
    remote_serde: naive
    extra_config:
      remote_storage_plugin.pfs.module_path: pfs.kvcache.adapters.lmcache
      remote_storage_plugin.pfs.class_name: PfsConnectorAdapter
      remote_storage_plugin.pfs.config: /etc/pfs/client.toml

Each LMCache chunk is one pfs block under the key's string (model, world size, worker,
chunk hash, dtype); with ``save_chunk_meta`` (LMCache's default) the block starts with
LMCache's own chunk header, as its file connector stores it, so partial chunks come back
with their shapes. A chunk that is missing, evicted or damaged is a miss (``None``),
never an error to the engine. The connector's coroutines run the blocking KVCache in a
worker thread, so LMCache's event loop never waits on the network.
"""
from __future__ import annotations

import asyncio
import builtins
import logging
import struct
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import (
    ConnectorAdapter,
    ConnectorContext,
    extract_plugin_type,
)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from pfs.kvcache.adapters.common import block_key, open_cache, sync_of
from pfs.kvcache.api import KVCache

log = logging.getLogger(__name__)

PLUGIN = "pfs"
NAMESPACE = "lmcache"  # the key string names model, world and dtype already


def plugin_options(config: Any, plugin_name: str | None) -> dict[str, Any]:
    """``remote_storage_plugin.<name>.<option>`` entries of LMCache's extra_config."""
    extra = (getattr(config, "extra_config", None) or {}) if config is not None else {}
    prefix = f"remote_storage_plugin.{plugin_name or PLUGIN}."
    return {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)}


class PfsConnector(RemoteConnector):
    """LMCache chunks in pfs's KV-cache tier. ``cache`` (tests, embedding) gives a
    KVCache to use instead of opening one from the plugin's options."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any = None, plugin_name: str | None = None, *,
                 cache: KVCache | None = None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        opts = plugin_options(config, plugin_name)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.sync = sync_of(opts)
        self._own = cache is None
        self.cache = cache if cache is not None else open_cache(
            opts, str(opts.get("namespace") or NAMESPACE))
        log.info("pfs LMCache connector: namespace %s, chunk meta %s", self.cache.ns,
                 self.save_chunk_meta)

    # -- blocking halves (run in a worker thread) -------------------------------------
    def _key(self, key: CacheEngineKey) -> bytes:
        return block_key(key.to_string())

    def _count(self, keys: builtins.list[CacheEngineKey]) -> int:
        try:
            return self.cache.exists([self._key(k) for k in keys])
        except OSError as exc:
            log.warning("pfs LMCache exists of %d chunks: %s", len(keys), exc)
            return 0

    def _get(self, key: CacheEngineKey) -> MemoryObj | None:
        head = self.remote_metadata_bytes if self.save_chunk_meta else 0
        buf = bytearray(head + self.full_chunk_size_bytes)
        try:
            n = self.cache.get_into(self._key(key), buf)
        except OSError as exc:  # ERANGE (not a chunk of this layout), a failing cluster
            log.warning("pfs LMCache get %s: %s", key.to_string(), exc)
            return None
        if n is None or n <= head:
            return None
        if self.save_chunk_meta:
            try:
                meta = RemoteMetadata.deserialize(bytes(buf[:head]))
            except (ValueError, KeyError, struct.error) as exc:  # not LMCache's header
                log.warning("pfs LMCache chunk %s: bad header (%s)", key.to_string(), exc)
                return None
            shapes, dtypes, fmt, size = meta.shapes, meta.dtypes, meta.fmt, meta.length
        else:
            shapes, dtypes, fmt, size = self.meta_shapes, self.meta_dtypes, self.meta_fmt, n
        if size != n - head:
            log.warning("pfs LMCache chunk %s: %d bytes, its header says %d",
                        key.to_string(), n - head, size)
            return None
        obj: MemoryObj | None = self.local_cpu_backend.allocate(shapes, dtypes, fmt)
        if obj is None:
            log.debug("pfs LMCache get: no local CPU memory for a chunk")
            return None
        dst = memoryview(obj.byte_array).cast("B")
        if len(dst) < size:
            obj.ref_count_down()
            return None
        dst[:size] = memoryview(buf)[head:n]
        if self.save_chunk_meta:
            return obj
        try:
            return self.reshape_partial_chunk(obj, size)
        except ValueError as exc:  # not a whole number of tokens: another layout
            log.warning("pfs LMCache chunk %s: %s", key.to_string(), exc)
            obj.ref_count_down()
            return None

    def _value(self, obj: MemoryObj) -> Any:
        data = memoryview(obj.byte_array).cast("B")
        if not self.save_chunk_meta:
            return data
        meta = RemoteMetadata(len(data), obj.get_shapes(), obj.get_dtypes(),
                              obj.get_memory_format())
        return meta.serialize() + data

    def _put(self, keys: builtins.list[CacheEngineKey], objs: builtins.list[MemoryObj]) -> None:
        self.cache.put_batch([self._key(k) for k in keys], [self._value(o) for o in objs],
                             sync=self.sync)

    # -- RemoteConnector --------------------------------------------------------------
    async def exists(self, key: CacheEngineKey) -> bool:
        return await asyncio.to_thread(self._count, [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._count([key]) == 1

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return await asyncio.to_thread(self._get, key)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await asyncio.to_thread(self._put, [key], [memory_obj])

    async def list(self) -> builtins.list[str]:
        """pfs keeps no listing of a namespace's keys (blocks live at their homes,
        found by hashing): an empty list."""
        return []

    async def close(self) -> None:
        if self._own:
            await asyncio.to_thread(self.cache.close)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the pool has a data server with a KV budget."""
        return 0 if self.cache.stats().get("pool") else 1

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: builtins.list[CacheEngineKey]) -> builtins.list[MemoryObj | None]:
        return list(await asyncio.gather(*(self.get(k) for k in keys)))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: builtins.list[CacheEngineKey],
                          memory_objs: builtins.list[MemoryObj]) -> None:
        await asyncio.to_thread(self._put, list(keys), list(memory_objs))

    async def batched_async_contains(self, lookup_id: str, keys: builtins.list[CacheEngineKey],
                                     pin: bool = False) -> int:
        """How many leading chunks are held: pfs's prefix exists, one call."""
        return await asyncio.to_thread(self._count, list(keys))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: builtins.list[CacheEngineKey]) -> int:
        return self._count(list(keys))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            return self.cache.remove([self._key(key)]) > 0
        except OSError as exc:
            log.warning("pfs LMCache remove %s: %s", key.to_string(), exc)
            return False


class PfsConnectorAdapter(ConnectorAdapter):
    """Makes a PfsConnector for ``plugin://pfs`` (or ``plugin://pfs.<instance>``)."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN}")

    def can_parse(self, url: str) -> bool:
        return (url.startswith("plugin://")
                and extract_plugin_type(url[len("plugin://"):]) == PLUGIN)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return PfsConnector(context.loop, context.local_cpu_backend, context.config,
                            context.plugin_name)
