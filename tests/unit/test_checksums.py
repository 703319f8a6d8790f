"""Block checksums without servers: the sidecar format and the short-circuit reader's
verification (pfs/core/checksums.py), and the planner's failure class for a block that
does not verify (EIO: the next replica; a local read that fails: the network)."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from pfs.client import plan
from pfs.core import checksums as ck
from tests.unit.test_plan import FakeCluster, _layout, _Local, _read, _read_step

BLOCK = ck.BLOCK


def _object(tmp_path: Path, data: bytes, holes: tuple[int, ...] = ()) -> tuple[int, int]:
    """An object file holding ``data`` and its sidecar (blocks in ``holes`` never
    written); their descriptors."""
    fd = os.open(tmp_path / "obj", os.O_RDWR | os.O_CREAT)
    cfd = os.open(tmp_path / "obj.crc", os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, data, 0)
    recs = []
    for blk in range(ck.n_blocks(len(data))):
        part = data[blk * BLOCK:(blk + 1) * BLOCK]
        recs.append((0, 0) if blk in holes else (ck.crc_padded(part), len(part)))
    ck.write_records(cfd, 0, recs)
    return fd, cfd


def _views(buf: bytearray, cuts: list[int]) -> list[memoryview]:
    out, pos, view = [], 0, memoryview(buf)
    for c in [*cuts, len(buf)]:
        out.append(view[pos:c])
        pos = c
    return out


def test_unaligned_reads_verify_and_scatter(tmp_path: Path) -> None:
    data = os.urandom(3 * BLOCK + 77)
    fd, cfd = _object(tmp_path, data)
    for off, n, cuts in [(0, len(data), []), (5, 100, []), (BLOCK - 3, BLOCK + 9, [4, 50]),
                         (3 * BLOCK + 70, 100, [])]:
        buf = bytearray(n)
        counts = ck.read_verified((1, 0), fd, cfd, off, _views(buf, cuts))
        got = min(n, len(data) - off)
        assert sum(counts) == got and bytes(buf[:got]) == data[off:off + got]


def test_a_flipped_byte_names_object_stripe_and_block(tmp_path: Path) -> None:
    data = os.urandom(3 * BLOCK)
    fd, cfd = _object(tmp_path, data)
    os.pwrite(fd, bytes([data[BLOCK + 9] ^ 1]), BLOCK + 9)
    with pytest.raises(ck.ChecksumError) as ei:
        ck.read_verified((7, 2), fd, cfd, BLOCK + 100, [memoryview(bytearray(10))])
    assert ei.value.errno == errno.EIO and ei.value.off == BLOCK
    assert "stripe 2" in str(ei.value) and f"offset {BLOCK}" in str(ei.value)
    buf = bytearray(BLOCK)  # the block before still reads
    assert ck.read_verified((7, 2), fd, cfd, 0, [memoryview(buf)]) == [BLOCK]


def test_holes_read_as_zeros_and_short_objects_fail(tmp_path: Path) -> None:
    data = b"\x01" * (3 * BLOCK)
    fd, cfd = _object(tmp_path, data, holes=(1,))
    buf = bytearray(3 * BLOCK)
    ck.read_verified((1, 0), fd, cfd, 0, [memoryview(buf)])
    assert buf == b"\x01" * BLOCK + bytes(BLOCK) + b"\x01" * BLOCK  # the map says hole
    os.ftruncate(fd, 2 * BLOCK + 10)
    with pytest.raises(ck.ChecksumError, match="short object"):
        ck.read_verified((1, 0), fd, cfd, 2 * BLOCK + 20, [memoryview(bytearray(5))])


def test_a_partial_block_hashes_as_zero_padded() -> None:
    assert ck.crc_padded(b"ab") == ck.crc_padded(b"ab" + bytes(100))
    assert ck.HOLE_CRC == ck.crc_padded(bytes(BLOCK))


class _Failing(FakeCluster):
    """Local reads of the listed stripes fail with EIO (a block that did not verify)."""

    def __init__(self, *a: Any, bad_local: set[int]) -> None:
        super().__init__(*a)
        self.bad_local = bad_local

    def do(self, eff: Any) -> Any:
        if isinstance(eff, plan.LocalRead) and eff.fd in self.bad_local:
            self.local_reads.append(eff.fd)
            raise OSError(errno.EIO, "checksum mismatch")
        return super().do(eff)


def test_a_checksum_error_is_tried_on_the_next_replica() -> None:
    assert plan.classify(OSError(errno.EIO, "x")) is plan.Failure.ELSEWHERE
    cl = FakeCluster(_layout(count=1, replicas=2))
    cl.store(b"z" * 100)
    cl.fail[("s0r0", "read")] = [errno.EIO]
    assert _read(cl, 0, 100) == b"z" * 100
    assert [s for s, _, _ in cl.log] == ["s0r0", "s0r1"]


@pytest.mark.parametrize("step", [False, True])
def test_a_local_read_that_does_not_verify_goes_to_the_servers(step: bool) -> None:
    cl = _Failing(_layout(count=1, replicas=2), bad_local={0})
    cl.store(b"q" * 100)
    local = _Local({0: 0})
    got = _read_step(cl, 0, 100, local=local) if step else _read(cl, 0, 100, local=local)
    assert got == b"q" * 100
    assert cl.local_reads == [0] and [s for s, _, _ in cl.log] == ["s0r0"]
    # a server that finds it bad too: EIO from every replica is EIO
    cl = _Failing(_layout(count=1, replicas=1), bad_local={0})
    cl.store(b"q" * 100)
    cl.fail[("s0r0", "read")] = [errno.EIO]
    with pytest.raises(OSError) as ei:
        _read(cl, 0, 100, local=_Local({0: 0}))
    assert ei.value.errno == errno.EIO


def test_a_network_reply_is_verified_across_scattered_buffers() -> None:
    data = bytearray(os.urandom(3 * BLOCK + 500))
    off = 100  # the reply starts inside block 0: blocks 1 and 2 lie wholly inside
    reply = data[off:]
    crcs = [ck.crc_padded(bytes(data[b * BLOCK:(b + 1) * BLOCK])) for b in (1, 2)]
    assert list(ck.whole_blocks(off, len(reply))) == [1, 2]
    views = _views(reply, [7, BLOCK, BLOCK + 3000])
    ck.verify_reply((3, 1), off, len(reply), views, crcs)
    ck.verify_reply((3, 1), off, len(reply), reply, crcs)
    reply[2 * BLOCK - off + 9] ^= 1  # a byte of block 2 changed on the way
    with pytest.raises(ck.ChecksumError) as ei:
        ck.verify_reply((3, 1), off, len(reply), _views(reply, [5000]), crcs)
    assert ei.value.errno == errno.EIO and ei.value.off == 2 * BLOCK
    with pytest.raises(ck.ChecksumError, match="carries 1 checksums for 2 blocks"):
        ck.verify_reply((3, 1), off, len(reply), reply, crcs[:1])


def test_aligned_reads_land_in_place_verified(tmp_path: Path) -> None:
    """Whole blocks go straight into the destinations (split anywhere), the edges
    through scratch; holes in the middle read as zeros."""
    data = os.urandom(5 * BLOCK + 300)
    fd, cfd = _object(tmp_path, data, holes=(2,))
    want = data[:2 * BLOCK] + bytes(BLOCK) + data[3 * BLOCK:]
    for off, n, cuts in [(0, 4 * BLOCK, []), (0, 4 * BLOCK, [BLOCK + 5, 3 * BLOCK - 1]),
                         (BLOCK - 7, 3 * BLOCK + 20, [8, 2 * BLOCK]),
                         (3 * BLOCK, 3 * BLOCK, [100]), (0, len(data) + 50, [])]:
        vr = ck.VerifiedRead((1, 0), fd, cfd, off, _views(bytearray(n), cuts))
        assert vr.direct and sum(len(d) for d in vr.direct) == len(vr.mid) * BLOCK
        buf = bytearray(b"\xee" * n)
        counts = ck.read_verified((1, 0), fd, cfd, off, _views(buf, cuts))
        got = min(n, len(data) - off)
        assert sum(counts) == got and bytes(buf[:got]) == want[off:off + got]


def test_an_aligned_read_of_a_flipped_byte_never_leaves_it(tmp_path: Path) -> None:
    data = b"\x05" * (4 * BLOCK)
    fd, cfd = _object(tmp_path, data)
    os.pwrite(fd, b"\x07", 2 * BLOCK + 11)
    buf = bytearray(4 * BLOCK)
    with pytest.raises(ck.ChecksumError) as ei:
        ck.read_verified((3, 1), fd, cfd, 0, _views(buf, [2 * BLOCK + 5]))
    assert ei.value.errno == errno.EIO and ei.value.off == 2 * BLOCK
    assert b"\x07" not in buf  # the bad block was read in place, then wiped


def test_views_of_whole_blocks_take_the_fast_path_with_the_same_checks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Destinations cut at block edges (the bulk reads' stripe units) are verified a
    block per slice: holes still read as zeros, a block written only in part (then
    the object grew past it) still verifies, a flipped byte still fails and is wiped."""
    data = bytearray(os.urandom(5 * BLOCK))
    data[2 * BLOCK + 100:3 * BLOCK] = bytes(BLOCK - 100)  # block 2 written up to 100
    fd, cfd = _object(tmp_path, bytes(data), holes=(1,))
    recs = ck.read_records(cfd, 0, 5)
    recs[2] = (ck.crc_padded(bytes(data[2 * BLOCK:2 * BLOCK + 100])), 100)
    ck.write_records(cfd, 0, recs)
    fast = []
    real = ck.VerifiedRead._verify_whole

    def spy(self: ck.VerifiedRead, *a: Any) -> None:
        fast.append(a[0])
        real(self, *a)

    monkeypatch.setattr(ck.VerifiedRead, "_verify_whole", spy)
    want = bytes(data[:BLOCK]) + bytes(BLOCK) + bytes(data[2 * BLOCK:])
    buf = bytearray(b"\xee" * 5 * BLOCK)
    assert ck.read_verified((1, 0), fd, cfd, 0, _views(buf, [BLOCK, 3 * BLOCK])) == \
        [BLOCK, 2 * BLOCK, 2 * BLOCK]
    assert bytes(buf) == want and fast
    os.pwrite(fd, bytes([data[3 * BLOCK + 7] ^ 1]), 3 * BLOCK + 7)
    buf = bytearray(5 * BLOCK)
    with pytest.raises(ck.ChecksumError) as ei:
        ck.read_verified((1, 0), fd, cfd, 0, _views(buf, [BLOCK, 3 * BLOCK]))
    assert ei.value.off == 3 * BLOCK and buf[3 * BLOCK:4 * BLOCK] == bytes(BLOCK)
    assert len(fast) == 2


