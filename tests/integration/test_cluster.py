"""Whole clusters of real processes: restarts, kill -9, dead servers, the CLI."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import pfs
from pfs.core.config import ClientConfig, ConfigError, load
from pfs.metaserver.counters import INO_RANGE
from pfs.tools import cluster

UNIT = 64 * 1024


def _kill(d: Path, name: str, sig: int = signal.SIGKILL) -> None:
    pid = cluster.running(d)[name]
    os.kill(pid, sig)
    while True:  # reap it (it is our child) or wait for it to go
        try:
            done, _ = os.waitpid(pid, 0)
            if done == pid:
                return
        except ChildProcessError:
            if not cluster._pid_alive(pid):
                return


def test_restart_of_every_server_keeps_data(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=3)
    blobs = {f"/d/f{i}": os.urandom(50_000 * (i + 1)) for i in range(5)}
    with pfs.connect(config=toml) as c:
        c.mkdir("/d")
        c.set_layout("/d", count=3, unit=UNIT)
        for p, b in blobs.items():
            c.write_file(p, b)
    cluster.down(private_cluster)
    assert cluster.running(private_cluster) == {}
    toml2 = cluster.up(private_cluster)  # the same cluster, on its existing data
    assert load(ClientConfig, toml2).meta == load(ClientConfig, toml).meta
    with pfs.connect(config=toml2) as c:
        for p, b in blobs.items():
            assert c.read_file(p) == b
        assert len(c._run(c.aio.meta.servers)) == 3  # same identities, no duplicates


def test_kill_9_metaserver_keeps_every_acknowledged_change(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.mkdir("/k")
        for i in range(50):
            c.write_file(f"/k/f{i}", f"data {i}".encode())
        for i in range(0, 50, 2):
            c.rename(f"/k/f{i}", f"/k/r{i}")
        for i in range(1, 50, 4):
            c.remove(f"/k/f{i}")
        c.symlink("r0", "/k/link")
        c.setxattr("/k/r0", "user.tag", b"kept")
        given = max(c.stat(f"/k/{n}").st_ino for n in c.listdir("/k"))
        free = c.statvfs("/").f_ffree
    _kill(private_cluster, "meta")
    toml = cluster.up(private_cluster)
    with pfs.connect(config=toml) as c:
        # inode numbers come from ranges held in memory: none is given twice after a crash
        assert c.statvfs("/").f_ffree == free  # the inode count was stored with them
        c.write_file("/k/new", b"n")
        assert c.stat("/k/new").st_ino > given
        c.remove("/k/new")
        names = set(c.listdir("/k"))
        want = {f"r{i}" for i in range(0, 50, 2)} | {f"f{i}" for i in range(3, 50, 4)} | {"link"}
        assert names == want
        for i in range(0, 50, 2):
            assert c.read_file(f"/k/r{i}") == f"data {i}".encode()
        assert c.readlink("/k/link") == "r0"
        assert c.getxattr("/k/r0", "user.tag") == b"kept"


# One client process: waits for the go file, then creates its files through batched
# calls of the largest size (one request = one operation of the group commit).
CREATOR = r"""
import os, sys, time
import pfs
toml, go, d, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with pfs.connect(config=toml) as c:
    c.makedirs(d, exist_ok=True)
    while not os.path.exists(go):
        time.sleep(0.005)
    paths = [f"{d}/f{i:05d}" for i in range(n)]
    errs = [e for e in c.create_many(paths) if e is not None]
    print(len(errs), errs[:1])
"""


def _batched_creates(toml: Path, tmp: Path, dirs: list[str], n: int) -> None:
    """One process per directory, each creating ``n`` files in it through batched calls,
    all started together: the metaserver's batches hold several clients' calls, more
    inode numbers than one in-memory range holds."""
    go = tmp / f"go-{dirs[0].strip('/').replace('/', '-')}"
    procs = [subprocess.Popen([sys.executable, "-c", CREATOR, str(toml), str(go), d, str(n)],
                              stdout=subprocess.PIPE, text=True) for d in dirs]
    time.sleep(2.0)  # let them connect
    go.touch()
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and out.split()[0] == "0", out


def _inodes(c: pfs.Client, dirs: list[str], n: int) -> dict[str, int]:
    """Every file's inode number (its inode record read back: a stat of each path)."""
    got: dict[str, int] = {}
    for d in dirs:
        paths = [f"{d}/f{i:05d}" for i in range(n)]
        for p, st in zip(paths, c.stat_many(paths), strict=True):
            assert not isinstance(st, OSError), st
            got[p] = st.st_ino
    return got


