"""After a metadata restore, a file truncated after the backup is back at the size the
backup recorded while its objects stay cut: a read of the cut-off range is EIO naming
the file and the truncation, never zeros (dataserver/cuts.py); the bytes before the cut
read back; a write past the cut is refused; truncating the file to its valid size, or
overwriting it whole, makes it whole again, and a later extension is a genuine hole."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

import pfs
from pfs.tools import cluster
from tests.restore_fixtures import UNIT, cli, content

SIZE = 5 * UNIT + 100  # two stripes: three units on stripe 0, two and a bit on stripe 1
CUT = UNIT + 10  # stripe 0 keeps one unit, stripe 1 ten bytes


def _eio(read: object) -> str:
    with pytest.raises(OSError) as ei:
        read()  # type: ignore[operator]
    assert ei.value.errno == errno.EIO, ei.value
    return str(ei.value)


def test_a_file_truncated_after_the_backup_reads_eio_past_the_cut(
    private_cluster: Path, tmp_path: Path
) -> None:
    d = private_cluster
    toml = cluster.up(d, data_servers=2)
    data = {n: content(n, SIZE) for n in ("A", "T", "U", "V")}
    with pfs.connect(config=toml) as c:
        c.set_layout("/", count=2, unit=UNIT)
        for n, b in data.items():
            c.write_file(f"/{n}", b)
    r = cli("admin", "backup", str(tmp_path / "backup"), "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    with pfs.connect(config=toml) as c:
        c.truncate("/T", CUT)
        c.truncate("/V", CUT)
        c.write_file("/U", b"rewritten, shorter")  # O_TRUNC: every object cut to 0
        c.truncate("/A", SIZE + UNIT)  # grown: nothing cut
    cluster.down(d)
    r = cli("admin", "restore", str(tmp_path / "backup"), "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    toml = cluster.up(d)
    with pfs.connect(config=toml) as c:
        assert c.stat("/T").st_size == SIZE  # the backup's size
        assert c.read_file("/A") == data["A"]
        with c.open("/T", "rb") as f:
            assert f.pread(UNIT, 0) == data["T"][:UNIT]  # before the cut: its bytes
            text = _eio(lambda: f.pread(100, 3 * UNIT))
            assert "/T" in text and "cut by a truncation after the metadata backup" in text
        _eio(lambda: c.read_file("/T"))
        _eio(lambda: c.read_file("/U"))
        with pytest.raises(OSError) as ei:  # zeros would be left in the cut range
            with c.open("/T", "r+b") as f:
                f.pwrite(b"x", 4 * UNIT)
        assert ei.value.errno == errno.EIO
        c.truncate("/T", CUT)  # its valid size: whole again
        assert c.read_file("/T") == data["T"][:CUT]
        c.truncate("/T", 3 * UNIT)  # grown again: a genuine hole
        assert c.read_file("/T") == data["T"][:CUT] + bytes(3 * UNIT - CUT)
        c.write_file("/U", b"whole")
        assert c.read_file("/U") == b"whole"
    cluster.down(d)  # the records are durable: the same after a restart
    toml = cluster.up(d)
    with pfs.connect(config=toml) as c:
        _eio(lambda: c.read_file("/V"))
        assert c.read_file("/T") == data["T"][:CUT] + bytes(3 * UNIT - CUT)
        c.truncate("/V", CUT)  # truncated after the restore, then grown: holes, no EIO
        c.truncate("/V", 2)
        c.truncate("/V", SIZE)
        assert c.read_file("/V") == data["V"][:2] + bytes(SIZE - 2)


def test_data_servers_that_kept_running_through_the_restore_answer_eio_at_once(
    private_cluster: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """The documented restore stops the metaserver only: a data server learns the
    restore window from the first request naming a restored chain version, before it
    registered again (not from its registration alone, which may come seconds later)."""
    d = private_cluster
    toml = cluster.up(d, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.set_layout("/", count=2, unit=UNIT)
        c.write_file("/T", content("T", SIZE))
    r = cli("admin", "backup", str(tmp_path / "backup"), "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    with pfs.connect(config=toml) as c:
        c.truncate("/T", CUT)
    cluster._stop(d, {"meta": cluster.running(d)["meta"]})
    r = cli("admin", "restore", str(tmp_path / "backup"), "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    monkeypatch.setattr(cluster, "_wait_registered", lambda *a: None)
    toml = cluster.up(d)  # the metaserver alone; the data servers register when they do
    with pfs.connect(config=toml) as c, c.open("/T", "rb") as f:
        assert "cut by a truncation" in _eio(lambda: f.pread(100, 3 * UNIT))
