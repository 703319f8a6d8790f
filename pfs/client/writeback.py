"""Write-behind: writes answered once they are under way, landing in the background.

A writer keeps several writes in flight instead of one round trip per write (the FUSE
mount answers the kernel this way; ``FileHandle.write_behind`` offers it to the native
API, whose ``pread_into``, ``commit``, ``fsync``, ``truncate`` and ``close`` follow the
rules below for both). The rules that keep this safe, all here:

- overlapping writes of an inode land in the order they were accepted (a write waits
  for the ranges in flight it overlaps before it starts);
- each handle has at most ``limit`` writes in flight (then the next one waits);
- the first failure of a handle's writes is kept and raised by its next write, commit,
  fsync, truncate or close, errno kept (:class:`HandleWrites`);
- a read of a range in flight waits for it, and a read past the size known so far
  waits for every write of the inode (one in flight may extend the file);
- ``end(ino)``: how long the file is once the writes in flight land (what a stat
  reports meanwhile).

Writes run on the client's trio nursery. Ranges are per inode, shared by every handle of
it in this client; errors and the bound are per handle.
"""
from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

WRITE_BEHIND = 16  # writes in flight per handle unless the caller says otherwise
_EVERYTHING = 1 << 63


class InodeWrites:
    """Writes of one inode accepted and still on their way to the data servers."""

    def __init__(self) -> None:
        self.ranges: dict[int, tuple[int, int, trio.Event]] = {}
        self.end = 0  # the file is at least this long once they land

    def overlapping(self, start: int, end: int) -> list[trio.Event]:
        return [ev for s, e, ev in self.ranges.values() if s < end and start < e]


class HandleWrites:
    """One handle's share of write-behind: a bound on its writes in flight, and the
    first error among them, kept until the handle reports it."""

    def __init__(self, limit: int) -> None:
        self.slots = trio.Semaphore(limit)
        self.error: OSError | None = None
        self.error_off = 0

    def failed(self, err: OSError, off: int) -> None:
        if self.error is None:
            self.error, self.error_off = err, off

    def take_error(self, name: str) -> OSError | None:
        """The kept error as a new ``OSError`` naming the file (once: it is reported)."""
        err, self.error = self.error, None
        if err is None:
            return None
        code = err.errno if isinstance(err.errno, int) and err.errno > 0 else errno.EIO
        new = OSError(code, f"{name}: a write at offset {self.error_off} failed: "
                            f"{err.strerror or err}")
        new.__cause__ = err
        return new


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` a failed write raised: itself, or the first in a group holding
    nothing else (parallel stripe writes raise from a nursery)."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(OSError)
        if matched is not None and rest is None:
            first: BaseException = matched
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            return first if isinstance(first, OSError) else None
    return None


class WriteBack:
    """A client's writes in flight, by inode; they run on ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._inodes: dict[int, InodeWrites] = {}
        self._ids = 0

    def end(self, ino: int) -> int:
        """The end of the last byte in flight for ``ino`` (0: none in flight)."""
        fl = self._inodes.get(ino)
        return fl.end if fl is not None else 0

    def busy(self, ino: int) -> bool:
        return ino in self._inodes

    def idle(self) -> bool:
        """No write in flight."""
        return not self._inodes

    def in_flight(self, ino: int) -> int:
        fl = self._inodes.get(ino)
        return len(fl.ranges) if fl is not None else 0

    async def wait(self, ino: int, start: int = 0, end: int = _EVERYTHING) -> None:
        """Wait for the writes of ``ino`` in flight now that overlap ``[start, end)``."""
        fl = self._inodes.get(ino)
        if fl is not None:
            for ev in fl.overlapping(start, end):
                await ev.wait()

    async def drain(self, ino: int) -> None:
        """Wait until every write of ``ino`` accepted so far has landed."""
        await self.wait(ino)

    async def drain_all(self) -> None:
        for ino in list(self._inodes):
            await self.drain(ino)

    async def before_read(self, ino: int, off: int, size: int, known_size: int) -> None:
        """A read of ``[off, off + size)`` sees the bytes written before it: it waits for
        the writes in flight over its range, or for all of them when it reaches past
        ``known_size`` (one may extend the file: a short read would be wrong)."""
        if ino not in self._inodes:
            return
        if off + size > known_size:
            await self.drain(ino)
        else:
            await self.wait(ino, off, off + size)

    async def start(self, ino: int, mine: HandleWrites, off: int, end: int,
                    write: Callable[[], Awaitable[Any]], name: str = "") -> None:
        """Start ``write()`` of ``[off, end)`` of ``ino`` in the background; returns once
        it is under way: after the writes it overlaps and with one of ``mine``'s slots.
        Between the last overlap check and registering the range there is no
        checkpoint, so a write accepted later always sees this one."""
        await mine.slots.acquire()
        try:
            while (fl := self._inodes.get(ino)) is not None \
                    and (evs := fl.overlapping(off, end)):
                for ev in evs:
                    await ev.wait()
        except BaseException:
            mine.slots.release()
            raise
        fl = self._inodes.setdefault(ino, InodeWrites())
        self._ids += 1
        key, done = self._ids, trio.Event()
        fl.ranges[key] = (off, end, done)
        fl.end = max(fl.end, end)
        self._nursery.start_soon(self._land, ino, mine, key, off, write, name)

    async def _land(self, ino: int, mine: HandleWrites, key: int, off: int,
                    write: Callable[[], Awaitable[Any]], name: str) -> None:
        try:
            await write()
        except ValueError as exc:  # the handle was closed under its writes in flight
            log.warning("%s: a write at offset %d was lost: %s", name or f"inode {ino}",
                        off, exc)
            mine.failed(OSError(errno.EBADF, str(exc)), off)
        except (OSError, BaseExceptionGroup) as exc:
            err = _os_error(exc)
            if err is None:
                raise
            log.debug("write-behind of %s at %d failed: %s", name or f"inode {ino}", off, err)
            mine.failed(err, off)
        finally:
            fl = self._inodes.get(ino)
            if fl is not None:
                fl.ranges.pop(key)[2].set()
                if not fl.ranges:
                    del self._inodes[ino]
            mine.slots.release()
