"""A data server's directory health and the staged replacement of a replica, without
processes: a directory removed (or found empty at start among used ones) is lost, its
objects refused with EIO (never read as a hole) and the others still served; a repaired
copy is renamed into place whole, with fresh checksums and its chain record."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from pfs.dataserver import checksums as dck
from pfs.dataserver.objects import ObjectStore


def _write(store: ObjectStore, obj: tuple[int, int], data: bytes) -> None:
    got = store.acquire_checked(obj, create=True)
    assert got is not None
    fd, cfd, release = got
    try:
        os.pwrite(fd, data, 0)
        if cfd is not None:
            dck.update(fd, cfd, 0, memoryview(data))
    finally:
        release()


def _split(store: ObjectStore) -> tuple[tuple[int, int], tuple[int, int]]:
    """An object on the first directory and one on the second."""
    by: dict[str, tuple[int, int]] = {}
    for ino in range(1, 100):
        by.setdefault(os.path.dirname(os.path.dirname(os.path.dirname(
            store.path((ino, 0))))), (ino, 0))
        if len(by) == 2:
            break
    return by[store.dirs[0]], by[store.dirs[1]]


def test_a_removed_directory_is_lost_and_only_its_objects_are_refused(tmp_path: Path) -> None:
    store = ObjectStore([str(tmp_path / "a"), str(tmp_path / "b")])
    try:
        on_a, on_b = _split(store)
        _write(store, on_a, b"a" * 100)
        _write(store, on_b, b"b" * 100)
        assert store.check_dirs() == []
        shutil.rmtree(store.dirs[0])
        store.check_absent(on_b)  # the other directory: no error
        with pytest.raises(OSError) as ei:  # an absent read notices the loss at once
            store.check_absent(on_a)
        assert ei.value.errno == errno.EIO and "lost" in str(ei.value)
        assert store.lost == {store.dirs[0]}
        assert os.path.exists(os.path.join(store.dirs[0], "FORMAT"))  # made again
        store.check_readable(on_b)
        with pytest.raises(OSError):
            store.check_readable(on_a)
        store.restored(store.dirs[0])
        store.check_readable(on_a)
    finally:
        store.close()


def test_an_empty_directory_among_used_ones_is_lost_at_start(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = ObjectStore(dirs)
    on_a, _ = _split(store)
    _write(store, on_a, b"x")
    store.close()
    shutil.rmtree(dirs[0])
    store = ObjectStore(dirs)
    try:
        assert store.lost == {os.path.abspath(dirs[0])}
        with pytest.raises(OSError):
            store.check_readable(on_a)
    finally:
        store.close()
    fresh = ObjectStore([str(tmp_path / "c"), str(tmp_path / "d")])  # a new server
    assert fresh.lost == set()
    fresh.close()


def test_a_staged_copy_replaces_a_replica_whole(tmp_path: Path) -> None:
    store = ObjectStore([str(tmp_path / "a")])
    try:
        obj = (5, 0)
        _write(store, obj, b"old" * 50_000)
        staged = store.staging_path(obj)
        with open(staged, "wb") as f:
            f.write(b"new" * 30_000)
        store.stage_checksums(staged)
        store.replace(obj, staged, (3, 2, 9))
        got = store.acquire_checked(obj)
        assert got is not None
        fd, cfd, release = got
        try:
            size = os.fstat(fd).st_size
            assert os.pread(fd, size, 0) == b"new" * 30_000
            assert cfd is not None
            assert dck.verify_fd(obj, fd, cfd, 0, dck.n_blocks(size), size) == []
        finally:
            release()
        assert store.chain_record(obj) in ((3, 2, 9), None)  # None: no user xattrs here
        assert not os.path.exists(staged) and not os.path.exists(staged + "-map")
    finally:
        store.close()
