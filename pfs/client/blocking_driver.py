"""The blocking driver: carries plans (:mod:`pfs.client.plan`) out in the caller's
thread, for ``pfs.connect()``: no trio, no threads, one request at a time.

Data requests go over :class:`~pfs.client.direct.DirectData`'s pooled blocking
connections, short-circuit reads are one ``preadv``, metadata requests go over the
``MetaClient``'s blocking connection (``request_blocking``), a
:class:`~pfs.client.plan.Parallel` runs its sub-plans one after the other. What needs
the event loop or the metaserver — renewing a capability of a file handle, asking a
local data server for a descriptor, reconnecting to a server that may have moved —
raises
:class:`~pfs.client.plan.HandOver` out of :meth:`BlockingDriver.run`, and the caller runs
the operation again on the trio driver.
"""
from __future__ import annotations

import time
from typing import Any, TypeVar

from pfs.client.direct import DirectData
from pfs.client.meta import MetaClient
from pfs.client.plan import (
    Call,
    DeferClose,
    DeviceWait,
    HandOver,
    LocalFd,
    LocalRead,
    MetaCall,
    Parallel,
    Plan,
    Reconnect,
    Renew,
    Send,
    Sleep,
    ToDevice,
)
from pfs.core.messages.base import parse_reply

T = TypeVar("T")


class BlockingDriver:
    def __init__(self, data: DirectData | None, meta: MetaClient) -> None:
        self.data = data  # None: data requests are the trio driver's
        self.meta = meta

    def run(self, plan: Plan[T]) -> T:
        send = plan.send
        try:
            effect = send(None)
            while True:
                try:
                    value = self._do(effect)
                except OSError as exc:
                    effect = plan.throw(exc)
                else:
                    effect = send(value)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            plan.close()  # a plan left suspended (HandOver) runs its cleanup now

    def _do(self, effect: Any) -> Any:
        kind = type(effect)
        if kind is LocalRead:
            return effect.local.read_blocking(effect.fd, effect.obj_off, effect.dests)
        if kind is Send:
            if self.data is None or isinstance(effect.into, list) \
                    or isinstance(effect.payload, list):
                raise HandOver("scattered requests are the trio driver's")
            msg = effect.msg
            fields, n = self.data.send(effect.sid, msg, payload=effect.payload,
                                       into=effect.into)
            parse_reply(msg, fields)  # checked: EPROTO when it does not fit
            return n
        if isinstance(effect, MetaCall):
            return self.meta.request_blocking(effect.msg)
        if isinstance(effect, Parallel):
            return [self.run(sub) for sub in effect.plans]
        if isinstance(effect, Sleep):
            time.sleep(effect.seconds)
            return None
        if isinstance(effect, DeferClose):
            return self.meta.defer_close(effect.fh, effect.generation)
        if isinstance(effect, ToDevice):
            effect.stager.copy(effect.slot, effect.dst_ptr, effect.src_off, effect.n)
            return None
        if isinstance(effect, DeviceWait):
            effect.stager.wait(effect.slot)
            return None
        if isinstance(effect, (Renew, Reconnect, LocalFd, Call)):
            raise HandOver(type(effect).__name__)
        raise TypeError(f"not an effect: {effect!r}")
