"""pfs.core.pinning: locked ranges of a file mapping, overlapping pins, the limit."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest

from pfs.core import pinning

PAGE = mmap.PAGESIZE


def _locked(addr: int, n: int) -> bool:
    """Whether [addr, addr + n) is locked: MADV_PAGEOUT refuses a locked range."""
    if pinning._libc.madvise(addr, n, pinning.MADV_PAGEOUT) == 0:
        return False
    assert ctypes.get_errno() == errno.EINVAL
    return True


def _mapping(tmp_path: Path, pages: int) -> mmap.mmap:
    """A read-only mapping of a new file of ``pages`` random pages."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(pages * PAGE))
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)


def test_overlapping_pins_keep_the_shared_pages_locked(tmp_path: Path) -> None:
    m = _mapping(tmp_path, 8)
    view = memoryview(m)
    base = pinning.address(m)
    a = pinning.pin(view[100 : 3 * PAGE + 5])  # pages 0-3
    b = pinning.pin(view[3 * PAGE : 6 * PAGE])  # pages 3-5
    assert a is not None and b is not None
    assert (a.lo, a.hi) == (base, base + 4 * PAGE)
    assert _locked(base, PAGE) and _locked(base + 5 * PAGE, PAGE)
    a.release()
    assert not _locked(base, 3 * PAGE)  # a's own pages go
    assert _locked(base + 3 * PAGE, 3 * PAGE)  # the shared page stays, with b's
    b.release()
    b.release()  # twice: nothing more
    assert not _locked(base, 8 * PAGE)
    assert pinning.stats()["live"] == 0
    view.release()
    m.close()


def test_a_pin_over_the_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 * PAGE))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    monkeypatch.setattr(pinning._state, "budget", float(2 * PAGE))
    refused = pinning.stats()["refused"]
    assert pinning.pin(memoryview(m)) is None  # the caller copies instead
    assert pinning.stats()["refused"] == refused + 1
    small = pinning.pin(memoryview(m)[:PAGE])
    assert small is not None
    small.release()
    m.close()


def test_a_mapped_range_is_locked_without_faulting_it_in_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = _mapping(tmp_path, 8)
    view = memoryview(m)
    base = pinning.address(m)
    populated: list[int] = []
    madvise = pinning._libc.madvise

    def counting(addr: int, n: int, advice: int) -> int:
        if advice == pinning.MADV_POPULATE_READ:
            populated.append(n)
        return int(madvise(addr, n, advice))

    monkeypatch.setattr(pinning._libc, "madvise", counting)
    sum(view[::PAGE])  # every page mapped
    p = pinning.pin(view[100 : 6 * PAGE])
    assert p is not None and populated == []  # the lock alone keeps them
    assert _locked(base, 6 * PAGE)
    p.release()
    assert madvise(base, 8 * PAGE, pinning.MADV_PAGEOUT) == 0  # unmapped (reclaimed)
    assert not pinning._mapped(base, base + 6 * PAGE)
    p = pinning.pin(view[100 : 6 * PAGE])
    assert p is not None and populated == [6 * PAGE]  # faulted in, and locked
    assert pinning._mapped(base, base + 6 * PAGE) and _locked(base, 6 * PAGE)
    p.release()
    view.release()
    m.close()


def test_a_forked_child_reads_its_own_page_table() -> None:
    """/proc/self/pagemap names the process that opened it: after a fork the child
    must see its own pages (mapped or not), or a pin would skip faulting them in."""
    pid = os.fork()
    if pid == 0:
        m = mmap.mmap(-1, 1 << 20)
        lo = pinning.address(m)
        before = pinning._mapped(lo, lo + (1 << 20))
        m[:] = b"y" * (1 << 20)
        after = pinning._mapped(lo, lo + (1 << 20))
        os._exit(0 if (not before and after) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
