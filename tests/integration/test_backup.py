"""Backup and restore of the metadata store (docs/architecture.md, "Operations:
backup"): `pfs admin backup` copies the store while the metaserver serves and clients
write; after more writes, a restore brings back exactly the namespace of the backup,
files of the backup read their bytes, later files are gone and their objects are
reported by `pfs fsck` as orphans and reclaimed by its repair; new files never reuse
an inode number the data servers have seen."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pfs
from pfs.tools import cluster


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args], capture_output=True,
                          text=True, timeout=180, check=False)


def content(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def fsck(toml: Path, *extra: str) -> dict:  # type: ignore[type-arg]
    r = cli("fsck", "--config", str(toml), "--json", *extra)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_backup_while_writing_then_restore(private_cluster: Path, tmp_path: Path) -> None:
    d = private_cluster
    toml = cluster.up(d, data_servers=2)
    before = {f"/a/f{i}": content(f"a{i}", 70_000 + 4099 * i) for i in range(6)}
    with pfs.connect(config=toml) as c:
        c.set_layout("/", count=2, unit=64 << 10)
        c.makedirs("/a")
        c.makedirs("/w")
        for path, data in before.items():
            c.write_file(path, data)
    stop = threading.Event()
    written: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def writer() -> None:  # a client writing all through the backup
        try:
            with pfs.connect(config=toml) as c:
                i = 0
                while not stop.is_set() or i < 5:
                    data = content(f"w{i}", 20_000 + 977 * i)
                    written[f"/w/g{i}"] = data
                    c.write_file(f"/w/g{i}", data)
                    i += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        backup = tmp_path / "backup"
        r = cli("admin", "backup", str(backup), "--cluster", str(d), "--json")
    finally:
        stop.set()
        t.join()
    assert r.returncode == 0, r.stderr
    assert not errors, errors
    manifest = json.loads(r.stdout)
    assert (backup / "data.mdb").stat().st_size == manifest["bytes"]
    assert (backup / "data.mdb").stat().st_mode & 0o077 == 0
    r = cli("admin", "backup", str(backup), "--cluster", str(d))
    assert r.returncode != 0 and "not empty" in r.stderr
    later = {f"/b/h{i}": content(f"b{i}", 50_000 + 11 * i) for i in range(4)}
    with pfs.connect(config=toml) as c:
        c.makedirs("/b")
        for path, data in later.items():
            c.write_file(path, data)
        later_inos = {c.stat(p).st_ino for p in later}
        gone_ino = c.stat("/a/f0").st_ino
        c.remove("/a/f0")  # deleted after the backup: its objects go for good
    deadline = time.monotonic() + 60  # the deleter runs behind the unlink
    while list((d / "data").rglob(f"{gone_ino}.*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list((d / "data").rglob(f"{gone_ino}.*"))
    r = cli("admin", "restore", str(backup), "--cluster", str(d))
    assert r.returncode != 0 and "is running" in r.stderr  # never under a live metaserver
    cluster.down(d)
    r = cli("admin", "restore", str(backup), "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    assert "kept in" in r.stdout and "pfs fsck" in r.stdout
    assert len(list(d.glob("meta.pre-restore-*"))) == 1  # the replaced store is kept
    toml = cluster.up(d)
    with pfs.connect(config=toml) as c:
        for path, data in before.items():
            if path != "/a/f0":
                assert c.read_file(path) == data, path
        assert not c.exists("/b")  # made after the backup
        restored = c.listdir("/w")
        for name in restored:  # the backup's view of files being written: a prefix
            got = c.read_file(f"/w/{name}")
            assert got == written[f"/w/{name}"][:len(got)], name
        c.write_file("/new", b"after the restore")
        assert c.read_file("/new") == b"after the restore"
        assert c.stat("/new").st_ino > max(later_inos)  # no inode number reused
    report = fsck(toml, "--no-verify")
    orphans = {p["ino"] for p in report["problems"] if p["kind"] == "orphan"}
    assert later_inos <= orphans, report
    # deleted after the backup: back in the namespace without its objects
    assert gone_ino in {p["ino"] for p in report["problems"] if p["kind"] == "missing"}
    report = fsck(toml, "--no-verify", "--repair", "--remove-orphans")
    assert not [p for p in report["problems"] if p["kind"] == "orphan" and p["ino"] in
                later_inos], report
