"""The mount's life: options, readiness, clean unmount on signals and ``pfs umount``, and
a metaserver that goes away (errors, never a hang) and comes back (the mount recovers)."""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pfs.fuse.mount import mount_entry
from pfs.fuse.options import MountError, parse_options
from pfs.tools import cluster
from tests.fuse_fixtures import *  # noqa: F403
from tests.fuse_fixtures import PY, fuse_usable, mounted, pfs_cli
from tests.integration.test_cluster import _kill


def test_parse_options() -> None:
    o = parse_options(
        [
            "allow_other,ro,entry_timeout=5,attr_timeout=0.5",
            "timeout=3,_netdev",
            "x-systemd.automount,noatime,fsname=pfs0,defaults",
        ]
    )
    assert o.tuning.read_only and o.tuning.entry_timeout == 5 and o.tuning.attr_timeout == 0.5
    assert o.timeout == 3
    assert sorted(o.fuse) == ["allow_other", "fsname=pfs0", "noatime"]
    assert "ro" in o.fuse_options("h:1") and "default_permissions" in o.fuse_options("h:1")
    assert "default_permissions" not in parse_options(["nodefault_permissions"]).fuse_options("h:1")
    for bad in ("bogus", "entry_timeout=x", "timeout=-1", "max_tasks=0", "attr_timeout="):
        with pytest.raises(MountError):
            parse_options([bad])


@pytest.fixture
def mountpoint() -> Iterator[Path]:
    if (why := fuse_usable()) is not None:
        pytest.skip(why)
    d = Path(tempfile.mkdtemp(prefix="pfs-test-mnt-"))
    try:
        yield d
    finally:
        if mount_entry(str(d)) is not None:
            subprocess.run(["umount", "-l", str(d)], check=False)
        os.rmdir(d)


def test_mount_errors(client_toml: Path, mountpoint: Path, tmp_path: Path) -> None:
    r = pfs_cli("mount", "--config", str(client_toml), str(mountpoint), "-o", "bogus")
    assert r.returncode != 0 and "unknown mount option" in r.stderr
    r = pfs_cli("mount", "--config", str(client_toml), str(tmp_path / "missing"))
    assert r.returncode != 0 and "not a directory" in r.stderr
    # nothing listens on port 1: the mount fails fast and leaves nothing mounted
    r = pfs_cli("mount", "--meta", "127.0.0.1:1", str(mountpoint))
    assert r.returncode != 0 and "127.0.0.1:1" in r.stderr
    assert mount_entry(str(mountpoint)) is None
    r = pfs_cli("umount", str(mountpoint))
    assert r.returncode != 0 and "not mounted" in r.stderr


def test_background_mount_and_umount(client_toml: Path) -> None:
    with mounted(client_toml) as m:
        e = mount_entry(str(m))
        assert e is not None and e["fstype"] == "fuse.pfs"
        assert os.stat(m).st_ino == 1
        r = pfs_cli("mount", "--config", str(client_toml), str(m))
        assert r.returncode != 0 and "already" in r.stderr
    assert not m.exists() or mount_entry(str(m)) is None


