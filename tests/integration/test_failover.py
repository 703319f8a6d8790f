"""Failure detection with real processes on loopback (docs/architecture.md, "Failure
detection"): a hung replica (SIGSTOP) costs a read a hedge deadline, not a minute, and
leaves placement when its lease runs out; a killed one leaves placement as soon as a
client saw it refuse; both are back after a heartbeat; a drained server gets no new
stripes, across a metaserver restart. Files use ``replicas=2`` explicitly."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import pfs
from pfs.core.config import ClientConfig, load
from pfs.tools import cluster

MiB = 1 << 20
LEASE = 5.0  # MetaConfig.heartbeat_timeout's default, what `pfs cluster up` runs with


def _remote(toml: Path) -> ClientConfig:
    """The cluster's client config without short-circuit reads: a client on another host
    (here every server is local, and a local descriptor outlives its server's death)."""
    cfg = load(ClientConfig, toml)
    cfg.short_circuit = False
    return cfg


def _servers(c: Any) -> dict[str, dict[str, Any]]:
    return c._run(c.aio.meta.servers)  # type: ignore[no-any-return]


def _pid_of(d: Path, c: Any, sid: str) -> tuple[str, int]:
    """The cluster process name and pid of data server ``sid`` (by its data directory)."""
    for name, pid in cluster.running(d).items():
        if name.startswith("data") and (d / "data" / f"ds{name[4:]}" / "server.id").exists() \
                and (d / "data" / f"ds{name[4:]}" / "server.id").read_text().strip() == sid:
            return name, pid
    raise AssertionError(f"no process for data server {sid}: {cluster.running(d)}")


def _wait_for(what: str, cond: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``cond()`` held (polled); fails after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def _new_files_avoid(c: Any, d: str, sid: str, n: int = 8) -> None:
    for i in range(n):
        path = f"{d}/new{i}-{time.monotonic_ns()}"
        c.write_file(path, b"x" * 1000)
        placed = {s for reps in c.get_layout(path)["servers"] for s in reps}
        assert sid not in placed, f"{path} was placed on {sid}: {placed}"


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_sigstop_of_a_replica_during_large_reads(private_cluster: Path, where: str) -> None:
    toml = cluster.up(private_cluster, data_servers=3)
    data = os.urandom(32 * MiB)
    # local: short-circuit descriptors from every server (a hung one must not stall the
    # request for one); remote: every byte over TCP
    with pfs.connect(config=toml if where == "local" else _remote(toml)) as c:
        c.mkdir("/r")
        c.set_layout("/r", count=2, unit=4 * MiB, replicas=2)
        c.write_file("/r/big", data)
        victim = c.get_layout("/r/big")["servers"][0][0]  # first replica of stripe 0
        _, pid = _pid_of(private_cluster, c, victim)
        for _ in range(2):  # the client's latency estimate of every server
            assert c.read_file("/r/big") == data

        done: list[float] = []  # when each read that started after the stop ended
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader() -> None:
            try:
                while not stop.is_set():
                    got = c.read_file("/r/big")
                    assert got == data, "a read returned wrong bytes"
                    done.append(time.monotonic())
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        with _stopped(pid):
            t_stop = time.monotonic()
            th = threading.Thread(target=reader)
            th.start()
            try:
                first = _wait_for("a read served by the other replica",
                                  lambda: bool(done) or bool(errors), 10.0)
                assert not errors, errors
                # out of placement within a few lease times; reads go on meanwhile
                _wait_for("the stopped server marked down",
                          lambda: _servers(c)[victim]["state"] == "down",
                          3 * LEASE + 2)
                assert time.monotonic() - t_stop >= LEASE - 1.5  # the lease did it
                _new_files_avoid(c, "/r", victim)
                assert len(done) >= 2  # reads kept coming
            finally:
                stop.set()
                th.join(60)
            assert not errors, errors
        print(f"first read after SIGSTOP ended {first:.2f} s later")
        # SIGCONT: back after its next heartbeat
        _wait_for("the server back up", lambda: _servers(c)[victim]["state"] == "up", 5.0)
        assert c.read_file("/r/big") == data


def test_kill_9_leaves_placement_once_a_client_saw_the_refusal(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=3)
    data = os.urandom(3 * MiB)
    with pfs.connect(config=_remote(toml)) as c:
        c.mkdir("/k")
        c.set_layout("/k", count=1, unit=4 * MiB, replicas=2)
        c.write_file("/k/f", data)
        victim = c.get_layout("/k/f")["servers"][0][0]
        name, pid = _pid_of(private_cluster, c, victim)
        assert c.read_file("/k/f") == data  # a connection to the victim, known address
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        os.waitpid(pid, 0)
        t0 = time.monotonic()
        assert c.read_file("/k/f") == data  # refused: the other replica at once
        assert time.monotonic() - t0 < 2.0
        _wait_for("the killed server marked down", lambda: _servers(c)[victim]["state"] == "down",
                  2.0)
        # well inside the lease: the client's report (checked by a probe) did it
        assert time.monotonic() - t_kill < LEASE - 1
        _new_files_avoid(c, "/k", victim)
    cluster.up(private_cluster)  # it comes back on its data and registers
    with pfs.connect(config=toml) as c:
        assert _servers(c)[victim]["state"] == "up"
        assert c.read_file("/k/f") == data


def _pfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_a_drained_server_gets_no_new_stripes_across_a_metaserver_restart(
        private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.mkdir("/d")
        c.set_layout("/d", count=2, unit=MiB, replicas=1)
        sid = sorted(_servers(c))[0]
    out = _pfs("admin", "drain", sid[:8], "--config", str(toml))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{sid}: draining"
    bad = _pfs("admin", "drain", "nosuchserver", "--config", str(toml))
    assert bad.returncode != 0 and "no data server 'nosuchserver'" in bad.stderr
    pid = cluster.running(private_cluster)["meta"]
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    cluster.up(private_cluster)  # the mark is durable
    listing = _pfs("admin", "servers", "--config", str(toml))
    assert listing.returncode == 0 and "draining" in listing.stdout, listing
    df = _pfs("df", "--config", str(toml))
    assert "DRAINING" in df.stdout, df.stdout
    with pfs.connect(config=toml) as c:
        assert _servers(c)[sid]["draining"]
        _new_files_avoid(c, "/d", sid)
    out = _pfs("admin", "undrain", sid, "--config", str(toml))
    assert out.returncode == 0 and out.stdout.strip() == f"{sid}: up", out
    with pfs.connect(config=toml) as c:
        placed = set()
        for i in range(6):
            c.write_file(f"/d/back{i}", b"y")
            placed |= {s for reps in c.get_layout(f"/d/back{i}")["servers"] for s in reps}
        assert sid in placed  # count 2 over 2 servers: every file uses both
