"""Floods survived (docs/security.md, "Floods"): servers whose open-file limit is 1024
take a flood of unauthenticated connections, more than that limit, while an
authenticated client keeps reading and writing correctly, and are still up after."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pfs
from pfs.core import config as cfgmod
from pfs.core.config import ClientConfig, ConnLimits, DataConfig, MetaConfig, NodeKey
from pfs.core.daemon import wait_ready
from pfs.tools import cluster

NOFILE = 1024
FLOOD = 1200  # connections against each server, from several source addresses
SOURCES = [f"127.0.0.{i}" for i in range(2, 8)]
HANDSHAKE = 1.0  # the servers' handshake_timeout in this test


def _limit_nofile() -> None:  # runs in the child, before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


@contextmanager
def limited_cluster(d: Path, data_servers: int = 2) -> Iterator[tuple[Path, int, list[int],
                                                                       list[subprocess.Popen[bytes]]]]:
    """A key-mode cluster whose server processes run with RLIMIT_NOFILE 1024 (soft and
    hard, so they cannot raise it); client.toml, the metaserver's port, the data
    servers' ports and the processes."""
    cluster.init(d)
    k = d / "keys"
    limits = ConnLimits(handshake_timeout=HANDSHAKE)
    meta_toml = d / "meta.toml"
    meta_toml.write_text(cfgmod.dump(MetaConfig(
        db=str(d / "meta"), port=0, map_size=1 << 28, key_file=str(k / "cluster.key"),
        connections=limits,
        node_keys=[NodeKey("local", str(k / "client.key"), allow_root=True)])))
    procs: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], log: Path) -> int:
        rfd, wfd = os.pipe()
        with log.open("wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", *argv, "--ready-fd", str(wfd)], stdout=out,
                stderr=subprocess.STDOUT, pass_fds=(wfd,), preexec_fn=_limit_nofile))
        os.close(wfd)
        try:
            line = wait_ready(rfd, 60)
        finally:
            os.close(rfd)
        assert line is not None, log.read_text()
        return int(line)

    try:
        mport = start(["pfs.metaserver", "--config", str(meta_toml)], d / "meta.log")
        meta = f"127.0.0.1:{mport}"
        dports = []
        for i in range(data_servers):
            dt = d / f"data{i}.toml"
            dt.write_text(cfgmod.dump(DataConfig(
                dirs=[str(d / f"ds{i}")], port=0, meta=meta, heartbeat=0.2,
                key_file=str(k / "cluster.key"), connections=limits)))
            dports.append(start(["pfs.dataserver", "--config", str(dt)], d / f"data{i}.log"))
        toml = d / "client.toml"
        toml.write_text(cfgmod.dump(ClientConfig(meta=meta, key_file=str(k / "client.key"),
                                                 key_name="local")))
        yield toml, mport, dports, procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def flood(port: int, n: int, stop: threading.Event, made: list[int]) -> None:
    """Open ``n`` TCP connections to ``port`` from several loopback addresses, send
    nothing (or half a frame), keep them until ``stop``."""
    held: list[socket.socket] = []
    try:
        for i in range(n):
            if stop.is_set():
                break
            s = socket.socket()
            s.settimeout(2.0)
            try:
                s.bind((SOURCES[i % len(SOURCES)], 0))
                s.connect(("127.0.0.1", port))
                if i % 3 == 0:
                    s.send(b"PF\x01")  # a frame that never finishes
            except OSError:
                s.close()
                continue
            held.append(s)
            made[0] += 1
        stop.wait(60)
    finally:
        for s in held:
            s.close()


def test_flood_of_unauthenticated_connections_against_servers_at_1024_descriptors(
        tmp_path: Path) -> None:
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 4 * FLOOD, "the test needs fds"
    with limited_cluster(tmp_path / "c") as (toml, mport, dports, procs):
        for p in procs:  # the limit holds in the servers
            assert resource.prlimit(p.pid, resource.RLIMIT_NOFILE) == (NOFILE, NOFILE)
        with pfs.connect(config=toml) as c:
            c.set_layout("/", count=2, unit=64 << 10)
            data = os.urandom(1 << 20)
            c.write_file("/before", data)  # connections to every server made before
            stop = threading.Event()
            made = [[0], [0]]
            threads = [threading.Thread(target=flood, args=(port, FLOOD, stop, m))
                       for port, m in ((mport, made[0]), (dports[0], made[1]))]
            for t in threads:
                t.start()
            rounds = 0
            try:
                # an authenticated client keeps working while the flood goes on
                deadline = time.monotonic() + 120
                while (any(t.is_alive() for t in threads) and made[0][0] + made[1][0] < 2 * FLOOD
                       and time.monotonic() < deadline) or rounds < 5:
                    name = f"/during-{rounds}"
                    body = os.urandom(200_000) + bytes([rounds % 256])
                    c.write_file(name, body)
                    assert c.read_file(name) == body
                    assert c.read_file("/before") == data
                    rounds += 1
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
            assert made[0][0] > 1100 and made[1][0] > 1100, made
            assert rounds >= 5
            print(f"flood: {made} connections, {rounds} rounds of the client meanwhile")
            # every server is still up and serves: new connections authenticate again
            for p in procs:
                assert p.poll() is None, (tmp_path / "c").glob("*.log")
            assert all(s["alive"] for s in c._run(c.aio.meta.servers).values())
        with pfs.connect(config=toml) as c2:
            assert c2.read_file("/before") == data
            c2.write_file("/after", b"after")
            assert c2.read_file("/after") == b"after"
    logs = "".join(p.read_text() for p in (tmp_path / "c").glob("*.log"))
    assert " died: " not in logs
    assert "dropping unauthenticated connections" in logs  # the pool pushed the flood out
    assert "Too many open files" not in logs


def test_an_idle_unauthenticated_connection_is_closed(tmp_path: Path) -> None:
    with limited_cluster(tmp_path / "c", data_servers=1) as (_toml, mport, dports, _procs):
        for port in (mport, dports[0]):
            s = socket.create_connection(("127.0.0.1", port), timeout=10 * HANDSHAKE)
            t0 = time.monotonic()
            try:
                assert s.recv(1) == b""  # closed by the server, nothing sent
            except ConnectionResetError:
                pass
            finally:
                s.close()
            assert time.monotonic() - t0 < 10 * HANDSHAKE
