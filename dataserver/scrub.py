"""The scrubber: a background task that re-reads every checked object at a bounded rate
(``scrub_rate`` bytes/s), verifies its blocks, logs and counts what does not match (the
data server's statfs reply carries the counts)."""
from __future__ import annotations

import logging
import os

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

    async def run(self, rate: int) -> None:
        """Scrub forever at ``rate`` bytes/s."""
        log.info("scrubber: %d bytes/s", rate)
        while True:
            seen = 0
            for d in self.store.dirs:
                root = os.path.join(d, "objects")
                for _path, obj in await trio.to_thread.run_sync(_list, root):
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
            for off in bad:
                if (obj, off) not in self.bad:
                    self.bad.add((obj, off))
                    self.errors += 1
                    log.error("scrub: object %s (inode %d, stripe %d): bad block at "
                              "offset %d", list(obj), obj[0], obj[1], off)
            n = count * ck.BLOCK
            self.scrubbed += n
            done += n
            blk += count
            await trio.sleep(n / rate)
