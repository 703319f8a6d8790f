"""Append-only files of fixed-size records, one per data directory: what tombstones
(tombstones.py) and truncation records (cuts.py) are kept in. An append is fsynced
before the caller changes the objects it describes, so a crash never leaves a change
without its record; a torn last record (a crash or a full disk mid-append) is cut,
never read."""

from __future__ import annotations

import errno
import os
import struct

from pfs.core.durable import fsync_dir


def read(d: str, name: str, rec: struct.Struct) -> tuple[list[tuple[int, ...]], int]:
    """The whole records of ``d/name`` (none: no file) and the file's size in bytes."""
    try:
        with open(os.path.join(d, name), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return [], 0
    whole = len(raw) - len(raw) % rec.size
    return list(rec.iter_unpack(memoryview(raw)[:whole])), len(raw)


def rewrite(d: str, name: str, data: bytes) -> None:
    """Replace ``d/name`` with ``data`` durably (temporary file, fsync, rename)."""
    path = os.path.join(d, name)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(d)


def append(d: str, name: str, data: bytes, size: int) -> None:
    """Append ``data`` (whole records of ``size`` bytes) to ``d/name`` and fsync it;
    on a failure (ENOSPC) nothing of it is left behind."""
    path = os.path.join(d, name)
    new = not os.path.exists(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        end = os.fstat(fd).st_size
        if end % size:  # a torn record (crash, full disk): records stay aligned
            end -= end % size
            os.ftruncate(fd, end)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, f"{name} of {d}: short write")
        except OSError:
            os.ftruncate(fd, end)  # no partial record left behind
            raise
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:  # its directory entry must survive a crash too
        fsync_dir(d)
