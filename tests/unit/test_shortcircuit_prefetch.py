"""Bulk short-circuit reads ask the kernel for their chunks ahead of the readers, from a
thread of their own: never more than ``BULK_WINDOW`` bytes past the chunks the readers
took, never for a chunk already cached, and not past the moment the readers are done."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from pfs.client import shortcircuit as sc
from pfs.client.plan import LocalChunk

MIB = 1 << 20


class _Servers:
    def __init__(self) -> None:
        self.stats = {"local_reads": 0, "local_bytes": 0, "fds": 0}
        self.handles: set[Any] = set()


def _file(tmp_path: Path, n: int, cached: bool) -> int:
    p = tmp_path / "obj"
    p.write_bytes(os.urandom(n))
    fd = os.open(p, os.O_RDONLY)
    if not cached:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd


def _chunks(n: int, size: int, buf: bytearray) -> list[LocalChunk]:
    mv = memoryview(buf)
    return [LocalChunk(0, i * size, [mv[i * size:(i + 1) * size]], [i * size])
            for i in range(n)]


def _handle(fd: int) -> sc.HandleObjects:
    h = sc.HandleObjects(_Servers())  # type: ignore[arg-type]
    h._fds[0] = fd
    return h


def test_the_prefetcher_keeps_a_window_ahead_of_the_readers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = _file(tmp_path, 8 * MIB, cached=False)
    monkeypatch.setattr(sc, "BULK_WINDOW", 3 * MIB)
    asked: list[int] = []
    step = threading.Semaphore(0)  # one per WILLNEED: the test follows the thread
    real = os.posix_fadvise

    def fadvise(f: int, off: int, n: int, advice: int) -> None:
        real(f, off, n, advice)
        asked.append(off // MIB)
        step.release()

    monkeypatch.setattr(sc.os, "posix_fadvise", fadvise)
    h = _handle(fd)
    chunks = _chunks(8, MIB, bytearray(8 * MIB))
    progress = sc._Progress()
    t = threading.Thread(target=h._prefetcher, args=(chunks, progress))
    t.start()
    try:
        for _ in range(3):
            assert step.acquire(timeout=30)
        assert asked == [0, 1, 2]  # the window: 3 chunks, then it waits for the readers
        with progress.cond:
            progress.taken = 2  # the readers took chunks 0 and 1
            progress.cond.notify_all()
        for _ in range(2):
            assert step.acquire(timeout=30)
        assert asked == [0, 1, 2, 3, 4]
    finally:
        with progress.cond:
            progress.stop = True  # the readers are done: it returns
            progress.cond.notify_all()
        t.join(timeout=30)
    assert not t.is_alive() and asked == [0, 1, 2, 3, 4]
    os.close(fd)


def test_cached_chunks_are_not_asked_for(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    fd = _file(tmp_path, 4 * MIB, cached=True)
    os.pread(fd, 4 * MIB, 0)  # every page in the cache
    calls: list[int] = []
    monkeypatch.setattr(sc.os, "posix_fadvise", lambda *a: calls.append(a[1]))
    h = _handle(fd)
    progress = sc._Progress()
    h._prefetcher(_chunks(4, MIB, bytearray(4 * MIB)), progress)  # returns when done
    assert calls == [] or not sc._nowait_ok  # (a kernel without RWF_NOWAIT asks always)
    os.close(fd)


def test_read_chunks_reads_every_chunk_and_stops_its_prefetcher(tmp_path: Path) -> None:
    n = 6 * MIB
    fd = _file(tmp_path, n, cached=False)
    want = os.pread(fd, n, 0)
    buf = bytearray(n)
    h = _handle(fd)
    seen: list[int] = []
    got = trio.run(lambda: h.read_chunks(_chunks(6, MIB, buf), threads=2,
                                         done=lambda c: seen.append(c.obj_off)))
    assert got == [[MIB]] * 6 and bytes(buf) == want
    assert sorted(seen) == [i * MIB for i in range(6)]  # (and it returned: the
    # prefetcher's thread, which its nursery waits for, ended with the readers)
    os.close(fd)
