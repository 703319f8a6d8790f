"""``pfs admin backup`` and ``pfs admin restore``: the metadata store, copied while the
metaserver serves, and put back (docs/architecture.md, "Operations: backup").

Both run on the metaserver's host, as its service user or root, and name the store by
the metaserver's config (``--config meta.toml``) or a ``pfs cluster`` (``--cluster
DIR``). The copy is LMDB's compacting copy of one read snapshot (metaserver/backup.py);
restore needs the metaserver stopped, keeps the store it replaces, and moves the
restored counters past what the data servers have seen.
"""
from __future__ import annotations

import argparse
import socket
from pathlib import Path

from pfs.core import config as cfgmod
from pfs.core.config import ConfigError, MetaConfig
from pfs.tools import cluster
from pfs.tools.output import human, print_json

STOP_FIRST = "stop it first (systemctl stop pfs-meta, or pfs cluster down --dir DIR)"


def _meta_config(args: argparse.Namespace) -> MetaConfig:
    path = Path(args.cluster) / "meta.toml" if args.cluster else Path(args.config)
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    return cfgmod.load(MetaConfig, path)


def _serving(args: argparse.Namespace, cfg: MetaConfig) -> str | None:
    """Where the metaserver of this store still runs (None: it does not)."""
    if args.cluster:
        pid = cluster.running(Path(args.cluster)).get("meta")
        return f"pid {pid}" if pid else None
    host = "127.0.0.1" if cfg.host in ("", "0.0.0.0", "::") else cfg.host
    try:
        with socket.create_connection((host, cfg.port), timeout=1.0):
            return f"{host}:{cfg.port}"
    except OSError:
        return None


def cmd_backup(args: argparse.Namespace) -> None:
    from pfs.metaserver.backup import BackupError, backup  # `pfs` starts without lmdb

    try:
        cfg = _meta_config(args)
        manifest = backup(cfg.db, args.dest, cfg.map_size)
    except (ConfigError, BackupError) as exc:
        raise SystemExit(f"pfs admin backup: {exc}") from None
    if args.json:
        print_json({"dest": args.dest, **manifest})
        return
    size = manifest["bytes"]
    assert isinstance(size, int)
    print(f"backed up {cfg.db} to {args.dest}: {human(size)} (compacted), as of "
          f"{manifest['time_utc']}")


def cmd_restore(args: argparse.Namespace) -> None:
    from pfs.metaserver.backup import BackupError, restore  # `pfs` starts without lmdb

    try:
        cfg = _meta_config(args)
        where = _serving(args, cfg)
        if where:
            raise ConfigError(f"the metaserver of {cfg.db} is running ({where}): {STOP_FIRST}")
        old, counters = restore(args.source, cfg.db, cfg.map_size)
    except (ConfigError, BackupError) as exc:
        raise SystemExit(f"pfs admin restore: {exc}") from None
    print(f"restored {args.source} into {cfg.db}"
          + (f"; the store it replaced is kept in {old}" if old else ""))
    print(f"inode numbers now start at {counters['next_ino']}, {counters['chains']} "
          "chain(s) at new versions (past anything the data servers saw)")
    print("next: start the metaserver; then `pfs fsck` lists the objects of files made "
          "after the backup (orphan) and of files deleted after it (missing); "
          "`pfs fsck --repair --remove-orphans` reclaims the orphans")


def add_parser(adm: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pfs admin backup`` and ``pfs admin restore`` under ``adm``."""
    def where(sp: argparse.ArgumentParser) -> None:
        g = sp.add_mutually_exclusive_group(required=True)
        g.add_argument("--config", help="the metaserver's config (meta.toml)")
        g.add_argument("--cluster", metavar="DIR", help="a `pfs cluster` directory")

    sp = adm.add_parser("backup", help="a consistent, compacted copy of the metadata store "
                                       "while the metaserver serves (on its host)")
    sp.add_argument("dest", metavar="DEST", help="a new (or empty) directory")
    sp.add_argument("--json", action="store_true", help="one JSON document for scripts")
    where(sp)
    sp.set_defaults(fn=cmd_backup)
    sp = adm.add_parser("restore", help="put a backup in place of the metadata store "
                                        "(the metaserver stopped); the old one is kept")
    sp.add_argument("source", metavar="BACKUP", help="a directory made by pfs admin backup")
    where(sp)
    sp.set_defaults(fn=cmd_restore)
