"""pfs: a parallel distributed filesystem for LLM clusters.

``pfs.connect()`` returns a :class:`pfs.client.Client`, an os-like API over the
cluster that reads and writes stripes in parallel straight into the caller's buffers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pfs.client.sync import Client


def connect(config: Any = None, meta: str | None = None, **kwargs: Any) -> "Client":
    """Connect to a cluster: ``config`` is a client.toml path or a ClientConfig,
    ``meta`` a ``HOST:PORT``; with neither, ``$PFS_CONFIG`` names the config file."""
    from pfs.client.sync import Client

    return Client.connect(config=config, meta=meta, **kwargs)


__all__ = ["connect", "__version__"]
