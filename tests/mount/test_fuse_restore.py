"""Through a FUSE mount: after a metadata restore, a file deleted after the backup (its
objects reclaimed) is EIO for a reader, never zeros; a sparse file's holes still read
as zeros (tests/integration/test_restore_reads.py has the native client's side)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.fuse_fixtures import *  # noqa: F403
from tests.fuse_fixtures import fuse_usable, mounted
from tests.restore_fixtures import UNIT, restore_after_delete


def test_a_file_deleted_after_the_backup_is_eio_through_the_mount(private_cluster: Path,
                                                                 tmp_path: Path) -> None:
    if (why := fuse_usable()) is not None:
        pytest.skip(why)
    got = restore_after_delete(private_cluster, tmp_path / "backup")
    with mounted(got.toml) as m:
        assert (m / "A").read_bytes() == got.a
        assert (m / "C").read_bytes() == got.c
        fd = os.open(m / "B", os.O_RDONLY)
        try:
            for off in (0, UNIT + 5):
                with pytest.raises(OSError) as ei:
                    os.pread(fd, 4096, off)
                assert ei.value.errno == errno.EIO
        finally:
            os.close(fd)
