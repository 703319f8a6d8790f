"""CRC32C algebra (pfs.core.crcmath) against the crc32c package."""
from __future__ import annotations

import random

import crc32c

from pfs.core import crcmath
from pfs.core.checksums import BLOCK


def _raw(data: bytes) -> int:
    """The raw CRC (init 0, no final xor), from the crc32c package."""
    return crc32c.crc32c(data) ^ crcmath.shift_by(len(data))(crcmath.MASK) ^ crcmath.MASK


def test_combine_and_fold_match_one_pass() -> None:
    rnd = random.Random(5)
    for la, lb in ((0, 1), (1, 0), (7, 1000), (BLOCK, BLOCK), (3, BLOCK + 17)):
        a, b = rnd.randbytes(la), rnd.randbytes(lb)
        assert crcmath.combine(crc32c.crc32c(a), crc32c.crc32c(b), lb) == crc32c.crc32c(a + b)
    data = rnd.randbytes(9 * BLOCK)
    crcs = [crc32c.crc32c(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK)]
    assert crcmath.fold(crcs, BLOCK) == crc32c.crc32c(data)
    assert crcmath.fold([], BLOCK) == 0


def test_raw_crcs_combine_linearly() -> None:
    rnd = random.Random(6)
    a, b = rnd.randbytes(300), rnd.randbytes(4096)
    assert crcmath.shift_by(len(b))(_raw(a)) ^ _raw(b) == _raw(a + b)
    assert crcmath.finish_raw(_raw(b), len(b)) == crc32c.crc32c(b)
    assert _raw(bytes(100)) == 0  # zeros through a zero register stay zero


def test_the_gpu_kernels_algorithm_matches_crc32c_on_the_cpu() -> None:
    """pfs.core.gpu_crc's numpy twin: per-thread pieces, a table step per byte, the
    tree combine with the shift matrices handed to the kernel."""
    from pfs.core import gpu_crc

    rnd = random.Random(8)
    data = bytearray(rnd.randbytes(3 * BLOCK)) + bytes(BLOCK)  # and an all-zero block
    data[BLOCK + 5] ^= 0xFF
    want = [crc32c.crc32c(data[i:i + BLOCK]) for i in range(0, len(data), BLOCK)]
    assert gpu_crc.crc_blocks_numpy(bytes(data)) == want
    table, cols, finish = gpu_crc.constants()
    assert len(table) == 256 and len(cols) == 32 * gpu_crc.LEVELS
    assert gpu_crc.THREADS * gpu_crc.PIECE == BLOCK
    assert "@" not in gpu_crc.KERNEL  # every constant filled in
