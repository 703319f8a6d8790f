"""Repair: chains kept at their replica count, lost servers replaced, servers drained,
new servers given a fair share (docs/architecture.md "Repair").

Each pass plans membership changes in the chain table (metaserver/chains.py) and leaves
the copying to catch-up (metaserver/catchup.py), which copies to every joining member:

- a server down for ``lost_after`` seconds, or declared lost (``pfs admin lost``), is
  *lost*: out of every chain for good (``gone``: never caught up again, told it is stale);
- a chain short of its count (``Chain.short``) gets a new member: it *joins* (writes are
  forwarded to it, it serves nothing), the head copies the chain to it at
  ``repair_rate``, verified against the head's checksums, then it serves;
- a member on a draining server, or on the most loaded one during a rebalance, is
  *replaced*: the new member joins, and the old one leaves once it is caught up
  (``ChainTable.retire``), so the count never drops during a move.

Every step is one transaction on the chain table: a metaserver killed midway resumes
where it was (a joining member is copied again from the start; ``install`` rewrites it).
At most ``MAX_MOVES`` chains are joining at once, so a drain or rebalance does not
pile up work; the rate bounds each copy.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from pfs.metaserver.catchup import CatchUp
from pfs.metaserver.chains import Chain, ChainTable
from pfs.metaserver.commit import CommitQueue
from pfs.metaserver.registry import Registry
from pfs.metaserver.store import Store, Txn

log = logging.getLogger(__name__)

MAX_MOVES = 4  # chains joining a new member at once


class Repair:
    def __init__(self, store: Store, commit: CommitQueue, chains: ChainTable,
                 registry: Registry, catchup: CatchUp,
                 servers: Callable[[Txn], dict[str, dict[str, Any]]], *,
                 lost_after: float, interval: float = 2.0) -> None:
        self.store = store
        self.commit = commit
        self.chains = chains
        self.registry = registry
        self.catchup = catchup
        self.servers = servers  # the durable server records (with "draining")
        self.lost_after = lost_after
        self.interval = interval
        self.down_since: dict[str, float] = {}
        self.lost: set[str] = set()  # declared or timed out since this start
        self.rebalancing = False
        self._stuck: set[int] = set()  # chains told to have no server to move to
        self.wake = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(self.interval):
                await self.wake.wait()
            self.wake = trio.Event()
            try:
                await self.pass_once()
            except OSError as exc:
                log.warning("repair pass failed (%s); trying again", exc)

    # -- requests ---------------------------------------------------------------
    async def declare_lost(self, sid: str) -> int:
        """``sid`` is lost for good: out of every chain it was in; how many."""
        self.lost.add(sid)
        with self.store.read() as txn:
            cids = [c.cid for c in self.chains.scan(txn)
                    if sid in (*c.members, *c.stale, *c.leaving)]
        n = 0
        for cid in cids:
            try:
                await self.commit.mutate(partial(self.chains.lose, cid=cid, sid=sid))
                n += 1
            except OSError as exc:  # its last member: kept, the data is nowhere else
                log.error("chain %d: %s", cid, exc)
        log.warning("data server %s lost: out of %d chains, their replicas to be restored",
                    sid, n)
        self.wake.set()
        return n

    def rebalance(self) -> None:
        self.rebalancing = True
        self.wake.set()

    # -- one pass ---------------------------------------------------------------
    async def pass_once(self) -> None:
        await self._find_lost()
        with self.store.read() as txn:
            chains = self.chains.scan(txn)
            draining = {sid for sid, rec in self.servers(txn).items()
                        if rec.get("draining")}
        for c in chains:
            # a restart between caught-up and retire
            if c.leaving and not self.chains.joining(c) and \
                    len(c.members) - len(c.leaving) >= c.want:
                await self.commit.mutate(partial(self.chains.retire, cid=c.cid))
            # a draining server taken out of a chain is not brought back: replaced
            for sid in c.stale:
                if sid in draining and sid not in c.members:
                    await self.commit.mutate(partial(self.chains.lose, cid=c.cid, sid=sid))
        with self.store.read() as txn:
            chains = self.chains.scan(txn)
        budget = MAX_MOVES - sum(1 for c in chains if self.chains.joining(c))
        load = self._load(chains)
        for c in chains:
            if budget <= 0:
                return
            if self.chains.joining(c):
                continue
            old = next((m for m in c.members if m in draining and m not in c.leaving), None)
            if c.short == 0 and old is None:
                continue
            new = self._pick(c, load)
            if new is None:
                if c.cid not in self._stuck:  # once, not every pass
                    log.warning("chain %d: no server to place a replica on (%s)", c.cid,
                                f"draining {old}" if old else f"{c.short} short")
                    self._stuck.add(c.cid)
                continue
            self._stuck.discard(c.cid)
            await self._move(c, old, new, load)
            budget -= 1
        if self.rebalancing:
            self.rebalancing = await self._rebalance(chains, load, budget)

    async def _find_lost(self) -> None:
        now = trio.current_time()
        with self.store.read() as txn:
            held = {s for c in self.chains.scan(txn) for s in (*c.members, *c.stale)}
        for sid in held:
            if self.registry.address(sid) is not None:
                self.down_since.pop(sid, None)
                continue
            since = self.down_since.setdefault(sid, now)
            if self.lost_after > 0 and now - since >= self.lost_after:
                log.warning("data server %s down for %.0f s: lost", sid, now - since)
                await self.declare_lost(sid)
                self.down_since.pop(sid, None)

    def _load(self, chains: list[Chain]) -> Counter[str]:
        load: Counter[str] = Counter({sid: 0 for sid in self.registry.placeable()})
        for c in chains:
            load.update(m for m in c.members if m not in c.leaving)
        return load

    def _pick(self, c: Chain, load: Counter[str]) -> str | None:
        """A server for a new replica of ``c``: placeable, not in it, in a failure
        domain its staying members are not in where possible, the least loaded. Never
        one that left it for good (lost, drained): its old replica is no member's."""
        places = self.registry.placeable()
        taken = set(c.members) | set(c.stale) | set(c.gone)
        domains = {places[m].domain for m in c.members if m in places}
        free = [s for s in places if s not in taken]
        if not free:
            return None
        return min(free, key=lambda s: (places[s].domain in domains, load[s],
                                        -places[s].free, s))

    async def _move(self, c: Chain, old: str | None, new: str, load: Counter[str]) -> None:
        await self.commit.mutate(
            lambda t: self.chains.replace_member(t, c.cid, old, new))
        load[new] += 1
        if old is not None:
            load[old] -= 1
        log.info("chain %d: %s joins%s", c.cid, new, f" in place of {old}" if old else "")
        self.catchup.wake()

    async def _rebalance(self, chains: list[Chain], load: Counter[str], budget: int
                         ) -> bool:
        """Move memberships from the most to the least loaded placeable servers; True
        while moves remain."""
        places = self.registry.placeable()
        busy = {c.cid for c in chains if self.chains.joining(c) or c.leaving}
        while budget > 0:
            ranked = sorted(places, key=lambda s: (load[s], s))
            if len(ranked) < 2 or load[ranked[-1]] - load[ranked[0]] <= 1:
                return bool(busy)
            hi, lo = ranked[-1], ranked[0]
            cand = [c for c in chains if c.cid not in busy and hi in c.members
                    and lo not in c.members and lo not in c.stale and lo not in c.gone]
            if not cand:
                return bool(busy)
            # keep failure domains apart: prefer a chain that lo's domain is new to
            c = min(cand, key=lambda c: (places[lo].domain in
                                         {places[m].domain for m in c.members
                                          if m in places and m != hi}, c.cid))
            await self._move(c, hi, lo, load)
            busy.add(c.cid)
            budget -= 1
        return True

    # -- progress ---------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self.store.read() as txn:
            chains = self.chains.scan(txn)
            stored = self.servers(txn)
        now = trio.current_time()
        members: Counter[str] = Counter()
        for c in chains:
            members.update(c.members)
        copying = [{"chain": cid, "target": target, "seconds": round(now - since, 1)}
                   for cid, (target, since) in self.catchup.copying.items()]
        return {
            "chains": len(chains),
            "short": sum(1 for c in chains if c.short),
            "joining": [{"chain": c.cid, "members": list(c.members),
                         "joining": list(self.chains.joining(c)),
                         "leaving": list(c.leaving)}
                        for c in chains if self.chains.joining(c) or c.leaving],
            "copying": copying,
            "stale": {str(c.cid): list(c.stale) for c in chains if c.stale},
            "objects_copied": self.catchup.objects,
            "bytes_copied": self.catchup.nbytes,
            "copy_rate": (round(self.catchup.nbytes / self.catchup.seconds)
                          if self.catchup.seconds > 0 else 0),
            "chains_copied": self.catchup.chains_done,
            "rate": self.catchup.rate,
            "draining": {sid: members[sid] for sid, rec in stored.items()
                         if rec.get("draining")},
            "memberships": dict(members),
            "down": {sid: round(now - t, 1) for sid, t in self.down_since.items()},
            "lost_after": self.lost_after,
            "lost": sorted(self.lost),
            "rebalancing": self.rebalancing,
        }
