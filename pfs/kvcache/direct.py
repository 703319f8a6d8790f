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
from collections.abc import Callable, Sequence
from typing import Any

from pfs.client.direct import DirectData
from pfs.core import crcfast
from pfs.core.auth import ClientAuth
from pfs.core.messages import kv as K
from pfs.core.messages.base import parse_reply

PIPELINE = 32  # gets of a batch in flight on one connection


def _value(sid: str, msg: K.KvGet, fields: dict[str, Any], got: int, authenticated: bool,
           out: memoryview) -> int | None:
    """A ``kv_get`` reply whose value (``got`` bytes) landed in ``out``: its length, or
    None for a miss; ``EIO`` when a plain connection's bytes fail their CRC32C."""
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


class DirectKv:
    """``get_into``/``put`` of one block at one server, in the calling thread."""

    def __init__(self, auth: ClientAuth, address: Callable[[str], tuple[str, int] | None],
                 timeout: float = 60.0) -> None:
        self.data = DirectData(auth.for_data(), address, timeout)

    def get_into(self, sid: str, ns: str, key: bytes, out: memoryview) -> int | None:
        msg = K.KvGet(ns=ns, key=key, len=min(len(out), K.MAX_VALUE))
        fields, got, authenticated = self.data.exchange(sid, msg, into=out)
        return _value(sid, msg, fields, got, authenticated, out)

    def get_batch(self, sid: str, ns: str, keys: Sequence[bytes], outs: Sequence[memoryview]
                  ) -> list[int | None | OSError]:
        """``get_into`` of each key at server ``sid``, pipelined on one connection
        (``PIPELINE`` requests at a time): per key its length, None (a miss), or its
        error (the server's, or ``EIO`` for bytes that fail their CRC32C). A connection
        that fails raises, as ``get_into``."""
        res: list[int | None | OSError] = []
        for i in range(0, len(keys), PIPELINE):
            calls = [(K.KvGet(ns=ns, key=k, len=min(len(o), K.MAX_VALUE)), o)
                     for k, o in zip(keys[i:i + PIPELINE], outs[i:i + PIPELINE], strict=True)]
            replies, authenticated = self.data.batch(sid, list(calls))
            for (msg, out), reply in zip(calls, replies, strict=True):
                if isinstance(reply, OSError):
                    res.append(reply)
                    continue
                try:
                    res.append(_value(sid, msg, reply[0], reply[1], authenticated, out))
                except OSError as exc:
                    res.append(exc)
        return res

    def put(self, sid: str, ns: str, key: bytes, view: memoryview, crc: int,
            pin: bool = False) -> None:
        msg = K.KvPut(ns=ns, key=key, crc=crc, pin=pin)
        fields, _ = self.data.send(sid, msg, payload=view)
        parse_reply(msg, fields)

    def close(self) -> None:
        self.data.close()
