"""The metaserver's log of data servers coming and going: every change of a server's
state (up, suspect, down, draining, full) as one line, so an operator reading the
journal sees when a peer was lost and found again without polling ``pfs admin
servers`` (docs/architecture.md, "Operations"). States are computed on demand from
heartbeats (metaserver/registry.py); this looks once a second."""
from __future__ import annotations

import logging

import trio

from pfs.metaserver.registry import Registry, State

log = logging.getLogger(__name__)

INTERVAL = 1.0  # seconds between looks: well under a lease (5 s by default)


async def log_changes(registry: Registry, interval: float = INTERVAL) -> None:
    """Forever: log each data server whose state changed since the last look."""
    last: dict[str, State] = {}
    while True:
        now = registry.states()
        for sid, (state, silent) in sorted(now.items()):
            before = last.get(sid)
            if before is None or before == state:
                continue  # a first registration is logged where it happens
            if state is State.DOWN:
                log.warning("data server %s: %s -> down (no heartbeat for %.1f s, or its "
                            "connection refused)", sid, before.value, silent)
            elif before is State.DOWN:
                log.info("data server %s: down -> %s (back)", sid, state.value)
            else:
                log.info("data server %s: %s -> %s", sid, before.value, state.value)
        last = {sid: state for sid, (state, _) in now.items()}
        await trio.sleep(interval)
