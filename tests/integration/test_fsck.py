"""``pfs fsck`` against real server processes: a clean cluster, then each kind of damage
made by hand in a data directory (a stray object, a deleted one, a cut one), a sparse
file, and a stopped data server; each with its report and exit status."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pfs
from pfs.tools import cluster

UNIT = 65536


def fsck(toml: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "fsck", "--config", str(toml),
                        "--json", *extra], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1, 2), r.stderr
    report = json.loads(r.stdout)
    assert report["exit"] == r.returncode
    return r.returncode, report


def kinds(report: dict[str, Any]) -> set[tuple[str, str | None, int]]:
    return {(p["kind"], p["path"], p["stripe"]) for p in report["problems"]}


def object_file(d: Path, ino: int, stripe: int) -> Path:
    found = list((d / "data").glob(f"ds*/objects/*/{ino}.{stripe}"))
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, int]]:
    """A cluster of 2 data servers holding /d/dense (4 units, written whole) and
    /d/sparse (4 units, only its last byte written); the dense file's inode."""
    d = tmp_path_factory.mktemp("fsck") / "cluster"
    try:
        toml = cluster.up(d, data_servers=2)
        with pfs.connect(config=toml) as c:
            c.mkdir("/d")
            c.set_layout("/d", count=2, unit=UNIT, replicas=1)
            c.write_file("/d/dense", os.urandom(4 * UNIT))
            with c.open("/d/sparse", "wb") as f:
                f.seek(4 * UNIT - 1)
                f.write(b"x")
            ino = c.stat("/d/dense").st_ino
        yield d, toml, ino
    finally:
        cluster.down(d)


def test_a_clean_cluster_exits_0_and_a_sparse_file_is_not_damage(
        fs: tuple[Path, Path, int]) -> None:
    _d, toml, _ino = fs
    rc, rep = fsck(toml)
    assert rc == 0, rep
    assert rep["files"] == 2 and rep["objects"] == 3 and not rep["unreachable"]
    # the sparse file's first stripe holds nothing: listed as a possible hole, no more
    assert kinds(rep) == {("hole?", "/d/sparse", 0)}
    assert any("server does not support verify" in n for n in rep["notes"]) or rep["verified"]


def test_a_stray_object_is_an_orphan(fs: tuple[Path, Path, int]) -> None:
    d, toml, _ino = fs
    stray = d / "data" / "ds0" / "objects" / "00" / "999999.0"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"junk")
    try:
        rc, rep = fsck(toml)
        assert rc == 1, rep
        orphans = [p for p in rep["problems"] if p["kind"] == "orphan"]
        assert [(p["ino"], p["stripe"]) for p in orphans] == [(999999, 0)]
        assert "no file has inode 999999" in orphans[0]["detail"]
    finally:
        stray.unlink()
    assert fsck(toml)[0] == 0


def test_a_deleted_object_is_missing(fs: tuple[Path, Path, int]) -> None:
    d, toml, ino = fs
    obj = object_file(d, ino, 1)
    saved = obj.read_bytes()
    obj.unlink()
    try:
        rc, rep = fsck(toml)
        assert rc == 1, rep
        assert ("missing", "/d/dense", 1) in kinds(rep)
    finally:
        obj.write_bytes(saved)
    assert fsck(toml)[0] == 0


def test_a_cut_object_is_short(fs: tuple[Path, Path, int]) -> None:
    d, toml, ino = fs
    obj = object_file(d, ino, 0)
    saved = obj.read_bytes()
    os.truncate(obj, 1000)
    try:
        rc, rep = fsck(toml)
        assert rc == 1, rep
        short = [p for p in rep["problems"] if p["kind"] == "short"]
        assert [(p["path"], p["stripe"]) for p in short] == [("/d/dense", 0)]
        assert f"1000 of {2 * UNIT} bytes" in short[0]["detail"]
        text = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "fsck", "--config",
                               str(toml)], capture_output=True, text=True, timeout=120)
        assert text.returncode == 1 and "short" in text.stdout and "/d/dense" in text.stdout
    finally:
        obj.write_bytes(saved)
    assert fsck(toml, "--rate", "1M")[0] == 0


def test_a_stopped_data_server_makes_the_check_incomplete(fs: tuple[Path, Path, int]) -> None:
    d, toml, _ino = fs
    sid = (d / "data" / "ds1" / "server.id").read_text().strip()
    pid = cluster.running(d)["data1"]
    os.kill(pid, signal.SIGTERM)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    try:
        rc, rep = fsck(toml)
        assert rc == 2, rep
        assert list(rep["unreachable"]) == [sid]
        # what lives only there is not judged missing
        assert not {k for k in kinds(rep) if k[0] in ("missing", "short")}
        text = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "admin", "fsck",
                               "--config", str(toml)], capture_output=True, text=True,
                              timeout=120)
        assert text.returncode == 2 and f"unreachable data server {sid}" in text.stdout
    finally:
        cluster.up(d)
    assert fsck(toml)[0] == 0


