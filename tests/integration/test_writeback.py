"""Write-behind (pfs/client/writeback.py, ``FileHandle.write_behind``): the rules alone
with fake writes, then through the native API against real servers."""
from __future__ import annotations

import errno
import os
import random
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from pfs.client.aio import AsyncClient
from pfs.client.writeback import HandleWrites, WriteBack

BIG = 3 * 1024 * 1024 + 123  # crosses stripes: several requests per write


# -- the rules, with writes that only sleep (no processes) ---------------------------
async def _fake_write(log: list[tuple[int, int]], off: int, end: int, delay: float,
                      fail: OSError | None = None) -> None:
    await trio.sleep(delay)
    if fail is not None:
        raise fail
    log.append((off, end))


def test_overlapping_writes_land_in_acceptance_order() -> None:
    """A slow write and a fast one over the same bytes: the fast one waits."""
    async def main() -> None:
        landed: list[tuple[int, int]] = []
        async with trio.open_nursery() as nursery:
            wb = WriteBack(nursery)
            mine = HandleWrites(8)
            await wb.start(1, mine, 0, 100, partial(_fake_write, landed, 0, 100, 0.05))
            await wb.start(1, mine, 200, 300, partial(_fake_write, landed, 200, 300, 0.0))
            assert wb.end(1) == 300 and wb.in_flight(1) == 2
            # overlaps the first: starts once it landed (the other landed meanwhile)
            await wb.start(1, mine, 50, 60, partial(_fake_write, landed, 50, 60, 0.0))
            assert landed == [(200, 300), (0, 100)]
            await wb.drain(1)
            assert not wb.busy(1) and wb.end(1) == 0
        assert landed == [(200, 300), (0, 100), (50, 60)]
    trio.run(main)


def test_a_handle_keeps_at_most_limit_writes_in_flight() -> None:
    async def main() -> None:
        landed: list[tuple[int, int]] = []
        most = 0
        async with trio.open_nursery() as nursery:
            wb = WriteBack(nursery)
            mine = HandleWrites(3)
            for i in range(20):
                await wb.start(1, mine, i * 10, i * 10 + 10,
                               partial(_fake_write, landed, i * 10, i * 10 + 10, 0.01))
                most = max(most, wb.in_flight(1))
            await wb.drain(1)
        assert most == 3 and len(landed) == 20
    trio.run(main)


def test_the_first_error_is_kept_and_reported_once() -> None:
    async def main() -> None:
        landed: list[tuple[int, int]] = []
        async with trio.open_nursery() as nursery:
            wb = WriteBack(nursery)
            mine = HandleWrites(4)
            await wb.start(1, mine, 0, 10, partial(_fake_write, landed, 0, 10, 0.0,
                                                   OSError(errno.ENOSPC, "full")))
            await wb.start(1, mine, 10, 20, partial(_fake_write, landed, 10, 20, 0.01,
                                                    OSError(errno.EIO, "later")))
            await wb.drain(1)
        err = mine.take_error("/f")
        assert err is not None and err.errno == errno.ENOSPC
        assert "/f" in str(err) and "offset 0" in str(err)
        assert mine.take_error("/f") is None
    trio.run(main)


def test_reads_wait_for_the_writes_they_would_see() -> None:
    async def main() -> None:
        landed: list[tuple[int, int]] = []
        async with trio.open_nursery() as nursery:
            wb = WriteBack(nursery)
            mine = HandleWrites(4)
            await wb.start(1, mine, 0, 10, partial(_fake_write, landed, 0, 10, 0.02))
            await wb.start(1, mine, 100, 200, partial(_fake_write, landed, 100, 200, 0.05))
            await wb.before_read(1, 0, 5, known_size=1000)  # only the write it overlaps
            assert landed == [(0, 10)]
            await wb.before_read(1, 150, 5, known_size=100)  # past the size: all of them
            assert landed == [(0, 10), (100, 200)]
            await wb.before_read(2, 0, 5, known_size=0)  # another inode: nothing to wait
    trio.run(main)