def test_concurrent_batched_creates_never_give_an_inode_number_twice(
        private_cluster: Path, tmp_path: Path) -> None:
    """Inode numbers come from ranges held in memory (``INO_RANGE``, 1,024): several
    clients' batched creates, many ranges in one group-commit batch, give every file a
    number of its own, before and after a kill -9 of the metaserver."""
    clients, n = 6, 3 * INO_RANGE  # 3 calls of MAX_MANY paths per client
    toml = cluster.up(private_cluster, data_servers=1)
    with pfs.connect(config=toml) as c:
        c.mkdir("/b")
    first = [f"/b/a{i}" for i in range(clients)]
    _batched_creates(toml, tmp_path, first, n)
    with pfs.connect(config=toml) as c:
        before = _inodes(c, first, n)
        free = c.statvfs("/").f_ffree
    assert len(set(before.values())) == len(before) == clients * n
    _kill(private_cluster, "meta")
    toml = cluster.up(private_cluster)
    second = [f"/b/b{i}" for i in range(clients)]
    with pfs.connect(config=toml) as c:
        assert _inodes(c, first, n) == before  # every acknowledged create is there
        assert c.statvfs("/").f_ffree == free
    _batched_creates(toml, tmp_path, second, n)
    with pfs.connect(config=toml) as c:
        after = _inodes(c, second, n)
        every = list(before.values()) + list(after.values())
        assert len(set(every)) == len(every)
        for d in first + second:  # every record is there to remove, once
            paths = [f"{d}/f{i:05d}" for i in range(n)]
            assert c.unlink_many(paths) == [None] * n
            c.rmdir(d)
        # the count followed: every file and both rounds' directories are gone
        assert c.statvfs("/").f_ffree == free + clients * (n + 1)


def test_dead_data_server_gives_a_clear_error_not_a_hang(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.mkdir("/x")
        c.set_layout("/x", count=2, unit=UNIT, replicas=1)  # no other copy to read
        c.write_file("/x/f", os.urandom(4 * UNIT))
        _kill(private_cluster, "data1")
        with pytest.raises(OSError) as ei:
            c.read_file("/x/f")
        assert ei.value.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EIO, errno.ENOTCONN)
        # the rest of the namespace keeps working
        assert c.stat("/x/f").st_size == 4 * UNIT
    cluster.up(private_cluster)  # it comes back on its data
    with pfs.connect(config=toml) as c:
        assert len(c.read_file("/x/f")) == 4 * UNIT


