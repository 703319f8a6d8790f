"""The data servers the metaserver knows are up: what each registered or last reported
(address, total and free bytes, each data directory and its filesystem) and when, and
the state of each (docs/architecture.md, "Failure detection").

**Leases.** Each heartbeat renews a server's lease for ``lease`` seconds (data servers
heartbeat every second by default, the lease is 5 s). A server whose lease ran out is
*down*: placement skips it, ``statfs`` leaves its space out, nothing is sent to it. One
whose connection was refused (a client reports it, the metaserver checks with a probe of
its own, or the metaserver's own call was refused) is down at once, until its next
heartbeat or registration. One silent for ``suspect_after`` seconds, or that did not
answer a probe in time, is *suspect*: shown, still placed (a busy host's heartbeat can be
late), down when its lease runs out.

**Draining** is the operator's (``pfs admin drain``), durable in the namespace's server
record; here it is a flag placement reads.

Capacity is counted per filesystem, once (``lfs df``): data servers on one host whose
directories share a disk report the same filesystem identity. A server that reports no
directories (an older one) counts as one filesystem of its own.

A server is *full* when one of its directories has less free space than the reserve
(``reserve_bytes`` or ``reserve_percent`` of that filesystem, whichever is smaller; a
stripe object may land in any of its directories): placement gives it no new stripes.
The numbers are as fresh as the last heartbeat; a data server whose disk fills up
between heartbeats sends one at once.

Only liveness lives here; the durable record of each server (key ``R``, so addresses
survive a metaserver restart) is the namespace's. Called from the event loop and from
the namespace's placement during a commit, hence the lock.
"""
from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pfs.core.messages.records import Volume


@dataclass(slots=True)
class LiveServer:
    host: str
    port: int
    total: int
    free: int
    seen: float  # clock() of the last register/heartbeat
    dirs: list[Volume]
    refused: float | None = None  # clock() when its connection was refused (down)
    unanswered: float | None = None  # clock() when a probe got no answer (suspect)
    domain: str = ""  # failure domain: the host it registered from, unless it said
    version: str = ""  # package version ("": an older server that does not say)
    protocol: tuple[int, int] | None = None  # wire protocol range it speaks
    load: tuple[int, ...] | None = None  # requests/s, bytes in/s, out/s, connections
    kv: tuple[int, ...] | None = None  # KV-cache blocks (KV_KEYS; None: no KV store)


class State(enum.Enum):
    """What ``pfs df`` and ``pfs admin servers`` show of a server."""

    UP = "up"
    SUSPECT = "suspect"  # heartbeat late, or a probe unanswered: still placed
    DOWN = "down"  # lease expired, or connection refused
    DRAINING = "draining"  # alive; placement skips it (the operator's)
    FULL = "full"  # alive; a directory is under the reserve


@dataclass(frozen=True, slots=True)
class Placeable:
    """A server placement may choose: alive, not full, not draining."""

    free: int  # bytes free (what placement weighs by)
    domain: str  # failure domain (replicas of a stripe go to distinct ones)


def _volumes(sid: str, total: int, free: int, dirs: list[Volume] | None) -> list[Volume]:
    """What ``sid`` reported per directory; an older server's whole space as one
    filesystem of its own."""
    if not dirs:
        return [Volume("", "", total, free)]
    return list(dirs)


LOAD_KEYS = ("requests", "bytes_in", "bytes_out", "connections")  # a heartbeat's load
KV_KEYS = ("budget", "used", "blocks", "hits", "misses", "evictions")  # ... and its kv


def _range(protocol: list[int] | None) -> tuple[int, int] | None:
    return (protocol[0], protocol[-1]) if protocol else None


def _kv(kv: list[int] | None) -> tuple[int, ...] | None:
    return tuple(kv) if kv and kv[0] > 0 else None


def _fs_key(sid: str, v: Volume) -> str:
    return v.fs if v.fs else f"\0{sid}\0{v.path}"  # no identity: unique


def distinct(servers: dict[str, list[Volume]]) -> tuple[int, int]:
    """Total and free bytes of the servers' volumes, each filesystem counted once."""
    seen: dict[str, Volume] = {}
    for sid, vols in sorted(servers.items()):
        for v in vols:
            seen.setdefault(_fs_key(sid, v), v)
    return sum(v.total for v in seen.values()), sum(v.free for v in seen.values())