def test_fsck_needs_root(fs: tuple[Path, Path, int]) -> None:
    _d, toml, _ino = fs
    from pfs.core.messages import meta as M

    with pfs.connect(config=toml) as c:
        meta = c.aio.meta
        with pytest.raises(PermissionError, match="root only"):
            c._run(meta.request, M.ScanCap(cred=(1000, 1000, ())))
        r = c._run(meta.request, M.ScanInodes(after=0, limit=10, cred=(0, 0, ())))
        assert r.end and {i[0] for i in r.inodes} >= {c.stat("/d/dense").st_ino}


def test_the_scan_capability_lists_and_changes_nothing(fs: tuple[Path, Path, int]) -> None:
    """fsck's capability lists objects and cannot cut or delete one; a file's own
    capability cannot list."""
    import errno

    from pfs.core.messages import data as D
    from pfs.core.messages import meta as M

    d, toml, ino = fs
    with pfs.connect(config=toml) as c:
        aio = c.aio
        scan = c._run(aio.meta.request, M.ScanCap(cred=(0, 0, ()))).cap
        sid = (d / "data" / "ds0" / "server.id").read_text().strip()

        async def send(msg: Any) -> Any:
            return (await aio.data.send(sid, msg)).fields

        listed = c._run(send, D.ListObjects(cap=scan))
        assert ino in {o[0] for o in listed["objects"]}  # count 2 on 2 servers: one each
        for msg in (D.Truncate(obj=(ino, 0), size=0, cap=scan),
                    D.Delete(objs=[(ino, 0)], cap=scan)):
            with pytest.raises(PermissionError):
                c._run(send, msg)
        opened = c._run(aio.meta.open, ino, os.O_RDONLY)
        with pytest.raises(OSError) as err:
            c._run(send, D.ListObjects(cap=opened.cap))
        assert err.value.errno == errno.EACCES
        c._run(aio.meta.close, opened.fh)
    rc, _rep = fsck(toml)
    assert rc == 0


def test_no_metaserver_exits_2() -> None:
    r = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "fsck", "--meta",
                        "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "could not check" in r.stderr and "127.0.0.1:1" in r.stderr


def test_the_block_map_tells_holes_cuts_and_losses_apart(private_cluster: Path) -> None:
    """With block maps: a file extended by truncate and written in part has holes, not
    losses; an object cut short is short by its map; an object gone while its map
    remains is missing; one gone with its map is missing when the file's other objects
    hold data written past it without holes (reads: tests/integration/test_checksums.py)."""
    d = private_cluster
    toml = cluster.up(d, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.mkdir("/d")
        c.set_layout("/d", count=2, unit=UNIT, replicas=1)
        with c.open("/d/ext", "wb") as f:  # extended by truncate, then written in part
            f.truncate(8 * UNIT)
            f.pwrite(os.urandom(UNIT // 2), 0)
        c.write_file("/d/dense", os.urandom(6 * UNIT))
        ext, dense = c.stat("/d/ext").st_ino, c.stat("/d/dense").st_ino
    rc, rep = fsck(toml)
    # ext's stripe 1 was never created (growing a file writes no object): the map of
    # stripe 0 says nothing was written past it, so it is a possible hole, not counted
    # (before block maps, stripe 0 being dense made it "missing")
    hole = {("hole?", "/d/ext", 1)}
    assert rc == 0 and kinds(rep) == hole, rep

    obj = object_file(d, ext, 0)  # cut inside the data the map says was written
    saved = obj.read_bytes()
    os.truncate(obj, 1000)
    rc, rep = fsck(toml)
    # (verify finds the cut block too: "checksum")
    assert rc == 1 and kinds(rep) - hole - {("checksum", "/d/ext", 0)} == {
        ("short", "/d/ext", 0)}, rep
    assert any("block map" in p["detail"] for p in rep["problems"] if p["kind"] == "short")
    obj.write_bytes(saved)

    obj = object_file(d, dense, 1)
    saved = obj.read_bytes()
    obj.unlink()  # the object file gone, its block map kept
    rc, rep = fsck(toml)
    assert rc == 1 and kinds(rep) - hole == {("missing", "/d/dense", 1)}, rep
    assert any("block map" in p["detail"] for p in rep["problems"] if p["kind"] == "missing")

    Path(f"{obj}.crc").unlink()
    rc, rep = fsck(toml)  # gone with its map: the other stripe was written past it
    assert rc == 1 and kinds(rep) - hole == {("missing", "/d/dense", 1)}, rep
    assert any("written past it" in p["detail"] for p in rep["problems"])
    obj.write_bytes(saved)  # back (without its map: now an unchecked object)
