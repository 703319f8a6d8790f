"""The mount's request path without a kernel: the directories whose names it knows
(``pfs.fuse.known_dirs``), the attributes it answers GETATTR from
(``pfs.fuse.attr_cache``) and the lock pyfuse3's workers hand over
(``pfs.fuse.workers``)."""

from __future__ import annotations

import socket
import time

import pytest
import trio
import trio.testing

from pfs.client.types import StatResult
from pfs.fuse.attr_cache import MAX_INODES, AttrCache
from pfs.fuse.known_dirs import MAX_NAMES, KnownDirs
from pfs.fuse.workers import (
    MAX_QUICK_WAIT_MS,
    HandoffLock,
    LoopState,
    QuickWait,
    ReaderLock,
    trio_for_pyfuse3,
)


def test_a_known_directory_answers_missing_names_only_within_the_bound() -> None:
    k = KnownDirs(0.3)
    k.learn(7, [b"a", b"b"], time.monotonic())
    assert k.absent(7, b"a") is None  # there: asked of the metaserver
    left = k.absent(7, b"c")
    assert left is not None and 0 < left <= 0.3
    assert k.absent(8, b"c") is None  # not known
    assert k.absent(7, b".") is None and k.absent(7, b"..") is None
    time.sleep(0.35)
    assert k.absent(7, b"c") is None  # the bound is over: ask again


def test_the_bound_counts_from_when_the_directory_was_known() -> None:
    k = KnownDirs(1.0)
    k.learn(7, [], time.monotonic() - 0.8)  # listed 0.8 s ago
    left = k.absent(7, b"x")
    assert left is not None and left <= 0.2
    k.learn(9, [], time.monotonic() - 2.0)  # already over: not kept
    assert k.absent(9, b"x") is None


def test_this_mounts_changes_keep_the_names_right() -> None:
    k = KnownDirs(5.0)
    k.learn(7, [], time.monotonic())
    k.added(7, b"new")
    assert k.absent(7, b"new") is None  # made here: there at once
    k.removed(7, b"new")
    assert k.absent(7, b"new") is not None
    k.found(7, b"elsewhere")  # the metaserver has a name held missing: the set is wrong
    assert k.absent(7, b"other") is None
    k.learn(7, [], time.monotonic())
    epoch = k.epoch
    k.drop(7)  # a change that failed or may have happened
    assert k.absent(7, b"x") is None and k.epoch > epoch


def test_off_and_too_large_keep_nothing() -> None:
    off = KnownDirs(0.0)
    off.learn(7, [], time.monotonic())
    assert not off.enabled and off.absent(7, b"x") is None
    k = KnownDirs(5.0)
    k.learn(7, (b"%d" % i for i in range(MAX_NAMES + 1)), time.monotonic())
    assert k.absent(7, b"x") is None


def test_the_handoff_lock_serves_waiters_in_order_and_drops_a_cancelled_one() -> None:
    async def main() -> None:
        lock = HandoffLock()
        order: list[int] = []

        async def worker(i: int) -> None:
            async with lock:
                order.append(i)
                await trio.sleep(0.01)

        async with trio.open_nursery() as n:
            for i in range(4):
                n.start_soon(worker, i)
                await trio.testing.wait_all_tasks_blocked()
        assert order == [0, 1, 2, 3] and not lock.locked()

        async with trio.open_nursery() as n:

            async def holder() -> None:
                async with lock:
                    await trio.sleep(0.05)

            n.start_soon(holder)
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.01) as scope:
                async with lock:
                    pytest.fail("acquired a held lock")
            assert scope.cancelled_caught
            n.start_soon(worker, 9)  # the next waiter still gets it
        assert order[-1] == 9 and not lock.locked()

    trio.run(main)


def test_pyfuse3_gets_trio_with_the_reader_lock() -> None:
    m = trio_for_pyfuse3()
    assert m.Lock is ReaderLock
    assert m.lowlevel is trio.lowlevel and m.ClosedResourceError is trio.ClosedResourceError
    assert m.open_nursery is trio.open_nursery
    quick = QuickWait(None)
    m = trio_for_pyfuse3(quick)
    assert m.lowlevel.wait_readable == quick.wait_readable
    assert m.lowlevel.current_task is trio.lowlevel.current_task  # the rest: trio's


