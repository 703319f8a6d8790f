"""Chain replication against real servers on loopback: one write order (replicas
byte-identical after concurrent overlapping writers), degraded writes when a replica is
killed mid-write (the write completes, the chain's version goes up), and a stale
replica that comes back never serves its old bytes."""
from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

import pfs
from pfs.core.layout import Layout
from pfs.core.messages import data as D
from pfs.tools import cluster
from tests.conftest import run_threads

UNIT = 1 << 20


def _kill(d: Path, name: str) -> None:
    pid = cluster.running(d)[name]
    os.kill(pid, signal.SIGKILL)
    while True:  # reap it (it is our child) or wait for it to go
        try:
            done, _ = os.waitpid(pid, 0)
            if done == pid:
                return
        except ChildProcessError:
            if not cluster._pid_alive(pid):
                return


def _sids(d: Path) -> dict[str, str]:
    """sid -> the cluster's process name (data0, data1...)."""
    out = {}
    for ds in sorted((d / "data").glob("ds*")):
        out[(ds / "server.id").read_text().strip()] = "data" + ds.name[2:]
    return out


def _replicas(d: Path, ino: int, stripe: int) -> list[Path]:
    return sorted((d / "data").glob(f"ds*/objects/*/{ino}.{stripe}"))


def _identical(d: Path, ino: int, stripes: int, replicas: int) -> None:
    for stripe in range(stripes):
        files = _replicas(d, ino, stripe)
        assert len(files) == replicas, files
        first = files[0].read_bytes()
        for other in files[1:]:
            assert other.read_bytes() == first, f"replicas of stripe {stripe} differ"


def test_two_replicas_by_default_on_distinct_servers(client, workdir: str) -> None:
    path = f"{workdir}/f"
    client.write_file(path, b"x" * 100)
    lay = Layout.from_wire(client.get_layout(path))
    assert lay.replicas == 2 and len(lay.chains) == lay.count
    for members in lay.servers:
        assert len(set(members)) == 2


def test_concurrent_overlapping_writers_leave_identical_replicas(
        client, client_toml: Path, cluster_dir: Path, workdir: str) -> None:
    path = f"{workdir}/f"
    client.set_layout(workdir, count=2, unit=UNIT, replicas=2)
    client.write_file(path, bytes(3 * UNIT))
    ino = client.stat(path).st_ino
    size = 3 * UNIT

    def writer(i: int) -> None:
        rng = random.Random(i)
        with pfs.connect(config=client_toml) as c, c.open(path, "r+b") as f:
            for _ in range(40):  # overlapping ranges, each writer its own byte
                off = rng.randrange(0, size - 1)
                n = min(rng.choice([100, 4096, 70_000, 300_000]), size - off)
                f.pwrite(bytes([i + 1]) * n, off)

    assert run_threads(writer, 4) == []
    _identical(cluster_dir, ino, 2, 2)
    # and a reader sees one of them
    data = client.read_file(path)
    assert len(data) == size and set(data) <= {0, 1, 2, 3, 4}


def test_a_stale_chain_version_is_refused_with_its_own_errno(client, workdir: str) -> None:
    path = f"{workdir}/f"
    client.set_layout(workdir, count=1, unit=UNIT, replicas=2)
    client.write_file(path, b"a" * 1000)
    lay = Layout.from_wire(client.get_layout(path))
    cid, ver = lay.chain_of(0)
    ino = client.stat(path).st_ino
    head = lay.servers[0][0]
    with client.open(path, "r+b") as f:
        cap = f.handle.cap
        f.pwrite(b"b" * 10, 0)

    async def call(msg: D.Write, payload: bytes) -> int:
        res = await client.aio.data.send(head, msg, payload=payload)
        return int(res.fields["n"])

    fwd = list(lay.servers[0][1:])
    # a newer version than the metaserver's is not believed (the head asks it)
    with pytest.raises(OSError) as ei:
        client._run(lambda: call(D.Write(obj=(ino, 0), off=0, cap=cap, chain=cid,
                                         ver=ver + 5, fwd=fwd), b"c"))
    assert ei.value.errno == D.CHAIN_STALE
    assert client._run(lambda: call(D.Write(obj=(ino, 0), off=0, cap=cap, chain=cid,
                                            ver=ver, fwd=fwd), b"c")) == 1
    with pytest.raises(OSError) as ei:  # and an older one is stale
        client._run(lambda: call(D.Write(obj=(ino, 0), off=0, cap=cap, chain=cid,
                                         ver=ver - 1, fwd=fwd), b"d"))
    assert ei.value.errno == D.CHAIN_STALE