def test_an_object_shrinking_under_an_aligned_read_is_eio(tmp_path: Path) -> None:
    data = os.urandom(4 * BLOCK)
    fd, cfd = _object(tmp_path, data)
    vr = ck.VerifiedRead((1, 0), fd, cfd, 0, [memoryview(bytearray(4 * BLOCK))])
    vr.got = 3 * BLOCK  # what a read racing a truncate gets
    with pytest.raises(ck.ChecksumError, match="short object"):
        vr.finish()


def test_reads_inside_one_block_keep_holes_and_ends(tmp_path: Path) -> None:
    data = b"\x02" * (2 * BLOCK + 50)
    fd, cfd = _object(tmp_path, data, holes=(1,))
    buf = bytearray(b"\xee" * 100)
    assert ck.read_verified((1, 0), fd, cfd, BLOCK + 10, [memoryview(buf)]) == [100]
    assert buf == bytes(100)  # the map says hole
    assert ck.read_verified((1, 0), fd, cfd, 2 * BLOCK + 40, [memoryview(buf)]) == [10]
    assert buf[:10] == b"\x02" * 10
    assert ck.read_verified((1, 0), fd, cfd, 3 * BLOCK, [memoryview(buf)]) == [0]
    os.ftruncate(fd, BLOCK - 5)  # written past the object's end: short, never zeros
    with pytest.raises(ck.ChecksumError, match="short object"):
        ck.read_verified((1, 0), fd, cfd, BLOCK - 20, [memoryview(bytearray(10))])


