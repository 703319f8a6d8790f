"""pfind's work sharing in ``pfs bench io500``'s find (pfs/bench/io500_find.py), on an
in-memory tree with the ranks stepped in lockstep: the deterministic rules of VI4IO/pfind
(the stack, the halves handed over, the chunks, the full queue, the token ring, glibc's
rand), so that a change to any of them fails here."""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing as mp
import threading
import time
from collections import deque
from typing import Any

import pytest

from pfs.bench.io500_find import (
    GlibcRand,
    Item,
    LocalNet,
    Net,
    SoloNet,
    StoreLister,
    Walker,
    pack_work,
    unpack_work,
)

SIZE = 3901


class MemStore:
    """A tree in memory: directory -> [(name, is_dir)], file -> size."""

    def __init__(self, dirs: dict[str, list[tuple[str, bool]]], sizes: dict[str, int]) -> None:
        self.dirs, self.sizes = dirs, sizes
        self.listed: list[str] = []
        self.by: dict[str, int] = {}  # directory -> the rank that listed it
        self.rank = 0

    def scan_with_hints(self, d: str) -> list[tuple[str, bool, Any]]:
        self.listed.append(d)
        self.by[d] = self.rank
        return [(n, isdir, None) for n, isdir in self.dirs[d]]

    def scan_stat(self, d: str, name: str, hint: Any) -> tuple[int, int, bool]:
        return self.sizes.get(f"{d}/{name}", 0), 5_000_000_000, True


class World:
    """pfind's messages between ranks in one process."""

    def __init__(self, size: int) -> None:
        self.req = [[0] * size for _ in range(size)]
        self.tok: list[int | None] = [None] * size
        self.box: list[deque[list[Item]]] = [deque() for _ in range(size)]


class MemNet(Net):
    def __init__(self, world: World, rank: int) -> None:
        self.w, self.rank = world, rank

    def requests(self) -> list[int]:
        row = self.w.req[self.rank]
        out = [t for t, a in enumerate(row) if a]
        for t in out:
            row[t] = 0
        return out

    def respond(self, thief: int, items: list[Item]) -> None:
        self.w.box[thief].append(list(items))

    def ask(self, victim: int) -> None:
        self.w.req[victim][self.rank] = 1

    def answer(self) -> list[Item] | None:
        box = self.w.box[self.rank]
        return box.popleft() if box else None

    def token(self) -> int | None:
        t, self.w.tok[self.rank] = self.w.tok[self.rank], None
        return t

    def pass_token(self, right: int, phase: int) -> None:
        assert self.w.tok[right] is None  # one token in the ring
        self.w.tok[right] = phase


def walk(store: MemStore, size: int, root: str = "/r", **kw: Any) -> list[Walker]:
    """Every rank's walk, one turn each in rank order, until all have ended."""
    world = World(size)
    lister = StoreLister(store, SIZE, 5, "01")
    ws = [Walker(r, size, lister, MemNet(world, r), **kw) for r in range(size)]
    for w in ws:
        w.start(root)
    ended = [False] * size
    for _ in range(1_000_000):
        for r, w in enumerate(ws):
            if not ended[r]:
                store.rank = r
                ended[r] = w.step()
        if all(ended):
            return ws
    raise AssertionError("the walk did not end")


def io500_tree(easy: int, hard: int) -> MemStore:
    """The data directory as io500 leaves it for find (2 ranks)."""
    dirs: dict[str, list[tuple[str, bool]]] = {
        "/r": [
            ("ior-easy", True),
            ("ior-hard", True),
            ("mdtest-easy", True),
            ("mdtest-hard", True),
        ],
        "/r/ior-easy": [("ior_file_easy.00000000", False), ("ior_file_easy.00000001", False)],
        "/r/ior-hard": [("file", False)],
        "/r/mdtest-easy": [("test-dir.0-0", True)],
        "/r/mdtest-easy/test-dir.0-0": [("mdtest_tree.0.0", True), ("mdtest_tree.1.0", True)],
        "/r/mdtest-hard": [("test-dir.0-0", True)],
        "/r/mdtest-hard/test-dir.0-0": [("mdtest_tree.0", True)],
    }
    sizes = {}
    for t in (0, 1):
        owner = (t + 1) % 2  # mdtest -u: rank r's files in the next rank's tree
        dirs[f"/r/mdtest-easy/test-dir.0-0/mdtest_tree.{t}.0"] = [
            (f"file.mdtest.{owner}.{i}", False) for i in range(easy)
        ]
    hard_dir = "/r/mdtest-hard/test-dir.0-0/mdtest_tree.0"
    dirs[hard_dir] = [(f"file.mdtest.{r}.{i}", False) for i in range(hard) for r in (0, 1)]
    for n, _ in dirs[hard_dir]:
        sizes[f"{hard_dir}/{n}"] = SIZE
    return MemStore(dirs, sizes)


