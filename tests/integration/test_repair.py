"""Repair against real servers on loopback: a server lost for good (killed, its data
directory removed) has its chains' replica count restored with identical bytes; a
metaserver killed with kill -9 midway resumes the repair; a drain moves every chain
membership off a server with reads verified meanwhile; a rebalance gives a new server
chains. Waits are polls with generous deadlines."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pfs
from pfs.core.layout import Layout
from pfs.core.messages import meta as M
from pfs.tools import cluster
from pfs.tools.admin_repair import call_plan
from tests.integration.test_replication import _kill, _sids

UNIT = 1 << 20
DEADLINE = 120.0


def _pfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args], capture_output=True,
                          text=True, timeout=120)


def _status(c: Any) -> dict[str, Any]:
    return c._drive(call_plan, M.RepairStatus())  # type: ignore[no-any-return]


def _until(what: str, cond: Callable[[], Any], deadline: float = DEADLINE) -> Any:
    end = time.monotonic() + deadline
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def _write_files(c: Any, n: int, size: int, seed: int) -> dict[str, bytes]:
    c.mkdir("/r")
    c.set_layout("/r", count=3, unit=UNIT, replicas=2)
    rng = random.Random(seed)
    files = {f"/r/f{i}": rng.randbytes(size + i * 1000) for i in range(n)}
    for path, data in files.items():
        c.write_file(path, data)
    return files


def _members(c: Any, path: str) -> list[list[str]]:
    return [list(m) for m in Layout.from_wire(c.get_layout(path)).servers]


def _settled(c: Any) -> bool:
    st = _status(c)
    return st["short"] == 0 and not st["joining"] and not st["copying"] and not st["stale"]


def _same_on_members(d: Path, c: Any, files: dict[str, bytes]) -> None:
    """Each stripe's chain has two members now, and their object files are identical."""
    dirs = {sid: d / "data" / f"ds{name[4:]}" for sid, name in _sids(d).items()}
    for path in files:
        ino = c.stat(path).st_ino
        for stripe, members in enumerate(_members(c, path)):
            assert len(members) == 2, (path, members)
            got = [b"".join(p.read_bytes() for p in dirs[m].glob(f"objects/*/{ino}.{stripe}"))
                   for m in members]
            assert got[0] == got[1], f"{path} stripe {stripe}: replicas differ"
            assert got[0] or stripe * UNIT >= len(files[path]), f"{path}: no data"


def test_a_lost_server_has_its_replicas_restored(private_cluster: Path) -> None:
    d = private_cluster
    toml = cluster.up(d, data_servers=3, meta_settings={"lost_after": 3.0})
    names = _sids(d)
    with pfs.connect(config=toml) as c:
        files = _write_files(c, 6, 3 * UNIT, 1)
        victim = _members(c, "/r/f0")[0][1]
        _kill(d, names[victim])
        shutil.rmtree(d / "data" / f"ds{names[victim][4:]}")  # its disk is gone
        _until("the lost server's replicas restored", lambda: victim in _status(c)["lost"]
               and _settled(c))
        for path, data in files.items():
            assert c.read_file(path) == data
            assert all(victim not in m for m in _members(c, path))
        _same_on_members(d, c, files)
        assert _status(c)["memberships"].get(victim, 0) == 0


def test_a_metaserver_killed_during_repair_resumes_it(private_cluster: Path) -> None:
    d = private_cluster
    slow = {"repair_rate": 4 << 20}  # 4 MiB/s: the copy takes seconds
    toml = cluster.up(d, data_servers=3, meta_settings=slow)
    names = _sids(d)
    with pfs.connect(config=toml) as c:
        files = _write_files(c, 6, 4 * UNIT, 2)
        victim = _members(c, "/r/f0")[0][0]
        _kill(d, names[victim])
        c._drive(call_plan, M.Lost(sid=victim, cred=c.aio.meta.wire_cred(c.aio.cred)))
        _until("a copy in flight", lambda: _status(c)["copying"], 60)
    _kill(d, "meta")
    # restarted at full rate; the lost server comes back too, and is not put back
    cluster.up(d, meta_settings={})
    with pfs.connect(config=toml) as c:
        assert _status(c)["joining"], "the repair's state did not survive the restart"
        _until("the repair finished after the restart", lambda: _settled(c))
        for path, data in files.items():
            assert c.read_file(path) == data
            assert all(victim not in m for m in _members(c, path))
        _same_on_members(d, c, files)
        assert c._run(c.aio.meta.servers)[victim]["alive"]
        assert _status(c)["memberships"].get(victim, 0) == 0


