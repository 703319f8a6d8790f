"""The scrubber: a background task that re-reads every checked object at a bounded rate
(``scrub_rate`` bytes/s), verifies its blocks, logs and counts what does not match (the
data server's statfs reply carries the counts). An object with a bad block is repaired
from another member of its chain (``repair``: dataserver/repair.py, the copy verified
there before it is installed); one that cannot be (an unreplicated file, no good copy)
stays reported."""
from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable

import trio

from pfs.core.messages.records import MAX_ID
from pfs.dataserver import checksums as ck
from pfs.dataserver.objects import ObjectStore

log = logging.getLogger(__name__)

CHUNK = 16  # blocks verified in one step (1 MiB), then a pause for the rate
IDLE = 1.0  # seconds between passes over an empty store


def _list(root: str) -> list[tuple[str, tuple[int, int]]]:
    return list(ck.iter_objects(root))


class Scrubber:
    def __init__(self, store: ObjectStore, locks: ck.RangeLocks) -> None:
        self.store = store
        self.locks = locks
        self.scrubbed = 0  # bytes verified
        self.errors = 0  # bad blocks found
        self.passes = 0  # full passes done
        self.bad: set[tuple[tuple[int, int], int]] = set()  # (object, offset) reported
        self.repaired = 0  # objects repaired after a bad block
        # replace a replica from a chain peer (None: report only)
        self.repair: Callable[[tuple[int, int]], Awaitable[int]] | None = None

    async def run(self, rate: int) -> None:
        """Scrub forever at ``rate`` bytes/s."""
        log.info("scrubber: %d bytes/s", rate)
        while True:
            seen = 0
            for d in self.store.dirs:
                if d in self.store.lost:
                    continue  # being restored from chain peers (repair.py)
                root = os.path.join(d, "objects")
                try:
                    found = await trio.to_thread.run_sync(_list, root)
                except OSError as exc:  # a drive gone: the directory check handles it
                    log.error("scrub: cannot list %s: %s", root, exc)
                    continue
                for _path, obj in found:
                    seen += await self.scrub_object(obj, rate)
            self.passes += 1
            if not seen:
                await trio.sleep(IDLE)

    async def scrub_object(self, obj: tuple[int, int], rate: int) -> int:
        """Verify one object, a chunk at a time; the bytes verified."""
        done = 0
        blk = 0
        while True:
            got = self.store.acquire_checked(obj)
            if got is None:
                return done
            fd, cfd, release = got
            try:
                if cfd is None:
                    return done
                size = os.fstat(fd).st_size
                count = min(CHUNK, max(ck.n_blocks(size),
                                       os.fstat(cfd).st_size // ck.RECORD) - blk)
                if count <= 0:
                    return done
                async with self.locks.hold(obj, blk, MAX_ID, exclusive=False):
                    bad = await trio.to_thread.run_sync(ck.verify_fd, obj, fd, cfd, blk,
                                                        count, size)
            finally:
                release()
            new = [off for off in bad if (obj, off) not in self.bad]
            for off in new:
                self.bad.add((obj, off))
                self.errors += 1
                log.error("scrub: object %s (inode %d, stripe %d): bad block at "
                          "offset %d", list(obj), obj[0], obj[1], off)
            if new and await self._repair(obj):
                self.bad.difference_update({(obj, off) for off in bad})
            n = count * ck.BLOCK
            self.scrubbed += n
            done += n
            blk += count
            await trio.sleep(n / rate)

    async def _repair(self, obj: tuple[int, int]) -> bool:
        """Have ``obj`` repaired from a chain peer; whether it was."""
        if self.repair is None:
            return False
        try:
            await self.repair(obj)
        except OSError as exc:
            log.error("scrub: object %s not repaired: %s", list(obj), exc)
            return False
        self.repaired += 1
        log.warning("scrub: object %s repaired from a chain peer", list(obj))
        return True
