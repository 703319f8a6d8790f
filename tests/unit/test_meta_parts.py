"""The metaserver's parts on their own, without processes or sockets: security set-up,
the data-server registry, open handles and orphans, the commit queue, the deleter."""
from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from pfs.core import auth, caps
from pfs.core.config import ConfigError, LayoutDefaults, MetaConfig, NodeKey
from pfs.core.wire.rpc import ConnContext
from pfs.metaserver import commit
from pfs.metaserver import deleter as deleter_module
from pfs.metaserver import keys as K
from pfs.metaserver.commit import CommitQueue, dry_run
from pfs.metaserver.counters import INO_RANGE, Counters
from pfs.metaserver.counters import write as counter_write
from pfs.metaserver.deleter import Deleter
from pfs.metaserver.handles import MAX_CLOSES, OpenFiles
from pfs.metaserver.namespace import Cred, Namespace
from pfs.metaserver.registry import Registry
from pfs.metaserver.security import SERVER_METHODS, cap_signer, meta_security
from pfs.metaserver.server import MetaService
from pfs.metaserver.store import LmdbStore, MemoryStore, WriteTxn


def trio_test(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kw: Any) -> None:
        trio.run(functools.partial(fn, *args, **kw))
    return wrapper


# ---------------------------------------------------------------------- security
def test_security_from_keys(tmp_path: Path) -> None:
    cluster, node = tmp_path / "cluster.key", tmp_path / "node.key"
    auth.create_key(cluster)
    auth.create_key(node)
    sec = meta_security(MetaConfig(key_file=str(cluster),
                                   node_keys=[NodeKey("n1", str(node), [10, 20], [30, 40])]))
    assert sec.server.mode == "key" and sec.own.mode == "key"
    ident = sec.server.keys["n1"][1]
    assert (ident.role, ident.uids, ident.gids) == ("client", (10, 20), (30, 40))
    assert sec.server.keys[auth.CLUSTER][1].role == "server"
    assert sec.data_keys == {"n1": auth.data_plane_key(auth.read_secret_file(node))}


def test_security_refusals_and_open_mode(tmp_path: Path) -> None:
    node = tmp_path / "node.key"
    auth.create_key(node)
    with pytest.raises(ConfigError, match="need key_file"):
        meta_security(MetaConfig(node_keys=[NodeKey("n1", str(node))]))
    sec = meta_security(MetaConfig())
    assert sec.server.mode == "open" and sec.data_keys == {}
    assert "register" in SERVER_METHODS and "create" not in SERVER_METHODS


def test_cap_signer_key_survives_a_restart(tmp_path: Path) -> None:
    cfg = MetaConfig(db=str(tmp_path))
    first = cap_signer(cfg, persistent=True)
    assert cap_signer(cfg, persistent=True).public_bytes == first.public_bytes
    assert cap_signer(cfg, persistent=False).public_bytes != first.public_bytes


# ---------------------------------------------------------------------- registry
class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_registry_liveness_follows_heartbeats() -> None:
    clock = FakeClock()
    reg = Registry(15.0, clock)
    assert not reg.heartbeat("a", 100, 50)  # never registered: must register first
    reg.register("a", "h1", 1, 100, 50)
    reg.register("b", "h2", 2, 200, 150)
    assert reg.address("a") == ("h1", 1)
    assert reg.free_space() == {"a": 50, "b": 150}
    assert reg.capacity() == (300, 200)
    clock.now += 10
    assert reg.heartbeat("a", 100, 40)
    clock.now += 10  # b silent for 20 s: down
    assert reg.address("b") is None and reg.address("a") == ("h1", 1)
    assert reg.free_space() == {"a": 40}
    assert reg.capacity() == (100, 40)
    assert reg.address("nobody") is None
    reg.register("b", "h2b", 3, 200, 100)  # back, at a new address
    assert reg.address("b") == ("h2b", 3)


