"""Bringing a stale chain member back: the metaserver's side of catch-up.

A member taken out of a chain (metaserver/chains.py) stays *stale*. Once it is up again
(registered, heartbeating), this task puts it back (``PARALLEL`` chains at once, each
copy at the repair rate) in three steps: it *joins* the chain at the tail (a new
version: writes are forwarded to it from now on, while it still serves nothing), the
chain's head copies every object of the chain to it (``catch_up``, dataserver/chain.py:
each object under its whole-object lock, so the copy and the forwarded writes land in
the head's order), then it is marked caught up and serves again (its next heartbeat tells it). A failure leaves it stale and
joining; the next pass tries again. The state is the chain table's, so a metaserver
restart midway resumes. Repair (metaserver/repair.py: a new member for a lost one, a
drain, a rebalance) joins another server as a stale member; the same steps bring it in,
then the member it replaces leaves (``ChainTable.retire``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

from pfs.core.messages import data as D
from pfs.metaserver.chains import Chain, ChainTable
from pfs.metaserver.commit import CommitQueue
from pfs.metaserver.dataplane import DataPlane
from pfs.metaserver.store import Store, WriteTxn

log = logging.getLogger(__name__)

INTERVAL = 2.0  # seconds between passes over the stale members
COPY_TIMEOUT = 3600.0  # seconds one chain's copy may take
PROBE_TIMEOUT = 2.0  # seconds a stale member has to answer before it joins again
PARALLEL = 4  # chains copied at once (each at the repair rate)


class CatchUp:
    def __init__(self, store: Store, commit: CommitQueue, chains: ChainTable,
                 alive: Callable[[str], bool], dataplane: DataPlane,
                 interval: float = INTERVAL, rate: int = 0) -> None:
        self.store = store
        self.commit = commit
        self.chains = chains
        self.alive = alive
        self.dataplane = dataplane
        self.interval = interval
        self.rate = rate  # bytes/s a head copies at most (0: unbounded)
        self.copying: dict[int, tuple[str, float]] = {}  # chain -> (target, since)
        self.objects = 0  # objects copied since this start
        self.chains_done = 0
        self.nbytes = 0  # bytes copied since this start, in self.seconds of copying
        self.seconds = 0.0
        self._wake = trio.Event()
        self._flight: set[tuple[int, str]] = set()  # (chain, member) being brought back

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                with trio.move_on_after(self.interval):
                    await self._wake.wait()
                self._wake = trio.Event()
                self.start_due(nursery)

    def start_due(self, nursery: trio.Nursery) -> int:
        """Start bringing back the stale members that are up, ``PARALLEL`` copies at
        most (each from its chain's head, at the rate); how many were started."""
        started = 0
        for cid, sid in self.due():
            if (cid, sid) in self._flight or len(self._flight) >= PARALLEL:
                continue
            self._flight.add((cid, sid))
            nursery.start_soon(self._one, cid, sid)
            started += 1
        return started

    def wake(self) -> None:
        """Pass now (repair joined a member)."""
        self._wake.set()

    def due(self) -> list[tuple[int, str]]:
        """(chain, member) pairs to bring back: stale members that are up."""
        with self.store.read() as txn:
            return [(c.cid, sid) for c in self.chains.scan(txn) for sid in c.stale
                    if self.alive(sid)]

    async def _one(self, cid: int, sid: str) -> None:
        try:
            await self.bring_back(cid, sid)
        except OSError as exc:
            log.warning("chain %d: catching %s up failed (%s); trying again later",
                        cid, sid, exc)
        finally:
            self._flight.discard((cid, sid))

    async def bring_back(self, cid: int, sid: str) -> None:
        # up by its last heartbeat is not enough (it may have died since): it answers
        if not await self.dataplane.probe(sid, PROBE_TIMEOUT):
            return
        def join(t: WriteTxn) -> Chain | None:
            # still stale here? (repair may have declared it lost meanwhile: gone)
            chain = self.chains.get(t, cid)
            if chain is None or sid not in chain.stale:
                return None
            return self.chains.add(t, cid, sid, caught_up=False)

        chain = await self.commit.mutate(join)
        if chain is None:
            return
        head = chain.members[0]
        if head == sid:  # no other member holds the chain's data: nothing to copy from
            log.error("chain %d: %s is its only member, stale; not served", cid, sid)
            return
        since = trio.current_time()
        self.copying[cid] = (sid, since)
        try:
            reply = await self.dataplane.request(
                head, partial(D.CatchUp, chain=cid, ver=chain.version, target=sid,
                              rate=self.rate or None),
                COPY_TIMEOUT)
        except OSError:
            # out again, still stale: writes must not wait on a member that failed
            await self.commit.mutate(lambda t: self.chains.remove(t, cid, sid))
            raise
        finally:
            self.copying.pop(cid, None)
        await self.commit.mutate(lambda t: self.chains.caught_up(t, cid, sid))
        # a replacement (repair, drain, rebalance): the member it replaces leaves now
        await self.commit.mutate(lambda t: self.chains.retire(t, cid))
        self.objects += reply.n
        self.nbytes += reply.nbytes
        self.seconds += trio.current_time() - since
        self.chains_done += 1
        log.info("chain %d: %s caught up from %s (%d objects)", cid, sid, head, reply.n)
