"""UringEngine against PosixEngine: identical bytes on random batches; O_DIRECT errors."""
from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import pfs.core.engine as engine_mod
from pfs.core.engine import (
    Op,
    PosixEngine,
    UringEngine,
    aligned_buffer,
    get_engine,
    uring_unavailable,
)

pytestmark = pytest.mark.skipif(uring_unavailable() is not None,
                                reason=f"no io_uring here: {uring_unavailable()}")

SIZE = 6 << 20


@pytest.fixture
def model(tmp_path: Path) -> Iterator[tuple[int, bytes, Path]]:
    data = random.Random(42).randbytes(SIZE)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        yield fd, data, path
    finally:
        os.close(fd)


def random_ops(rng: random.Random, fd: int, n: int) -> list[Op]:
    ops = []
    for _ in range(n):
        off = rng.randrange(SIZE + 20_000)
        length = rng.choice([0, 1, 7, 4096, 5000, 65_536, 70_001, 1 << 20, (2 << 20) + 3])
        ops.append(Op(fd, off, length, memoryview(bytearray(length + rng.randrange(3)))))
    return ops


@pytest.mark.parametrize("qd,chunk", [(1, 4096), (4, 64 * 1024), (32, 1 << 20), (256, 4 << 20)])
def test_random_reads_match_posix(model: tuple[int, bytes, Path], qd: int, chunk: int) -> None:
    fd, data, _ = model
    rng = random.Random(qd * 7 + chunk)
    ops_u = random_ops(rng, fd, 60)
    ops_p = [Op(o.fd, o.offset, o.length, memoryview(bytearray(len(o.buf)))) for o in ops_u]

    async def main() -> tuple[list[int], list[int]]:
        u = UringEngine(queue_depth=qd, chunk=chunk)
        p = PosixEngine(queue_depth=qd)
        try:
            return await u.submit(ops_u), await p.submit(ops_p)
        finally:
            u.close()
            p.close()

    cu, cp = trio.run(main)
    assert cu == cp
    for ou, op, n in zip(ops_u, ops_p, cu, strict=True):
        assert n == len(data[ou.offset:ou.offset + ou.length])
        assert bytes(ou.buf) == bytes(op.buf)
        assert ou.buf[:n] == data[ou.offset:ou.offset + n]


def test_concurrent_tasks_share_a_small_ring(model: tuple[int, bytes, Path]) -> None:
    fd, data, _ = model
    results: dict[int, tuple[list[Op], list[int]]] = {}

    async def task(i: int, eng: UringEngine) -> None:
        ops = random_ops(random.Random(i), fd, 12)
        results[i] = (ops, await eng.submit(ops))

    async def main() -> None:
        eng = UringEngine(queue_depth=3, chunk=16 * 1024)
        async with trio.open_nursery() as n:
            for i in range(10):
                n.start_soon(task, i, eng)
        eng.close()

    trio.run(main)
    for ops, counts in results.values():
        for op, c in zip(ops, counts, strict=True):
            assert bytes(op.buf[:c]) == data[op.offset:op.offset + op.length]


def test_writes_fsync_and_read_back(tmp_path: Path) -> None:
    rng = random.Random(5)
    fd = os.open(tmp_path / "w", os.O_RDWR | os.O_CREAT, 0o600)
    model = bytearray(3 << 20)
    ops = []
    for i in range(0, len(model), 300_000):  # disjoint: a batch runs in no given order
        n = min(rng.randrange(1, 300_000), len(model) - i)
        chunk = rng.randbytes(n)
        model[i:i + n] = chunk
        ops.append(Op(fd, i, n, chunk, True))

    async def main() -> None:
        eng = UringEngine(chunk=64 * 1024)
        assert await eng.submit(ops) == [op.length for op in ops]
        assert await eng.write(fd, len(model), b"tail") == 4
        await eng.fsync(fd)
        eng.close()

    trio.run(main)
    os.close(fd)
    got = (tmp_path / "w").read_bytes()
    assert got == bytes(model) + b"tail"


def test_registered_files_and_buffers(model: tuple[int, bytes, Path]) -> None:
    fd, data, _ = model
    fixed = [bytearray(1 << 20), bytearray(4096)]

    async def main() -> None:
        eng = UringEngine()
        eng.register_files([fd])
        eng.register_buffers(fixed)
        assert await eng.read_into(fd, 12345, memoryview(fixed[0])) == 1 << 20
        assert await eng.read_into(fd, 7, memoryview(fixed[1])[:100]) == 100
        assert await eng.read_into(fd, SIZE - 10, memoryview(fixed[1])) == 10  # EOF
        other = bytearray(5000)
        assert await eng.read_into(fd, 1, memoryview(other)[3:]) == 4997
        assert bytes(other[3:]) == data[1:4998]
        eng.unregister_buffers()
        eng.unregister_files()
        eng.close()

    trio.run(main)
    assert bytes(fixed[0]) == data[12345:12345 + (1 << 20)]
    assert bytes(fixed[1][:10]) == data[-10:]
    with pytest.raises(TypeError):
        trio.run(lambda: _register_bad())


