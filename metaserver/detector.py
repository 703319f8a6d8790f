"""Fast failure detection: what the metaserver does when a client (or its own data
plane) says a data server refused a connection. It believes nobody blindly: it probes
the server itself (a fresh connection and a ``statfs``, bounded by ``probe_timeout``),
at most once per ``min_gap`` seconds per server and one probe at a time, then:

- refused (or reset, unreachable): the server is down now (:meth:`Registry.refused`),
  out of placement until its next heartbeat;
- connected but no answer in time (a hung process: the kernel still accepts): suspect;
  its lease takes it out within a few seconds;
- answered: nothing (the client's view was stale, or the network between them broke).
"""
from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable

import trio

from pfs.core.messages import data as D
from pfs.core.wire.rpc import RpcClient
from pfs.metaserver.registry import Registry, State

log = logging.getLogger(__name__)

# what a probe's failure must be for the server to count as down at once
REFUSED_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH,
                            errno.ENETUNREACH, errno.ECONNABORTED, errno.EPIPE})

# opens an authenticated connection to host:port in the given nursery
Connect = Callable[[trio.Nursery, str, int], Awaitable[RpcClient]]


class Detector:
    def __init__(self, registry: Registry, connect: Connect, *,
                 probe_timeout: float = 1.0, min_gap: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._connect = connect
        self.probe_timeout = probe_timeout
        self._min_gap = min_gap
        self._clock = clock
        self._last: dict[str, float] = {}  # sid -> clock() of its last probe
        self._running: dict[str, trio.Event] = {}

    def due(self, sid: str) -> bool:
        """Whether a report of ``sid`` starts a probe now (none running, none lately)."""
        last = self._last.get(sid)
        return sid not in self._running and (last is None
                                             or self._clock() - last >= self._min_gap)

    async def report(self, sid: str) -> State:
        """A connection to ``sid`` failed for someone: probe it (rate-limited; a report
        while a probe runs waits for that one) and return its state after."""
        running = self._running.get(sid)
        if running is not None:
            with trio.move_on_after(self.probe_timeout * 2):
                await running.wait()
        elif self.due(sid):
            await self._probe(sid)
        return self._registry.state(sid)

    async def _probe(self, sid: str) -> None:
        addr = self._registry.known_address(sid)
        if addr is None:
            return
        done = self._running[sid] = trio.Event()
        self._last[sid] = self._clock()
        try:
            outcome = await self.probe(*addr)
        finally:
            del self._running[sid]
            done.set()
        if outcome == "refused":
            if self._registry.refused(sid):
                log.warning("data server %s at %s:%d refused a probe: down (out of "
                            "placement until its next heartbeat)", sid, *addr)
        elif outcome == "unanswered":
            self._registry.unanswered(sid)
            log.warning("data server %s at %s:%d did not answer a probe in %g s: suspect",
                        sid, *addr, self.probe_timeout)

    async def probe(self, host: str, port: int) -> str:
        """``"ok"``, ``"refused"`` or ``"unanswered"``: one fresh connection and a
        ``statfs``, within ``probe_timeout``."""
        outcome = "unanswered"  # what the deadline leaves
        with trio.move_on_after(self.probe_timeout):
            try:
                async with trio.open_nursery() as nursery:
                    client = await self._connect(nursery, host, port)
                    try:
                        await client.request(D.Statfs(), timeout=self.probe_timeout)
                    finally:
                        client.close()
                outcome = "ok"
            except* OSError as group:
                code = getattr(group.exceptions[0], "errno", None)
                outcome = ("refused" if code in REFUSED_ERRNOS
                           else "unanswered" if code == errno.ETIMEDOUT
                           else "ok")  # it answered, if only to refuse us
        return outcome
