"""Backup and restore of the metadata store (docs/architecture.md, "Operations").

**Backup** is LMDB's own copy with compaction (``mdb_env_copy2`` with
``MDB_CP_COMPACT``), run from a read-only handle on the live store: it reads one
snapshot (a read transaction), so the copy is consistent — every committed change up
to one moment, nothing half-done — while the metaserver goes on serving and writing
(readers never block LMDB's writer). Free pages are left out, so the copy is as small
as the namespace. It runs on the metaserver's host, as its service user or root (the
store is 0700): see the doc for why not over the wire.

**Restore** puts a backup in the store's place (the metaserver stopped). The data servers
lived on after the backup, so three counters of the backup are behind what they have
seen, and are moved past it in the restored copy:

- ``next_ino`` by ``INO_GAP``: files created after the backup left objects named by
  their inode numbers; a new file must never reuse one (it would read the old object's
  bytes in its holes). Those objects are orphans now, for ``pfs fsck`` to report and
  ``pfs fsck --repair --remove-orphans`` to delete.
- every chain's ``version`` by ``VERSION_GAP``: data servers refuse a chain version
  older than one they saw (and objects record theirs), so the restored chains must be
  newer than any before; ``nchain`` by ``CHAIN_GAP``, for the same reason.

It also records a *restore window* (key ``W``): from the backup's start (its manifest;
``CUT_MARGIN`` earlier, the gap between a truncation's cut and its commit; no manifest:
from 0) to ``CUT_MARGIN`` after now (clock skew, should the metaserver have moved). A truncation the data servers stamped within it may be unknown to the
restored namespace, which names the old size: they answer EIO for the range it cut off
instead of zeros (dataserver/cuts.py).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import lmdb

from pfs.core.durable import fsync_dir as _fsync_dir
from pfs.core.versions import METADATA_FORMAT, package_version
from pfs.metaserver import keys as K
from pfs.metaserver.chains import ChainTable
from pfs.metaserver.store import LmdbStore, store_format

MANIFEST = "pfs-backup.json"  # beside the copy's data.mdb: what it is, from when
INO_GAP = 1 << 32  # inode numbers skipped at each restore (u64: room for 2^32 restores)
CHAIN_GAP = 1 << 20
VERSION_GAP = 1 << 20  # (a data server that sees such a jump asks for restore windows)
CUT_MARGIN = 300 * 10**9  # ns: a cut this long before a backup may be unknown to it


class BackupError(ValueError):
    """A backup or restore refused, with the reason (not a store problem)."""


def backup(db: str | os.PathLike[str], dest: str | os.PathLike[str],
           map_size: int = 8 << 30) -> dict[str, object]:
    """A consistent compacted copy of the live store in ``db`` into the new directory
    ``dest`` (data.mdb and a manifest, 0600 in a 0700 directory); the manifest.
    ``map_size``: the metaserver's (a smaller map would fail when its store grew)."""
    src, out = Path(db), Path(dest)
    if not (src / "data.mdb").is_file():
        raise BackupError(f"{src} holds no metadata store (no data.mdb)")
    if out.exists() and any(out.iterdir()):
        raise BackupError(f"{out} exists and is not empty; name a new directory")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    # read-only, but with the lock file: the metaserver's writer keeps the pages this
    # snapshot reads until the copy ends (lock=False would let it reuse them)
    try:
        env = lmdb.open(str(src), readonly=True, lock=True, subdir=True, max_dbs=0,
                        readahead=False, map_size=map_size)
        try:
            started = time.time()
            with env.begin() as txn:
                counters = {name: K.read_u64(v) for name in ("next_ino", "inodes", "nchain")
                            if (v := txn.get(K.counter(name.encode()))) is not None}
                fmt = txn.get(K.FORMAT)
            env.copy(str(out), compact=True)
        finally:
            env.close()
    except lmdb.Error as exc:  # a store being resized under the copy, a lock not ours
        shutil.rmtree(out, ignore_errors=True)
        raise BackupError(f"copy of {src} failed: {exc}; run it again (as the "
                          "metaserver's user or root)") from None
    os.chmod(out / "data.mdb", 0o600)
    manifest: dict[str, object] = {
        "source": str(src.resolve()), "time": started,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "format": K.read_u64(fmt) if fmt else 0, "pfs": package_version(),
        "bytes": (out / "data.mdb").stat().st_size, "counters": counters}
    _write_private(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    with open(out / "data.mdb", "rb") as f:
        os.fsync(f.fileno())
    _fsync_dir(out)
    return manifest


def restore(src: str | os.PathLike[str], db: str | os.PathLike[str],
            map_size: int = 8 << 30) -> tuple[Path | None, dict[str, int]]:
    """Put the backup in ``src`` in place of the store ``db`` (its metaserver stopped).
    The store there is kept, renamed ``DB.pre-restore-TIME`` (None: there was none);
    its capability key is carried over. Returns that and the counters as restored."""
    src_p, db_p = Path(src), Path(db)
    if not (src_p / "data.mdb").is_file():
        raise BackupError(f"{src_p} is not a backup (no data.mdb)")
    stage = db_p.with_name(db_p.name + ".restoring")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(mode=0o700, parents=True)
    shutil.copyfile(src_p / "data.mdb", stage / "data.mdb")
    os.chmod(stage / "data.mdb", 0o600)
    cap_key = db_p / "capability.key"
    if cap_key.is_file():  # capabilities held by clients stay valid
        shutil.copy2(cap_key, stage / "capability.key")
    counters = _move_counters_past(stage, map_size, _backup_start(src_p))
    old: Path | None = None
    if db_p.exists():
        old = db_p.with_name(f"{db_p.name}.pre-restore-{time.strftime('%Y%m%dT%H%M%S')}")
        os.rename(db_p, old)
    os.rename(stage, db_p)
    _fsync_dir(db_p.parent)
    return old, counters


def _backup_start(src: Path) -> int:
    """When the backup in ``src`` started (ns, its manifest); 0 when unknown."""
    try:
        with open(src / MANIFEST, encoding="utf-8") as f:
            started = json.load(f).get("time")
    except (OSError, ValueError, AttributeError):
        return 0
    return int(started * 1e9) if isinstance(started, (int, float)) else 0


def _move_counters_past(path: Path, map_size: int, started: int) -> dict[str, int]:
    """In the copy at ``path``: next_ino, nchain and every chain's version moved past
    anything the data servers may have seen since the backup, and the restore window
    from ``started`` recorded (module doc)."""
    store = LmdbStore(path, map_size)  # refuses a format this pfs cannot open
    try:
        with store.write() as txn:
            if store_format(txn) != METADATA_FORMAT:
                raise BackupError(f"{path}: not a metadata store of this pfs")
            out: dict[str, int] = {}
            for name, gap in (("next_ino", INO_GAP), ("nchain", CHAIN_GAP)):
                raw = txn.get(K.counter(name.encode()))
                out[name] = (K.read_u64(raw) if raw else 0) + gap
                txn.put(K.counter(name.encode()), K.u64(out[name]))
            out["chains"] = ChainTable().advance(txn, VERSION_GAP)
            # (the margin after now too: this host's clock may be behind the one that
            # stamped the cuts, when the metaserver moved hosts)
            lo = max(0, started - CUT_MARGIN) if started else 0
            txn.put(K.restore_window(lo), K.u64(time.time_ns() + CUT_MARGIN))
    finally:
        store.close()
    for name in os.listdir(path):  # the lock file LMDB just made: the service's alone
        os.chmod(path / name, 0o600)
    return out


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
