"""The Prometheus endpoints of real server processes: counters move with the calls."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pfs
from pfs.core.daemon import wait_ready
from pfs.tools import cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return str(r.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _value(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def test_data_server_metrics_move_with_writes_and_reads(private_cluster: Path) -> None:
    port = _free_port()
    toml = cluster.up(private_cluster, data_servers=1, data_args=["--metrics-port", str(port)])
    before = _scrape(port)
    with pfs.connect(config=toml) as c:
        c.write_file("/m", os.urandom(300_000))
        assert len(c.read_file("/m")) == 300_000
        try:
            c.open("/nope", "rb")
        except FileNotFoundError:
            pass
    after = _scrape(port)
    assert _value(after, "pfs_rpc_bytes_in_total", service="dataserver") >= \
        _value(before, "pfs_rpc_bytes_in_total", service="dataserver") + 300_000
    assert _value(after, "pfs_rpc_requests_total", service="dataserver") > \
        _value(before, "pfs_rpc_requests_total", service="dataserver")
    assert _value(after, "pfs_rpc_seconds_count", service="dataserver") > 0
    assert _value(after, "pfs_data_total_bytes") > 0
    assert _value(after, "pfs_connections", service="dataserver") >= 0


def test_metaserver_metrics_count_calls_and_errors(tmp_path: Path) -> None:
    port = _free_port()
    rfd, wfd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "pfs.metaserver", "--db",
                             str(tmp_path / "db"), "--port", "0", "--metrics-port", str(port),
                             "--ready-fd", str(wfd)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            pass_fds=(wfd,))
    os.close(wfd)
    try:
        line = wait_ready(rfd, 60)
        assert line is not None, "the metaserver exited"
        with pfs.connect(meta=f"127.0.0.1:{int(line)}") as c:
            c.mkdir("/d")
            for _ in range(3):
                c.stat("/d")
            try:
                c.stat("/missing")
            except FileNotFoundError:
                pass
        text = _scrape(port)
        assert _value(text, "pfs_rpc_requests_total", service="meta", method="mkdir") >= 1
        assert _value(text, "pfs_rpc_requests_total", service="meta") >= 5
        assert _value(text, "pfs_rpc_errors_total", service="meta", errno="ENOENT") >= 1
        assert _value(text, "pfs_connections", service="meta") >= 0
        assert "pfs_server_heartbeat_age_seconds" in text
    finally:
        os.close(rfd)
        proc.terminate()
        proc.wait(timeout=30)
