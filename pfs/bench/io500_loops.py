"""The C loops of ``pfs bench io500`` (io500_loops.c beside this file): built with the
system's C compiler at first use into the user's cache directory and loaded with ctypes.

Python's cost per system call (a few microseconds) decides the rate of an mdtest or find
phase on a local filesystem, where the kernel answers in about one; mdtest and pfind pay
none. The C functions make the calls mdtest and pfind make, in the same order, one call
per phase and rank; everything else stays in Python. Without a compiler (or with
``PFS_IO500_NO_C=1``) :func:`load` returns None and says why, and the phases run their
Python loops, which do the same work (tests/integration/test_io500_loops.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import mmap
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from pfs.core.cbuild import build, cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("io500_loops.c")
ENV_OFF = "PFS_IO500_NO_C"  # set (non-empty): use the Python loops
FIND_REGEX = ".*01.*"  # pfind's translation of -name "*01*" (pfind-options.c)
_ERRLEN = 4096

_i64 = ctypes.c_int64
_p64 = ctypes.POINTER(ctypes.c_int64)


class CLoops:
    """The loaded library: one method per loop, each raising OSError as os.* would."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib, self.path = lib, path
        c, sz, vp = ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p
        lib.io5_md_create.argtypes = [c, ctypes.c_int, _i64, ctypes.c_double, vp, sz,
                                      ctypes.c_uint64, _p64, c, sz]
        lib.io5_md_stat.argtypes = [c, ctypes.c_int, _i64, _i64, _p64, _p64, c, sz]
        lib.io5_md_read.argtypes = [c, ctypes.c_int, _i64, vp, sz, c, ctypes.c_uint64,
                                    ctypes.c_int, _p64, _p64, _p64, c, sz]
        lib.io5_md_unlink.argtypes = [c, ctypes.c_int, _i64, _p64, c, sz]
        lib.io5_find_pattern.argtypes = [c, ctypes.POINTER(ctypes.c_int), c, sz]
        lib.io5_find_pattern.restype = vp
        lib.io5_find_open.argtypes = [c, vp, _i64, _i64, ctypes.POINTER(ctypes.c_int), c, sz]
        lib.io5_find_open.restype = vp
        lib.io5_find_chunk.argtypes = [vp, _i64, _i64, _p64, _p64,
                                       ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.POINTER(ctypes.c_size_t),
                                       ctypes.POINTER(ctypes.c_int), c, sz]
        lib.io5_find_close.argtypes = [vp]
        lib.io5_find_close.restype = None
        lib.io5_ior_read.argtypes = [ctypes.c_int, vp, sz, _i64, _i64, _i64, ctypes.c_int,
                                     ctypes.c_uint64, c, ctypes.c_int, _p64, _p64, _p64, c, sz]
        lib.io5_free.argtypes = [vp]
        for f in ("io5_md_create", "io5_md_stat", "io5_md_read", "io5_md_unlink",
                  "io5_find_chunk", "io5_ior_read"):
            getattr(lib, f).restype = ctypes.c_int
        lib.io5_free.restype = None
        self._pattern: int | None = None  # find's compiled -name, once (as pfind's)

    @staticmethod
    def _raise(rc: int, err: ctypes.Array[ctypes.c_char]) -> None:
        if rc:
            raise OSError(rc, os.strerror(rc), err.value.decode(errors="surrogateescape"))

    @staticmethod
    def mono_deadline(deadline: float) -> float:
        """``deadline`` (a time.perf_counter() value) on CLOCK_MONOTONIC, the C clock."""
        if math.isinf(deadline):
            return 1e300
        return deadline - time.perf_counter() + time.clock_gettime(time.CLOCK_MONOTONIC)

    def md_create(self, d: str, rank: int, start: int, stop: int, deadline: float,
                  data: bytearray | mmap.mmap, seed: int) -> int:
        """Create files ``start`` .. ``stop - 1`` of ``rank`` in ``d`` until the deadline
        (perf_counter seconds); returns the next item (the count done)."""
        done = _i64(start)
        err = ctypes.create_string_buffer(_ERRLEN)
        buf = (ctypes.c_char * max(1, len(data))).from_buffer(data) if data else None
        rc = self.lib.io5_md_create(os.fsencode(d), rank, stop, self.mono_deadline(deadline),
                                    buf, len(data), seed, ctypes.byref(done), err, _ERRLEN)
        self._raise(rc, err)
        return done.value

    def md_stat(self, d: str, owner: int, count: int, size: int) -> tuple[int, int]:
        """stat() each of ``owner``'s ``count`` files; (done, wrong sizes)."""
        done, bad = _i64(0), _i64(0)
        err = ctypes.create_string_buffer(_ERRLEN)
        rc = self.lib.io5_md_stat(os.fsencode(d), owner, count, size, ctypes.byref(done),
                                  ctypes.byref(bad), err, _ERRLEN)
        self._raise(rc, err)
        return done.value, bad.value

    def md_read(self, d: str, owner: int, count: int, size: int, body: bytes, seed: int,
                verify: bool) -> tuple[int, int, int]:
        """open/read/compare/close each of ``owner``'s files; (done, bytes, bad)."""
        done, got, bad = _i64(0), _i64(0), _i64(0)
        err = ctypes.create_string_buffer(_ERRLEN)
        mem = mmap.mmap(-1, max(1, size))  # page-aligned, as mdtest's aligned_buffer_alloc
        buf = (ctypes.c_char * len(mem)).from_buffer(mem)
        rc = self.lib.io5_md_read(os.fsencode(d), owner, count, buf, size, body, seed,
                                  int(verify), ctypes.byref(done), ctypes.byref(got),
                                  ctypes.byref(bad), err, _ERRLEN)
        self._raise(rc, err)
        return done.value, got.value, bad.value

    def md_unlink(self, d: str, owner: int, count: int) -> int:
        done = _i64(0)
        err = ctypes.create_string_buffer(_ERRLEN)
        rc = self.lib.io5_md_unlink(os.fsencode(d), owner, count, ctypes.byref(done), err,
                                    _ERRLEN)
        self._raise(rc, err)
        return done.value

    def ior_read(self, fd: int, buf: Any, count: int, first: int, stride: int,
                 writer: int, body: bytes, seed: int, verify: bool) -> tuple[int, int, int]:
        """IOR's read loop on ``fd`` into ``buf`` (a writable buffer of one transfer,
        page-aligned as IOR's): transfer k at ``first + k * stride``; (done, bytes,
        bad)."""
        done, got, bad = _i64(0), _i64(0), _i64(0)
        err = ctypes.create_string_buffer(_ERRLEN)
        transfer = len(buf)
        cbuf = (ctypes.c_char * transfer).from_buffer(buf)
        rc = self.lib.io5_ior_read(fd, cbuf, transfer, count, first, stride, writer, seed, body,
                                   int(verify), ctypes.byref(done), ctypes.byref(got),
                                   ctypes.byref(bad), err, _ERRLEN)
        self._raise(rc, err)
        return done.value, got.value, bad.value

    def find_open(self, d: str, size: int, newer: int) -> FindCursor:
        """pfind's opendir of ``d`` for :meth:`FindCursor.chunk`; matches are files named
        ``*01*`` of ``size`` bytes whose ctime is at least ``newer`` (whole seconds)."""
        rc = ctypes.c_int(0)
        err = ctypes.create_string_buffer(_ERRLEN)
        if self._pattern is None:
            pat = self.lib.io5_find_pattern(FIND_REGEX.encode(), ctypes.byref(rc), err, _ERRLEN)
            self._raise(rc.value, err)
            self._pattern = pat
        h = self.lib.io5_find_open(os.fsencode(d), self._pattern, size, newer,
                                   ctypes.byref(rc), err, _ERRLEN)
        self._raise(rc.value, err)
        return FindCursor(self, d, h, size, newer)

    @staticmethod
    def find_lstat(path: str, size: int, newer: int) -> int:
        """pfind's find_do_lstat of a queued file: 1 if it matches, else 0. One lstat()
        (os.lstat makes the same call with less per-call cost than a ctypes call)."""
        st = os.lstat(path)
        return int(st.st_size == size and st.st_ctime_ns // 1_000_000_000 >= newer)


class FindCursor:
    """An open directory that pfind reads a chunk at a time (its current_dir)."""

    def __init__(self, loops: CLoops, d: str, handle: int, size: int, newer: int) -> None:
        self._loops, self.dir, self._h = loops, d, handle
        self.size, self.newer = size, newer

    def chunk(self, max_entries: int, room: int
              ) -> tuple[int, int, list[tuple[str, str, None]], bool]:
        """One find_do_readdir call: (files counted, files found, [(kind, path, None)] to
        queue in readdir order, finished). Kinds: "d" and "f" queued; "D" and "F" (last, at
        most one) the entry that found the queue full."""
        lib = self._loops.lib
        files, found = _i64(0), _i64(0)
        raw, rawlen, fin = ctypes.c_void_p(), ctypes.c_size_t(0), ctypes.c_int(0)
        err = ctypes.create_string_buffer(_ERRLEN)
        rc = lib.io5_find_chunk(self._h, max_entries, room, ctypes.byref(files),
                                ctypes.byref(found), ctypes.byref(raw), ctypes.byref(rawlen),
                                ctypes.byref(fin), err, _ERRLEN)
        try:
            if rc:
                self.close()
            self._loops._raise(rc, err)
            blob = ctypes.string_at(raw.value, rawlen.value) if raw.value else b""
        finally:
            lib.io5_free(raw)
        d = self.dir
        items = [(chr(n[0]), f"{d}/{os.fsdecode(n[1:])}", None)
                 for n in blob.split(b"\0")[:-1]]
        if fin.value:
            self.close()
        return files.value, found.value, items, bool(fin.value)

    def close(self) -> None:
        if self._h:
            self._loops.lib.io5_find_close(self._h)
            self._h = 0


_loaded: tuple[CLoops | None, str] | None = None


def load() -> tuple[CLoops | None, str]:
    """(the C loops, "") or (None, why not); built once per source version and cached."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


def _load() -> tuple[CLoops | None, str]:
    if os.environ.get(ENV_OFF):
        return None, f"${ENV_OFF} is set"
    try:
        src = SOURCE.read_bytes()
    except OSError as exc:
        return None, f"no source {SOURCE}: {exc.strerror}"
    tag = hashlib.sha256(src).hexdigest()[:16]
    lib_path = cache_dir() / f"io500_loops-{tag}.so"
    try:
        if not lib_path.exists():
            logger.info("building %s", lib_path)
            build(SOURCE, lib_path)
        return CLoops(ctypes.CDLL(str(lib_path)), lib_path), ""
    except (OSError, subprocess.SubprocessError) as exc:
        return None, str(exc)


def reset() -> None:
    """Forget what :func:`load` found (tests)."""
    global _loaded
    _loaded = None
