"""The data servers the metaserver knows are up: what each registered or last reported
(address, total and free bytes) and when. A server silent for ``timeout`` seconds counts
as down: placement skips it, ``statfs`` leaves its space out, nothing is sent to it.

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


@dataclass(slots=True)
class LiveServer:
    host: str
    port: int
    total: int
    free: int
    seen: float  # clock() of the last register/heartbeat


class Registry:
    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, LiveServer] = {}

    def _alive_since(self) -> float:
        return self._clock() - self._timeout

    def register(self, sid: str, host: str, port: int, total: int, free: int) -> None:
        """``sid`` is up at ``host:port`` (a registration, or a heartbeat from a server
        registered before this metaserver started)."""
        with self._lock:
            self._live[sid] = LiveServer(host, port, total, free, self._clock())

    def heartbeat(self, sid: str, total: int, free: int) -> bool:
        """``sid`` is still up; False when it has not registered since this start."""
        with self._lock:
            live = self._live.get(sid)
            if live is None:
                return False
            live.total, live.free, live.seen = total, free, self._clock()
            return True

    def address(self, sid: str) -> tuple[str, int] | None:
        """Where ``sid`` listens; None when it is down or unknown."""
        with self._lock:
            s = self._live.get(sid)
        if s is None or s.seen < self._alive_since():
            return None
        return s.host, s.port

    def free_space(self) -> dict[str, int]:
        """Free bytes of each server that is up (what placement chooses among)."""
        since = self._alive_since()
        with self._lock:
            return {sid: s.free for sid, s in self._live.items() if s.seen >= since}

    def capacity(self) -> tuple[int, int]:
        """Total and free bytes of the servers that are up."""
        since = self._alive_since()
        with self._lock:
            alive = [s for s in self._live.values() if s.seen >= since]
        return sum(s.total for s in alive), sum(s.free for s in alive)

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
                           "free": live.free}
                out[sid] = {**rec, "alive": live is not None and live.seen >= since}
        return out
