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
the operation again on the trio driver. A :class:`~pfs.client.plan.Hedge` cannot race
here: its first request is sent alone with the hedge deadline as its timeout; a timeout
is a failed connection, so the operation goes to the trio driver, which tries the slow
server last (:class:`~pfs.client.health.Health`). A :class:`~pfs.client.plan.Report` is
left to that run too.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from pfs.client.direct import DirectData
from pfs.client.health import Health
from pfs.client.meta import MetaClient
from pfs.client.plan import (
    Call,
    DeferClose,
    DeviceWait,
    HandOver,
    Hedge,
    LocalFd,
    LocalRead,
    MetaCall,
    Parallel,
    Plan,
    Reconnect,
    Refresh,
    Renew,
    Report,
    Send,
    Sleep,
    ToDevice,
    resume,
)
from pfs.core import metrics
from pfs.core.checksums import ChecksumError, copied, verify_read
from pfs.core.messages.base import parse_reply

T = TypeVar("T")

# the effects this driver leaves to the trio driver (HandOver)
_HANDED_OVER = (Renew, Refresh, LocalFd, Call)


class BlockingDriver:
    def __init__(self, data: DirectData | None, meta: MetaClient,
                 health: Health | None = None) -> None:
        self.data = data  # None: data requests are the trio driver's
        self.meta = meta
        self.health = health
        # by effect type: one dict look-up per effect, no chain of tests
        self._handlers: dict[type, Callable[[Any], Any]] = {
            LocalRead: self._local_read, Send: self._send, MetaCall: self._meta_call,
            Parallel: self._parallel, Sleep: self._sleep, DeferClose: self._defer_close,
            ToDevice: self._to_device, DeviceWait: self._device_wait,
            Hedge: self._hedge, Reconnect: self._reconnect, Report: self._report,
            **{kind: self._hand_over for kind in _HANDED_OVER}}

    def run(self, plan: Plan[T]) -> T:
        send = plan.send
        do = self._do
        # None: a driver for plans that make no metadata call (tests of data plans)
        meta = getattr(self.meta, "request_blocking", None)
        try:
            effect = send(None)
            while True:
                try:
                    # a metadata call (most plans are one) without the look-up of _do
                    value = (meta(effect.msg) if type(effect) is MetaCall and meta is not None
                             else do(effect))
                except OSError as exc:
                    effect = plan.throw(exc)
                else:
                    effect = send(value)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            plan.close()  # a plan left suspended (HandOver) runs its cleanup now

    def run_step(self, step: Any, done: Callable[[Any, Any], Any] | None,
                 general: Callable[..., Plan[T]], *args: Any) -> T | None:
        """Carry out a plan's step (:func:`pfs.client.plan.read_step`, ``write_step``)
        here; ``done(step, result)`` finishes it. When it fails, the general plan
        ``general(*args)`` goes on from the failure (:func:`pfs.client.plan.resume`)."""
        try:
            if type(step) is LocalRead:  # the commonest step, carried out inline
                result = step.local.read_blocking(step.fd, step.obj_off, step.dests)
            else:
                result = self._do(step)
        except OSError as exc:
            return self.run(resume(general(*args), step, exc))
        if done is not None:
            done(step, result)
        return None

    def _do(self, effect: Any) -> Any:
        try:
            handler = self._handlers[type(effect)]
        except KeyError:
            raise TypeError(f"not an effect: {effect!r}") from None
        return handler(effect)

    def _local_read(self, effect: LocalRead) -> list[int]:
        return effect.local.read_blocking(effect.fd, effect.obj_off, effect.dests)  # type: ignore[no-any-return]

    def _send(self, effect: Send, timeout: float | None = None) -> Any:
        if self.data is None or type(effect.into) is list or type(effect.payload) is list:
            raise HandOver("scattered requests are the trio driver's")
        msg = effect.msg
        timed = self.health is not None and msg.method == "read"
        t0 = time.monotonic() if timed else 0.0
        while True:
            fields, n = self.data.send(effect.sid, msg, payload=effect.payload,
                                       into=effect.into, timeout=timeout)
            parse_reply(msg, fields)  # checked: EPROTO when it does not fit
            if effect.reply:
                return fields
            crcs = fields.get("crcs")
            if crcs is not None:
                try:  # a read of a checked object: verify what came
                    verify_read(msg, n, effect.into, crcs)
                except ChecksumError:
                    metrics.checksum_failure("network")
                    msg = copied(msg)  # a write raced the sendfile? re-read once, copied
                    if msg is None:
                        raise
                    continue
            if timed:
                assert self.health is not None
                self.health.observe(effect.sid, msg.len, time.monotonic() - t0)  # type: ignore[attr-defined]
            return n

    def _hedge(self, effect: Hedge) -> tuple[int, None]:
        """The first request alone, with the hedge deadline as its timeout (no race in
        one thread); its failure is raised, as the plan expects of such a driver."""
        return self._send(effect.first, effect.after), None

    def _reconnect(self, effect: Reconnect) -> None:
        if self.health is not None:
            self.health.failed(effect.sid)  # the trio driver's run tries it last
        raise HandOver("Reconnect")

    def _report(self, effect: Report) -> None:
        return None  # the trio driver's run (after the Reconnect) reports it

    def _meta_call(self, effect: MetaCall) -> Any:
        return self.meta.request_blocking(effect.msg)

    def _parallel(self, effect: Parallel) -> list[Any]:
        return [self.run(sub) for sub in effect.plans]

    def _sleep(self, effect: Sleep) -> None:
        time.sleep(effect.seconds)

    def _defer_close(self, effect: DeferClose) -> bool:
        return self.meta.defer_close(effect.fh, effect.generation, effect.unwritten)

    def _to_device(self, effect: ToDevice) -> None:
        effect.stager.copy(effect.slot, effect.dst_ptr, effect.src_off, effect.n)

    def _device_wait(self, effect: DeviceWait) -> None:
        effect.stager.wait(effect.slot)

    def _hand_over(self, effect: Any) -> None:
        raise HandOver(type(effect).__name__)
