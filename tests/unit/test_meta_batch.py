"""Batched metadata calls (metaserver/batch.py) against every store engine: each path
succeeds or fails alone, in one transaction."""
from __future__ import annotations

import errno
import os
import random
import stat
from collections.abc import Iterator
from typing import Any

import pytest

from pfs.core.config import LayoutDefaults
from pfs.metaserver import batch
from pfs.metaserver import keys as K
from pfs.metaserver.namespace import ROOT, Cred, Namespace
from pfs.metaserver.store import LmdbStore, MemoryStore

USER = Cred(1000, 1000, (1000,))


@pytest.fixture(params=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    s = (MemoryStore() if request.param == "memory"
         else LmdbStore(tmp_path / "db", 1 << 26, check_format=False))
    yield s
    s.close()


@pytest.fixture
def ns(store: Any) -> Namespace:
    n = Namespace(LayoutDefaults(unit=65536, count=2, replicas=1),
                  servers=lambda: {"s1": 100, "s2": 200}, rng=random.Random(7))
    with store.write() as txn:
        n.format(txn)
        n.mkdir(txn, ROOT, K.ROOT_INO, b"d", 0o777)
    return n


def test_create_many_each_path_alone(store: Any, ns: Namespace) -> None:
    with store.write() as txn:
        ns.create(txn, USER, ns.lookup(txn, ROOT, K.ROOT_INO, b"d")["ino"], b"b",
                  stat.S_IFREG | 0o600, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    paths = [b"/d/a", b"/d/b", b"/nodir/c", b"/d/" + b"x" * 300, b"/d/c"]
    with store.write() as txn:
        got = batch.create_many(ns, txn, USER, paths, 0o640, exclusive=True)
    codes = [r[0] for r in got]
    assert codes == [0, errno.EEXIST, errno.ENOENT, errno.ENAMETOOLONG, 0]
    assert "/d/b" in got[1][1] and "/nodir/c" in got[2][1]  # the message names the path
    with store.read() as txn:
        names = [e[0] for e in ns.readdir(txn, ROOT, ns.lookup(txn, ROOT, K.ROOT_INO,
                                                                 b"d")["ino"])[0]]
        a = ns.resolve(txn, ROOT, b"/d/a", True)["attr"]
    assert sorted(names) == [b"a", b"b", b"c"]
    assert stat.S_ISREG(a["mode"]) and a["mode"] & 0o7777 == 0o640 and a["uid"] == 1000
    assert got[0][1]["ino"] == a["ino"]
    # not exclusive: an existing file is left as it is, its attributes returned
    with store.write() as txn:
        again = batch.create_many(ns, txn, USER, [b"/d/a"], 0o600, exclusive=False)
    assert again == [[0, a]]


def test_a_failed_path_leaves_no_records(store: Any, ns: Namespace) -> None:
    with store.read() as txn:
        before = ns.statfs(txn, 0, 0)["ffree"]
    with store.write() as txn:
        got = batch.create_many(ns, txn, Cred(2000, 2000), [b"/d/ok", b"/d/ok"], 0o600,
                                exclusive=True)
    assert [r[0] for r in got] == [0, errno.EEXIST]
    with store.read() as txn:
        assert ns.statfs(txn, 0, 0)["ffree"] == before - 1


def test_stat_many_and_unlink_many(store: Any, ns: Namespace) -> None:
    with store.write() as txn:
        batch.create_many(ns, txn, USER, [b"/d/a", b"/d/b"], 0o644, exclusive=True)
    with store.read() as txn:
        got = batch.stat_many(ns, txn, USER, [b"/d/a", b"/d/zz", b"/d/b", b"/d/a/x"], True)
    assert [r[0] for r in got] == [0, errno.ENOENT, 0, errno.ENOTDIR]
    assert got[0][1]["ino"] != got[2][1]["ino"]
    with store.write() as txn:
        gone = batch.unlink_many(ns, txn, USER, [b"/d/a", b"/d/a", b"/d", b"/d/b"])
    assert [r[0] for r in gone] == [0, errno.ENOENT, errno.EISDIR, 0]
    assert gone[0] == [0, None]
    with store.read() as txn:
        assert ns.readdir(txn, ROOT, ns.lookup(txn, ROOT, K.ROOT_INO, b"d")["ino"])[0] == []


def test_permissions_are_checked_per_path(store: Any, ns: Namespace) -> None:
    with store.write() as txn:
        ns.mkdir(txn, ROOT, K.ROOT_INO, b"closed", 0o755)
        got = batch.create_many(ns, txn, USER, [b"/closed/a", b"/d/a"], 0o644, True)
    assert [r[0] for r in got] == [errno.EACCES, 0]
