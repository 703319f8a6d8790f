"""PosixEngine against plain files."""
from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from pfs.core.engine import Op, PosixEngine, get_engine


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, 4096, 64 * 1024 - 1, 64 * 1024, 3 * 1024 * 1024 + 7])
def test_write_then_read(fd: int, size: int) -> None:
    data = random.Random(size).randbytes(size)

    async def main() -> None:
        eng = PosixEngine()
        assert await eng.write(fd, 100, data) == size
        buf = bytearray(size + 50)
        n = await eng.read_into(fd, 100, memoryview(buf))
        assert n == size  # short at end of file
        assert buf[:n] == data
        assert await eng.read_into(fd, 0, memoryview(bytearray(100))) == (100 if size else 0)
        await eng.fsync(fd)
        eng.close()

    trio.run(main)
    assert os.pread(fd, size, 100) == data


def test_batch_mixed_sizes(fd: int) -> None:
    rng = random.Random(7)
    model = bytearray(rng.randbytes(8 << 20))
    os.pwrite(fd, model, 0)
    ops = []
    for _ in range(40):
        off = rng.randrange(len(model) + 10_000)
        length = rng.choice([1, 100, 4096, 70_000, 1 << 20])
        ops.append((fd, off, length, memoryview(bytearray(length + rng.randrange(3)))))

    async def main() -> list[int]:
        return await get_engine("posix", queue_depth=4).readv(ops)

    counts = trio.run(main)
    for (_fd, off, length, buf), n in zip(ops, counts, strict=True):
        want = model[off:off + length]
        assert n == len(want)
        assert buf[:n] == want


def test_batch_writes_then_reads(fd: int) -> None:
    rng = random.Random(3)
    model = bytearray(2 << 20)
    writes = []
    for i in range(30):
        length = rng.choice([10, 5000, 100_000])
        off = rng.randrange(len(model) - length)
        data = bytes([i + 1]) * length
        writes.append(Op(fd, off, length, data, True))
    # non-overlapping ops only: a batch runs in no particular order
    taken: list[tuple[int, int]] = []
    chosen = []
    for op in writes:
        if all(op.offset + op.length <= a or op.offset >= b for a, b in taken):
            taken.append((op.offset, op.offset + op.length))
            chosen.append(op)
            model[op.offset:op.offset + op.length] = op.buf

    async def main() -> None:
        eng = PosixEngine(queue_depth=3)
        assert await eng.submit(chosen) == [op.length for op in chosen]
        buf = bytearray(len(model))
        assert await eng.read_into(fd, 0, memoryview(buf)) == max(b for _a, b in taken)
        assert buf[:max(b for _a, b in taken)] == model[:max(b for _a, b in taken)]

    trio.run(main)


def test_errors() -> None:
    async def main() -> None:
        eng = PosixEngine()
        with pytest.raises(OSError) as e:
            await eng.read_into(-1, 0, memoryview(bytearray(10)))
        assert e.value.errno == errno.EBADF
        with pytest.raises(OSError) as e:  # a large op fails in its thread the same way
            await eng.readv([(-1, 0, 1 << 20, memoryview(bytearray(1 << 20)))])
        assert e.value.errno == errno.EBADF
        with pytest.raises(OSError) as e:
            await eng.readv([(0, 0, 20, memoryview(bytearray(10)))])
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError) as e:
            await eng.read_into(0, -1, memoryview(bytearray(10)))
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError) as e:
            await eng.read_into(0, 0, memoryview(b"readonly"))
        assert e.value.errno == errno.EINVAL
        eng.close()
        with pytest.raises(OSError) as e:
            await eng.read_into(0, 0, memoryview(bytearray(1)))
        assert e.value.errno == errno.EBADF

    trio.run(main)


def test_get_engine() -> None:
    assert isinstance(get_engine("posix"), PosixEngine)
    with pytest.raises(OSError) as e:
        get_engine("nope")
    assert e.value.errno == errno.EINVAL
    with pytest.raises(ValueError):
        PosixEngine(queue_depth=0)


def test_liburing_that_this_user_may_not_import_is_an_import_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """liburing rewrites a cache file in its package on every import: a user who does not
    own the install (a loader under a root-owned virtualenv) gets ImportError, which
    sends the loader and the short-circuit reads to the posix engine."""
    import sys
    from importlib.abc import MetaPathFinder

    from pfs.core.engine import import_liburing

    class Refuse(MetaPathFinder):
        def find_spec(self, name: str, path: object, target: object = None) -> None:
            if name == "liburing":
                raise PermissionError(errno.EACCES, "Permission denied",
                                      "liburing/__pycache__/__init__.importer-311.pyc")

    monkeypatch.delitem(sys.modules, "liburing", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
    with pytest.raises(ImportError, match="importer-311.pyc"):
        import_liburing()
    assert "liburing" not in sys.modules