def test_registry_placeable_set_follows_every_change() -> None:
    """The placeable set is kept between creates: a refusal, a drain, a report of a
    full disk and a lease running out each show at once, and a caller cannot change it."""
    clock = FakeClock()
    reg = Registry(15.0, clock)
    reg.register("a", "h1", 1, 100, 50)
    reg.register("b", "h2", 2, 200, 150)
    got = reg.free_space()
    assert got == {"a": 50, "b": 150}
    got["c"] = 1  # the caller's copy
    assert reg.free_space() == {"a": 50, "b": 150} and set(reg.placeable()) == {"a", "b"}
    assert reg.refused("b") and reg.free_space() == {"a": 50}
    assert reg.heartbeat("b", 200, 140) and reg.free_space() == {"a": 50, "b": 140}
    reg.draining("a", True)
    assert reg.free_space() == {"b": 140}
    reg.draining("a", False)
    assert reg.heartbeat("a", 100, 0) and reg.free_space() == {"b": 140}  # full
    assert reg.heartbeat("a", 100, 60)
    clock.now += 15
    assert reg.free_space() == {"a": 60, "b": 140}  # the lease holds to its last instant
    clock.now += 0.001
    assert reg.free_space() == {}


def test_registry_describes_stored_servers() -> None:
    clock = FakeClock()
    reg = Registry(15.0, clock)
    stored = {"a": {"host": "old", "port": 9, "total": 1, "free": 1},
              "c": {"host": "hc", "port": 7, "total": 5, "free": 4}}
    reg.register("a", "h1", 1, 100, 50)
    assert reg.describe(stored) == {
        "a": {"host": "h1", "port": 1, "total": 100, "free": 50, "full": False, "dirs": [],
              "alive": True, "state": "up", "draining": False, "domain": "h1", "age": 0.0},
        "c": {"host": "hc", "port": 7, "total": 5, "free": 4, "alive": False,
              "state": "down", "draining": False}}
    clock.now += 16
    assert reg.describe(stored)["a"]["alive"] is False
    assert reg.describe(stored)["a"]["state"] == "down"


# ---------------------------------------------------------------------- commit queue
class CountingStore(MemoryStore):
    """Counts commits; ``fail`` makes the next commit fail after its operations ran."""

    def __init__(self) -> None:
        super().__init__()
        self.commits = 0
        self.fail = False

    @contextmanager
    def write(self, headroom: bool = False) -> Iterator[Any]:
        with super().write(headroom) as txn:
            yield txn
            if self.fail:
                self.fail = False
                raise OSError(errno.EIO, "disk trouble")
            self.commits += 1

    def value(self, key: bytes) -> bytes | None:
        with self.read() as txn:
            return txn.get(key)


def put(key: bytes, result: Any = None) -> Callable[[WriteTxn], Any]:
    def fn(txn: WriteTxn) -> Any:
        txn.put(key, b"v")
        return result
    return fn


def put_then_fail(key: bytes) -> Callable[[WriteTxn], Any]:
    def fn(txn: WriteTxn) -> Any:
        txn.put(key, b"v")
        raise OSError(errno.EEXIST, "refused")
    return fn


async def settle(queue: CommitQueue, nursery: trio.Nursery, *,
                 results: dict[bytes, Any], fns: dict[bytes, Callable[[WriteTxn], Any]]
                 ) -> None:
    """Queue every ``fns`` operation before the writer runs, then run it."""
    async def call(key: bytes, fn: Callable[[WriteTxn], Any]) -> None:
        try:
            results[key] = await queue.mutate(fn)
        except OSError as exc:
            results[key] = exc

    async with trio.open_nursery() as callers:
        for key, fn in fns.items():
            callers.start_soon(call, key, fn)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(queue.run)


@trio_test
async def test_concurrent_mutations_share_one_commit() -> None:
    store = CountingStore()
    batches: list[int] = []
    queue = CommitQueue(store, lambda: batches.append(store.commits))
    results: dict[bytes, Any] = {}
    async with trio.open_nursery() as nursery:
        await settle(queue, nursery, results=results,
                     fns={b"k%d" % i: put(b"k%d" % i, i) for i in range(20)})
        nursery.cancel_scope.cancel()
    assert results == {b"k%d" % i: i for i in range(20)}
    assert store.commits == 1 and batches == [1]  # after_batch ran once, after the commit


@trio_test
async def test_a_failing_operation_rolls_back_alone() -> None:
    store = CountingStore()
    queue = CommitQueue(store)
    results: dict[bytes, Any] = {}
    async with trio.open_nursery() as nursery:
        await settle(queue, nursery, results=results,
                     fns={b"a": put(b"a", 1), b"bad": put_then_fail(b"bad"),
                          b"c": put(b"c", 3)})
        nursery.cancel_scope.cancel()
    assert results[b"a"] == 1 and results[b"c"] == 3
    assert isinstance(results[b"bad"], OSError) and results[b"bad"].errno == errno.EEXIST
    assert store.commits == 1
    assert store.value(b"a") == store.value(b"c") == b"v" and store.value(b"bad") is None