async def _register_bad() -> None:
    eng = UringEngine()
    try:
        eng.register_buffers([b"bytes are read-only"])  # type: ignore[list-item]
    finally:
        eng.close()


def test_cancellation_leaves_nothing_in_flight(model: tuple[int, bytes, Path]) -> None:
    fd, data, _ = model

    async def main() -> None:
        eng = UringEngine(queue_depth=2, chunk=4096, async_min=0)
        buf = bytearray(SIZE)
        with trio.move_on_after(0.0005):
            await eng.read_into(fd, 0, memoryview(buf))
        assert eng._inflight == 0  # shielded: every SQE completed before the call returned
        small = bytearray(10)
        assert await eng.read_into(fd, 100, memoryview(small)) == 10
        assert bytes(small) == data[100:110]
        eng.close()

    trio.run(main)


def test_errors(model: tuple[int, bytes, Path]) -> None:
    fd, _, _ = model

    async def main() -> None:
        eng = get_engine("uring")
        assert isinstance(eng, UringEngine)
        for bad in (-1, 1_000_000):
            with pytest.raises(OSError) as e:
                await eng.read_into(bad, 0, memoryview(bytearray(10)))
            assert e.value.errno == errno.EBADF
        with pytest.raises(OSError) as e:  # the first failing op of a batch is raised
            await eng.readv([(fd, 0, 10, memoryview(bytearray(10))),
                             (1_000_000, 0, 1 << 20, memoryview(bytearray(1 << 20)))])
        assert e.value.errno == errno.EBADF
        with pytest.raises(OSError) as e:
            await eng.read_into(fd, 0, memoryview(b"readonly"))
        assert e.value.errno == errno.EINVAL
        eng.close()
        with pytest.raises(OSError) as e:
            await eng.read_into(fd, 0, memoryview(bytearray(1)))
        assert e.value.errno == errno.EBADF

    trio.run(main)
    with pytest.raises(ValueError):
        UringEngine(chunk=10)


def test_unavailable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_mod, "uring_unavailable", lambda: "io_uring_disabled is 2")
    with pytest.raises(OSError) as e:
        get_engine("uring")
    assert e.value.errno == errno.ENOTSUP
    assert "io_uring_disabled is 2" in str(e.value) and "posix" in str(e.value)


def _direct_fd(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:  # tmpfs and some overlay filesystems refuse O_DIRECT
        pytest.skip(f"O_DIRECT not supported on {path.parent}: {exc}")


@pytest.mark.parametrize("name", ["posix", "uring"])
def test_direct_reads_and_alignment_errors(model: tuple[int, bytes, Path], name: str) -> None:
    _, data, path = model
    fd = _direct_fd(path)

    async def main() -> None:
        eng = get_engine(name)
        buf = aligned_buffer(1 << 20)
        assert await eng.read_into(fd, 8192, buf) == 1 << 20
        assert bytes(buf) == data[8192:8192 + (1 << 20)]
        tail = aligned_buffer(8192)
        assert await eng.read_into(fd, SIZE - 4096, tail) == 4096  # short at end of file
        cases = [(4096, aligned_buffer(8192)[1:4097], "buffer address"),
                 (100, aligned_buffer(4096), "file offset 100"),
                 (0, aligned_buffer(1000), "length 1000")]
        for off, b, what in cases:
            with pytest.raises(OSError) as e:
                await eng.read_into(fd, off, b)
            assert e.value.errno == errno.EINVAL
            assert "O_DIRECT" in str(e.value) and what in str(e.value)
        eng.close()

    try:
        trio.run(main)
    finally:
        os.close(fd)


def test_direct_engine_checks_before_submitting(model: tuple[int, bytes, Path]) -> None:
    _, data, path = model
    _direct_fd(path)

    async def main() -> None:
        eng = UringEngine(direct=True)
        fd = eng.open(path)
        try:
            with pytest.raises(OSError) as e:
                await eng.read_into(fd, 0, memoryview(bytearray(4096))[1:])
            assert e.value.errno == errno.EINVAL and "length 4095" in str(e.value)
            buf = aligned_buffer(4096)
            assert await eng.read_into(fd, 4096, buf) == 4096
            assert bytes(buf) == data[4096:8192]
        finally:
            os.close(fd)
            eng.close()

    trio.run(main)


def test_aligned_buffer() -> None:
    for align in (512, 4096, 1 << 16):
        b = aligned_buffer(12345, align)
        assert len(b) == 12345 and not b.readonly
        assert engine_mod.buffer_address(b) % align == 0
    with pytest.raises(ValueError):
        aligned_buffer(10, 3000)


def test_auto_is_uring_where_available() -> None:
    eng = get_engine("auto")
    try:
        assert isinstance(eng, UringEngine)
        assert engine_mod.default_engine() == "uring"
    finally:
        eng.close()