@dataclass(frozen=True, slots=True)
class Reserve:
    """Free space kept back on every filesystem: the smaller of the two."""

    nbytes: int = 256 << 20
    percent: float = 1.0

    def of(self, total: int) -> int:
        return min(self.nbytes, int(total * self.percent / 100))

    def full(self, vols: list[Volume]) -> bool:
        return any(v.free <= self.of(v.total) for v in vols)


class Registry:
    """Liveness and space of the data servers. ``lease``: seconds a heartbeat keeps a
    server alive (``MetaConfig.heartbeat_timeout``); ``suspect_after``: seconds of
    silence before it is shown suspect."""

    def __init__(self, lease: float, clock: Callable[[], float] = time.monotonic,
                 reserve: Reserve | None = None, *, suspect_after: float | None = None
                 ) -> None:
        self._lease = lease
        self._suspect_after = lease / 2 if suspect_after is None else suspect_after
        self._clock = clock
        self._reserve = reserve or Reserve()
        self._lock = threading.Lock()
        self._live: dict[str, LiveServer] = {}
        self._draining: set[str] = set()
        # placement asks for the placeable servers at every create: the answer is kept
        # until a report or state change (``_changed``) or the first lease in it runs out
        self._placeable: tuple[float, dict[str, Placeable], dict[str, int]] | None = None

    def _changed(self) -> None:
        """Forget the kept placeable set (called with the lock held)."""
        self._placeable = None

    def _alive(self, s: LiveServer, now: float) -> bool:
        return s.refused is None and s.seen >= now - self._lease

    def register(self, sid: str, host: str, port: int, total: int, free: int,
                 dirs: list[Volume] | None = None, domain: str = "",
                 version: str | None = None, protocol: list[int] | None = None,
                 kv: list[int] | None = None) -> None:
        """``sid`` is up at ``host:port`` (a registration, or a heartbeat from a server
        registered before this metaserver started); ``domain``: its failure domain
        (default: its host); ``version``, ``protocol``: what it runs, if it says."""
        vols = _volumes(sid, total, free, dirs)
        with self._lock:
            self._live[sid] = LiveServer(host, port, total, free, self._clock(), vols,
                                         domain=domain or host, version=version or "",
                                         protocol=_range(protocol), kv=_kv(kv))
            self._changed()

    def heartbeat(self, sid: str, total: int, free: int,
                  dirs: list[Volume] | None = None, load: list[int] | None = None,
                  version: str | None = None, protocol: list[int] | None = None,
                  kv: list[int] | None = None) -> bool:
        """``sid`` is still up (its lease renewed; a refusal or unanswered probe
        before is forgotten); False when it has not registered since this start.
        ``load``: what it served over the last interval, if it says."""
        vols = _volumes(sid, total, free, dirs)
        with self._lock:
            live = self._live.get(sid)
            if live is None:
                return False
            live.total, live.free, live.seen, live.dirs = total, free, self._clock(), vols
            self._changed()
            live.refused = live.unanswered = None
            live.load = tuple(load) if load is not None else None
            live.kv = _kv(kv)
            if version:
                live.version, live.protocol = version, _range(protocol) or live.protocol
            return True

    def refused(self, sid: str) -> bool:
        """A connection to ``sid`` was refused (checked by the caller): down now, until
        its next heartbeat. True when that changed its state."""
        with self._lock:
            live = self._live.get(sid)
            if live is None or live.refused is not None:
                return False
            live.refused = self._clock()
            self._changed()
            return True

    def unanswered(self, sid: str) -> None:
        """A probe of ``sid`` connected but got no answer in time: suspect."""
        with self._lock:
            live = self._live.get(sid)
            if live is not None and live.unanswered is None:
                live.unanswered = self._clock()

    def set_draining(self, sids: set[str]) -> None:
        """The servers being drained (from their durable records)."""
        with self._lock:
            self._draining = set(sids)
            self._changed()

    def draining(self, sid: str, on: bool) -> None:
        with self._lock:
            if on:
                self._draining.add(sid)
            else:
                self._draining.discard(sid)
            self._changed()

    def states(self) -> dict[str, tuple[State, float]]:
        """Every known server's state and seconds since its last heartbeat (for the
        log of changes, metaserver/watch.py)."""
        now = self._clock()
        with self._lock:
            return {sid: (self._state(sid, s, now), now - s.seen)
                    for sid, s in self._live.items()}

    def state(self, sid: str) -> State:
        now = self._clock()
        with self._lock:
            s = self._live.get(sid)
            return State.DOWN if s is None else self._state(sid, s, now)

    def _state(self, sid: str, s: LiveServer, now: float) -> State:
        if not self._alive(s, now):
            return State.DOWN
        if sid in self._draining:
            return State.DRAINING
        if self._reserve.full(s.dirs):
            return State.FULL
        if s.unanswered is not None or s.seen < now - self._suspect_after:
            return State.SUSPECT
        return State.UP

    def address(self, sid: str) -> tuple[str, int] | None:
        """Where ``sid`` listens; None when it is down or unknown."""
        now = self._clock()
        with self._lock:
            s = self._live.get(sid)
            if s is None or not self._alive(s, now):
                return None
            return s.host, s.port

    def known_address(self, sid: str) -> tuple[str, int] | None:
        """Where ``sid`` last registered, up or down (what a probe connects to)."""
        with self._lock:
            s = self._live.get(sid)
            return None if s is None else (s.host, s.port)

    def placeable(self) -> dict[str, Placeable]:
        """The servers new stripes may go to: alive (lease held, not refused), not full,
        not draining — with the free bytes placement weighs by and the failure domain
        replicas must differ in. Suspect servers stay in (a late heartbeat on a busy
        host is no failure; the lease decides)."""
        return dict(self._kept()[1])

    def free_space(self) -> dict[str, int]:
        """Free bytes of each placeable server (:meth:`placeable` without domains)."""
        return dict(self._kept()[2])

    def _kept(self) -> tuple[float, dict[str, Placeable], dict[str, int]]:
        """The placeable set, computed again only after a change or once the earliest
        lease in it has run out (a server leaves it only then; one joins it only by a
        report, which is a change)."""
        now = self._clock()
        with self._lock:
            kept = self._placeable
            if kept is not None and now <= kept[0]:
                return kept
            places = {sid: Placeable(s.free, s.domain) for sid, s in self._live.items()
                      if self._alive(s, now) and sid not in self._draining
                      and not self._reserve.full(s.dirs)}
            until = min((self._live[sid].seen + self._lease for sid in places),
                        default=math.inf)
            kept = (until, places, {sid: p.free for sid, p in places.items()})
            self._placeable = kept
            return kept

    def capacity(self) -> tuple[int, int]:
        """Total and free bytes of the servers that are up, each filesystem once."""
        now = self._clock()
        with self._lock:
            alive = {sid: s.dirs for sid, s in self._live.items() if self._alive(s, now)}
        return distinct(alive)

    def live(self) -> dict[str, tuple[int, int, float]]:
        """sid -> (total, free, seconds since its last report), for the metrics."""
        now = self._clock()
        with self._lock:
            return {sid: (s.total, s.free, now - s.seen) for sid, s in self._live.items()}

    def describe(self, stored: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The stored servers' records, updated from what each last reported, with
        ``alive``, ``state`` (:class:`State`'s value), ``draining``, ``domain`` and
        ``age`` (seconds since its last heartbeat; absent when never seen here)."""
        now = self._clock()
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            for sid, rec in stored.items():
                live = self._live.get(sid)
                extra: dict[str, Any] = {"draining": sid in self._draining}
                if live is not None:
                    rec = {"host": live.host, "port": live.port, "total": live.total,
                           "free": live.free, "full": self._reserve.full(live.dirs),
                           "dirs": [list(v) for v in live.dirs if v.path]}
                    extra.update(state=self._state(sid, live, now).value,
                                 domain=live.domain, age=round(now - live.seen, 3))
                    if live.version:
                        extra.update(version=live.version, protocol=live.protocol)
                    if live.load is not None:
                        extra["load"] = dict(zip(LOAD_KEYS, live.load, strict=False))
                    if live.kv is not None:
                        extra["kv"] = dict(zip(KV_KEYS, live.kv, strict=False))
                else:
                    rec = {k: v for k, v in rec.items() if k != "draining"}
                    extra["state"] = State.DOWN.value
                out[sid] = {**rec, **extra,
                            "alive": live is not None and self._alive(live, now)}
        return out
