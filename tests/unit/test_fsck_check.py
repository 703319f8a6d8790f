"""pfs fsck's classification, on fake listings: orphans, missing and short objects, holes
of sparse files, replicas as evidence, servers that could not be listed."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio

from pfs.tools.fsck import Report
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
