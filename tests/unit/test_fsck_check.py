"""pfs fsck's classification, on fake listings: orphans, missing and short objects, holes
of sparse files, replicas as evidence, servers that could not be listed."""
from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import trio

from pfs.core.messages import data as D
from pfs.core.messages import meta as M
from pfs.core.messages.base import RequestMessage
from pfs.tools.fsck import Fsck, Rate, Report
from pfs.tools.fsck_check import FileRec, ObjRec, Peek, Problem, Tally, classify, merge

U = 65536
LAYOUT = {"unit": U, "count": 2, "replicas": 1, "servers": [["a"], ["b"]]}


def dense(ino: int, stripe: int, size: int) -> ObjRec:
    return ObjRec(ino, stripe, size, (size + 4095) // 4096 * 4096)


def kinds(problems: list[Problem]) -> list[tuple[str, int, int, str]]:
    return sorted((p.kind, p.ino, p.stripe, p.sid) for p in problems)


def test_a_whole_file_is_clean() -> None:
    f = FileRec(5, 4 * U, LAYOUT)
    problems, ref = classify(f, {"a": {0: dense(5, 0, 2 * U)}, "b": {1: dense(5, 1, 2 * U)}},
                             set())
    assert problems == [] and len(ref) == 2


def test_absent_and_cut_objects_of_a_dense_file() -> None:
    f = FileRec(5, 4 * U, LAYOUT)
    problems, _ = classify(f, {"a": {0: dense(5, 0, 1000)}}, set())
    assert kinds(problems) == [("missing", 5, 1, "b"), ("short", 5, 0, "a")]
    assert "1000 of 131072 bytes" in next(p.detail for p in problems if p.kind == "short")


def test_a_file_with_only_its_last_byte_written_has_holes_not_losses() -> None:
    f = FileRec(5, 4 * U, LAYOUT)
    last = ObjRec(5, 1, 2 * U, 4096)  # one block of data at the end of the object
    problems, _ = classify(f, {"b": {1: last}}, set())
    assert kinds(problems) == [("hole?", 5, 0, "a")]
    rep = Report(problems=problems)
    assert rep.exit_code == 0  # a possible hole is listed, not counted


def test_a_replica_with_the_data_proves_a_loss_even_in_a_sparse_file() -> None:
    layout = {"unit": U, "count": 1, "replicas": 2, "servers": [["a", "b"]]}
    f = FileRec(7, U, layout)
    problems, _ = classify(f, {"a": {0: ObjRec(7, 0, U, 4096)}}, set())
    assert kinds(problems) == [("missing", 7, 0, "b")]


def test_objects_the_layout_does_not_place_are_orphans() -> None:
    f = FileRec(5, 4 * U, LAYOUT)
    objs = {"a": {0: dense(5, 0, 2 * U), 1: dense(5, 1, 7)}, "b": {1: dense(5, 1, 2 * U)},
            "c": {0: dense(5, 0, 3)}}
    problems, _ = classify(f, objs, set())
    assert kinds(problems) == [("orphan", 5, 0, "c"), ("orphan", 5, 1, "a")]


def test_a_server_that_was_not_listed_is_not_judged() -> None:
    f = FileRec(5, 4 * U, LAYOUT)
    problems, _ = classify(f, {"a": {0: dense(5, 0, 2 * U)}}, {"b"})
    assert problems == []


def test_an_empty_or_unplaced_file_expects_nothing() -> None:
    assert classify(FileRec(5, 0, LAYOUT), {}, set())[0] == []
    assert classify(FileRec(6, 100, None), {}, set())[0] == []


def mapped(ino: int, stripe: int, size: int, written: int, holes: int = 0) -> ObjRec:
    """An object with a block map (allocation does not matter then)."""
    return ObjRec(ino, stripe, size, 0, written, holes)


def test_the_block_map_tells_a_cut_from_a_hole() -> None:
    f = FileRec(5, 4 * U, LAYOUT)
    # stripe 0 grown by truncate past its data: a hole, even though it looks sparse
    ok = {"a": {0: mapped(5, 0, 2 * U, U // 2)}, "b": {1: mapped(5, 1, 2 * U, 2 * U)}}
    assert classify(f, ok, set())[0] == []
    cut = {"a": {0: mapped(5, 0, 1000, U // 2)}, "b": {1: mapped(5, 1, 2 * U, 2 * U)}}
    problems, _ = classify(f, cut, set())
    assert kinds(problems) == [("short", 5, 0, "a")]
    assert "block map says data was written up to 32768" in problems[0].detail


def test_an_object_gone_with_or_without_its_block_map() -> None:
    f = FileRec(5, 4 * U, LAYOUT)
    lost = ObjRec(5, 1, -1, 0, 2 * U, 0)  # the file gone, the map kept
    problems, ref = classify(f, {"a": {0: mapped(5, 0, 2 * U, 2 * U)}, "b": {1: lost}}, set())
    assert kinds(problems) == [("missing", 5, 1, "b")] and len(ref) == 1  # not verified
    # gone with its map: stripe 0 holds data past stripe 1's start, without holes
    problems, _ = classify(f, {"a": {0: mapped(5, 0, 2 * U, 2 * U)}}, set())
    assert kinds(problems) == [("missing", 5, 1, "b")]
    assert "written past it" in problems[0].detail
    # ... but not when nothing was written past it, or the file has holes
    for obj in (mapped(5, 0, 2 * U, U), mapped(5, 0, 2 * U, 2 * U, holes=1)):
        problems, _ = classify(f, {"a": {0: obj}}, set())
        assert kinds(problems) == [("hole?", 5, 1, "b")]
    # a stripe gone with its map whose replica kept its map: lost
    layout = {"unit": U, "count": 1, "replicas": 2, "servers": [["a", "b"]]}
    problems, _ = classify(FileRec(7, U, layout), {"a": {0: ObjRec(7, 0, -1, 0, U)}}, set())
    assert kinds(problems) == [("missing", 7, 0, "a"), ("missing", 7, 0, "b")]
    # a block map left of an object no file places there: an orphan, said so
    problems, _ = classify(FileRec(7, U, layout), {"c": {0: ObjRec(7, 0, -1, 0, U)}}, set())
    assert [p.detail.split(";")[0] for p in problems if p.kind == "orphan"] == [
        "only a block map (the object file is gone)"]


async def _aiter(items: list[Any]) -> AsyncIterator[Any]:
    for x in items:
        yield x


def test_merge_finds_orphans_before_between_and_after_files() -> None:
    files = [FileRec(5, U, LAYOUT), FileRec(9, 0, LAYOUT)]
    objs = {"a": [dense(2, 0, 10), dense(5, 0, U), dense(7, 0, 1), dense(12, 3, 4)],
            "b": []}
    tally = Tally()

    async def main() -> list[int]:
        streams = {sid: Peek(_aiter(lst)) for sid, lst in objs.items()}
        return [f.ino async for f, _ in merge(_aiter(files), streams, set(), tally)]

    assert trio.run(main) == [5, 9]
    assert kinds(tally.problems) == [("orphan", 2, 0, "a"), ("orphan", 7, 0, "a"),
                                     ("orphan", 12, 3, "a")]
    assert (tally.files, tally.objects) == (2, 4)


def test_exit_codes() -> None:
    assert Report().exit_code == 0
    assert Report(problems=[Problem("orphan", 1, 0, "a", "")]).exit_code == 1
    assert Report(unreachable={"a": "down"}).exit_code == 2
    assert Report(problems=[Problem("orphan", 1, 0, "a", "")],
                  unreachable={"b": "down"}).exit_code == 2
    assert Report(problems=[Problem("unchecked", 1, 0, "a", "")]).exit_code == 0


def test_with_a_server_of_the_file_down_an_absent_object_may_be_a_hole() -> None:
    # the object that would show the file sparse may be the one on the server down
    f = FileRec(5, 4 * U, LAYOUT)
    problems, _ = classify(f, {}, {"b"})
    assert kinds(problems) == [("hole?", 5, 0, "a")]
    assert "could not be listed" in problems[0].detail


class _FakeFsck(Fsck):
    """Fsck whose data servers answer ``verify`` from a table: a reply or an errno."""

    def __init__(self, answers: dict[str, Any]) -> None:
        super().__init__(client=None, rate=0)  # type: ignore[arg-type]
        self.answers = answers
        self.asked: list[str] = []

    async def cap(self) -> bytes:
        return b"cap"

    async def data(self, sid: str, msg: RequestMessage) -> Any:
        assert isinstance(msg, D.Verify)
        self.asked.append(sid)
        a = self.answers[sid]
        if isinstance(a, int):
            raise OSError(a, f"{sid}: refused")
        return a


def _verify_all(fk: Fsck, objs: list[tuple[str, ObjRec]]) -> None:
    async def main() -> None:
        limiter = trio.Semaphore(1)
        async with trio.open_nursery() as n:
            for sid, o in objs:
                await limiter.acquire()
                n.start_soon(fk.verify_one, sid, o, limiter)

    trio.run(main)


def test_verify_results_become_checksum_problems_notes_and_errors() -> None:
    fk = _FakeFsck({"old": errno.ENOSYS, "good": D.VerifyReply(blocks=2, bad=[], unchecked=False),
                    "bad": D.VerifyReply(blocks=4, bad=[65536], unchecked=False),
                    "legacy": D.VerifyReply(blocks=0, bad=[], unchecked=True),
                    "broken": errno.EACCES})
    o = dense(5, 0, 4 * U)
    _verify_all(fk, [("old", o), ("old", o), ("good", o), ("bad", o), ("legacy", o),
                     ("broken", o)])
    rep = fk.report
    assert fk.asked.count("old") == 1  # ENOSYS once: that server is not asked again
    assert rep.notes == ["data server old: checksums not verified (server does not "
                         "support verify)"]
    assert kinds(rep.problems) == [("checksum", 5, 0, "bad"), ("unchecked", 5, 0, "legacy")]
    assert next(p.bad for p in rep.problems if p.kind == "checksum") == [65536]
    assert len(rep.errors) == 1 and "broken" in rep.errors[0]
    assert rep.verified == 3 and rep.exit_code == 2


def test_rate_limits_the_bytes_verified() -> None:
    async def main() -> float:
        r = Rate(10 << 20)
        t0 = trio.current_time()
        for _ in range(3):
            await r.take(1 << 20)
        return trio.current_time() - t0

    assert trio.run(main) >= 0.25


def test_damage_not_found_again_is_dropped() -> None:
    """A file created (or deleted) while the scan ran looks damaged once; fsck looks
    at each damaged inode again and keeps only what it finds twice."""
    class Again(_FakeFsck):
        async def _recheck(self, ino: int) -> list[Problem] | None:
            return {7: [], 5: [Problem("missing", 5, 1, "b", "")], 9: None}[ino]

    fk = Again({})
    fk.report.problems = [Problem("orphan", 7, 0, "a", ""), Problem("missing", 5, 1, "b", ""),
                          Problem("short", 9, 0, "a", ""),
                          Problem("checksum", 7, 0, "a", "", bad=[0])]
    trio.run(fk._confirm)
    assert kinds(fk.report.problems) == [("checksum", 7, 0, "a"), ("missing", 5, 1, "b"),
                                         ("short", 9, 0, "a")]


class _Meta:
    """A metaserver of one file, inode 5, striped over "a" and "ghost" (unregistered)."""

    layout = {"unit": U, "count": 2, "replicas": 1, "servers": [["a"], ["ghost"]]}

    async def servers(self) -> dict[str, Any]:
        return {"a": {"alive": True, "host": "h", "port": 1}}

    async def request(self, msg: RequestMessage) -> Any:
        if isinstance(msg, M.ScanCap):
            return M.CapReply(cap=b"c", cap_ttl=300)
        if isinstance(msg, M.ScanInodes):
            rows = [[5, 4 * U, self.layout]] if msg.after < 5 else []
            return M.ScanInodesReply(inodes=rows, next=5, end=True)
        assert isinstance(msg, M.ScanDeleting)
        return M.ScanDeletingReply(entries=[], next=0, end=True)

    async def readdir(self, ino: int, cookie: int, limit: int, cred: Any = None
                      ) -> tuple[list[Any], bool]:
        return [], True


class _Data:
    async def send(self, sid: str, msg: RequestMessage) -> Any:
        assert sid == "a"
        if isinstance(msg, D.Verify):
            raise OSError(errno.ENOSYS, "dataserver: unknown method 'verify'")
        assert isinstance(msg, D.ListObjects)
        objs = [[5, 0, 2 * U, 2 * U], [8, 0, 10, 4096]]
        return SimpleNamespace(fields={"objects": [o for o in objs if msg.after is None
                                                   or tuple(o[:2]) > msg.after], "end": True})


def test_a_run_over_fake_servers() -> None:
    client = SimpleNamespace(meta=_Meta(), data=_Data())
    rep = trio.run(Fsck(client).run)  # type: ignore[arg-type]
    # stripe 1 lives on a server nobody registered: unreachable, not "missing"
    assert rep.unreachable == {"ghost": "named by a layout but not registered"}
    assert kinds(rep.problems) == [("orphan", 8, 0, "a")]
    assert rep.notes == ["data server a: checksums not verified (server does not support "
                         "verify)"]
    assert (rep.files, rep.objects, rep.exit_code) == (1, 2, 2)


def test_objects_queued_for_deletion_are_not_orphans() -> None:
    class Queued(_Meta):
        async def request(self, msg: RequestMessage) -> Any:
            if isinstance(msg, M.ScanDeleting):
                # the first queue entry has sequence number 0
                layout = {"unit": U, "count": 1, "replicas": 1, "servers": [["a"]]}
                return M.ScanDeletingReply(entries=[[0, 8, layout]], next=1, end=True)
            return await super().request(msg)

    rep = trio.run(Fsck(SimpleNamespace(meta=Queued(), data=_Data())).run)  # type: ignore[arg-type]
    assert rep.problems == []
