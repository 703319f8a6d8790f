"""What an operator relies on, without processes: where a client finds its config and
what it says when none is usable (docs/security.md, "User keys"), the JSON log format,
and a restored metadata store's counters (docs/architecture.md, "Operations")."""
from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import msgpack
import pytest

from pfs.core import config as cfgmod
from pfs.core import logs
from pfs.core.config import ConfigError, MetaConfig
from pfs.metaserver import keys as K
from pfs.metaserver.backup import INO_GAP, VERSION_GAP, BackupError, backup, restore
from pfs.metaserver.chains import ChainTable
from pfs.metaserver.store import LmdbStore


@pytest.fixture
def lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No $PFS_CONFIG, a home in tmp_path, the system file in tmp_path/etc."""
    monkeypatch.delenv("PFS_CONFIG", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(cfgmod, "SYSTEM_CLIENT_CONFIG", str(tmp_path / "etc" / "client.toml"))
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_users_config_comes_before_the_nodes(lookup: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    system = write(lookup / "etc" / "client.toml", 'meta = "node:1"\n')
    assert cfgmod.find_client_config() == system
    user = write(lookup / "home" / ".config" / "pfs" / "client.toml", 'meta = "user:1"\n')
    assert cfgmod.client_config().meta == "user:1"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(lookup / "xdg"))
    assert cfgmod.find_client_config() == system  # $XDG_CONFIG_HOME replaces ~/.config
    monkeypatch.setenv("PFS_CONFIG", str(user))
    assert cfgmod.client_config(meta="other:2").meta == "other:2"  # $PFS_CONFIG + --meta
    monkeypatch.setenv("PFS_CONFIG", str(lookup / "none.toml"))
    with pytest.raises(ConfigError, match="none.toml does not exist"):
        cfgmod.client_config()  # named, so used as it is: no fall-back


def test_no_usable_config_names_every_file_tried(lookup: Path) -> None:
    write(lookup / "etc" / "client.toml",
          f'meta = "node:1"\nkey_file = "{lookup / "keys" / "node.key"}"\n'
          'key_name = "nodes"\n')
    with pytest.raises(ConfigError) as info:
        cfgmod.client_config()
    msg = str(info.value)
    assert "$PFS_CONFIG: not set" in msg
    assert f"{lookup / 'home' / '.config' / 'pfs' / 'client.toml'}: does not exist" in msg
    assert f"its key file {lookup / 'keys' / 'node.key'} does not exist" in msg
    assert "--owner USER" in msg
    assert cfgmod.client_config(meta="h:1").key_file == ""  # --meta alone: open client


def test_json_log_lines(tmp_path: Path) -> None:
    out = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)  # pytest's own: put back after
    logs.setup("info", "json", out)
    try:
        log = logging.getLogger("pfs.test")
        log.debug("not at INFO")
        log.info("hello %s", "there")
        try:
            raise OSError(5, "boom")
        except OSError:
            log.exception("it broke")
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["message"] == "hello there" and first["level"] == "INFO"
    assert first["logger"] == "pfs.test" and first["time"].endswith("Z") and "exc" not in first
    assert second["level"] == "ERROR" and "OSError: [Errno 5] boom" in second["exc"]
    with pytest.raises(ValueError, match="log format 'xml'"):
        logs.setup("INFO", "xml")
    with pytest.raises(ConfigError, match="log_level 'LOUD'"):
        MetaConfig(log_level="LOUD")


def test_restore_moves_counters_past_the_backup(tmp_path: Path) -> None:
    db = tmp_path / "db"
    store = LmdbStore(db)
    with store.write() as txn:
        txn.put(K.counter(b"next_ino"), K.u64(42))
        txn.put(K.counter(b"nchain"), K.u64(3))
        ChainTable().make_or_reuse(txn, ("a", "b"))
    with store.read() as txn:
        [chain] = ChainTable().scan(txn)
    store.close()  # one process opens an environment once (the metaserver is another)
    (db / "capability.key").write_bytes(b"k" * 32)
    manifest = backup(db, tmp_path / "bk")
    assert manifest["counters"] == {"next_ino": 42, "nchain": 4}
    with pytest.raises(BackupError, match="not empty"):
        backup(db, tmp_path / "bk")
    old, counters = restore(tmp_path / "bk", db)
    assert old is not None and (old / "data.mdb").exists()
    assert counters["next_ino"] == 42 + INO_GAP and counters["chains"] == 1
    assert (db / "capability.key").read_bytes() == b"k" * 32
    assert {os.stat(p).st_mode & 0o077 for p in db.iterdir()} == {0}
    store = LmdbStore(db)
    with store.read() as txn:
        assert K.read_u64(txn.get(K.counter(b"next_ino")) or b"") == 42 + INO_GAP
        raw = txn.get(K.chain(chain.cid))
        assert raw is not None
        assert msgpack.unpackb(raw)["version"] == chain.version + VERSION_GAP
    store.close()
