"""The trio driver: carries plans (:mod:`pfs.client.plan`) out with many requests in
flight, for ``AsyncClient``, the FUSE mount and the sync client's larger requests.

Requests go over :class:`~pfs.client.data.DataClient`'s connections, short-circuit
reads to the client's engine (:mod:`pfs.client.shortcircuit`), device destinations through a
pinned staging buffer (:mod:`pfs.client.device`), metadata requests over the ``MetaClient``; a plan's :class:`~pfs.client.plan.Parallel` sub-plans run as tasks of a
nursery, and the first ``OSError`` among them is raised as itself.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from pfs.client.data import DataClient, run_all
from pfs.client.plan import (
    Call,
    DeferClose,
    DeviceWait,
    LocalFd,
    LocalRead,
    MetaCall,
    Parallel,
    Plan,
    Reconnect,
    Refresh,
    Renew,
    Send,
    Sleep,
    ToDevice,
)
from pfs.core.checksums import ChecksumError, copied, verify_read
from pfs.core.messages.base import parse_reply

if TYPE_CHECKING:  # annotations only: MetaClient runs its plans on this driver
    from pfs.client.meta import MetaClient

T = TypeVar("T")


class TrioDriver:
    def __init__(self, data: DataClient | None = None, meta: MetaClient | None = None) -> None:
        self.data = data
        self.meta = meta

    async def run(self, plan: Plan[T]) -> T:
        value: Any = None
        exc: OSError | None = None
        try:
            while True:
                try:
                    effect = plan.send(value) if exc is None else plan.throw(exc)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                value, exc = None, None
                try:
                    if type(effect) is MetaCall:  # most metadata plans: no other effect
                        assert self.meta is not None
                        value = await self.meta.request(effect.msg)
                    else:
                        value = await self._do(effect)
                except OSError as e:
                    exc = e
        finally:
            plan.close()

    async def _do(self, effect: Any) -> Any:
        if isinstance(effect, Send):
            assert self.data is not None
            msg = effect.msg
            while True:
                r = await self.data.send(effect.sid, msg, payload=effect.payload,
                                         into=effect.into)
                parse_reply(msg, r.fields)  # checked: EPROTO when it does not fit
                if effect.reply:
                    return r.fields
                crcs = r.fields.get("crcs")
                if crcs is None:
                    return r.nbytes
                try:  # a read of a checked object: verify what came
                    verify_read(msg, r.nbytes, effect.into if effect.into is not None
                                else r.payload, crcs)
                    return r.nbytes
                except ChecksumError:
                    msg = copied(msg)  # a write raced the sendfile? re-read once, copied
                    if msg is None:
                        raise
        if isinstance(effect, Parallel):
            results: list[Any] = [None] * len(effect.plans)

            async def one(i: int, sub: Plan[Any]) -> None:
                results[i] = await self.run(sub)

            await run_all([partial(one, i, sub) for i, sub in enumerate(effect.plans)])
            return results
        if isinstance(effect, MetaCall):
            assert self.meta is not None
            return await self.meta.request(effect.msg)
        if isinstance(effect, LocalRead):
            return await effect.local.read(effect.fd, effect.obj_off, effect.dests)
        if isinstance(effect, LocalFd):
            return await effect.local.fd(effect.replicas, effect.ino, effect.stripe, effect.cap)
        if isinstance(effect, Renew):
            await effect.owner.renew()
            return effect.owner.cap
        if isinstance(effect, Refresh):
            return await effect.owner.refresh_layout()
        if isinstance(effect, Reconnect):
            return None  # DataClient reconnects on the next call, looking servers up again
        if isinstance(effect, Sleep):
            await trio.sleep(effect.seconds)
            return None
        if isinstance(effect, ToDevice):
            effect.stager.copy(effect.slot, effect.dst_ptr, effect.src_off, effect.n)
            return None
        if isinstance(effect, DeviceWait):
            await trio.to_thread.run_sync(effect.stager.wait, effect.slot)
            return None
        if isinstance(effect, Call):
            return await effect.fn(*effect.args)
        if isinstance(effect, DeferClose):
            assert self.meta is not None
            return self.meta.defer_close(effect.fh, effect.generation)
        raise TypeError(f"not an effect: {effect!r}")