def test_open_handle_survives_a_data_server_restart(private_cluster: Path) -> None:
    """A data server that comes back registers on a new port: the same client finds it
    there on its next call (it used to fail once with ECONNREFUSED at the old address)."""
    toml = cluster.up(private_cluster, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.mkdir("/x")
        c.set_layout("/x", count=2, unit=UNIT)
        data = os.urandom(4 * UNIT)
        c.write_file("/x/f", data)
        f = c.open("/x/f", "r+b")  # open for writing too: reads go over TCP
        assert f.read() == data
        _kill(private_cluster, "data1")
        cluster.up(private_cluster)
        f.seek(0)
        assert f.read() == data
        f.seek(0)
        f.write(b"z" * 10)
        f.close()
        assert c.read_file("/x/f") == b"z" * 10 + data[10:]


def test_metaserver_down_is_an_error_then_recovers(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=1)
    with pfs.connect(config=toml) as c:
        c.write_file("/m", b"abc")
        _kill(private_cluster, "meta")
        c.aio.meta.timeout = 1.0  # retried that long (docs "Errors"), then ETIMEDOUT
        with pytest.raises(OSError) as ei:
            c.stat("/m")
        assert ei.value.errno == errno.ETIMEDOUT
        cluster.up(private_cluster)
        assert c.read_file("/m") == b"abc"  # the same client reconnects


def test_open_handles_survive_a_metaserver_restart(private_cluster: Path) -> None:
    """The restarted metaserver knows none of the client's handles (EBADF): a handle
    reopens its inode, so what it wrote still reaches the file's size on close."""
    toml = cluster.up(private_cluster, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.mkdir("/x")
        c.set_layout("/x", count=2, unit=UNIT)
        data = os.urandom(4 * UNIT)
        c.write_file("/x/r", data)
        f = c.open("/x/f", "wb")
        f.write(b"a" * UNIT)
        r = c.open("/x/r", "rb")
        r2 = c.open("/x/r", "r+b")
        _kill(private_cluster, "meta")
        cluster.up(private_cluster)
        f.write(b"b" * UNIT)
        f.close()
        assert c.stat("/x/f").st_size == 2 * UNIT
        assert c.read_file("/x/f") == b"a" * UNIT + b"b" * UNIT
        assert r.read() == data
        assert r2.read() == data
        r.close()
        r2.close()


def test_a_dirty_close_outlasts_a_metaserver_outage(private_cluster: Path) -> None:
    """Acknowledged writes must not vanish from the size because the metaserver was
    away when the file was closed: the close retries until it is back."""
    toml = cluster.up(private_cluster, data_servers=2)
    with pfs.connect(config=toml) as c:
        f = c.open("/f", "wb")
        f.write(b"a" * UNIT)
        r = c.open("/f", "rb")  # nothing to commit: released with the next request
        _kill(private_cluster, "meta")
        r.close()  # no round trip of its own, so no error: the metaserver forgot it anyway
        restart = threading.Timer(1.0, cluster.up, args=(private_cluster,))
        restart.start()
        try:
            f.close()
        finally:
            restart.join()
        assert c.stat("/f").st_size == UNIT
        assert c.read_file("/f") == b"a" * UNIT


def test_unknown_config_key_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "client.toml"
    p.write_text('meta = "127.0.0.1:1"\nmetta = "typo"\n')
    with pytest.raises(ConfigError, match="metta"):
        pfs.connect(config=p)


def _pfs(*args: str, env_config: Path | None = None, input: bytes | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if env_config is not None:
        env["PFS_CONFIG"] = str(env_config)
    return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args], capture_output=True,
                          env=env, input=input, timeout=120)


def test_cli_round_trip(private_cluster: Path, tmp_path: Path) -> None:
    r = _pfs("cluster", "up", "--dir", str(private_cluster), "--data-servers", "2")
    assert r.returncode == 0, r.stderr
    toml = Path(r.stdout.decode().strip().splitlines()[-1])
    assert toml == private_cluster.resolve() / "client.toml" and toml.exists()
    local = tmp_path / "in.bin"
    local.write_bytes(os.urandom(300_000))
    for args in (["mkdir", "-p", "/a/b"], ["setstripe", "--count", "2", "--unit", "64K", "/a"],
                 ["put", str(local), "/a/b/f"], ["mv", "/a/b/f", "/a/g"],
                 ["get", "/a/g", str(tmp_path / "out.bin")]):
        r = _pfs(*args, env_config=toml)
        assert r.returncode == 0, (args, r.stderr)
    assert (tmp_path / "out.bin").read_bytes() == local.read_bytes()
    r = _pfs("ls", "-l", "/a", env_config=toml)
    assert b"g" in r.stdout and b"300000" in r.stdout
    r = _pfs("getstripe", "--json", "/a/g", env_config=toml)
    assert b'"count": 2' in r.stdout and b'"unit": 65536' in r.stdout
    r = _pfs("cat", "/a/g", "--config", str(toml), "--meta", load(ClientConfig, toml).meta)
    assert r.stdout == local.read_bytes()
    # a secured cluster: an address alone (no key) is refused, with what to do
    r = _pfs("cat", "/a/g", "--meta", load(ClientConfig, toml).meta)
    assert r.returncode == 1 and b"EACCES" in r.stderr and b"key_file" in r.stderr
    r = _pfs("df", env_config=toml)
    assert r.returncode == 0 and b"avail" in r.stdout
    r = _pfs("stat", "/nope", env_config=toml)
    assert r.returncode == 1 and b"ENOENT" in r.stderr
    r = _pfs("rm", "-r", "/a", env_config=toml)
    assert r.returncode == 0, r.stderr
    r = _pfs("cluster", "status", "--dir", str(private_cluster))
    assert r.returncode == 0 and r.stdout.count(b" up ") == 2
    r = _pfs("cluster", "down", "--dir", str(private_cluster))
    assert r.returncode == 0 and cluster.running(private_cluster) == {}
