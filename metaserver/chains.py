"""The chain table: which data servers hold a stripe's replicas, in write order.

A file's layout names one chain per stripe (``layout["chains"]``); a chain is an ordered
list of data servers, head first, and a version (key ``H``, metaserver/keys.py). A
client writes to the head only; each member applies a write and forwards it to the next;
the tail's acknowledgement travels back (docs/architecture.md "Replication"). Chains are
shared: placement reuses the chain of the same ordered members, so a lost server bumps
the version of the few chains it was in, not of every file it held.

Every membership change bumps the chain's version. A member taken out (dead or hung,
reported by the member before it) is kept as *stale*: it missed writes, so it serves
nothing of the chain until it has been caught up (a copy from the head) and put back.
The table is all here: ``remove``, ``add`` and ``set_members`` are what repair builds
on. Called inside the metaserver's write transactions (group commit).
"""
from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from pfs.metaserver import keys as K
from pfs.metaserver.store import Txn

log = logging.getLogger(__name__)

DECODED_MAX = 1 << 16  # decoded chains kept (a cluster has far fewer)


@dataclass(frozen=True, slots=True)
class Chain:
    cid: int
    version: int
    members: tuple[str, ...]  # head first; the ones that serve
    stale: tuple[str, ...] = ()  # taken out, not caught up: they serve nothing of it
    # repair (metaserver/repair.py): the replica count it keeps (0: as many as members
    # and stale ones), members to drop once the joining ones are caught up (drain,
    # rebalance), and servers out for good (lost, drained): never brought back, told
    # they are stale (they serve nothing of it), reached by deletes
    want: int = 0
    leaving: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()

    def to_rec(self) -> dict[str, Any]:
        return {"version": self.version, "members": list(self.members),
                "stale": list(self.stale), "want": self.want,
                "leaving": list(self.leaving), "gone": list(self.gone)}

    @classmethod
    def from_rec(cls, cid: int, rec: dict[str, Any]) -> Chain:
        members, stale = tuple(rec["members"]), tuple(rec.get("stale", ()))
        return cls(cid, int(rec["version"]), members, stale,
                   int(rec.get("want") or len(dict.fromkeys((*members, *stale)))),
                   tuple(rec.get("leaving", ())), tuple(rec.get("gone", ())))

    @property
    def short(self) -> int:
        """Replicas missing: ``want`` less the members that stay and the stale ones
        still expected back."""
        staying = [m for m in self.members if m not in self.leaving]
        pending = [s for s in self.stale if s not in self.members]
        return max(0, self.want - len(staying) - len(pending))

    def to_wire(self) -> list[Any]:
        return [self.cid, self.version, list(self.members)]


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class ChainTable:
    """The chains in a store, with an index of members -> chain id for placement
    (rebuilt from the store on first use; every hit is checked against the store, so an
    entry of a transaction that did not commit is harmless)."""

    def __init__(self) -> None:
        self._by_members: dict[tuple[str, ...], int] | None = None
        # decoded chains by id, each with the stored bytes it was decoded from: a hit
        # is a read of the record and a comparison of bytes (every create and unlink
        # reads each of its stripes' chains, a handful of them, several times). Never
        # stale: the record is read each time, only its decoding is saved.
        self._decoded: dict[int, tuple[bytes, Chain]] = {}

    # -- records ---------------------------------------------------------------
    def get(self, txn: Txn, cid: int) -> Chain | None:
        raw = txn.get(K.chain(cid))
        if raw is None:
            return None
        hit = self._decoded.get(cid)
        if hit is not None and hit[0] == raw:
            return hit[1]
        chain = Chain.from_rec(cid, msgpack.unpackb(raw, raw=False))
        if len(self._decoded) >= DECODED_MAX:
            self._decoded.clear()
        self._decoded[cid] = (bytes(raw), chain)
        return chain

    def _put(self, txn: Txn, chain: Chain) -> None:
        txn.put(K.chain(chain.cid), _pack(chain.to_rec()))
        if self._by_members is not None:
            self._by_members[chain.members] = chain.cid

    def _need(self, txn: Txn, cid: int) -> Chain:
        chain = self.get(txn, cid)
        if chain is None:
            raise OSError(errno.ENOENT, f"no chain {cid}")
        return chain

    def advance(self, txn: Txn, by: int) -> int:
        """Every chain's version moved on by ``by``, members unchanged: a restored store
        (metaserver/backup.py) must be newer than any version a data server saw since.
        How many chains."""
        chains = self.scan(txn)
        for chain in chains:
            self._put(txn, replace(chain, version=chain.version + by))
        return len(chains)

    def scan(self, txn: Txn) -> list[Chain]:
        return [Chain.from_rec(K.read_u64(k, 1), msgpack.unpackb(v, raw=False))
                for k, v in list(txn.scan(K.CHAIN))]

    # -- placement -------------------------------------------------------------
    def make_or_reuse(self, txn: Txn, members: tuple[str, ...]) -> Chain:
        """The chain of exactly these members in this order (made when there is none)."""
        if self._by_members is None:
            self._by_members = {c.members: c.cid for c in self.scan(txn)}
        cid = self._by_members.get(members)
        if cid is not None:
            chain = self.get(txn, cid)
            if chain is not None and chain.members == members:
                return chain
        raw = txn.get(K.counter(b"nchain"))
        cid = (K.read_u64(raw) if raw else 0) + 1
        txn.put(K.counter(b"nchain"), K.u64(cid))
        chain = Chain(cid, 1, members, want=len(members))
        self._put(txn, chain)
        return chain

    # -- membership changes: each bumps the version -----------------------------
    def remove(self, txn: Txn, cid: int, sid: str) -> Chain:
        """Take ``sid`` out of chain ``cid`` (it is dead, hung or lost): it becomes stale.
        A member already out changes nothing; the last member is never taken out (its
        data would be nowhere), EBUSY."""
        chain = self._need(txn, cid)
        if sid not in chain.members:
            return chain
        if len(chain.members) == 1:
            raise OSError(errno.EBUSY, f"chain {cid}: {sid} is its last member")
        new = replace(chain, version=chain.version + 1,
                      members=tuple(m for m in chain.members if m != sid),
                      stale=tuple(dict.fromkeys((*chain.stale, sid))))
        self._put(txn, new)
        log.warning("chain %d: %s taken out, version %d, members %s", cid, sid,
                    new.version, list(new.members))
        return new

    def add(self, txn: Txn, cid: int, sid: str, caught_up: bool = True) -> Chain:
        """Put ``sid`` at the tail of chain ``cid``. ``caught_up`` False: it *joins*
        (writes are forwarded to it, it stays stale, serving nothing, until
        :meth:`caught_up`: the copy of the chain's objects goes on meanwhile)."""
        chain = self._need(txn, cid)
        if sid in chain.members:
            return self.caught_up(txn, cid, sid) if caught_up else chain
        stale = chain.stale if not caught_up else tuple(s for s in chain.stale if s != sid)
        if not caught_up and sid not in stale:
            stale = (*stale, sid)
        new = replace(chain, version=chain.version + 1, members=(*chain.members, sid),
                      stale=stale, gone=tuple(g for g in chain.gone if g != sid))
        self._put(txn, new)
        log.info("chain %d: %s %s, version %d", cid, sid,
                 "added" if caught_up else "joining", new.version)
        return new

    def caught_up(self, txn: Txn, cid: int, sid: str) -> Chain:
        """``sid``, a member, holds every object of chain ``cid`` now: it serves again.
        (No new version: the members did not change.)"""
        chain = self._need(txn, cid)
        if sid not in chain.stale or sid not in chain.members:
            return chain
        new = replace(chain, stale=tuple(s for s in chain.stale if s != sid))
        self._put(txn, new)
        log.info("chain %d: %s caught up", cid, sid)
        return new

    def joining(self, chain: Chain) -> tuple[str, ...]:
        """Members still being caught up (stale: they serve nothing yet)."""
        return tuple(m for m in chain.members if m in chain.stale)

    def set_members(self, txn: Txn, cid: int, members: tuple[str, ...]) -> Chain:
        """Any other change (repair, drain): the new members, head first; members
        dropped become stale."""
        chain = self._need(txn, cid)
        if not members:
            raise OSError(errno.EINVAL, f"chain {cid}: no members")
        if members == chain.members:
            return chain
        dropped = [m for m in chain.members if m not in members]
        new = replace(chain, version=chain.version + 1, members=members,
                      stale=tuple(s for s in dict.fromkeys((*chain.stale, *dropped))
                                  if s not in members))
        self._put(txn, new)
        return new

    def stale_on(self, txn: Txn, sid: str) -> list[Chain]:
        """The chains ``sid`` was taken out of and is not back in (gone for good
        included: it serves nothing of them)."""
        return [c for c in self.scan(txn) if sid in c.stale or sid in c.gone]

    # -- repair: each step a transaction, so a restart resumes (repair.py) -------
    def replace_member(self, txn: Txn, cid: int, old: str | None, new: str) -> Chain:
        """``new`` joins chain ``cid`` (not caught up: writes reach it, it serves
        nothing); ``old``, a member, leaves once ``new`` is caught up (:meth:`retire`).
        ``old`` None: ``new`` adds a replica the chain is short of."""
        chain = self.add(txn, cid, new, caught_up=False)
        if old is not None and old in chain.members and old not in chain.leaving:
            chain = replace(chain, leaving=(*chain.leaving, old))
            self._put(txn, chain)
        return chain

    def retire(self, txn: Txn, cid: int) -> Chain:
        """Drop the leaving members of chain ``cid`` once the members that stay are
        caught up and as many as it wants (a replacement that failed keeps the leaving
        one in); they are gone for good (a new version)."""
        chain = self._need(txn, cid)
        if not chain.leaving or self.joining(chain):
            return chain
        keep = tuple(m for m in chain.members if m not in chain.leaving)
        if not keep or len(keep) < chain.want:
            return chain
        new = replace(chain, version=chain.version + 1, members=keep, leaving=(),
                      stale=tuple(s for s in chain.stale if s not in chain.leaving),
                      gone=tuple(dict.fromkeys((*chain.gone, *chain.leaving))))
        self._put(txn, new)
        log.info("chain %d: %s left, version %d, members %s", cid, list(chain.leaving),
                 new.version, list(keep))
        return new

    def lose(self, txn: Txn, cid: int, sid: str) -> Chain:
        """``sid`` is lost for good: out of chain ``cid`` (a new version when it was a
        member), never caught up again. Its last member stays (EBUSY: its data would be
        nowhere) until another holds the data."""
        chain = self._need(txn, cid)
        if sid in chain.members:
            if len([m for m in chain.members if m not in chain.stale]) == 1 \
                    and sid not in chain.stale:
                raise OSError(errno.EBUSY, f"chain {cid}: {sid} is its last member")
            chain = self.remove(txn, cid, sid)
        if sid not in chain.stale and sid not in chain.leaving:
            return chain
        new = replace(chain, stale=tuple(s for s in chain.stale if s != sid),
                      leaving=tuple(s for s in chain.leaving if s != sid),
                      gone=tuple(dict.fromkeys((*chain.gone, sid))))
        self._put(txn, new)
        log.warning("chain %d: %s lost, members %s", cid, sid, list(new.members))
        return new

    # -- layouts ---------------------------------------------------------------
    def resolve(self, txn: Txn, layout: dict[str, Any] | None) -> dict[str, Any] | None:
        """A stored layout as clients see it: each stripe's servers are its chain's
        members now, with the chain's version. A layout without chains (placed before
        them) is an implicit chain per stripe, as placed (version 0)."""
        if not layout or not layout.get("chains"):
            return layout
        return self.resolved(layout, self._of(txn, layout))

    @staticmethod
    def resolved(layout: dict[str, Any], chains: list[Chain]) -> dict[str, Any]:
        """:meth:`resolve` with the layout's chains already read (a create has them
        from placement)."""
        return {**layout, "servers": [list(c.members) for c in chains],
                "versions": [c.version for c in chains]}

    def _of(self, txn: Txn, layout: dict[str, Any]) -> list[Chain]:
        """The chains ``layout`` names, each read once."""
        chains = []
        for cid in layout["chains"]:
            chain = self.get(txn, cid)
            if chain is None:  # cannot happen: a chain is never deleted
                raise OSError(errno.EIO, f"layout names chain {cid}, which does not exist")
            chains.append(chain)
        return chains

    def holders(self, txn: Txn, layout: dict[str, Any]) -> dict[str, Any]:
        """``layout`` with, per stripe, every server that may hold its object: the
        members placed, those now, and stale ones (what deleting the file must reach)."""
        if not layout.get("chains"):
            return layout
        chains = self._of(txn, layout)
        placed_all = layout.get("servers", ())
        servers = []
        for s, chain in enumerate(chains):
            placed = placed_all[s] if s < len(placed_all) else []
            servers.append(list(dict.fromkeys((*placed, *chain.members, *chain.stale))))
        return {**layout, "servers": servers, "versions": [c.version for c in chains]}
