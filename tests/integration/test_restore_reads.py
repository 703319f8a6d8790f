"""After a metadata restore, a file deleted after the backup (its objects reclaimed by
the deleter) is back in the namespace without its data: reading it is EIO naming it and
the restore, never zeros (data servers keep tombstones, dataserver/tombstones.py);
genuine holes of a sparse file still read as zeros, other files read their bytes; a
write to the deleted data is refused until the file is truncated to 0."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

import pfs
from pfs.tools import cluster
from tests.restore_fixtures import UNIT, cli, restore_after_delete


def test_a_file_deleted_after_the_backup_reads_eio_not_zeros(private_cluster: Path,
                                                             tmp_path: Path) -> None:
    d = private_cluster
    got = restore_after_delete(d, tmp_path / "backup")
    with pfs.connect(config=got.toml) as c:
        assert c.stat("/B").st_ino == got.b_ino  # back in the namespace
        assert c.read_file("/A") == got.a
        assert c.read_file("/C") == got.c  # its holes: zeros
        with c.open("/B", "rb") as f:  # a small read (the blocking driver), a whole one
            for read in (lambda: f.pread(100, UNIT + 5), lambda: c.read_file("/B")):
                with pytest.raises(OSError) as ei:
                    read()
                assert ei.value.errno == errno.EIO
                text = str(ei.value)
                assert "/B" in text and f"inode {got.b_ino}" in text, text
                assert "deleted after the metadata backup" in text, text
        # a write into the deleted data would leave zeros around it: refused
        with pytest.raises(OSError) as ei:
            with c.open("/B", "r+b") as f:
                f.pwrite(b"new", 10)
        assert ei.value.errno == errno.EIO
        with pytest.raises(OSError):
            c.read_file("/B")
    r = cli("fsck", "--config", str(got.toml), "--json", "--no-verify")
    missing = {p["ino"] for p in json.loads(r.stdout)["problems"] if p["kind"] == "missing"}
    assert got.b_ino in missing  # fsck still reports it
    cluster.down(d)  # the tombstones are durable: the same after a restart
    toml = cluster.up(d)
    with pfs.connect(config=toml) as c:
        with pytest.raises(OSError) as ei:
            c.read_file("/B")
        assert ei.value.errno == errno.EIO
        c.write_file("/B", b"overwritten whole")  # O_TRUNC: every object cut to 0 first
        assert c.read_file("/B") == b"overwritten whole"
        c.truncate("/B", 3 * UNIT)  # truncated up: a genuine hole now
        assert c.read_file("/B") == b"overwritten whole" + bytes(3 * UNIT - 17)
        assert c.read_file("/C") == got.c


def restore(d: Path, backup: Path) -> Path:
    cluster.down(d)
    r = cli("admin", "restore", str(backup), "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    return cluster.up(d)


def test_an_orphan_fsck_removed_reads_eio_when_a_newer_backup_names_it(
        private_cluster: Path, tmp_path: Path) -> None:
    """Backup 1, file X, backup 2; backup 1 restored: X's objects are orphans, which
    fsck removes; backup 2 restored (the newer one after all): X is EIO, not zeros."""
    d = private_cluster
    toml = cluster.up(d, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.set_layout("/", count=2, unit=UNIT)
        c.write_file("/early", b"e" * 1000)
    assert cli("admin", "backup", str(tmp_path / "b1"), "--cluster", str(d)).returncode == 0
    with pfs.connect(config=toml) as c:
        c.write_file("/X", b"x" * (3 * UNIT))
        x_ino = c.stat("/X").st_ino
    assert cli("admin", "backup", str(tmp_path / "b2"), "--cluster", str(d)).returncode == 0
    toml = restore(d, tmp_path / "b1")
    r = cli("fsck", "--config", str(toml), "--json", "--no-verify", "--repair",
            "--remove-orphans")
    assert not list((d / "data").rglob(f"{x_ino}.*")), r.stdout
    toml = restore(d, tmp_path / "b2")
    with pfs.connect(config=toml) as c:
        assert c.read_file("/early") == b"e" * 1000
        with pytest.raises(OSError) as ei:
            c.read_file("/X")
        assert ei.value.errno == errno.EIO and "/X" in str(ei.value)
