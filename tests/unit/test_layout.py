"""Striping math: every range maps to pieces that reassemble the range exactly."""
from __future__ import annotations

import errno

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pfs.core.layout import Layout, locate, object_size, pieces, stripe_extents

units = st.sampled_from([4096, 8192, 65536, 1 << 20])
counts = st.integers(min_value=1, max_value=8)


def brute_locate(unit: int, count: int, off: int) -> tuple[int, int]:
    # walk the file unit by unit, counting how many units each stripe has received
    filled = [0] * count
    block = 0
    while (block + 1) * unit <= off:
        filled[block % count] += unit
        block += 1
    return block % count, filled[block % count] + off - block * unit


@given(units, counts, st.integers(min_value=0, max_value=50 * 65536))
def test_locate_matches_brute_force(unit: int, count: int, off: int) -> None:
    if off // unit > 2000:
        off = off % (2000 * unit)
    assert locate(unit, count, off) == brute_locate(unit, count, off)


@given(units, counts, st.integers(0, 1 << 34), st.integers(0, 1 << 24))
def test_pieces_cover_range_exactly(unit: int, count: int, off: int, length: int) -> None:
    ps = list(pieces(unit, count, off, length))
    assert sum(p.length for p in ps) == length
    pos = off
    for p in ps:
        assert p.file_off == pos
        assert 0 < p.length <= unit
        # a piece never crosses a stripe unit boundary
        assert p.file_off // unit == (p.file_off + p.length - 1) // unit
        assert (p.stripe, p.obj_off) == locate(unit, count, p.file_off)
        pos += p.length


@settings(max_examples=100, deadline=None)
@given(units, counts, st.integers(0, 1 << 20), st.integers(1, 1 << 18))
def test_pieces_reassemble_bytes(unit: int, count: int, off: int, length: int) -> None:
    """Scatter a range into per-stripe objects and gather it back, byte for byte."""
    data = bytes(range(256)) * (length // 256 + 1)
    data = data[off % 256:off % 256 + length]
    objects: dict[int, bytearray] = {}
    for p in pieces(unit, count, off, length):
        obj = objects.setdefault(p.stripe, bytearray())
        if len(obj) < p.obj_off + p.length:
            obj.extend(bytes(p.obj_off + p.length - len(obj)))
        obj[p.obj_off:p.obj_off + p.length] = data[p.file_off - off:p.file_off - off + p.length]
    out = bytearray(length)
    for p in pieces(unit, count, off, length):
        out[p.file_off - off:p.file_off - off + p.length] = objects[p.stripe][p.obj_off:p.obj_off + p.length]
    assert bytes(out) == data


@given(units, counts, st.integers(0, 1 << 26))
def test_object_sizes_sum_to_file_size(unit: int, count: int, size: int) -> None:
    sizes = [object_size(unit, count, s, size) for s in range(count)]
    assert sum(sizes) == size
    if size:
        last = size - 1
        stripe, obj_off = locate(unit, count, last)
        assert sizes[stripe] == obj_off + 1


@given(units, counts, st.integers(0, 1 << 26), st.integers(0, 1 << 24))
def test_extents_are_contiguous_per_stripe(unit: int, count: int, off: int, length: int) -> None:
    for ext in stripe_extents(unit, count, off, length):
        pos = ext.obj_off
        for p in ext.pieces:
            assert p.stripe == ext.stripe and p.obj_off == pos
            pos += p.length
        assert pos == ext.obj_off + ext.length


@pytest.mark.parametrize("unit,count,replicas", [(1000, 1, 1), (0, 1, 1), (4096, 0, 1),
                                                 (4096, 1000, 1), (4096, 2, 0)])
def test_bad_geometry_is_einval(unit: int, count: int, replicas: int) -> None:
    with pytest.raises(OSError) as ei:
        Layout(unit, count, replicas)
    assert ei.value.errno == errno.EINVAL


def test_wire_round_trip() -> None:
    lay = Layout(1 << 20, 2, 2, (("a", "b"), ("c", "d")))
    assert Layout.from_wire(lay.to_wire()) == lay
