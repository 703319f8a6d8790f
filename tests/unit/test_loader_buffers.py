"""The loader's host buffers: fresh anonymous mappings, faulted in ahead of the reads
(by ``MADV_POPULATE_WRITE`` or, on an older kernel, a byte per huge page), zero-filled and
writable either way, and the thread that populates them stops when told."""
from __future__ import annotations

import resource
import threading

import pytest

from pfs.loader import buffers


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_populate_faults_the_pages_in_ahead() -> None:
    n = 8 << 20
    mm = buffers.anon_buffer(n)
    assert len(mm) == n
    before = _faults()
    buffers.populate([(buffers.address(mm), n)], threads=2)
    assert _faults() - before >= n // 4096 // 2  # the kernel took them here, not later
    assert mm[:16] == bytes(16) and mm[n - 1] == 0
    mm[n - 1] = 7
    assert mm[n - 1] == 7


@pytest.mark.parametrize("huge", [False, True])
def test_without_the_kernel_call(monkeypatch: pytest.MonkeyPatch, huge: bool) -> None:
    """Huge pages get a byte each written (zeros); small ones are left to the reads."""
    monkeypatch.setattr(buffers, "_populate_ok", False)
    monkeypatch.setattr(buffers, "HUGE_PAGES", huge)
    n = (4 << 20) + 123
    mm = buffers.anon_buffer(n)
    assert buffers.populate([(buffers.address(mm), n)]) is False
    assert bytes(mm) == bytes(n)  # the contents stay zero either way


def test_a_stopped_populate_returns_at_once() -> None:
    n = 256 << 20  # not faulted: the stop is already set after the first piece
    mm = buffers.anon_buffer(n)
    stop = threading.Event()
    stop.set()
    before = _faults()
    assert buffers.populate([(buffers.address(mm), n)], threads=2, stop=stop)
    assert _faults() - before < n // 4096 // 2


def test_empty_ranges() -> None:
    assert buffers.populate([]) is True
    assert len(buffers.anon_buffer(0)) == 1  # mmap needs a length; callers slice to 0