def test_drain_moves_every_membership_off_a_server(private_cluster: Path) -> None:
    d = private_cluster
    toml = cluster.up(d, data_servers=4, meta_settings={"repair_rate": 16 << 20})
    with pfs.connect(config=toml) as c:
        files = _write_files(c, 8, 2 * UNIT, 3)
        target = _members(c, "/r/f0")[0][0]
        stop = threading.Event()
        errors: list[BaseException] = []
        reads = 0

        def reader() -> None:  # reads verified all through the move
            nonlocal reads
            try:
                with pfs.connect(config=toml) as rc:
                    while not stop.is_set():
                        for path, data in files.items():
                            assert rc.read_file(path) == data, f"{path}: a wrong byte"
                            reads += 1
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)

        t = threading.Thread(target=reader)
        t.start()
        try:
            out = _pfs("admin", "drain", target, "--config", str(toml))
            assert out.returncode == 0, out.stderr
            _until("the drained server empty",
                   lambda: _status(c)["draining"].get(target) == 0 and _settled(c))
            text = _pfs("admin", "repair", "status", "--config", str(toml)).stdout
            assert f"draining {target}: 0 chain memberships left (empty)" in text, text
        finally:
            stop.set()
            t.join(60)
        assert errors == [] and reads > 0
        for path, data in files.items():
            assert c.read_file(path) == data
            assert all(target not in m for m in _members(c, path))
        _same_on_members(d, c, files)


def test_rebalance_gives_a_new_server_chains(private_cluster: Path) -> None:
    d = private_cluster
    toml = cluster.up(d, data_servers=3)
    with pfs.connect(config=toml) as c:
        files = _write_files(c, 8, UNIT, 4)
    cluster.up(d, data_servers=4)
    new = next(sid for sid, name in _sids(d).items() if name == "data3")
    with pfs.connect(config=toml) as c:
        assert _status(c)["memberships"].get(new, 0) == 0
        out = _pfs("admin", "rebalance", "--config", str(toml))
        assert out.returncode == 0, out.stderr
        _until("the rebalance done", lambda: not _status(c)["rebalancing"]
               and _settled(c))
        st = _pfs("admin", "repair", "status", "--json", "--config", str(toml))
        assert st.returncode == 0, st.stderr
        load = json.loads(st.stdout)["memberships"]
        assert load.get(new, 0) > 0, load
        assert json.loads(st.stdout)["bytes_copied"] > 0
        assert max(load.values()) - min(load.values()) <= 1, load
        for path, data in files.items():
            assert c.read_file(path) == data
        _same_on_members(d, c, files)


def test_a_bad_block_on_the_head_is_not_copied(private_cluster: Path) -> None:
    d = private_cluster
    toml = cluster.up(d, data_servers=3)
    names = _sids(d)
    with pfs.connect(config=toml) as c:
        c.mkdir("/b")
        c.set_layout("/b", count=1, unit=UNIT, replicas=2)
        c.write_file("/b/f", b"g" * 300_000)
        ino = c.stat("/b/f").st_ino
        head, tail = _members(c, "/b/f")[0]
        obj = next((d / "data" / f"ds{names[head][4:]}").glob(f"objects/*/{ino}.0"))
        with obj.open("r+b") as f:  # rot on the head's disk
            f.seek(70_000)
            f.write(b"X")
        _kill(d, names[tail])
        c._drive(call_plan, M.Lost(sid=tail, cred=c.aio.meta.wire_cred(c.aio.cred)))
        log = d / "logs" / "meta.log"
        _until("the copy refused", lambda: "bad block" in log.read_text(), 60)
        (cid, (new,)), = _status(c)["stale"].items()  # joined, never caught up
        assert new not in (head, tail) and _members(c, "/b/f")[0][0] == head
        copies = list((d / "data" / f"ds{names[new][4:]}").glob(f"objects/*/{ino}.0"))
        assert all(b"X" not in p.read_bytes() for p in copies), "the bad block spread"
