"""Least privilege on disk and in keys (docs/security.md, "Files on disk", "Node keys and
root"): what servers create is theirs alone; node keys carry uid/gid ranges and act as
root only when made with --allow-root; `pfs cluster up` makes its admin key explicitly."""
from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import pfs
from pfs.client.sync import Client
from pfs.client.types import Cred
from pfs.core.config import ClientConfig, MetaConfig, load
from pfs.tools import admin_keys, cluster


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_servers_create_private_files(private_cluster: Path) -> None:
    d = private_cluster
    r = cli("cluster", "up", "--dir", str(d), "--data-servers", "2")
    assert r.returncode == 0, r.stderr
    assert "admin key 'local'" in r.stderr and "may act as root" in r.stderr
    with pfs.connect(config=d / "client.toml") as c:
        c.set_layout("/", count=2, unit=64 << 10)
        c.write_file("/f", os.urandom(300_000))
        c.makedirs("/a/b")
        c.write_file("/a/b/g", b"g")
    db = d / "meta"
    assert mode(db) == 0o700
    for name in ("data.mdb", "lock.mdb", "capability.key"):
        assert mode(db / name) == 0o600, name
    assert mode(d / "keys") == 0o700
    for k in (d / "keys").iterdir():
        assert mode(k) == 0o600, k
    assert mode(d / "meta.toml") == 0o600  # it names every key file
    files = dirs = 0
    for root, subdirs, names in os.walk(d / "data"):
        for s in subdirs:
            if Path(root) != d / "data":  # below the data directories the servers made
                assert mode(Path(root) / s) == 0o700, Path(root) / s
                dirs += 1
        for n in names:
            assert mode(Path(root) / n) == 0o600, Path(root) / n
            files += 1
    assert files >= 4 and dirs >= 2  # objects, checksums, sid and format files...


def test_a_store_made_before_is_made_private_at_start(private_cluster: Path) -> None:
    d = private_cluster
    cluster.up(d, data_servers=1)
    cluster.down(d)
    for name in ("data.mdb", "lock.mdb"):
        os.chmod(d / "meta" / name, 0o644)
    os.chmod(d / "meta", 0o755)
    cluster.up(d, data_servers=1)
    assert mode(d / "meta") == 0o700
    assert mode(d / "meta" / "data.mdb") == 0o600 and mode(d / "meta" / "lock.mdb") == 0o600


def test_node_keys_without_root_are_squashed_and_admin_keys_are_not(
        private_cluster: Path) -> None:
    d = private_cluster
    cluster.up(d, data_servers=1)
    r = cli("admin", "key", "create", "bob", "--cluster", str(d), "--uids", "1000-1999",
            "--gids", "1000-1999")
    assert r.returncode == 0, r.stderr
    assert "root squashed" in r.stdout and "restart the metaserver" in r.stdout
    r = cli("admin", "key", "create", "ops", "--cluster", str(d), "--allow-root")
    assert r.returncode == 0, r.stderr
    r = cli("admin", "key", "create", "bob", "--cluster", str(d))
    assert r.returncode != 0 and "already has a node key 'bob'" in r.stderr
    r = cli("admin", "key", "list", "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    rows = {line.split("\t")[0]: line for line in r.stdout.splitlines()}
    assert set(rows) == {"local", "bob", "ops"}
    assert "uids 1000-1999" in rows["bob"] and "root: no (squashed to uid 65534)" in rows["bob"]
    assert "root: yes" in rows["ops"] and "root: yes" in rows["local"]
    r = cli("admin", "key", "list", "--cluster", str(d), "--json")
    keys = {k["name"]: k for k in json.loads(r.stdout)}
    assert keys["bob"]["uids"] == [1000, 1999] and keys["bob"]["squash_uid"] == 65534
    assert keys["ops"]["allow_root"] and keys["bob"]["file_present"]
    bob_key = Path(load(MetaConfig, d / "meta.toml").node_keys[1].file)
    assert mode(bob_key) == 0o600
    cluster.down(d)
    cluster.up(d)  # the metaserver reads its keys at start; added keys are kept
    meta = load(ClientConfig, d / "client.toml").meta

    def as_key(name: str, cred: Cred | None = None) -> Client:
        return pfs.connect(ClientConfig(meta=meta, key_file=str(d / "keys" / f"{name}.key")
                                        if name != "local" else str(d / "keys" / "client.key"),
                                        key_name=name), cred=cred)

    with as_key("local") as admin:  # the admin key of `pfs cluster up` acts as root
        admin.mkdir("/pub", 0o777)
        admin.chmod("/pub", 0o777)
        admin.write_file("/root-only", b"secret")
        admin.chmod("/root-only", 0o600)
        assert admin.stat("/root-only").st_uid == 0
    with as_key("bob", Cred(0, 0, ())) as bob:
        # root on bob's node is squashed to nobody: not root's file, not root's directory
        with pytest.raises(OSError) as info:
            bob.read_file("/root-only")
        assert info.value.errno == errno.EACCES
        with pytest.raises(OSError) as info:
            bob.mkdir("/nope", 0o755)
        assert info.value.errno == errno.EACCES
        bob.write_file("/pub/by-root-of-bob", b"x")
        st = bob.stat("/pub/by-root-of-bob")
        assert (st.st_uid, st.st_gid) == (65534, 65534)
    with as_key("bob", Cred(1500, 1500, ())) as bob:
        bob.write_file("/pub/by-1500", b"y")
        assert bob.stat("/pub/by-1500").st_uid == 1500
    with as_key("bob", Cred(5, 5, ())) as bob, pytest.raises(OSError) as info:
        bob.stat("/pub")
    assert info.value.errno == errno.EPERM and "may not act as uid 5" in str(info.value)
    with as_key("ops", Cred(0, 0, ())) as ops:  # made with --allow-root
        assert ops.read_file("/root-only") == b"secret"
    # revoked: the key file goes, and the metaserver refuses it after its restart
    r = cli("admin", "key", "revoke", "bob", "--cluster", str(d))
    assert r.returncode == 0, r.stderr
    assert not bob_key.exists()
    assert "bob" not in {nk.name for nk in admin_keys.listing(d / "meta.toml")}
