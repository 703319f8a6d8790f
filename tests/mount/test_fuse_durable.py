"""Durable acknowledgements through the mount: close(2) (FUSE flush) returns after what
was written is synced on every replica; fsync(2) too (see tests/integration/test_durable.py)."""
from __future__ import annotations

import os
from pathlib import Path

from pfs.client.sync import Client
from tests.fuse_fixtures import *  # noqa: F403
from tests.sync_probe import unsynced

UNIT = 64 * 1024


def test_close_through_the_mount_syncs_every_replica(mdir: Path, client: Client) -> None:
    pdir = "/" + mdir.name
    client.set_layout(pdir, count=2, unit=UNIT, replicas=2)
    (mdir / "f").write_bytes(os.urandom(5 * UNIT))
    dirty = unsynced(client, f"{pdir}/f")
    assert len(dirty) >= 2 and set(dirty.values()) == {0}, dirty
    client.set_layout(pdir, durable=False)  # the control: opted out, close leaves them
    (mdir / "g").write_bytes(os.urandom(5 * UNIT))
    assert sum(unsynced(client, f"{pdir}/g").values()) == 4
    fd = os.open(mdir / "h", os.O_CREAT | os.O_WRONLY)  # fsync syncs even so
    try:
        os.write(fd, os.urandom(5 * UNIT))
        os.fsync(fd)
        assert set(unsynced(client, f"{pdir}/h").values()) == {0}
    finally:
        os.close(fd)
