"""Adapters that let inference engines keep their KV cache in pfs: ``lmcache`` (a remote
storage plugin of LMCache) and ``sglang`` (a HiCache storage backend of SGLang), both
over :class:`pfs.kvcache.KVCache`; ``common`` holds what they share (options, names,
tensor views). Import the one you need: each imports its engine (docs/kvcache-engines.md).
"""