@contextmanager
def _foreground(client_toml: Path, mountpoint: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``pfs mount -f`` on ``mountpoint``, once it reported ready; killed (and the mount
    detached) if the test leaves it running."""
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "pfs.tools.cli",
            "mount",
            "-f",
            "--config",
            str(client_toml),
            str(mountpoint),
            "--ready-fd",
            str(wfd),
        ],
        pass_fds=(wfd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    os.close(wfd)
    try:
        assert select.select([rfd], [], [], 60)[0], "no readiness report"
        assert os.read(rfd, 100) == b"ok\n"
        yield proc
    finally:
        os.close(rfd)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_signal_unmounts(client_toml: Path, mountpoint: Path, sig: int) -> None:
    with _foreground(client_toml, mountpoint) as proc:
        (mountpoint / f"sig-{sig}").write_bytes(b"x")
        fd = os.open(mountpoint / f"sig-{sig}", os.O_RDONLY)  # open files do not block it
        os.close(fd)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert mount_entry(str(mountpoint)) is None
        assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()


def test_the_daemon_exits_after_umount(client_toml: Path, mountpoint: Path) -> None:
    """``pfs umount`` of a mount that served requests (answered at once and after a
    metaserver call) ends its daemon: the worker that last read /dev/fuse may still
    hold pyfuse3's read lock when the session ends (fuse/workers.py)."""
    with _foreground(client_toml, mountpoint) as proc:
        for i in range(20):
            f = mountpoint / f"exit-{i}"
            os.close(os.open(f, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            os.stat(f)
            os.unlink(f)
        r = pfs_cli("umount", str(mountpoint))
        assert r.returncode == 0, r.stderr
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()


def _errno_of(fn, *args) -> int:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno or -1
    return 0


def test_metaserver_gone_and_back(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=1)
    with mounted(toml, "timeout=2,entry_timeout=0,attr_timeout=0") as m:
        (m / "f").write_bytes(b"before")
        meta_pid = cluster.running(private_cluster)["meta"]
        # a metaserver that hangs: calls time out, nothing waits forever
        os.kill(meta_pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert _errno_of(os.stat, m / "f") in (errno.ETIMEDOUT, errno.EIO)
            assert time.monotonic() - t0 < 20
        finally:
            os.kill(meta_pid, signal.SIGCONT)
        # a metaserver that is gone: retried for `timeout`, then ETIMEDOUT (or EIO);
        # never ENOTCONN, which reads as a dead mount (docs "Errors")
        os.kill(meta_pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while cluster._pid_alive(meta_pid) and time.monotonic() < deadline:
            try:
                os.waitpid(meta_pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.02)
        assert _errno_of(os.stat, m / "f") in (errno.ETIMEDOUT, errno.EIO)
        assert _errno_of(os.listdir, m) in (errno.ETIMEDOUT, errno.EIO)
        # back on the same port: the mount answers again, data intact
        cluster.up(private_cluster)
        assert (m / "f").read_bytes() == b"before"
        (m / "g").write_bytes(b"after")
        assert sorted(os.listdir(m)) == ["f", "g"]
        # a data server that is gone: writes behind fail at close (or fsync), not silently
        data_pid = cluster.running(private_cluster)["data0"]
        os.kill(data_pid, signal.SIGKILL)
        while cluster._pid_alive(data_pid):
            try:
                os.waitpid(data_pid, 0)
            except ChildProcessError:
                break
        fd = os.open(m / "h", os.O_CREAT | os.O_WRONLY, 0o644)
        codes = []
        try:
            for _ in range(4):
                codes.append(_errno_of(os.write, fd, b"y" * (1 << 20)))
        finally:
            codes.append(_errno_of(os.close, fd))
        assert any(codes), codes


def test_a_metaserver_restart_is_waited_for_not_enotconn(private_cluster: Path) -> None:
    """The mount retries while the metaserver restarts: calls made meanwhile succeed
    once it is back (within the mount's timeout), none answers ENOTCONN."""
    toml = cluster.up(private_cluster, data_servers=1)
    with mounted(toml, "timeout=30,entry_timeout=0,attr_timeout=0") as m:
        (m / "f").write_bytes(b"before")
        _kill(private_cluster, "meta")
        back = threading.Timer(1.0, cluster.up, args=(private_cluster,))
        back.start()
        try:
            assert os.stat(m / "f").st_size == 6
            (m / "g").write_bytes(b"during")  # a create right after the restart
        finally:
            back.join()
        assert sorted(os.listdir(m)) == ["f", "g"]
        assert (m / "g").read_bytes() == b"during"


def test_mount_metrics_count_client_cache_hits(client_toml: Path, tmp_path: Path) -> None:
    """A mount whose config sets ``metrics_port`` serves /metrics: after some file
    operations its client-side counters (the attribute, xattr and short-circuit
    descriptor caches, RPCs sent) have moved, and the hedge and checksum counters are
    there."""
    from tests.metrics_scrape import free_port as _free_port
    from tests.metrics_scrape import scrape as _scrape
    from tests.metrics_scrape import value as _value

    port = _free_port()
    toml = tmp_path / "client.toml"
    toml.write_text(client_toml.read_text().replace("metrics_port = 0", f"metrics_port = {port}"))
    with mounted(toml) as m:
        d = m / f"metrics-{os.getpid()}"
        d.mkdir()
        data = os.urandom(3 << 20)
        for i in range(3):
            with open(d / f"f{i}", "wb") as f:
                for k in range(3):  # before each write the kernel asks security.capability
                    f.write(data[k << 20 : (k + 1) << 20])
            os.stat(d)  # the directory's attributes the create's reply carried
        for i in range(3):
            assert (d / f"f{i}").read_bytes() == data
        text = _scrape(port)
        for i in range(3):
            (d / f"f{i}").unlink()
        d.rmdir()
    lookups = {
        (c, r): _value(text, "pfs_client_cache_lookups_total", cache=c, result=r)
        for c in ("attr", "xattr", "local_fd")
        for r in ("hit", "miss")
    }
    assert lookups["attr", "hit"] + lookups["attr", "miss"] > 0, lookups
    assert lookups["xattr", "hit"] > 0, lookups  # the later writes' asks are answered here
    assert lookups["local_fd", "miss"] > 0, lookups  # the cluster's servers are local
    assert _value(text, "pfs_rpc_requests_total", service="client") > 0
    assert "pfs_client_hedged_reads_total" in text and "pfs_client_hedge_wins_total" in text
