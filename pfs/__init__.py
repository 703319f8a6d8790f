"""pfs: a parallel distributed filesystem for LLM clusters.

``pfs.connect()`` returns a :class:`pfs.client.sync.Client`, an os-like API over the
cluster that reads and writes stripes in parallel straight into the caller's buffers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pfs.client.sync import Client


def connect(config: Any = None, meta: str | None = None, **kwargs: Any) -> Client:
    """Connect to a cluster: ``config`` is a client.toml path or a ClientConfig,
    ``meta`` a ``HOST:PORT``; with neither, ``$PFS_CONFIG`` names the config file."""
    from pfs.client.sync import Client

    return Client.connect(config=config, meta=meta, **kwargs)


def load_safetensors(source: Any, device: str = "cpu", client: Any = None,
                     **kwargs: Any) -> dict[str, Any]:
    """Load a (sharded) safetensors checkpoint from pfs or local disk into
    ``{name: tensor}``; see :func:`pfs.loader.safetensors.load_safetensors` (imported on first use)."""
    from pfs.loader.safetensors import load_safetensors as load

    return load(source, device, client, **kwargs)


__all__ = ["connect", "load_safetensors", "__version__"]
