"""What a client knows of each data server's health, without I/O: how long its reads
take (for the hedge deadline), which servers failed it lately (tried last), and when a
refusal is worth reporting to the metaserver. The drivers feed it what they measure;
the planner (:mod:`pfs.client.plan`) asks it for an order of replicas and a deadline.

**The estimate** is TCP's retransmission timer (RFC 6298) per server and size class:
a smoothed latency ``srtt`` and mean deviation ``rttvar`` (gains 1/8 and 1/4), and the
deadline ``srtt + 4 * rttvar`` — above nearly every answer of a steady server, so a
hedge is rare unless the server stalls. Size classes (up to 64 KiB, up to 1 MiB,
larger) keep an 8 MiB read's time from setting a 4 KiB read's deadline. The deadline
is bounded below by ``hedge_min`` (no hedging within the noise of a busy host) and above
by ``hedge_max`` (a server that never answered yet, or has stalled for good, costs at
most that much before the next replica is asked).

**Penalties**: a server that lost a hedge, timed out or refused is tried after the other
replicas for ``penalty`` seconds, doubled at each failure in a row up to
``MAX_PENALTY`` (an answer resets it), so a stalled server costs one deadline per
penalty period, not one per read, and ever fewer while it stays stalled.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# size classes: the largest request each covers
CLASSES = (64 << 10, 1 << 20)
MAX_PENALTY = 60.0  # seconds: the longest a failing server is read last


def size_class(nbytes: int) -> int:
    for i, top in enumerate(CLASSES):
        if nbytes <= top:
            return i
    return len(CLASSES)


@dataclass(slots=True)
class Estimate:
    srtt: float
    rttvar: float

    def add(self, sample: float) -> None:
        self.rttvar += (abs(self.srtt - sample) - self.rttvar) / 4
        self.srtt += (sample - self.srtt) / 8

    @property
    def deadline(self) -> float:
        return self.srtt + 4 * self.rttvar


class Health:
    """Per-server latency estimates, penalties and report rate limits. Shared by the
    trio driver and the sync client's threads, hence the lock (held for a few
    arithmetic operations)."""

    def __init__(self, *, hedge_min: float = 0.05, hedge_max: float = 2.0,
                 penalty: float = 5.0, report_gap: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hedge_min = hedge_min
        self.hedge_max = max(hedge_max, hedge_min)
        self.penalty = penalty
        self.report_gap = report_gap
        self.clock = clock
        self._est: dict[tuple[str, int], Estimate] = {}
        self._penalised: dict[str, float] = {}  # sid -> clock() until which it goes last
        self._strikes: dict[str, int] = {}  # failures in a row
        self._reported: dict[str, float] = {}
        self._lock = threading.Lock()

    # -- what the drivers tell it ------------------------------------------------------
    def observe(self, sid: str, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` from ``sid`` answered in ``seconds``."""
        key = (sid, size_class(nbytes))
        with self._lock:
            self._strikes.pop(sid, None)
            est = self._est.get(key)
            if est is None:
                self._est[key] = Estimate(seconds, seconds / 2)
            else:
                est.add(seconds)

    def failed(self, sid: str) -> None:
        """``sid`` stalled (lost a hedge, timed out) or refused: try it last for a while."""
        with self._lock:
            n = self._strikes.get(sid, 0)
            self._strikes[sid] = n + 1
            self._penalised[sid] = self.clock() + min(self.penalty * 2 ** min(n, 16),
                                                      MAX_PENALTY)

    def report_due(self, sid: str) -> bool:
        """Whether a refusal by ``sid`` should be reported to the metaserver now (at
        most one report per ``report_gap`` seconds per server); True counts as sent."""
        now = self.clock()
        with self._lock:
            last = self._reported.get(sid)
            if last is not None and now - last < self.report_gap:
                return False
            self._reported[sid] = now
            return True

    # -- what the planner asks ---------------------------------------------------------
    def deadline(self, sid: str, nbytes: int) -> float:
        """Seconds to wait for ``sid``'s answer to a read of ``nbytes`` before asking the
        next replica too: the estimate of that size class, within the bounds; with no
        estimate yet, ``hedge_max``."""
        with self._lock:
            est = self._est.get((sid, size_class(nbytes)))
            d = self.hedge_max if est is None else est.deadline
        return min(max(d, self.hedge_min), self.hedge_max)

    def penalised(self, sid: str) -> bool:
        """Whether ``sid`` failed lately (still in its penalty)."""
        until = self._penalised.get(sid)
        return until is not None and until > self.clock()

    def order(self, replicas: Sequence[str]) -> Sequence[str]:
        """``replicas`` with the penalised ones last (in their order), as given when none
        is (the common case costs one dict test per replica)."""
        pen = self._penalised
        if not pen:
            return replicas
        now = self.clock()
        bad = [sid for sid in replicas if pen.get(sid, 0.0) > now]
        if not bad:
            return replicas
        return [sid for sid in replicas if sid not in bad] + bad
