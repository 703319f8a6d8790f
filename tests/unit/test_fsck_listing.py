"""The two listings pfs fsck merges: the namespace's files and deletion queue in pages
(every store engine), and a data server's objects in id order, in pages."""
from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pfs.core.config import LayoutDefaults
from pfs.dataserver import checksums as dck
from pfs.dataserver.objects import ObjectStore
from pfs.metaserver.namespace import ROOT, Namespace
from pfs.metaserver.store import LmdbStore, MemoryStore

CREAT = os.O_CREAT | os.O_RDWR | os.O_EXCL


@pytest.fixture(params=["memory", "lmdb"])
def ns_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Namespace, Any]]:
    s = (MemoryStore() if request.param == "memory"
         else LmdbStore(str(tmp_path / "db"), 1 << 26, check_format=False))
    ns = Namespace(LayoutDefaults(unit=65536, count=2, replicas=1),
                   servers=lambda: {"s1": 100, "s2": 200}, opened=lambda ino: False,
                   is_open=lambda ino: False, deleting=lambda ino: False,
                   rng=random.Random(7))
    with s.write() as txn:
        ns.format(txn)
    yield ns, s
    s.close()


def test_scan_files_pages_through_regular_files_only(ns_store: tuple[Namespace, Any]) -> None:
    ns, store = ns_store
    with store.write() as txn:
        d = ns.mkdir(txn, ROOT, 1, b"d", 0o755)["ino"]
        files = [ns.create(txn, ROOT, d, b"f%d" % i, 0o644, CREAT)[0]["ino"] for i in range(5)]
        ns.symlink(txn, ROOT, d, b"l", b"f0")
    seen: list[int] = []
    after, end, pages = 0, False, 0
    while not end:
        with store.read() as txn:
            rows, after, end = ns.scan_files(txn, after, 2)
        pages += 1
        for ino, size, layout in rows:
            assert size == 0 and layout["servers"]
            seen.append(ino)
    assert seen == files and pages >= 4  # 8 inodes (root, d, 5 files, a link), 2 a page


def test_scan_deleting_lists_the_queue(ns_store: tuple[Namespace, Any]) -> None:
    ns, store = ns_store
    with store.write() as txn:
        inos = [ns.create(txn, ROOT, 1, b"f%d" % i, 0o644, CREAT)[0]["ino"] for i in range(3)]
        for i in range(3):
            ns.unlink(txn, ROOT, 1, b"f%d" % i)
    with store.read() as txn:
        first, start, end = ns.scan_deleting(txn, 0, 2)
        assert not end and [e[1] for e in first] == inos[:2]
        rest, _, end = ns.scan_deleting(txn, start, 2)
        assert end and [e[1] for e in rest] == inos[2:]
        assert all(e[2]["servers"] for e in first + rest)


def test_list_objects_in_id_order_a_page_at_a_time(tmp_path: Path) -> None:
    store = ObjectStore([str(tmp_path / "a"), str(tmp_path / "b")])
    try:
        ids = [(ino, stripe) for ino in (3, 12, 7, 100) for stripe in (1, 0)]
        for obj in ids:
            got = store.acquire_checked(obj, create=True)
            assert got is not None
            fd, cfd, release = got
            assert cfd is not None
            os.pwrite(fd, b"x", 8191)  # one byte at the end: a sparse object
            dck.update(fd, cfd, 8191, memoryview(b"x"))  # and its block map, as a write
            release()
        # names that are not objects are skipped (whatever else lives beside them)
        fan = next(p for p in (tmp_path / "a" / "objects").iterdir() if p.is_dir())
        (fan / "12.0.tmp").write_bytes(b"")
        (fan / "notes").write_bytes(b"")
        listed: list[tuple[int, int, int, int, int, int]] = []
        after: tuple[int, int] | None = None
        while True:
            page, end = store.list_objects(after, 3)
            listed += page
            if end:
                break
            after = page[-1][:2]
        assert [o[:2] for o in listed] == sorted(ids)
        assert all(o[2] == 8192 and o[3] < o[2] for o in listed)
        # the block map's summary: written up to the byte at 8191, no hole before it
        assert all(o[4:] == (8192, 0) for o in listed)
        # an object whose file is gone but whose block map remains is listed, size -1
        lost = store.path((7, 1))
        os.unlink(lost)
        page, _end = store.list_objects((7, 0), 1)
        assert page == [(7, 1, -1, 0, 8192, 0)]
    finally:
        store.close()
