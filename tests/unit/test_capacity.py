"""Honest capacity: each filesystem counted once, the reserve that makes a server full,
and placement that skips full servers (a fake registry, no processes)."""
from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from pfs.core.config import LayoutDefaults
from pfs.core.messages.records import Volume
from pfs.dataserver import capacity
from pfs.metaserver.namespace import Cred, Namespace
from pfs.metaserver.registry import Registry, Reserve, distinct
from pfs.metaserver.store import MemoryStore

pytestmark = pytest.mark.unit

GiB = 1 << 30
ROOT = Cred(0, 0, ())


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def vol(path: str, fs: str, total: int, free: int) -> Volume:
    return Volume(path, fs, total, free)


def test_a_filesystem_shared_by_servers_counts_once() -> None:
    reg = Registry(15.0, FakeClock())
    disk = [vol("/d", "hostA:2049", 100 * GiB, 40 * GiB)]
    for i in range(4):  # four servers, one disk (a local cluster)
        reg.register(f"s{i}", "h", 9000 + i, 100 * GiB, 40 * GiB, disk)
    assert reg.capacity() == (100 * GiB, 40 * GiB)
    # another host's disk with the same st_dev is another filesystem
    reg.register("b", "h2", 1, 50 * GiB, 10 * GiB, [vol("/d", "hostB:2049", 50 * GiB, 10 * GiB)])
    assert reg.capacity() == (150 * GiB, 50 * GiB)
    # an older server reports no directories: its space counts on its own, as does a
    # directory without a filesystem identity
    reg.register("old", "h3", 1, 7 * GiB, 3 * GiB)
    reg.register("anon", "h4", 1, 2 * GiB, 1 * GiB, [vol("/x", "", GiB, GiB // 2),
                                                      vol("/y", "", GiB, GiB // 2)])
    assert reg.capacity() == (159 * GiB, 54 * GiB)


def test_distinct_keeps_one_report_per_filesystem() -> None:
    a = [vol("/d1", "h:1", 10, 5), vol("/d2", "h:1", 10, 5), vol("/d3", "h:2", 20, 2)]
    assert distinct({"a": a, "b": [vol("/e", "h:2", 20, 2)]}) == (30, 7)
    assert distinct({}) == (0, 0)


def test_the_reserve_is_the_smaller_of_bytes_and_percent() -> None:
    r = Reserve(256 << 20, 1.0)
    assert r.of(8 << 20) == (8 << 20) // 100  # a small disk: 1%
    assert r.of(10 << 40) == 256 << 20  # a large one: 256 MiB
    assert r.full([vol("/a", "x", 10 << 40, 100 << 20)])
    assert not r.full([vol("/a", "x", 10 << 40, 300 << 20)])
    # a stripe may land in any directory of a server: one full directory makes it full
    assert r.full([vol("/a", "x", 10 << 40, 1 << 40), vol("/b", "y", 10 << 40, 0)])


def test_full_and_silent_servers_get_no_new_stripes() -> None:
    clock = FakeClock()
    reg = Registry(15.0, clock, Reserve(1 << 20, 1.0))
    for sid, free in (("a", 50 * GiB), ("b", 40 * GiB), ("c", 1 << 19)):
        reg.register(sid, "h", 1, 100 * GiB, free, [vol("/d", f"h:{sid}", 100 * GiB, free)])
    assert set(reg.free_space()) == {"a", "b"}
    stored = {sid: {"host": "h", "port": 1, "total": 0, "free": 0} for sid in "abc"}
    assert [sid for sid, s in reg.describe(stored).items() if s["full"]] == ["c"]
    # c's disk drained: its next heartbeat makes it placeable again
    assert reg.heartbeat("c", 100 * GiB, 9 * GiB, [vol("/d", "h:c", 100 * GiB, 9 * GiB)])
    assert set(reg.free_space()) == {"a", "b", "c"}
    clock.now += 16  # all silent: nothing to place on, and no space counted
    assert reg.free_space() == {} and reg.capacity() == (0, 0)


def _namespace(reg: Registry) -> tuple[Namespace, MemoryStore]:
    store = MemoryStore()
    ns = Namespace(LayoutDefaults(unit=65536, count=4, replicas=1), servers=reg.free_space,
                   opened=lambda ino: False, is_open=lambda ino: False,
                   deleting=lambda ino: False, rng=random.Random(3))
    with store.write() as txn:
        assert ns.format(txn)
    return ns, store


def test_placement_skips_full_servers_then_places_on_fewer_then_enospc() -> None:
    reg = Registry(15.0, FakeClock())
    for sid in "abcd":
        reg.register(sid, "h", 1, 100 * GiB, 50 * GiB,
                     [vol("/d", f"h:{sid}", 100 * GiB, 50 * GiB)])
    reg.heartbeat("d", 100 * GiB, 0, [vol("/d", "h:d", 100 * GiB, 0)])  # d is full
    ns, store = _namespace(reg)
    for i in range(20):
        with store.write() as txn:
            _, layout, _ = ns.create(txn, ROOT, 1, b"f%d" % i, 0o644, os.O_CREAT | os.O_WRONLY)
        # four stripes asked, three servers can take one: three stripes, none on d
        assert layout is not None and layout["count"] == 3
        assert sorted(s[0] for s in layout["servers"]) == ["a", "b", "c"]
    for sid in "abc":
        reg.heartbeat(sid, 100 * GiB, 1 << 20, [vol("/d", f"h:{sid}", 100 * GiB, 1 << 20)])
    with store.write() as txn, pytest.raises(OSError) as info:
        ns.create(txn, ROOT, 1, b"big.bin", 0o644, os.O_CREAT | os.O_WRONLY)
    assert info.value.errno == errno.ENOSPC
    assert "big.bin" in str(info.value) and "full" in str(info.value)


def test_a_data_server_names_the_filesystem_of_each_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    vols = capacity.volumes([str(tmp_path / "a"), str(tmp_path / "b")])
    assert vols[0].fs == vols[1].fs and vols[0].fs.startswith(capacity.host_id())
    st = os.statvfs(tmp_path)
    assert capacity.space(vols) == (st.f_blocks * st.f_frsize, vols[0].free)
    # the test knob: a disk that looks full
    full = capacity.volumes([str(tmp_path / "a")], free_override=0)
    assert full[0].free == 0 and full[0].total == vols[0].total


def test_registry_keeps_load_and_version_and_older_servers_omit_them() -> None:
    """What ``pfs admin status`` shows: the last heartbeat's load, the version from the
    registration (or a heartbeat, after a metaserver restart); an older server that
    reports neither has no such keys."""
    reg = Registry(15.0, FakeClock())
    reg.register("new", "h1", 1, 100, 50, version="0.2.0", protocol=[1, 2])
    reg.register("old", "h2", 1, 100, 50)
    stored = {"new": {"host": "h1", "port": 1}, "old": {"host": "h2", "port": 1}}
    d = reg.describe(stored)
    assert d["new"]["version"] == "0.2.0" and d["new"]["protocol"] == (1, 2)
    assert "load" not in d["new"] and "version" not in d["old"] and "load" not in d["old"]
    assert reg.heartbeat("new", 100, 40, load=[7, 4096, 0, 3])
    assert reg.heartbeat("old", 100, 40)
    d = reg.describe(stored)
    assert d["new"]["load"] == {"requests": 7, "bytes_in": 4096, "bytes_out": 0,
                                "connections": 3}
    assert d["new"]["version"] == "0.2.0"  # a heartbeat without one keeps it
    assert "load" not in d["old"]
    assert reg.heartbeat("new", 100, 40, load=[0, 0, 0, 1], version="0.3.0", protocol=[2, 2])
    assert reg.describe(stored)["new"]["version"] == "0.3.0"
