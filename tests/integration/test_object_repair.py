"""Object repair against real server processes at 2 replicas: the scrubber replaces a
replica with a flipped byte from the good one, ``pfs fsck --repair`` restores a
deleted and a cut replica (and a second fsck is clean), and a data server with two data
directories that loses one keeps serving the right bytes while the lost objects are
copied back from its chain peer."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import pfs
from pfs.core.messages import data as D
from pfs.core.messages import meta as M
from pfs.dataserver.objects import _mix
from pfs.tools import cluster

UNIT = 1 << 16
STRIPES = 2  # (over 2 data servers)
SIZE = 4 * STRIPES * UNIT


def _wait(what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _replicas(d: Path, ino: int, stripe: int) -> list[Path]:
    return sorted((d / "data").glob(f"*/objects/*/{ino}.{stripe}")) + sorted(
        (d / "extra").glob(f"*/objects/*/{ino}.{stripe}"))


def _identical(d: Path, ino: int, stripe: int) -> bool:
    files = _replicas(d, ino, stripe)
    return len(files) == 2 and files[0].read_bytes() == files[1].read_bytes()


def _fsck(toml: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "fsck", "--config", str(toml),
                        "--json", *extra], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1, 2), r.stderr
    return r.returncode, json.loads(r.stdout)


def _file(c: Any, path: str) -> tuple[int, bytes]:
    if not c.exists(os.path.dirname(path)):
        c.makedirs(os.path.dirname(path))
    c.set_layout(os.path.dirname(path), count=STRIPES, unit=UNIT, replicas=2)
    data = os.urandom(SIZE)
    c.write_file(path, data)
    return c.stat(path).st_ino, data


@pytest.fixture
def scrubbed(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    d = tmp_path / "cluster"
    try:
        toml = cluster.up(d, data_servers=2, data_args=["--scrub-rate", str(64 << 20)])
        yield d, toml
    finally:
        cluster.down(d)


def test_the_scrubber_repairs_a_flipped_byte_from_the_good_replica(
        scrubbed: tuple[Path, Path]) -> None:
    d, toml = scrubbed
    with pfs.connect(config=toml) as c:
        ino, data = _file(c, "/s/f")
        bad = _replicas(d, ino, 1)[0]
        with open(bad, "r+b") as f:
            f.seek(1000)
            b = f.read(1)
            f.seek(1000)
            f.write(bytes([b[0] ^ 0xFF]))
        assert not _identical(d, ino, 1)
        _wait("the scrubber's repair", lambda: _identical(d, ino, 1))
        assert c.read_file("/s/f") == data

        counts = []  # the repair shows in the data servers' statfs
        for sid in c._run(lambda: c.aio.meta.servers()):
            st = c._run(lambda s=sid: c.aio.data.send(s, D.Statfs()))
            counts.append(int(st.fields.get("repaired", 0)))
        assert sum(counts) >= 1


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    d = tmp_path / "cluster"
    try:
        # the scrubber off: it would repair what fsck is to find
        toml = cluster.up(d, data_servers=2, data_args=["--scrub-rate", "0"])
        yield d, toml
    finally:
        cluster.down(d)


def test_fsck_repair_restores_a_deleted_and_a_cut_replica(plain: tuple[Path, Path]) -> None:
    d, toml = plain
    with pfs.connect(config=toml) as c:
        ino, data = _file(c, "/r/f")
        # one replica of stripe 0 deleted whole, one of stripe 1 cut short
        gone = _replicas(d, ino, 0)[0]
        gone.unlink()
        (gone.parent / (gone.name + ".crc")).unlink(missing_ok=True)
        cut = _replicas(d, ino, 1)[1]
        with open(cut, "r+b") as f:
            f.truncate(UNIT)
        code, report = _fsck(toml)
        assert code == 1
        found = {(p["kind"], p["stripe"]) for p in report["problems"]}
        assert ("short", 1) in found and any(s == 0 for _k, s in found), report
        # read-only without --repair: nothing changed
        assert len(_replicas(d, ino, 0)) == 1
        code, report = _fsck(toml, "--repair")
        assert code == 0, report
        assert len(report["repaired"]) >= 2, report
        for stripe in (0, 1):
            assert _identical(d, ino, stripe), stripe
        code, report = _fsck(toml)
        assert code == 0, report
        assert c.read_file("/r/f") == data


def test_fsck_removes_orphans_only_when_told(plain: tuple[Path, Path]) -> None:
    d, toml = plain
    with pfs.connect(config=toml) as c:
        ino, _data = _file(c, "/o/f")
    src = _replicas(d, ino, 0)[0]
    # where the server keeps object (ino + 1000, 0): its fanout is a hash of the id
    fan = f"{(_mix(ino + 1000, 0) >> 32) & 0xFF:02x}"
    stray = src.parent.parent / fan / f"{ino + 1000}.0"
    stray.parent.mkdir(exist_ok=True)
    shutil.copy(src, stray)
    code, report = _fsck(toml, "--repair")
    assert code == 1 and stray.exists()
    assert {p["kind"] for p in report["problems"]} == {"orphan"}
    code, report = _fsck(toml, "--repair", "--remove-orphans")
    assert code == 0, report
    assert not stray.exists()


def test_an_unreplicated_object_is_reported_not_repaired(plain: tuple[Path, Path]) -> None:
    d, toml = plain
    with pfs.connect(config=toml) as c:
        c.mkdir("/u")
        c.set_layout("/u", count=1, unit=UNIT, replicas=1)
        c.write_file("/u/f", os.urandom(4 * UNIT))
        ino = c.stat("/u/f").st_ino
    with open(_replicas(d, ino, 0)[0], "r+b") as f:
        f.truncate(UNIT)
    code, report = _fsck(toml, "--repair")
    assert code == 1
    assert report["not_repaired"] and "cannot be repaired" in report["not_repaired"][0]


# -- a lost drive --------------------------------------------------------------------
def _start_two_dirs(d: Path, dirs: list[Path]) -> None:
    spec = cluster.load_spec(d)
    assert spec is not None
    cluster._start(d, "data1", [
        "pfs.dataserver", "--key-file", str(d / "keys" / "cluster.key"),
        "--dir", str(dirs[0]), "--dir", str(dirs[1]), "--host", spec.host,
        "--port", "0", "--meta", f"{spec.host}:{spec.meta_port}", "--heartbeat", "0.5"])


def _restart_empty(d: Path, dirs: list[Path]) -> None:
    """Stop the server of two directories, empty the first, start it again."""
    pid = cluster.running(d)["data1"]
    os.kill(pid, signal.SIGTERM)
    _wait("data1 to stop", lambda: "data1" not in cluster.running(d))
    shutil.rmtree(dirs[0])
    dirs[0].mkdir()
    _start_two_dirs(d, dirs)


@pytest.fixture
def two_dirs(tmp_path: Path) -> Iterator[tuple[Path, Path, list[Path]]]:
    """One ordinary data server and one with two data directories."""
    d = tmp_path / "cluster"
    try:
        toml = cluster.up(d, data_servers=1)
        dirs = [d / "extra" / "a", d / "extra" / "b"]
        for x in dirs:
            x.mkdir(parents=True)
        _start_two_dirs(d, dirs)
        with pfs.connect(config=toml) as c:
            _wait("two data servers", lambda: sum(
                1 for s in c._run(lambda: c.aio.meta.servers()).values()
                if s.get("alive")) == 2)
        yield d, toml, dirs
    finally:
        cluster.down(d)


@pytest.mark.parametrize("how", ["removed while running", "empty at a restart"])
def test_a_lost_data_directory_keeps_serving_and_is_restored(
        two_dirs: tuple[Path, Path, list[Path]], how: str) -> None:
    d, toml, dirs = two_dirs
    with pfs.connect(config=toml) as c:
        files = {}
        for i in range(4):
            ino, data = _file(c, f"/l/f{i}")
            files[f"/l/f{i}"] = (ino, data)
        lost = [p for x in dirs[:1] for p in x.glob("objects/*/*") if "." in p.name]
        assert lost, "nothing was placed on the first directory"
    errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        with pfs.connect(config=toml) as rc:
            while not stop.is_set():
                for path, (_ino, data) in files.items():
                    try:
                        if rc.read_file(path) != data:
                            errors.append(f"{path}: wrong bytes")
                    except OSError as exc:
                        errors.append(f"{path}: {exc}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        time.sleep(0.5)
        if how == "removed while running":
            shutil.rmtree(dirs[0])
        else:
            _restart_empty(d, dirs)
        _wait("the lost objects restored", lambda: all(
            all(_identical(d, ino, s) for s in range(STRIPES)) for ino, _ in files.values()),
            timeout=90)
        sid = (dirs[1] / "server.id").read_text().strip()
        with pfs.connect(config=toml) as c:
            _wait("the directory serving again", lambda: not c._run(
                lambda: c.aio.data.send(sid, D.Statfs())).fields.get("lost_dirs"))
        time.sleep(1.0)
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert (dirs[0] / "FORMAT").exists()
    with pfs.connect(config=toml) as c:
        for path, (_ino, data) in files.items():
            assert c.read_file(path) == data


def test_repairs_during_overlapping_writes_lose_no_write(plain: tuple[Path, Path]) -> None:
    """Each replica (head and tail in turn) repaired again and again while writers
    overlap: the replicas end byte-identical, holding what the writers last wrote."""
    d, toml = plain
    with pfs.connect(config=toml) as c:
        ino, _data = _file(c, "/w/f")
        lay = c.get_layout("/w/f")
        members = lay["servers"][0]
        cap = c._run(lambda: c.aio.meta.request(M.ScanCap(cred=(0, 0, ())))).cap
        stop = threading.Event()
        failures: list[BaseException] = []
        writes: list[int] = []

        def writer(i: int) -> None:
            rng = random.Random(i)
            try:
                with pfs.connect(config=toml) as wc, wc.open("/w/f", "r+b") as f:
                    while not stop.is_set():
                        off = rng.randrange(0, 4 * UNIT)  # both stripes
                        f.pwrite(bytes([i + 1]) * rng.choice([10, 5000, 70_000]), off)
                        writes.append(i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            end, k, tries = time.monotonic() + 3.0, 0, 0
            while time.monotonic() < end or k < 8:
                sid = members[k % 2]
                tries += 1
                assert tries < 1000, "repairs kept being refused"
                try:
                    c._run(lambda s=sid: c.aio.data.send(s, D.RepairObject(obj=(ino, 0),
                                                                           cap=cap)))
                except BlockingIOError:  # EAGAIN: the other copy is behind this one
                    continue  # (a write on its way down the chain): refused, try again
                k += 1
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert failures == [] and len(writes) > 20
        assert _identical(d, ino, 0)
        assert _identical(d, ino, 1)
