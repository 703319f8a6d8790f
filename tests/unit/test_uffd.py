"""The userfaultfd fill primitives (:mod:`pfs.client.uffd`) on plain files and mappings:
pages copied from a file's page cache, edges made present, the memory plain again
after unregistering, and a missing page touched while registered raising SIGBUS in
a child process instead of hanging it."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pfs.client import uffd

PAGE = mmap.PAGESIZE
pytestmark = pytest.mark.skipif(not uffd.available(), reason="no userfaultfd here")


def _addr(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


@pytest.fixture
def obj(tmp_path: Path) -> Iterator[tuple[Path, bytes, uffd.Source, mmap.mmap, int]]:
    """An 8-page file mapped as a source, and a fresh 10-page mapping (its address)."""
    data = os.urandom(8 * PAGE)
    f = tmp_path / "obj"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    src = uffd.Source(fd, len(data))
    mm = mmap.mmap(-1, 10 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        yield f, data, src, mm, _addr(mm)
    finally:
        src.close()
        os.close(fd)
        mm.close()


def test_copy_settle_unregister(obj: tuple[Path, bytes, uffd.Source, mmap.mmap, int]) -> None:
    """Copied pages hold the file's bytes, settled pages read as zeros and take
    writes, a page left missing faults in as zeros once unregistered, and the buffer
    is ordinary writable memory afterwards; a second copy onto a filled page is
    refused (EEXIST), not silently merged."""
    f, data, src, mm, base = obj
    assert uffd.register(base, 10 * PAGE)
    uffd.copy(base, src.addr, 4 * PAGE)
    uffd.copy(base + 6 * PAGE, src.addr + 6 * PAGE, 2 * PAGE)
    uffd.settle(base + 4 * PAGE + 100, 10)  # one page, touched in its middle
    with pytest.raises(OSError) as ei:
        uffd.copy(base, src.addr, PAGE)
    assert ei.value.errno == 17  # EEXIST
    assert mm[: 4 * PAGE] == data[: 4 * PAGE]
    assert mm[6 * PAGE : 8 * PAGE] == data[6 * PAGE :]
    assert mm[4 * PAGE : 5 * PAGE] == bytes(PAGE)
    mm[4 * PAGE + 5] = 7  # a settled page takes writes while registered
    uffd.unregister(base, 10 * PAGE)
    assert mm[5 * PAGE : 6 * PAGE] == bytes(PAGE)  # never filled: zeros now
    assert mm[8 * PAGE :] == bytes(2 * PAGE)
    mm[:PAGE] = bytes(PAGE)  # private memory: the file keeps its bytes
    assert f.read_bytes() == data


def test_settle_skips_present_pages(obj: tuple[Path, bytes, uffd.Source, mmap.mmap, int]) -> None:
    """Settling a range where some pages were copied leaves those pages' bytes and
    fills only the missing ones."""
    _f, data, src, mm, base = obj
    assert uffd.register(base, 4 * PAGE)
    uffd.copy(base + PAGE, src.addr + PAGE, PAGE)
    uffd.copy(base + 3 * PAGE, src.addr + 3 * PAGE, PAGE)
    uffd.settle(base, 4 * PAGE)
    assert mm[:PAGE] == bytes(PAGE) and mm[2 * PAGE : 3 * PAGE] == bytes(PAGE)
    assert mm[PAGE : 2 * PAGE] == data[PAGE : 2 * PAGE]
    assert mm[3 * PAGE : 4 * PAGE] == data[3 * PAGE : 4 * PAGE]
    uffd.unregister(base, 4 * PAGE)


def test_missing_page_touched_while_registered_is_sigbus_not_a_hang() -> None:
    """Nobody handles this userfaultfd's faults: a bug that touches a page before it
    is filled must crash loudly (SIGBUS), never wait forever."""
    code = (
        "import ctypes, mmap\n"
        "from pfs.client import uffd\n"
        "mm = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "assert uffd.register(ctypes.addressof(ctypes.c_char.from_buffer(mm)), 4096)\n"
        "print(mm[0])\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        timeout=60,
        env=dict(os.environ, PYTHONFAULTHANDLER=""),
    )
    assert p.returncode == -signal.SIGBUS, p.stderr[-500:]


def test_disabled_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uffd, "ENABLED", False)
    assert not uffd.available()
    assert not uffd.register(0, PAGE)


def test_cached_probe(tmp_path: Path) -> None:
    """The probe that sends a filled chunk to the read path when its object is cold:
    False once the file's pages are dropped, True once read, True past the end."""
    from pfs.client.shortcircuit import _cached

    f = tmp_path / "obj"
    f.write_bytes(os.urandom(64 * PAGE))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert not _cached(fd, 0, 64 * PAGE)
        os.pread(fd, 64 * PAGE, 0)
        assert _cached(fd, 0, 64 * PAGE)
        assert _cached(fd, 100 * PAGE, PAGE)
    finally:
        os.close(fd)


def _mapped_pages(addr: int, n: int) -> int:
    """How many of the ``n`` pages from ``addr`` this process's page table maps."""
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        raw = os.pread(fd, 8 * n, addr // PAGE * 8)
    finally:
        os.close(fd)
    return sum(1 for i in range(n) if raw[8 * i + 7] & 0x80)


def test_drop_unmaps_copied_source_pages(
    obj: tuple[Path, bytes, uffd.Source, mmap.mmap, int],
) -> None:
    """A source range dropped after its copy has no page-table entries left (the
    load's end then has none to tear down), and copying it again still gives the
    file's bytes (the page cache kept them)."""
    _f, data, src, mm, base = obj
    assert uffd.register(base, 8 * PAGE)
    uffd.copy(base, src.addr, 4 * PAGE)
    assert _mapped_pages(src.addr, 4) == 4  # the copy faulted the source in
    src.drop(0, 4 * PAGE)
    assert _mapped_pages(src.addr, 4) == 0
    uffd.copy(base + 4 * PAGE, src.addr, 4 * PAGE)  # the same source bytes again
    uffd.unregister(base, 8 * PAGE)
    assert mm[: 4 * PAGE] == data[: 4 * PAGE] == mm[4 * PAGE : 8 * PAGE]


def test_fill_verified_drops_its_source_pages(tmp_path: Path) -> None:
    """:func:`pfs.client.filled.fill_verified` leaves no page of the object mapped
    behind a chunk it copied, and the chunk holds the object's bytes, verified."""
    from pfs.client.filled import fill_verified
    from pfs.core import checksums

    n = 2 * checksums.BLOCK
    data = os.urandom(n)
    f = tmp_path / "obj"
    f.write_bytes(data)
    c = tmp_path / "obj.crc"
    fd = os.open(f, os.O_RDONLY)
    cfd = os.open(c, os.O_RDWR | os.O_CREAT)
    src = uffd.Source(fd, n)
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        recs = [
            (checksums.crc_padded(data[i : i + checksums.BLOCK]), checksums.BLOCK)
            for i in range(0, n, checksums.BLOCK)
        ]
        checksums.write_records(cfd, 0, recs)
        base = _addr(mm)
        assert uffd.register(base, n)
        counts, copied = fill_verified((1, 0), fd, cfd, 0, [memoryview(mm)], src)
        uffd.unregister(base, n)
        assert counts == [n] and copied == n
        assert mm[:] == data
        assert _mapped_pages(src.addr, n // PAGE) == 0
    finally:
        src.close()
        os.close(cfd)
        os.close(fd)
        mm.close()
