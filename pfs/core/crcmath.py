"""CRC32C algebra: appending zeros as a linear map, so CRCs of pieces combine.

CRC32C (Castagnoli, reflected, init and final xor ``0xFFFFFFFF``) of a message ``A + B``
is ``shift(crc(A), len(B)) ^ crc(B)``, where ``shift(c, n)`` — feeding ``n`` zero bytes
through the register — is linear over GF(2): a 32x32 bit matrix, applied here through four
256-entry tables (:class:`Shift`). Two uses:

- a reader checks a run of whole blocks with *one* CRC pass over all of its bytes
  against the stored block CRCs folded together (:func:`fold`), instead of one call per
  block (fewer calls, one GIL release; a mismatch is then located block by block);
- the GPU kernel (:mod:`pfs.core.gpu_crc`) hashes a block in parallel pieces and
  combines them with the same maps.

The *raw* CRC (init 0, no final xor) is what the pieces combine with:
``raw(A + B) = shift(raw(A), len(B)) ^ raw(B)``; a block's CRC32C is
``raw(block) ^ shift(0xFFFFFFFF, len(block)) ^ 0xFFFFFFFF`` (:func:`finish_raw`).
"""
from __future__ import annotations

import functools

POLY = 0x82F63B78  # CRC32C, bit-reflected
MASK = 0xFFFFFFFF


def _byte_step(r: int) -> int:
    """The register after one zero byte."""
    for _ in range(8):
        r = (r >> 1) ^ (POLY if r & 1 else 0)
    return r


def _apply(cols: list[int], v: int) -> int:
    out, i = 0, 0
    while v:
        if v & 1:
            out ^= cols[i]
        v >>= 1
        i += 1
    return out


def _square(cols: list[int]) -> list[int]:
    return [_apply(cols, c) for c in cols]


@functools.lru_cache(maxsize=64)
def shift_columns(nbytes: int) -> tuple[int, ...]:
    """The matrix of ``shift(., nbytes)`` as 32 columns (the image of each bit)."""
    result = [1 << i for i in range(32)]  # identity
    power = [_byte_step(1 << i) for i in range(32)]  # one byte
    n = nbytes
    while n:
        if n & 1:
            result = [_apply(power, c) for c in result]
        n >>= 1
        if n:
            power = _square(power)
    return tuple(result)


class Shift:
    """``shift(., nbytes)`` as four byte tables: ``s(c)`` costs four lookups."""

    __slots__ = ("nbytes", "tables")

    def __init__(self, nbytes: int) -> None:
        cols = list(shift_columns(nbytes))
        self.nbytes = nbytes
        self.tables = [[_apply(cols[8 * k:8 * k + 8], b) for b in range(256)]
                       for k in range(4)]

    def __call__(self, c: int) -> int:
        t0, t1, t2, t3 = self.tables
        return t0[c & 0xFF] ^ t1[(c >> 8) & 0xFF] ^ t2[(c >> 16) & 0xFF] ^ t3[c >> 24]


@functools.lru_cache(maxsize=8)
def shift_by(nbytes: int) -> Shift:
    return Shift(nbytes)


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``."""
    return shift_by(len_b)(crc_a) ^ crc_b


def fold(crcs: list[int], block: int) -> int:
    """CRC32C of consecutive blocks of ``block`` bytes each, from their CRCs."""
    s = shift_by(block)
    acc = 0
    first = True
    for c in crcs:
        acc = c if first else s(acc) ^ c
        first = False
    return acc


def finish_raw(raw: int, nbytes: int) -> int:
    """CRC32C of an ``nbytes`` message whose raw CRC (init 0, no final xor) is ``raw``."""
    return raw ^ shift_by(nbytes)(MASK) ^ MASK
