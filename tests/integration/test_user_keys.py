"""User keys (docs/security.md, "User keys"): an ordinary user on a client node works
with a key of their own, issued by `pfs admin key create NAME --owner USER`, found in
~/.config/pfs/client.toml without root; it may not act as anyone else, and the node's
key stays out of its reach.

The user's process is a child that imports what it needs as root and then drops to uid
1000 (the interpreter lives under /root here, which uid 1000 may not enter)."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import pfs
from pfs.core.config import ClientConfig, MetaConfig, load
from pfs.tools import cluster

UID = 1000

# Run as the user: argv = uid, cluster dir. Prints one JSON line of findings.
AS_USER = r'''
import dataclasses, encodings.idna, errno, json, os, sys
import numpy as np
import safetensors.numpy
import pfs, pfs.client.sync, pfs.client.aio, pfs.loader.safetensors
from pfs.core import config as cfgmod
uid, d = int(sys.argv[1]), sys.argv[2]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
out = {}
found = cfgmod.find_client_config()  # no $PFS_CONFIG: the user's own
out["found"] = str(found)
tensors = {"w": np.arange(4096 * 48, dtype=np.float32).reshape(4096, 48),
           "b": np.arange(7, dtype=np.int64)}
blob = safetensors.numpy.save(tensors)
with pfs.connect() as c:
    c.write_file("/home/u/data.bin", bytes(range(256)) * 9000)
    out["read_back"] = c.read_file("/home/u/data.bin") == bytes(range(256)) * 9000
    c.write_file("/home/u/ck.safetensors", blob)
    st = c.stat("/home/u/ck.safetensors")
    out["owner"] = [st.st_uid, st.st_gid]
    got = pfs.load_safetensors("/home/u/ck.safetensors", client=c, framework="numpy")
    out["loaded"] = sorted(got) == ["b", "w"] and all(
        np.array_equal(got[k], tensors[k]) for k in tensors)
cfg = cfgmod.client_config(None)
try:  # the same key claiming uid 1001
    with pfs.connect(config=dataclasses.replace(cfg, uid=uid + 1, gid=uid)) as c:
        c.stat("/home/u")
    out["other_uid"] = "allowed"
except OSError as exc:
    out["other_uid"] = [exc.errno, str(exc)]
try:
    open(os.path.join(d, "keys", "client.key"), "rb").read()
    out["node_key"] = "read"
except OSError as exc:
    out["node_key"] = exc.errno
try:  # the node's config: its key is not the user's to read
    pfs.connect(config=os.path.join(os.environ["HOME"], "node.toml")).close()
    out["node_config"] = "connected"
except (OSError, cfgmod.ConfigError) as exc:
    out["node_config"] = str(exc)
os.environ["HOME"] = "/nonexistent"
cfgmod.SYSTEM_CLIENT_CONFIG = os.path.join(d, "client.toml")
try:
    cfgmod.find_client_config()
    out["lookup"] = "found"
except cfgmod.ConfigError as exc:
    out["lookup"] = str(exc)
print(json.dumps(out))
'''


@pytest.fixture
def home() -> Iterator[Path]:
    """A home directory uid 1000 can reach (pytest's tmp_path is root's alone)."""
    h = Path(tempfile.mkdtemp(prefix="pfs-user-home-"))
    os.chmod(h, 0o755)
    os.chown(h, UID, UID)
    try:
        yield h
    finally:
        shutil.rmtree(h, ignore_errors=True)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def _has_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
@pytest.mark.skipif(not _has_user(UID), reason=f"no user with uid {UID} on this host")
def test_a_user_with_a_key_of_their_own(private_cluster: Path, home: Path) -> None:
    d = private_cluster
    cluster.up(d, data_servers=2)
    user_dir = home / ".config" / "pfs"
    r = cli("admin", "key", "create", "u1000", "--owner", str(UID), "--cluster", str(d),
            "--user-dir", str(user_dir))
    assert r.returncode == 0, r.stderr
    nk = {k.name: k for k in load(MetaConfig, d / "meta.toml").node_keys}["u1000"]
    assert (nk.uids, nk.gids, nk.allow_root) == ([UID, UID], [UID, UID], False)
    for f in (user_dir / "u1000.key", user_dir / "client.toml"):
        st = f.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (UID, 0o600), f
    assert (user_dir / "u1000.key").read_bytes() == Path(nk.file).read_bytes()
    assert Path(nk.file).stat().st_uid == 0  # the metaserver's copy is not the user's
    r = cli("admin", "key", "create", "again", "--owner", str(UID), "--cluster", str(d),
            "--user-dir", str(user_dir))
    assert r.returncode == 0 and "exists and was left alone" in r.stderr, r.stderr
    r = cli("admin", "key", "create", "r", "--owner", "0", "--cluster", str(d))
    assert r.returncode != 0 and "--allow-root" in r.stderr
    cluster.down(d)
    cluster.up(d)  # the metaserver reads its keys at start; data servers re-register
    with pfs.connect(config=d / "client.toml") as admin:
        admin.makedirs("/home/u")
        admin.chown("/home/u", UID, UID)
    node = home / "node.toml"  # the node's config, readable by all as /etc/pfs's is
    shutil.copy(d / "client.toml", node)
    os.chmod(node, 0o644)
    env = {k: v for k, v in os.environ.items() if k not in ("PFS_CONFIG", "XDG_CONFIG_HOME")}
    r2 = subprocess.run([sys.executable, "-c", AS_USER, str(UID), str(d)], capture_output=True,
                        text=True, timeout=120, env={**env, "HOME": str(home)}, cwd=home)
    assert r2.returncode == 0, r2.stderr
    out = json.loads(r2.stdout.splitlines()[-1])
    assert out["found"] == str(user_dir / "client.toml")
    assert out["read_back"] and out["loaded"] and out["owner"] == [UID, UID]
    err, msg = out["other_uid"]
    assert err == 1 and "may not act as uid 1001" in msg, out  # EPERM at the metaserver
    assert out["node_key"] == 13  # EACCES
    assert "EACCES" in out["node_config"] and "--owner" in out["node_config"]
    lookup = out["lookup"]
    assert "$PFS_CONFIG: not set" in lookup and "/nonexistent/.config/pfs/client.toml: does " \
        "not exist" in lookup and str(d / "client.toml") in lookup, lookup
    # the objects of the user's files are on both data servers (2 replicas)
    with pfs.connect(config=d / "client.toml") as admin:
        assert admin.read_file("/home/u/data.bin") == bytes(range(256)) * 9000
    user_cfg = load(ClientConfig, user_dir / "client.toml")
    assert (user_cfg.key_name, user_cfg.uid, user_cfg.gid) == ("u1000", UID, UID)