@pytest.mark.parametrize("victim", ["tail", "head"])
def test_kill_9_of_a_replica_during_a_large_write(private_cluster: Path, victim: str) -> None:
    toml = cluster.up(private_cluster, data_servers=2)
    names = _sids(private_cluster)
    data = random.Random(5).randbytes(48 * UNIT)
    with pfs.connect(config=toml) as c:
        c.mkdir("/r")
        c.set_layout("/r", count=1, unit=UNIT, replicas=2)
        c.write_file("/r/f", b"")
        before = Layout.from_wire(c.get_layout("/r/f"))
        cid, ver = before.chain_of(0)
        gone = before.servers[0][1 if victim == "tail" else 0]
        written, killed = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                with c.open("/r/f", "r+b") as f:
                    for off in range(0, len(data), UNIT):
                        f.pwrite(data[off:off + UNIT], off)
                        if off == 8 * UNIT:  # the rest goes after the kill
                            written.set()
                            killed.wait(60)
            except BaseException as exc:  # the test's assertion below reports it
                errors.append(exc)
                written.set()

        t = threading.Thread(target=write)
        t.start()
        assert written.wait(60)
        _kill(private_cluster, names[gone])
        killed.set()
        t.join(120)
        assert not t.is_alive() and errors == []
        assert c.read_file("/r/f") == data  # every byte, from the member left
        after = Layout.from_wire(c.get_layout("/r/f"))
        assert after.chain_of(0)[0] == cid and after.chain_of(0)[1] > ver
        assert gone not in after.servers[0] and len(after.servers[0]) == 1


def test_a_stale_replica_restarted_never_serves_old_bytes_and_is_caught_up(
        private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=2)
    names = _sids(private_cluster)
    with pfs.connect(config=toml) as c:
        c.mkdir("/r")
        c.set_layout("/r", count=1, unit=UNIT, replicas=2)
        c.write_file("/r/f", b"old" * 1000)
        old = Layout.from_wire(c.get_layout("/r/f"))
        cid = old.chain_of(0)[0]
        for n in range(20):  # a second file on the same chain (placement reuses it)
            c.write_file(f"/r/g{n}", b"G" * 5000)
            if Layout.from_wire(c.get_layout(f"/r/g{n}")).chain_of(0)[0] == cid:
                other = f"/r/g{n}"
                break
        else:
            raise AssertionError("placement never reused the chain of /r/f")
        ino = c.stat("/r/f").st_ino
        tail = old.servers[0][1]
        _kill(private_cluster, names[tail])
        with c.open("/r/f", "r+b") as f:  # the head finds the tail gone: taken out
            f.pwrite(b"new" * 1000, 0)
        assert tail not in Layout.from_wire(c.get_layout("/r/f")).servers[0]
    cluster.up(private_cluster)  # the stale replica comes back, holding "old"
    with pfs.connect(config=toml) as c:
        async def read_from_tail(ver: int | None, cap: bytes) -> bytes:
            buf = bytearray(3000)
            await c.aio.data.send(tail, D.Read(obj=(ino, 0), off=0, len=3000, cap=cap,
                                               chain=cid if ver is not None else None,
                                               ver=ver), into=memoryview(buf))
            return bytes(buf)

        refused = 0
        deadline = time.monotonic() + 30
        while True:  # refused while stale; then caught up (copied from the head)
            ver = Layout.from_wire(c.get_layout("/r/f")).chain_of(0)[1]
            with c.open("/r/f", "rb") as f:  # a capability for the members now (the
                cap = f.handle.cap  # tail is placed again once it rejoined)
            try:
                got = c._run(lambda v=ver, k=cap: read_from_tail(v, k))
            except OSError as exc:
                # stale (EREMCHG) once it rejoined; before that it is no member at all,
                # and a capability for the file does not place the object there (EACCES)
                assert exc.errno in (D.CHAIN_STALE, errno.EACCES), exc
                refused += 1
                assert time.monotonic() < deadline, "never caught up"
                time.sleep(0.1)
                continue
            assert got == b"new" * 1000, "a stale replica served its old bytes"
            break
        assert refused, "the restarted replica was never refused (it was not stale?)"
        lay = Layout.from_wire(c.get_layout("/r/f"))
        assert lay.servers[0][-1] == tail and lay.chain_of(0)[1] > old.chain_of(0)[1]
        assert c.read_file("/r/f") == b"new" * 1000
        _identical(private_cluster, ino, 1, 2)
        _identical(private_cluster, c.stat(other).st_ino, 1, 2)
    assert errno.EREMCHG == D.CHAIN_STALE


