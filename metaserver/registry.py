"""The data servers the metaserver knows are up: what each registered or last reported
(address, total and free bytes, each data directory and its filesystem) and when. A
server silent for ``timeout`` seconds counts as down: placement skips it, ``statfs``
leaves its space out, nothing is sent to it.

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


def _volumes(sid: str, total: int, free: int, dirs: list[Volume] | None) -> list[Volume]:
    """What ``sid`` reported per directory; an older server's whole space as one
    filesystem of its own."""
    if not dirs:
        return [Volume("", "", total, free)]
    return list(dirs)


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
    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic,
                 reserve: Reserve | None = None) -> None:
        self._timeout = timeout
        self._clock = clock
        self._reserve = reserve or Reserve()
        self._lock = threading.Lock()
        self._live: dict[str, LiveServer] = {}

    def _alive_since(self) -> float:
        return self._clock() - self._timeout

    def register(self, sid: str, host: str, port: int, total: int, free: int,
                 dirs: list[Volume] | None = None) -> None:
        """``sid`` is up at ``host:port`` (a registration, or a heartbeat from a server
        registered before this metaserver started)."""
        vols = _volumes(sid, total, free, dirs)
        with self._lock:
            self._live[sid] = LiveServer(host, port, total, free, self._clock(), vols)

    def heartbeat(self, sid: str, total: int, free: int,
                  dirs: list[Volume] | None = None) -> bool:
        """``sid`` is still up; False when it has not registered since this start."""
        vols = _volumes(sid, total, free, dirs)
        with self._lock:
            live = self._live.get(sid)
            if live is None:
                return False
            live.total, live.free, live.seen, live.dirs = total, free, self._clock(), vols
            return True

    def address(self, sid: str) -> tuple[str, int] | None:
        """Where ``sid`` listens; None when it is down or unknown."""
        with self._lock:
            s = self._live.get(sid)
        if s is None or s.seen < self._alive_since():
            return None
        return s.host, s.port

    def free_space(self) -> dict[str, int]:
        """Free bytes of each server that is up and not full (what placement chooses
        among)."""
        since = self._alive_since()
        with self._lock:
            return {sid: s.free for sid, s in self._live.items()
                    if s.seen >= since and not self._reserve.full(s.dirs)}

    def capacity(self) -> tuple[int, int]:
        """Total and free bytes of the servers that are up, each filesystem once."""
        since = self._alive_since()
        with self._lock:
            alive = {sid: s.dirs for sid, s in self._live.items() if s.seen >= since}
        return distinct(alive)

    def live(self) -> dict[str, tuple[int, int, float]]:
        """sid -> (total, free, seconds since its last report), for the metrics."""
        now = self._clock()
        with self._lock:
            return {sid: (s.total, s.free, now - s.seen) for sid, s in self._live.items()}

    def describe(self, stored: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The stored servers' records, updated from what each last reported, with
        ``alive``."""
        since = self._alive_since()
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            for sid, rec in stored.items():
                live = self._live.get(sid)
                if live is not None:
                    rec = {"host": live.host, "port": live.port, "total": live.total,
                           "free": live.free, "full": self._reserve.full(live.dirs),
                           "dirs": [list(v) for v in live.dirs if v.path],
                           "age": round(self._clock() - live.seen, 3)}
                out[sid] = {**rec, "alive": live is not None and live.seen >= since}
        return out
