"""pfs.core.crcfast: the folding CRC32C gives crc32c's values (every length around its
thresholds, odd addresses, chained), its constants are the polynomial's, and it is
used only when built, private to this user and checked."""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import crc32c
import pytest

from pfs.core import crcfast

CASTAGNOLI = 0x1EDC6F41  # x^32 + ... (the normal form, x^32 implied)


def _xpow_mod(n: int) -> int:
    r = 1
    for _ in range(n):
        r <<= 1
        if r & (1 << 32):
            r ^= (1 << 32) | CASTAGNOLI
    return r


def _fold_constant(n: int) -> int:
    """x^n mod P, bit-reflected, shifted left by one (the 33-bit form CLMUL takes)."""
    return int(f"{_xpow_mod(n):032b}"[::-1], 2) << 1


def test_the_constants_are_the_polynomials() -> None:
    src = crcfast.SOURCE.read_text()
    for name, dist in (("k2048", 2048), ("k512", 512)):
        m = re.search(name + r" = _mm512_set_epi64\(0x([0-9a-f]+), 0x([0-9a-f]+)", src)
        assert m is not None, name
        assert int(m.group(1), 16) == _fold_constant(dist - 32)
        assert int(m.group(2), 16) == _fold_constant(dist + 32)
    m = re.search(r"k128 = _mm_set_epi64x\(0x([0-9a-f]+), 0x([0-9a-f]+)\)", src)
    assert m is not None
    assert int(m.group(1), 16) == _fold_constant(96)
    assert int(m.group(2), 16) == _fold_constant(160)


def _capable() -> bool:
    """A C compiler and a CPU with what the folding path needs."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    need = {"sse4_2", "pclmulqdq", "avx512f", "avx512vl", "vpclmulqdq"}
    return bool(shutil.which("cc") or shutil.which("gcc")) and need <= flags


def _folding() -> crcfast.Crc:
    fn, why = crcfast.load()
    if fn is None:  # no compiler or no VPCLMULQDQ here: the package's function is used
        assert not _capable(), f"the folding CRC should load here: {why}"
        assert why and crcfast.crc32c is crc32c.crc32c
        return crcfast.crc32c
    assert crcfast.crc32c is not crc32c.crc32c
    return fn


def test_every_length_and_alignment_gives_crc32c_values() -> None:
    fn = _folding()
    rnd = random.Random(7)
    data = rnd.randbytes(1 << 20)
    lengths = [*range(0, 1300), *range(4096 - 70, 4096 + 70), 65535, 65536, 65537,
               (1 << 20) - 9]
    for n in lengths:
        for start in (0, 1, 3, 8):
            view = memoryview(data)[start:start + n]
            assert fn(view) == crc32c.crc32c(view), (n, start)
    for _ in range(200):  # chained: a value carried over from an earlier part
        n, seed = rnd.randrange(2 << 20), rnd.getrandbits(32)
        view = memoryview(rnd.randbytes(n))
        assert fn(view, seed) == crc32c.crc32c(view, seed), n
        cut = rnd.randrange(n + 1)
        assert fn(view[cut:], fn(view[:cut])) == crc32c.crc32c(view)
    assert fn(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert fn(bytearray(3000)) == crc32c.crc32c(bytes(3000))  # zeros; a bytearray


def test_copy_gives_the_crc_of_what_it_copied() -> None:
    """crc32c_copy (one pass where the CPU folds; else a copy, then crc32c): every
    length and alignment, the bytes past the copy left alone."""
    _folding()
    rnd = random.Random(11)
    data = rnd.randbytes(1 << 20)
    for fn in (crcfast.crc32c_copy, crcfast._copy_then_crc):
        for n in [*range(0, 600, 7), 1023, 1024, 1025, 4096 + 65, 65536 + 3, (1 << 20) - 9]:
            for start in (0, 5):
                src = memoryview(data)[start:start + n]
                dst = bytearray(b"\xee" * (n + 10))
                seed = rnd.getrandbits(32)
                assert fn(memoryview(dst)[3:], src, seed) == crc32c.crc32c(src, seed), n
                assert dst[3:3 + n] == src
                assert dst[:3] == b"\xee" * 3 and dst[3 + n:] == b"\xee" * 7
        with pytest.raises(ValueError):
            fn(bytearray(3), b"four")


def test_not_used_when_turned_off_or_not_private(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(crcfast.ENV_OFF, "1")
    fn, why = crcfast.load()
    assert fn is None and crcfast.ENV_OFF in why
    monkeypatch.delenv(crcfast.ENV_OFF)
    shared = tmp_path / "shared"
    (shared / "pfs").mkdir(parents=True)
    os.chmod(shared / "pfs", 0o777)  # anyone could replace the library there
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    fn, why = crcfast.load()
    assert fn is None and ("not private" in why or "compiler" in why), why
