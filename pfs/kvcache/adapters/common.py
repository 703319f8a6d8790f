"""What the engine adapters share: a KVCache built from an engine's option table, engine
names made into pfs namespaces and keys, and byte views of torch tensors."""
from __future__ import annotations

import ctypes
import hashlib
import re
from collections.abc import Mapping
from typing import Any

import torch

from pfs.kvcache.api import MAX_KEY, KVCache

MAX_NS = 128
_NOT_NS = re.compile(r"[^A-Za-z0-9._:-]+")
# the options an engine's config may give (all optional but a cluster: config or meta)
OPTIONS = ("config", "meta", "namespace", "node_tier_bytes", "node_dir", "replicas", "pin",
           "sync", "short_circuit")


def namespace(*parts: str | None) -> str:
    """A pfs namespace from engine names (a model such as ``org/Model-7B``, a rank):
    characters pfs does not take become ``_``; a name too long keeps its start and a
    hash of the whole, so two long names never meet."""
    text = ":".join(_NOT_NS.sub("_", p) for p in parts if p)
    if len(text) <= MAX_NS:
        return text or "default"
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return f"{text[:MAX_NS - 17]}.{digest}"


def block_key(name: str) -> bytes:
    """A pfs key from an engine's key string; one longer than pfs takes keeps its start
    and a hash of the whole."""
    raw = name.encode()
    if len(raw) <= MAX_KEY:
        return raw
    return raw[:MAX_KEY - 33] + b"#" + hashlib.blake2b(raw, digest_size=16).hexdigest().encode()


def open_cache(options: Mapping[str, Any], ns: str) -> KVCache:
    """A blocking KVCache from an engine's options (:data:`OPTIONS`): ``config`` (a pfs
    client config file; else $PFS_CONFIG) and/or ``meta`` (host:port)."""
    kw: dict[str, Any] = {}
    if "node_tier_bytes" in options:
        kw["node_tier_bytes"] = int(options["node_tier_bytes"])
    if options.get("node_dir"):
        kw["node_dir"] = str(options["node_dir"])
    if "replicas" in options:
        kw["replicas"] = int(options["replicas"])
    if "pin" in options:
        kw["pin"] = _flag(options["pin"])
    if "short_circuit" in options:
        kw["short_circuit"] = _flag(options["short_circuit"])
    return KVCache(options.get("config"), ns, meta=options.get("meta"), **kw)


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def sync_of(options: Mapping[str, Any]) -> bool:
    """Whether a put waits for the block's homes (default) or only this node's tier."""
    return _flag(options.get("sync", True))


def tensor_bytes(t: torch.Tensor) -> Any:
    """What KVCache takes for a tensor, its own memory as bytes (no copy): a GPU tensor
    as a uint8 tensor (pfs's device path; bf16 has no CUDA array interface), a host
    tensor as a writable memoryview. ValueError when it is not contiguous: a copy would
    not be the engine's page."""
    if not t.is_contiguous():
        raise ValueError("a KV page tensor must be contiguous")
    if t.device.type != "cpu":
        return t.reshape(-1).view(torch.uint8)
    view: memoryview = t.reshape(-1).view(torch.uint8).numpy().data
    return view


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def address_view(address: int, size: int) -> memoryview:
    """Writable bytes at a raw host address (an engine's pinned host pool)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")
