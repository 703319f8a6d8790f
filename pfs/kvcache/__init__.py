"""A KV-cache tier for inference: blocks of the attention KV cache put once and fetched by
every node, from this node's shared memory, then from their homes on the data servers
(docs/architecture.md, "KV-cache tier")."""
from pfs.kvcache.api import AsyncKVCache, KVCache

__all__ = ["AsyncKVCache", "KVCache"]
