"""The trio driver: carries plans (:mod:`pfs.client.plan`) out with many requests in
flight, for ``AsyncClient``, the FUSE mount and the sync client's larger requests.

Requests go over :class:`~pfs.client.data.DataClient`'s connections, short-circuit
reads to the client's engine (:mod:`pfs.client.shortcircuit`), device destinations through a
pinned staging buffer (:mod:`pfs.client.device`), metadata requests over the ``MetaClient``; a plan's :class:`~pfs.client.plan.Parallel` sub-plans run as tasks of a
nursery, and the first ``OSError`` among them is raised as itself. A
:class:`~pfs.client.plan.Hedge` races two replicas (the second's reply into a spare
buffer, copied over when it wins); each read's time feeds the client's
:class:`~pfs.client.health.Health`, and a :class:`~pfs.client.plan.Report` goes to the
metaserver in the background.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from pfs.client.data import DataClient, run_all
from pfs.client.health import Health
from pfs.client.plan import (
    Call,
    DeferClose,
    DeviceWait,
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
)
from pfs.client.verify import streamed, verify_read
from pfs.core import metrics
from pfs.core.checksums import ChecksumError, copied
from pfs.core.messages import meta as M
from pfs.core.messages.base import parse_reply
from pfs.core.wire.rpc import HOLD

if TYPE_CHECKING:  # annotations only: MetaClient runs its plans on this driver
    from pfs.client.meta import MetaClient

T = TypeVar("T")
log = logging.getLogger(__name__)

# seconds a local data server has to hand over a descriptor (an open and a sendmsg)
# before the read goes over the network instead
LOCAL_FD_TIMEOUT = 1.0


def spare_like(into: Any) -> Any:
    """A buffer (or list of buffers) of the same shape as ``into``, for a hedged read."""
    if isinstance(into, list):
        return [memoryview(bytearray(len(d))) for d in into]
    return memoryview(bytearray(len(into)))


def copy_into(dest: Any, src: Any, n: int) -> None:
    """The first ``n`` bytes of ``src`` into ``dest`` (same shapes, as spare_like)."""
    if not isinstance(dest, list):
        dest[:n] = src[:n]
        return
    for d, s in zip(dest, src, strict=True):
        k = min(n, len(d))
        d[:k] = s[:k]
        n -= k
        if n <= 0:
            break


class TrioDriver:
    def __init__(self, data: DataClient | None = None, meta: MetaClient | None = None,
                 health: Health | None = None, nursery: trio.Nursery | None = None) -> None:
        self.data = data
        self.meta = meta
        self.health = health
        self._nursery = nursery  # where reports to the metaserver run
        self._answered: dict[str, float] = {}  # when each server last answered a read
        # the hedge deadlines (cancel scopes) of the reads waiting for each server, and
        # one read's deadline each: moved on by the server's answers (``_progress``)
        self._waiting: dict[str, dict[trio.CancelScope, float]] = {}

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
                        hold = HOLD.get()
                        if hold is not None:  # only a metaserver call may hold the loop
                            hold.waits()
                        value = await self._do(effect)
                except OSError as e:
                    exc = e
        finally:
            plan.close()

    async def _send(self, effect: Send, held: bool = False) -> Any:
        """``effect`` carried out; ``held``: the caller holds a place among the requests
        in flight (``DataClient.slots``)."""
        data = self.data
        assert data is not None
        if not held:
            async with data.slots:
                return await self._send(effect, True)
        msg = effect.msg
        timed = self.health is not None and msg.method == "read"
        # timed from here, not from before the wait for a place: that wait is this
        # client's queue, not the server's time
        t0 = time.monotonic() if timed else 0.0
        while True:
            stream = streamed(msg, effect.into)
            r = await data.send(effect.sid, msg, payload=effect.payload,
                                into=effect.into, held=True,
                                on_reply=None if stream is None else stream.on_reply)
            parse_reply(msg, r.fields)  # checked: EPROTO when it does not fit
            if effect.reply:
                return r.fields
            crcs = r.fields.get("crcs")
            if crcs is not None:
                try:  # a read of a checked object: verify what came
                    if stream is not None and stream.started:  # as it was received
                        stream.finish()
                    else:
                        await verify_read(msg, r.nbytes, effect.into if effect.into is not None
                                          else r.payload, crcs)
                except ChecksumError:
                    metrics.checksum_failure("network")
                    msg = copied(msg)  # a write raced the sendfile? re-read once, copied
                    if msg is None:
                        raise
                    continue
            if timed:
                assert self.health is not None
                # by the size asked (a hole's short reply is no smaller request), from
                # when the server answered its previous read if that came later: the
                # time it took for this one, not for those queued before it
                now = time.monotonic()
                since = max(t0, self._answered.get(effect.sid, t0))
                self._answered[effect.sid] = now
                self.health.observe(effect.sid, msg.len, now - since)  # type: ignore[attr-defined]
                self._progress(effect.sid)
            return r.nbytes

    def _progress(self, sid: str) -> None:
        """``sid`` answered a read: the hedge deadlines of the reads waiting for it run
        again from now (it is busy, not stalled)."""
        waiting = self._waiting.get(sid)
        if waiting:
            now = trio.current_time()
            for scope, after in waiting.items():
                if scope.deadline < now + after:
                    scope.deadline = now + after

    async def _hedge(self, h: Hedge) -> tuple[Any, list[OSError | None] | None]:
        """``h.first`` within its deadline (no task, no nursery: the common case costs
        what a plain send does); past it, the first again and ``h.second`` at once, the
        first good answer wins and the other is cancelled. The first's request is sent
        again rather than kept: trio cannot detach a call running in this task, and a
        task per read would cost several times the request (measured ~100 us here).
        A failure of one while the other runs waits for the other.

        The deadline (``h.after``, one read's) runs from when the request goes out (a
        place among the client's requests in flight taken), and again from each answer
        the server gives another read meanwhile: a bulk reader (a checkpoint load)
        keeps dozens of reads queued, each waiting for those before it at the server,
        and hedging them by one read's deadline from the call sent duplicates of most
        of a load to a busy cluster. A stalled server answers nothing: its reads are
        hedged one deadline after its last answer."""
        assert self.data is not None
        sid = h.first.sid
        try:
            async with self.data.slots:
                with trio.move_on_after(h.after) as scope:
                    waiting = self._waiting.setdefault(sid, {})
                    waiting[scope] = h.after
                    try:
                        return await self._send(h.first, True), None
                    finally:
                        del waiting[scope]
        except OSError as exc:
            return None, [exc, None]
        log.debug("hedging a read: %s gave no answer in %.3f s, asking %s too",
                  h.first.sid, h.after, h.second.sid)
        errors: list[OSError | None] = [None, None]
        won: list[tuple[int, Any]] = []
        spare = spare_like(h.second.into) if h.second.into is not None else None
        second = Send(h.second.sid, h.second.msg, h.second.payload, spare)

        async def attempt(i: int, effect: Send, nursery: trio.Nursery) -> None:
            try:
                value = await self._send(effect)
            except OSError as exc:
                errors[i] = exc
            else:
                if not won:
                    won.append((i, value))
                    nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attempt, 0, h.first, nursery)
            nursery.start_soon(attempt, 1, second, nursery)
        metrics.hedged(bool(won) and won[0][0] == 1)
        if not won:
            return None, errors
        i, value = won[0]
        if i == 1:
            if spare is not None:
                copy_into(h.second.into, spare, value)
            if self.health is not None:
                self.health.failed(h.first.sid)  # lost a race: asked last for a while
        return value, None

    async def _local_fd(self, effect: LocalFd) -> int | None:
        """A descriptor from a local server, within LOCAL_FD_TIMEOUT: a hung local
        server (asked over a Unix socket, with no timeout of its own) must not stall the
        read, which then goes over the network, hedged. Servers that failed lately are
        not asked. A timeout penalises nobody: which replica hung is not known here, and
        the network read's hedge finds out."""
        health = self.health
        if health is None:
            return await effect.local.fd(effect.replicas, effect.ino, effect.stripe,  # type: ignore[no-any-return]
                                         effect.cap)
        replicas = tuple(s for s in effect.replicas if not health.penalised(s))
        if not replicas:
            return None
        with trio.move_on_after(LOCAL_FD_TIMEOUT):
            return await effect.local.fd(replicas, effect.ino, effect.stripe,  # type: ignore[no-any-return]
                                         effect.cap)
        log.info("no descriptor from local data server(s) %s in %g s: reading over the "
                 "network", ", ".join(replicas), LOCAL_FD_TIMEOUT)
        return None

    def _report(self, effect: Report) -> None:
        if self.meta is None or self._nursery is None or \
                (self.health is not None and not self.health.report_due(effect.sid)):
            return
        self._nursery.start_soon(self._send_report, effect, name="pfs-report-server")

    async def _send_report(self, effect: Report) -> None:
        assert self.meta is not None
        try:
            r = await self.meta.request(M.ReportServer(sid=effect.sid, errno=effect.errno))
            log.info("reported data server %s (errno %d): now %s", effect.sid,
                     effect.errno, r.state)
        except OSError as exc:  # the metaserver is away: the lease will tell it
            log.debug("report of data server %s failed: %s", effect.sid, exc)

    async def _do(self, effect: Any) -> Any:
        if isinstance(effect, Send):
            return await self._send(effect)
        if isinstance(effect, Hedge):
            return await self._hedge(effect)
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
            return await self._local_fd(effect)
        if isinstance(effect, Renew):
            await effect.owner.renew()
            return effect.owner.cap
        if isinstance(effect, Refresh):
            return await effect.owner.refresh_layout()
        if isinstance(effect, Reconnect):
            if self.health is not None:
                self.health.failed(effect.sid)  # tried last for a while
            return None  # DataClient reconnects on the next call, looking servers up again
        if isinstance(effect, Report):
            self._report(effect)
            return None
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
            return self.meta.defer_close(effect.fh, effect.generation, effect.unwritten)
        raise TypeError(f"not an effect: {effect!r}")
