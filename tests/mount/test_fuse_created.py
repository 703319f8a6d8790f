"""Files this mount creates, and what they cost the servers. The first write's
``security.capability`` question needs no metaserver call (a new file has no xattrs). An
unlinked file created and closed without a write costs the data servers nothing
(metaserver/handles.py, "Files no data server saw"), so every way of writing one must
still leave its objects to the deleter."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from tests.fuse_fixtures import *  # noqa: F403
from tests.fuse_fixtures import mounted
from tests.integration.test_unwritten import _on_disk, wait_gone
from tests.metrics_scrape import free_port, scrape, value

UNIT = 64 * 1024
CREATE = os.O_CREAT | os.O_EXCL | os.O_WRONLY


def _layout(client, mnt: Path, mdir: Path) -> None:  # type: ignore[no-untyped-def]
    client.set_layout("/" + str(mdir.relative_to(mnt)), count=4, unit=UNIT)


def test_files_written_through_the_mount_have_their_objects_deleted(
    client, mnt: Path, mdir: Path, cluster_dir: Path
) -> None:
    _layout(client, mnt, mdir)
    fd = os.open(mdir / "written", CREATE, 0o644)  # the create's own handle writes
    os.write(fd, os.urandom(3 * UNIT))
    os.close(fd)
    os.close(os.open(mdir / "rewritten", CREATE, 0o644))  # created clean, then rewritten
    fd = os.open(mdir / "rewritten", os.O_WRONLY | os.O_TRUNC)
    os.write(fd, os.urandom(2 * UNIT))
    os.close(fd)
    fd = os.open(mdir / "extended", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    os.ftruncate(fd, 4 * UNIT)  # extended: no data server yet; then written through mmap
    with mmap.mmap(fd, 4 * UNIT) as m:
        m[UNIT : 2 * UNIT] = b"m" * UNIT
        m.flush()
    os.close(fd)
    fd = os.open(mdir / "orphan", CREATE, 0o644)  # unlinked while open, written after
    ino = os.fstat(fd).st_ino
    os.unlink(mdir / "orphan")
    os.write(fd, b"o" * UNIT)
    os.fsync(fd)
    assert _on_disk(cluster_dir, ino)
    os.close(fd)
    inos = [ino]
    for name in ("written", "rewritten", "extended"):
        ino = os.stat(mdir / name).st_ino
        assert _on_disk(cluster_dir, ino), name
        inos.append(ino)
        os.unlink(mdir / name)
    for ino in inos:
        wait_gone(cluster_dir, ino)


def test_a_file_created_empty_is_gone_with_its_unlink(mnt: Path, mdir: Path, mdir2: Path) -> None:
    """The cheap path keeps the namespace's rules: seen empty from another mount
    (close-to-open), still readable there after its unlink while open."""
    os.close(os.open(mdir / "e", CREATE, 0o644))
    assert os.stat(mdir2 / "e").st_size == 0
    fd = os.open(mdir2 / "e", os.O_RDONLY)
    try:
        os.unlink(mdir / "e")
        assert os.read(fd, 10) == b""
    finally:
        os.close(fd)
    assert not (mdir / "e").exists()


def test_a_file_created_here_is_written_without_asking_for_its_xattrs(
    client_toml: Path, tmp_path: Path
) -> None:
    port = free_port()
    toml = tmp_path / "client.toml"
    toml.write_text(client_toml.read_text().replace("metrics_port = 0", f"metrics_port = {port}"))
    n = 20
    with mounted(toml) as m:
        d = m / f"xattrs-{os.getpid()}"
        d.mkdir()
        (d / "old").write_bytes(b"")
        time.sleep(1.2)  # what the mount knows of "old" expired (attr_timeout)
        before = scrape(port)
        for i in range(n):
            fd = os.open(d / f"f{i}", CREATE, 0o644)
            os.write(fd, b"x" * 100)
            os.close(fd)
        made = scrape(port)
        fd = os.open(d / "old", os.O_CREAT | os.O_WRONLY)  # opened, not made: it may have some
        os.write(fd, b"y")
        os.close(fd)
        last = scrape(port)
        os.setxattr(d / "f0", "user.k", b"v")
        assert os.getxattr(d / "f0", "user.k") == b"v"
        for p in d.iterdir():
            p.unlink()
        d.rmdir()

    def calls(text: str) -> float:
        return value(text, "pfs_rpc_requests_total", service="client", method="getxattr")

    assert calls(made) - calls(before) == 0
    assert calls(last) - calls(made) == 1
