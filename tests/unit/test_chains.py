"""The chain table and chain placement, on both store engines (no processes)."""
from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from pfs.core.config import LayoutDefaults
from pfs.core.layout import Layout
from pfs.metaserver.chains import ChainTable
from pfs.metaserver.namespace import ROOT, Namespace
from pfs.metaserver.store import LmdbStore, MemoryStore

CREAT = os.O_CREAT | os.O_RDWR


@pytest.fixture(params=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    s = (MemoryStore() if request.param == "memory"
         else LmdbStore(tmp_path / "db", 1 << 26, check_format=False))
    yield s
    s.close()


def _ns(store: Any, alive: dict[str, int], replicas: int = 2, count: int = 2) -> Namespace:
    ns = Namespace(LayoutDefaults(unit=65536, count=count, replicas=replicas),
                   servers=lambda: dict(alive), rng=random.Random(3))
    with store.write() as txn:
        ns.format(txn)
    return ns


def _create(ns: Namespace, store: Any, name: bytes) -> dict[str, Any]:
    with store.write() as txn:
        _, lay, _ = ns.create(txn, ROOT, 1, name, 0o644, CREAT)
    assert lay is not None
    return lay


def test_a_chain_is_made_once_and_reused(store: Any) -> None:
    table = ChainTable()
    with store.write() as txn:
        a = table.make_or_reuse(txn, ("s1", "s2"))
        b = table.make_or_reuse(txn, ("s1", "s2"))
        c = table.make_or_reuse(txn, ("s2", "s1"))  # another order: another chain
    assert a == b and a.version == 1 and a.members == ("s1", "s2")
    assert c.cid != a.cid
    with store.read() as txn:  # a fresh table (a restarted metaserver) finds it again
        assert ChainTable().get(txn, a.cid) == a
    with store.write() as txn:
        assert ChainTable().make_or_reuse(txn, ("s1", "s2")).cid == a.cid


def test_membership_changes_bump_one_chains_version(store: Any) -> None:
    table = ChainTable()
    with store.write() as txn:
        a = table.make_or_reuse(txn, ("s1", "s2", "s3"))
        other = table.make_or_reuse(txn, ("s2", "s4"))
        out = table.remove(txn, a.cid, "s2")
        assert out.version == a.version + 1 and out.members == ("s1", "s3")
        assert out.stale == ("s2",)
        assert table.remove(txn, a.cid, "s2") == out  # reported twice: one change
        assert [c.cid for c in table.stale_on(txn, "s2")] == [a.cid]
        back = table.add(txn, a.cid, "s2")  # caught up: back at the tail
        assert back.members == ("s1", "s3", "s2") and back.stale == ()
        assert back.version == out.version + 1
        moved = table.set_members(txn, a.cid, ("s3", "s4"))
        assert moved.stale == ("s1", "s2") and moved.version == back.version + 1
        assert table.get(txn, other.cid) == other  # untouched
        solo = table.make_or_reuse(txn, ("s9",))
        with pytest.raises(OSError) as e:
            table.remove(txn, solo.cid, "s9")
        assert e.value.errno == errno.EBUSY


def test_layouts_carry_chains_and_show_their_members_now(store: Any) -> None:
    ns = _ns(store, {"s1": 100, "s2": 100, "s3": 100})
    lay = _create(ns, store, b"f")
    layout = Layout.from_wire(lay)
    assert layout.replicas == 2 and len(layout.chains) == 2
    assert all(len(set(s)) == 2 for s in layout.servers)
    cid, ver = layout.chain_of(0)
    gone = layout.servers[0][1]
    with store.write() as txn:
        ns.chains.remove(txn, cid, gone)
    with store.read() as txn:
        now = Layout.from_wire(ns.get_layout(txn, 2) or {})
    assert now.chain_of(0) == (cid, ver + 1)
    assert now.servers[0] == (layout.servers[0][0],)


def test_a_layout_from_before_chains_is_an_implicit_chain(store: Any) -> None:
    old = {"unit": 65536, "count": 1, "replicas": 2, "servers": [["a", "b"]]}
    with store.read() as txn:
        assert ChainTable().resolve(txn, old) == old
    assert Layout.from_wire(old).chain_of(0) == (0, 0)


def test_replicas_go_to_distinct_failure_domains(store: Any) -> None:
    alive = {f"s{i}": 100 for i in range(6)}
    ns = _ns(store, alive, replicas=2, count=4)
    with store.write() as txn:  # three hosts, two servers each
        for i in range(6):
            ns.register_server(txn, f"s{i}", f"10.0.0.{i // 2}", 9000 + i, 1, 1)
    for n in range(20):
        lay = _create(ns, store, b"f%d" % n)
        for members in lay["servers"]:
            assert len({ns.domains[m] for m in members}) == 2, lay
    assert ns.placement_note == ""


def test_a_rack_label_is_the_domain_and_one_domain_still_gets_distinct_servers(
        store: Any) -> None:
    alive = {"s1": 100, "s2": 100, "s3": 100}
    ns = _ns(store, alive, replicas=2, count=1)
    with store.write() as txn:  # one host, but s3 says it is in another rack
        ns.register_server(txn, "s1", "h", 1, 1, 1, "rack-a")
        ns.register_server(txn, "s2", "h", 2, 1, 1, "rack-a")
        ns.register_server(txn, "s3", "h", 3, 1, 1, "rack-b")
    for n in range(10):
        lay = _create(ns, store, b"f%d" % n)
        assert "s3" in lay["servers"][0]
    alive.pop("s3")
    lay = _create(ns, store, b"one-rack")
    assert sorted(lay["servers"][0]) == ["s1", "s2"]  # distinct servers all the same
    assert "fewer failure domains" in ns.placement_note


def test_kept_placements_follow_domain_changes_and_large_clusters(store: Any) -> None:
    """Placement keeps its stripe assignments per server order: a server that moves
    to another rack is placed by its new domain at once, and a cluster too large to
    keep them is placed by the same rules."""
    alive = {"s1": 100, "s2": 100, "s3": 100, "s4": 100}
    ns = _ns(store, alive, replicas=2, count=2)
    with store.write() as txn:  # two racks
        for i, rack in ((1, "a"), (2, "a"), (3, "b"), (4, "b")):
            ns.register_server(txn, f"s{i}", "h", i, 1, 1, f"rack-{rack}")
    for n in range(40):  # every order seen: each is kept
        for members in _create(ns, store, b"f%d" % n)["servers"]:
            assert len({ns.domains[m] for m in members}) == 2
    with store.write() as txn:  # s2 moves to rack b, s3 to rack a
        ns.register_server(txn, "s2", "h", 2, 1, 1, "rack-b")
        ns.register_server(txn, "s3", "h", 3, 1, 1, "rack-a")
    for n in range(40):
        for members in _create(ns, store, b"g%d" % n)["servers"]:
            assert {ns.domains[m] for m in members} == {"rack-a", "rack-b"}, members
    big = {f"t{i:02d}": 100 for i in range(20)}
    ns = _ns(store, big, replicas=3, count=8)
    with store.write() as txn:
        for i in range(20):
            ns.register_server(txn, f"t{i:02d}", f"10.0.0.{i % 5}", i, 1, 1)
    with store.write() as txn:
        lay = ns.place(65536, 8, 3, txn=txn)
    assert len({m[0] for m in lay["servers"]}) == 8  # distinct heads
    for members in lay["servers"]:
        assert len({ns.domains[m] for m in members}) == 3


def test_default_replicas_is_two_capped_by_the_servers_up(store: Any) -> None:
    assert LayoutDefaults().replicas == 2
    ns = Namespace(servers=lambda: {"only": 1}, rng=random.Random(1))
    with store.write() as txn:
        ns.format(txn)
    lay = _create(ns, store, b"f")
    assert lay["replicas"] == 1 and lay["servers"] == [["only"]]
    ns.servers = lambda: {"a": 1, "b": 1}
    lay = _create(ns, store, b"g")
    assert lay["replicas"] == 2


def test_a_replacement_joins_then_the_member_it_replaces_leaves_for_good(store: Any
                                                                        ) -> None:
    table = ChainTable()
    with store.write() as txn:
        a = table.make_or_reuse(txn, ("s1", "s2"))
        assert a.want == 2 and a.short == 0
        j = table.replace_member(txn, a.cid, "s2", "s3")  # drain s2: s3 joins first
        assert j.members == ("s1", "s2", "s3") and table.joining(j) == ("s3",)
        assert j.leaving == ("s2",) and j.short == 0
        assert table.retire(txn, a.cid) == j  # s3 not caught up yet: s2 stays
        table.caught_up(txn, a.cid, "s3")
        done = table.retire(txn, a.cid)
        assert done.members == ("s1", "s3") and done.gone == ("s2",)
        assert done.stale == () and done.leaving == ()
        assert done.version == j.version + 1
        assert [c.cid for c in table.stale_on(txn, "s2")] == [a.cid]  # it serves none
    with store.read() as txn:  # all of it in the record (a restart resumes)
        assert ChainTable().get(txn, a.cid) == done
    with store.write() as txn:  # a replacement that failed: the leaving one stays in
        j = table.replace_member(txn, a.cid, "s3", "s4")
        failed = table.remove(txn, a.cid, "s4")
        assert table.joining(failed) == () and failed.leaving == ("s3",)
        assert table.retire(txn, a.cid) == failed
        assert failed.short == 0  # s4 is expected back (stale): nothing else joins


def test_a_lost_member_leaves_its_chain_short_and_is_never_caught_up(store: Any) -> None:
    table = ChainTable()
    with store.write() as txn:
        a = table.make_or_reuse(txn, ("s1", "s2", "s3"))
        out = table.remove(txn, a.cid, "s3")  # taken out: stale, expected back
        assert out.stale == ("s3",) and out.short == 0
        lost = table.lose(txn, a.cid, "s3")
        assert lost.stale == () and lost.gone == ("s3",) and lost.short == 1
        lost = table.lose(txn, a.cid, "s2")  # a member lost: out, a new version
        assert lost.members == ("s1",) and lost.short == 2
        assert lost.version == out.version + 1
        with pytest.raises(OSError) as e:  # its last member: the data is nowhere else
            table.lose(txn, a.cid, "s1")
        assert e.value.errno == errno.EBUSY
        grown = table.replace_member(txn, a.cid, None, "s4")
        assert grown.short == 1 and table.joining(grown) == ("s4",)
        # deletes go to the servers placed and those in it now, not to ones gone for
        # good since (a lost server may never answer: its objects are fsck's orphans)
        layout = {"chains": [a.cid], "servers": [["s1", "s2"]]}
        assert set(table.holders(txn, layout)["servers"][0]) == {"s1", "s2", "s4"}