def expected(store: MemStore) -> tuple[int, int]:
    files = sum(1 for v in store.dirs.values() for _, isdir in v if not isdir)
    found = sum(1 for p in store.sizes if "01" in p.rsplit("/", 1)[1])
    return files, found


def test_glibc_rand_is_libcs() -> None:
    assert [GlibcRand(1)() for _ in range(1)] == [1804289383]
    r = GlibcRand(1)
    assert [r() for _ in range(3)] == [1804289383, 846930886, 1681692777]
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    for seed in (1, 7, 12345):
        libc.srand(seed)
        mine = GlibcRand(seed)
        assert [mine() for _ in range(500)] == [libc.rand() for _ in range(500)]


def test_give_hands_over_the_top_half_and_refills_from_the_excess_list() -> None:
    w = Walker(0, 2, StoreLister(MemStore({}, {}), SIZE, 0, "01"), SoloNet())
    w.work = [("d", f"/q{i}", f"hint{i}") for i in range(5)]
    w.excess = ["/x0", "/x1", "/x2"]
    got = w.give()
    # pfind: pending_work -= pending_work / 2, then sends work[pending_work ..]; hints stay
    assert got == [("d", "/q3", None), ("d", "/q4", None)]
    # then moves as many excess directories into the queue, the last first
    assert w.work[3:] == [("d", "/x2", None), ("d", "/x1", None)] and w.excess == ["/x0"]
    assert [i[1] for i in w.work[:3]] == ["/q0", "/q1", "/q2"]
    w.work = [("f", "/one", None)]
    assert w.give() == [] and w.work == [("f", "/one", None)]  # 1 // 2: nothing


def test_chunks_of_max_entries_plus_one() -> None:
    names = [(f"e{i}", False) for i in range(2500)]
    store = MemStore({"/big": names, "/other": []}, {})
    w = Walker(0, 1, StoreLister(store, SIZE, 0, "01"), SoloNet())
    w.work = [("d", "/other", None), ("d", "/big", None)]
    seen = []
    for _ in range(3):
        w.process_one_item()
        queued = sum(1 for k, _, _ in w.work if k == "f")
        seen.append((w.files + queued, w.current is not None))
    # 1,001 entries a turn (pfind stops when processed > max_entries_per_iter), and the
    # directory is read to its end before /other, below on the stack, is taken
    assert seen == [(1001, True), (2002, True), (2500, False)]
    assert store.listed == ["/big"] and w.work[0] == ("d", "/other", None)
    w.process_one_item()  # the top: the last queued lstat job
    assert store.listed == ["/big"]


def test_a_full_queue_sends_directories_to_the_excess_list_and_lstats_files_now() -> None:
    names = [("d0", True), ("d1", True), ("d2", True), ("x01", False), ("d3", True)]
    dirs: dict[str, list[tuple[str, bool]]] = {"/r": names}
    for n in ("d0", "d1", "d2", "d3"):
        dirs[f"/r/{n}"] = []
    w = Walker(
        0,
        1,
        StoreLister(MemStore(dirs, {"/r/x01": SIZE}), SIZE, 0, "01"),
        SoloNet(),
        queue_length=2,
    )
    w.work = [("d", "/r", None)]
    w.process_one_item()
    assert [p for _, p, _ in w.work] == ["/r/d0", "/r/d1"] and w.excess == ["/r/d2"]
    assert w.current is not None
    w.process_one_item()  # still no room: x01 is lstat'ed at once
    assert w.files == 1 and w.found == 1 and w.mon.lstats == 1
    w.process_one_item()
    assert w.excess == ["/r/d2", "/r/d3"]
    w.process_one_item()  # the end of /r
    assert w.current is None
    w.process_one_item()  # the excess list before the stack, its last first
    assert w.excess == ["/r/d2"] and w.mon.dirs == 2


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_file_once_every_directory_once_and_every_rank_ends(size: int) -> None:
    store = io500_tree(1500, 700)
    ws = walk(store, size)
    files, found = expected(store)
    assert sum(w.files for w in ws) == files and sum(w.found for w in ws) == found
    assert sorted(store.listed) == sorted(store.dirs)
    assert all(w.completed() for w in ws)


def test_the_token_ring_of_two_idle_ranks() -> None:
    """pfind's ending on 2 ranks (as its find.csv shows): rank 0 passes the token 4
    times, rank 1 3 times; rank 0 counts the rounds without work up to 3."""
    ws = walk(MemStore({"/r": [("a", False)]}, {}), 2)
    assert [w.mon.tokens_send for w in ws] == [4, 3]
    assert [w.files for w in ws] == [1, 0]