def test_the_quick_wait_reads_on_only_while_nothing_else_has_to_run() -> None:
    """``QuickWait`` (pyfuse3's wait for /dev/fuse) skips trio's scheduler only while no
    other task is runnable, no descriptor another task waits on is ready, no thread or
    deadline wakes the loop: else it goes trio's way, and the others run."""

    async def main() -> None:
        quick = QuickWait(LoopState.current())
        assert quick.loop is not None  # this trio's epoll set is found: the quick path is on
        fuse, kernel = socket.socketpair()
        other, peer = socket.socketpair()
        with fuse, kernel, other, peer:
            kernel.send(b"r")
            await trio.testing.wait_all_tasks_blocked()  # (trio's own start-up tasks)
            assert quick.ready(fuse.fileno())  # a request, nothing else to do
            ran: list[str] = []

            async def waiter() -> None:
                await trio.lowlevel.wait_readable(other)
                ran.append("waiter")

            async with trio.open_nursery() as n:
                n.start_soon(waiter)
                assert not quick.ready(fuse.fileno())  # a task is runnable
                await trio.testing.wait_all_tasks_blocked()
                peer.send(b"x")  # what another task waits for is ready
                t0 = time.monotonic()
                assert not quick.ready(fuse.fileno())
                await quick.wait_readable(fuse.fileno())  # trio's way: the other runs
                await trio.testing.wait_all_tasks_blocked()
                assert ran == ["waiter"]
            fuse.recv(1)
            # nothing readable: a deadline, or a thread that finishes, ends the wait
            # long before MAX_QUICK_WAIT_MS
            with trio.move_on_after(0.05):  # (a deadline the poll must not sleep past)
                assert not quick.ready(fuse.fileno())
                await trio.lowlevel.checkpoint()
            async with trio.open_nursery() as n:
                n.start_soon(trio.to_thread.run_sync, time.sleep, 0.05)
                await trio.testing.wait_all_tasks_blocked()
                assert not quick.ready(fuse.fileno())
            assert time.monotonic() - t0 < 0.8 * MAX_QUICK_WAIT_MS / 1000
            # a task woken in the same scheduler batch, not yet run, is runnable too
            # (it is off the run queue): no quick read before it ran
            kernel.send(b"r")
            seen: list[tuple[bool, bool]] = []

            async def sibling(go: trio.Event, woke: list[str]) -> None:
                await go.wait()
                woke.append("sibling")

            async def probe(go: trio.Event, woke: list[str]) -> None:
                await go.wait()
                seen.append((not woke, quick.ready(fuse.fileno())))

            for _ in range(30):
                go, woke = trio.Event(), list[str]()
                async with trio.open_nursery() as n:
                    n.start_soon(sibling, go, woke)
                    n.start_soon(probe, go, woke)
                    await trio.testing.wait_all_tasks_blocked()
                    go.set()
            assert {pending for pending, _ in seen} == {True, False}  # (a coin toss each)
            assert all(ready is not pending for pending, ready in seen)

    trio.run(main)


def _attr(ino: int, size: int = 0) -> StatResult:
    return StatResult(0o100644, ino, 1, 0, 0, size, 0, 0, 0, 0, 4096, 0, 0)


def test_kept_attributes_answer_only_within_the_bound() -> None:
    c = AttrCache(0.3)
    c.put(5, _attr(5, 10))
    got = c.get(5)
    assert got is not None and got.st_size == 10
    assert c.get(6) is None
    time.sleep(0.35)
    assert c.get(5) is None  # attr_timeout passed since the reply: ask again
    off = AttrCache(0.0)  # attr_timeout 0: nothing kept
    off.put(5, _attr(5))
    assert off.get(5) is None


def test_a_reply_that_crossed_a_change_here_is_not_kept() -> None:
    c = AttrCache(5.0)
    since = c.gen  # a getattr is sent...
    c.drop(5)  # ...a setattr of the same inode ends meanwhile
    c.put(5, _attr(5, 1), since)  # the getattr's reply may be from before it
    assert c.get(5) is None
    c.put(5, _attr(5, 2), c.gen)  # one sent after the change is kept
    c.put(6, _attr(6, 3))  # so is a change's own reply
    assert c.get(5) is not None and c.get(6) is not None
    c.clear()  # an unlink, rmdir or rename: everything goes
    assert c.get(5) is None and c.get(6) is None


def test_the_attribute_cache_is_bounded() -> None:
    c = AttrCache(60.0)
    for ino in range(MAX_INODES + 1):
        c.put(ino, _attr(ino))
    assert c.get(MAX_INODES) is not None and c.get(0) is None


def test_the_reader_lock_stays_with_a_worker_until_its_request_waits() -> None:
    """pyfuse3's read lock (``ReaderLock``): a worker that leaves it keeps it and takes
    it again at once; a waiting worker gets it only when ``yield_reader`` is called (a
    request is about to wait) or the holder leaves with an error."""
    from pfs.fuse import workers

    async def main() -> None:
        lock = workers.ReaderLock()
        got: list[str] = []

        async def other() -> None:
            async with lock:
                got.append("other")

        async with lock:
            pass
        assert lock.locked()  # left, still held by this task
        async with trio.open_nursery() as n:
            n.start_soon(other)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []  # waits: the holder serves a request without waiting
            async with lock:  # the holder again: no wait
                pass
            assert got == []
            workers.yield_reader()  # the holder's request is about to wait
            await trio.testing.wait_all_tasks_blocked()
            assert got == ["other"]
        assert lock.locked()  # "other" left normally: it holds it now
        workers.yield_reader()  # (its next request waits): free, nobody waiting
        assert not lock.locked()
        with pytest.raises(RuntimeError):
            async with lock:
                raise RuntimeError("boom")
        assert not lock.locked()  # left with an error: handed on at once

    trio.run(main)
