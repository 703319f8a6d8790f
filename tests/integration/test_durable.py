"""Durable acknowledgements: close(), flush() and fsync() return only
after what the handle wrote is on stable storage on every replica, and only then is
the size committed; a directory opted out (``setstripe --no-sync``) skips it on close.

The probe (tests/sync_probe.py) is the data server's own ``sync`` reply: ``dirty``
counts the listed objects written since their last sync there. After a close it must be
0 on every replica; a close that stopped syncing leaves it at the number of objects
written (the opt-out shows the probe sees that)."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import pfs
from pfs.client.sync import Client
from pfs.core.layout import Layout
from pfs.tools import cluster
from tests.sync_probe import by_server, unsynced

UNIT = 64 * 1024


@pytest.mark.parametrize("size", [100, 4 * UNIT + 7])  # the blocking driver's, the trio's
def test_close_syncs_what_it_wrote_on_every_replica(client: Client, workdir: str,
                                                    size: int) -> None:
    d = f"{workdir}/durable"
    client.mkdir(d)
    client.set_layout(d, count=2, unit=UNIT, replicas=2)
    client.write_file(f"{d}/f", os.urandom(size))
    dirty = unsynced(client, f"{d}/f")
    assert len(dirty) >= 2 and set(dirty.values()) == {0}, dirty
    # the control: the same writes under the opt-out leave the objects unsynced
    s = f"{workdir}/scratch"
    client.mkdir(s)
    client.set_layout(s, count=2, unit=UNIT, replicas=2, durable=False)
    client.write_file(f"{s}/f", os.urandom(size))
    dirty = unsynced(client, f"{s}/f")
    written = by_server(Layout.from_wire(client.get_layout(f"{s}/f")))
    n = 1 if size < UNIT else 2
    assert sum(dirty.values()) == n * 2, (dirty, written)  # every replica of each stripe


def test_flush_and_fsync_sync_too_and_the_opt_out_still_fsyncs(client: Client,
                                                               workdir: str) -> None:
    s = f"{workdir}/scratch"
    client.mkdir(s)
    client.set_layout(s, count=2, unit=UNIT, replicas=1, durable=False)
    with client.open(f"{s}/f", "wb") as f:
        f.write(os.urandom(3 * UNIT))
        f.flush()  # opted out: flush commits the size only
        assert sum(unsynced(client, f"{s}/f").values()) == 2
        f.write(os.urandom(UNIT))
        f.fsync()  # fsync syncs even so
        assert set(unsynced(client, f"{s}/f").values()) == {0}
    d = f"{workdir}/durable"
    client.mkdir(d)
    client.set_layout(d, count=2, unit=UNIT)
    with client.open(f"{d}/f", "wb") as f:
        f.write(os.urandom(3 * UNIT))
        f.flush()  # the NFS close-to-open COMMIT
        assert set(unsynced(client, f"{d}/f").values()) == {0}
        assert client.stat(f"{d}/f").st_size == 3 * UNIT


def test_the_opt_out_is_inherited_kept_and_undone(client: Client, workdir: str) -> None:
    s = f"{workdir}/scratch"
    client.makedirs(f"{s}/old")
    lay = client.set_layout(s, durable=False)
    assert lay["durable"] is False
    client.mkdir(f"{s}/new")
    for p in (f"{s}/f", f"{s}/old/f", f"{s}/new/f"):  # subdirectories, older or newer
        client.write_file(p, b"x")
        assert client.get_layout(p)["durable"] is False
    client.set_layout(s, count=2)  # a layout change without the flag keeps it
    assert client.get_layout(s)["durable"] is False
    client.set_layout(s, durable=False)  # and the flag alone keeps the striping
    assert client.get_layout(s)["count"] == 2
    client.set_layout(s, durable=True)
    client.write_file(f"{s}/g", b"x")
    assert client.get_layout(f"{s}/g").get("durable", True) is True
    client.write_file(f"{workdir}/plain", b"x")  # elsewhere: durable, the field absent
    assert "durable" not in client.get_layout(f"{workdir}/plain")


def test_setstripe_no_sync(client_toml: Path, client: Client, workdir: str) -> None:
    client.mkdir(f"{workdir}/s")
    out = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "setstripe", "--json", "--config",
                          str(client_toml), "--no-sync", f"{workdir}/s"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert '"durable": false' in out
    assert client.get_layout(f"{workdir}/s")["durable"] is False


def _kill(d: Path, name: str) -> None:
    pid = cluster.running(d)[name]
    os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _sid(d: Path, i: int) -> str:
    return (d / "data" / f"ds{i}" / "server.id").read_text().strip()


def test_kill_9_of_data_servers_right_after_close_keeps_the_data(private_cluster: Path
                                                                 ) -> None:
    toml = cluster.up(private_cluster, data_servers=2)
    data = os.urandom(6 * UNIT + 5)
    with pfs.connect(config=toml) as c:
        c.mkdir("/d")
        c.set_layout("/d", count=2, unit=UNIT)
        c.write_file("/d/f", data)
        for name in ("data0", "data1"):
            _kill(private_cluster, name)
    toml = cluster.up(private_cluster)
    with pfs.connect(config=toml) as c:
        assert c.stat("/d/f").st_size == len(data)
        assert c.read_file("/d/f") == data


def test_a_replica_failing_the_sync_fails_close_and_commits_no_size(private_cluster: Path
                                                                    ) -> None:
    """The last member of a chain failing the sync fails close (no size committed); one
    of two members failing it is taken out of the chain, and the close is durable on the
    member left (docs/architecture.md "Replication")."""
    toml = cluster.up(private_cluster, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.mkdir("/d")
        c.set_layout("/d", count=1, unit=UNIT, replicas=2)
        c.mkdir("/one")
        c.set_layout("/one", count=1, unit=UNIT, replicas=1)
        f = c.open("/d/f", "wb")
        data = os.urandom(2 * UNIT)
        f.write(data)  # acknowledged by both replicas
        for n in range(20):  # a one-replica file on data1
            g = c.open(f"/one/g{n}", "wb")
            if g.handle.layout.servers[0][0] == _sid(private_cluster, 1):
                break
            g.close()
        g.write(os.urandom(UNIT))
        _kill(private_cluster, "data1")  # a replica dies before the close's sync
        with pytest.raises(OSError) as err:
            g.close()
        assert err.value.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.ENOTCONN,
                                   errno.EPIPE, errno.EIO)
        assert c.stat(f"/one/g{n}").st_size == 0  # the size was not committed
        f.close()  # data1 is taken out of /d/f's chain; synced on the member left
        assert c.stat("/d/f").st_size == 2 * UNIT
        lay = c.get_layout("/d/f")
        assert lay["servers"] == [[_sid(private_cluster, 0)]]
        assert set(unsynced(c, "/d/f").values()) == {0}
        assert c.read_file("/d/f") == data


def test_a_close_syncs_what_every_handle_of_the_client_wrote(client: Client,
                                                             workdir: str) -> None:
    """The size a close commits covers the writes of the client's other handles of
    the inode too: their stripes are synced with it."""
    d = f"{workdir}/d"
    client.mkdir(d)
    client.set_layout(d, count=2, unit=UNIT)
    client.write_file(f"{d}/f", b"")
    a, b = client.open(f"{d}/f", "r+b"), client.open(f"{d}/f", "r+b")
    try:
        a.seek(UNIT)
        a.write(os.urandom(UNIT))  # stripe 1
        b.write(os.urandom(10))  # stripe 0
        b.close()  # commits the size 2 * UNIT: a's stripe is synced too
        assert client.stat(f"{d}/f").st_size == 2 * UNIT
        assert set(unsynced(client, f"{d}/f").values()) == {0}
    finally:
        a.close()