def test_pfinds_distribution_of_the_io500_tree() -> None:
    """On 2 ranks the bottom of a stack stays with its rank: the rank that reads
    test-dir.0-0 reads both mdtest-easy trees, and the other gets only lstat jobs from
    them (the top halves it asks for). Lockstep turns make the counts exact."""
    store = io500_tree(1500, 700)
    ws = walk(store, 2)
    easy = "/r/mdtest-easy/test-dir.0-0"
    assert store.by[f"{easy}/mdtest_tree.0.0"] == store.by[f"{easy}/mdtest_tree.1.0"]
    # one turn costs the same whatever it does here (a chunk of 1,001 entries as one
    # lstat), so rank 1 reads every big directory and rank 0 lstats what it is handed
    assert (
        store.by[f"{easy}/mdtest_tree.0.0"]
        == store.by["/r/mdtest-hard/test-dir.0-0/mdtest_tree.0"]
        == 1
    )
    assert [(w.files, w.found, w.mon.dirs, w.mon.lstats) for w in ws] == [
        (33, 6, 5, 31),
        (4370, 6, 5, 30),
    ]
    # (requests sent, items received, requests answered, items given)
    assert [
        (w.mon.steal_tries, w.mon.work_stolen, w.mon.steal_inbound, w.mon.work_send) for w in ws
    ] == [(6, 30, 2, 2), (2, 2, 6, 30)]


def test_an_answer_travels_as_pfinds_work_items() -> None:
    items: list[Item] = [("d", "/r/mdtest-easy", None), ("f", "/r/x/file.mdtest.0.101", None)]
    data = pack_work(items)
    assert len(data) == 2 * 4120  # sizeof(work_t): char name[PATH_MAX], 2 x uint64, char
    assert unpack_work(data) == items
    assert pack_work([]) == b"" and unpack_work(b"") == []


def test_a_giver_waits_until_the_asker_took_work_but_not_an_empty_answer() -> None:
    """Open MPI's shared memory sends anything over 4 KiB by rendezvous: pfind's MPI_Send
    of one or more work items returns only once the asker has received them."""
    net = LocalNet.make(mp.get_context("spawn"), 2)
    try:
        giver, thief = net.at(0), net.at(1)
        sent = threading.Event()

        def give() -> None:
            giver.respond(1, [("f", "/r/a01", None)])
            sent.set()

        t = threading.Thread(target=give)
        t.start()
        assert not sent.wait(0.3)  # still in its MPI_Send
        assert thief.answer() == [("f", "/r/a01", None)]
        assert sent.wait(10)
        t.join()
        giver.respond(1, [])  # an empty answer is eager: back at once
        assert thief.answer() == []
    finally:
        net.close()


def test_an_answer_over_a_mailbox_arrives_whole_in_fragments_and_in_order() -> None:
    """An answer of more items than a mailbox holds goes in fragments, each taken
    before the next is posted; the giver returns once the last is taken."""
    net = LocalNet.make(mp.get_context("spawn"), 2)
    giver, thief = net.at(0), net.at(1)
    n = 2 * LocalNet.SLOT_ITEMS + 7
    items: list[Item] = [("f" if i % 3 else "d", f"/r/t/file.mdtest.1.{i}", None) for i in range(n)]
    t = threading.Thread(target=giver.respond, args=(1, items))
    t.start()
    got = None
    while got is None:
        got = thief.answer()
    t.join(10)
    assert not t.is_alive() and got == items
    assert thief.answer() is None  # nothing left behind


def test_a_walk_over_the_local_net_reads_every_directory_once() -> None:
    """Two ranks (threads here) walking the io500 tree over LocalNet: work is handed
    over both ways, every directory is read exactly once and the counts are pfind's."""
    store = io500_tree(1500, 700)
    listed: list[str] = []

    class Counting(StoreLister):
        def open(self, d: str) -> Any:
            listed.append(d)
            time.sleep(0.002)  # lets the other thread run, ask, and be handed work
            return super().open(d)

    net = LocalNet.make(mp.get_context("spawn"), 2)
    ws = [Walker(r, 2, Counting(store, SIZE, 5, "01"), net.at(r)) for r in range(2)]
    errors: list[BaseException] = []

    def run(w: Walker) -> None:
        try:
            w.run("/r")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            net.stop()

    threads = [threading.Thread(target=run, args=(w,)) for w in ws]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    files, found = expected(store)
    assert sum(w.files for w in ws) == files and sum(w.found for w in ws) == found
    assert sorted(listed) == sorted(store.dirs)
    assert sum(w.mon.work_stolen for w in ws) == sum(w.mon.work_send for w in ws) > 0
