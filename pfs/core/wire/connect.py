"""Authenticated client connections: a TCP (or TLS) connection, then the handshake of
:class:`pfs.core.auth.ClientAuth`, as an RPC client for trio or for a blocking thread.

Here rather than in :mod:`pfs.core.auth` so that auth stays key, HMAC and TLS logic and the
RPC layer may use it without an import cycle."""
from __future__ import annotations

import errno
from typing import Any

import trio

from pfs.core.auth import AUTH_TIMEOUT, ClientAuth
from pfs.core.errors import ProtocolError
from pfs.core.wire.blocking import BlockingConnection, BlockingRpcClient
from pfs.core.wire.rpc import RpcClient


def open_blocking(auth: ClientAuth, host: str, port: int,
                  timeout: float = 60.0) -> BlockingRpcClient:
    """A blocking RPC client to ``host:port``, authenticated with ``auth``."""
    conn = BlockingConnection.open(host, port, timeout=min(timeout, AUTH_TIMEOUT),
                                   tls=auth.tls)
    try:
        auth.hello_blocking(conn)
    except ProtocolError as exc:
        conn.close()
        raise OSError(errno.EPROTO, f"{host}:{port}: {exc}") from None
    except BaseException:
        conn.close()
        raise
    conn.set_timeout(timeout)
    return BlockingRpcClient(conn)


async def open_rpc(auth: ClientAuth, nursery: trio.Nursery, host: str, port: int,
                   **kw: Any) -> RpcClient:
    """A trio RPC client to ``host:port`` (its reader runs in ``nursery``), authenticated
    with ``auth``; ``kw`` goes to :meth:`RpcClient.open`."""
    try:
        return await RpcClient.open(nursery, host, port, tls=auth.tls, hello=auth.hello, **kw)
    except trio.TooSlowError:
        raise OSError(errno.ETIMEDOUT, f"{host}:{port}: authentication timed out") from None
    except ProtocolError as exc:
        raise OSError(errno.EPROTO, f"{host}:{port}: {exc}") from None
