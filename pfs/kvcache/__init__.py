"""The KV-cache tier: blocks of the attention KV cache put once and fetched by every node,
from this node's shared memory, then from their homes on the data servers
(docs/architecture.md "KV-cache tier"). ``KVCache``/``AsyncKVCache`` are the API;
``remote`` is the low-level client of one data server's block store."""
from pfs.kvcache.api import AsyncKVCache, KVCache

__all__ = ["AsyncKVCache", "KVCache"]
