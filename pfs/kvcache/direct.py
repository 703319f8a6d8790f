"""The blocking twin's route to a block's home without the event loop: ``kv_get`` and
``kv_put`` over pooled blocking connections (:class:`pfs.client.direct.DirectData`) from
the caller's thread.

A request through the trio thread costs two thread hand-offs besides the round trip;
on a busy host each hand-off waits for a time slice, which made a 256 KiB get from a
server slower than the same get from Redis (one blocking socket). Anything unusual -
no address yet, a server that does not answer - raises, and the caller goes the trio
way, which marks servers down and refreshes the pool.
"""
from __future__ import annotations

import errno
from collections.abc import Callable

from pfs.client.direct import DirectData
from pfs.core import crcfast
from pfs.core.auth import ClientAuth
from pfs.core.messages import kv as K
from pfs.core.messages.base import parse_reply


class DirectKv:
    """``get_into``/``put`` of one block at one server, in the calling thread."""

    def __init__(self, auth: ClientAuth, address: Callable[[str], tuple[str, int] | None],
                 timeout: float = 60.0) -> None:
        self.data = DirectData(auth.for_data(), address, timeout)

    def get_into(self, sid: str, ns: str, key: bytes, out: memoryview) -> int | None:
        msg = K.KvGet(ns=ns, key=key, len=min(len(out), K.MAX_VALUE))
        fields, got, authenticated = self.data.exchange(sid, msg, into=out)
        reply: K.KvGetReply = parse_reply(msg, fields)
        if not reply.found:
            return None
        if got != reply.n:
            raise OSError(errno.EPROTO, f"kv get from {sid}: {got} bytes received for a "
                                        f"{reply.n}-byte value")
        # the server checked the value's CRC as it read it; a MAC'd (or TLS) connection
        # then proves these are the bytes it checked: a second CRC here adds nothing
        if not authenticated and crcfast.crc32c(out[:reply.n]) != reply.crc:
            raise OSError(errno.EIO, f"kv get from {sid}: the bytes received do not match "
                                     "their CRC32C")
        return reply.n

    def put(self, sid: str, ns: str, key: bytes, view: memoryview, crc: int,
            pin: bool = False) -> None:
        msg = K.KvPut(ns=ns, key=key, crc=crc, pin=pin)
        fields, _ = self.data.send(sid, msg, payload=view)
        parse_reply(msg, fields)

    def close(self) -> None:
        self.data.close()