def test_a_hung_replica_is_taken_out_after_the_forward_deadline(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=2, data_args=["--forward-timeout", "1"])
    names = _sids(private_cluster)
    data = random.Random(9).randbytes(4 * UNIT)
    with pfs.connect(config=toml) as c:
        c.mkdir("/r")
        c.set_layout("/r", count=1, unit=UNIT, replicas=2)
        c.write_file("/r/f", b"")
        before = Layout.from_wire(c.get_layout("/r/f"))
        tail = before.servers[0][1]
        pid = cluster.running(private_cluster)[names[tail]]
        os.kill(pid, signal.SIGSTOP)
        try:
            with c.open("/r/f", "r+b") as f:
                t0 = time.monotonic()
                f.pwrite(data, 0)  # the head waits 1 s for the tail, then goes on
                assert time.monotonic() - t0 < 10
                after = Layout.from_wire(c.get_layout("/r/f"))
                assert after.servers[0] == (before.servers[0][0],)
                assert after.chain_of(0)[1] > before.chain_of(0)[1]
                t0 = time.monotonic()
            # the write's reply said the chain changed: the close syncs the head alone
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(pid, signal.SIGCONT)
        assert c.read_file("/r/f") == data
        ino = c.stat("/r/f").st_ino
        deadline = time.monotonic() + 30
        while tail not in Layout.from_wire(c.get_layout("/r/f")).servers[0]:
            assert time.monotonic() < deadline, "the resumed replica was never caught up"
            time.sleep(0.2)
        while True:  # joining, then caught up: the copy
            try:
                _identical(private_cluster, ino, 1, 2)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "the replicas never became identical"
                time.sleep(0.2)


def test_replicas_go_to_distinct_failure_domains(private_cluster: Path) -> None:
    """Two servers on this host (its address is their domain) and two that say they are
    in rack "b": every chain has one of each."""
    toml = cluster.up(private_cluster, data_servers=2)
    spec = cluster.load_spec(private_cluster)
    assert spec is not None
    for i in (2, 3):
        ddir = private_cluster / "data" / f"ds{i}"
        ddir.mkdir(parents=True)
        cluster._start(private_cluster, f"data{i}", [
            "pfs.dataserver", "--key-file", str(private_cluster / "keys" / "cluster.key"),
            "--dir", str(ddir), "--port", "0", "--meta", f"127.0.0.1:{spec.meta_port}",
            "--domain", "b"])
    rack_b = {sid for sid, name in _sids(private_cluster).items()
              if name in ("data2", "data3")}
    with pfs.connect(config=toml) as c:
        deadline = time.monotonic() + 20
        c.mkdir("/r")
        c.set_layout("/r", count=2, unit=UNIT, replicas=2)
        while True:  # until all four registered
            c.write_file("/r/probe", b"")
            lay = Layout.from_wire(c.get_layout("/r/probe"))
            if len({s for m in lay.servers for s in m}) == 4 or time.monotonic() > deadline:
                break
            c.remove("/r/probe")
            time.sleep(0.2)
        for n in range(12):
            c.write_file(f"/r/f{n}", b"x")
            for members in Layout.from_wire(c.get_layout(f"/r/f{n}")).servers:
                assert len(members) == 2
                assert len(set(members) & rack_b) == 1, members
