"""Checksums through the mount: a byte flipped in an object file is EIO for a reader of
the mount, never wrong bytes (see tests/integration/test_checksums.py)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from pfs.client.sync import Client
from tests.fuse_fixtures import *  # noqa: F403

BLOCK = 64 << 10


def test_a_flipped_byte_is_eio_through_the_mount(mdir: Path, client: Client,
                                                 cluster_dir: Path) -> None:
    pdir = "/" + mdir.name
    client.set_layout(pdir, count=1, unit=1 << 20, replicas=1)
    data = os.urandom(4 * BLOCK)
    client.write_file(f"{pdir}/f", data)  # not through the mount: no page cached there
    ino = client.stat(f"{pdir}/f").st_ino
    (obj,) = (cluster_dir / "data").glob(f"ds*/objects/*/{ino}.0")
    with open(obj, "r+b") as f:
        f.seek(BLOCK + 5)
        b = f.read(1)
        f.seek(BLOCK + 5)
        f.write(bytes([b[0] ^ 1]))
    fd = os.open(mdir / "f", os.O_RDONLY)
    try:
        assert os.pread(fd, BLOCK, 0) == data[:BLOCK]
        with pytest.raises(OSError) as ei:
            os.pread(fd, 100, BLOCK)
        assert ei.value.errno == errno.EIO
    finally:
        os.close(fd)