@trio_test
async def test_a_failed_commit_fails_its_batch_and_the_writer_goes_on() -> None:
    store = CountingStore()
    store.fail = True
    queue = CommitQueue(store)
    results: dict[bytes, Any] = {}
    async with trio.open_nursery() as nursery:
        await settle(queue, nursery, results=results,
                     fns={b"a": put(b"a"), b"bad": put_then_fail(b"bad")})
        assert await queue.mutate(put(b"later", "ok")) == "ok"
        nursery.cancel_scope.cancel()
    assert results[b"a"].errno == errno.EIO  # type: ignore[union-attr]
    assert results[b"bad"].errno == errno.EEXIST  # type: ignore[union-attr]  # its own error
    assert store.value(b"a") is None and store.value(b"later") == b"v"


@trio_test
async def test_batches_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit, "MAX_BATCH", 4)
    store = CountingStore()
    queue = CommitQueue(store)
    results: dict[bytes, Any] = {}
    async with trio.open_nursery() as nursery:
        await settle(queue, nursery, results=results,
                     fns={b"k%d" % i: put(b"k%d" % i, i) for i in range(10)})
        nursery.cancel_scope.cancel()
    assert len(results) == 10 and store.commits == 3


@trio_test
async def test_background_operations(caplog: pytest.LogCaptureFixture) -> None:
    store = CountingStore()
    queue = CommitQueue(store)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        with caplog.at_level(logging.WARNING, logger="pfs.metaserver.commit"):
            queue.submit(put_then_fail(b"bad"))
            queue.submit(put(b"bg"))
            await queue.mutate(put(b"fg"))  # queued after them: done after them
        assert store.value(b"bg") == b"v" and store.value(b"bad") is None
        assert "background metadata update failed" in caplog.text
        queue.close()
        assert queue.closed
        queue.submit(put(b"dropped"))
        await queue.mutate(put(b"fg2"))
        assert store.value(b"dropped") is None
        nursery.cancel_scope.cancel()


@trio_test
async def test_a_cancelled_caller_leaves_its_operation_queued() -> None:
    """A handler cancelled while it waits (its client went away) does not take its
    operation back: it commits with its batch, and the callers after it are served."""
    store = CountingStore()
    queue = CommitQueue(store)
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as callers:
            callers.start_soon(queue.mutate, put(b"gone"))
            await trio.testing.wait_all_tasks_blocked()
            callers.cancel_scope.cancel()
        nursery.start_soon(queue.run)
        assert await queue.mutate(put(b"next", 2)) == 2
        nursery.cancel_scope.cancel()
    assert store.value(b"gone") == store.value(b"next") == b"v"


@trio_test
async def test_write_alone_and_dry_run() -> None:
    store = CountingStore()
    queue = CommitQueue(store)
    assert await queue.write_alone(put(b"boot", 7)) == 7
    assert store.value(b"boot") == b"v" and store.commits == 1

    def check(txn: WriteTxn) -> None:
        dry_run(txn, put(b"tried"))
        with pytest.raises(OSError):
            dry_run(txn, put_then_fail(b"refused"))

    await queue.write_alone(check)
    assert store.value(b"tried") is None and store.value(b"refused") is None


# ---------------------------------------------------------------------- open files
def conn() -> ConnContext:
    return ConnContext(None, "test")  # type: ignore[arg-type]


