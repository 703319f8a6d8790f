"""The data server's truncation records (dataserver/cuts.py): enforced only inside a
restore window, durable across a restart, cleared and expired ones reclaimed at start,
a few per object at most (merged towards enforcing more, never less)."""

from __future__ import annotations

import errno
from pathlib import Path

from pfs.dataserver.cuts import FILE, MAX_MARKS, RECORD, Cuts, cut_error

DAY = 86400.0
S = 10**9  # ns
T0 = 1_000_000_000.0  # the clock, in seconds


def one_dir(d: Path, keep: float = 30 * DAY, now: float = T0) -> Cuts:
    return Cuts([str(d)], lambda _obj: str(d), keep, clock=lambda: now)


def record(c: Cuts, obj: tuple[int, int], at: int, end: int, clear: bool = False) -> None:
    c.write(obj, [(at, end)], clear)
    c.put(obj, [(at, end)], clear)


def test_a_cut_is_enforced_only_inside_a_restore_window(tmp_path: Path) -> None:
    c = one_dir(tmp_path)
    t = int(T0) * S
    record(c, (7, 0), t, 300)  # cut from 300 bytes at t
    assert c.deleted_range((7, 0), 100) is None  # no restore: a hole past the end
    c.set_windows([(t - 10 * S, t + 10 * S)])  # a backup from before t restored after it
    assert c.deleted_range((7, 0), 100) == (100, 300)
    assert c.deleted_range((7, 0), 300) is None  # written up to its old end since
    assert c.deleted_range((7, 1), 0) is None
    c.set_windows([(t + S, t + 10 * S)])  # the backup was taken after the cut
    assert c.deleted_range((7, 0), 100) is None
    c.set_windows([(0, t)])  # restored before the cut was made
    assert c.deleted_range((7, 0), 100) is None


def test_records_survive_a_restart_and_cleared_or_expired_ones_are_reclaimed(
    tmp_path: Path,
) -> None:
    c = one_dir(tmp_path)
    t = int(T0) * S
    record(c, (1, 0), t - 40 * int(DAY) * S, 50)  # older than keep
    record(c, (2, 0), t, 60)
    record(c, (3, 0), t, 70)
    c.write((3, 0), [], clear=True)  # deleted, or truncated to its size since a restore
    with open(tmp_path / FILE, "ab") as f:
        f.write(RECORD.pack(4, 0, 9, t)[:11])  # a torn append
    again = one_dir(tmp_path)
    assert len(again) == 1 and again.has((2, 0)) and not again.has((3, 0))
    assert (tmp_path / FILE).stat().st_size == RECORD.size  # compacted
    again.set_windows([(t - S, t + S)])
    assert again.deleted_range((2, 0), 10) == (10, 60)


def test_a_later_cut_reaching_as_far_replaces_earlier_ones_and_few_are_kept(
    tmp_path: Path,
) -> None:
    c = one_dir(tmp_path)
    t = int(T0) * S
    record(c, (5, 0), t, 100)
    record(c, (5, 0), t + S, 100)  # grown back and cut again from as far
    assert c.marks((5, 0)) == [(t + S, 100)]
    for i in range(2 * MAX_MARKS):  # ever shorter cuts: each earlier one still counts
        record(c, (6, 0), t + i * S, 1000 - i)
    kept = c.marks((6, 0))
    assert len(kept) == MAX_MARKS and kept[-1] == (t + (2 * MAX_MARKS - 1) * S, 1000 - 31)
    for i in range(2 * MAX_MARKS):  # whichever window: the range is never shorter
        c.set_windows([(t + i * S, t + 100 * S)])
        rng = c.deleted_range((6, 0), 0)
        assert rng is not None and rng[1] >= 1000 - i


def test_the_error_names_the_inode_and_the_truncation() -> None:
    e = cut_error((42, 1), 10, 20)
    assert e.errno == errno.EIO
    assert "inode 42" in str(e) and "truncation after the metadata backup" in str(e)
