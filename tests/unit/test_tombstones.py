"""The data server's tombstones (dataserver/tombstones.py): durable across a restart,
loaded into memory, bounded (expired and cleared ones dropped and their bytes reclaimed
at the next start, a torn last record ignored), placed in their object's directory."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from pfs.dataserver.objects import ObjectStore
from pfs.dataserver.tombstones import FILE, RECORD, Tombstones, deleted_error

DAY = 86400.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def one_dir(d: Path, clock: Clock, keep: float = 30 * DAY) -> Tombstones:
    return Tombstones([str(d)], lambda _obj: str(d), keep=keep, clock=clock)


def test_tombstones_survive_a_restart_and_cost_one_record_each(tmp_path: Path) -> None:
    clock = Clock(1_000_000_000.0)
    t = one_dir(tmp_path, clock)
    assert (7, 0) not in t and len(t) == 0
    objs = [(7, 0), (7, 2), (1 << 40, 3)]
    t.write(objs)
    t.add(objs)
    assert all(o in t for o in objs) and (7, 1) not in t
    assert (tmp_path / FILE).stat().st_size == 3 * RECORD.size == 72
    again = one_dir(tmp_path, clock)  # a restart: read back from the file
    assert len(again) == 3 and all(o in again for o in objs) and (8, 0) not in again
    assert (tmp_path / FILE).stat().st_size == 72  # nothing to reclaim: not rewritten


def test_cleared_expired_and_torn_records_are_reclaimed_at_start(tmp_path: Path) -> None:
    clock = Clock(1_000_000_000.0)
    t = one_dir(tmp_path, clock)
    t.write([(1, 0), (2, 0)])
    clock.t += 20 * DAY
    t.write([(3, 0), (4, 0)])
    t.write([(4, 0)], cleared=True)  # truncated to 0 since: no longer deleted data
    with open(tmp_path / FILE, "ab") as f:
        f.write(RECORD.pack(5, 0, int(clock.t))[:10])  # a crash in the middle of an append
    clock.t += 15 * DAY  # (1, 0) and (2, 0) are 35 days old now: past ``keep``
    t = one_dir(tmp_path, clock)
    assert (3, 0) in t and len(t) == 1
    assert (tmp_path / FILE).stat().st_size == RECORD.size  # compacted
    clock.t += 30 * DAY
    assert len(one_dir(tmp_path, clock)) == 0
    assert (tmp_path / FILE).stat().st_size == 0


def test_each_directory_keeps_its_objects_tombstones(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = ObjectStore(dirs)
    objs = [(ino, 0) for ino in range(100, 140)]
    store.tombs.write(objs)
    store.tombs.add(objs)
    store.close()
    for d in dirs:
        n = os.path.getsize(os.path.join(d, FILE)) // RECORD.size
        assert 0 < n < len(objs)  # both hold some: placed as their objects are
    store = ObjectStore(dirs)
    assert all(o in store.tombs for o in objs) and len(store.tombs) == len(objs)
    store.close()


def test_the_error_names_the_inode_and_the_restore() -> None:
    e = deleted_error((42, 1))
    assert e.errno == errno.EIO
    assert "inode 42" in str(e) and "deleted after the metadata backup" in str(e)


def test_a_full_disk_leaves_no_torn_record_and_the_next_append_stays_aligned(
        tmp_path: Path, monkeypatch: Any) -> None:
    clock = Clock(1_000_000_000.0)
    t = one_dir(tmp_path, clock)
    t.write([(1, 0)])
    with open(tmp_path / FILE, "ab") as f:
        f.write(RECORD.pack(9, 0, int(clock.t))[:7])  # an earlier torn append
    real_write = os.write

    def full(fd: int, data: bytes) -> int:  # the disk fills in the middle of the records
        real_write(fd, data[:RECORD.size + 5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    try:
        t.write([(2, 0), (3, 0)])
    except OSError as e:
        assert e.errno == errno.ENOSPC
    else:
        raise AssertionError("a full disk was not reported")
    monkeypatch.setattr(os, "write", real_write)
    assert (tmp_path / FILE).stat().st_size == RECORD.size  # neither torn piece kept
    t.write([(4, 0)])
    again = one_dir(tmp_path, clock)
    assert {o for o in [(1, 0), (2, 0), (3, 0), (4, 0), (9, 0)] if o in again} == {(1, 0), (4, 0)}