# -- through the native API, against the shared cluster --------------------------------
def _run(client_toml: Path, fn: Callable[[AsyncClient], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with AsyncClient.connect(config=client_toml) as ac:
            return await fn(ac)
    return trio.run(main)


def test_overlapping_writes_behind_keep_their_order(client, client_toml, workdir) -> None:
    """Writes of several stripes and small ones over them, all in flight at once: the
    file is what the same writes done one after another give."""
    path = f"{workdir}/order"
    rng = random.Random(7)
    model = bytearray()
    writes = []
    for i in range(40):
        off = rng.randrange(0, BIG)
        size = BIG if i % 8 == 0 else rng.randrange(1, 200_000)
        data = bytes([i + 1]) * size
        writes.append((off, data))
        end = off + size
        model[len(model):end] = bytes(max(0, end - len(model)))
        model[off:end] = data

    async def go(ac: AsyncClient) -> int:
        f = await ac.open(path, "wb")
        most = 0
        for off, data in writes:
            assert await f.write_behind(data, off, limit=8) == len(data)
            most = max(most, ac.writes.in_flight(f.ino))
        # what a stat says meanwhile: the size once they land
        assert (await ac.stat(path)).st_size == len(model)
        await f.close()
        return most

    assert _run(client_toml, go) > 1  # several were in flight together
    assert client.read_file(path) == bytes(model)


def test_a_read_of_a_range_in_flight_sees_the_new_bytes(client, client_toml, workdir) -> None:
    path = f"{workdir}/read"
    client.write_file(path, b"o" * 1000)
    new = os.urandom(BIG)

    async def go(ac: AsyncClient) -> None:
        f = await ac.open(path, "r+b")
        await f.write_behind(new, 0)
        assert ac.writes.busy(f.ino)  # under way, not landed: the read must wait
        buf = bytearray(100)
        assert await f.pread_into(buf, 500) == 100 and buf == new[500:600]
        # past the size known before the write landed: the whole write is read back
        await f.write_behind(b"tail", BIG)
        buf = bytearray(10)
        assert await f.pread_into(buf, BIG) == 4 and buf[:4] == b"tail"
        # another handle of the file, in the same client, sees them too
        g = await ac.open(path, "rb")
        await f.write_behind(b"again", 10)
        buf = bytearray(5)
        assert await g.pread_into(buf, 10) == 5 and buf == b"again"
        await g.close()
        await f.close()

    _run(client_toml, go)
    assert client.read_file(path) == new[:10] + b"again" + new[15:] + b"tail"


def _failing_file(client, workdir: str, name: str) -> str:
    """A file whose writes at FAR fail on the data server (EFBIG: past the largest
    object; one stripe, so the object offset is the file offset)."""
    path = f"{workdir}/{name}"
    client.write_file(path, b"")
    client.set_layout(path, count=1)
    return path


FAR = (1 << 63) - 8


def test_a_failed_write_behind_is_raised_by_the_next_call(client, client_toml,
                                                          workdir) -> None:
    path = _failing_file(client, workdir, "fails")

    async def go(ac: AsyncClient) -> None:
        f = await ac.open(path, "r+b")
        # accepted, fails in the background; the next flush reports it, once
        assert await f.write_behind(b"x" * 16, FAR) == 16
        await f.drain()
        with pytest.raises(OSError) as exc:
            await f.commit()
        assert exc.value.errno == errno.EFBIG and path in str(exc.value)
        await f.commit()
        # ... or the next write
        await f.write_behind(b"x" * 16, FAR)
        await f.drain()
        with pytest.raises(OSError) as exc:
            await f.write_behind(b"fine", 0)
        assert exc.value.errno == errno.EFBIG
        # ... or the next fsync
        await f.write_behind(b"x" * 16, FAR)
        with pytest.raises(OSError) as exc:
            await f.fsync()
        assert exc.value.errno == errno.EFBIG
        # ... or the close, which closes the handle all the same
        await f.write_behind(b"kept", 0)
        await f.write_behind(b"x" * 16, FAR)
        with pytest.raises(OSError) as exc:
            await f.close()
        assert exc.value.errno == errno.EFBIG and f.closed
        # an error is the handle's own: another handle of the file reports nothing
        g = await ac.open(path, "r+b")
        h = await ac.open(path, "r+b")
        await g.write_behind(b"x" * 16, FAR)
        await h.write_behind(b"KEPT", 0)
        await h.close()
        with pytest.raises(OSError):
            await g.close()

    _run(client_toml, go)
    assert client.read_file(path) == b"KEPT"


def test_native_close_and_truncate_report_a_failed_write_behind(client, client_toml,
                                                                 workdir) -> None:
    """The plain FileHandle methods give a native user of write_behind the mount's
    guarantees: close raises the deferred error with its errno (and still closes),
    truncate waits for the writes in flight and raises it first, and pread_into reads
    back bytes still in flight."""
    path = _failing_file(client, workdir, "native")

    async def go(ac: AsyncClient) -> bytes:
        f = await ac.open(path, "r+b")
        await f.write_behind(b"x" * 16, FAR)  # fails in the background
        with pytest.raises(OSError) as exc:
            await f.close()
        assert exc.value.errno == errno.EFBIG and path in str(exc.value)
        assert f.closed and not ac.writes.busy(f.ino)
        with pytest.raises(ValueError):
            await f.pread_into(bytearray(1), 0)

        f = await ac.open(path, "r+b")
        data = os.urandom(BIG)
        await f.write_behind(data, 0)
        assert ac.writes.busy(f.ino)  # in flight: the read waits for it
        buf = bytearray(BIG + 10)
        assert await f.pread_into(buf, 0) == BIG and buf[:BIG] == data
        await f.write_behind(b"x" * 16, FAR)
        with pytest.raises(OSError) as exc:
            await f.truncate(1000)
        assert exc.value.errno == errno.EFBIG and not ac.writes.busy(f.ino)
        await f.truncate(1000)  # reported once: this one goes through
        await f.close()
        return data

    data = _run(client_toml, go)
    assert client.read_file(path) == data[:1000]


def test_o_append_writes_behind_go_after_the_writes_in_flight(client, client_toml,
                                                              workdir) -> None:
    path = f"{workdir}/append"
    first = os.urandom(BIG)

    async def go(ac: AsyncClient) -> None:
        f = await ac.open(path, "wb")
        a = await ac.open(path, "ab")
        await f.write_behind(first, 0)  # in flight: the file will end at BIG
        for i in range(5):
            await a.write_behind(b"%d" % i, 0)  # the offset is the end of file
        await a.close()
        await f.close()

    _run(client_toml, go)
    assert client.read_file(path) == first + b"01234"


def test_truncate_after_writes_behind(client, client_toml, workdir) -> None:
    """A size set by the mount's path (truncate_ino) lands after the writes in flight
    and is not undone by a later close of the writer."""
    path = f"{workdir}/trunc"

    async def go(ac: AsyncClient) -> None:
        f = await ac.open(path, "wb")
        await f.write_behind(os.urandom(BIG), 0)
        attr = await ac.truncate_ino(f.ino, 1000)
        assert attr.st_size == 1000
        await f.close()
        assert (await ac.stat(path)).st_size == 1000

    _run(client_toml, go)
    assert client.stat(path).st_size == 1000
