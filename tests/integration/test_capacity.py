"""Honest capacity with real processes: a disk shared by four data servers counts once
(``pfs df``, statfs), a full server gets no new stripes, and ``ENOSPC`` comes only when
no server can take the data, naming the file, with every acknowledged byte kept."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pfs
from pfs.core.config import ClientConfig, load
from pfs.tools import cluster
from pfs.tools.cli import human

MiB = 1 << 20
FAST = ["--heartbeat", "0.2"]  # fresh free-space numbers without waiting


def _servers(c: Any) -> dict[str, dict[str, Any]]:
    servers: dict[str, dict[str, Any]] = c._run(c.aio.meta.servers)
    return servers


def _until(what: str, ok: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _df(toml: Path) -> str:
    env = {**os.environ, "PFS_CONFIG": str(toml)}
    r = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "df"], capture_output=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode()


def _full_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "full.toml"
    cfg.write_text("free_override = 0\n")  # the test knob: this server's disk looks full
    return cfg


def test_a_disk_shared_by_four_servers_counts_once(private_cluster: Path,
                                                    tmp_path: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=4, data_args=FAST)
    st = os.statvfs(private_cluster / "data")
    size = st.f_blocks * st.f_frsize
    with pfs.connect(config=toml) as c:
        vfs = c.statvfs()
        assert vfs.f_blocks * vfs.f_frsize == pytest.approx(size, abs=vfs.f_frsize)
        free = vfs.f_bavail * vfs.f_frsize
        assert abs(free - st.f_bavail * st.f_frsize) < size // 100  # not four times it
        servers = _servers(c)
        assert len(servers) == 4
        assert len({s["dirs"][0][1] for s in servers.values()}) == 1  # one filesystem
    out = _df(toml)
    rows = out.splitlines()
    assert len(rows) == 1 + 4 + 1, out  # header, one row per server, the total
    assert sum(" up" in r for r in rows[1:5]) == 4
    assert rows[-1].startswith("total") and human(size) in rows[-1]


def test_a_full_server_gets_no_new_stripes(private_cluster: Path, tmp_path: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=3, data_args=FAST)
    d = private_cluster.resolve()
    spec = cluster.load_spec(d)
    assert spec is not None
    data_sec = cluster._security(d, spec)[2]
    with pfs.connect(config=toml) as c:
        ddir = d / "data" / "full"
        ddir.mkdir()
        meta = load(ClientConfig, toml).meta
        cluster._start(d, "data9",
                       ["pfs.dataserver", *data_sec, "--dir", str(ddir), "--port", "0",
                        "--meta", meta, "--config", str(_full_config(tmp_path)), *FAST])
        _until("the full server to register",
               lambda: sum(s["alive"] for s in _servers(c).values()) == 4)
        full = [sid for sid, s in _servers(c).items() if s["full"]]
        assert len(full) == 1
        c.makedirs("/wide")
        c.set_layout("/wide", count=4, unit=64 * 1024)
        for i in range(12):
            c.write_file(f"/wide/f{i}", b"x" * 300_000)
            lay = c.get_layout(f"/wide/f{i}")
            # four stripes asked, three servers can take one: three, none on the full one
            assert lay["count"] == 3
            assert full[0] not in {s for stripe in lay["servers"] for s in stripe}
            assert c.read_file(f"/wide/f{i}") == b"x" * 300_000
    out = _df(toml)
    assert "FULL" in out and out.count(" up") == 3


def test_enospc_only_when_no_server_can_take_the_data(private_cluster: Path,
                                                      tmp_path: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=2,
                      data_args=["--config", str(_full_config(tmp_path)), *FAST])
    with pfs.connect(config=toml) as c:
        c.mkdir("/d")  # metadata alone still works
        with pytest.raises(OSError) as info:
            c.write_file("/d/weights.bin", b"x" * MiB)
        assert info.value.errno == errno.ENOSPC
        assert "weights.bin" in str(info.value) and "full" in str(info.value)
        assert not c.exists("/d/weights.bin")


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_disk_that_fills_up_gives_enospc_and_keeps_what_was_acknowledged(
        private_cluster: Path) -> None:
    d = private_cluster.resolve()
    small = d / "data" / "ds0"  # the one data server's directory, 8 MiB
    with _tmpfs(small, "8m"):
        try:
            # a slow heartbeat: only the one a full disk sends at once can tell the
            # metaserver in time
            toml = cluster.up(d, data_servers=1, data_args=["--heartbeat", "6"])
            with pfs.connect(config=toml) as c:
                kept = os.urandom(2 * MiB)
                c.write_file("/kept", kept)  # acknowledged
                with pytest.raises(OSError) as info:  # more than the disk holds
                    c.write_file("/big", os.urandom(16 * MiB))
                assert info.value.errno == errno.ENOSPC, info.value
                assert "big" in str(info.value)
                assert c.read_file("/kept") == kept
                # the server said so at once: the next file is refused by placement
                _until("the full disk to be reported",
                       lambda: all(s["full"] for s in _servers(c).values()), timeout=2)
                with pytest.raises(OSError) as info:
                    c.write_file("/next", b"y")
                assert info.value.errno == errno.ENOSPC and "next" in str(info.value)
                c.remove("/big")  # space comes back with the next heartbeat
                _until("the space to come back",
                       lambda: not any(s["full"] for s in _servers(c).values()), timeout=30)
                c.write_file("/next", b"y")
                assert c.read_file("/kept") == kept
        finally:
            cluster.down(d)
