"""A cluster whose metadata was restored from a backup taken before a file was deleted
and its objects reclaimed (docs/architecture.md, "What restore cannot undo"): shared by
tests/integration/test_restore_reads.py (the native client) and
tests/mount/test_fuse_restore.py (a FUSE mount)."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pfs
from pfs.tools import cluster

UNIT = 64 << 10


def content(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


@dataclass
class Restored:
    toml: Path  # the restarted cluster's client config
    a: bytes  # /A: untouched since the backup
    c: bytes  # /C: sparse (a hole in an object, a stripe never written, truncated up)
    b_ino: int  # /B: deleted after the backup, its objects reclaimed, then restored


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args], capture_output=True,
                          text=True, timeout=180, check=False)


def restore_after_delete(d: Path, backup: Path) -> Restored:
    """Files A, B and C; a backup; B deleted and the deleter waited for; the backup
    restored and the cluster started again."""
    toml = cluster.up(d, data_servers=2)
    a = content("A", 3 * UNIT + 1000)
    c = bytearray(5 * UNIT)  # truncated up to 5 units
    c[:1000] = content("C0", 1000)  # stripe 0 object: written, then a hole
    c[2 * UNIT + 500:2 * UNIT + 1500] = content("C2", 1000)  # stripe 0 again; stripe 1 never
    with pfs.connect(config=toml) as cl:
        cl.set_layout("/", count=2, unit=UNIT)
        cl.write_file("/A", a)
        cl.write_file("/B", content("B", 3 * UNIT))
        with cl.open("/C", "wb") as f:
            f.pwrite(c[:1000], 0)
            f.pwrite(c[2 * UNIT + 500:2 * UNIT + 1500], 2 * UNIT + 500)
        cl.truncate("/C", len(c))
    r = cli("admin", "backup", str(backup), "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    toml, b_ino = delete_and_restore(d, toml, backup)
    return Restored(toml, a, bytes(c), b_ino)


def delete_and_restore(d: Path, toml: Path, backup: Path,
                       also: Callable[[pfs.Client], None] = lambda cl: None
                       ) -> tuple[Path, int]:
    """/B deleted (and ``also`` done) after ``backup``, the deleter waited for, the
    backup restored and the cluster started again; its client config and /B's inode."""
    with pfs.connect(config=toml) as cl:
        b_ino = cl.stat("/B").st_ino
        cl.remove("/B")
        also(cl)
    deadline = time.monotonic() + 60  # the deleter runs behind the unlink: poll for it
    while list((d / "data").rglob(f"{b_ino}.*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list((d / "data").rglob(f"{b_ino}.*")), "the deleter never reclaimed /B"
    cluster.down(d)
    r = cli("admin", "restore", str(backup), "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    return cluster.up(d), b_ino
