"""Bulk short-circuit reads ask the kernel for their chunks ahead of the readers, from a
thread of their own: never more than ``BULK_WINDOW`` bytes past the chunks the readers
took, never for a chunk already cached, without waiting, and not past the moment the
readers are done."""
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
        self.stats = {"local_reads": 0, "local_bytes": 0, "fds": 0, "mapped_bytes": 0}
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
    step = threading.Semaphore(0)  # one per chunk asked for: the test follows the thread
    h = _handle(fd)

    def prefetch(c: LocalChunk) -> None:
        asked.append(c.obj_off // MIB)
        step.release()

    monkeypatch.setattr(h, "_prefetch", prefetch)
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


class _Calls:
    """What ``_prefetch`` asks of the kernel (the calls still made)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[int, int, int]] = []  # (offset, length, flags)
        self.fadvise: list[int] = []
        real_preadv, real_fadvise = os.preadv, os.posix_fadvise

        def preadv(fd: int, bufs: Any, off: int, flags: int = 0) -> int:
            self.reads.append((off, sum(len(b) for b in bufs), flags))
            return real_preadv(fd, bufs, off, flags)

        def fadvise(fd: int, off: int, n: int, advice: int) -> None:
            self.fadvise.append(off)
            real_fadvise(fd, off, n, advice)

        monkeypatch.setattr(sc.os, "preadv", preadv)
        monkeypatch.setattr(sc.os, "posix_fadvise", fadvise)


def test_a_cold_chunk_starts_readahead_without_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold chunk: a 1-byte probe of its last page, then a read of the chunk that
    returns at once (EAGAIN) having started the file's readahead; no WILLNEED (it
    leaves 4 KiB pages behind). A cached chunk: the probe alone."""
    if not sc._nowait_ok:
        pytest.skip("this kernel refuses RWF_NOWAIT")
    fd = _file(tmp_path, 4 * MIB, cached=False)
    calls = _Calls(monkeypatch)
    h = _handle(fd)
    chunk = _chunks(1, 4 * MIB, bytearray(4 * MIB))[0]
    h._prefetch(chunk)
    assert calls.reads == [(4 * MIB - 1, 1, os.RWF_NOWAIT), (0, 4 * MIB, os.RWF_NOWAIT)]
    assert calls.fadvise == []
    os.pread(fd, 4 * MIB, 0)  # now every page is cached
    calls.reads.clear()
    h._prefetch(chunk)
    assert calls.reads == [(4 * MIB - 1, 1, os.RWF_NOWAIT)] and calls.fadvise == []
    os.close(fd)


def test_without_rwf_nowait_it_asks_willneed(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    fd = _file(tmp_path, 2 * MIB, cached=True)
    monkeypatch.setattr(sc, "_nowait_ok", False)
    calls = _Calls(monkeypatch)
    h = _handle(fd)
    for c in _chunks(2, MIB, bytearray(2 * MIB)):
        h._prefetch(c)
    assert calls.fadvise == [0, MIB] and calls.reads == []
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


def test_read_chunks_advises_each_object_sequential_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bulk read tells the kernel that each object it reads goes front to back
    (``POSIX_FADV_SEQUENTIAL``: twice the readahead window for a cold object), once per
    object, before its readers start; the bytes are the same."""
    fds = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        fds.append(_file(tmp_path / str(i), 2 * MIB, cached=False))
    want = [os.pread(fd, 2 * MIB, 0) for fd in fds]
    advised: list[tuple[int, int, int, int]] = []
    real_fadvise = os.posix_fadvise

    def fadvise(fd: int, off: int, n: int, advice: int) -> None:
        advised.append((fd, off, n, advice))
        real_fadvise(fd, off, n, advice)

    monkeypatch.setattr(sc.os, "posix_fadvise", fadvise)
    h = _handle(fds[0])
    h._fds[1] = fds[1]
    bufs = [bytearray(2 * MIB) for _ in fds]
    chunks = [LocalChunk(s, i * MIB, [memoryview(bufs[s])[i * MIB:(i + 1) * MIB]],
                         [i * MIB]) for i in range(2) for s in range(2)]
    got = trio.run(lambda: h.read_chunks(chunks, threads=2))
    assert got == [[MIB]] * 4 and [bytes(b) for b in bufs] == want
    seq = [a for a in advised if a[3] == os.POSIX_FADV_SEQUENTIAL]
    assert sorted(seq) == sorted((fd, 0, 0, os.POSIX_FADV_SEQUENTIAL) for fd in fds)
    for fd in fds:
        os.close(fd)
