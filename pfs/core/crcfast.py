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


def _checked(fn: Crc) -> bool:
    """Whether ``fn`` gives the package's value on random buffers, chained too."""
    rnd = random.Random(0x5EED)
    for n in CHECK_SIZES:
        view = memoryview(rnd.randbytes(n + 1))[1:]  # an odd address too
        seed = rnd.getrandbits(32)
        if fn(view, 0) != _pkg.crc32c(view) or fn(view, seed) != _pkg.crc32c(view, seed):
            return False
    return True


def load() -> tuple[Crc | None, str]:
    """The folding function and "", or None and why not."""
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
    fn: Crc = mod.crc32c
    if not _checked(fn):
        return None, "it disagreed with the crc32c package"
    return fn, ""


def _pick() -> Crc:
    fn, why = load()
    if fn is None:
        log.debug("CRC32C by the crc32c package (%s)", why)
        return _pkg.crc32c  # type: ignore[no-any-return]
    return fn


crc32c: Crc = _pick()
"""``crc32c(data, value=0)``: as ``crc32c.crc32c``."""