def test_a_reply_is_verified_in_parts() -> None:
    """Parts of a reply (what worker threads check) cover it exactly; a bad block is
    found by the part holding it, single buffer or scattered."""
    data = bytearray(os.urandom(6 * BLOCK))
    off = BLOCK
    reply = data[off:]
    crcs = [ck.crc_padded(bytes(data[b * BLOCK:(b + 1) * BLOCK])) for b in range(1, 6)]
    reply[3 * BLOCK + 1] ^= 1  # block 4 of the object, index 3 of the reply's
    for into in (reply, _views(reply, [BLOCK // 2, 2 * BLOCK + 3])):
        ck.verify_reply((3, 1), off, len(reply), into, crcs, range(0, 3))
        ck.verify_reply((3, 1), off, len(reply), into, crcs, range(4, 5))
        with pytest.raises(ck.ChecksumError) as ei:
            ck.verify_reply((3, 1), off, len(reply), into, crcs, range(3, 5))
        assert ei.value.off == 4 * BLOCK


def test_a_verified_read_in_steps_checks_each_once(tmp_path: Path) -> None:
    """VerifiedRead.verify_mid (a driver's steps) then finish(): the same bytes as one
    read; a flip in a step already verified is not missed, one later is found."""
    data = os.urandom(8 * BLOCK + 10)
    fd, cfd = _object(tmp_path, data, holes=(5,))
    want = data[:5 * BLOCK] + bytes(BLOCK) + data[6 * BLOCK:]
    buf = bytearray(len(data) - 30)
    vr = ck.VerifiedRead((1, 0), fd, cfd, 30, _views(buf, [BLOCK + 7]))
    vr.got = os.preadv(fd, vr.direct, vr.direct_off)
    vr.verify_mid(0, 3)
    vr.verify_mid(3, 5)
    assert vr.checked == 5
    assert sum(vr.finish()) == len(buf) and bytes(buf) == want[30:]
    os.pwrite(fd, b"\x00" if data[7 * BLOCK] else b"\x01", 7 * BLOCK)
    vr = ck.VerifiedRead((1, 0), fd, cfd, 30, [memoryview(bytearray(len(buf)))])
    vr.got = os.preadv(fd, vr.direct, vr.direct_off)
    vr.verify_mid(0, 4)
    with pytest.raises(ck.ChecksumError) as ei:
        vr.finish()
    assert ei.value.off == 7 * BLOCK


def _stream(off: int, reply: bytes | bytearray, crcs: Any, pieces: list[int]) -> ck.StreamCheck:
    """A StreamCheck fed ``reply`` cut at ``pieces`` (sizes, the rest last)."""
    sc = ck.StreamCheck((3, 1), off)
    assert sc.on_reply({"n": len(reply), "crcs": crcs}, len(reply)) == sc.update
    view, at = memoryview(bytes(reply)), 0
    for k in pieces + [len(reply)]:
        sc.update(view[at:at + k])
        at = min(len(reply), at + k)
    return sc


@pytest.mark.parametrize("pieces", [[], [1], [7, BLOCK, BLOCK + 3000], [BLOCK - 100] * 5,
                                    [3] * 50])
def test_a_reply_checked_as_it_lands_matches_verify_reply(pieces: list[int]) -> None:
    """A reply fed in any pieces (the receive's) is checked block by block as the
    verification after the receive would: the leading partial block skipped, a changed
    byte EIO at its block, raised only by ``finish`` (never while receiving)."""
    data = bytearray(os.urandom(5 * BLOCK + 700))
    off = 100  # the reply starts inside block 0: blocks 1..4 lie wholly inside
    reply = data[off:]
    crcs = [ck.crc_padded(bytes(data[b * BLOCK:(b + 1) * BLOCK])) for b in range(1, 5)]
    assert list(ck.whole_blocks(off, len(reply))) == [1, 2, 3, 4]
    _stream(off, reply, crcs, pieces).finish()
    reply[3 * BLOCK - off + 9] ^= 1  # a byte of block 3 changed on the way
    sc = _stream(off, reply, crcs, pieces)  # fed whole: no exception on the way
    with pytest.raises(ck.ChecksumError) as ei:
        sc.finish()
    assert ei.value.errno == errno.EIO and ei.value.off == 3 * BLOCK


def test_a_reply_check_refuses_what_does_not_fit() -> None:
    """Checksums that do not fit the reply are not taken (the caller verifies after the
    receive, which says why); a reply fed short of its blocks fails ``finish``."""
    reply = os.urandom(2 * BLOCK)
    crcs = [ck.crc_padded(reply[:BLOCK]), ck.crc_padded(reply[BLOCK:])]
    for bad in (crcs[:1], "x", [1, "2"], None):
        sc = ck.StreamCheck((3, 1), 0)
        assert sc.on_reply({"crcs": bad}, len(reply)) is None and not sc.started
    sc = ck.StreamCheck((3, 1), 0)
    assert sc.start(crcs, len(reply)) and sc.started
    sc.update(memoryview(reply)[:BLOCK + 5])
    with pytest.raises(ck.ChecksumError, match="ended before"):
        sc.finish()
