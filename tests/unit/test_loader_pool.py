"""The loader's buffer pool: a buffer comes back when the last tensor over it is freed,
and only then; the next load of the process gets it already faulted in; what is kept
goes back to the kernel after a while, beyond a budget, or on ``release``. And a load
into reused buffers never shows bytes of an earlier load."""
from __future__ import annotations

import gc
import json
import resource
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pfs.loader import pool as poolmod
from pfs.loader.pool import BufferPool
from pfs.loader.safetensors import load_safetensors

try:
    import torch
except ImportError:
    torch = None  # type: ignore[assignment]

FRAMEWORKS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(
    torch is None, reason="torch not installed"))]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _addr(lease: poolmod.Lease) -> int:
    return poolmod.ctypes.addressof(lease.array)


def test_a_freed_buffer_comes_back_filled_in() -> None:
    p = BufferPool(keep_seconds=60)
    n = 4 << 20
    a = p.take(n)
    assert a.fresh and len(a.view) == n
    a.view[:] = b"\x01" * n  # faulted in by the writes
    where = _addr(a)
    del a
    assert p.free_bytes() == n
    data = b"\x02" * n
    before = _faults()
    b = p.take(n)
    assert not b.fresh and _addr(b) == where
    b.view[:] = data
    assert _faults() - before < 16  # no page faulted in again
    assert p.stats["reused"] == 1 and p.stats["reused_bytes"] == n


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_not_handed_out_while_a_tensor_holds_it(framework: str) -> None:
    """A view of the buffer (what a load returns) keeps it out of the pool; freeing
    the view hands it back."""
    p = BufferPool(keep_seconds=60)
    n = 1 << 20
    a = p.take(n)
    if framework == "torch":
        t: Any = torch.frombuffer(a.array, dtype=torch.uint8, count=n)[10:20].view(torch.int16)
    else:
        t = np.frombuffer(a.array, dtype=np.uint8, count=n)[10:20].view(np.int16)
    where = _addr(a)
    del a
    gc.collect()
    assert p.free_bytes() == 0
    b = p.take(n)
    assert b.fresh and _addr(b) != where
    del t
    assert p.free_bytes() == n  # back as soon as the last view went (no collector)
    c = p.take(n)
    assert _addr(c) == where


def test_sizes_match_within_the_slack() -> None:
    p = BufferPool(keep_seconds=60)
    big = p.take(8 << 20)
    del big
    small = p.take(1 << 20)  # 8x smaller: a fresh one, the big one stays free
    assert small.fresh and p.free_bytes() == 8 << 20
    near = p.take((7 << 20) + 5)  # within a quarter: reused, exactly as long as asked
    assert not near.fresh and len(near.view) == (7 << 20) + 5
    assert len(memoryview(near.array).cast("B")) == (7 << 20) + 5


def test_release_budget_and_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    p = BufferPool(keep_seconds=30, keep_bytes=3 << 20)
    leases = [p.take(1 << 20) for _ in range(4)]
    del leases
    assert p.free_bytes() == 3 << 20  # the budget: the oldest went back to the kernel
    assert p.stats["unmapped"] == 1
    now = poolmod.time.monotonic()
    monkeypatch.setattr(poolmod.time, "monotonic", lambda: now + 31)
    p._expire()  # what the timer runs: everything older than keep_seconds goes
    assert p.free_bytes() == 0 and p.stats["unmapped"] == 4
    monkeypatch.undo()
    x = p.take(1 << 20)
    del x
    assert p.release() == 1 << 20 and p.free_bytes() == 0


def test_keep_seconds_zero_keeps_nothing() -> None:
    p = BufferPool(keep_seconds=0)
    a = p.take(1 << 20)
    del a
    assert p.free_bytes() == 0
    p.release()  # unmapped by now, or here (while it died, the array still held it)
    assert p.stats["unmapped"] == 1 and not p._dying


# -- loads into reused buffers -------------------------------------------------------
def _write(path: Path, tensors: dict[str, bytes]) -> None:
    """A safetensors file of U8 tensors (raw bytes), in the given order."""
    header: dict[str, Any] = {}
    off = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        off += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values()))



def _bytes(t: Any) -> bytes:
    if torch is not None and isinstance(t, torch.Tensor):
        return t.numpy().tobytes()
    return np.asarray(t).tobytes()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_reused_buffer_never_shows_an_earlier_load(tmp_path: Path, framework: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Load A, free it, load B (same sizes, other bytes; then a little smaller, so a
    larger freed buffer is reused): B's tensors hold B's bytes and nothing more."""
    p = BufferPool(keep_seconds=60)
    monkeypatch.setattr(poolmod, "POOL", p)
    n = 3 << 20
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    _write(a, {"x": b"\xaa" * n, "y": b"\xab" * 1000})
    _write(b, {"x": bytes(range(256)) * (n // 256), "y": b"\x01" * 1000})
    _write(c, {"x": b"\x07" * (n - 4096), "y": b"\x02" * 900})
    out = load_safetensors(a, framework=framework)
    assert _bytes(out["x"]) == b"\xaa" * n
    del out
    assert p.free_bytes() > 0  # handed back at once, without the garbage collector
    for path, x, y in ((b, bytes(range(256)) * (n // 256), b"\x01" * 1000),
                       (c, b"\x07" * (n - 4096), b"\x02" * 900)):
        before = p.stats["reused"]
        out = load_safetensors(path, framework=framework)
        assert p.stats["reused"] > before
        assert _bytes(out["x"]) == x and _bytes(out["y"]) == y
        # the buffer is exactly the region (x and y), not the larger one it reuses
        size = (out["x"].untyped_storage().nbytes() if framework == "torch"
                else out["x"].base.nbytes)
        assert size == len(x) + len(y)
        del out


def test_consecutive_loads_take_no_faults(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stability guarantee: a process that frees a load and loads again reads into
    the buffers it had (a fresh load faults in a page per 4 KiB)."""
    monkeypatch.setattr(poolmod, "POOL", BufferPool(keep_seconds=60))
    n = 32 << 20
    path = tmp_path / "m.safetensors"
    _write(path, {"w": b"\x05" * n})
    before = _faults()
    out = load_safetensors(path, framework="numpy")
    first = _faults() - before
    del out
    before = _faults()
    out = load_safetensors(path, framework="numpy")
    again = _faults() - before
    assert _bytes(out["w"]) == b"\x05" * n
    assert first >= n // 4096 // 2 and again < first // 10


def test_a_return_while_take_chooses_only_appends() -> None:
    """A tensor the collector frees inside ``take`` (same thread, the lock held) must
    not reorder the list ``take`` is choosing from: the budget waits for the next
    return."""
    p = BufferPool(keep_seconds=60, keep_bytes=1 << 20)
    a, b = p.take(1 << 20), p.take(1 << 20)
    del a
    p._taking = True
    del b
    assert p.free_bytes() == 2 << 20 and p.stats["unmapped"] == 0
    p._taking = False
    c = p.take(1 << 20)
    del c
    assert p.free_bytes() == 1 << 20
