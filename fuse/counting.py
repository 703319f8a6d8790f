"""Kernel requests counted by opcode, for the mount's ``/metrics``.

``pfs_fuse_requests_total{op}`` counts each request the kernel sent (``lookup``,
``create``, ``getattr``, ``flush``, ``release``, ``forget``, ...), whatever the answer;
with ``pfs_rpc_requests_total{service="client"}`` it tells what an operation costs the
mount: how many kernel requests, and how many of them needed the metaserver. Counted
only while metrics are served (``metrics_port``): :func:`count_requests` then puts a
counting wrapper on each handler of the operations object; without it the handlers are
pyfuse3's to call directly, at no cost.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

from pfs.core import metrics

# the handlers pyfuse3 calls on a request from the kernel (its ``Operations``)
HANDLERS = ("lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir",
            "unlink", "rmdir", "symlink", "rename", "link", "open", "create", "read",
            "write", "flush", "release", "fsync", "opendir", "readdir", "releasedir",
            "fsyncdir", "statfs", "getxattr", "setxattr", "listxattr", "removexattr",
            "access")

Handler = Callable[..., Coroutine[Any, Any, Any]]


def _counted(handler: Handler, inc: Callable[[], None]) -> Handler:
    @functools.wraps(handler)
    async def counted(*args: Any) -> Any:
        inc()
        return await handler(*args)
    return counted


def count_requests(ops: Any) -> bool:
    """Count each kernel request ``ops`` serves, by opcode, if metrics are served;
    whether it does."""
    if not metrics.enabled():
        return False
    for op in HANDLERS:
        inc = metrics.fuse_request_counter(op)
        assert inc is not None  # metrics are on
        setattr(ops, op, _counted(getattr(ops, op), inc))
    return True
