"""CRC32C of large values at about twice the ``crc32c`` package's speed: what a KV get
spends most of its CPU on after the copy (a 2 MiB block: ~70 us at ~30 GB/s, against
~45 us for the kernel to copy it out of the page cache).

That package uses the crc32 instruction, 8 bytes a cycle at best. ``crcfold.c`` beside
this file folds the buffer by carry-less multiplication over AVX-512 registers
(VPCLMULQDQ) instead; it is built with the system's C compiler at first use into the
user's cache directory (as the io500 loops are) and checked against the package on
random buffers before it is used. Without a compiler, on a CPU without those
instructions, when the check fails, or with ``PFS_CRC_NO_C=1``, :func:`crc32c` is the
package's own function: the same values, at its speed.

:func:`crc32c_copy` copies a buffer and returns its CRC in the same pass (each 64-byte
vector folded is also stored): the node tier's hit, a copy out of shared memory and its
check, then costs about the copy alone. Without the folding module it is a copy, then
:func:`crc32c`.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import random
import stat
import subprocess
import sysconfig
from pathlib import Path
from typing import Any, Protocol

import crc32c as _pkg

from pfs.core.cbuild import build, cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("crcfold.c")
ENV_OFF = "PFS_CRC_NO_C"
CHECK_SIZES = (0, 1, 7, 255, 1023, 1024, 1025, 4096 + 3, 65536 + 17, 300_001)


class Crc(Protocol):
    def __call__(self, data: Any, value: int = 0, /) -> int: ...


def _target() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / f"_pfs_crcfold-{digest}{suffix}"


def _owned(path: Path) -> bool:
    """Whether ``path`` and its folder are this user's and no one else may write them
    (a library loaded from there runs as this user)."""
    for p in (path.parent, path):
        st = p.stat()
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o022:
            return False
    return True


class CopyCrc(Protocol):
    def __call__(self, dst: Any, src: Any, value: int = 0, /) -> int: ...


def _checked(fn: Crc, copy: CopyCrc) -> bool:
    """Whether ``fn`` gives the package's value on random buffers, chained too, and
    ``copy`` copies them whole and gives the same value."""
    rnd = random.Random(0x5EED)
    for n in CHECK_SIZES:
        view = memoryview(rnd.randbytes(n + 1))[1:]  # an odd address too
        seed = rnd.getrandbits(32)
        if fn(view, 0) != _pkg.crc32c(view) or fn(view, seed) != _pkg.crc32c(view, seed):
            return False
        dst = bytearray(n + 3)
        got = copy(memoryview(dst)[1:], view, seed)
        if got != _pkg.crc32c(view, seed) or dst[1:n + 1] != view:
            return False
    return True


def _copy_then_crc(dst: Any, src: Any, value: int = 0, /) -> int:
    out = memoryview(dst).cast("B")
    n = memoryview(src).nbytes
    out[:n] = memoryview(src).cast("B")
    return crc32c(out[:n], value)


def _load() -> tuple[Any, str]:
    """The built module, checked, and "", or None and why not."""
    if os.environ.get(ENV_OFF):
        return None, f"{ENV_OFF} is set"
    try:
        path = _target()
        if not path.exists():
            build(SOURCE, path, ("-I", sysconfig.get_paths()["include"]))
        if not _owned(path):
            return None, f"{path} is not private to this user"
        spec = importlib.util.spec_from_file_location("_pfs_crcfold", path)
        if spec is None or spec.loader is None:
            return None, f"{path} cannot be loaded"
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        return None, str(exc)
    if not mod.folds():
        return None, "this CPU has no VPCLMULQDQ over AVX-512"
    if not _checked(mod.crc32c, mod.crc32c_copy):
        return None, "it disagreed with the crc32c package"
    return mod, ""


def load() -> tuple[Crc | None, str]:
    """The folding function and "", or None and why not."""
    mod, why = _load()
    return (mod.crc32c if mod is not None else None), why


def _pick() -> tuple[Crc, CopyCrc | None]:
    mod, why = _load()
    if mod is None:
        log.debug("CRC32C by the crc32c package (%s)", why)
        return _pkg.crc32c, None
    return mod.crc32c, mod.crc32c_copy


crc32c: Crc
_copy: CopyCrc | None
crc32c, _copy = _pick()
"""``crc32c(data, value=0)``: as ``crc32c.crc32c``."""
crc32c_copy: CopyCrc = _copy if _copy is not None else _copy_then_crc
"""``crc32c_copy(dst, src, value=0)``: copy ``src`` to the start of ``dst`` (at least as
long) and return ``crc32c(src, value)``, in one pass over the bytes where the CPU folds
(a KV hit's copy out of shared memory and its check cost about the copy alone)."""
