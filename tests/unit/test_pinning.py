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


def test_overlapping_pins_keep_the_shared_pages_locked(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 * PAGE))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
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