class Orphans:
    """A store where inodes can be orphans, and a reclaim that records its calls."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.reclaimed: list[int] = []

    def make_orphan(self, ino: int) -> None:
        with self.store.write() as txn:
            txn.put(K.orphan(ino), b"")

    def reclaim(self, txn: WriteTxn, ino: int) -> bool:
        txn.delete(K.orphan(ino))
        self.reclaimed.append(ino)
        return True


def open_files(orphans: Orphans) -> tuple[OpenFiles, CommitQueue]:
    queue = CommitQueue(orphans.store)
    return OpenFiles(orphans.store, queue, orphans.reclaim), queue


def test_handles_belong_to_their_connection() -> None:
    files, _ = open_files(Orphans())
    a, b = conn(), conn()
    fa = files.new_handle(a, 7, os.O_RDONLY, root=True)
    fw = files.new_handle(a, 8, os.O_WRONLY, root=False)
    fb = files.new_handle(b, 9, os.O_RDWR, root=False)
    assert fb == fa  # numbered per connection
    h = files.handle(a, fa)
    assert (h.ino, h.rights, h.root) == (7, caps.READ, True)
    assert files.handle(a, fw).rights == caps.WRITE and not files.handle(a, fw).root
    assert files.handle(b, fb).rights == caps.READ | caps.WRITE
    assert files.close_handle(a, fa).ino == 7
    for call in (files.handle, files.close_handle):
        with pytest.raises(OSError) as e:
            call(a, fa)
        assert e.value.errno == errno.EBADF
    assert files.handle(b, fb).ino == 9  # another connection's handle of that number


def test_open_counts_and_the_namespace_hooks() -> None:
    files, _ = open_files(Orphans())
    files.ref(5)
    files.ref(5)
    assert files.is_open(5) and not files.is_open(6)
    assert files.opened(5)  # last link dropped while open: keep it (an orphan)
    assert not files.opened(6)  # not open: deleted now, and dying until the commit
    with pytest.raises(OSError) as e:
        files.ref(6)
    assert e.value.errno == errno.ENOENT
    assert not files.is_open(6)
    files.batch_committed()
    files.ref(6)  # gone from the store by now; the namespace's open refuses it
    assert files.is_open(6)


@trio_test
async def test_the_last_close_of_an_orphan_reclaims_it() -> None:
    orphans = Orphans()
    files, queue = open_files(orphans)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        files.ref(5)
        files.ref(5)
        files.ref(6)
        assert files.opened(5)  # unlinked while open: an orphan
        orphans.make_orphan(5)
        await files.release(5)
        assert orphans.reclaimed == [] and files.is_open(5)
        await files.release(5)  # the last handle
        assert orphans.reclaimed == [5] and not files.is_open(5)
        await files.release(6)  # never an orphan
        assert orphans.reclaimed == [5]
        files.ref(7)
        assert files.opened(7)  # its unlink's batch then failed: no orphan key
        await files.release(7)
        assert orphans.reclaimed == [5]
        nursery.cancel_scope.cancel()


@trio_test
async def test_deferred_closes_and_lost_connections_release_handles() -> None:
    orphans = Orphans()
    files, queue = open_files(orphans)
    ctx = conn()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        fhs = []
        for ino in (5, 6, 7):
            files.ref(ino)
            fhs.append(files.new_handle(ctx, ino, os.O_RDONLY, root=True))
            assert files.opened(ino)
            orphans.make_orphan(ino)
        for bad in ([1] * (MAX_CLOSES + 1), ["x"], [True]):
            with pytest.raises(OSError) as e:
                files.release_closed(ctx, bad)
            assert e.value.errno == errno.EINVAL
        files.release_closed(ctx, [fhs[0], 999])  # unknown handles are skipped
        await queue.mutate(lambda t: None)  # the reclaim went before it
        assert orphans.reclaimed == [5]
        with pytest.raises(OSError):
            files.handle(ctx, fhs[0])
        files.connection_lost(ctx)
        await queue.mutate(lambda t: None)
        assert sorted(orphans.reclaimed) == [5, 6, 7]
        assert not any(files.is_open(i) for i in (5, 6, 7))
        nursery.cancel_scope.cancel()


@trio_test
async def test_nothing_is_reclaimed_once_stopped() -> None:
    orphans = Orphans()
    files, queue = open_files(orphans)
    ctx = conn()
    files.ref(5)
    files.new_handle(ctx, 5, os.O_RDONLY, root=True)
    assert files.opened(5)
    orphans.make_orphan(5)
    queue.close()
    files.connection_lost(ctx)  # left for the next start's reclaim of orphans
    assert not files.is_open(5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        await queue.mutate(lambda t: None)
        nursery.cancel_scope.cancel()
    assert orphans.reclaimed == []


# ---------------------------------------------------------------------- deleter
ROOT = Cred(0, 0, ())


class FakeObjects:
    """Records deletions; a server in ``refuse`` fails that many rounds."""

    def __init__(self, refuse: dict[str, int]) -> None:
        self.rounds: list[dict[str, list[list[int]]]] = []
        self.refuse = refuse
        self.sent = trio.Event()

    async def delete_objects(self, objs: dict[str, list[list[int]]],
                             live: set[int]) -> dict[str, OSError]:
        self.rounds.append(objs)
        self.sent.set()
        errors = {}
        for sid in objs:
            if self.refuse.get(sid, 0) > 0:
                self.refuse[sid] -= 1
                errors[sid] = OSError(errno.EIO, "disk hiccup")
        return errors


def queued(store: MemoryStore) -> int:
    with store.read() as txn:
        return len(list(txn.scan(K.DELQ)))


def test_deleter_sends_queued_deletions_together_and_retries_failures() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)  # its sleeps take no time

    async def main() -> None:
        store = MemoryStore()
        queue = CommitQueue(store)
        ns = Namespace(LayoutDefaults(unit=4096, count=2, replicas=1),
                       servers=lambda: {"s1": 100, "s2": 100})
        objects = FakeObjects({"s2": 1})
        deleter = Deleter(store, ns, queue, objects)
        await queue.write_alone(ns.format)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.run)
            def create(name: bytes) -> Callable[[WriteTxn], Any]:
                return lambda t: ns.create(t, ROOT, 1, name, 0o644, os.O_RDWR)

            def unlink(name: bytes) -> Callable[[WriteTxn], Any]:
                return lambda t: ns.unlink(t, ROOT, 1, name)

            inos = []
            for name in (b"a", b"b", b"c"):
                attr, _, _ = await queue.mutate(create(name))
                inos.append(attr["ino"])
            nursery.start_soon(deleter.run)
            for name in (b"a", b"b", b"c"):
                await queue.mutate(unlink(name))
                deleter.wake()
            assert queued(store) == 3
            await objects.sent.wait()
            start = trio.current_time()
            want = sorted([ino, s] for ino in inos for s in (0, 1))
            first = objects.rounds[0]
            assert sorted(first["s1"] + first["s2"]) == want  # one round for all three
            await trio.testing.wait_all_tasks_blocked()
            assert queued(store) == 3  # s2 refused: every entry waits for it
            objects.sent = trio.Event()
            await objects.sent.wait()
            waited = trio.current_time() - start  # retried soon, not at the idle check
            assert deleter_module.DELETE_RETRY <= waited < deleter_module.IDLE_CHECK
            await trio.testing.wait_all_tasks_blocked()
            assert len(objects.rounds) == 2 and queued(store) == 0
            assert not any(deleter.deleting(ino) for ino in inos)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


class FlushingStore(MemoryStore):
    """Flushes like LmdbStore: each commit that writes flushes once, ``sync`` once."""

    def __init__(self) -> None:
        super().__init__()
        self.flush_on_commit = True
        self.flushes = 0
        self.syncs = 0
        self.committed = trio.Event()

    @contextmanager
    def write(self, headroom: bool = False) -> Iterator[Any]:
        with super().write(headroom) as txn:
            yield txn
        self.flushes += 1
        self.committed.set()

    def sync(self) -> None:
        self.syncs += 1


@trio_test
async def test_one_flush_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Callers of a batch are woken once a later flush covers it: the next batch's
    commit, or a sync when nothing else waits. Three batches in a row: three commits and
    one sync, not three of each."""
    monkeypatch.setattr(commit, "MAX_BATCH", 4)
    store = FlushingStore()
    woken: list[tuple[int, int]] = []
    queue = CommitQueue(store, lambda: woken.append((store.flushes, store.syncs)))
    assert store.flush_on_commit is False  # the queue flushes itself
    results: dict[bytes, Any] = {}
    async with trio.open_nursery() as nursery:
        await settle(queue, nursery, results=results,
                     fns={b"k%d" % i: put(b"k%d" % i, i) for i in range(10)})
        await queue.durable()  # nothing committed and unflushed is left
        nursery.cancel_scope.cancel()
    assert len(results) == 10
    assert woken == [(2, 0), (3, 0), (3, 1)]  # batch 1 after commit 2, 2 after 3, 3 synced


