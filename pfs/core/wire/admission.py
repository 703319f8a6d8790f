"""Who a server lets in: connections per peer, and the pool of connections still in
their handshake (docs/security.md, "Floods").

A connection counts against its peer (the remote address) from accept to close; a peer
at ``max_per_peer`` gets its next connection closed at once. Until it has authenticated,
a connection also holds a *handshake ticket*: at most ``max_unauthenticated`` at once,
``max_unauthenticated_per_peer`` of them from one peer. A new handshake that finds its
peer's share full evicts that peer's oldest; one that finds the whole pool full evicts
the oldest of the peer holding the most. So a flood of unauthenticated connections from
some addresses only ever pushes out its own, and a client elsewhere finishes its
handshake however fast the flood comes; a server also evicts the oldest handshake to
free a descriptor when ``accept`` runs out of them (:meth:`Admission.evict_one`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import trio

log = logging.getLogger(__name__)

LOG_EVERY = 10.0  # seconds between two log lines about refused or evicted peers


@dataclass(eq=False, slots=True)
class Ticket:
    """One connection's place in the handshake pool."""

    peer: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    evicted: bool = False
    done: bool = False

    def evict(self) -> None:
        self.evicted = True
        self.scope.cancel()


class Admission:
    """Per-peer connection counts and the handshake pool of one server."""

    def __init__(self, max_per_peer: int = 1024, max_unauthenticated: int = 256,
                 max_unauthenticated_per_peer: int = 64, name: str = "server") -> None:
        self.max_per_peer = max(1, max_per_peer)
        self.max_unauthenticated = max(1, max_unauthenticated)
        self.max_unauthenticated_per_peer = max(1, min(max_unauthenticated_per_peer,
                                                       self.max_unauthenticated))
        self.name = name
        self._peers: dict[str, int] = {}
        self._pending: dict[str, dict[int, Ticket]] = {}  # peer -> tickets, oldest first
        self._unauth = 0
        self._seq = 0
        self.refused = 0  # connections closed at once (their peer at its limit)
        self.evicted = 0  # handshakes pushed out of the pool
        self._logged = 0.0

    @property
    def unauthenticated(self) -> int:
        return self._unauth

    def connections(self, peer: str) -> int:
        return self._peers.get(peer, 0)

    # -- connections per peer ---------------------------------------------------
    def admit(self, peer: str) -> bool:
        """Count a new connection of ``peer``; False (not counted) when it is at its
        limit: close the connection."""
        n = self._peers.get(peer, 0)
        if n >= self.max_per_peer:
            self.refused += 1
            self._note("%s: refusing connections from %s: %d open (max_per_peer %d)",
                       self.name, peer, n, self.max_per_peer)
            return False
        self._peers[peer] = n + 1
        return True

    def leave(self, peer: str) -> None:
        n = self._peers.get(peer, 0) - 1
        if n > 0:
            self._peers[peer] = n
        else:
            self._peers.pop(peer, None)

    # -- the handshake pool -----------------------------------------------------
    def handshake(self, peer: str) -> Ticket:
        """A ticket for a connection about to authenticate; makes room first."""
        mine = self._pending.get(peer)
        if mine is not None and len(mine) >= self.max_unauthenticated_per_peer:
            self._evict(peer)
        elif self._unauth >= self.max_unauthenticated:
            self._evict(max(self._pending, key=lambda p: len(self._pending[p])))
        ticket = Ticket(peer)
        self._seq += 1
        self._pending.setdefault(peer, {})[self._seq] = ticket
        self._unauth += 1
        return ticket

    def finish(self, ticket: Ticket) -> None:
        """The connection authenticated, failed or closed: its ticket goes."""
        if ticket.done:
            return
        ticket.done = True
        mine = self._pending.get(ticket.peer)
        if mine is None:
            return
        for seq, t in mine.items():
            if t is ticket:
                del mine[seq]
                self._unauth -= 1
                break
        if not mine:
            del self._pending[ticket.peer]

    def evict_one(self) -> bool:
        """Push the oldest handshake of the peer holding the most out (a descriptor is
        needed); False when none is pending."""
        if not self._pending:
            return False
        self._evict(max(self._pending, key=lambda p: len(self._pending[p])))
        return True

    def _evict(self, peer: str) -> None:
        mine = self._pending[peer]
        seq = next(iter(mine))
        ticket = mine.pop(seq)
        if not mine:
            del self._pending[peer]
        self._unauth -= 1
        ticket.done = True
        ticket.evict()
        self.evicted += 1
        self._note("%s: dropping unauthenticated connections (%s holds %d handshakes; "
                   "%d in the pool, %d evicted so far)", self.name, peer, len(mine) + 1,
                   self._unauth, self.evicted)

    def _note(self, fmt: str, *args: object) -> None:
        """Log at most one line per LOG_EVERY seconds: a flood must not flood the log."""
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY:
            self._logged = now
            log.warning(fmt, *args)
