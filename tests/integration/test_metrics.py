"""The Prometheus endpoints of real server processes: counters move with the calls."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pfs
from pfs.core.daemon import wait_ready
from pfs.tools import cluster
from tests.metrics_scrape import free_port, scrape, value


def test_data_server_metrics_move_with_writes_and_reads(private_cluster: Path) -> None:
    port = free_port()
    toml = cluster.up(private_cluster, data_servers=1, data_args=["--metrics-port", str(port)])
    before = scrape(port)
    with pfs.connect(config=toml) as c:
        c.write_file("/m", os.urandom(300_000))
        assert len(c.read_file("/m")) == 300_000
        try:
            c.open("/nope", "rb")
        except FileNotFoundError:
            pass
    after = scrape(port)
    assert value(after, "pfs_rpc_bytes_in_total", service="dataserver") >= \
        value(before, "pfs_rpc_bytes_in_total", service="dataserver") + 300_000
    assert value(after, "pfs_rpc_requests_total", service="dataserver") > \
        value(before, "pfs_rpc_requests_total", service="dataserver")
    assert value(after, "pfs_rpc_seconds_count", service="dataserver") > 0
    assert value(after, "pfs_data_total_bytes") > 0
    assert value(after, "pfs_connections", service="dataserver") >= 0


def test_metaserver_metrics_count_calls_and_errors(tmp_path: Path) -> None:
    port = free_port()
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
        text = scrape(port)
        assert value(text, "pfs_rpc_requests_total", service="meta", method="mkdir") >= 1
        assert value(text, "pfs_rpc_requests_total", service="meta") >= 5
        assert value(text, "pfs_rpc_errors_total", service="meta", errno="ENOENT") >= 1
        assert value(text, "pfs_connections", service="meta") >= 0
        assert "pfs_server_heartbeat_age_seconds" in text
    finally:
        os.close(rfd)
        proc.terminate()
        proc.wait(timeout=30)