@trio_test
async def test_a_mutation_just_behind_a_batch_saves_its_flush() -> None:
    """A mutation queued a scheduler pass or two after a batch commits (a request the
    server had already received) joins the next batch, whose commit makes the first
    durable: no flush for the first batch alone."""
    store = FlushingStore()
    woken: list[tuple[int, int]] = []
    queue = CommitQueue(store, lambda: woken.append((store.flushes, store.syncs)))

    async def behind() -> None:
        await store.committed.wait()  # the first batch committed, not yet flushed
        for _ in range(commit.SETTLE_PASSES - 1):
            await trio.lowlevel.checkpoint()
        await queue.mutate(put(b"b"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        nursery.start_soon(behind)
        await queue.mutate(put(b"a"))
        await queue.durable()
        nursery.cancel_scope.cancel()
    assert woken == [(2, 0), (2, 1)]  # "a" after the commit of "b"; "b" flushed alone


@trio_test
async def test_busy_tasks_do_not_hold_back_a_lone_flush() -> None:
    """The passes the writer lets run before flushing a batch alone are bounded: tasks
    that never block (but keep yielding) do not delay the acknowledgement."""
    store = FlushingStore()
    queue = CommitQueue(store)

    async def busy() -> None:
        while True:
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        for _ in range(3):
            nursery.start_soon(busy)
        with trio.fail_after(5):
            assert await queue.mutate(put(b"a", 1)) == 1
        nursery.cancel_scope.cancel()
    assert store.syncs == 1


@trio_test
async def test_durable_waits_for_the_flush() -> None:
    """``durable`` called once a batch is committed returns only after its flush."""
    store = FlushingStore()
    queue = CommitQueue(store)
    seen: list[int] = []

    async def barrier() -> None:
        await store.committed.wait()  # committed (visible), perhaps not yet flushed
        await queue.durable()
        seen.append(store.syncs)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        nursery.start_soon(barrier)
        await queue.mutate(put(b"a"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert seen == [1]


def test_lmdb_counts_the_commits_that_flushed(tmp_path: Path) -> None:
    """A commit that wrote flushes the file (what makes the batch before it durable);
    one that changed nothing does not, and the commit queue must not count on it."""
    store = LmdbStore(tmp_path / "db", 1 << 24, check_format=False)
    try:
        store.flush_on_commit = False
        with store.write() as txn:
            txn.put(b"k", b"v")
        assert store.flushes == 1
        with store.write() as txn:
            assert txn.get(b"k") == b"v"
        assert store.flushes == 1
        store.sync()
        with store.read() as txn:
            assert txn.get(b"k") == b"v"
    finally:
        store.close()


def test_credentials_kept_per_connection_are_checked_again_when_they_change() -> None:
    """A connection's last allowed credentials are kept; other ones are checked afresh
    (a refused uid stays refused after an allowed one, and root is still squashed)."""
    svc = MetaService(MemoryStore(), MetaConfig(root_squash=True))
    ctx = ConnContext(conn=None, peer="t",  # type: ignore[arg-type]  # no wire here
                      identity=auth.Identity("node", "client", (1000, 1999), (100, 199)))

    class Req:
        def __init__(self, cred: tuple[int, int, tuple[int, ...]]) -> None:
            self.cred = cred

    assert svc._cred(ctx, Req((1000, 100, ()))) == Cred(1000, 100)
    assert svc._cred(ctx, Req((1000, 100, ()))) == Cred(1000, 100)  # kept
    with pytest.raises(OSError) as e:
        svc._cred(ctx, Req((5, 100, ())))
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError):
        svc._cred(ctx, Req((1000, 100, (7,))))  # a group outside the key's range
    squashed = svc._cred(ctx, Req((0, 0, ())))
    assert squashed.uid == svc.config.squash_uid
    assert svc._cred(ctx, Req((1001, 101, ()))) == Cred(1001, 101)


class _Counted:
    """A write transaction that counts its puts of counter keys (and its nested ones')."""

    def __init__(self, txn: Any, puts: dict[bytes, int]) -> None:
        self._txn, self._puts = txn, puts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def put(self, key: bytes, value: bytes) -> None:
        if key.startswith(K.counter(b"")):
            self._puts[key] = self._puts.get(key, 0) + 1
        self._txn.put(key, value)

    @contextmanager
    def nested(self) -> Iterator[Any]:
        with self._txn.nested() as sub:
            yield _Counted(sub, self._puts)


class _CountingStore(MemoryStore):
    """Counts the puts of each counter key."""

    def __init__(self) -> None:
        super().__init__()
        self.counter_puts: dict[bytes, int] = {}

    @contextmanager
    def write(self, headroom: bool = False) -> Iterator[Any]:  # type: ignore[override]
        with super().write(headroom) as txn:
            yield _Counted(txn, self.counter_puts)


def test_inode_numbers_come_from_ranges_stored_once_per_batch_and_never_repeat() -> None:
    """Creates in group-commit batches take inode numbers from a range kept in memory:
    ``next_ino`` is stored once per range (its end) and the inode count once per batch,
    not once per create. Operations that roll back give their count back. A new
    service on the same store (what a crash leaves) starts past every number handed
    out, and a batch that fails forgets the range it took."""
    store = _CountingStore()

    async def service(creates: list[bytes]) -> list[int]:
        counters = Counters()
        queue = CommitQueue(store, counters=counters)
        ns = Namespace(LayoutDefaults(unit=4096, count=1, replicas=1),
                       servers=lambda: {"s1": 100}, counters=counters)
        await queue.write_alone(ns.format)
        inos = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.run)
            for name in creates:
                create = functools.partial(ns.create, cred=ROOT, parent=1, name=name,
                                           mode=0o644)
                attr, _, _ = await queue.mutate(
                    functools.partial(create, flags=os.O_RDWR | os.O_CREAT))
                inos.append(attr["ino"])
                with pytest.raises(FileExistsError):  # rolled back: counts nothing
                    await queue.mutate(functools.partial(
                        create, flags=os.O_RDWR | os.O_CREAT | os.O_EXCL))
            nursery.cancel_scope.cancel()
        return inos

    first = trio.run(service, [b"a%d" % i for i in range(20)])
    assert first == sorted(set(first))
    assert store.counter_puts[K.counter(b"next_ino")] == 2  # format, then one range
    assert store.counter_puts[K.counter(b"inodes")] == 1 + 20  # format, then per batch
    with store.read() as txn:
        assert K.read_u64(txn.get(K.counter(b"inodes")) or b"") == 21  # root + 20 files
    again = trio.run(service, [b"b%d" % i for i in range(3)])  # the same store, restarted
    assert min(again) > max(first)


def _counters_at(next_ino: int) -> tuple[MemoryStore, Counters]:
    """A store whose ``next_ino`` is ``next_ino`` and counters inside a batch."""
    store = MemoryStore()
    with store.write() as txn:
        counter_write(txn, b"next_ino", next_ino)
    c = Counters()
    c.begin()
    return store, c


def test_a_failed_batch_forgets_the_inode_range_it_took() -> None:
    store, c = _counters_at(100)
    with store.read() as txn:
        assert c.new_ino(txn) == 100
    c.end(committed=False)  # nothing stored: 100.. was never given out durably
    c.begin()
    with store.write() as txn:
        assert c.new_ino(txn) == 100 and c.new_ino(txn) == 101
        c.flush(txn)
    c.end(committed=True)
    with store.read() as txn:
        assert K.read_u64(txn.get(K.counter(b"next_ino")) or b"") == 100 + INO_RANGE
        assert K.read_u64(txn.get(K.counter(b"inodes")) or b"") == 2
    c.begin()
    with store.write() as txn:
        assert c.new_ino(txn) == 102  # from memory: no read, no put
    c.end(committed=True)


def test_a_batch_using_more_than_one_range_never_repeats_a_number() -> None:
    """One batch may hand out more numbers than a range holds (8 clients' batched
    creates of 256 paths each): the next range starts past the first, not at the stored
    ``next_ino`` its batch has not written yet."""
    store, c = _counters_at(100)
    with store.write() as txn:
        given = [c.new_ino(txn) for _ in range(3 * INO_RANGE + 5)]
        c.flush(txn)
    c.end(committed=True)
    assert len(set(given)) == len(given) and min(given) == 100
    c.begin()
    with store.write() as txn:
        later = c.new_ino(txn)
    c.end(committed=True)
    with store.read() as txn:
        stored = K.read_u64(txn.get(K.counter(b"next_ino")) or b"")
    assert later > max(given) and stored > max(given)


def test_profiled_writes_cpu_statistics_even_when_it_fails(tmp_path: Path) -> None:
    """``PFS_META_PROFILE``: the metaserver's run under cProfile, its statistics written
    to ``PATH.<pid>`` however it ends."""
    import pstats

    from pfs.metaserver.__main__ import _profiled

    def work() -> None:
        sum(i * i for i in range(10_000))
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError):
        _profiled(str(tmp_path / "prof"), work)
    stats = pstats.Stats(str(tmp_path / f"prof.{os.getpid()}"))
    assert any(fn[2] == "work" for fn in stats.stats)  # type: ignore[attr-defined]
